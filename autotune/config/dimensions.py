"""What the tuner derives from the search dimensions' declarations (:mod:`autotune.config.fsdp_configuration`):
the hungriest and most frugal configuration of a space, the memory order, the host check, the prior on speed and
the simplest member of an equivalence class. The memory gate, the frontier, the search and the equivalence
classes read these, never a dimension by name; ``tests/test_house.py`` checks every declaration is whole."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from autotune.config.dimension_kit import (  # noqa: F401 - the names a reader of dimensions imports
    Dimension,
    Fields,
    HostFacts,
    MemoryOrder,
    Placement,
    SpeedContext,
    Topology,
)
from autotune.config.fsdp_configuration import (  # noqa: F401
    DEFAULTS,
    DIMENSIONS,
    RECOMPUTE_SPEED,
    compile_effect,
    precision_effects,
    reshards_partially,
    shard_ranks,
)

DIMENSION: dict[str, Dimension] = {d.name: d for d in DIMENSIONS}


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
