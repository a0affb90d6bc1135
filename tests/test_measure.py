"""The convergence test adaptive timing stops on."""

import math

import pytest

from autotune.stats import relative_ci95


def test_relative_ci95_is_the_student_t_half_width_over_the_mean():
    # mean 1.0, sample sd 0.1, t(0.975, df=2) = 4.303
    assert relative_ci95([1.0, 1.1, 0.9]) == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    # df=11 is not tabulated: the next smaller df's (larger) t is used, never a smaller one
    times = [1.0, 1.2] * 6
    sd = 0.1 * math.sqrt(12 / 11)
    assert relative_ci95(times) == pytest.approx(2.228 * sd / math.sqrt(12) / 1.1)


def test_relative_ci95_needs_two_steps_and_shrinks_with_more():
    assert relative_ci95([1.0]) == math.inf
    assert relative_ci95([1.0, 1.0, 1.0]) == 0.0
    few, many = [1.0, 1.1, 0.9], [1.0, 1.1, 0.9] * 4
    assert relative_ci95(many) < relative_ci95(few)


def test_the_median_ci_uses_order_statistics_from_six_steps():
    from autotune.stats import median_ci95, relative_median_ci95

    times = [1.0, 1.1, 0.9, 1.05, 0.95, 5.0, 1.02, 0.98, 1.01, 0.99]  # one stall
    # n=10: (x_(2), x_(9)) holds the median with 97.9% probability.
    assert median_ci95(times) == (sorted(times)[1], sorted(times)[8])
    assert relative_median_ci95(times) < 0.2  # the stall does not widen it, unlike the mean's
    assert median_ci95([1.0] * 6) == (1.0, 1.0)
    lo, hi = median_ci95([1.0, 1.1, 0.9])  # too few for order statistics: the mean's t-interval
    assert lo < 1.0 < hi
