"""The one configuration vocabulary shared by the driver and the worker.

Both sides import this module, so it imports neither torch nor optuna. The driver
writes a :class:`TrialRequest` to ``config.json``; the worker answers with a
:class:`TrialResult` in ``result.json``. Every value is validated on the way in,
so an impossible combination is refused with its reason before any process
starts, and both files round-trip through JSON unchanged.

>>> cfg = FsdpConfig(fsdp_version=1, sharding_strategy="SHARD_GRAD_OP")
>>> cfg.reshard_after_forward
False
>>> FsdpConfig.from_dict(cfg.to_dict()) == cfg
True
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

FSDP_VERSIONS = (1, 2)
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
AUTO_WRAP_POLICIES = ("transformer_layer", "size_based", "none")
MIXED_PRECISIONS = ("fp32", "bf16", "bf16_fp32_reduce", "fp16")
ACTIVATION_CHECKPOINTING = ("none", "full", "every_other_layer", "selective")
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "none")

# Which strategies keep parameters sharded after forward. FSDP2 spells the same
# choice as ``reshard_after_forward``; keeping one table makes the two agree.
RESHARD_AFTER_FORWARD = {
    "FULL_SHARD": True,
    "HYBRID_SHARD": True,
    "SHARD_GRAD_OP": False,
    "HYBRID_SHARD_ZERO2": False,
    "NO_SHARD": False,
}
HYBRID_STRATEGIES = ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


# "auto" picks CUDA + NCCL when GPUs are visible, else CPU + gloo.
DEVICES = ("auto", "cpu", "cuda")
# What starts a trial's torchrun agents when it spans several nodes (autotune.launch.multinode).
LAUNCHERS = ("local", "slurm")
# What picks a study's next configuration (autotune.study.search, or an Optuna sampler).
SEARCHES = ("autotune", "tpe", "gp", "random")


class Choice(str, enum.Enum):
    """A string enum: compares, hashes, prints and serializes as its value, as
    Python 3.11's StrEnum does (this package runs on 3.10 too)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Status(Choice):
    """How a trial's torchrun job ended (a TrialResult's status)."""

    OK = "ok"
    OOM = "oom"  # out of memory (on CUDA: under the allocator cap): does not fit
    CRASH = "crash"
    TIMEOUT = "timeout"
    ABORTED = "aborted"  # stopped after its first steps as hopeless
    NODE_LOST = "node_lost"  # a node of a multi-node trial went away


TRIAL_STATUSES = tuple(s.value for s in Status)


class ConfigError(ValueError):
    """A value or a combination the vocabulary does not allow; the message says why."""


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    # bool is an int subclass: fsdp_version=True must not pass as 1.
    if isinstance(value, bool) and not all(isinstance(a, bool) for a in allowed):
        raise ConfigError(f"{name}={value!r} is not allowed; choose one of {list(allowed)}")
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not allowed; choose one of {list(allowed)}")


def _check_type(name: str, value: Any, kind: type) -> None:
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{name}={value!r} must be an integer")
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be true or false")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{name}={value!r} must be a number")
    if kind is str and not isinstance(value, str):
        raise ConfigError(f"{name}={value!r} must be a string")


def _always(picked: Mapping[str, Any]) -> bool:
    return True


@dataclass(frozen=True)
class SearchField:
    """One field of :class:`FsdpConfig` that a search space can vary.

    The one place its type, its allowed values and its condition are written:
    configuration validation, search-space files, the sampler's draws, the
    CLI and the report all read them from here.
    """

    name: str
    kind: type
    # Allowed values, or None for "any integer >= 1".
    allowed: tuple | None = None
    # Whether the field is drawn, given the fields drawn before it: a choice
    # that cannot matter (FSDP1-only knobs under FSDP2) is never drawn.
    applies: Callable[[Mapping[str, Any]], bool] = _always
    # Words a space file may write for a value (``node`` for None: one node's ranks).
    aliases: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def from_yaml(self, value: Any) -> Any:
        """The value a space file's word stands for (itself unless an alias)."""
        return self.aliases[value] if isinstance(value, str) and value in self.aliases else value

    def allowed_text(self) -> str:
        words = "".join(f", or {word}" for word in self.aliases)
        if self.allowed is None:
            return "any integer >= 1" + words
        return ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in self.allowed) + words

    def check(self, value: Any) -> None:
        """Raise :class:`ConfigError` naming the field, the value and what is allowed."""
        if value is None and None in self.aliases.values():
            return
        wrong_type = not isinstance(value, self.kind) or (self.kind is int and isinstance(value, bool))
        if wrong_type:
            kind = {int: "an integer", bool: "true or false", str: "a string"}[self.kind]
            raise ConfigError(f"{self.name}={value!r} is not {kind}; allowed values: {self.allowed_text()}")
        if (self.allowed is None and value < 1) or (self.allowed is not None and value not in self.allowed):
            raise ConfigError(f"{self.name}={value!r} is not allowed; allowed values: {self.allowed_text()}")


# In drawing order: a field's condition may only look at earlier ones.
SEARCH_FIELDS: tuple[SearchField, ...] = (
    SearchField("fsdp_version", int, FSDP_VERSIONS),
    SearchField("sharding_strategy", str, SHARDING_STRATEGIES),
    SearchField("auto_wrap_policy", str, AUTO_WRAP_POLICIES),
    SearchField("min_num_params", int, None, lambda p: p["auto_wrap_policy"] == "size_based"),
    SearchField("mixed_precision", str, MIXED_PRECISIONS),
    SearchField("activation_checkpointing", str, ACTIVATION_CHECKPOINTING),
    SearchField("forward_prefetch", bool, (False, True)),
    SearchField("backward_prefetch", str, BACKWARD_PREFETCH, lambda p: p["fsdp_version"] == 1),
    SearchField("limit_all_gathers", bool, (False, True), lambda p: p["fsdp_version"] == 1),
    SearchField("shard_group_size", int, None, lambda p: p["sharding_strategy"] in HYBRID_STRATEGIES, {"node": None}),
    SearchField("cpu_offload", bool, (False, True)),
    SearchField("compile", bool, (False, True)),
    SearchField("micro_batch_size", int, None),
)
SEARCH_FIELD = {f.name: f for f in SEARCH_FIELDS}


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def _from_mapping(cls: type, data: Mapping[str, Any], what: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what} must be a JSON object, got {type(data).__name__}")
    names = _field_names(cls)
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{what} has unknown key(s) {unknown}; known keys: {sorted(names)}")
    return cls(**dict(data))


@dataclass(frozen=True)
class FsdpConfig:
    """One FSDP configuration: what the tuner searches over and what it exports.

    Field names follow PyTorch's FSDP1 arguments; where FSDP2 has no such argument
    the worker maps the field onto FSDP2's own mechanism (a 2-D mesh for NO_SHARD
    and hybrid sharding, ``reshard_after_forward`` for the strategy, explicit
    ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``).
    """

    fsdp_version: int = 2
    sharding_strategy: str = "FULL_SHARD"
    auto_wrap_policy: str = "transformer_layer"
    # Class names of the model's repeated block; empty means "the model's
    # ``_no_split_modules``", resolved by the driver's model probe before export.
    transformer_layer_cls: tuple[str, ...] = ()
    min_num_params: int = 100_000_000
    mixed_precision: str = "fp32"
    activation_checkpointing: str = "none"
    forward_prefetch: bool = False
    backward_prefetch: str = "BACKWARD_PRE"
    limit_all_gathers: bool = True
    # Hybrid strategies: ranks per shard group (replicated across the groups);
    # None: one node's ranks. Must divide the world size.
    shard_group_size: int | None = None
    cpu_offload: bool = False
    # torch.compile each repeated block before sharding, as torchtitan does.
    compile: bool = False
    micro_batch_size: int = 1
    # Derived from sharding_strategy when left as None; given explicitly it must agree.
    reshard_after_forward: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.transformer_layer_cls, str):
            object.__setattr__(self, "transformer_layer_cls", (self.transformer_layer_cls,))
        elif isinstance(self.transformer_layer_cls, list):
            object.__setattr__(self, "transformer_layer_cls", tuple(self.transformer_layer_cls))
        self._validate()
        if self.reshard_after_forward is None:
            object.__setattr__(
                self, "reshard_after_forward", RESHARD_AFTER_FORWARD[self.sharding_strategy]
            )

    def _validate(self) -> None:
        for search_field in SEARCH_FIELDS:
            search_field.check(getattr(self, search_field.name))
        for cls_name in self.transformer_layer_cls:
            if not isinstance(cls_name, str) or not cls_name.isidentifier():
                raise ConfigError(f"transformer_layer_cls entry {cls_name!r} is not a class name")
        if self.reshard_after_forward is not None:
            _check_type("reshard_after_forward", self.reshard_after_forward, bool)
            implied = RESHARD_AFTER_FORWARD[self.sharding_strategy]
            if self.reshard_after_forward != implied:
                raise ConfigError(
                    f"reshard_after_forward={self.reshard_after_forward} contradicts "
                    f"sharding_strategy={self.sharding_strategy}, which implies {implied}; "
                    "choose the strategy and leave reshard_after_forward unset"
                )
        if self.shard_group_size is not None and not self.is_hybrid:
            raise ConfigError(f"shard_group_size={self.shard_group_size} applies to hybrid sharding only "
                              f"(HYBRID_SHARD, HYBRID_SHARD_ZERO2), not {self.sharding_strategy}")
        if self.fsdp_version == 2:
            # FSDP2 always prefetches the next module's all-gather before its
            # backward (an empty explicit list falls back to that default), and it
            # has no post-backward prefetch and no all-gather rate limiter to turn
            # off: these FSDP1 knobs have no FSDP2 counterpart.
            if self.backward_prefetch != "BACKWARD_PRE":
                raise ConfigError(
                    f"backward_prefetch={self.backward_prefetch} is FSDP1-only: FSDP2 always "
                    "prefetches before backward; use BACKWARD_PRE with fsdp_version=2"
                )
            if not self.limit_all_gathers:
                raise ConfigError(
                    "limit_all_gathers=false is FSDP1-only: FSDP2 bounds in-flight all-gathers "
                    "itself; leave it true with fsdp_version=2"
                )

    @property
    def is_hybrid(self) -> bool:
        return self.sharding_strategy in HYBRID_STRATEGIES

    def to_dict(self) -> dict[str, Any]:
        # Every field is a scalar but the class tuple; asdict's deep copy cost
        # most of a replayed study's time, which compares keys of every trial.
        data = {name: getattr(self, name) for name in _field_names(FsdpConfig)}
        data["transformer_layer_cls"] = list(self.transformer_layer_cls)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FsdpConfig:
        return _from_mapping(cls, data, "fsdp config")

    def replace(self, **changes: Any) -> FsdpConfig:
        # reshard_after_forward is derived: let it follow a changed strategy.
        if "sharding_strategy" in changes and "reshard_after_forward" not in changes:
            changes["reshard_after_forward"] = None
        return dataclasses.replace(self, **changes)

    def key(self) -> str:
        """A canonical string: equal keys mean the same configuration to measure."""
        cached = self.__dict__.get("_key")
        if cached is None:
            cached = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
            object.__setattr__(self, "_key", cached)  # frozen: computed once, never changes
        return cached

    def describe(self) -> str:
        """A short human label, for progress lines and tables."""
        parts = [
            f"FSDP{self.fsdp_version}",
            self.sharding_strategy,
            {"transformer_layer": "wrap=layer", "size_based": f"wrap>={self.min_num_params:.0e}", "none": "wrap=none"}[self.auto_wrap_policy],
            self.mixed_precision,
            f"ac={self.activation_checkpointing}",
        ]
        if self.forward_prefetch:
            parts.append("fwd-prefetch")
        if self.fsdp_version == 1:
            parts.append(f"bwd={self.backward_prefetch}")
            if not self.limit_all_gathers:
                parts.append("no-limit-ag")
        if self.is_hybrid:
            parts.append(f"shard={self.shard_group_size or 'node'}")
        if self.cpu_offload:
            parts.append("offload")
        if self.compile:
            parts.append("compile")
        parts.append(f"mbs={self.micro_batch_size}")
        return " ".join(parts)


@dataclass(frozen=True)
class LoraSpec:
    """The workload is LoRA fine-tuning (peft): adapters of rank ``rank`` on the
    modules named, over frozen base weights. Frozen weights have no gradients
    and no optimizer state, so memory goes to activations and the best
    configuration moves; a trial, its estimate and the exports all carry it.
    Field names are peft's ``LoraConfig`` names but ``rank`` (``r``)."""

    rank: int
    # peft scales the adapters' output by lora_alpha / r; throughput does not depend on it.
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    # Module names to adapt; empty: peft's default for the model type (q_proj and
    # v_proj for Llama), which the worker resolves and the result reports.
    target_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, (list, str)):
            names = self.target_modules.split(",") if isinstance(self.target_modules, str) else self.target_modules
            object.__setattr__(self, "target_modules", tuple(n.strip() for n in names if n.strip()))
        _check_type("rank", self.rank, int)
        if self.rank < 1:
            raise ConfigError(f"LoRA rank={self.rank} must be at least 1 (8 or 16 are usual)")
        _check_type("lora_alpha", self.lora_alpha, int)
        if self.lora_alpha < 1:
            raise ConfigError(f"lora_alpha={self.lora_alpha} must be at least 1")
        _check_type("lora_dropout", self.lora_dropout, float)
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_dropout={self.lora_dropout} must be at least 0 and below 1")
        for name in self.target_modules:
            if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
                raise ConfigError(f"LoRA target module {name!r} is not a module name (q_proj, v_proj, ...)")

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout,
                "target_modules": list(self.target_modules)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoraSpec:
        return _from_mapping(cls, data, "lora")

    def label(self) -> str:
        return f"lora{self.rank}"


# Untimed steps before timing: the first allocates optimizer state, the last
# (never the first) measures peak memory.
MIN_WARMUP_STEPS = 2

# A trial given ``abort_below_tokens_per_s`` is judged after this many timed
# steps: the worker stops there, and replays of a measured table charge that many.
ABORT_CHECK_STEPS = 2
# Most timed steps a trial runs by default. Trials of one configuration differ
# by more than a trial's steps do (benchmarks/results/noise_cpu.md: single-trial
# CV 7-18% against a step-time median known to +-3-5% from 6 steps), so beyond
# a few steps, time is better spent on another interleaved round than on more
# steps of one trial.
DEFAULT_TIMED_STEPS = 6
# On a GPU a step takes a fraction of a second against seconds to start a
# trial (6 steps of 0.18 s gave a 95% CI of +-10% on an H200): steps are timed
# until the median is known to --timing-ci, for at most this many seconds.
CUDA_TIMED_STEPS = 200
CUDA_TIMING_BUDGET_S = 8.0


def timing_defaults(device_type: str) -> tuple[int, float | None]:
    """(most timed steps, most seconds of them) for trials on ``device_type``."""
    return (CUDA_TIMED_STEPS, CUDA_TIMING_BUDGET_S) if device_type == "cuda" else (DEFAULT_TIMED_STEPS, None)
# On CPU the first warm-up step (optimizer state allocated, caches cold) runs
# at most about 1.5x a timed step's time; a first step this many times below
# the abort threshold already shows the trial is hopeless (fp16 on a CPU
# without fp16 units: 20x), and the rest of its warm-up is not worth waiting
# for. Not on CUDA, where the first step ran 8.3x (autotune.worker.train.first_step_judges).
WARMUP_ABORT_SLACK = 4.0


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
    # autotune.launch.locks.quiet_lock_path). None: nothing to keep quiet.
    quiet_lock: str | None = None
    # LoRA fine-tuning on frozen base weights; None: every parameter trains.
    lora: LoraSpec | None = None
    # Shallow trial (autotune.depth): copies of the model at these depths are timed, one after the other in this
    # job, and their line extended to ``full_depth`` blocks; empty: the model as it is.
    depths: tuple[int, ...] = ()
    full_depth: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.lora, Mapping):
            object.__setattr__(self, "lora", LoraSpec.from_dict(self.lora))
        if self.lora is not None and not isinstance(self.lora, LoraSpec):
            raise ConfigError("lora must be a LoraSpec or its dict")
        if isinstance(self.fsdp, Mapping):
            object.__setattr__(self, "fsdp", FsdpConfig.from_dict(self.fsdp))
        if not isinstance(self.fsdp, FsdpConfig):
            raise ConfigError("fsdp must be an FsdpConfig or its dict")
        _check_type("model", self.model, str)
        if not self.model:
            raise ConfigError("model must not be empty")
        for name in ("seq_len", "timed_steps", "nnodes", "grad_accum_steps"):
            _check_type(name, getattr(self, name), int)
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        _check_type("warmup_steps", self.warmup_steps, int)
        if self.warmup_steps < MIN_WARMUP_STEPS:
            raise ConfigError(
                f"warmup_steps={self.warmup_steps} must be at least {MIN_WARMUP_STEPS}: the first step allocates "
                "optimizer state and is never representative, and the last measures memory"
            )
        _check_type("seed", self.seed, int)
        _check_choice("device", self.device, DEVICES)
        _check_type("timing_ci", self.timing_ci, float)
        if not 0 <= self.timing_ci < 1:
            raise ConfigError(f"timing_ci={self.timing_ci} must be at least 0 and below 1 (0.02 means 2%)")
        if self.abort_below_tokens_per_s is not None:
            _check_type("abort_below_tokens_per_s", self.abort_below_tokens_per_s, float)
        _check_type("pin_ranks", self.pin_ranks, bool)
        if self.memory_budget_bytes is not None:
            _check_type("memory_budget_bytes", self.memory_budget_bytes, int)
            if self.memory_budget_bytes < 1:
                raise ConfigError(f"memory_budget_bytes={self.memory_budget_bytes} must be at least 1")
        if self.quiet_lock is not None:
            _check_type("quiet_lock", self.quiet_lock, str)
        if self.timing_budget_s is not None:
            _check_type("timing_budget_s", self.timing_budget_s, float)
            if self.timing_budget_s <= 0:
                raise ConfigError(f"timing_budget_s={self.timing_budget_s} must be greater than 0")
        if isinstance(self.depths, list):
            object.__setattr__(self, "depths", tuple(self.depths))
        if self.depths:
            if len(self.depths) < 2 or list(self.depths) != sorted(set(self.depths)) or self.depths[0] < 1:
                raise ConfigError(f"depths={list(self.depths)} must be two or more increasing block counts")
            if not isinstance(self.full_depth, int) or self.full_depth <= self.depths[-1]:
                raise ConfigError(f"full_depth={self.full_depth} must be deeper than the shallow copies {list(self.depths)}")

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
        return _from_mapping(cls, data, "trial request")


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
    # CUDA, capped: the cap, and memory outside the allocator that appeared after
    # it was last set (``outside_allocator`` is what the cap left room for): 0
    # when the cap emulated a GPU of the budget's size exactly.
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
        _check_choice("status", self.status, TRIAL_STATUSES)
        self.rank_memory = [
            RankMemory(**r) if isinstance(r, Mapping) else r for r in self.rank_memory
        ]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrialResult:
        return _from_mapping(cls, data, "trial result")


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


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write JSON so that a reader sees the old file or the whole new one, never half."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` so that a reader sees the old file or the whole new one, never half.

    The temporary file has a name of its own, so two writers of one path never
    collide; a killed writer leaves at most a stray temporary file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file private; exports and results are for sharing.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
