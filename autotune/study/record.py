"""The trial record: every attribute a trial of an autotune study carries, named once.

Optuna keeps a trial's facts as string-keyed user attributes. The writers
(the objective, the memory gate, the claims) and the readers (the trials
table, the summary, the report, the export, the dashboard, the benchmarks)
all use the names below, and the helpers that read a record
(:func:`is_feasible`, :func:`best_search_trial`, :func:`trial_config`) live
here too, so no reader needs the orchestrator.

Optuna's own fields carry the rest: the value is tokens/s, the state is
COMPLETE (measured, or out of memory), PRUNED (never launched, or stopped early
as hopeless) or FAIL (crash, timeout, interrupted), and the constraint
``peak_memory_over_budget`` (peak - budget) is positive when infeasible.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from autotune.units import rate_unit
from autotune.config import Choice, FsdpConfig, Status, TrialResult
from autotune.study.margin import Sample
from autotune.study.optuna_internals import set_system_attr
from autotune.study.verdict import STORED_AS, read_verdict

METRIC_NAME = "tokens_per_s"
CONSTRAINT_KEY = "peak_memory_over_budget"


class Attr:
    """User-attribute names of a trial."""

    # What was drawn.
    CONFIG = "config"  # FsdpConfig.to_dict() of the configuration: its class's simplest member
    LABEL = "label"  # FsdpConfig.describe()
    DRAWN_AS = "drawn_as"  # the label drawn, when it names the same program as CONFIG less simply
    BASELINE = "baseline"  # True on the first trial: the standard recipe
    # True on the standard recipe's trial when the space does not offer it: measured beside the answer, never
    # the answer, and not one of the run's --trials.
    OUTSIDE_SPACE = "outside_space"
    RETRY_OF = "retry_of"  # number of the trial this one retries
    # Who ran it.
    RUNNER = "runner"  # {"host", "pid", "start"} of the tuner process
    CLAIMED = "claimed"  # True once this trial holds the claim to measure its configuration
    REUSED_FROM = "reused_from"  # number of the trial whose measurement this one copies
    # The launch.
    STARTED_AT = "started_at"  # wall-clock seconds since the epoch
    ENDED_AT = "ended_at"
    DEVICES = "devices"  # the device slot's indices
    WALL_S = "wall_s"
    STATUS = "status"  # TrialResult.status: ok, oom, crash, timeout, aborted
    TRIAL_DIR = "trial_dir"
    LOG_PATH = "log_path"
    PHASES = "phases"  # seconds per worker phase
    # The measurement (copied from TrialResult).
    TOKENS_PER_S = "tokens_per_s"
    STEP_TIME_MEDIAN_S = "step_time_median_s"
    STEP_TIME_P10_S = "step_time_p10_s"
    STEP_TIME_P90_S = "step_time_p90_s"
    STEP_TIME_CV = "step_time_cv"
    TOKENS_PER_S_CI_LOW = "tokens_per_s_ci_low"  # 95% confidence interval of tokens/s within the trial
    TOKENS_PER_S_CI_HIGH = "tokens_per_s_ci_high"
    TIMED_STEPS = "timed_steps"
    NNODES = "nnodes"  # nodes the trial ran on, ranks on each, and the device mesh they formed
    NPROC_PER_NODE = "nproc_per_node"
    MESH_SHAPE = "mesh_shape"
    SKIPPED_STEPS = "skipped_steps"
    LOSS_FIRST = "loss_first"
    LOSS_LAST = "loss_last"
    MEMORY_METHOD = "memory_method"
    WORLD_SIZE = "world_size"
    DEVICE = "device"
    DEVICE_NAME = "device_name"
    TORCH_VERSION = "torch_version"
    TRANSFORMERS_VERSION = "transformers_version"
    NUM_PARAMS = "num_params"
    TRAINABLE_PARAMS = "trainable_params"  # all of them, or LoRA's adapters only
    LORA_TARGET_MODULES = "lora_target_modules"  # the modules LoRA's adapters went on
    TOKENS_PER_STEP = "tokens_per_step"
    PEAK_MEMORY_BYTES = "peak_memory_bytes"  # the largest rank's peak: what it held of the device
    PEAK_MEMORY_GIB = "peak_memory_gib"
    TENSOR_PEAK_BYTES = "tensor_peak_bytes"  # the largest rank's tensor bytes (CUDA: allocated), what estimates predict
    # CUDA: the most device memory a rank held outside the allocator
    OUTSIDE_ALLOCATOR_BYTES = "outside_allocator_bytes"
    MEMORY_CAP_BYTES = "memory_cap_bytes"  # CUDA: what each rank's caching allocator was capped at
    ALLOC_RETRIES = "alloc_retries"  # CUDA: the most times a rank's allocator freed its cache and retried
    ALLOCATOR_CONF = "allocator_conf"  # PYTORCH_CUDA_ALLOC_CONF the trial ran with
    RANK_MEMORY = "rank_memory"  # every rank's RankMemory
    FITS_BUDGET = "fits_budget"
    # Why it is not a usable result.
    PRUNE_REASON = "prune_reason"
    ABORTED = "aborted"  # stopped early as hopeless
    TOKENS_PER_S_PARTIAL = "tokens_per_s_partial"
    CAUSE = "cause"  # oom, crash, timeout, tuner died, interrupted
    ERROR = "error"
    FAILED_RANK = "failed_rank"
    EXIT_CODE = "exit_code"
    # The confirmation round (fresh re-measurements after the search).
    CONFIRMATION_ROUND = "confirmation_round"  # 1, 2, ...
    CONFIRMATION_ROLE = "confirmation_role"  # a verdict.Role
    # The memory estimate.
    PREDICTED_PEAK_BYTES = "predicted_peak_bytes"  # tensor bytes of the fake step
    PREDICTED_DEVICE_PEAK_BYTES = "predicted_device_peak_bytes"  # with the device margin
    PREDICTED_BREAKDOWN = "predicted_breakdown"
    PREDICTION_METHOD = "prediction_method"
    PREDICTION_MARGIN = "prediction_margin"
    FIT_CHANCE = "fit_chance"  # below 1: predicted near the budget, launched to find out
    # The speed prediction made before launch (autotune.speed.SpeedPrediction.to_dict(): tokens/s, its interval,
    # MFU, where the time goes, the profile and how calibrated), beside the measurement the trial makes.
    PREDICTED_SPEED = "predicted_speed"
    PREDICTED_TOKENS_PER_S = "predicted_tokens_per_s"
    # A shallow trial (autotune.depth): its tokens/s and step time are the line through its copies, extended.
    EXTRAPOLATED = "extrapolated"  # True on such a trial
    DEPTH_POINTS = "depth_points"  # each copy's DepthPoint.to_dict()
    FULL_DEPTH = "full_depth"  # the depth the line was extended to
    LINE_CHECK = "line_check"  # a third copy's distance off the line, relative (None with two copies)
    # The copies' tensor peaks extended to full depth (autotune.depth.peak_at): a shallow trial's measured
    # memory, which calibrates the margin as a full-depth trial's does; and that against the memory estimate
    # (autotune.study.margin.LinePeakCheck.to_dict()).
    LINE_TENSOR_PEAK_BYTES = "line_tensor_peak_bytes"
    LINE_PEAK_CHECK = "line_peak_check"
    COPIES_ORDER = "copies_order"  # "shallowest first" or "deepest first"
    WHOLE_BECAUSE = "whole_because"  # why a shallow study ran this search trial at full depth


class Cause(Choice):
    """Why a trial is not a usable measurement (its ``cause`` attribute)."""

    OOM = "oom"  # out of memory: infeasible, a COMPLETE trial
    CRASH = "crash"
    TIMEOUT = "timeout"
    NODE_LOST = "node lost"
    TUNER_DIED = "tuner died"
    INTERRUPTED = "interrupted"

    @classmethod
    def of(cls, status: str) -> "Cause":
        """The cause a failed trial is recorded with, from its result's status."""
        return cls.NODE_LOST if status == Status.NODE_LOST else cls(status)


class StudyAttr:
    """User-attribute names of the study."""

    IDENTITY = "identity"  # model, nproc, seq_len, budget_bytes, space_digest: what a resume must match
    BUDGET = "budget"  # the budget as the user wrote it
    SPACE_PATH = "space_path"
    HOST = "host"  # HostInfo of the last run
    EXCLUDED = "excluded"  # {"count", "examples": [{"label", "reason"}]}: ruled out before any trial
    CONFIRMATION = STORED_AS  # the confirmation round's Verdict (autotune.study.verdict)
    # What the last run spent on memory estimates: fake steps, their seconds, the
    # seconds the search waited for them, configurations judged without one.
    ESTIMATE_COSTS = "estimate_costs"
    # How the search's trials meet the model's depth (autotune.study.trial_depth.DepthPlan.to_dict()).
    TRIAL_DEPTH = "trial_depth"
    # The speed model at the end of the last run: its profile, refitted efficiencies and uncertainty.
    SPEED_MODEL = "speed_model"
    # Configurations never launched because their predicted speed, high side included, was below the best
    # measured: [{"label", "config", "predicted_tokens_per_s", "high", "best", "reason"}].
    SKIPPED_SLOW = "skipped_slow"


# What a reused trial copies from the trial that measured its configuration:
# the measurement, not when, where or by whom it ran.
NOT_REUSED = (Attr.CONFIG, Attr.LABEL, Attr.BASELINE, Attr.RUNNER, Attr.CLAIMED, Attr.STARTED_AT, Attr.ENDED_AT,
              Attr.DEVICES, Attr.WALL_S, Attr.RETRY_OF, Attr.CONFIRMATION_ROUND, Attr.CONFIRMATION_ROLE,
              Attr.PREDICTED_SPEED, Attr.PREDICTED_TOKENS_PER_S)
# Copied from a TrialResult onto a measured trial.
MEASURED = (Attr.NNODES, Attr.NPROC_PER_NODE, Attr.MESH_SHAPE, Attr.TOKENS_PER_S, Attr.STEP_TIME_MEDIAN_S,
            Attr.STEP_TIME_P10_S, Attr.STEP_TIME_P90_S, Attr.STEP_TIME_CV,
            Attr.TOKENS_PER_S_CI_LOW, Attr.TOKENS_PER_S_CI_HIGH,
            Attr.TIMED_STEPS, Attr.SKIPPED_STEPS, Attr.LOSS_FIRST, Attr.LOSS_LAST, Attr.MEMORY_METHOD, Attr.WORLD_SIZE,
            Attr.DEVICE, Attr.DEVICE_NAME, Attr.TORCH_VERSION, Attr.TRANSFORMERS_VERSION, Attr.NUM_PARAMS,
            Attr.TRAINABLE_PARAMS, Attr.LORA_TARGET_MODULES, Attr.TOKENS_PER_STEP, Attr.ALLOCATOR_CONF)


def is_feasible(trial: Any) -> bool:
    """Measured, and within the budget."""
    from optuna.trial import TrialState

    return trial.state == TrialState.COMPLETE and all(v <= 0 for v in trial.constraints.values())


def is_confirmation(trial: Any) -> bool:
    return Attr.CONFIRMATION_ROUND in trial.user_attrs


def search_trials(study: Any) -> list:
    """Trials of the search: everything but the confirmation round's re-measurements."""
    return [t for t in study.get_trials(deepcopy=False) if not is_confirmation(t)]


def winner(study: Any) -> Any | None:
    """The confirmed winner's search trial when a confirmation round ran, else the best feasible trial."""
    verdict = read_verdict(study)
    if verdict is not None:
        return next((t for t in study.get_trials(deepcopy=False) if t.number == verdict.winner.trial), None)
    return best_search_trial(study)


def answer_trials(study: Any) -> list:
    """Search trials whose configuration the space offers: what may be the answer (a reference outside the
    space is measured beside it)."""
    return [t for t in search_trials(study) if not t.user_attrs.get(Attr.OUTSIDE_SPACE)]


def best_search_trial(study: Any) -> Any | None:
    """The fastest feasible trial of the search (a single measurement) among those the space offers."""
    feasible = [t for t in answer_trials(study) if is_feasible(t)]
    return max(feasible, key=lambda t: t.value) if feasible else None


def trial_config(trial: Any) -> FsdpConfig | None:
    data = trial.user_attrs.get(Attr.CONFIG)
    return _parsed_config(json.dumps(data, sort_keys=True)) if data else None


def value_of(trial: Any) -> float:
    """A measured trial's tokens/s (a complete trial always has one)."""
    if trial.value is None:
        raise ValueError(f"trial #{trial.number} has no value")
    return float(trial.value)


def config_key(trial: Any) -> str | None:
    """The key of the configuration ``trial`` ran, or None when it recorded none."""
    cfg = trial_config(trial)
    return cfg.key() if cfg is not None else None


@functools.lru_cache(maxsize=4096)
def _parsed_config(text: str) -> FsdpConfig:
    # Stopping rules and claims look at every trial's configuration after each
    # trial; parsing and validating each afresh made a long study quadratic.
    return FsdpConfig.from_dict(json.loads(text))


def set_constraint(trial: Any, violation: float) -> None:
    """Record how far over the budget a trial is (<= 0: feasible).

    Optuna 4+/5 reads ``constraints:<key>``; optuna-dashboard 0.21 only reads
    the older ``constraints`` list. Both are written so the two agree.
    """
    trial.set_constraint(CONSTRAINT_KEY, violation)
    set_system_attr(trial, "constraints", [violation])


def write_memory(trial: Any, result: TrialResult) -> None:
    """What the ranks held: tensor bytes, outside the allocator, the cap and its retries (from every rank's figures)."""
    ranks = result.rank_memory
    figures = {Attr.TENSOR_PEAK_BYTES: [m.tensor_peak for m in ranks if m.tensor_peak is not None],
               Attr.OUTSIDE_ALLOCATOR_BYTES: [m.outside_allocator for m in ranks if m.outside_allocator is not None],
               Attr.ALLOC_RETRIES: [m.alloc_retries for m in ranks if m.alloc_retries is not None]}
    for name, values in figures.items():
        if values:
            trial.set_user_attr(name, max(values))
    if result.memory_cap_bytes is not None:
        trial.set_user_attr(Attr.MEMORY_CAP_BYTES, result.memory_cap_bytes)


def write_measurement(trial: Any, result: TrialResult, budget_bytes: int) -> int:
    """A measured trial's figures and its constraint; returns the peak."""
    peak = int(result.peak_memory_bytes or 0)
    for name in MEASURED:
        trial.set_user_attr(name, getattr(result, name))
    write_memory(trial, result)
    trial.set_user_attr(Attr.PEAK_MEMORY_BYTES, peak)
    trial.set_user_attr(Attr.PEAK_MEMORY_GIB, round(peak / 2**30, 4))
    trial.set_user_attr(Attr.RANK_MEMORY, [vars(m) for m in result.rank_memory])
    trial.set_user_attr(Attr.FITS_BUDGET, peak <= budget_bytes)
    set_constraint(trial, float(peak - budget_bytes))
    return peak


def write_extrapolated(trial: Any, result: TrialResult, budget_bytes: int) -> int | None:
    """A shallow trial's figures (its speed extended from the copies), and its
    constraint from the full-depth memory estimate the gate made before launch:
    a copy's own peak says nothing of the full model's. Returns that peak
    (None when the gate judged the whole space to fit without estimates)."""
    for name in MEASURED:
        trial.set_user_attr(name, getattr(result, name))
    trial.set_user_attr(Attr.EXTRAPOLATED, True)
    trial.set_user_attr(Attr.DEPTH_POINTS, result.depth_points)
    trial.set_user_attr(Attr.FULL_DEPTH, result.full_depth)
    trial.set_user_attr(Attr.LINE_CHECK, result.line_check)
    write_copies_memory(trial, result)
    predicted = trial.user_attrs.get(Attr.PREDICTED_DEVICE_PEAK_BYTES)
    if predicted is None:
        set_constraint(trial, -1.0)
        return None
    trial.set_user_attr(Attr.PEAK_MEMORY_BYTES, int(predicted))
    trial.set_user_attr(Attr.PEAK_MEMORY_GIB, round(predicted / 2**30, 4))
    set_constraint(trial, float(predicted - budget_bytes))
    return int(predicted)


def write_copies_memory(trial: Any, result: TrialResult) -> None:
    """What a shallow trial's copies show of the full model's memory: their tensor peaks' line at full depth,
    the order they ran in, and what lies outside the allocator (the same at any depth: the context, NCCL)."""
    from autotune.depth import DepthPoint, peak_at

    points = [DepthPoint.from_dict(p) for p in result.depth_points]
    line = peak_at(points, result.full_depth) if points and result.full_depth else None
    if line is not None:
        trial.set_user_attr(Attr.LINE_TENSOR_PEAK_BYTES, line)
    ordered = sorted(points, key=lambda p: p.depth)
    if ordered and ordered[0].order is not None and ordered[-1].order is not None:
        trial.set_user_attr(Attr.COPIES_ORDER,
                            "shallowest first" if ordered[0].order < ordered[-1].order else "deepest first")
    outside = [m.outside_allocator for m in result.rank_memory if m.outside_allocator is not None]
    if outside:
        trial.set_user_attr(Attr.OUTSIDE_ALLOCATOR_BYTES, max(outside))


def is_extrapolated(trial: Any) -> bool:
    """Whether a trial's speed was extended from shallow copies, not measured at full depth."""
    return bool(trial.user_attrs.get(Attr.EXTRAPOLATED))


def write_failure(trial: Any, result: TrialResult, cause: str) -> None:
    trial.set_user_attr(Attr.CAUSE, cause)
    trial.set_user_attr(Attr.ERROR, result.error)
    trial.set_user_attr(Attr.FAILED_RANK, result.failed_rank)
    trial.set_user_attr(Attr.EXIT_CODE, result.exit_code)


def measured_samples(study: Any, budget_bytes: int) -> list[Sample]:
    """Each launched trial with a prediction, against what it needed: its tensor
    peak (a shallow trial's: its copies' peaks extended to full depth, where
    that reaches the prediction), or for one out of memory under the cap, the
    cap (a lower bound)."""
    from optuna.trial import TrialState

    samples = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        attrs = t.user_attrs
        predicted = attrs.get(Attr.PREDICTED_PEAK_BYTES)
        if not predicted or Attr.REUSED_FROM in attrs:
            continue
        outside = attrs.get(Attr.OUTSIDE_ALLOCATOR_BYTES)
        if attrs.get(Attr.EXTRAPOLATED):
            line = attrs.get(Attr.LINE_TENSOR_PEAK_BYTES)
            if line and line >= predicted and attrs.get(Attr.STATUS) == Status.OK:
                # The copies' peaks extended to full depth: a lower bound of the full-depth peak
                # (autotune.study.margin.LinePeakCheck), so it calibrates the margin's high side only.
                samples.append(Sample(line, predicted, attrs.get(Attr.PREDICTION_METHOD), outside))
            continue
        if attrs.get(Attr.STATUS) == Status.OK:
            # Trials recorded before tensor peaks were kept: the device peak less what lies outside.
            needed = attrs.get(Attr.TENSOR_PEAK_BYTES) or attrs.get(Attr.PEAK_MEMORY_BYTES, 0) - (outside or 0)
        elif attrs.get(Attr.STATUS) == Status.OOM and attrs.get(Attr.MEMORY_CAP_BYTES):
            needed = attrs[Attr.MEMORY_CAP_BYTES] + 1
        else:
            continue
        samples.append(Sample(needed, predicted, attrs.get(Attr.PREDICTION_METHOD), outside))
    return samples


def copy_measurement(trial: Any, previous: Any) -> None:
    """A reused trial takes the earlier trial's measurement (not when or where it ran)."""
    for name, value in previous.user_attrs.items():
        if name not in NOT_REUSED:
            trial.set_user_attr(name, value)
    trial.set_user_attr(Attr.REUSED_FROM, previous.number)


def first_line(error: str | None) -> str:
    text = (error or "").strip()
    return text.splitlines()[0] if text else ""


def crash_signature(error: str | None) -> str:
    """The error of a crash without which rank hit it: the same fault on rank 0
    in one trial and on rank 1 in the next is the same fault."""
    first = re.sub(r"^rank \d+ failed: ", "", first_line(error))
    return re.sub(r"\brank \d+\b", "rank ?", first)


def study_rate(study: Any, short: bool = False) -> str:
    """How a stored study's throughput is written: its workload's unit (stored with its identity), else tokens."""
    identity = study.user_attrs.get(StudyAttr.IDENTITY) or {}
    return rate_unit(identity.get("unit") or "tokens", short)
