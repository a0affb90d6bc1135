"""Where an expert starts: the memory frontier, the first launches of a search.

For the least communicating sharding strategy that fits, the largest micro
batch that fits with no, selective and full checkpointing; then each other
strategy once, at the choice expected fastest (:func:`frontier_configs`).
Every "fits" is a fake step of the memory estimate (seconds each), so
:class:`FrontierPlan` plans one strategy at a time, when the search is about
to launch it, and hands the next strategy's questions to the gate to answer
in the background while the trial in between runs. A strategy whose least
hungry configuration does not fit costs one question, not one per
checkpointing mode and precision: planning the whole frontier at once made a
gated Qwen2 study wait 80 s between its first two launches.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol, Sequence

from autotune.config import DIMENSION, DIMENSIONS, FsdpConfig

# Sharding strategies by how much they communicate, least first (the strategy's declared preference):
# with the memory to spare, less sharding is usually faster.
BY_COMMUNICATION = DIMENSION["sharding_strategy"].preferred
# The dimensions the frontier walks itself; among configurations equal in them, each other dimension's
# declared preference picks the variant an expert starts from.
FRONTIER_AXES = ("sharding_strategy", "shard_group_size", "mixed_precision", "activation_checkpointing",
                 "micro_batch_size")
_VARIANT_DIMENSIONS = tuple(d for d in DIMENSIONS if d.name not in FRONTIER_AXES)


def frontier_configs(candidates: list[FsdpConfig], fits: Callable[[FsdpConfig], bool], fast_precisions: tuple[str, ...],
                     speed: Callable[[FsdpConfig], float] = lambda c: 1.0) -> list[FsdpConfig]:
    """Where an expert starts, least communication first, in the fastest precision
    that fits, FSDP2 with one unit per layer where the space offers them:

    - for the least-communicating strategy that fits, the largest micro batch
      that fits with no checkpointing, with selective and with full
      checkpointing, fastest first by ``speed`` (the host's saturation curve
      decides whether a larger batch is worth its recomputation);
    - then, for every other strategy, the one of those that ``speed`` expects fastest.
    """
    return [cfg for seeds in frontier_by_strategy(candidates, fits, fast_precisions, speed) for cfg in seeds]


def frontier_by_strategy(candidates: list[FsdpConfig], fits: Callable[[FsdpConfig], bool],
                         fast_precisions: tuple[str, ...],
                         speed: Callable[[FsdpConfig], float] = lambda c: 1.0) -> Iterator[list[FsdpConfig]]:
    """:func:`frontier_configs` one strategy at a time: a search asks ``fits`` (a
    fake step each, seconds) only for the strategy it is about to launch, not
    for the whole frontier between two launches."""
    first = True
    for strategy, group_size in frontier_strategies(candidates):
        if not _most_frugal_fits([c for c in candidates if (c.sharding_strategy, c.shard_group_size or 0)
                                  == (strategy, group_size)], fits):
            continue  # the strategy cannot fit in any precision
        for precision in fast_precisions:
            group = [c for c in candidates if c.sharding_strategy == strategy
                     and (c.shard_group_size or 0) == group_size and c.mixed_precision == precision]
            if not _most_frugal_fits(group, fits):
                continue  # nothing in the group can fit: one fake step, not one per checkpointing mode
            chosen: list[FsdpConfig]
            if first:
                span = [cfg for mode in SPANNED_CHECKPOINTING if (cfg := _largest_fitting(group, mode,
                                                                                          fits)) is not None]
                chosen = sorted(span, key=lambda c: -speed(c))
            else:
                fastest = _fastest_fitting(group, fits, speed) if group else None
                chosen = [fastest] if fastest is not None else []
            if chosen:
                first = False
                yield chosen
                break


def frontier_strategies(candidates: list[FsdpConfig]) -> list[tuple[str, int]]:
    """(strategy, shard group size or 0), least communication first: the frontier's order."""
    return sorted({(c.sharding_strategy, c.shard_group_size or 0) for c in candidates},
                  key=lambda s: (BY_COMMUNICATION.index(s[0]), -s[1]))


# The checkpointing modes whose largest fitting micro batch the first strategy spans.
SPANNED_CHECKPOINTING = ("none", "selective", "full")


# Checkpointing modes and precisions, least memory first (their declared memory orders).
FRUGAL_CHECKPOINTING = DIMENSION["activation_checkpointing"].memory.frugal_order
FRUGAL_PRECISION = DIMENSION["mixed_precision"].memory.frugal_order


def most_frugal(group: list[FsdpConfig]) -> FsdpConfig | None:
    """The group's least hungry configuration: the most checkpointing, the smallest
    micro batch, two-byte parameters (the preferred variant of it)."""
    def rank(order: tuple[str, ...], value: str) -> int:
        return order.index(value) if value in order else len(order)

    return min(group, key=lambda c: (rank(FRUGAL_CHECKPOINTING, c.activation_checkpointing), c.micro_batch_size,
                                     rank(FRUGAL_PRECISION, c.mixed_precision), preferred(c)), default=None)


def _most_frugal_fits(group: list[FsdpConfig], fits: Callable[[FsdpConfig], bool]) -> bool:
    """Whether the group's least hungry configuration fits: when it does not,
    nothing else in the group does, and one fake step says so for all of them."""
    frugal = most_frugal(group)
    return frugal is not None and fits(frugal)


def preferred(c: FsdpConfig) -> tuple:
    """Among configurations of one size, the variant an expert starts from (each dimension's declared preference:
    FSDP2, one unit per layer, no extra prefetch, no offload or compile, whole-group resharding)."""
    return tuple(d.preference(getattr(c, d.name)) for d in _VARIANT_DIMENSIONS)


def _largest_fitting(group: list[FsdpConfig], checkpointing: str,
                     fits: Callable[[FsdpConfig], bool]) -> FsdpConfig | None:
    """The preferred variant of the largest micro batch that fits with ``checkpointing``."""
    options = sorted((c for c in group if c.activation_checkpointing == checkpointing),
                     key=lambda c: (-c.micro_batch_size, preferred(c)))
    seen_sizes: set[int] = set()
    for cfg in options:
        if cfg.micro_batch_size in seen_sizes:
            continue  # only the preferred variant of each size is tried
        seen_sizes.add(cfg.micro_batch_size)
        if fits(cfg):
            return cfg
    return None


def _fastest_fitting(group: list[FsdpConfig], fits: Callable[[FsdpConfig], bool],
                     speed: Callable[[FsdpConfig], float]) -> FsdpConfig | None:
    """The preferred variant of the (checkpointing, micro batch) expected fastest that fits."""
    best: dict[tuple, FsdpConfig] = {}
    for cfg in sorted(group, key=preferred):
        best.setdefault((cfg.activation_checkpointing, cfg.micro_batch_size), cfg)
    return next((cfg for cfg in sorted(best.values(), key=lambda c: -speed(c)) if fits(cfg)), None)


class FitOracle(Protocol):
    """What the search asks of the memory gate (:class:`autotune.study.gate.MemoryGate`)."""

    def fit_chance(self, cfg: FsdpConfig) -> tuple[float, str | None]:
        """(chance to fit, why not when it is 0), estimating if need be."""

    def free_chance(self, cfg: FsdpConfig) -> tuple[float, str | None] | None:
        """The same when it needs no fake step, else None."""

    def probably_over(self, cfg: FsdpConfig) -> bool:
        """Whether a rough model says a fake step of ``cfg`` would likely find it over budget."""

    def speculate(self, configs: list[FsdpConfig]) -> None:
        """Estimate these in the background, where the host has cores to spare."""


class FrontierPlan:
    """The frontier of one search, planned a strategy at a time (see the module)."""

    def __init__(self, candidates: list[FsdpConfig], gate: FitOracle, priors: Any, say: Callable[[str], None],
                 speculated: int, enabled: bool = True) -> None:
        self.candidates = candidates
        self.gate = gate
        self.priors = priors
        self.say = say
        self.speculated = speculated
        # The seeds planned so far, and the plan of the rest (made at the first
        # proposal, once the gate has planned).
        self.seeds: list[FsdpConfig] = []
        self._planning: Iterator[list[FsdpConfig]] | None = None
        self._open = enabled

    def next_seed(self, open_keys: set[str]) -> FsdpConfig | None:
        """The first seed not yet held, planning further strategies until one is found or none is left."""
        while True:
            seed = next((c for c in self.seeds if c.key() in open_keys), None)
            if seed is not None or not self._plan_next():
                return seed

    def complete(self) -> list[FsdpConfig]:
        """The whole frontier, planned to its end."""
        while self._plan_next():
            pass
        return list(self.seeds)

    def _plan_next(self) -> bool:
        """Plan the next strategy (its fake steps run now, those of the next ones in the
        background); False once the frontier is complete."""
        if not self._open:
            return False
        if self._planning is None:
            fast = tuple(sorted(self.priors.precision, key=lambda p: -self.priors.precision[p]))
            self._planning = frontier_by_strategy(self.candidates, lambda c: self.gate.fit_chance(c)[0] >= 1.0, fast,
                                                  self.priors.speed)
        seeds = next(self._planning, None)
        if seeds is None:
            self._open = False
            return False
        self.say(f"Frontier{', measured first' if not self.seeds else ''}: {'; '.join(c.describe() for c in seeds)}")
        self.seeds += seeds
        self.gate.speculate(self._next_strategy_needs())
        return True

    def _next_strategy_needs(self) -> list[FsdpConfig]:
        """The configurations the next strategies will be asked about first, fastest
        expected first: estimated while the trial in between runs."""
        planned = {(c.sharding_strategy, c.shard_group_size or 0) for c in self.seeds}
        fast = max(self.priors.precision, key=self.priors.precision.get)
        needs = []
        for strategy in [s for s in frontier_strategies(self.candidates) if s not in planned][:2]:
            group = [c for c in self.candidates if (c.sharding_strategy, c.shard_group_size or 0) == strategy
                     and c.mixed_precision == fast and self.gate.free_chance(c) is None]
            needs += sorted(group, key=lambda c: (-self.priors.speed(c), preferred(c)))[:self.speculated]
        return needs

    def first_needs(self) -> list[FsdpConfig]:
        """Configurations whose fit the frontier asks first: the span of the least
        communicating strategy in the fastest precision (:meth:`span_needs`), and
        the other strategies without checkpointing, at the space's smallest and
        largest micro batch (which bound every other of their class)."""
        strategies = sorted({c.sharding_strategy for c in self.candidates}, key=BY_COMMUNICATION.index)
        return self._ends({(s, "none") for s in strategies[1:]}, self.span_needs())

    def frugal_needs(self) -> list[FsdpConfig]:
        """Each strategy's least hungry configuration: the frontier's first question of
        it (:func:`frontier_by_strategy`), a fake step each."""
        return [cfg for strategy in frontier_strategies(self.candidates)
                if (cfg := most_frugal([c for c in self.candidates
                                        if (c.sharding_strategy, c.shard_group_size or 0) == strategy])) is not None]

    def span_needs(self) -> list[FsdpConfig]:
        """The fake steps the first strategy needs: its span's checkpointing modes at
        the space's smallest and largest micro batch, in the fastest precision. The
        first strategy is the least communicating one whose least hungry
        configuration is known to fit (after :meth:`frugal_needs`), else the first."""
        strategies = frontier_strategies(self.candidates)
        fitting = [s for s, frugal in zip(strategies, self.frugal_needs())
                   if (self.gate.free_chance(frugal) or (0.0, None))[0] >= 1.0]
        first = (fitting or strategies)[:1]
        return self._ends({(s, mode) for s, _ in first for mode in SPANNED_CHECKPOINTING})

    def _ends(self, wanted: set[tuple[str, str]], first: Sequence[FsdpConfig] = ()) -> list[FsdpConfig]:
        fast = max(self.priors.precision, key=self.priors.precision.get)
        sizes = sorted({c.micro_batch_size for c in self.candidates})
        picked: dict[tuple, FsdpConfig] = {(c.sharding_strategy, c.activation_checkpointing, c.micro_batch_size): c
                                           for c in first}
        for cfg in sorted(self.candidates, key=preferred):
            key = (cfg.sharding_strategy, cfg.activation_checkpointing, cfg.micro_batch_size)
            if (key[:2] in wanted and cfg.mixed_precision == fast and key[2] in (sizes[0], sizes[-1])
                    and not cfg.is_hybrid):
                picked.setdefault(key, cfg)
        return list(picked.values())
