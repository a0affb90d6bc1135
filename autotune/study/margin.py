"""The device margin on top of a predicted tensor peak, calibrated by what the study measured.

The fake step (:mod:`autotune.worker.estimate`) counts tensor bytes, exactly
what CPU trials measure. A CUDA device also holds its context, NCCL's buffers
and the caching allocator's rounding: a fixed term and a factor cover them,
and once a study has measured a few trials the factor is fitted to them.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Iterable

from autotune.config import FsdpConfig

# CUDA needs memory that no tensor accounts for: the context (about 0.5 GiB),
# NCCL's buffers, and the caching allocator's rounding and fragmentation.
CUDA_MARGIN_BYTES = int(1.5 * 2**30)
CUDA_MARGIN_FACTOR = 1.10
# Calibrate from the study only once it has this many measured trials.
MIN_CALIBRATION_TRIALS = 3
# How far the fake step over-predicts at worst: 10.1% (SHARD_GRAD_OP with full
# checkpointing, benchmarks/results/estimator_accuracy_cpu.md). A configuration
# predicted over the budget by less may still fit, and only a launch can tell.
ESTIMATE_SLACK = 0.10


@dataclass(frozen=True)
class Margin:
    """Predicted device peak = tensor peak * factor + fixed bytes; the peak
    could be as low as tensor peak * low_factor + fixed bytes."""

    factor: float
    fixed_bytes: int
    source: str
    low_factor: float = 1.0 - ESTIMATE_SLACK

    def apply(self, tensor_peak: int) -> int:
        return int(tensor_peak * self.factor + self.fixed_bytes)

    def lowest(self, tensor_peak: int) -> int:
        """The smallest device peak the prediction leaves plausible: above the
        budget even by this, a launch is a waste."""
        return int(tensor_peak * self.low_factor + self.fixed_bytes)


def default_margin(device_type: str) -> Margin:
    if device_type == "cuda":
        return Margin(CUDA_MARGIN_FACTOR, CUDA_MARGIN_BYTES, "default CUDA margin")
    # On CPU the trial measures the same quantity the estimator predicts.
    return Margin(1.0, 0, "none (CPU trials measure tensor bytes too)")


def fit_chance(margin: Margin, tensor_peak: int, budget_bytes: int) -> float:
    """How likely a configuration with this predicted tensor peak fits: 1 when
    even the margin's high side fits, 0 when even its low side does not, and
    where the budget falls between them otherwise."""
    high, low = margin.apply(tensor_peak), margin.lowest(tensor_peak)
    if high <= budget_bytes:
        return 1.0
    if low > budget_bytes:
        return 0.0
    return (budget_bytes - low) / max(1, high - low)


def calibrated_margin(pairs: Iterable[tuple[int, int]], device_type: str) -> Margin:
    """The margin from (measured, predicted) pairs of this study, the default
    until enough trials exist.

    The fixed term (context, NCCL buffers) stays: the measured peak includes
    that memory outside the allocator, so the factor fitted on top of it is
    the largest ratio of what remains to the prediction, and a configuration
    that fitted is never pruned by a model that under-predicts.
    """
    fixed = default_margin(device_type).fixed_bytes
    ratios = [(m - fixed) / p for m, p in pairs if m and p]
    if len(ratios) < MIN_CALIBRATION_TRIALS:
        return default_margin(device_type)
    factor = max(1.0, max(ratios))
    # The low side stays at least as wide as the estimator's known slack: a
    # handful of trials does not show how far the next one may fall below.
    low = min(1.0 - ESTIMATE_SLACK, min(ratios))
    source = (f"calibrated on {len(ratios)} trials (median ratio {statistics.median(ratios):.3f})"
              + (f" + {fixed / 2**30:.1f} GiB fixed" if fixed else ""))
    return Margin(round(factor, 4), fixed, source, low_factor=round(low, 4))


def memory_key(cfg: FsdpConfig) -> str:
    """What decides the peak: the configuration less its all-gather rate limit,
    which changes when host-side work waits, not what is allocated."""
    data = cfg.to_dict()
    data.pop("limit_all_gathers")
    return json.dumps(data, sort_keys=True, separators=(",", ":"))
