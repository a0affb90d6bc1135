"""The device margin on top of a predicted tensor peak, calibrated by what the study measured.

The fake step (:mod:`autotune.worker.fake_step`) counts tensor bytes: what a
CPU trial measures, and what CUDA's caching allocator must hold (its
*allocated* peak). On CUDA the trial caps that allocator at the budget less
the device memory outside it (context, NCCL, cuBLAS), so a configuration fits
when its allocated peak fits under the cap: the allocator frees cached blocks
and retries before it fails, as a GPU of the budget's size would, so
fragmentation costs speed (retries, recorded), not a launch. The margin
therefore covers the estimate's own error (a factor) and the memory outside
the allocator (a fixed term, measured by every CUDA trial), nothing else.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from autotune.config import FsdpConfig
from autotune.config.estimate_method import EstimateMethod, SlackClass, slack_class

# What lies outside the caching allocator on a CUDA device before any trial
# measured it: the context (about 0.5 GiB) and NCCL's buffers; one rank of an
# H200 measured 1.29-1.31 GiB (benchmarks/results/gpu_check_2026-12-04.md).
CUDA_OUTSIDE_BYTES = int(1.5 * 2**30)
# The estimate's error on the allocated peak: the fake step predicted a held-out
# 1.5B decoder's allocated peak within 1% on an H200; its worst over-prediction
# on the CPU table is 3.5% (ESTIMATE_SLACK), so the same width on the high side.
CUDA_MARGIN_FACTOR = 1.04
# Calibrate the factor from the study only once it has this many measured trials.
MIN_CALIBRATION_TRIALS = 3
# How far the fake step over-predicts at worst, by how the figure was made
# (measured/predicted over the 144 configurations of benchmarks/data/grid_cpu.csv
# and benchmarks/results/estimator_accuracy_cpu.md): a real fake step at least
# 0.965, FSDP1 SHARD_GRAD_OP (derived from FULL_SHARD) at least 0.898; a micro
# batch interpolated between two fake steps is an upper bound (the peak is
# convex in it), at most 2.3% over the fake step at that micro batch on
# llama-tiny: the exact slack plus that. A configuration predicted over the
# budget by less may still fit, and only a launch can tell; one predicted over
# it by more is not worth a launch.
ESTIMATE_SLACK = {SlackClass.EXACT: 0.04, SlackClass.INTERPOLATED: 0.065, SlackClass.DERIVED: 0.11}


@dataclass(frozen=True)
class Sample:
    """One launched trial against its prediction: the tensor bytes it needed (the
    allocator's allocated peak on CUDA, live storages on CPU; for a trial out of
    memory under the cap, the cap it could not stay under: a lower bound), what
    was predicted, by which method, and the device memory outside the allocator."""

    measured: int
    predicted: int
    method: str | EstimateMethod | None = None
    outside: int | None = None


@dataclass(frozen=True)
class Margin:
    """Predicted device peak = tensor peak * factor + fixed bytes; the peak
    could be as low as tensor peak * low factor + fixed bytes, the low factor
    being the estimator's known slack for the figure's method, or lower where
    this study measured lower (``low_factors``, by method class)."""

    factor: float
    fixed_bytes: int
    source: str
    low_factors: Mapping[str, float] = field(default_factory=dict)

    def apply(self, tensor_peak: int) -> int:
        return int(tensor_peak * self.factor + self.fixed_bytes)

    def low_factor(self, method: str | EstimateMethod | None = None) -> float:
        kind = slack_class(method)
        return min(1.0 - ESTIMATE_SLACK[kind], self.low_factors.get(kind, 1.0))

    def lowest(self, tensor_peak: int, method: str | EstimateMethod | None = None) -> int:
        """The smallest device peak the prediction leaves plausible: above the
        budget even by this, a launch is a waste."""
        return int(tensor_peak * self.low_factor(method) + self.fixed_bytes)


def default_margin(device_type: str, outside_bytes: int | None = None) -> Margin:
    """The margin before calibration; ``outside_bytes``: what a trial here measured outside the allocator."""
    if device_type == "cuda":
        fixed = CUDA_OUTSIDE_BYTES if outside_bytes is None else outside_bytes
        where = "default" if outside_bytes is None else "measured"
        return Margin(CUDA_MARGIN_FACTOR, fixed, f"x{CUDA_MARGIN_FACTOR} + {fixed / 2**30:.2f} GiB outside the "
                                                 f"allocator ({where})")
    # On CPU the trial measures the same quantity the estimator predicts.
    return Margin(1.0, 0, "none (CPU trials measure tensor bytes too)")


@dataclass(frozen=True)
class LinePeakCheck:
    """A shallow trial's copies' tensor peaks, extended to full depth, against the memory estimate's: their ratio
    and the range the margin allows (its low factor for the estimate's method to its factor, at least the
    estimator's exact slack on the high side, which the CPU's factor of 1 would leave at none).

    The line is a lower bound of the full-depth peak: each phase's peak is affine in depth, the step's is their
    largest, and where another phase takes the peak between the copies and full depth the line through the
    copies falls short (12.3% on one of 11 configurations, benchmarks/results/shallow_trials_order_cpu.md; 0.0%
    on 8). So only a line above the margin's high side disagrees with the estimate."""

    line_bytes: int
    predicted_bytes: int
    low: float
    high: float

    @property
    def ratio(self) -> float:
        return self.line_bytes / self.predicted_bytes

    @property
    def agrees(self) -> bool:
        return self.ratio <= self.high

    def describe(self) -> str:
        where = ("BEYOND" if not self.agrees else "under: a lower bound, within" if self.ratio < self.low
                 else "within")
        return (f"the copies' peaks extended to full depth {self.ratio:.3f}x the estimate ({where} the margin's "
                f"{self.low:.3f}-{self.high:.3f})")

    def to_dict(self) -> dict[str, Any]:
        return {"line_bytes": self.line_bytes, "predicted_bytes": self.predicted_bytes, "ratio": round(self.ratio, 4),
                "low": round(self.low, 4), "high": round(self.high, 4), "agrees": self.agrees}


def line_peak_check(line_bytes: int, predicted_bytes: int, margin: Margin,
                    method: str | EstimateMethod | None = None) -> LinePeakCheck:
    """The copies' line against the estimate (:class:`LinePeakCheck`)."""
    high = max(margin.factor, 1.0 + ESTIMATE_SLACK[SlackClass.EXACT])
    return LinePeakCheck(line_bytes, predicted_bytes, margin.low_factor(method), high)


def fit_chance(margin: Margin, tensor_peak: int, budget_bytes: int,
               method: str | EstimateMethod | None = None) -> float:
    """How likely a configuration with this predicted tensor peak fits: 1 when
    even the margin's high side fits, 0 when even its low side does not, and
    where the budget falls between them otherwise."""
    high, low = margin.apply(tensor_peak), margin.lowest(tensor_peak, method)
    if high <= budget_bytes:
        return 1.0
    if low > budget_bytes:
        return 0.0
    return (budget_bytes - low) / max(1, high - low)


def calibrated_margin(samples: Iterable[Sample], device_type: str) -> Margin:
    """The margin from this study's launched trials (the default until enough exist).

    The fixed term is the most memory any trial found outside the allocator
    (CUDA), from the first trial on. The factor is the largest ratio of
    needed to predicted tensor bytes, so that a configuration that fitted is
    never pruned by a model that under-predicts, and one that ran out of
    memory under the cap is never predicted to fit again.
    """
    samples = [s for s in samples if s.measured and s.predicted]
    outside = [s.outside for s in samples if s.outside is not None]
    base = default_margin(device_type, max(outside) if outside and device_type == "cuda" else None)
    measured = [(s.measured / s.predicted, slack_class(s.method)) for s in samples]
    ratios = [r for r, _ in measured]
    if len(ratios) < MIN_CALIBRATION_TRIALS:
        return base
    factor = max(1.0, max(ratios))
    # The low side only widens: a handful of trials does not show how far the
    # next one may fall below, so the known slack stays the floor (Margin.low_factor).
    lows = {kind.value: round(min(r for r, k in measured if k == kind), 4) for kind in {k for _, k in measured}}
    source = (f"calibrated on {len(ratios)} trials (median ratio {statistics.median(ratios):.3f})"
              + (f" + {base.fixed_bytes / 2**30:.2f} GiB outside the allocator" if base.fixed_bytes else ""))
    return Margin(round(factor, 4), base.fixed_bytes, source, low_factors=lows)


def memory_key(cfg: FsdpConfig) -> str:
    """What decides the peak: the configuration less ``compile``, whose blocks
    the fake step runs eagerly (an upper side: inductor's fused kernels hold
    fewer intermediates). ``limit_all_gathers`` stays: without the limit,
    FSDP1's rank 1 peaked 6% higher in a one-unit bf16 trial."""
    data = cfg.to_dict()
    data.pop("compile")
    if cfg.auto_wrap_policy != "size_based":
        data.pop("min_num_params")  # read by size-based wrapping only
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def memory_class(cfg: FsdpConfig) -> str:
    """:func:`memory_key` less the micro batch: the peak of one class is affine in
    the micro batch (exact at two, interpolated between them)."""
    data = json.loads(memory_key(cfg))
    data.pop("micro_batch_size")
    return json.dumps(data, sort_keys=True, separators=(",", ":"))
