"""Confidence intervals, the few the tuner needs: standard library only, for the worker, the study and the
benchmarks."""

from __future__ import annotations

import math
import statistics

# Two-sided 95% Student t quantiles by degrees of freedom; 1.96 beyond the table.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t95(df: int) -> float:
    """The 95% two-sided t quantile; between tabulated rows, the smaller df's (larger, so safer) one."""
    if df > 30:
        return 1.96
    return next(v for k, v in sorted(_T95.items(), reverse=True) if k <= df)


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """The 95% Student-t confidence interval of the mean (infinite for fewer than 2 values)."""
    if len(values) < 2:
        return (-math.inf, math.inf)
    mean = statistics.fmean(values)
    half = t95(len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    return (mean - half, mean + half)


def relative_ci95(values: list[float]) -> float:
    """Half-width of :func:`mean_ci95` as a fraction of the mean: 0.02 means within 2%."""
    if len(values) < 2:
        return math.inf
    mean = statistics.fmean(values)
    lo, hi = mean_ci95(values)
    return (hi - lo) / 2 / mean if mean > 0 else math.inf


def median_ci95(values: list[float]) -> tuple[float, float]:
    """A 95% confidence interval of the median, free of any assumption about the
    distribution (a stall makes step times skewed).

    From order statistics: (x_(j), x_(n+1-j)) for the largest j whose two tails
    hold at most 2.5% each of Binomial(n, 1/2). With fewer than 6 values no such
    pair exists, and the mean's Student-t interval stands in.
    """
    ordered = sorted(values)
    n = len(ordered)
    if n < 2:
        return (-math.inf, math.inf)
    tail, j = 0.0, 0
    while True:
        tail += math.comb(n, j) / 2**n
        if tail > 0.025:
            break
        j += 1
    if j == 0:
        return mean_ci95(ordered)
    return (ordered[j - 1], ordered[n - j])


def relative_median_ci95(values: list[float]) -> float:
    """Half-width of :func:`median_ci95` as a fraction of the median."""
    if len(values) < 2:
        return math.inf
    lo, hi = median_ci95(values)
    return (hi - lo) / 2 / statistics.median(values)
