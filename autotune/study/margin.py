"""The device margin on top of a predicted tensor peak, calibrated by what the study measured.

The fake step (:mod:`autotune.worker.estimate`) counts tensor bytes, exactly
what CPU trials measure. A CUDA device also holds its context, NCCL's buffers
and the caching allocator's rounding: a fixed term and a factor cover them,
and once a study has measured a few trials the factor is fitted to them.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import Iterable

from autotune.config import FsdpConfig

# CUDA needs memory that no tensor accounts for: the context (about 0.5 GiB),
# NCCL's buffers, and the caching allocator's rounding and fragmentation.
CUDA_MARGIN_BYTES = int(1.5 * 2**30)
CUDA_MARGIN_FACTOR = 1.10
# Calibrate from the study only once it has this many measured trials.
MIN_CALIBRATION_TRIALS = 3
# How far the fake step over-predicts at worst, by how the figure was made
# (measured/predicted over the 144 configurations of benchmarks/data/grid_cpu.csv
# and benchmarks/results/estimator_accuracy_cpu.md): a real fake step at least
# 0.965, FSDP1 SHARD_GRAD_OP (derived from FULL_SHARD) at least 0.898. A
# configuration predicted over the budget by less may still fit, and only a
# launch can tell; one predicted over it by more is not worth a launch.
ESTIMATE_SLACK = {"exact": 0.04, "derived": 0.11}


def method_class(method: str | None) -> str:
    """"derived" for figures partly derived rather than run (see autotune.worker.estimate), else "exact"."""
    return "derived" if method and "derived" in method else "exact"


@dataclass(frozen=True)
class Margin:
    """Predicted device peak = tensor peak * factor + fixed bytes; the peak
    could be as low as tensor peak * low factor + fixed bytes, the low factor
    being the estimator's known slack for the figure's method, or lower where
    this study measured lower (``low_factors``, by method class)."""

    factor: float
    fixed_bytes: int
    source: str
    low_factors: dict[str, float] = field(default_factory=dict)

    def apply(self, tensor_peak: int) -> int:
        return int(tensor_peak * self.factor + self.fixed_bytes)

    def low_factor(self, method: str | None = None) -> float:
        kind = method_class(method)
        return min(1.0 - ESTIMATE_SLACK[kind], self.low_factors.get(kind, 1.0))

    def lowest(self, tensor_peak: int, method: str | None = None) -> int:
        """The smallest device peak the prediction leaves plausible: above the
        budget even by this, a launch is a waste."""
        return int(tensor_peak * self.low_factor(method) + self.fixed_bytes)


def default_margin(device_type: str) -> Margin:
    if device_type == "cuda":
        return Margin(CUDA_MARGIN_FACTOR, CUDA_MARGIN_BYTES, "default CUDA margin")
    # On CPU the trial measures the same quantity the estimator predicts.
    return Margin(1.0, 0, "none (CPU trials measure tensor bytes too)")


def fit_chance(margin: Margin, tensor_peak: int, budget_bytes: int, method: str | None = None) -> float:
    """How likely a configuration with this predicted tensor peak fits: 1 when
    even the margin's high side fits, 0 when even its low side does not, and
    where the budget falls between them otherwise."""
    high, low = margin.apply(tensor_peak), margin.lowest(tensor_peak, method)
    if high <= budget_bytes:
        return 1.0
    if low > budget_bytes:
        return 0.0
    return (budget_bytes - low) / max(1, high - low)


def calibrated_margin(pairs: Iterable[tuple], device_type: str) -> Margin:
    """The margin from (measured, predicted[, method]) triples of this study, the default
    until enough trials exist.

    The fixed term (context, NCCL buffers) stays: the measured peak includes
    that memory outside the allocator, so the factor fitted on top of it is
    the largest ratio of what remains to the prediction, and a configuration
    that fitted is never pruned by a model that under-predicts.
    """
    fixed = default_margin(device_type).fixed_bytes
    measured = [((m - fixed) / p, method_class(rest[0] if rest else None)) for m, p, *rest in pairs if m and p]
    ratios = [r for r, _ in measured]
    if len(ratios) < MIN_CALIBRATION_TRIALS:
        return default_margin(device_type)
    factor = max(1.0, max(ratios))
    # The low side only widens: a handful of trials does not show how far the
    # next one may fall below, so the known slack stays the floor (Margin.low_factor).
    lows = {kind: round(min(r for r, k in measured if k == kind), 4) for kind in {k for _, k in measured}}
    source = (f"calibrated on {len(ratios)} trials (median ratio {statistics.median(ratios):.3f})"
              + (f" + {fixed / 2**30:.1f} GiB fixed" if fixed else ""))
    return Margin(round(factor, 4), fixed, source, low_factors=lows)


def memory_key(cfg: FsdpConfig) -> str:
    """What decides the peak: the configuration less its all-gather rate limit,
    which changes when host-side work waits, not what is allocated."""
    data = cfg.to_dict()
    data.pop("limit_all_gathers")
    return json.dumps(data, sort_keys=True, separators=(",", ":"))
