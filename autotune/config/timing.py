"""How long a trial warms up and times steps, on CPU and on CUDA."""

from __future__ import annotations

# Untimed steps before timing: the first allocates optimizer state, the last
# (never the first) measures peak memory.
MIN_WARMUP_STEPS = 2

# A trial given ``abort_below_tokens_per_s`` is judged after this many timed
# steps: the worker stops there, and replays of a measured table charge that many.
ABORT_CHECK_STEPS = 2
# Most timed steps a trial runs by default. Trials of one configuration differ
# by more than a trial's steps do (benchmarks/results/noise_cpu.md: single-trial
# CV 7-18% against a step-time median known to +-3-5% from 6 steps), so beyond
# a few steps, time is better spent on another interleaved round than on more
# steps of one trial.
DEFAULT_TIMED_STEPS = 6
# On a GPU a step takes a fraction of a second against seconds to start a
# trial (6 steps of 0.18 s gave a 95% CI of +-10% on an H200): steps are timed
# until the median is known to --timing-ci, for at most this many seconds.
CUDA_TIMED_STEPS = 200
CUDA_TIMING_BUDGET_S = 8.0


def timing_defaults(device_type: str) -> tuple[int, float | None]:
    """(most timed steps, most seconds of them) for trials on ``device_type``."""
    return (CUDA_TIMED_STEPS, CUDA_TIMING_BUDGET_S) if device_type == "cuda" else (DEFAULT_TIMED_STEPS, None)
# On CPU the first warm-up step (optimizer state allocated, caches cold) runs
# at most about 1.5x a timed step's time; a first step this many times below
# the abort threshold already shows the trial is hopeless (fp16 on a CPU
# without fp16 units: 20x), and the rest of its warm-up is not worth waiting
# for. Not on CUDA, where the first step ran 8.3x (autotune.worker.train.first_step_judges).
WARMUP_ABORT_SLACK = 4.0
