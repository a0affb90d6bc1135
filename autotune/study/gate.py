"""The memory gate: which configurations are predicted not to fit, before any launch.

At the start of a run the gate plans. When even the hungriest configuration
of the space is predicted to fit with room to spare, no configuration needs an
estimate. Otherwise the micro batch is capped at the largest that fits with
the space's most frugal choices, and every other configuration is estimated
(a fake training step, cached in the study's trials) before it may launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import optuna
from optuna.trial import TrialState

from autotune.config import FsdpConfig
from autotune.study.margin import Margin, calibrated_margin, fit_chance, memory_key
from autotune.study.record import Attr, set_constraint, trial_config
from autotune.study.space import SearchSpace
from autotune.units import format_bytes

# The hungriest configuration must fit with this much room before per-trial
# estimates are skipped.
SAFETY = 1.25


class Estimator(Protocol):
    """What the gate needs of an estimator: ``EstimatorClient``, or a replay of recorded predictions."""

    def estimate(self, cfg: FsdpConfig) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass
class GatePlan:
    """What the gate decided at the start of the run; the summary reads it."""

    # Per-configuration estimates are made (False: off, failed, or all fit).
    active: bool = False
    # The largest micro batch predicted to fit (0: none does); None: no cap.
    mbs_cap: int | None = None
    # The most frugal configuration at the smallest micro batch tried, and its predicted device peak.
    frugal: tuple[FsdpConfig, int] | None = None
    note: str = ""


class MemoryGate:
    """Predicts each configuration's peak and refuses those over budget."""

    def __init__(self, study: optuna.Study, space: SearchSpace, layer_classes: tuple[str, ...], budget_bytes: int,
                 device_type: str, estimator: Estimator | None, say: Callable[[str], None]) -> None:
        self.study, self.space, self.layer_classes = study, space, layer_classes
        self.budget_bytes, self.device_type = budget_bytes, device_type
        self.estimator = estimator
        self.say = say
        self.plan = GatePlan()
        self._predictions: dict[str, dict[str, Any]] = {}

    def start(self) -> GatePlan:
        """Plan the run (see the module's docstring)."""
        if self.estimator is None:
            return self.plan
        hungriest = hungriest_config(self.space, self.layer_classes)
        prediction = self.prediction(hungriest)
        self.plan.active = True
        if prediction is None:
            return self.plan  # each configuration is still estimated on its own
        if self.margin().apply(prediction["peak_bytes"]) * SAFETY <= self.budget_bytes:
            self.plan.note = (f"even {hungriest.describe()} is predicted at {format_bytes(prediction['peak_bytes'])}, "
                              "well within the budget; no configuration needs an estimate.")
            self.say(f"Memory estimate: {self.plan.note}")
            self.plan.active = False
            self.close()
            return self.plan
        self.plan.mbs_cap = self._largest_micro_batch()
        if self.plan.frugal is not None:
            self.say(f"Memory estimate: the largest micro batch that may fit is {self.plan.mbs_cap or 'none'} "
                     f"(with {self.plan.frugal[0].describe()}).")
        return self.plan

    def _largest_micro_batch(self) -> int | None:
        frugal = frugal_config(self.space, self.layer_classes)
        for mbs in sorted(self.space.choices.get("micro_batch_size", (1,)), reverse=True):
            cfg = frugal.replace(micro_batch_size=mbs)
            prediction = self.prediction(cfg)
            if prediction is None:
                return None  # no estimate, no cap: every configuration gets launched
            self.plan.frugal = (cfg, self.margin().apply(prediction["peak_bytes"]))
            # The cap keeps every micro batch that may fit: the search weighs the doubtful ones.
            if self.margin().lowest(prediction["peak_bytes"], prediction.get("method")) <= self.budget_bytes:
                return mbs
        return 0

    def check(self, trial: optuna.Trial, cfg: FsdpConfig) -> str | None:
        """Why ``cfg`` is predicted not to fit (recording the prediction and a
        positive constraint on ``trial``), or None to let it launch."""
        reason, prediction, device_peak, chance = self._judge(cfg)
        if chance < 1.0:
            trial.set_user_attr(Attr.FIT_CHANCE, round(chance, 3))
        if prediction is not None:
            trial.set_user_attr(Attr.PREDICTED_PEAK_BYTES, prediction["peak_bytes"])
            trial.set_user_attr(Attr.PREDICTED_DEVICE_PEAK_BYTES, device_peak)
            trial.set_user_attr(Attr.PREDICTED_BREAKDOWN, prediction.get("breakdown", {}))
            trial.set_user_attr(Attr.PREDICTION_METHOD, prediction.get("method"))
            trial.set_user_attr(Attr.PREDICTION_MARGIN, self.margin().source)
        if reason is not None:
            # Infeasible for the sampler too, by the predicted amount.
            set_constraint(trial, float(device_peak - self.budget_bytes) if device_peak else 1.0)
        return reason

    def fit_reason(self, cfg: FsdpConfig) -> str | None:
        """Why ``cfg`` is predicted not to fit, or None: for choosing among configurations before any trial."""
        return self._judge(cfg)[0]

    def fit_chance(self, cfg: FsdpConfig) -> tuple[float, str | None]:
        """How likely ``cfg`` fits (1: predicted to; 0: predicted not to, with the reason)."""
        reason, _, _, chance = self._judge(cfg)
        return chance, reason

    def _judge(self, cfg: FsdpConfig) -> tuple[str | None, dict[str, Any] | None, int | None, float]:
        """(reason or None, the prediction if one was made, the predicted device peak, the chance it fits)."""
        if not self.plan.active:
            return None, None, None, 1.0
        if self.plan.mbs_cap is not None and cfg.micro_batch_size > self.plan.mbs_cap:
            return (f"micro_batch_size {cfg.micro_batch_size} is above {self.plan.mbs_cap or 'every choice'}, the largest "
                    "that may fit even with the most frugal choices of the space"), None, None, 0.0
        prediction = self.prediction(cfg)
        if prediction is None:
            return None, None, None, 1.0
        margin = self.margin()
        device_peak = margin.apply(prediction["peak_bytes"])
        chance = fit_chance(margin, prediction["peak_bytes"], self.budget_bytes, prediction.get("method"))
        if chance > 0.0:
            return None, prediction, device_peak, chance
        return (f"predicted peak {format_bytes(device_peak)} ({prediction.get('method')}, margin: {margin.source}) "
                f"is over the budget {format_bytes(self.budget_bytes)}, even at the estimate's low side "
                f"{format_bytes(margin.lowest(prediction['peak_bytes'], prediction.get('method')))}"), prediction, device_peak, chance

    def prediction(self, cfg: FsdpConfig) -> dict[str, Any] | None:
        """The fake-step estimate of ``cfg``, from the study's trials when one has it."""
        key = memory_key(cfg)
        for t in self.study.get_trials(deepcopy=False):
            if t.user_attrs.get(Attr.PREDICTED_PEAK_BYTES) and trial_config(t) and memory_key(trial_config(t)) == key:
                return {"peak_bytes": t.user_attrs[Attr.PREDICTED_PEAK_BYTES],
                        "method": t.user_attrs.get(Attr.PREDICTION_METHOD),
                        "breakdown": t.user_attrs.get(Attr.PREDICTED_BREAKDOWN, {}), "cached_from": t.number}
        if key not in self._predictions:
            result = self.estimator.estimate(cfg)
            if "error" in result:
                self.say(f"(memory estimate failed for {cfg.describe()}: {result['error']}; it will be launched)")
                return None
            self._predictions[key] = result
        return self._predictions[key]

    def margin(self) -> Margin:
        """The device margin, calibrated on this study's measured, launched trials."""
        pairs = [(t.user_attrs[Attr.PEAK_MEMORY_BYTES], t.user_attrs[Attr.PREDICTED_PEAK_BYTES],
                  t.user_attrs.get(Attr.PREDICTION_METHOD))
                 for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                 if t.user_attrs.get(Attr.PREDICTED_PEAK_BYTES) and t.user_attrs.get(Attr.STATUS) == "ok"
                 and Attr.REUSED_FROM not in t.user_attrs]
        return calibrated_margin(pairs, self.device_type)

    def close(self) -> None:
        if self.estimator is not None:
            self.estimator.close()
            self.estimator = None


def _first_offered(space: SearchSpace, name: str, preference: tuple) -> Any:
    """The space's choice for ``name`` that comes first in ``preference``."""
    options = space.choices.get(name, (getattr(FsdpConfig, name),))
    return next((o for o in preference if o in options), options[0])


def hungriest_config(space: SearchSpace, layer_classes: tuple[str, ...]) -> FsdpConfig:
    """The space's choices that cost most memory: no sharding, one unit, fp32,
    no checkpointing or offload, prefetch on, the largest micro batch."""
    version = _first_offered(space, "fsdp_version", (2, 1))
    return FsdpConfig(
        fsdp_version=version,
        sharding_strategy=_first_offered(space, "sharding_strategy", ("NO_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2", "HYBRID_SHARD", "FULL_SHARD")),
        auto_wrap_policy=_first_offered(space, "auto_wrap_policy", ("none", "size_based", "transformer_layer")),
        min_num_params=max(space.choices.get("min_num_params", (FsdpConfig.min_num_params,))),
        mixed_precision=_first_offered(space, "mixed_precision", ("fp32", "bf16_fp32_reduce", "fp16", "bf16")),
        activation_checkpointing=_first_offered(space, "activation_checkpointing", ("none", "selective", "every_other_layer", "full")),
        forward_prefetch=_first_offered(space, "forward_prefetch", (True, False)),
        backward_prefetch=_first_offered(space, "backward_prefetch", ("BACKWARD_PRE", "BACKWARD_POST", "none")) if version == 1 else "BACKWARD_PRE",
        micro_batch_size=max(space.choices.get("micro_batch_size", (1,))),
        transformer_layer_cls=layer_classes,
    )


def frugal_config(space: SearchSpace, layer_classes: tuple[str, ...]) -> FsdpConfig:
    """The space's choices that cost least memory (but CPU offload, which the
    host may not run): full sharding, per-layer units, bf16, full checkpointing."""
    return FsdpConfig(
        fsdp_version=_first_offered(space, "fsdp_version", (2, 1)),
        sharding_strategy=_first_offered(space, "sharding_strategy", ("FULL_SHARD", "HYBRID_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2", "NO_SHARD")),
        auto_wrap_policy=_first_offered(space, "auto_wrap_policy", ("transformer_layer", "size_based", "none")),
        min_num_params=min(space.choices.get("min_num_params", (FsdpConfig.min_num_params,))),
        mixed_precision=_first_offered(space, "mixed_precision", ("bf16", "fp16", "bf16_fp32_reduce", "fp32")),
        activation_checkpointing=_first_offered(space, "activation_checkpointing", ("full", "every_other_layer", "selective", "none")),
        transformer_layer_cls=layer_classes,
    )
