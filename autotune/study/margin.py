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


@dataclass(frozen=True)
class Margin:
    """Predicted device peak = tensor peak * factor + fixed bytes."""

    factor: float
    fixed_bytes: int
    source: str

    def apply(self, tensor_peak: int) -> int:
        return int(tensor_peak * self.factor + self.fixed_bytes)


def default_margin(device_type: str) -> Margin:
    if device_type == "cuda":
        return Margin(CUDA_MARGIN_FACTOR, CUDA_MARGIN_BYTES, "default CUDA margin")
    # On CPU the trial measures the same quantity the estimator predicts.
    return Margin(1.0, 0, "none (CPU trials measure tensor bytes too)")


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
    return Margin(round(factor, 4), fixed, f"calibrated on {len(ratios)} trials (median ratio {statistics.median(ratios):.3f})"
                  + (f" + {fixed / 2**30:.1f} GiB fixed" if fixed else ""))


def memory_key(cfg: FsdpConfig) -> str:
    """What decides the peak: the configuration less its all-gather rate limit,
    which changes when host-side work waits, not what is allocated."""
    data = cfg.to_dict()
    data.pop("limit_all_gathers")
    return json.dumps(data, sort_keys=True, separators=(",", ":"))
