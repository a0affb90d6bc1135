"""One FSDP configuration: what the tuner searches over, what a trial applies and what is exported, and each of
its search dimensions declared once, below the record (see :mod:`autotune.config.dimension_kit` for what a
declaration holds, :mod:`autotune.config.dimensions` for what is derived from them).

A new dimension is a field here, its declaration in ``DIMENSIONS`` (in drawing order: a condition or an
equivalence rule may look only at earlier dimensions), its argument in the worker's apply step and its mapping
in each export.

>>> cfg = FsdpConfig(fsdp_version=1, sharding_strategy="SHARD_GRAD_OP")
>>> cfg.reshard_after_forward
False
>>> FsdpConfig.from_dict(cfg.to_dict()) == cfg
True
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from autotune.config.dimension_kit import (
    LARGER_NEEDS_MORE,
    SMALLER_NEEDS_MORE,
    Dimension,
    Fields,
    HostFacts,
    MemoryOrder,
    Placement,
    SpeedContext,
    Topology,
    first_offered,
    no_host_rule,
    no_prior,
    ranked,
    smaller_group_needs_more,
    unordered,
)
from autotune.config.vocabulary import (
    ACTIVATION_CHECKPOINTING,
    AUTO_WRAP_POLICIES,
    BACKWARD_PREFETCH,
    FSDP_VERSIONS,
    HYBRID_STRATEGIES,
    MIXED_PRECISIONS,
    RESHARD_AFTER_FORWARD,
    SHARDING_STRATEGIES,
    ConfigError,
    check_type,
    field_names,
    from_mapping,
)


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
    # FSDP2 FULL_SHARD / HYBRID_SHARD: after forward, parameters are resharded onto groups of this
    # many ranks (fully_shard's reshard_after_forward as an int: the backward all-gather stays within
    # the group, one node's ranks for example), not the whole shard group; None: the whole group.
    reshard_group_size: int | None = None
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
        for dimension in DIMENSIONS:
            dimension.check(getattr(self, dimension.name))
        for cls_name in self.transformer_layer_cls:
            if not isinstance(cls_name, str) or not cls_name.isidentifier():
                raise ConfigError(f"transformer_layer_cls entry {cls_name!r} is not a class name")
        if self.reshard_after_forward is not None:
            check_type("reshard_after_forward", self.reshard_after_forward, bool)
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
        if self.reshard_group_size is not None and not reshards_partially(self.to_dict()):
            raise ConfigError(f"reshard_group_size={self.reshard_group_size} applies to FSDP2 with FULL_SHARD or "
                              f"HYBRID_SHARD only, not FSDP{self.fsdp_version} {self.sharding_strategy}")
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
        data = {name: getattr(self, name) for name in field_names(FsdpConfig)}
        data["transformer_layer_cls"] = list(self.transformer_layer_cls)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FsdpConfig:
        return from_mapping(cls, data, "fsdp config")

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
        """A short human label, for progress lines and tables: each dimension's word."""
        fields = self.to_dict()
        return " ".join(word for dim in DIMENSIONS if (word := dim.label(fields[dim.name], fields)) is not None)


# -- Priors on speed: FSDP practice, and the host probe where it measures -------------------------------------------

def precision_effects(host: HostFacts) -> dict[str, float]:
    """What each precision is expected to do to log tokens/s on this host: the
    host probe says which low precisions this device runs fast."""
    if host.bf16_is_fast:
        effects = {"fp32": -0.3, "bf16": 0.3, "bf16_fp32_reduce": 0.25}
    else:
        effects = {"fp32": 0.0, "bf16": -0.5, "bf16_fp32_reduce": -0.55}
    # With fp16 units, fp16 is about as fast as bf16 (less its grad scaler);
    # without them it runs far slower than fp32 (20x on this CPU).
    effects["fp16"] = 0.25 if host.fp16_is_fast else -1.0
    return effects


# The share of a step's speed each checkpointing mode keeps: full checkpointing
# recomputes the whole forward (three passes of work become four), every other
# layer half of that, selective only the elementwise work between the matmuls
# and attention it keeps.
RECOMPUTE_SPEED = {"none": 1.0, "selective": 0.92, "every_other_layer": 0.87, "full": 0.75}


def compile_effect(host: HostFacts) -> float:
    """torchtitan reports +15% for Llama 3.1 8B on H100s; on a CPU the gain is
    small and the first compiled trial pays tens of seconds of compilation."""
    return 0.1 if host.device_type == "cuda" else -0.1


def _micro_batch_prior(mbs: int, context: SpeedContext) -> float:
    """The log of the device's efficiency at the batch's tokens per step (the probe's
    saturation curve); without a curve, a mild preference for larger batches."""
    if context.host.saturation:
        return math.log(max(1e-3, context.host.efficiency(mbs * context.seq_len)))
    return 0.1 * math.log2(mbs)


# -- Host rules --------------------------------------------------------------------------------------------------------

def _precision_rule(value: str, fields: Fields, placement: Placement) -> str | None:
    if value.startswith("bf16") and not placement.host.bf16_supported:
        return "bf16 is not supported on this device"
    if value == "fp16" and not placement.host.fp16_supported:
        return "fp16 is not supported on this device"
    return None


def _shard_group_rule(value: int | None, fields: Fields, placement: Placement) -> str | None:
    world = placement.world_size
    if fields["sharding_strategy"] in HYBRID_STRATEGIES and world is not None and value is not None and world % value:
        return f"shard_group_size={value} does not divide the {world} ranks into equal shard groups"
    return None


def shard_ranks(fields: Fields, world_size: int, nnodes: int) -> int:
    """Ranks a parameter is sharded over: all of them, one node's or the hybrid shard group's (1: NO_SHARD)."""
    strategy = fields["sharding_strategy"]
    if strategy == "NO_SHARD":
        return 1
    if strategy in HYBRID_STRATEGIES:
        return fields["shard_group_size"] or world_size // nnodes
    return world_size


def _reshard_group_rule(value: int | None, fields: Fields, placement: Placement) -> str | None:
    if value is None or placement.world_size is None:
        return None
    shard = shard_ranks(fields, placement.world_size, placement.nnodes)
    if shard % value:
        return f"reshard_group_size={value} does not divide the {shard} ranks a parameter is sharded over"
    return None


def _offload_rule(value: bool, fields: Fields, placement: Placement) -> str | None:
    if value and placement.host.device_type != "cuda":
        return "cpu_offload needs an accelerator: on a CPU-only host PyTorch refuses it"
    return None


def _compile_rule(value: bool, fields: Fields, placement: Placement) -> str | None:
    if value and not placement.host.compile_supported:
        return f"compile needs a toolchain for torch.compile's kernels: {placement.host.compile_note}"
    return None


# -- Equivalence rules (each checked by measuring: tests/test_equivalence.py) ------------------------------------

def _simplest_strategy(fields: Fields, topology: Topology) -> str:
    """A hybrid strategy whose shard groups span every rank is its non-hybrid
    strategy; one whose groups hold one rank replicates everything (FSDP1 clamps
    a one-rank group to NO_SHARD). At one rank, FSDP1 runs every strategy as
    NO_SHARD, and FSDP2's SHARD_GRAD_OP keeps what NO_SHARD keeps."""
    strategy = fields["sharding_strategy"]
    if strategy in HYBRID_STRATEGIES:
        group = fields["shard_group_size"] or topology.node_size
        if group == topology.world_size:
            strategy = "FULL_SHARD" if strategy == "HYBRID_SHARD" else "SHARD_GRAD_OP"
        elif group == 1:
            strategy = "NO_SHARD"
    if topology.world_size == 1 and (fields["fsdp_version"] == 1 or strategy == "SHARD_GRAD_OP"):
        strategy = "NO_SHARD"
    return strategy


def _simplest_wrap(fields: Fields, topology: Topology) -> str:
    """Size-based wrapping whose threshold exceeds the whole model wraps nothing but the root."""
    if fields["auto_wrap_policy"] == "size_based" and topology.num_params is not None \
            and fields["min_num_params"] > topology.num_params:
        return "none"
    return fields["auto_wrap_policy"]


def _unused_unless(condition: Callable[[Fields, Topology], bool], name: str) -> Callable[[Fields, Topology], Any]:
    """The value, or the vocabulary's default where ``condition`` makes it do nothing."""
    def simplest(fields: Fields, topology: Topology) -> Any:
        return fields[name] if condition(fields, topology) else DEFAULTS[name]

    return simplest


def _never_unshards(fields: Fields) -> bool:
    """FSDP1 NO_SHARD in fp32 never unshards: no all-gather, no cast."""
    return (fields["fsdp_version"] == 1 and fields["sharding_strategy"] == "NO_SHARD"
            and fields["mixed_precision"] == "fp32")


def _simplest_checkpointing(fields: Fields, topology: Topology) -> str:
    """Checkpointing every other layer of a one-layer model is checkpointing it."""
    if fields["activation_checkpointing"] == "every_other_layer" and topology.num_layers == 1:
        return "full"
    return fields["activation_checkpointing"]


def _simplest_shard_group(fields: Fields, topology: Topology) -> int | None:
    """Only hybrid strategies have shard groups; one node's ranks is the simpler name of that size."""
    value = fields["shard_group_size"]
    if fields["sharding_strategy"] not in HYBRID_STRATEGIES or value == topology.node_size:
        return None
    return value


def reshards_partially(fields: Fields) -> bool:
    """Whether a post-forward reshard group applies: FSDP2 strategies that reshard after forward."""
    return fields["fsdp_version"] == 2 and fields["sharding_strategy"] in ("FULL_SHARD", "HYBRID_SHARD")


def _simplest_reshard_group(fields: Fields, topology: Topology) -> int | None:
    """A reshard group of every rank a parameter is sharded over is plain resharding: torch's
    ``_get_post_forward_mesh_info`` turns an int equal to the shard mesh's size into True."""
    value = fields["reshard_group_size"]
    if value is None or not reshards_partially(fields):
        return None
    return None if value >= shard_ranks(fields, topology.world_size, topology.nnodes) else value


# -- The declarations, in drawing order ----------------------------------------------------------------------

def _wrap_label(value: str, fields: Fields) -> str:
    return {"transformer_layer": "wrap=layer", "size_based": f"wrap>={fields['min_num_params']:.0e}",
            "none": "wrap=none"}[value]


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension(
        "fsdp_version", int, FSDP_VERSIONS, unordered(hungriest=(2, 1), frugal=(2, 1)), no_prior, no_host_rule,
        lambda f, t: f["fsdp_version"], preferred=(2, 1), apply=("fsdp.parallelize",), label=lambda v, f: f"FSDP{v}"),
    Dimension(
        "sharding_strategy", str, SHARDING_STRATEGIES,
        ranked(("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"),
               hungriest=("NO_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2", "HYBRID_SHARD", "FULL_SHARD"),
               frugal=("FULL_SHARD", "HYBRID_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2", "NO_SHARD")),
        no_prior, no_host_rule, _simplest_strategy,
        # Least communication first: with memory to spare, less sharding is usually faster.
        preferred=("NO_SHARD", "HYBRID_SHARD_ZERO2", "SHARD_GRAD_OP", "HYBRID_SHARD", "FULL_SHARD"),
        apply=("fsdp.build_mesh", "fsdp.apply_fsdp1"), label=lambda v, f: v),
    Dimension(
        "auto_wrap_policy", str, AUTO_WRAP_POLICIES,
        unordered(hungriest=("none", "size_based", "transformer_layer"),
                  frugal=("transformer_layer", "size_based", "none")),
        no_prior, no_host_rule, _simplest_wrap, preferred=("transformer_layer",),
        apply=("fsdp.apply_fsdp1", "fsdp.apply_fsdp2"), label=_wrap_label),
    Dimension(
        "min_num_params", int, None, MemoryOrder(lambda a, b: a == b, max, min), no_prior, no_host_rule,
        _unused_unless(lambda f, t: f["auto_wrap_policy"] == "size_based", "min_num_params"),
        preferred=(), apply=("fsdp.apply_fsdp1", "fsdp.apply_fsdp2"), label=lambda v, f: None,
        applies=lambda p: p["auto_wrap_policy"] == "size_based"),
    Dimension(
        "mixed_precision", str, MIXED_PRECISIONS,
        ranked(("fp32", "bf16_fp32_reduce", "bf16"), ("fp32", "fp16", "bf16"),
               hungriest=("fp32", "bf16_fp32_reduce", "fp16", "bf16"),
               frugal=("bf16", "fp16", "bf16_fp32_reduce", "fp32")),
        lambda v, c: precision_effects(c.host)[v], _precision_rule, lambda f, t: f["mixed_precision"],
        preferred=(), apply=("fsdp.apply_fsdp1", "fsdp.apply_fsdp2"), label=lambda v, f: v),
    Dimension(
        "activation_checkpointing", str, ACTIVATION_CHECKPOINTING,
        # Selective checkpointing keeps the matmul outputs that full checkpointing
        # recomputes; every other layer keeps half the layers whole.
        ranked(("none", "selective", "full"), ("none", "every_other_layer", "full"),
               hungriest=("none", "selective", "every_other_layer", "full"),
               frugal=("full", "every_other_layer", "selective", "none")),
        lambda v, c: math.log(RECOMPUTE_SPEED[v]), no_host_rule, _simplest_checkpointing,
        preferred=("none", "selective", "every_other_layer", "full"), apply=("fsdp.apply_activation_checkpointing",),
        label=lambda v, f: f"ac={v}"),
    Dimension(
        "forward_prefetch", bool, (False, True), LARGER_NEEDS_MORE, no_prior, no_host_rule,
        # With one FSDP unit there is no other unit to prefetch.
        _unused_unless(lambda f, t: f["auto_wrap_policy"] != "none", "forward_prefetch"),
        preferred=(False, True), apply=("fsdp.apply_fsdp1", "fsdp.apply_fsdp2_prefetch"),
        label=lambda v, f: "fwd-prefetch" if v else None),
    Dimension(
        "backward_prefetch", str, BACKWARD_PREFETCH,
        ranked(("BACKWARD_PRE", "none"), ("BACKWARD_POST", "none"),
               hungriest=("BACKWARD_PRE", "BACKWARD_POST", "none"), frugal=("none", "BACKWARD_POST", "BACKWARD_PRE")),
        no_prior, no_host_rule,
        _unused_unless(lambda f, t: not (f["fsdp_version"] == 1 and (f["auto_wrap_policy"] == "none"
                                                                     or _never_unshards(f))), "backward_prefetch"),
        preferred=("BACKWARD_PRE", "BACKWARD_POST", "none"), apply=("fsdp.apply_fsdp1",),
        label=lambda v, f: f"bwd={v}" if f["fsdp_version"] == 1 else None, applies=lambda p: p["fsdp_version"] == 1),
    Dimension(
        "limit_all_gathers", bool, (False, True), SMALLER_NEEDS_MORE, no_prior, no_host_rule,
        _unused_unless(lambda f, t: not _never_unshards(f), "limit_all_gathers"),
        preferred=(True, False), apply=("fsdp.apply_fsdp1",),
        label=lambda v, f: "no-limit-ag" if f["fsdp_version"] == 1 and not v else None,
        applies=lambda p: p["fsdp_version"] == 1),
    Dimension(
        "shard_group_size", int, None, smaller_group_needs_more(none_is_whole=False), no_prior,
        _shard_group_rule, _simplest_shard_group,
        preferred=(None,), apply=("fsdp.build_mesh",),
        label=lambda v, f: f"shard={v or 'node'}" if f["sharding_strategy"] in HYBRID_STRATEGIES else None,
        applies=lambda p: p["sharding_strategy"] in HYBRID_STRATEGIES, aliases={"node": None}),
    Dimension(
        "cpu_offload", bool, (False, True),
        # Offload moves parameters (and FSDP1's gradients) off the device.
        MemoryOrder(lambda a, b: a <= b, first_offered((False, True)), first_offered((True, False))),
        lambda v, c: -0.5 if v else 0.0, _offload_rule, lambda f, t: f["cpu_offload"],
        preferred=(False, True), apply=("fsdp.parallelize", "fsdp.apply_fsdp1", "fsdp.apply_fsdp2"),
        label=lambda v, f: "offload" if v else None),
    Dimension(
        "compile", bool, (False, True),
        MemoryOrder(lambda a, b: True, first_offered((False, True)), first_offered((False, True)), estimated=False),
        lambda v, c: compile_effect(c.host) if v else 0.0, _compile_rule, lambda f, t: f["compile"],
        preferred=(False, True), apply=("fsdp.apply_compile",), label=lambda v, f: "compile" if v else None),
    Dimension(
        "reshard_group_size", int, None, smaller_group_needs_more(none_is_whole=True), no_prior, _reshard_group_rule,
        _simplest_reshard_group, preferred=(None,), apply=("fsdp.apply_fsdp2",),
        label=lambda v, f: f"reshard={v}" if v is not None else None,
        applies=reshards_partially, aliases={"all": None}, minimum=2),
    Dimension(
        "micro_batch_size", int, None, LARGER_NEEDS_MORE, _micro_batch_prior, no_host_rule,
        lambda f, t: f["micro_batch_size"], preferred=(), apply=("train.measure",), label=lambda v, f: f"mbs={v}"),
)


# Each dimension's value when a space leaves it out, or a rule makes it meaningless.
DEFAULTS: dict[str, Any] = {d.name: getattr(FsdpConfig, d.name) for d in DIMENSIONS}
