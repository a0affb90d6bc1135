"""The Optuna study: draw a configuration, launch it (or don't), record what happened.

Every outcome is kept as data. A configuration the host cannot run, or one
already measured, is never launched; an over-budget or out-of-memory trial is
a COMPLETE trial with a positive memory constraint, so the sampler learns what
does not fit; a crash or timeout is a FAIL with its cause. Nothing here
imports torch: trials run in torchrun subprocesses.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune import interrupts
from autotune.config import FsdpConfig, TrialRequest, TrialResult
from autotune.errors import UsageError
from autotune.forkserver import ForkServer
from autotune.host import HostInfo, ModelInfo, host_incompatibility
from autotune.launcher import LaunchOutcome, launch_trial
from autotune.lifeline import process_alive, process_start_ticks
from autotune.locks import device_slot, exclusive
from autotune.space import SearchSpace
from autotune.storage import open_storage, sqlite_path, study_dir
from autotune.units import format_bytes

METRIC_NAME = "tokens_per_s"
CONSTRAINT_KEY = "peak_memory_over_budget"
# A trial whose first timed steps run below best / ABORT_FACTOR stops there: at
# half the best speed it cannot win, whatever the noise (a few percent), and on
# CPU a slow precision can cost ten times a fast one.
ABORT_FACTOR = 2.0
# Stop drawing when this many draws in a row launch nothing (all pruned or
# already measured): the sampler has nothing new left to propose.
MAX_IDLE_DRAWS = 200
# Stop when this many launches in a row, from the first of a run, crashed with
# one and the same error while nothing in the study was ever measured: the
# model or the host is broken, not a configuration.
SAME_CRASH_LIMIT = 3


class TrialFailed(Exception):
    """A trial that crashed or timed out; Optuna records it as FAIL and goes on."""


@dataclass(frozen=True)
class RunSettings:
    model: str
    model_label: str
    nproc: int
    seq_len: int
    budget_bytes: int
    budget_text: str
    space: SearchSpace
    trials: int
    trial_timeout_s: float
    study_name: str
    storage_url: str
    seed: int = 0
    warmup_steps: int = 2
    timed_steps: int = 10
    timing_ci: float = 0.02
    nnodes: int = 1
    # Predict each configuration's peak before launch and skip those over budget.
    use_estimate: bool = True
    quiet: bool = False
    device_type: str = "cpu"
    # Device sets a trial may run on (GPU indices, or CPU cores); one trial per
    # slot at a time, so several slots run trials side by side.
    slots: tuple[tuple[int, ...], ...] = ()


def default_study_name(model_label: str, nproc: int, seq_len: int, budget_text: str) -> str:
    return f"{model_label}-w{nproc}-s{seq_len}-{budget_text}"


def baseline_config(host: HostInfo, layer_classes: tuple[str, ...], space: SearchSpace | None = None) -> FsdpConfig:
    """The commonly recommended starting point: SHARD_GRAD_OP, one FSDP unit per
    transformer layer, bf16 where the device runs it fast, else fp32; at the
    space's smallest micro batch (the micro batch is the user's workload, not an
    FSDP setting, so the baseline stays within the sizes they asked for)."""
    sizes = space.choices.get("micro_batch_size", (1,)) if space is not None else (1,)
    return FsdpConfig(
        fsdp_version=2,
        sharding_strategy="SHARD_GRAD_OP",
        auto_wrap_policy="transformer_layer",
        transformer_layer_cls=layer_classes,
        mixed_precision="bf16" if host.bf16_is_fast else "fp32",
        micro_batch_size=min(sizes),
    )


def enqueue_baseline(study: optuna.Study, host: HostInfo, layer_classes: tuple[str, ...], space: SearchSpace) -> None:
    """Measure the recommended starting point first: every later trial is
    compared with it, and the early abort needs a best to compare against."""
    study.enqueue_trial(_as_params(baseline_config(host, layer_classes, space)), user_attrs={"baseline": True})


def _set_constraint(trial: optuna.Trial, violation: float) -> None:
    # Optuna 4+/5 reads "constraints:<key>"; optuna-dashboard 0.21 only reads
    # the older "constraints" list. Both are written so the two agree.
    trial.set_constraint(CONSTRAINT_KEY, violation)
    # Optuna has no public setter for system attrs any more; this is the one
    # its own set_constraint uses.
    trial.storage.set_trial_system_attr(trial._trial_id, "constraints", [violation])


def is_feasible(trial: FrozenTrial) -> bool:
    return trial.state == TrialState.COMPLETE and all(v <= 0 for v in trial.constraints.values())


def best_feasible(study: optuna.Study) -> FrozenTrial | None:
    try:
        return study.best_trial
    except ValueError:
        return None


def trial_config(trial: FrozenTrial) -> FsdpConfig | None:
    data = trial.user_attrs.get("config")
    return FsdpConfig.from_dict(data) if data else None


STUDY_IDENTITY = ("model", "nproc", "seq_len", "budget_bytes", "space_digest")


def study_identity(settings: RunSettings) -> dict[str, Any]:
    return {
        "model": settings.model,
        "nproc": settings.nproc,
        "seq_len": settings.seq_len,
        "budget_bytes": settings.budget_bytes,
        "space_digest": settings.space.digest,
    }


def check_resumable(settings: RunSettings) -> None:
    """Refuse, before anything is written, to resume a study made for other work."""
    path = sqlite_path(settings.storage_url)
    if path is not None and not path.exists():
        return
    summaries = optuna.get_all_study_summaries(open_storage(settings.storage_url), include_best_trial=False)
    summary = next((s for s in summaries if s.study_name == settings.study_name), None)
    if summary is None:
        return
    if summary.direction != optuna.study.StudyDirection.MAXIMIZE:
        raise UsageError(
            f"study {settings.study_name!r} exists with direction {summary.direction.name.lower()}, "
            "but autotune maximizes tokens/s; choose another --study-name"
        )
    stored = summary.user_attrs.get("identity", {})
    identity = study_identity(settings)
    for key in STUDY_IDENTITY:
        if key in stored and stored[key] != identity[key]:
            raise UsageError(
                f"study {settings.study_name!r} was created with {key}={stored[key]!r}, not {identity[key]!r}; "
                "rerun with the original settings or choose another --study-name"
            )


def load_or_create_study(settings: RunSettings, storage: Any) -> optuna.Study:
    """Resume the study (see :func:`check_resumable`) or create it."""
    sampler = optuna.samplers.TPESampler(
        seed=settings.seed, multivariate=True, group=True, constant_liar=True, n_startup_trials=8
    )
    names = {s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    if settings.study_name in names:
        return optuna.load_study(study_name=settings.study_name, storage=storage, sampler=sampler)
    try:
        study = optuna.create_study(
            study_name=settings.study_name, storage=storage, sampler=sampler, direction="maximize"
        )
    except optuna.exceptions.DuplicatedStudyError:
        # Another tuner created it between our look and our create: join it.
        return optuna.load_study(study_name=settings.study_name, storage=storage, sampler=sampler)
    study.set_metric_names([METRIC_NAME])
    study.set_user_attr("identity", study_identity(settings))
    study.set_user_attr("budget", settings.budget_text)
    study.set_user_attr("space_path", settings.space.path)
    return study


@dataclass
class RunCounts:
    launched: int = 0
    pruned: int = 0
    reused: int = 0
    failed: int = 0
    aborted: int = 0
    # Launches saved: configurations predicted over budget, never started.
    predicted_over: int = 0
    idle_draws: int = 0
    trial_wall_s: list[float] = field(default_factory=list)
    # (error signature, log path) of each launch of this run
    # that crashed, while every launch so far crashed.
    crashes: list[tuple[str, str]] = field(default_factory=list)
    every_launch_crashed: bool = True
    last_crash: str = ""


def first_line(error: str | None) -> str:
    text = (error or "").strip()
    return text.splitlines()[0] if text else ""


def crash_signature(error: str | None) -> str:
    """The error of a crash without which rank hit it: the same fault on rank 0
    in one trial and on rank 1 in the next is the same fault."""
    first = re.sub(r"^rank \d+ failed: ", "", first_line(error))
    return re.sub(r"\brank \d+\b", "rank ?", first)


class Tuner:
    """The objective and its bookkeeping for one ``autotune run``."""

    def __init__(self, study: optuna.Study, settings: RunSettings, host: HostInfo, model: ModelInfo) -> None:
        # Forks trial processes from pre-imported interpreters; None starts fresh ones.
        self.forks: ForkServer | None = None
        self.study = study
        self.settings = settings
        self.host = host
        self.model = model
        self.counts = RunCounts()
        # Optuna runs one objective per slot in threads; counts are shared.
        self._lock = threading.RLock()
        self.bar = None
        self.estimator = None
        self.mbs_cap = None
        self.frugal_prediction: tuple[FsdpConfig, int] | None = None
        self._predictions: dict[str, dict[str, Any]] = {}
        configs = settings.space.enumerate(model.layer_classes)
        self.space_size = len(configs)
        # Exhaustion is only worth checking for spaces a study can finish.
        self.space_keys = {c.key() for c in configs} if self.space_size <= 4 * MAX_IDLE_DRAWS else None
        self.folder = study_dir(settings.storage_url, settings.study_name)

    # -- progress -----------------------------------------------------------
    def say(self, text: str) -> None:
        """One event: to the plain log in the study folder always, to the terminal unless --quiet."""
        with self._lock:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / "run.log", "a") as log:
                log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
            if self.settings.quiet:
                return
            if self.bar is not None:
                self.bar.write(text, file=sys.stderr)
            else:
                print(text, file=sys.stderr, flush=True)

    def start_progress(self) -> None:
        """A live bar (trials launched of N, elapsed, state, best so far) when stderr is a terminal."""
        if self.settings.quiet or not sys.stderr.isatty():
            return
        from tqdm import tqdm

        self.bar = tqdm(total=self.settings.trials, desc="trials", unit="trial", file=sys.stderr, dynamic_ncols=True)

    def show_state(self, state: str) -> None:
        if self.bar is not None:
            best = self._best_value()
            with self._lock:
                self.bar.n = min(len(self.counts.trial_wall_s), self.settings.trials)
                self.bar.set_postfix_str(f"{state} | best {best:,.0f} tok/s" if best else state)

    def close_progress(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _best_value(self) -> float | None:
        best = best_feasible(self.study)
        return best.value if best is not None else None

    def _progress(self, trial: optuna.Trial, cfg: FsdpConfig, outcome: str) -> None:
        best = self._best_value()
        best_text = f" | best {best:,.0f} tok/s" if best else ""
        self.say(f"[{self.counts.launched:>3}/{self.settings.trials}] #{trial.number:<3} {cfg.describe()}: {outcome}{best_text}")

    # -- the objective ------------------------------------------------------
    def _count(self, name: str, idle: bool | None = None) -> None:
        with self._lock:
            setattr(self.counts, name, getattr(self.counts, name) + 1)
            if idle is not None:
                self.counts.idle_draws = self.counts.idle_draws + 1 if idle else 0

    def objective(self, trial: optuna.Trial) -> float:
        try:
            return self._objective(trial)
        except KeyboardInterrupt as exc:
            # Ctrl-C or SIGTERM (later signals are ignored, so this is recorded):
            # Optuna marks the trial FAIL and re-raises.
            trial.set_user_attr("cause", "interrupted")
            trial.set_user_attr("error", f"the tuner was stopped by {signal_name(exc)} during this trial; "
                                         "it was queued to run again")
            raise

    def _objective(self, trial: optuna.Trial) -> float:
        # An enqueued trial (the baseline, a retry) may hold values outside the space file.
        fixed = trial.storage.get_trial_system_attrs(trial._trial_id).get("fixed_params")
        cfg = self.settings.space.suggest(trial, self.model.layer_classes, fixed)
        trial.set_user_attr("config", cfg.to_dict())
        trial.set_user_attr("label", cfg.describe())
        trial.set_user_attr("runner", runner_identity())

        reason = host_incompatibility(cfg, self.host, self.settings.nnodes)
        if reason is None:
            reason = self._predicted_over_budget(trial, cfg)
            if reason is not None:
                self._count("predicted_over")
        if reason is not None:
            self._count("pruned", idle=True)
            trial.set_user_attr("prune_reason", reason)
            self._progress(trial, cfg, f"not launched: {reason}")
            raise optuna.TrialPruned(reason)

        while True:
            # The claim is atomic across every tuner on this host: two of them
            # drawing the same configuration measure it once.
            with exclusive(self.folder / "claims.lock"):
                previous, running = self._already_measured(cfg, trial.number)
                if previous is None and running is None:
                    trial.set_user_attr("claimed", True)
            if previous is not None:
                return self._reuse(trial, previous)
            if running is None:
                break
            self._progress(trial, cfg, f"being measured by trial #{running.number}; waiting to reuse its result")
            self._wait_for(running)

        self._count("launched", idle=False)
        return self._launch(trial, cfg)

    # -- the memory estimate ------------------------------------------------
    def start_estimator(self, estimator: Any | None = None) -> None:
        """Plan pruning: no estimates at all when even the hungriest configuration
        of the space is predicted to fit; else cap the micro batch at the largest
        predicted fit.

        ``estimator`` (anything with ``estimate(cfg)`` and ``close()``) replaces
        the fake-step subprocess: benchmarks replay recorded predictions through it.
        """
        self.estimator = None
        self.mbs_cap: int | None = None
        if not self.settings.use_estimate:
            return
        if estimator is None:
            from autotune.estimate import EstimatorClient

            estimator = EstimatorClient(self.settings.model, self.settings.nproc, self.settings.nnodes,
                                        self.settings.seq_len, timeout_s=self.settings.trial_timeout_s)
        self.estimator = estimator
        hungriest = hungriest_config(self.settings.space, self.model.layer_classes)
        prediction = self._prediction(hungriest)
        if prediction is None:
            return
        if self._margin().apply(prediction["peak_bytes"]) * SAFETY <= self.settings.budget_bytes:
            self.say(f"Memory estimate: even {hungriest.describe()} is predicted at "
                     f"{format_bytes(prediction['peak_bytes'])}, well within the budget; no configuration needs an estimate.")
            self.estimator.close()
            self.estimator = None
            return
        frugal = frugal_config(self.settings.space, self.model.layer_classes)
        for mbs in sorted(self.settings.space.choices.get("micro_batch_size", (1,)), reverse=True):
            prediction = self._prediction(frugal.replace(micro_batch_size=mbs))
            if prediction is None:
                return  # no estimate, no cap: every configuration gets launched
            self.frugal_prediction = (frugal.replace(micro_batch_size=mbs), self._margin().apply(prediction["peak_bytes"]))
            if self.frugal_prediction[1] <= self.settings.budget_bytes:
                self.mbs_cap = mbs
                break
        else:
            self.mbs_cap = 0
        self.say(f"Memory estimate: the largest micro batch predicted to fit is {self.mbs_cap or 'none'} "
                 f"(with {frugal.describe()}).")

    def close_estimator(self) -> None:
        if getattr(self, "estimator", None) is not None:
            self.estimator.close()

    def _margin(self):
        from autotune.estimate import calibrated_margin

        pairs = [(t.user_attrs["peak_memory_bytes"], t.user_attrs["predicted_peak_bytes"])
                 for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                 if t.user_attrs.get("predicted_peak_bytes") and t.user_attrs.get("status") == "ok"
                 and "reused_from" not in t.user_attrs]
        return calibrated_margin(pairs, self.host.device_type)

    def _prediction(self, cfg: FsdpConfig) -> dict[str, Any] | None:
        """The fake-step estimate of ``cfg``, from the study's cache when any trial has it."""
        from autotune.estimate import memory_key

        key = memory_key(cfg)
        for t in self.study.get_trials(deepcopy=False):
            if t.user_attrs.get("predicted_peak_bytes") and trial_config(t) and memory_key(trial_config(t)) == key:
                return {"peak_bytes": t.user_attrs["predicted_peak_bytes"], "method": t.user_attrs.get("prediction_method"),
                        "breakdown": t.user_attrs.get("predicted_breakdown", {}), "cached_from": t.number}
        cached = self._predictions.get(key)
        if cached is not None:
            return cached
        result = self.estimator.estimate(cfg)
        if "error" in result:
            self.say(f"(memory estimate failed for {cfg.describe()}: {result['error']}; it will be launched)")
            return None
        self._predictions[key] = result
        return result

    def _predicted_over_budget(self, trial: optuna.Trial, cfg: FsdpConfig) -> str | None:
        if getattr(self, "estimator", None) is None:
            return None
        if self.mbs_cap is not None and cfg.micro_batch_size > self.mbs_cap:
            reason = (f"micro_batch_size {cfg.micro_batch_size} is above {self.mbs_cap or 'every choice'}, the largest "
                      "predicted to fit even with the most frugal choices of the space")
            _set_constraint(trial, 1.0)
            return reason
        prediction = self._prediction(cfg)
        if prediction is None:
            return None
        margin = self._margin()
        device_peak = margin.apply(prediction["peak_bytes"])
        trial.set_user_attr("predicted_peak_bytes", prediction["peak_bytes"])
        trial.set_user_attr("predicted_device_peak_bytes", device_peak)
        trial.set_user_attr("predicted_breakdown", prediction.get("breakdown", {}))
        trial.set_user_attr("prediction_method", prediction.get("method"))
        trial.set_user_attr("prediction_margin", margin.source)
        if device_peak <= self.settings.budget_bytes:
            return None
        # Infeasible for the sampler too, by the predicted amount.
        _set_constraint(trial, float(device_peak - self.settings.budget_bytes))
        return (f"predicted peak {format_bytes(device_peak)} ({prediction.get('method')}, margin: {margin.source}) "
                f"is over the budget {format_bytes(self.settings.budget_bytes)}")

    def _wait_for(self, other: FrozenTrial) -> None:
        deadline = time.monotonic() + self.settings.trial_timeout_s + 60
        while time.monotonic() < deadline:
            interrupts.check()
            current = self.study._storage.get_trial(other._trial_id)
            if current.state.is_finished() or not _runner_alive(current):
                return
            time.sleep(1.0)

    def _already_measured(self, cfg: FsdpConfig, number: int) -> tuple[FrozenTrial | None, FrozenTrial | None]:
        """An earlier trial of the same configuration whose answer would not
        change (measured, stopped early as hopeless, or crashed: a crash from
        the configuration itself repeats, a timeout may not, so it is retried),
        and a live trial measuring it right now."""
        key = cfg.key()
        finished, running = None, None
        for t in self.study.get_trials(deepcopy=False):
            if t.number == number or trial_config(t) is None or trial_config(t).key() != key:
                continue
            if t.state == TrialState.RUNNING:
                if t.user_attrs.get("claimed") and _runner_alive(t):
                    running = t
                continue
            if t.state == TrialState.PRUNED and not t.user_attrs.get("aborted"):
                continue
            if t.state == TrialState.FAIL and t.user_attrs.get("cause") != "crash":
                continue
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
                finished = finished or t
        return finished, running

    def _reuse(self, trial: optuna.Trial, previous: FrozenTrial) -> float:
        self._count("reused", idle=True)
        for name, value in previous.user_attrs.items():
            # Only what was measured; not when and where that other trial ran.
            if name not in ("config", "label", "baseline", "runner", "claimed", "started_at", "ended_at", "devices", "wall_s"):
                trial.set_user_attr(name, value)
        trial.set_user_attr("reused_from", previous.number)
        self._progress(trial, trial_config(previous), f"same configuration as trial #{previous.number}, not launched again")
        if previous.state == TrialState.PRUNED:
            raise optuna.TrialPruned(previous.user_attrs.get("prune_reason", "reused"))
        if previous.state == TrialState.FAIL:
            raise TrialFailed(f"crashed before in trial #{previous.number}: {previous.user_attrs.get('error')}")
        _set_constraint(trial, previous.constraints.get(CONSTRAINT_KEY, 0.0))
        return float(previous.value)

    def _launch(self, trial: optuna.Trial, cfg: FsdpConfig) -> float:
        best = self._best_value()
        request = TrialRequest(
            fsdp=cfg,
            model=self.settings.model,
            seq_len=self.settings.seq_len,
            warmup_steps=self.settings.warmup_steps,
            timed_steps=self.settings.timed_steps,
            timing_ci=self.settings.timing_ci,
            seed=self.settings.seed,
            nnodes=self.settings.nnodes,
            abort_below_tokens_per_s=best / ABORT_FACTOR if best else None,
        )
        trial_dir = self.folder / "trials" / str(trial.number)
        self.show_state(f"#{trial.number} running: {cfg.describe()}")
        # Every trial holds its devices: other tuners on this host wait their turn.
        slots = list(self.settings.slots) or [tuple(range(self.host.device_count))]
        waiting = lambda: self._progress(trial, cfg, "waiting for a free device slot")  # noqa: E731
        with device_slot(self.host.device_type, slots, on_wait=waiting) as slot:
            trial.set_user_attr("devices", list(slot))
            outcome = self.run_trial(request, trial_dir, slot)
        with self._lock:
            self.counts.trial_wall_s.append(outcome.wall_s)
        trial.set_user_attr("started_at", outcome.started_at)
        trial.set_user_attr("ended_at", outcome.ended_at)
        result = outcome.result
        trial.set_user_attr("status", result.status)
        trial.set_user_attr("trial_dir", str(trial_dir))
        trial.set_user_attr("log_path", str(outcome.log_path))
        trial.set_user_attr("wall_s", round(outcome.wall_s, 3))
        if result.phases:
            trial.set_user_attr("phases", result.phases)
        return self._record(trial, cfg, result, best)

    def run_trial(self, request: TrialRequest, trial_dir: Path, slot: tuple[int, ...]) -> LaunchOutcome:
        """The one torchrun job; benchmarks replay a measured table through this seam."""
        return launch_trial(request, trial_dir, self.settings.nproc, self.settings.trial_timeout_s,
                            self.host.device_type, devices=slot, forks=self.forks)

    def _record(self, trial: optuna.Trial, cfg: FsdpConfig, result: TrialResult, best: float | None) -> float:
        budget = self.settings.budget_bytes
        if result.status != "crash":
            with self._lock:
                self.counts.every_launch_crashed = False
        if result.status == "ok":
            peak = int(result.peak_memory_bytes or 0)
            for name in (
                "tokens_per_s", "step_time_median_s", "step_time_p10_s", "step_time_p90_s", "step_time_cv",
                "loss_first", "loss_last", "memory_method", "world_size", "device", "device_name",
                "torch_version", "transformers_version", "num_params", "tokens_per_step",
            ):  # fmt: skip
                trial.set_user_attr(name, getattr(result, name))
            trial.set_user_attr("peak_memory_bytes", peak)
            trial.set_user_attr("peak_memory_gib", round(peak / 2**30, 4))
            trial.set_user_attr("rank_memory", [vars(m) for m in result.rank_memory])
            trial.set_user_attr("fits_budget", peak <= budget)
            _set_constraint(trial, float(peak - budget))
            fit = "fits" if peak <= budget else f"OVER budget by {format_bytes(peak - budget)}"
            self._progress(trial, cfg, f"{result.tokens_per_s:,.0f} tok/s, peak {format_bytes(peak)} ({fit}), {trial.user_attrs['wall_s']:.1f}s")
            return float(result.tokens_per_s)
        if result.status == "aborted":
            self._count("aborted")
            reason = f"hopeless: {result.tokens_per_s:,.0f} tok/s over the first timed steps, under 1/{ABORT_FACTOR:g} of the best {best:,.0f}"
            trial.set_user_attr("aborted", True)
            trial.set_user_attr("tokens_per_s_partial", result.tokens_per_s)
            trial.set_user_attr("prune_reason", reason)
            trial.report(float(result.tokens_per_s), step=0)
            self._progress(trial, cfg, f"stopped early, {reason}")
            raise optuna.TrialPruned(reason)
        if result.status == "oom":
            # Out of memory is an answer, not a failure: it does not fit.
            peak = int(result.peak_memory_bytes or 0)
            trial.set_user_attr("cause", "oom")
            trial.set_user_attr("error", result.error)
            trial.set_user_attr("failed_rank", result.failed_rank)
            trial.set_user_attr("fits_budget", False)
            if peak:
                trial.set_user_attr("peak_memory_bytes", peak)
            _set_constraint(trial, float(max(peak - budget, 1)))
            self._progress(trial, cfg, f"out of memory on rank {result.failed_rank}: infeasible")
            return 0.0
        self._count("failed")
        with self._lock:
            if self.counts.every_launch_crashed and result.status == "crash":
                self.counts.crashes.append((crash_signature(result.error), trial.user_attrs["log_path"]))
                self.counts.last_crash = first_line(result.error)
            else:
                self.counts.every_launch_crashed = False
        trial.set_user_attr("cause", result.status)
        trial.set_user_attr("error", result.error)
        trial.set_user_attr("failed_rank", result.failed_rank)
        trial.set_user_attr("exit_code", result.exit_code)
        self._progress(trial, cfg, f"FAILED ({result.status}): {first_line(result.error)} [log: {trial.user_attrs['log_path']}]")
        raise TrialFailed(f"{result.status}: {result.error}")

    # -- stopping -----------------------------------------------------------
    def stop_when_done(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.show_state(f"#{trial.number} {trial.state.name.lower()}")
        if trial.state == TrialState.COMPLETE:
            self.refresh_note(study)
        if self.counts.launched >= self.settings.trials:
            study.stop()
        elif self.space_exhausted(study):
            self.say(f"All {self.space_size} configurations of the space have been tried.")
            study.stop()
        elif self.same_crash_every_time():
            _, log = self.counts.crashes[-1]
            self.say(f"Stopping: all {len(self.counts.crashes)} trials launched crashed with the same error, "
                     f"{self.counts.last_crash} [log: {log}]")
            study.stop()
        elif self.counts.idle_draws >= MAX_IDLE_DRAWS:
            self.say(f"The last {MAX_IDLE_DRAWS} draws were all pruned or already measured; stopping.")
            study.stop()

    def same_crash_every_time(self) -> bool:
        """Whether the launches of this run all crashed alike, often enough to
        say the fault is not the configuration's, with nothing ever measured."""
        crashes = self.counts.crashes
        if not self.counts.every_launch_crashed or len(crashes) < SAME_CRASH_LIMIT:
            return False
        if len({signature for signature, _ in crashes}) != 1:
            return False
        return not any(t.user_attrs.get("tokens_per_s") or t.user_attrs.get("cause") == "oom"
                       for t in self.study.get_trials(deepcopy=False))

    def refresh_note(self, study: optuna.Study) -> None:
        """Keep the dashboard's study note on the current best; cosmetic, so never fatal."""
        try:
            from autotune.dashboard import update_study_note

            update_study_note(study)
        except Exception as exc:  # noqa: BLE001 - a concurrent note edit must not stop tuning
            self.say(f"(could not update the dashboard note: {exc})")

    def space_exhausted(self, study: optuna.Study) -> bool:
        """Whether every configuration of a small space has a finished trial."""
        if self.space_keys is None:
            return False
        seen = {trial_config(t).key() for t in study.get_trials(deepcopy=False) if t.state.is_finished() and trial_config(t)}
        return self.space_keys <= seen


# The hungriest configuration must fit with this much room before per-trial
# estimates are skipped.
SAFETY = 1.25


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
        activation_checkpointing=_first_offered(space, "activation_checkpointing", ("none", "every_other_layer", "full")),
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
        activation_checkpointing=_first_offered(space, "activation_checkpointing", ("full", "every_other_layer", "none")),
        transformer_layer_cls=layer_classes,
    )


def runner_identity() -> dict[str, Any]:
    """Which process runs a trial: host, pid and the pid's start time."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start_ticks(os.getpid())}


def _runner_alive(trial: FrozenTrial) -> bool:
    """False only when the trial's tuner ran on this host and is gone; on
    another host the heartbeat decides."""
    runner = trial.user_attrs.get("runner")
    if not runner or runner.get("host") != socket.gethostname():
        return True
    return process_alive(runner["pid"]) and process_start_ticks(runner["pid"]) == runner.get("start")


def recover_stale_trials(study: optuna.Study, say) -> int:
    """Fail the RUNNING trials whose tuner died on this host, and queue them again.

    Optuna's heartbeat does the same after its grace period, for any host;
    here a dead tuner is certain at once, so the retry need not wait.
    """
    recovered = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if _runner_alive(t):
            continue
        _fail(study, t, "tuner died", "the autotune process running this trial died; the trial was queued again")
        _requeue(study, t)
        say(f"Trial #{t.number} was left RUNNING by a tuner that died; marked failed and queued again.")
        recovered += 1
    return recovered


def settle_interrupted(study: optuna.Study, name: str) -> list[int]:
    """After Ctrl-C or SIGTERM: this tuner's unfinished trials are FAIL with
    cause ``interrupted``, and each drawn configuration is queued to run again.

    Optuna records the trial it was running as FAIL (the objective set the
    cause); a signal that landed between draws or inside Optuna's own
    bookkeeping can leave one RUNNING instead.
    """
    me = runner_identity()
    mine = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("runner") == me or
            (t.state == TrialState.RUNNING and not t.user_attrs.get("runner"))]
    retried = {t.user_attrs.get("retry_of") for t in study.get_trials(deepcopy=False)}
    settled = []
    for t in mine:
        if t.state == TrialState.RUNNING:
            _fail(study, t, "interrupted", f"the tuner was stopped by {name} during this trial; it was queued to run again")
        elif not (t.state == TrialState.FAIL and t.user_attrs.get("cause") == "interrupted"):
            continue
        if t.number not in retried and trial_config(t) is not None:
            _requeue(study, t)
        settled.append(t.number)
    return settled


def _fail(study: optuna.Study, trial: FrozenTrial, cause: str, error: str) -> None:
    study._storage.set_trial_user_attr(trial._trial_id, "cause", cause)
    study._storage.set_trial_user_attr(trial._trial_id, "error", error)
    study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)


def _requeue(study: optuna.Study, trial: FrozenTrial) -> None:
    cfg = trial_config(trial)
    attrs = {"retry_of": trial.number, **({"baseline": True} if trial.user_attrs.get("baseline") else {})}
    study.enqueue_trial(_as_params(cfg) if cfg else trial.params, user_attrs=attrs)


def signal_name(exc: BaseException) -> str:
    return exc.name if isinstance(exc, interrupts.Interrupted) else "SIGINT"


@dataclass
class RunOutcome:
    study: optuna.Study
    tuner: Tuner
    elapsed_s: float
    # The stop request that ended the run early, if one did.
    interrupted: interrupts.Interrupted | None = None


def run_study(settings: RunSettings, host: HostInfo, model: ModelInfo) -> RunOutcome:
    """Run (or resume) the study until ``settings.trials`` launches are done, or a signal stops it."""
    check_resumable(settings)
    storage = open_storage(settings.storage_url, heartbeat=True)
    study = load_or_create_study(settings, storage)
    study.set_user_attr("host", host.as_dict())
    tuner = Tuner(study, settings, host, model)
    start = time.perf_counter()
    interrupted = None
    # Started first: its imports overlap the estimator's start.
    tuner.forks = ForkServer()
    try:
        _plan_and_optimize(study, tuner, settings, host, model)
    except KeyboardInterrupt as exc:
        interrupted = exc if isinstance(exc, interrupts.Interrupted) else interrupts.Interrupted(signal.SIGINT)
        settled = settle_interrupted(study, interrupted.name)
        tuner.say(f"Stopped by {interrupted.name}" + (f"; trial(s) {', '.join(f'#{n}' for n in settled)} "
                                                       "recorded as interrupted and queued to run again" if settled else ""))
    finally:
        tuner.close_progress()
        tuner.close_estimator()
        tuner.forks.close()
    tuner.refresh_note(study)
    return RunOutcome(study, tuner, time.perf_counter() - start, interrupted)


def _plan_and_optimize(study: optuna.Study, tuner: Tuner, settings: RunSettings, host: HostInfo, model: ModelInfo) -> None:
    tuner.start_estimator()
    # Several tuners may start on one study at once: one of them enqueues the baseline.
    with exclusive(tuner.folder / "claims.lock"):
        if not study.get_trials(deepcopy=False):
            enqueue_baseline(study, host, model.layer_classes, settings.space)
        recover_stale_trials(study, tuner.say)
    if tuner.space_exhausted(study):
        tuner.say(f"All {tuner.space_size} configurations of the space were measured in earlier runs.")
        return
    if not tuner.forks.ready():
        tuner.say(f"Fork server unavailable ({tuner.forks.error}); each trial starts fresh interpreters.")
    tuner.start_progress()
    study.optimize(
        tuner.objective, callbacks=[tuner.stop_when_done], catch=(TrialFailed,),
        n_jobs=max(1, len(settings.slots)),
    )


def _as_params(cfg: FsdpConfig) -> dict[str, Any]:
    """Enqueued parameters: every field, so the trial is exactly ``cfg`` even
    where the space file does not offer that value."""
    data = cfg.to_dict()
    data.pop("transformer_layer_cls")
    data.pop("reshard_after_forward")
    return data
