"""The search dimensions, each declared once with everything the tuner knows about it.

A dimension is one field of :class:`~autotune.config.FsdpConfig` that a space
may vary. Its declaration holds, in one place:

- its values, its condition (drawn only when earlier choices make it matter)
  and the words a space file may write for a value;
- its effect on memory (:class:`MemoryOrder`): which value needs at least as
  much as which, and which offered value is the hungriest and the most frugal;
- its prior on speed, before any trial (log tokens/s, from the host probe where
  it can be measured);
- the host rule that rules a value out before launch;
- its equivalence rule: the simplest value that runs the same program;
- the variant an expert starts from, and how a progress line labels it;
- the worker's ``apply_*`` steps that consume it (by name, ``fsdp.apply_fsdp2``
  for ``autotune/worker/fsdp.py``: that file is exported verbatim and imports
  torch only, so it cannot read this table).

The memory gate, the memory order, the frontier, the search's prior, the
equivalence classes, the host check and :meth:`FsdpConfig.describe` are all
derived from these declarations (``tests/test_house.py`` checks each is
complete). A new dimension is a field of :class:`FsdpConfig`, one declaration
here, its ``apply_*`` argument and its export mapping.

Declarations are in drawing order: a condition or an equivalence rule may look
only at earlier dimensions' values (an equivalence rule sees them already
simplified).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from autotune.config.vocabulary import (
    ACTIVATION_CHECKPOINTING,
    AUTO_WRAP_POLICIES,
    BACKWARD_PREFETCH,
    FSDP_VERSIONS,
    HYBRID_STRATEGIES,
    MIXED_PRECISIONS,
    SHARDING_STRATEGIES,
    ConfigError,
)

Fields = Mapping[str, Any]


@dataclass(frozen=True)
class Topology:
    """What decides which configurations are one program: the ranks, the nodes and the model."""

    world_size: int
    nnodes: int = 1
    # Parameters and repeated blocks of the model (None: unknown, and the rules
    # that need them do not apply).
    num_params: int | None = None
    num_layers: int | None = None

    @property
    def node_size(self) -> int:
        return self.world_size // self.nnodes


class HostFacts(Protocol):
    """What priors and host rules read of the host probe (``autotune.launch.host.HostInfo``)."""

    @property
    def device_type(self) -> str: ...

    @property
    def bf16_supported(self) -> bool: ...

    @property
    def fp16_supported(self) -> bool: ...

    @property
    def compile_supported(self) -> bool: ...

    @property
    def compile_note(self) -> str | None: ...

    @property
    def bf16_is_fast(self) -> bool: ...

    @property
    def fp16_is_fast(self) -> bool: ...

    @property
    def saturation(self) -> Any: ...

    def efficiency(self, tokens: int) -> float: ...


@dataclass(frozen=True)
class SpeedContext:
    """What a prior on speed may read: the host probe and the sequence length of a micro batch."""

    host: HostFacts
    seq_len: int


@dataclass(frozen=True)
class Placement:
    """Where a configuration would run: the host, its nodes and ranks (None: not known yet)."""

    host: HostFacts
    nnodes: int = 1
    world_size: int | None = None


def _first(preference: Sequence[Any]) -> Callable[[Sequence[Any]], Any]:
    """The offered value that comes first in ``preference`` (else the first offered)."""
    def pick(options: Sequence[Any]) -> Any:
        return next((p for p in preference if p in options), options[0])

    return pick


@dataclass(frozen=True)
class MemoryOrder:
    """How a dimension moves the per-rank peak.

    ``at_least(a, b)``: a value ``a`` needs at least as much memory as ``b``,
    all else equal (measured on llama-tiny, tests/test_equivalence.py and
    benchmarks/results/estimator_accuracy_cpu.md); values with no sure sign
    are ordered only with themselves. ``hungriest`` and ``frugal`` pick, among
    the values a space offers, the one that costs most and least: the gate's
    "everything fits" shortcut is sound only if no dimension is left out of
    them. ``estimated``: False when the fake step's figure ignores the value
    (compiled blocks are estimated eagerly).
    """

    at_least: Callable[[Any, Any], bool]
    hungriest: Callable[[Sequence[Any]], Any]
    frugal: Callable[[Sequence[Any]], Any]
    estimated: bool = True
    # The values from least memory to most, where the dimension names them (the frontier's frugal order).
    frugal_order: tuple = ()


def ranked(*chains: tuple[Any, ...], hungriest: Sequence[Any], frugal: Sequence[Any]) -> MemoryOrder:
    """Values in chains, most memory first: ``a`` needs at least ``b`` when a comes before b in one of them."""
    def at_least(a: Any, b: Any) -> bool:
        return a == b or any(a in chain and b in chain and chain.index(a) < chain.index(b) for chain in chains)

    return MemoryOrder(at_least, _first(hungriest), _first(frugal), frugal_order=tuple(frugal))


def unordered(hungriest: Sequence[Any], frugal: Sequence[Any]) -> MemoryOrder:
    """No sure sign between values (configurations must agree on it to be compared)."""
    return MemoryOrder(lambda a, b: a == b, _first(hungriest), _first(frugal), frugal_order=tuple(frugal))


LARGER_NEEDS_MORE = MemoryOrder(lambda a, b: a >= b, max, min)
SMALLER_NEEDS_MORE = MemoryOrder(lambda a, b: a <= b, min, max)


def _smaller_group_needs_more(none_is_whole: bool) -> MemoryOrder:
    """Ranks per group: the fewer ranks share a parameter, the more each holds. None is the whole
    group when ``none_is_whole`` (larger than any other value), else a size not known here (one
    node's ranks), ordered only with itself."""
    def size(v: int | None) -> float:
        return math.inf if v is None else v

    def at_least(a: int | None, b: int | None) -> bool:
        return a == b or ((none_is_whole or None not in (a, b)) and size(a) <= size(b))

    def hungriest(options: Sequence[int | None]) -> int | None:
        known = [o for o in options if o is not None] if not none_is_whole else list(options)
        return min(known, key=size) if known else options[0]

    def frugal(options: Sequence[int | None]) -> int | None:
        return None if None in options else max(options, key=size)

    return MemoryOrder(at_least, hungriest, frugal)


def _no_rule(fields: Fields, topology: Topology, name: str) -> Any:
    return fields[name]


def _no_host_rule(value: Any, fields: Fields, placement: Placement) -> str | None:
    return None


def _no_prior(value: Any, context: SpeedContext) -> float:
    return 0.0


def _always(picked: Fields) -> bool:
    return True


@dataclass(frozen=True)
class Dimension:
    """One search dimension: see the module's docstring for what each part is for."""

    name: str
    kind: type
    # Allowed values, or None for "any integer >= minimum".
    allowed: tuple | None
    memory: MemoryOrder
    # What the value is expected to do to log tokens/s on this host, before any trial.
    prior: Callable[[Any, SpeedContext], float]
    # Why the value cannot run there, or None.
    host_rule: Callable[[Any, Fields, Placement], str | None]
    # The simplest value that runs the same program, given the fields (earlier ones already simplified).
    simplest: Callable[[Fields, Topology], Any]
    # Values an expert starts from, first first (the frontier's preferred variant); unlisted values come last.
    preferred: tuple
    # The worker's steps that consume the value, as ``module.function`` under autotune.worker (``fsdp.apply_fsdp2``).
    apply: tuple[str, ...]
    # The progress line's word for the value (None: nothing to say).
    label: Callable[[Any, Fields], str | None]
    # Whether the dimension is drawn, given the values drawn before it.
    applies: Callable[[Fields], bool] = _always
    # Words a space file may write for a value (``node`` for None: one node's ranks).
    aliases: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    minimum: int = 1

    def from_yaml(self, value: Any) -> Any:
        """The value a space file's word stands for (itself unless an alias)."""
        return self.aliases[value] if isinstance(value, str) and value in self.aliases else value

    def allowed_text(self) -> str:
        words = "".join(f", or {word}" for word in self.aliases)
        if self.allowed is None:
            return f"any integer >= {self.minimum}" + words
        return ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in self.allowed) + words

    def check(self, value: Any) -> None:
        """Raise :class:`ConfigError` naming the dimension, the value and what is allowed."""
        if value is None and None in self.aliases.values():
            return
        wrong_type = not isinstance(value, self.kind) or (self.kind is int and isinstance(value, bool))
        if wrong_type:
            kind = {int: "an integer", bool: "true or false", str: "a string"}[self.kind]
            raise ConfigError(f"{self.name}={value!r} is not {kind}; allowed values: {self.allowed_text()}")
        if (self.allowed is None and value < self.minimum) or (self.allowed is not None and value not in self.allowed):
            raise ConfigError(f"{self.name}={value!r} is not allowed; allowed values: {self.allowed_text()}")

    def preference(self, value: Any) -> int:
        """Where ``value`` stands in the expert's order (0: where an expert starts)."""
        return self.preferred.index(value) if value in self.preferred else len(self.preferred)


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
        "fsdp_version", int, FSDP_VERSIONS, unordered(hungriest=(2, 1), frugal=(2, 1)), _no_prior, _no_host_rule,
        lambda f, t: f["fsdp_version"], preferred=(2, 1), apply=("fsdp.parallelize",), label=lambda v, f: f"FSDP{v}"),
    Dimension(
        "sharding_strategy", str, SHARDING_STRATEGIES,
        ranked(("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"),
               hungriest=("NO_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2", "HYBRID_SHARD", "FULL_SHARD"),
               frugal=("FULL_SHARD", "HYBRID_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2", "NO_SHARD")),
        _no_prior, _no_host_rule, _simplest_strategy,
        # Least communication first: with memory to spare, less sharding is usually faster.
        preferred=("NO_SHARD", "HYBRID_SHARD_ZERO2", "SHARD_GRAD_OP", "HYBRID_SHARD", "FULL_SHARD"),
        apply=("fsdp.build_mesh", "fsdp.apply_fsdp1"), label=lambda v, f: v),
    Dimension(
        "auto_wrap_policy", str, AUTO_WRAP_POLICIES,
        unordered(hungriest=("none", "size_based", "transformer_layer"),
                  frugal=("transformer_layer", "size_based", "none")),
        _no_prior, _no_host_rule, _simplest_wrap, preferred=("transformer_layer",),
        apply=("fsdp.apply_fsdp1", "fsdp.apply_fsdp2"), label=_wrap_label),
    Dimension(
        "min_num_params", int, None, MemoryOrder(lambda a, b: a == b, max, min), _no_prior, _no_host_rule,
        _unused_unless(lambda f, t: f["auto_wrap_policy"] == "size_based", "min_num_params"),
        preferred=(), apply=("fsdp.apply_fsdp1", "fsdp.apply_fsdp2"), label=lambda v, f: None,
        applies=lambda p: p["auto_wrap_policy"] == "size_based"),
    Dimension(
        "mixed_precision", str, MIXED_PRECISIONS,
        ranked(("fp32", "bf16_fp32_reduce", "bf16"), ("fp32", "fp16", "bf16"),
               hungriest=("fp32", "bf16_fp32_reduce", "fp16", "bf16"), frugal=("bf16", "fp16", "bf16_fp32_reduce",
                                                                               "fp32")),
        lambda v, c: precision_effects(c.host)[v], _precision_rule, lambda f, t: f["mixed_precision"],
        preferred=(), apply=("fsdp.apply_fsdp1", "fsdp.apply_fsdp2"), label=lambda v, f: v),
    Dimension(
        "activation_checkpointing", str, ACTIVATION_CHECKPOINTING,
        # Selective checkpointing keeps the matmul outputs that full checkpointing
        # recomputes; every other layer keeps half the layers whole.
        ranked(("none", "selective", "full"), ("none", "every_other_layer", "full"),
               hungriest=("none", "selective", "every_other_layer", "full"),
               frugal=("full", "every_other_layer", "selective", "none")),
        lambda v, c: math.log(RECOMPUTE_SPEED[v]), _no_host_rule, _simplest_checkpointing,
        preferred=("none", "selective", "every_other_layer", "full"), apply=("fsdp.apply_activation_checkpointing",),
        label=lambda v, f: f"ac={v}"),
    Dimension(
        "forward_prefetch", bool, (False, True), LARGER_NEEDS_MORE, _no_prior, _no_host_rule,
        # With one FSDP unit there is no other unit to prefetch.
        _unused_unless(lambda f, t: f["auto_wrap_policy"] != "none", "forward_prefetch"),
        preferred=(False, True), apply=("fsdp.apply_fsdp1", "fsdp.apply_fsdp2_prefetch"),
        label=lambda v, f: "fwd-prefetch" if v else None),
    Dimension(
        "backward_prefetch", str, BACKWARD_PREFETCH,
        ranked(("BACKWARD_PRE", "none"), ("BACKWARD_POST", "none"),
               hungriest=("BACKWARD_PRE", "BACKWARD_POST", "none"), frugal=("none", "BACKWARD_POST", "BACKWARD_PRE")),
        _no_prior, _no_host_rule,
        _unused_unless(lambda f, t: not (f["fsdp_version"] == 1 and (f["auto_wrap_policy"] == "none"
                                                                     or _never_unshards(f))), "backward_prefetch"),
        preferred=("BACKWARD_PRE", "BACKWARD_POST", "none"), apply=("fsdp.apply_fsdp1",),
        label=lambda v, f: f"bwd={v}" if f["fsdp_version"] == 1 else None, applies=lambda p: p["fsdp_version"] == 1),
    Dimension(
        "limit_all_gathers", bool, (False, True), SMALLER_NEEDS_MORE, _no_prior, _no_host_rule,
        _unused_unless(lambda f, t: not _never_unshards(f), "limit_all_gathers"),
        preferred=(True, False), apply=("fsdp.apply_fsdp1",),
        label=lambda v, f: "no-limit-ag" if f["fsdp_version"] == 1 and not v else None,
        applies=lambda p: p["fsdp_version"] == 1),
    Dimension(
        "shard_group_size", int, None, _smaller_group_needs_more(none_is_whole=False), _no_prior,
        _shard_group_rule, _simplest_shard_group,
        preferred=(None,), apply=("fsdp.build_mesh",),
        label=lambda v, f: f"shard={v or 'node'}" if f["sharding_strategy"] in HYBRID_STRATEGIES else None,
        applies=lambda p: p["sharding_strategy"] in HYBRID_STRATEGIES, aliases={"node": None}),
    Dimension(
        "cpu_offload", bool, (False, True),
        # Offload moves parameters (and FSDP1's gradients) off the device.
        MemoryOrder(lambda a, b: a <= b, _first((False, True)), _first((True, False))),
        lambda v, c: -0.5 if v else 0.0, _offload_rule, lambda f, t: f["cpu_offload"],
        preferred=(False, True), apply=("fsdp.parallelize", "fsdp.apply_fsdp1", "fsdp.apply_fsdp2"),
        label=lambda v, f: "offload" if v else None),
    Dimension(
        "compile", bool, (False, True),
        MemoryOrder(lambda a, b: True, _first((False, True)), _first((False, True)), estimated=False),
        lambda v, c: compile_effect(c.host) if v else 0.0, _compile_rule, lambda f, t: f["compile"],
        preferred=(False, True), apply=("fsdp.apply_compile",), label=lambda v, f: "compile" if v else None),
    Dimension(
        "reshard_group_size", int, None, _smaller_group_needs_more(none_is_whole=True), _no_prior, _reshard_group_rule,
        _simplest_reshard_group, preferred=(None,), apply=("fsdp.apply_fsdp2",),
        label=lambda v, f: f"reshard={v}" if v is not None else None,
        applies=reshards_partially, aliases={"all": None}, minimum=2),
    Dimension(
        "micro_batch_size", int, None, LARGER_NEEDS_MORE, _micro_batch_prior, _no_host_rule,
        lambda f, t: f["micro_batch_size"], preferred=(), apply=("train.make_batch",), label=lambda v, f: f"mbs={v}"),
)
DIMENSION: dict[str, Dimension] = {d.name: d for d in DIMENSIONS}

# Each dimension's value when a space leaves it out, or a rule makes it meaningless (FsdpConfig's defaults).
DEFAULTS: dict[str, Any] = {
    "fsdp_version": 2, "sharding_strategy": "FULL_SHARD", "auto_wrap_policy": "transformer_layer",
    "min_num_params": 100_000_000, "mixed_precision": "fp32", "activation_checkpointing": "none",
    "forward_prefetch": False, "backward_prefetch": "BACKWARD_PRE", "limit_all_gathers": True,
    "shard_group_size": None, "cpu_offload": False, "compile": False, "micro_batch_size": 1,
    "reshard_group_size": None,
}


def extreme_fields(choices: Mapping[str, Sequence[Any]], hungriest: bool) -> dict[str, Any]:
    """The offered values that cost most (or least) memory, drawn in order so that a
    dimension that does not apply keeps its default."""
    picked: dict[str, Any] = {}
    for dim in DIMENSIONS:
        options = choices.get(dim.name)
        if options and dim.applies(picked):
            picked[dim.name] = (dim.memory.hungriest if hungriest else dim.memory.frugal)(tuple(options))
        else:
            picked[dim.name] = DEFAULTS[dim.name]
    return picked


def simplest_fields(fields: Fields, topology: Topology) -> dict[str, Any]:
    """Each dimension's simplest value, in drawing order (see :func:`autotune.study.equivalence.canonical`)."""
    working = dict(fields)
    for dim in DIMENSIONS:
        working[dim.name] = dim.simplest(working, topology)
    return working


def needs_at_least(a: Fields, b: Fields) -> bool:
    """Whether ``a`` needs at least as much memory per rank as ``b``: every dimension
    the fake step sees moves the same way, or is equal."""
    for dim in DIMENSIONS:
        if not dim.memory.estimated:
            continue
        x, y = a[dim.name], b[dim.name]
        if x != y and not dim.memory.at_least(x, y):
            return False
    return True


def host_reason(fields: Fields, placement: Placement) -> str | None:
    """The first dimension's reason why ``fields`` cannot run there, or None."""
    for dim in DIMENSIONS:
        reason = dim.host_rule(fields[dim.name], fields, placement)
        if reason is not None:
            return reason
    return None


def speed_prior(fields: Fields, context: SpeedContext) -> float:
    """The expected log tokens/s of ``fields`` relative to the host's best, summed over dimensions."""
    return sum(dim.prior(fields[dim.name], context) for dim in DIMENSIONS)


def describe(fields: Fields) -> str:
    """A short human label, for progress lines and tables."""
    return " ".join(word for dim in DIMENSIONS if (word := dim.label(fields[dim.name], fields)) is not None)
