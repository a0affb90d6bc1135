"""What one trial job costs by the depths it builds, from what a shallow trial measured: whether copies pay.

A trial job pays its start once (launch, imports, the process group), then for each model it builds (the full
model, or each shallow copy) a build, a wrap and a first step's one-off work, and then its warm-up and timed
steps at that depth's step time. Counting blocks alone (the copies together have at most half the model's)
leaves out the per-job and per-copy costs, which on a GPU are most of a trial: on an H200, 1.2B-parameter trials
took 13-17 s with steps of 0.2-0.5 s (benchmarks/results/gpu_check_2026-12-04.md). On this 2-core CPU a 32-block
Llama (hidden 256, 2 ranks, micro batch 1) measured 11.8 s for a trial of copies of 4 and 8 blocks against
15.8 s at full depth: 0.75, not the 0.38 its blocks count.

The study's first shallow trial measures every term (it times three copies): :func:`measured_cost` reads them,
and ``auto`` keeps its copies only when they cost at most half of a full-depth trial
(:func:`autotune.study.trial_depth.after_check`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from autotune.depth import DepthPoint, fit_line


@dataclass(frozen=True)
class TrialCost:
    """A trial job's seconds by the depths it builds."""

    job_s: float  # once per job: launch, imports, process group
    copy_s: float  # once per model built: build, wrap, the first step beyond a step's time
    fixed_step_s: float  # a step's time outside the blocks (the line's intercept)
    block_step_s: float  # a step's time per block (the line's slope)
    warmup_steps: float  # untimed steps after the first
    timed_steps: float  # steps timed, where no timing budget cuts them short
    timing_budget_s: float | None = None  # the most seconds of timed steps a model gets

    def step_s(self, depth: int) -> float:
        return self.fixed_step_s + depth * self.block_step_s

    def seconds(self, depths: Sequence[int]) -> float:
        """One job that builds and times a model at each of ``depths``."""
        total = self.job_s
        for depth in depths:
            step = self.step_s(depth)
            timed = self.timed_steps * step
            if self.timing_budget_s is not None:
                timed = min(timed, max(self.timing_budget_s, 3 * step))
            total += self.copy_s + (1 + self.warmup_steps) * step + timed
        return total

    def describe(self, depths: Sequence[int], full_depth: int) -> str:
        return (f"copies of {' and '.join(map(str, depths))} blocks {self.seconds(depths):.1f} s a trial against "
                f"{self.seconds((full_depth,)):.1f} s at full depth (start {self.job_s:.1f} s, "
                f"{self.copy_s:.1f} s a copy, steps {1000 * self.fixed_step_s:.0f} ms + "
                f"{1000 * self.block_step_s:.1f} ms a block)")


def measured_cost(points: Sequence[Mapping[str, Any]], phases: Mapping[str, float],
                  timing_budget_s: float | None = None) -> TrialCost | None:
    """The cost a shallow trial measured: its ``phases`` (summed over its copies) and its copies' ``points``
    (``depth``, ``step_time_s``, ``timed_steps``); None without two timed copies or the phases."""
    timed = [DepthPoint.from_dict(p) for p in points if p.get("step_time_s")]
    if len({p.depth for p in timed}) < 2 or "launch_and_import_s" not in phases:
        return None
    # The line the study extends (autotune.depth), through every copy timed.
    intercept, slope = fit_line(timed)
    slope, intercept = max(0.0, slope), max(0.0, intercept)
    steps_s = sum(p.step_time_s for p in timed)
    one_off = phases.get("build_s", 0.0) + phases.get("wrap_s", 0.0) + phases.get("first_step_s", 0.0) - steps_s
    return TrialCost(
        job_s=phases["launch_and_import_s"], copy_s=max(0.0, one_off) / len(timed),
        fixed_step_s=intercept, block_step_s=slope,
        warmup_steps=max(0.0, (phases.get("warmup_s", 0.0) - phases.get("first_step_s", 0.0)) / steps_s),
        timed_steps=statistics.mean(p.timed_steps or 0 for p in timed), timing_budget_s=timing_budget_s)
