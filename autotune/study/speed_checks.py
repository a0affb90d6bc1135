"""What a study does with its speed predictions around each launch: record the prediction beside the measurement,
learn from the measurement, and never launch a configuration predicted hopeless.

A configuration is hopeless when even the high side of its predicted interval is below the best measured so far:
the interval is the refitted profile's (:mod:`autotune.study.speed_oracle`), so this waits until the study has
measured :data:`MIN_CALIBRATION` trials to refit it on. The search leaves such configurations out before drawing
them (:class:`autotune.study.search.ModelSearch`); with one of Optuna's samplers, a drawn one is pruned with the
reason. Either way the study keeps the reason (``autotune trials`` lists both).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import optuna

from autotune.config import FsdpConfig, Status, TrialResult
from autotune.speed.prediction import SpeedPrediction
from autotune.study.record import Attr, StudyAttr
from autotune.study.speed_oracle import SpeedOracle

# Measured trials the profile is refitted on before a prediction may rule a configuration out.
MIN_CALIBRATION = 3
# At most this many skipped configurations are kept as examples in the study.
SKIPPED_EXAMPLES = 200


def hopeless_reason(prediction: SpeedPrediction | None, best: float | None, calibrated: int) -> str | None:
    """Why ``prediction`` is not worth a launch against the ``best`` tokens/s measured, or None."""
    if prediction is None or best is None or calibrated < MIN_CALIBRATION:
        return None
    if prediction.tokens_per_s_high >= best:
        return None
    return (f"predicted {prediction.tokens_per_s:,.0f} tok/s (90% interval {prediction.tokens_per_s_low:,.0f}-"
            f"{prediction.tokens_per_s_high:,.0f}, calibrated on {calibrated} trials), below the best measured "
            f"{best:,.0f} even at its high side")


class SpeedWatch:
    """The speed model's part in a study's launches (see the module); inert without an oracle."""

    def __init__(self, oracle: SpeedOracle | None, best: Callable[[], float | None]) -> None:
        self.oracle = oracle
        self.best = best
        self.skipped: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def hopeless(self, cfg: FsdpConfig) -> str | None:
        """Why ``cfg`` is predicted hopeless now, or None; a hopeless one is kept with its reason."""
        if self.oracle is None or self.oracle.calibrated < MIN_CALIBRATION:
            return None
        prediction = self.oracle.predict(cfg)
        best = self.best()
        reason = hopeless_reason(prediction, best, self.oracle.calibrated)
        if reason is not None and prediction is not None:
            with self._lock:
                self.skipped.setdefault(cfg.key(), {
                    "label": cfg.describe(), "config": cfg.to_dict(), "predicted_tokens_per_s": prediction.tokens_per_s,
                    "high": prediction.tokens_per_s_high, "best": best, "reason": reason})
        return reason

    def before_launch(self, trial: optuna.Trial, cfg: FsdpConfig, may_skip: bool = True) -> str | None:
        """Record ``cfg``'s prediction on ``trial``; why it is hopeless (only where it ``may_skip``: not the
        standard recipe, which every answer is measured against), or None to launch it."""
        if self.oracle is None:
            return None
        prediction = self.oracle.predict(cfg)
        if prediction is not None:
            trial.set_user_attr(Attr.PREDICTED_SPEED, {**prediction.to_dict(),
                                                       "calibration_trials": self.oracle.calibrated})
            trial.set_user_attr(Attr.PREDICTED_TOKENS_PER_S, round(prediction.tokens_per_s, 2))
        return self.hopeless(cfg) if may_skip else None

    def after_measure(self, trial: optuna.Trial, cfg: FsdpConfig, result: TrialResult) -> None:
        """A measured step calibrates the profile."""
        if self.oracle is not None and result.tokens_per_s and result.tokens_per_step:
            self.oracle.observe(trial.number, cfg, result.tokens_per_step / result.tokens_per_s)

    def resume(self, study: optuna.Study) -> None:
        """A resumed study's measured trials calibrate the profile as this run's will (once the speed model has
        work to predict them from: after the gate's first fake steps)."""
        from optuna.trial import TrialState

        from autotune.study.record import is_confirmation, trial_config

        if self.oracle is None or not self.oracle.known():
            return
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            cfg, tokens = trial_config(t), t.user_attrs.get(Attr.TOKENS_PER_STEP)
            if cfg is not None and tokens and t.value and not is_confirmation(t) and Attr.REUSED_FROM not in \
                    t.user_attrs and t.user_attrs.get(Attr.STATUS) == Status.OK:
                self.oracle.observe(t.number, cfg, tokens / t.value, refit_now=False)
        self.oracle.refit()

    def record(self, study: optuna.Study) -> None:
        """The speed model as it ends the run, and what it skipped, in the study."""
        if self.oracle is None:
            return
        study.set_user_attr(StudyAttr.SPEED_MODEL, self.oracle.summary())
        previous = study.user_attrs.get(StudyAttr.SKIPPED_SLOW, [])
        known = {str(entry.get("label")) for entry in previous}
        added = [entry for entry in self.skipped.values() if entry["label"] not in known]
        if added:
            study.set_user_attr(StudyAttr.SKIPPED_SLOW, (previous + added)[:SKIPPED_EXAMPLES])
