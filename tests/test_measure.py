"""The convergence test adaptive timing stops on."""

import math

import pytest

from autotune.worker.measure import relative_ci95


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
