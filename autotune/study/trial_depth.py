"""Which depth a study's trials run at: the model as it is, or shallow copies whose line is extended to it.

``--trial-depth`` is ``auto`` (the default), ``full`` or two depths ``N,M``.
``auto`` starts with copies of :data:`DEPTHS` blocks when they have at most
half the model's blocks, and full depth otherwise, with the reason: llama-tiny's
4 blocks run whole. The study's first shallow trial also times a third copy (12
blocks beside 4 and 8), and measures what a trial costs: its start, each copy's
build, wrap and first step, and its steps by depth (:mod:`autotune.study.depth_cost`).
When that copy lies off the line through the other two by more than the timing
noise allows, the study goes on with deeper copies (twice as deep) or at full
depth; when the copies do not cost at most half of a full-depth trial (on a
GPU, a job's start and each copy's set-up are most of a trial), at full depth;
and it says why (:func:`after_check`). Fit is never a shallow copy's word: it stays the
full-depth memory estimate's, so a study without estimates runs at full depth.
The plan is stored on the study, which keeps it when resumed.

A configuration whose FSDP units do not follow the blocks (no auto wrap: the
whole model is one unit; size-based units larger than a block: its blocks
are gathered together, as one unit that grows with the depth) runs at full
depth in a shallow study (:func:`whole_because`): measured on a 32-block Llama
(benchmarks/results/shallow_trials_cpu.md), FSDP1 with size-based units of
1e6 parameters over blocks of 0.79M came out 34.0% faster on the copies' line
than at full depth.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from autotune.config import FsdpConfig
from autotune.errors import UsageError
from autotune.study.depth_cost import measured_cost
from autotune.study.depth_setting import DepthMode, TrialDepth
from autotune.study.record import Attr

# The copies a deep model's trials time first (the check's third is as far beyond the deeper as they are apart).
DEPTHS = (4, 8)
# How far the third copy may lie off the line (relative to its step time), beyond its own timing noise.
LINE_TOLERANCE = 0.05


@dataclass(frozen=True)
class DepthPlan:
    """How a study's search trials meet the model's depth."""

    setting: TrialDepth
    full_depth: int | None  # the model's blocks (None: unknown)
    depths: tuple[int, ...] = ()  # the copies' depths; empty: the model as it is
    reason: str = ""  # why, in words
    # The line's check, once the first shallow trial ran it: its depths, how far off, and the verdict.
    check: dict[str, Any] | None = None
    # The parameters of one block (None: unknown), against which size-based units are judged.
    block_params: int | None = None

    @property
    def shallow(self) -> bool:
        return bool(self.depths)

    def request_depths(self, cfg: FsdpConfig | None = None) -> tuple[int, ...]:
        """The depths the next search trial (of ``cfg``) times: with the check's third copy until it has run;
        none for a configuration whose units do not follow the blocks."""
        if cfg is not None and self.shallow and whole_because(cfg, self.block_params) is not None:
            return ()
        if not self.shallow or self.check is not None or self.setting.mode != DepthMode.AUTO:
            return self.depths
        third = _check_depth(self.depths)
        return self.depths + (third,) if third is not None and third < (self.full_depth or 0) else self.depths

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["setting"] = str(self.setting)
        data["depths"] = list(self.depths)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DepthPlan:
        return cls(setting=TrialDepth.parse(data["setting"]), full_depth=data.get("full_depth"),
                   depths=tuple(data.get("depths") or ()),
                   reason=data.get("reason", ""), check=data.get("check"), block_params=data.get("block_params"))

    def describe(self) -> str:
        if not self.shallow:
            return f"full depth ({self.reason})" if self.reason else "full depth"
        return (f"shallow copies of {' and '.join(map(str, self.depths))} blocks extended to {self.full_depth}"
                + (f" ({self.reason})" if self.reason else "")
                + "; configurations whose FSDP units span blocks (no auto wrap, size-based units larger than a block) "
                  "run whole")


def whole_because(cfg: FsdpConfig, block_params: int | None) -> str | None:
    """Why a shallow study runs ``cfg`` at full depth, or None: its FSDP units do not grow one block at a time."""
    if cfg.auto_wrap_policy == "none":
        return "no auto wrap: the whole model is one FSDP unit, whose gather grows with the depth"
    if cfg.auto_wrap_policy == "size_based" and (block_params is None or block_params < cfg.min_num_params):
        size = f"blocks of {block_params:,} parameters" if block_params is not None else "blocks of unknown size"
        return (f"size-based units of {cfg.min_num_params:,} parameters span its {size}: they are gathered as one "
                "unit that grows with the depth")
    return None


def plan_depths(setting: TrialDepth, num_layers: int | None, block_period: int, buildable: bool, estimated: bool,
                space_checkpointing: tuple[str, ...] = (), block_params: int | None = None,
                block_prefix: int = 0) -> DepthPlan:
    """The study's plan, from the setting and the model (``num_layers`` blocks repeating every ``block_period``
    after the first ``block_prefix``; ``buildable``: a copy of another depth can be built, as for a transformers
    config) and whether memory is estimated."""
    return replace(_plan_depths(setting, num_layers, block_period, buildable, estimated, space_checkpointing,
                                block_prefix), block_params=block_params)


def _plan_depths(setting: TrialDepth, num_layers: int | None, block_period: int, buildable: bool, estimated: bool,
                 space_checkpointing: tuple[str, ...], block_prefix: int = 0) -> DepthPlan:
    if setting.mode == DepthMode.FULL:
        return DepthPlan(setting, num_layers)
    why_not = _why_full_depth(num_layers, buildable, estimated)
    if setting.mode == DepthMode.COPIES:
        depths = setting.copies
        if why_not is not None or num_layers is None:
            raise UsageError(f"--trial-depth {setting}: {why_not}; use --trial-depth full")
        if depths[-1] >= num_layers:
            raise UsageError(f"--trial-depth {setting}: the model has {num_layers} blocks; give copies shallower than "
                             "that, or --trial-depth full")
        return DepthPlan(setting, num_layers, depths, "as asked")
    if why_not is not None or num_layers is None:
        return DepthPlan(setting, num_layers, reason=why_not or "")
    # Checkpointing every other block repeats in pairs; a model's own pattern (alternating attention) in its period.
    # Past the blocks that stand apart (DeepSeek's first dense ones), whole repeats: the line's slope is then a
    # repeat's, not one block kind's.
    unit = _lcm(block_period, 2 if "every_other_layer" in space_checkpointing else 1)
    low = block_prefix + _round_up(max(DEPTHS[0] - block_prefix, 1), unit)
    depths = (low, max(low + unit, block_prefix + _round_up(DEPTHS[1] - block_prefix, unit)))
    if 2 * sum(depths) > num_layers:
        return DepthPlan(setting, num_layers, reason=f"{num_layers} blocks: copies of {depths[0]} and {depths[1]} "
                                                     "would not make a trial twice cheaper")
    return DepthPlan(setting, num_layers, depths, f"{num_layers} blocks")


def after_check(plan: DepthPlan, points: Sequence[Mapping[str, Any]], line_check: float | None,
                phases: Mapping[str, float] | None = None, timing_budget_s: float | None = None) -> DepthPlan:
    """The plan once the first shallow trial timed its three copies: kept when the
    middle copy lies on the line through the others within the timing noise and
    the copies cost at most half of a full-depth trial by what that trial measured
    (its ``phases``: :func:`autotune.study.depth_cost.measured_cost`), else deeper
    copies, else full depth; the check is recorded either way."""
    if plan.check is not None or line_check is None or len(points) < 3:
        return plan
    middle = sorted(points, key=lambda p: p["depth"])[1]
    noise = _relative_half_width(middle)
    allowed = LINE_TOLERANCE + noise
    check = {"depths": [p["depth"] for p in points], "off_by": round(line_check, 4), "allowed": round(allowed, 4)}
    cost = measured_cost(points, phases or {}, timing_budget_s)
    full = plan.full_depth or 0
    if cost is not None:
        check["cost"] = {"copies_s": round(cost.seconds(plan.depths), 2), "full_s": round(cost.seconds((full,)), 2)}

    def cheap(depths: tuple[int, ...]) -> bool:
        if cost is None:
            return 2 * sum(depths) <= full
        return depths[-1] < full and cost.seconds(depths) <= cost.seconds((full,)) / 2

    if abs(line_check) <= allowed:
        if cheap(plan.depths):
            return replace(plan, check={**check, "verdict": "on the line"})
        assert cost is not None  # the study's plan counted the copies' blocks already
        return replace(plan, depths=(), reason=f"measured: {cost.describe(plan.depths, full)}: not twice cheaper",
                       check={**check, "verdict": "on the line, but not twice cheaper: full depth"})
    deeper = tuple(2 * d for d in plan.depths)
    off = (f"the copy of {middle['depth']} blocks lay {100 * abs(line_check):.0f}% off the line through "
           f"{points[0]['depth']} and {points[-1]['depth']} (timing noise allows {100 * allowed:.0f}%)")
    if cheap(deeper):
        return replace(plan, depths=deeper, reason=f"{off}: deeper copies",
                       check={**check, "verdict": f"off the line: copies of {deeper[0]} and {deeper[1]} blocks"})
    return replace(plan, depths=(), reason=f"{off}, and deeper copies would not make a trial twice cheaper",
                   check={**check, "verdict": "off the line: full depth"})


def _why_full_depth(num_layers: int | None, buildable: bool, estimated: bool) -> str | None:
    if not buildable or not num_layers:
        return "a module:function model is built as it is, at one depth"
    if not estimated:
        return "without memory estimates (--no-estimate) only a full-depth trial shows whether the model fits"
    return None


def _check_depth(depths: tuple[int, ...]) -> int | None:
    step = depths[-1] - depths[0]
    return depths[-1] + step if step > 0 else None


def _relative_half_width(point: Mapping[str, Any]) -> float:
    low, high, t = point.get("ci_low_s"), point.get("ci_high_s"), point.get("step_time_s")
    if not low or not high or not t:
        return 0.0
    return (high - low) / 2 / t


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _lcm(a: int, b: int) -> int:
    from math import gcd

    return a * b // gcd(a, b)


class StudyDepth:
    """A study's depth plan, shared by the threads of its device slots: what search
    trials time, updated once, by the line's check of the first shallow trial."""

    def __init__(self, plan: DepthPlan, store: Callable[[dict[str, Any]], None] = lambda _: None,
                 say: Callable[[str], None] = lambda _: None, timing_budget_s: float | None = None) -> None:
        self.plan = plan
        self.timing_budget_s = timing_budget_s  # the full-depth trial's, for its cost
        self._store, self._say = store, say
        self._lock = threading.Lock()
        self._said: set[str] = set()
        self._shallow_launched = 0

    def next_deepest_first(self) -> bool:
        """Whether the next shallow trial runs its copies deepest first: every other one does, so that a drift
        between a job's first and second copy shows as a difference between the two orders (the record's
        ``copies_order``) instead of tilting every line one way."""
        with self._lock:
            self._shallow_launched += 1
            return self._shallow_launched % 2 == 0

    def depths_for(self, cfg: FsdpConfig, trial: Any) -> tuple[int, ...]:
        """The depths a search trial of ``cfg`` times; a configuration a shallow study runs whole records why on
        ``trial``, and the study says so once per reason."""
        depths = self.plan.request_depths(cfg)
        whole = whole_because(cfg, self.plan.block_params) if self.plan.shallow and not depths else None
        if whole is None:
            return depths
        trial.set_user_attr(Attr.WHOLE_BECAUSE, whole)
        with self._lock:
            first = whole not in self._said
            self._said.add(whole)
        if first:
            self._say(f"Trial depth: {whole}; such configurations run whole.")
        return depths

    def after_trial(self, points: Sequence[Mapping[str, Any]], line_check: float | None,
                    phases: Mapping[str, float] | None = None) -> None:
        """Apply a shallow trial's check of its line and cost (:func:`after_check`), store the plan and say what
        changed."""
        if line_check is None:
            return
        with self._lock:
            plan = after_check(self.plan, points, line_check, phases, self.timing_budget_s)
            if plan == self.plan:
                return
            self.plan = plan
            self._store(plan.to_dict())
        verdict = (plan.check or {}).get("verdict")
        self._say(f"Trial depth: {verdict}; {plan.describe()}.")
