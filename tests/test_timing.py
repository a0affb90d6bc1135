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


def test_on_a_gpu_steps_are_timed_until_the_ci_is_met_not_for_a_fixed_count():
    """Noisy steps (+-5%) need more than the CPU's 6 to pin the median to 2%: on a GPU the cap is time, not a count."""
    import random

    rng = random.Random(0)
    noisy = [(0.18 * (1 + rng.uniform(-0.05, 0.05)), True) for _ in range(500)]
    from autotune.config import CUDA_TIMED_STEPS, CUDA_TIMING_BUDGET_S
    from autotune.stats import relative_median_ci95

    times, _, _ = time_steps(scripted(noisy), CUDA_TIMED_STEPS, 0.02, None, 100, CUDA_TIMING_BUDGET_S)
    assert 6 < len(times) < CUDA_TIMED_STEPS and relative_median_ci95(times) <= 0.02
    assert sum(times) <= CUDA_TIMING_BUDGET_S
    # A CI that cannot be met in the time allowed stops at the budget, with what it has.
    wild = [(0.5 * (1 + rng.uniform(-0.9, 0.9)), True) for _ in range(500)]
    times, _, _ = time_steps(scripted(wild), CUDA_TIMED_STEPS, 0.001, None, 100, 4.0)
    assert 4.0 <= sum(times) < 4.0 + 1.0 and len(times) >= 3


def test_the_allocator_cap_is_the_budget_less_what_lies_outside_the_allocator():
    from autotune.worker.measure import BudgetBelowOverheadError, allocator_cap
    from autotune.worker.failures import is_out_of_memory

    gib = 2**30
    # An H200 (140 GiB) with 1.3 GiB of context and NCCL buffers and 2 MiB reserved by the warm-up collective.
    cap = allocator_cap(40 * gib, total=140 * gib, free=140 * gib - int(1.3 * gib) - 2 * 2**20, reserved=2 * 2**20)
    assert cap.outside_bytes == int(1.3 * gib) and cap.cap_bytes == 40 * gib - int(1.3 * gib)
    # A budget above the device is the device, less what lies outside the allocator there too.
    assert allocator_cap(200 * gib, total=140 * gib, free=139 * gib, reserved=0).cap_bytes == 139 * gib
    # A budget that does not even cover the context: out of memory, so the trial is infeasible, not a crash.
    with pytest.raises(BudgetBelowOverheadError) as caught:
        allocator_cap(gib, total=140 * gib, free=138 * gib, reserved=0)
    assert is_out_of_memory(caught.value)
