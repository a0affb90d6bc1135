"""How fast a configuration trains: step time, tokens/s and MFU, each with an interval, from its work and a
device profile.

>>> # predict(cfg, work, structure, Placement(8, 1), micro_batches=1, profile=named_profile("h100-sxm"))
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from autotune.config.step_work import StepWork
from autotune.speed.device_profile import DeviceProfile
from autotune.speed.fsdp_schedule import Event, ModelStructure, Placement, schedule
from autotune.speed.model_work import COMPUTE_DTYPE, ModelWork, model_work
from autotune.speed.overlap import simulate

# The interval holds 90% of the profile's spread (a normal in log tokens/s).
INTERVAL_Z = 1.645
# How far a factor is moved (in log) to see how much the step leans on it.
NUDGE = 0.05


@dataclass(frozen=True)
class SpeedPrediction:
    """One configuration's predicted speed on one profile."""

    step_s: float
    tokens_per_s: float
    tokens_per_s_low: float
    tokens_per_s_high: float
    # Model FLOPs (forward and backward, recomputation left out) per second per device over its peak.
    mfu: float
    compute_s: float
    communication_s: float
    exposed_communication_s: float
    host_s: float
    host_optimizer_s: float
    profile: str
    # How the work was had: the configuration's own fake step, or derived from another's (see ModelWork.at).
    basis: str
    # The log-space standard deviation the interval was drawn with.
    uncertainty: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpeedPrediction:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})

    def describe(self) -> str:
        return (f"{self.tokens_per_s:,.0f} tok/s ({self.tokens_per_s_low:,.0f}-{self.tokens_per_s_high:,.0f}), "
                f"MFU {100 * self.mfu:.1f}%")


def factor_spread(events: Sequence[Event], profile: DeviceProfile, ranks_on_node: int, seconds: float) -> float:
    """The log-space spread of a step's time that the calibration's uncertain factors leave: each factor's pull on
    the step (its elasticity, by nudging it) through the factors' covariance. Nothing before any calibration."""
    covariance = profile.factor_covariance
    if not covariance:
        return 0.0
    names = list(profile.efficiencies.to_dict())
    pull = []
    for i, name in enumerate(names):
        if covariance[i][i] <= 0.0:
            pull.append(0.0)
            continue
        nudged = dataclasses.replace(profile.efficiencies,
                                     **{name: getattr(profile.efficiencies, name) * math.exp(NUDGE)})
        after = simulate(events, profile.with_efficiencies(nudged), ranks_on_node).seconds
        pull.append(math.log(after / seconds) / NUDGE)
    variance = sum(pull[i] * covariance[i][j] * pull[j] for i in range(len(names)) for j in range(len(names)))
    return math.sqrt(max(0.0, variance))


def work_for(cfg: Mapping[str, Any], work: ModelWork) -> ModelWork:
    """``work`` as ``cfg`` would do it."""
    return work.at(micro_batch_size=cfg["micro_batch_size"], precision=cfg["mixed_precision"],
                   checkpointing=cfg["activation_checkpointing"], compiled=bool(cfg.get("compile")))


def predict(cfg: Mapping[str, Any], work: ModelWork, structure: ModelStructure, placement: Placement,
            micro_batches: int, profile: DeviceProfile, basis: str = "own fake step",
            uncertainty: float | None = None) -> SpeedPrediction:
    """``cfg``'s speed on ``profile`` (see the module): ``work`` is counted by a fake step of ``cfg`` or of a
    configuration it is derived from."""
    done = work_for(cfg, work)
    events = schedule(cfg, done, structure, placement, micro_batches)
    time = simulate(events, profile, ranks_on_node=placement.node_size)
    tokens = cfg["micro_batch_size"] * done.seq_len * placement.world_size * micro_batches
    tokens_per_s = tokens / time.seconds
    sigma = math.hypot(profile.uncertainty if uncertainty is None else uncertainty,
                       factor_spread(events, profile, placement.node_size, time.seconds))
    spread = math.exp(INTERVAL_Z * sigma)
    peak = profile.peak(COMPUTE_DTYPE[cfg["mixed_precision"]])
    mfu = micro_batches * done.model_flops() / (time.seconds * peak) if peak else 0.0
    return SpeedPrediction(time.seconds, tokens_per_s, tokens_per_s / spread, tokens_per_s * spread, mfu,
                           time.compute_s, time.communication_s, time.exposed_communication_s, time.host_s,
                           time.host_optimizer_s, profile.name, basis, sigma)


def work_of_estimate(answer: Mapping[str, Any], cfg: Mapping[str, Any]) -> tuple[ModelWork, float] | None:
    """The work an estimate's fake step counted for ``cfg`` (its ``work``: one copy, or two shallow copies and the
    model's depth), and the share of the parameters that train (LoRA's adapters: a fraction), or None for an
    estimate that counted none."""
    counted = answer.get("work")
    if not counted or not counted.get("steps"):
        return None
    steps = [StepWork.from_dict(s) for s in counted["steps"]]
    work = model_work(steps, cfg["mixed_precision"], cfg["activation_checkpointing"], counted.get("depth"))
    return work, steps[-1].trainable_fraction
