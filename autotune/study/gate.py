"""The memory gate: which configurations are predicted not to fit, before any launch, at the cost of few estimates.

At the start of a run the gate plans. When even the hungriest configuration
of the space is predicted to fit with room to spare, no configuration needs an
estimate. Otherwise the micro batch is capped at the largest that fits with
the space's most frugal choices, and every other configuration is judged
before it may launch, as cheaply as the answer allows:

1. a figure already known: a fake step of this configuration (cached in the
   study's trials), or two fake steps of its class (everything but the micro
   batch) between which its micro batch lies: the peak is affine in the
   micro batch, so the line through them bounds it from above;
2. the memory order (:mod:`autotune.study.memory_order`): needing at least as
   much as a configuration known not to fit, or no more than one known to fit
   (measured, or predicted with the margin's high side);
3. only then a fake step (:mod:`autotune.worker.fake_step`), of the micro batch
   asked for when it is the space's smallest or largest, else of both ends.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import optuna
from optuna.trial import TrialState

from autotune.config import FsdpConfig
from autotune.config.dimensions import extreme_fields
from autotune.study.fake_step_cache import FakeStepFigures
from autotune.study.margin import Margin, calibrated_margin, fit_chance
from autotune.study.memory_order import Witnesses
from autotune.study.peak_model import PeakModel
from autotune.study.record import Attr, measured_samples, set_constraint
from autotune.study.space import SearchSpace
from autotune.units import format_bytes

# The hungriest configuration must fit with this much room before per-trial
# estimates are skipped.
SAFETY = 1.25
# Below this chance to fit by the rough model, a candidate waits for likelier ones.
UNLIKELY = 0.2


class Estimator(Protocol):
    """What the gate needs of an estimator: ``EstimatorClient``, or a replay of recorded predictions."""

    def estimate(self, cfg: FsdpConfig) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass
class GatePlan:
    """What the gate decided at the start of the run; the summary reads it."""

    # Per-configuration estimates are made (False: off, failed, or all fit).
    active: bool = False
    # Even the hungriest configuration is predicted to fit with room to spare.
    all_fit: bool = False
    # The largest micro batch predicted to fit (0: none does); None: no cap.
    mbs_cap: int | None = None
    # The most frugal configuration at the smallest micro batch tried, and its predicted device peak.
    frugal: tuple[FsdpConfig, int] | None = None
    note: str = ""
    # Fake steps run (their seconds, and the seconds the search waited for them),
    # and configurations judged by the memory order, without one.
    fake_steps: int = 0
    fake_step_s: float = 0.0
    estimate_wait_s: float = 0.0
    judged_free: int = 0


@dataclass(frozen=True)
class Cores:
    """Where fake steps may run: how many at once before any trial (every core
    is idle then), and, while trials run, on the cores no trial uses, or, on a
    host whose trials take every core, on theirs while no trial times steps."""

    idle: int = 1
    spare: tuple[int, ...] = ()
    # Without spare cores: the timing lock under which estimates share the
    # trials' cores (ExecutionSettings.timing_lock); None: no sharing.
    timing_lock: str | None = None


@dataclass(frozen=True)
class FitVerdict:
    """The gate's judgement of one configuration."""

    chance: float
    reason: str | None = None
    prediction: dict[str, Any] | None = None
    device_peak: int | None = None


class MemoryGate:
    """Predicts each configuration's peak and refuses those over budget."""

    def __init__(self, study: optuna.Study, space: SearchSpace, layer_classes: tuple[str, ...], budget_bytes: int,
                 device_type: str, estimator: Estimator | None, say: Callable[[str], None],
                 cores: Cores | None = None) -> None:
        self.study, self.space, self.layer_classes = study, space, layer_classes
        self.budget_bytes, self.device_type = budget_bytes, device_type
        self.estimator = estimator
        self.say = say
        self.cores = cores or Cores()
        self.plan = GatePlan()
        micro_batches = space.choices.get("micro_batch_size", (FsdpConfig.micro_batch_size,))
        self.figures = FakeStepFigures(estimator, micro_batches, say)
        self.witnesses = Witnesses()
        self.model = PeakModel()
        self._seen_trials = -1
        self._margin: Margin | None = None
        # Trials on several device slots finish in threads of their own, and each refreshes: one refresh at a time,
        # so that none finds the trials counted and the margin not yet set (it returned None, and a trial failed).
        self._refresh_lock = threading.Lock()

    def start(self) -> GatePlan:
        """Plan the run (see the module's docstring and :func:`plan_run`)."""
        return plan_run(self)

    def check(self, trial: optuna.Trial, cfg: FsdpConfig) -> str | None:
        """Why ``cfg`` is predicted not to fit (recording the prediction and a
        positive constraint on ``trial``), or None to let it launch."""
        verdict = self.judge(cfg)
        assert verdict is not None  # judged with estimates, it always has an answer
        record_verdict(trial, verdict, self.margin().source, self.budget_bytes)
        return verdict.reason

    def fit_chance(self, cfg: FsdpConfig) -> tuple[float, str | None]:
        """How likely ``cfg`` fits (1: predicted to; 0: predicted not to, with the reason)."""
        verdict = self.judge(cfg)
        assert verdict is not None  # judged with estimates, it always has an answer
        return verdict.chance, verdict.reason

    def probably_over(self, cfg: FsdpConfig) -> bool:
        """Whether the rough model of the fake steps so far (:mod:`autotune.study.peak_model`)
        gives ``cfg`` under a 20% chance to fit: not worth a fake step before likelier ones."""
        self.model.fit(list(self.figures.points))
        chance = self.model.chance_to_fit(cfg,
                                          int((self.budget_bytes - self.margin().fixed_bytes) / self.margin().factor))
        return chance is not None and chance < UNLIKELY

    def free_chance(self, cfg: FsdpConfig) -> tuple[float, str | None] | None:
        """:meth:`fit_chance` when it needs no fake step, else None."""
        verdict = self.judge(cfg, estimate=False)
        return None if verdict is None else (verdict.chance, verdict.reason)

    def judge(self, cfg: FsdpConfig, estimate: bool = True) -> FitVerdict | None:
        """The chance ``cfg`` fits, judged as cheaply as the answer allows (see the
        module's docstring); None when that takes a fake step and ``estimate`` is off."""
        if not self.plan.active:
            return FitVerdict(1.0)
        if self.plan.mbs_cap is not None and cfg.micro_batch_size > self.plan.mbs_cap:
            cap = self.plan.mbs_cap or "every choice"
            return FitVerdict(0.0, f"micro_batch_size {cfg.micro_batch_size} is above {cap}, the largest that may fit "
                                   "even with the most frugal choices of the space")
        known = self.figures.known(cfg)
        if known is None:
            ordered = self.witnesses.judge(cfg)
            if ordered is not None:
                self.plan.judged_free += 1
                return FitVerdict(*ordered)
            if not estimate:
                return None
        prediction = known or self.prediction(cfg)
        if prediction is None:
            return FitVerdict(1.0)
        return self._verdict(cfg, prediction)

    def _verdict(self, cfg: FsdpConfig, prediction: dict[str, Any]) -> FitVerdict:
        margin = self.margin()
        tensor, method = prediction["peak_bytes"], prediction.get("method")
        device_peak = margin.apply(tensor)
        chance = fit_chance(margin, tensor, self.budget_bytes, method)
        if chance >= 1.0:
            self.witnesses.fits(cfg, measured=False)
        if chance > 0.0:
            return FitVerdict(chance, None, prediction, device_peak)
        self.witnesses.over(cfg, f"predicted at {format_bytes(device_peak)}", measured=False)
        return FitVerdict(0.0,
                          f"predicted peak {format_bytes(device_peak)} ({method}, margin: {margin.source}) is over the "
                            f"budget {format_bytes(self.budget_bytes)}, even at the estimate's low side "
                            f"{format_bytes(margin.lowest(tensor, method))}", prediction, device_peak)

    def prefetch(self, configs: list[FsdpConfig]) -> None:
        """Make the fake steps ``configs`` need now, on every core (before any trial runs)."""
        self.figures.prefetch(configs, self.cores.idle)
        self._count_steps()

    def speculate(self, configs: list[FsdpConfig]) -> None:
        """Make the fake steps ``configs`` need in the background (see :class:`Cores`):
        the search hands in what it may propose next, for its next proposal."""
        if self.estimator is not None and (self.cores.spare or self.cores.timing_lock) and self.plan.active:
            self.figures.speculate(configs, self.cores.spare, None if self.cores.spare else self.cores.timing_lock)

    def _count_steps(self) -> None:
        self.plan.fake_steps, self.plan.fake_step_s = self.figures.steps, round(self.figures.seconds, 3)
        self.plan.estimate_wait_s = round(self.figures.waited_s, 3)

    def prediction(self, cfg: FsdpConfig) -> dict[str, Any] | None:
        """The fake-step figure of ``cfg``: known, interpolated in its class, or estimated now."""
        figure = self.figures.get(cfg)
        self._count_steps()
        return figure

    def refresh(self) -> None:
        """Take in the study's measured trials (the runner calls it after each trial): they are the
        surest witnesses of the memory order, and they calibrate the margin."""
        with self._refresh_lock:
            trials = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if len(trials) == self._seen_trials:
                return
            self.witnesses.take_measured(trials)
            margin = calibrated_margin(measured_samples(self.study, self.budget_bytes), self.device_type)
            if margin != self._margin:
                # Predictions judged with the old margin are judged again from their figures.
                self._margin = margin
                self.witnesses.forget_predicted()
            self._seen_trials = len(trials)

    def margin(self) -> Margin:
        """The device margin, calibrated on this study's measured, launched trials (as of the last :meth:`refresh`)."""
        if self._margin is None:
            self.refresh()
        assert self._margin is not None  # refresh sets it
        return self._margin

    def close(self) -> None:
        self.figures.join()
        self._count_steps()
        if self.estimator is not None:
            self.estimator.close()
            self.estimator = None
            self.figures.estimator = None


def plan_needs(gate: MemoryGate) -> list[FsdpConfig]:
    """The fake steps the plan makes (:func:`plan_run`): the hungriest configuration, and the most frugal one at
    the smallest and largest micro batch."""
    frugal = frugal_config(gate.space, gate.layer_classes)
    return [hungriest_config(gate.space, gate.layer_classes), *(frugal.replace(micro_batch_size=m)
                                                               for m in gate.figures.ends)]


def plan_run(gate: MemoryGate) -> GatePlan:
    """Is every configuration predicted to fit with room to spare (then none needs an
    estimate), and what is the largest micro batch that may fit at all?"""
    plan = gate.plan
    if gate.estimator is None:
        return plan
    gate.refresh()
    gate.figures.load(gate.study)
    hungriest = hungriest_config(gate.space, gate.layer_classes)
    # No trial runs yet: the plan's fake steps share every core.
    gate.prefetch(plan_needs(gate))
    prediction = gate.prediction(hungriest)
    plan.active = True
    if prediction is None:
        return plan  # each configuration is still judged on its own
    if gate.margin().apply(prediction["peak_bytes"]) * SAFETY <= gate.budget_bytes:
        plan.note = (f"even {hungriest.describe()} is predicted at {format_bytes(prediction['peak_bytes'])}, "
                     "well within the budget; no configuration needs an estimate.")
        gate.say(f"Memory estimate: {plan.note}")
        plan.active, plan.all_fit = False, True
        gate.close()
        return plan
    plan.mbs_cap = largest_micro_batch(gate)
    if plan.frugal is not None:
        gate.say(f"Memory estimate: the largest micro batch that may fit is {plan.mbs_cap or 'none'} "
                 f"(with {plan.frugal[0].describe()}).")
    return plan


def largest_micro_batch(gate: MemoryGate) -> int | None:
    """The largest micro batch that may fit with the space's most frugal choices
    (0: none; None: not estimated), recording that configuration in the plan."""
    frugal = frugal_config(gate.space, gate.layer_classes)
    for mbs in sorted(gate.figures.micro_batches, reverse=True):
        cfg = frugal.replace(micro_batch_size=mbs)
        prediction = gate.prediction(cfg)
        if prediction is None:
            return None  # no estimate, no cap: every configuration gets launched
        gate.plan.frugal = (cfg, gate.margin().apply(prediction["peak_bytes"]))
        # The cap keeps every micro batch that may fit: the search weighs the doubtful ones.
        if gate.margin().lowest(prediction["peak_bytes"], prediction.get("method")) <= gate.budget_bytes:
            return mbs
    return 0


def record_verdict(trial: optuna.Trial, verdict: FitVerdict, margin_source: str, budget_bytes: int) -> None:
    """What the gate said of a trial's configuration, on the trial: its chance to
    fit, its prediction and, when it does not fit, a positive constraint."""
    if verdict.chance < 1.0:
        trial.set_user_attr(Attr.FIT_CHANCE, round(verdict.chance, 3))
    if verdict.prediction is not None:
        trial.set_user_attr(Attr.PREDICTED_PEAK_BYTES, verdict.prediction["peak_bytes"])
        trial.set_user_attr(Attr.PREDICTED_DEVICE_PEAK_BYTES, verdict.device_peak)
        trial.set_user_attr(Attr.PREDICTED_BREAKDOWN, verdict.prediction.get("breakdown", {}))
        trial.set_user_attr(Attr.PREDICTION_METHOD, verdict.prediction.get("method"))
        trial.set_user_attr(Attr.PREDICTION_MARGIN, margin_source)
    if verdict.reason is not None:
        # Infeasible for the sampler too, by the predicted amount.
        set_constraint(trial, float(verdict.device_peak - budget_bytes) if verdict.device_peak else 1.0)


def hungriest_config(space: SearchSpace, layer_classes: tuple[str, ...]) -> FsdpConfig:
    """The space's choices that cost most memory, each dimension's as it declares
    (no sharding, one unit, fp32, no checkpointing or offload, prefetch on, the largest micro batch)."""
    return FsdpConfig(**extreme_fields(space.choices, hungriest=True), transformer_layer_cls=layer_classes)


def frugal_config(space: SearchSpace, layer_classes: tuple[str, ...]) -> FsdpConfig:
    """The space's choices that cost least memory, each dimension's as it declares: full sharding, per-layer
    units, bf16, full checkpointing, CPU offload where the space offers it (a cap planned without it would
    rule out offloaded configurations that fit; where the host cannot offload, it is only looser)."""
    return FsdpConfig(**extreme_fields(space.choices, hungriest=False), transformer_layer_cls=layer_classes)
