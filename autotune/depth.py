"""Shallow trials: a deep model's step time from copies of a few of its blocks, and the line through them.

A model of many identical blocks trains each block the same way: the unit
gathers, computes and reduces the same shapes, and the embedding, the head
and the optimizer's fixed costs are the same at any depth. So a step's time
is affine in the number of blocks, and two copies of the model at two depths
predict it at the full depth: t(L) = t(a) + (L - a) * (t(b) - t(a)) / (b - a).
A third depth, where one is run, checks the line (:func:`line_check`).

Standard library only: the driver plans the depths and reads the figures, the
worker times the copies, and both read them from here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class DepthPoint:
    """One shallow copy's timing: its depth, its median step time and that median's 95% interval."""

    depth: int
    step_time_s: float
    ci_low_s: float | None = None
    ci_high_s: float | None = None
    timed_steps: int | None = None
    # The copy's own peaks: what it held of the device, and its tensor bytes (the memory estimate's quantity).
    peak_memory_bytes: int | None = None
    tensor_peak_bytes: int | None = None
    # When the copy ran in its job: 0 first.
    order: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DepthPoint:
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})  # type: ignore[arg-type]  # as stored


def fit_line(points: Sequence[DepthPoint]) -> tuple[float, float]:
    """(intercept, slope) of step time against depth, least squares over the points."""
    if len({p.depth for p in points}) < 2:
        raise ValueError("a line needs two depths")
    n = len(points)
    mean_d = sum(p.depth for p in points) / n
    mean_t = sum(p.step_time_s for p in points) / n
    slope = (sum((p.depth - mean_d) * (p.step_time_s - mean_t) for p in points)
             / sum((p.depth - mean_d) ** 2 for p in points))
    return mean_t - slope * mean_d, slope


def step_time_at(points: Sequence[DepthPoint], depth: int) -> float:
    """The step time the line through ``points`` predicts at ``depth``."""
    intercept, slope = fit_line(points)
    return intercept + slope * depth


def interval_at(points: Sequence[DepthPoint], depth: int) -> tuple[float, float] | None:
    """The step time at ``depth`` from the shallowest and deepest copies' own
    intervals, taken at their most unfavourable: beyond both copies the
    prediction grows with the deeper one's time and falls with the
    shallower one's, so (shallow high, deep low) and (shallow low, deep high)
    bound it. None when a copy has no interval."""
    low, high = min(points, key=lambda p: p.depth), max(points, key=lambda p: p.depth)
    if low.ci_low_s is None or low.ci_high_s is None or high.ci_low_s is None or high.ci_high_s is None:
        return None

    def at(t_low: float, t_high: float) -> float:
        return t_high + (depth - high.depth) * (t_high - t_low) / (high.depth - low.depth)

    return at(low.ci_high_s, high.ci_low_s), at(low.ci_low_s, high.ci_high_s)


def peak_at(points: Sequence[DepthPoint], depth: int, field: str = "tensor_peak_bytes") -> int | None:
    """A peak at ``depth`` on the line through the shallowest and deepest copies' peaks (``field``), or None
    when either has none. A block holds the same parameters, gradients, optimizer state and activations at any
    depth, so the peak is affine in depth as the step time is (the fake step's copies extend to the whole step's
    peak exactly: benchmarks/results/estimator_scale_cpu.md)."""
    low, high = min(points, key=lambda p: p.depth), max(points, key=lambda p: p.depth)
    a, b = getattr(low, field), getattr(high, field)
    if a is None or b is None or high.depth == low.depth:
        return None
    return round(a + (depth - low.depth) * (b - a) / (high.depth - low.depth))


def line_check(points: Sequence[DepthPoint]) -> float | None:
    """With three or more depths, how far the middle one lies off the line through
    the shallowest and deepest, relative to its own time; None with two."""
    if len(points) < 3:
        return None
    ordered = sorted(points, key=lambda p: p.depth)
    middle = ordered[len(ordered) // 2]
    predicted = step_time_at([ordered[0], ordered[-1]], middle.depth)
    return (middle.step_time_s - predicted) / middle.step_time_s
