"""A deep model's fake step from two shallow copies: which depths to step, and how each kind of moment's figures
extend to the model's depth (see :class:`autotune.worker.breakdown_tracker.BreakdownTracker` for why each kind
is extended on its own)."""

from __future__ import annotations

from typing import Any

import math

from autotune.config import FsdpConfig
from autotune.worker.block_pattern import UNIFORM, BlockPattern
from autotune.worker.models import is_mixture_of_experts

# Models with at least this many blocks are estimated from 3- and 4-block copies;
# shallower ones run whole, which costs little more.
EXTRAPOLATE_FROM_BLOCKS = 8


def block_period(cfg: FsdpConfig, pattern: BlockPattern = UNIFORM) -> int:
    """Blocks after which the step repeats itself: the model's own pattern of blocks (alternating attention,
    dense and MoE blocks), in pairs where every other block is checkpointed (a size-based unit never spans two
    blocks: their container is never a unit)."""
    return math.lcm(pattern.period, 2 if cfg.activation_checkpointing == "every_other_layer" else 1)


def extrapolation_points(cfg: FsdpConfig, blocks: int, pattern: BlockPattern = UNIFORM) -> tuple[int, int]:
    """The two depths to run for a model of ``blocks`` blocks: one period
    apart, past the pattern's prefix, each with room for the first and last few blocks of
    :class:`~autotune.worker.breakdown_tracker.BreakdownTracker` (one more than the period), and in the model's
    phase of the period, so that its last block is of the kind theirs is (checkpointed, an MoE block).
    Not 2 blocks: there the first block's and the last block's special cases
    (the last one is not resharded after forward, backward starts on it)
    overlap at the peak, and 2 -> 3 grew 19% more than any later block did
    (HSDP with selective checkpointing on llama-tiny)."""
    period = block_period(cfg, pattern)
    low = pattern.prefix + max(3, 2 * period)
    low += (blocks - low) % period
    return low, low + period


def not_extrapolated(model: str, cfg: FsdpConfig) -> str | None:
    """Why ``cfg`` of ``model`` is estimated whole however deep the model, or None.

    FSDP1's size-based units of a mixture-of-experts block are not affine in
    depth: from 3 and 4 blocks an 8-block Mixtral came out 1.6-7.3% over the
    whole step in 5 of 12 such configurations, against under 0.3% for every
    other class sampled (benchmarks/results/estimator_extrapolation_cpu.md)."""
    if cfg.fsdp_version == 1 and cfg.auto_wrap_policy == "size_based" and is_mixture_of_experts(model):
        return "fsdp1_size_based_moe"
    return None


def extrapolate_moments(low: dict[str, dict[str, Any]], high: dict[str, dict[str, Any]], low_n: int, high_n: int,
                        blocks: int) -> dict[str, dict[str, Any]]:
    """Each kind of moment's peak and breakdown at ``blocks`` blocks, on the line through the copies of ``low_n``
    and ``high_n`` blocks (their ``moments``). Each phase's peak(L) = peak(low) + (L - low) * per-block growth.
    A middle block is the same moment as the blocks on either side of it (see BreakdownTracker)."""
    def at_depth(a: int, b: int) -> int:
        return round(a + (blocks - low_n) * (b - a) / (high_n - low_n))

    moments = {}
    for kind in high.keys() & low.keys() - {k for k in high if k.endswith("/middle")}:
        a, b = low[kind], high[kind]
        moments[kind] = {"peak_bytes": at_depth(a["peak_bytes"], b["peak_bytes"]),
                         "breakdown": {k: max(0, at_depth(a["breakdown"].get(k, 0), v))
                                       for k, v in b["breakdown"].items()}}
    return moments


def largest(moments: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The step's peak and its breakdown: those of the kind of moment that peaks highest."""
    kind = max(moments, key=lambda k: moments[k]["peak_bytes"])
    return {"peak_bytes": moments[kind]["peak_bytes"], "breakdown": dict(moments[kind]["breakdown"]), "peak_at": kind}
