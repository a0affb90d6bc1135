"""The machinery of a search dimension's declaration.

A dimension is one field of :class:`~autotune.config.FsdpConfig` that a space may vary. Its declaration (a
:class:`Dimension`, in ``DIMENSIONS`` beside the record, :mod:`autotune.config.fsdp_configuration`) holds:

- its values, its condition (drawn only when earlier choices make it matter) and the words a space file may
  write for a value;
- its effect on memory (:class:`MemoryOrder`): which value needs at least as much as which, and which offered
  value is the hungriest and the most frugal;
- its prior on speed, before any trial (log tokens/s, from the host probe where it can be measured);
- the host rule that rules a value out before launch;
- its equivalence rule: the simplest value that runs the same program;
- the variant an expert starts from, and how a progress line labels it;
- the worker's ``apply_*`` steps that consume it, by name (``fsdp.apply_fsdp2`` for
  ``autotune/worker/fsdp.py``: that file is exported verbatim and imports torch only, so it cannot read the
  declarations).

What the tuner derives from the declarations is in :mod:`autotune.config.dimensions`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from autotune.config.vocabulary import ConfigError

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


def first_offered(preference: Sequence[Any]) -> Callable[[Sequence[Any]], Any]:
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

    return MemoryOrder(at_least, first_offered(hungriest), first_offered(frugal), frugal_order=tuple(frugal))


def unordered(hungriest: Sequence[Any], frugal: Sequence[Any]) -> MemoryOrder:
    """No sure sign between values (configurations must agree on it to be compared)."""
    return MemoryOrder(lambda a, b: a == b, first_offered(hungriest), first_offered(frugal), frugal_order=tuple(frugal))


LARGER_NEEDS_MORE = MemoryOrder(lambda a, b: a >= b, max, min)
SMALLER_NEEDS_MORE = MemoryOrder(lambda a, b: a <= b, min, max)


def smaller_group_needs_more(none_is_whole: bool) -> MemoryOrder:
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


def no_host_rule(value: Any, fields: Fields, placement: Placement) -> str | None:
    return None


def no_prior(value: Any, context: SpeedContext) -> float:
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
