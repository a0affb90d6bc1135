"""The timing loop: skipped fp16 steps are not timed, convergence and the hopeless-trial check."""

import pytest

from autotune.worker.train import time_steps


def scripted(steps):
    """A timed step that replays (seconds, stepped) pairs."""
    it = iter(steps)
    return lambda: next(it)


def test_steps_the_loss_scaler_skipped_are_not_timed():
    steps = [(0.1, False), (1.0, True), (0.1, False), (1.0, True), (1.2, True)]
    times, skipped, partial = time_steps(scripted(steps), 3, 0.0, None, 100)
    assert times == [1.0, 1.0, 1.2] and skipped == 2 and partial is None


def test_a_run_of_skipped_steps_is_bounded_and_fails():
    with pytest.raises(RuntimeError, match="skipped all 3 timed steps"):
        time_steps(scripted([(0.1, False)] * 10), 3, 0.0, None, 100)


def test_timing_stops_once_the_mean_is_known_never_before_three_steps():
    times, _, _ = time_steps(scripted([(1.0, True)] * 10), 10, 0.02, None, 100)
    assert len(times) == 3


def test_a_hopeless_trial_stops_after_two_steps_with_its_partial_figure():
    times, _, partial = time_steps(scripted([(1.0, True)] * 10), 10, 0.0, 1000.0, 100)
    assert len(times) == 2 and partial == pytest.approx(100.0)
