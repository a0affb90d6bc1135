"""The objective: one Optuna trial is draw, gate, claim, launch, record.

Every outcome is kept as data. A configuration the host cannot run, or one
predicted over budget, is never launched (PRUNED, with its reason); one
already measured is reused; an out-of-memory trial is COMPLETE with a
positive constraint, so the sampler learns what does not fit; a crash or a
timeout is a FAIL with its cause.

The launch, the memory gate and the claims are handed in, so tests and the
search-efficiency replay substitute them without patching.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config import FsdpConfig, Status, TrialRequest, TrialResult
from autotune.interrupts import Interrupted
from autotune.launch.host import HostInfo, ModelInfo, host_incompatibility
from autotune.launch.launcher import LaunchOutcome
from autotune.launch.locks import device_slot
from autotune.study.claims import Claims, runner_identity
from autotune.study.equivalence import Topology, canonical
from autotune.study.optuna_internals import fixed_params
from autotune.study.gate import MemoryGate
from autotune.study.margin import Margin, line_peak_check
from autotune.study.settings import RunSettings
from autotune.study.record import (
    CONSTRAINT_KEY, Attr, Cause, best_search_trial, copy_measurement, crash_signature, first_line, set_constraint,
    value_of, write_extrapolated, write_failure, write_measurement, write_memory,
)  # fmt: skip
from autotune.study.progress import Reporter
from autotune.study.baseline import as_params
from autotune.study.planned_sampler import PlannedSampler
from autotune.study.search import ModelSearch
from autotune.study.space import SearchSpace
from autotune.study.speed_checks import SpeedWatch
from autotune.study.depth_setting import DepthMode, TrialDepth
from autotune.study.trial_depth import DepthPlan, StudyDepth
from autotune.units import format_bytes

# A trial whose first timed steps run below best / ABORT_FACTOR stops there: at
# half the best speed it cannot win, whatever the noise (a few percent), and on
# CPU a slow precision can cost ten times a fast one.
ABORT_FACTOR = 2.0

# One torchrun job: (request, trial folder, device slot) -> how it ended.
LaunchFn = Callable[[TrialRequest, Path, tuple[int, ...]], LaunchOutcome]


class TrialFailed(Exception):
    """A trial that crashed or timed out; Optuna records it as FAIL and goes on."""


@dataclass
class RunCounts:
    """What this run did, for the summary and the stopping rules."""

    launched: int = 0
    pruned: int = 0
    reused: int = 0
    failed: int = 0
    aborted: int = 0
    # Launches of the confirmation round, and of a reference outside the space (not counted in ``launched``).
    confirmed: int = 0
    references: int = 0
    # Launches saved: configurations predicted over budget, never started.
    predicted_over: int = 0
    # Draws in a row that launched nothing.
    idle_draws: int = 0
    trial_wall_s: list[float] = field(default_factory=list)
    # (error signature, log path) of each launch while every launch crashed.
    crashes: list[tuple[str, str]] = field(default_factory=list)
    every_launch_crashed: bool = True
    last_crash: str = ""

    def note_launch(self, result: TrialResult, log_path: str) -> None:
        """Keep the crashes of a run in which every launch so far crashed."""
        if self.every_launch_crashed and result.status == Status.CRASH:
            self.crashes.append((crash_signature(result.error), log_path))
            self.last_crash = first_line(result.error)
        else:
            self.every_launch_crashed = False


def draw(trial: optuna.Trial, study: optuna.Study, space: SearchSpace, layer_classes: tuple[str, ...],
         search: ModelSearch | None, sampler: PlannedSampler | None, topology: Topology) -> FsdpConfig:
    """The trial's configuration, recorded on it: the one queued for it (the
    baseline, a seed, a retry, a confirmation round: it may hold values outside
    the space file), else autotune's proposal, else the Optuna sampler's draw;
    in each case the simplest member of its class (see :mod:`autotune.study.equivalence`)."""
    fixed = fixed_params(trial)
    if not fixed and search is not None and sampler is not None:
        proposal = search.propose(study)
        if proposal is None:
            reason = "every configuration of the space that can run here is measured or ruled out"
            trial.set_user_attr(Attr.PRUNE_REASON, reason)
            raise optuna.TrialPruned(reason)
        sampler.plan(trial.number, proposal)
        fixed = as_params(proposal)
    drawn = space.suggest(trial, layer_classes, fixed)
    cfg = canonical(drawn, topology)
    if cfg != drawn:
        trial.set_user_attr(Attr.DRAWN_AS, drawn.describe())
    trial.set_user_attr(Attr.CONFIG, cfg.to_dict())
    return cfg


def record_out_of_memory(trial: optuna.Trial, result: TrialResult, budget_bytes: int) -> str:
    """An infeasible trial, with the figure it reached and the cap it could not stay under; its line."""
    write_failure(trial, result, Cause.OOM)
    write_memory(trial, result)
    trial.set_user_attr(Attr.FITS_BUDGET, False)
    peak = int(result.peak_memory_bytes or 0)
    if peak:
        trial.set_user_attr(Attr.PEAK_MEMORY_BYTES, peak)
    set_constraint(trial, float(max(peak - budget_bytes, 1)))
    reached = f", having reached {format_bytes(peak)}" if peak else ""
    under = f" under its cap of {format_bytes(result.memory_cap_bytes)}" if result.memory_cap_bytes else ""
    return f"out of memory on rank {result.failed_rank}{under}{reached}: infeasible"


def trial_request(settings: RunSettings, cfg: FsdpConfig, abort_below: float | None,
                  depths: tuple[int, ...] = (), full_depth: int | None = None,
                  deepest_first: bool = False) -> TrialRequest:
    """The torchrun job of one trial of ``cfg``: the study's question, how to measure it, and its depths."""
    question, measure = settings.study, settings.measure
    return TrialRequest(fsdp=cfg, model=question.model, seq_len=question.seq_len, warmup_steps=measure.warmup_steps,
                        timed_steps=measure.timed_steps, timing_ci=measure.timing_ci,
                        timing_budget_s=measure.timing_budget_s, seed=settings.search.seed, nnodes=question.nnodes,
                        grad_accum_steps=settings.grad_accum_steps(cfg.micro_batch_size),
                        memory_budget_bytes=question.budget_bytes, timing_lock=settings.execution.timing_lock,
                        lora=question.lora,
                        depths=depths, full_depth=full_depth if depths else None, deepest_first=deepest_first,
                        abort_below_tokens_per_s=abort_below)


def _tokens_per_s(result: TrialResult) -> float:
    """The tokens/s of a result that has them (measured, or stopped early): a result without is a worker's bug."""
    if result.tokens_per_s is None:
        raise ValueError(f"a {result.status} trial result without tokens/s")
    return float(result.tokens_per_s)


def record_extrapolated(trial: optuna.Trial, result: TrialResult, budget_bytes: int, margin: Margin,
                        rate: str = "tok/s") -> str:
    """A shallow trial: its line's speed and the fit the full-depth estimate predicted, its copies' peaks against
    that estimate; its line."""
    peak = write_extrapolated(trial, result, budget_bytes)
    fit = ("fits by the estimate" if peak is None else f"predicted {format_bytes(peak)}, "
           + ("fits" if peak <= budget_bytes else f"OVER budget by {format_bytes(peak - budget_bytes)}"))
    copies = " and ".join(str(p["depth"]) for p in result.depth_points)
    order = trial.user_attrs.get(Attr.COPIES_ORDER)
    check = f", the middle copy {100 * result.line_check:+.1f}% off the line" if result.line_check is not None else ""
    line, predicted = trial.user_attrs.get(Attr.LINE_TENSOR_PEAK_BYTES), trial.user_attrs.get(Attr.PREDICTED_PEAK_BYTES)
    memory = ""
    if line and predicted:
        verdict = line_peak_check(line, predicted, margin, trial.user_attrs.get(Attr.PREDICTION_METHOD))
        trial.set_user_attr(Attr.LINE_PEAK_CHECK, verdict.to_dict())
        memory = f"; {verdict.describe()}"
    return (f"{result.tokens_per_s:,.0f} {rate} extrapolated from {copies} blocks"
            + (f" ({order})" if order else "") + f" to {result.full_depth}{check}, {fit}{memory}, "
            f"{trial.user_attrs[Attr.WALL_S]:.1f}s")


def record_interruption(trial: optuna.Trial, exc: KeyboardInterrupt) -> None:
    """Ctrl-C or SIGTERM during a trial (later signals are ignored, so this is recorded): Optuna marks the trial
    FAIL and re-raises."""
    name = exc.name if isinstance(exc, Interrupted) else "SIGINT"
    trial.set_user_attr(Attr.CAUSE, Cause.INTERRUPTED)
    trial.set_user_attr(Attr.ERROR, f"the tuner was stopped by {name} during this trial; it was queued to run again")


def topology_of(settings: RunSettings, model: ModelInfo) -> Topology:
    """What decides which configurations of this run are one program."""
    return Topology(settings.world_size, settings.study.nnodes, model.num_params, model.num_layers)


class Objective:
    """Called by ``study.optimize`` once per trial, in one thread per device slot."""

    def __init__(self, study: optuna.Study, settings: RunSettings, host: HostInfo, model: ModelInfo, *,
                 launch: LaunchFn, gate: MemoryGate, claims: Claims, reporter: Reporter, folder: Path,
                 search: ModelSearch | None = None, sampler: PlannedSampler | None = None,
                 speed: SpeedWatch | None = None) -> None:
        self.study, self.settings, self.host, self.model, self.folder = study, settings, host, model, folder
        self.launch, self.gate, self.claims, self.reporter = launch, gate, claims, reporter
        # Predictions before each launch, calibration after it (inert without a speed model).
        self.speed = speed or SpeedWatch(None, self.best_value)
        self.topology = topology_of(settings, model)
        # autotune's own search proposes each draw (the sampler delivers it); without it, Optuna's sampler draws.
        self.search, self.sampler = search, sampler
        # How search trials meet the model's depth (the runner hands in the study's plan).
        self.depth = StudyDepth(DepthPlan(TrialDepth(DepthMode.FULL), model.num_layers))
        self.counts = RunCounts()
        self._lock = threading.RLock()

    def __call__(self, trial: optuna.Trial) -> float:
        try:
            return self._run(trial)
        except KeyboardInterrupt as exc:
            record_interruption(trial, exc)
            raise

    def _run(self, trial: optuna.Trial) -> float:
        cfg = self._draw(trial)
        if Attr.CONFIRMATION_ROUND in trial.user_attrs:
            # A fresh re-measurement of a finalist: never reused, never stopped early.
            self._tally(confirmed=1)
            return self._launch(trial, cfg, abort=False)
        reason = host_incompatibility(cfg, self.host, self.settings.study.nnodes, self.settings.world_size)
        if reason is None:
            reason = self.gate.check(trial, cfg)
            if reason is not None:
                self._tally(predicted_over=1)
        reason = reason or self.speed.before_launch(trial, cfg, may_skip=Attr.BASELINE not in trial.user_attrs)
        if reason is not None:
            self._tally(pruned=1, idle=True)
            trial.set_user_attr(Attr.PRUNE_REASON, reason)
            self._line(trial, cfg, f"not launched: {reason}")
            raise optuna.TrialPruned(reason)
        on_wait = lambda running: self._line(  # noqa: E731
            trial, cfg, f"being measured by trial #{running.number}; waiting to reuse its result")
        previous = self.claims.claim(trial, cfg, on_wait)
        if previous is not None:
            return self._reuse(trial, cfg, previous)
        self._tally(**{"references" if trial.user_attrs.get(Attr.OUTSIDE_SPACE) else "launched": 1}, idle=False)
        return self._launch(trial, cfg)

    def _draw(self, trial: optuna.Trial) -> FsdpConfig:
        with self._lock:
            # Proposing and recording the proposal are one step: slots run in threads.
            cfg = draw(trial, self.study, self.settings.study.space, self.model.layer_classes, self.search,
                       self.sampler, self.topology)
        trial.set_user_attr(Attr.LABEL, cfg.describe())
        trial.set_user_attr(Attr.RUNNER, runner_identity())
        return cfg

    def _reuse(self, trial: optuna.Trial, cfg: FsdpConfig, previous: FrozenTrial) -> float:
        self._tally(reused=1, idle=True)
        copy_measurement(trial, previous)
        self._line(trial, cfg, f"same configuration as trial #{previous.number}, not launched again")
        if previous.state == TrialState.PRUNED:
            raise optuna.TrialPruned(previous.user_attrs.get(Attr.PRUNE_REASON, "reused"))
        if previous.state == TrialState.FAIL:
            raise TrialFailed(f"crashed before in trial #{previous.number}: {previous.user_attrs.get(Attr.ERROR)}")
        set_constraint(trial, previous.constraints.get(CONSTRAINT_KEY, 0.0))
        return value_of(previous)

    def _launch(self, trial: optuna.Trial, cfg: FsdpConfig, abort: bool = True) -> float:
        best = self.best_value()
        # The confirmation rounds measure the model as it is: the verdict is full depth's.
        depths = () if Attr.CONFIRMATION_ROUND in trial.user_attrs else self.depth.depths_for(cfg, trial)
        abort_below = best / ABORT_FACTOR if best and abort else None
        request = trial_request(self.settings, cfg, abort_below, depths, self.depth.plan.full_depth,
                                self.depth.next_deepest_first() if depths else False)
        trial_dir = self.folder / "trials" / str(trial.number)
        self.reporter.show_state(f"#{trial.number} running: {cfg.describe()}", len(self.counts.trial_wall_s), best)
        # Every trial holds its devices: other tuners on this host wait their turn.
        slots = list(self.settings.execution.slots) or [tuple(range(self.host.device_count))]
        waiting = lambda: self._line(trial, cfg, "waiting for a free device slot")  # noqa: E731
        with device_slot(self.host.device_type, slots, on_wait=waiting, names=self.host.device_uuids) as slot:
            trial.set_user_attr(Attr.DEVICES, list(slot))
            outcome = self.launch(request, trial_dir, slot)
        with self._lock:
            self.counts.trial_wall_s.append(outcome.wall_s)
        for name, value in ((Attr.STARTED_AT, outcome.started_at), (Attr.ENDED_AT, outcome.ended_at),
                            (Attr.STATUS, outcome.result.status), (Attr.TRIAL_DIR, str(trial_dir)),
                            (Attr.LOG_PATH, str(outcome.log_path)), (Attr.WALL_S, round(outcome.wall_s, 3))):
            trial.set_user_attr(name, value)
        if outcome.result.phases:
            trial.set_user_attr(Attr.PHASES, outcome.result.phases)
        return self._record(trial, cfg, outcome.result, best)

    def _record(self, trial: optuna.Trial, cfg: FsdpConfig, result: TrialResult, best: float | None) -> float:
        self._note_crash(trial, result)
        budget = self.settings.study.budget_bytes
        if result.status == Status.OK:
            self.speed.after_measure(trial, cfg, result)
        if result.status == Status.OK and result.depth_points:
            self._line(trial, cfg, record_extrapolated(trial, result, budget, self.gate.margin(), self.reporter.rate))
            self.depth.after_trial(result.depth_points, result.line_check, result.phases)
            return _tokens_per_s(result)
        if result.status == Status.OK:
            peak = write_measurement(trial, result, budget)
            fit = "fits" if peak <= budget else f"OVER budget by {format_bytes(peak - budget)}"
            self._line(trial, cfg, f"{result.tokens_per_s:,.0f} {self.reporter.rate}, peak {format_bytes(peak)} "
                                   f"({fit}), {trial.user_attrs[Attr.WALL_S]:.1f}s")
            return _tokens_per_s(result)
        if result.status == Status.ABORTED:
            self._tally(aborted=1)
            reason = (f"hopeless: {result.tokens_per_s:,.0f} {self.reporter.rate} over the first timed steps, "
                      f"under 1/{ABORT_FACTOR:g} of the best {best:,.0f}")
            trial.set_user_attr(Attr.ABORTED, True)
            trial.set_user_attr(Attr.TOKENS_PER_S_PARTIAL, result.tokens_per_s)
            trial.set_user_attr(Attr.PRUNE_REASON, reason)
            trial.report(_tokens_per_s(result), step=0)
            self._line(trial, cfg, f"stopped early, {reason}")
            raise optuna.TrialPruned(reason)
        if result.status == Status.OOM:
            # Out of memory is an answer, not a failure: it does not fit (on CUDA: not under the cap).
            self._line(trial, cfg, record_out_of_memory(trial, result, budget))
            return 0.0
        self._tally(failed=1)
        write_failure(trial, result, Cause.of(result.status))
        log = trial.user_attrs[Attr.LOG_PATH]
        self._line(trial, cfg, f"FAILED ({result.status}): {first_line(result.error)} [log: {log}]")
        raise TrialFailed(f"{result.status}: {result.error}")

    def _note_crash(self, trial: optuna.Trial, result: TrialResult) -> None:
        with self._lock:
            self.counts.note_launch(result, trial.user_attrs[Attr.LOG_PATH])

    def best_value(self) -> float | None:
        # The best the space holds (a faster reference outside it would stop every configuration as hopeless).
        best = best_search_trial(self.study)
        return best.value if best is not None else None

    def _tally(self, idle: bool | None = None, **added: int) -> None:
        """Add to this run's counts (slots run in threads); ``idle``: whether the draw launched nothing."""
        with self._lock:
            for name, amount in added.items():
                setattr(self.counts, name, getattr(self.counts, name) + amount)
            if idle is not None:
                self.counts.idle_draws = self.counts.idle_draws + 1 if idle else 0

    def _line(self, trial: optuna.Trial, cfg: FsdpConfig, text: str) -> None:
        self.reporter.trial(trial.number, cfg.describe(), text, self.counts.launched, self.best_value())
