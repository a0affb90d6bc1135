"""What crosses between driver and worker: the trial asked for (``config.json``), the result
(``result.json``), and an exported best configuration read back as a trial to reproduce."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from autotune.config.fsdp_configuration import FsdpConfig
from autotune.config.lora_spec import LoraSpec
from autotune.config.timing import DEFAULT_TIMED_STEPS, MIN_WARMUP_STEPS
from autotune.config.vocabulary import DEVICES, TRIAL_STATUSES, ConfigError, check_choice, check_type, from_mapping


@dataclass(frozen=True)
class TrialRequest:
    """Everything one torchrun job needs: the contents of ``config.json``."""

    fsdp: FsdpConfig
    model: str = "llama-tiny"
    seq_len: int = 256
    warmup_steps: int = 2
    timed_steps: int = DEFAULT_TIMED_STEPS
    seed: int = 0
    # "auto" picks CUDA + NCCL when GPUs are visible, else CPU + gloo.
    device: str = "auto"
    nnodes: int = 1
    # Stop after the first timed steps when the run is slower than this:
    # hopeless trials then cost a few steps instead of a whole measurement.
    abort_below_tokens_per_s: float | None = None
    # Stop timing once the median step time is known to within this fraction
    # (95% confidence); 0 always runs all ``timed_steps``.
    timing_ci: float = 0.02
    # Each rank on its own cores of the device slot, with as many intra-op threads.
    pin_ranks: bool = True
    # Micro batches per optimizer step (see :func:`accumulation_steps`); a
    # timed step is one optimizer step, gradients synced on its last micro batch.
    grad_accum_steps: int = 1
    # Per-rank memory budget. On CUDA each rank caps its caching allocator at it,
    # less what it measures outside the allocator, before building the model:
    # a configuration fits when it trains under that cap. None: no cap.
    memory_budget_bytes: int | None = None
    # Stop timing after this many seconds of timed steps (once at least the
    # minimum count ran), whatever ``timed_steps`` allows; None: by count only.
    timing_budget_s: float | None = None
    # A lock file rank 0 holds shared while steps are timed: the tuner estimates
    # memory on the trial's own cores only while no trial holds it (see
    # autotune.launch.locks.timing_lock_path). None: no lock to hold.
    timing_lock: str | None = None
    # LoRA fine-tuning on frozen base weights; None: every parameter trains.
    lora: LoraSpec | None = None
    # Shallow trial (autotune.depth): copies of the model at these depths are timed, one after the other in this
    # job, and their line extended to ``full_depth`` blocks; empty: the model as it is.
    depths: tuple[int, ...] = ()
    full_depth: int | None = None
    # Run the copies deepest first: a study alternates the order from one shallow trial to the next, so that a
    # drift between the copies of one job (the second runs warmer, or later in a noisy machine's minute) shows in
    # the record instead of tilting every line the same way.
    deepest_first: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.lora, Mapping):
            object.__setattr__(self, "lora", LoraSpec.from_dict(self.lora))
        if self.lora is not None and not isinstance(self.lora, LoraSpec):
            raise ConfigError("lora must be a LoraSpec or its dict")
        if isinstance(self.fsdp, Mapping):
            object.__setattr__(self, "fsdp", FsdpConfig.from_dict(self.fsdp))
        if not isinstance(self.fsdp, FsdpConfig):
            raise ConfigError("fsdp must be an FsdpConfig or its dict")
        check_type("model", self.model, str)
        if not self.model:
            raise ConfigError("model must not be empty")
        for name in ("seq_len", "timed_steps", "nnodes", "grad_accum_steps"):
            check_type(name, getattr(self, name), int)
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        check_type("warmup_steps", self.warmup_steps, int)
        if self.warmup_steps < MIN_WARMUP_STEPS:
            raise ConfigError(
                f"warmup_steps={self.warmup_steps} must be at least {MIN_WARMUP_STEPS}: the first step allocates "
                "optimizer state and is never representative, and the last measures memory"
            )
        check_type("seed", self.seed, int)
        check_choice("device", self.device, DEVICES)
        check_type("timing_ci", self.timing_ci, float)
        if not 0 <= self.timing_ci < 1:
            raise ConfigError(f"timing_ci={self.timing_ci} must be at least 0 and below 1 (0.02 means 2%)")
        if self.abort_below_tokens_per_s is not None:
            check_type("abort_below_tokens_per_s", self.abort_below_tokens_per_s, float)
        check_type("pin_ranks", self.pin_ranks, bool)
        if self.memory_budget_bytes is not None:
            check_type("memory_budget_bytes", self.memory_budget_bytes, int)
            if self.memory_budget_bytes < 1:
                raise ConfigError(f"memory_budget_bytes={self.memory_budget_bytes} must be at least 1")
        if self.timing_lock is not None:
            check_type("timing_lock", self.timing_lock, str)
        if self.timing_budget_s is not None:
            check_type("timing_budget_s", self.timing_budget_s, float)
            if self.timing_budget_s <= 0:
                raise ConfigError(f"timing_budget_s={self.timing_budget_s} must be greater than 0")
        check_type("deepest_first", self.deepest_first, bool)
        if isinstance(self.depths, list):
            object.__setattr__(self, "depths", tuple(self.depths))
        if self.depths:
            if len(self.depths) < 2 or list(self.depths) != sorted(set(self.depths)) or self.depths[0] < 1:
                raise ConfigError(f"depths={list(self.depths)} must be two or more increasing block counts")
            if not isinstance(self.full_depth, int) or self.full_depth <= self.depths[-1]:
                raise ConfigError(f"full_depth={self.full_depth} must be deeper than the shallow copies "
                                  f"{list(self.depths)}")

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["fsdp"] = self.fsdp.to_dict()
        data["lora"] = self.lora.to_dict() if self.lora is not None else None
        data["depths"] = list(self.depths)
        return data

    def at_full_depth(self) -> TrialRequest:
        """The same trial on the model as it is."""
        return dataclasses.replace(self, depths=(), full_depth=None)

    def tokens_per_step(self, world_size: int) -> int:
        """Tokens of one optimizer step, every rank and micro batch together."""
        return self.fsdp.micro_batch_size * self.seq_len * world_size * self.grad_accum_steps

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrialRequest:
        return from_mapping(cls, data, "trial request")


@dataclass
class RankMemory:
    """Peak memory of one rank, in bytes. CUDA fills both allocator figures; CPU
    hosts fill ``tracked`` from live tensor storages, since RSS is not device memory."""

    rank: int
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    tracked: int | None = None
    # CUDA: device memory outside the caching allocator (context, NCCL buffers).
    outside_allocator: int | None = None
    # CUDA: times the allocator, at its cap, freed its cached blocks and retried.
    alloc_retries: int | None = None
    # CUDA, capped: the cap, and by how much the memory outside the allocator, as
    # measured at the end of the run, outgrew the room the cap last left for it:
    # 0 when the cap emulated a GPU of the budget's size exactly.
    cap_bytes: int | None = None
    outside_growth: int | None = None

    @property
    def tensor_peak(self) -> int | None:
        """Bytes of live tensors at the peak: what the memory estimate predicts."""
        return self.peak_allocated if self.peak_allocated is not None else self.tracked

    @property
    def peak(self) -> int:
        """What the rank needs of the device: its allocator's peak plus what lies outside it."""
        figures = [v for v in (self.peak_reserved, self.tracked, self.peak_allocated) if v is not None]
        return (max(figures) if figures else 0) + (self.outside_allocator or 0)


@dataclass
class TrialResult:
    """What rank 0 writes to ``result.json``; the driver also fills it in for
    trials that never produced one (timeout, crash)."""

    status: str
    tokens_per_s: float | None = None
    step_time_median_s: float | None = None
    step_time_p10_s: float | None = None
    step_time_p90_s: float | None = None
    step_time_cv: float | None = None
    # 95% confidence interval of tokens/s, from that of the median step time.
    tokens_per_s_ci_low: float | None = None
    tokens_per_s_ci_high: float | None = None
    timed_steps: int | None = None
    tokens_per_step: int | None = None
    peak_memory_bytes: int | None = None
    memory_method: str | None = None
    rank_memory: list[RankMemory] = field(default_factory=list)
    loss_first: float | None = None
    loss_last: float | None = None
    world_size: int | None = None
    # Across nodes: how many, ranks on each, and the device mesh the ranks formed.
    nnodes: int | None = None
    nproc_per_node: int | None = None
    mesh_shape: list[int] | None = None
    device: str | None = None
    device_name: str | None = None
    torch_version: str | None = None
    transformers_version: str | None = None
    num_params: int | None = None
    # Parameters the optimizer steps: all of them, or LoRA's adapters only.
    trainable_params: int | None = None
    # LoRA: the modules the adapters went on (peft's default resolved).
    lora_target_modules: list[str] | None = None
    # Steps fp16's loss scaling skipped (not timed, not measured).
    skipped_steps: int = 0
    # CUDA: the cap on each rank's caching allocator (the budget less what lies
    # outside it), and the allocator settings the ranks ran with.
    memory_cap_bytes: int | None = None
    allocator_conf: str | None = None
    # Seconds spent in each phase of the worker, to show where a trial's time goes.
    phases: dict[str, float] = field(default_factory=dict)
    # A shallow trial (autotune.depth): each copy's timing (DepthPoint.to_dict()), the depth its line was
    # extended to (the step time, tokens/s and their interval above are that line's figures), and how far a
    # third copy lay off the line (None with two).
    depth_points: list[dict[str, Any]] = field(default_factory=list)
    full_depth: int | None = None
    line_check: float | None = None
    error: str | None = None
    failed_rank: int | None = None
    exit_code: int | None = None

    def __post_init__(self) -> None:
        check_choice("status", self.status, TRIAL_STATUSES)
        self.rank_memory = [
            RankMemory(**r) if isinstance(r, Mapping) else r for r in self.rank_memory
        ]

    @property
    def tensor_peak(self) -> int | None:
        """The largest rank's tensor bytes at its peak: what the memory estimate predicts (None: not measured)."""
        peaks = [m.tensor_peak for m in self.rank_memory if m.tensor_peak is not None]
        return max(peaks) if peaks else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrialResult:
        return from_mapping(cls, data, "trial result")


# The exported configuration's format: autotune export, best_config.json.
SCHEMA = "autotune.fsdp-config/v1"


def accumulation_steps(global_batch_size: int | None, micro_batch_size: int, data_parallel: int) -> int:
    """Micro batches per optimizer step that keep ``global_batch_size`` samples a
    step across ``data_parallel`` ranks (1 without a global batch)."""
    if global_batch_size is None:
        return 1
    per_step = micro_batch_size * data_parallel
    if global_batch_size % per_step:
        raise ConfigError(f"global batch {global_batch_size} is not a multiple of micro batch {micro_batch_size} "
                          f"x {data_parallel} ranks")
    return global_batch_size // per_step


def request_from_export(doc: Mapping[str, Any], **overrides: Any) -> TrialRequest:
    """The trial that reproduces an exported measurement."""
    if doc.get("schema") != SCHEMA:
        raise ConfigError(f"not an {SCHEMA} document (schema={doc.get('schema')!r})")
    budget = (doc.get("budget") or {}).get("memory_bytes")
    fields = {"fsdp": doc["fsdp"], "model": doc["model"], "seq_len": doc["seq_len"],
              "grad_accum_steps": doc.get("gradient_accumulation_steps", 1), "nnodes": doc.get("nnodes", 1),
              "memory_budget_bytes": int(budget) if budget else None, "lora": doc.get("lora"), **overrides}
    return TrialRequest(**fields)


def load_request(data: Any) -> TrialRequest:
    """A trial's config.json, or an exported best configuration to reproduce."""
    if isinstance(data, Mapping) and data.get("schema") == SCHEMA:
        return request_from_export(data)
    return TrialRequest.from_dict(data)
