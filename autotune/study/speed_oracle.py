"""A study's speed predictions: the work its fake steps counted, and the device profile refitted to what it measured.

The memory gate's fake steps (:mod:`autotune.study.fake_step_cache`) count each stepped configuration's work
too. The oracle keeps that work; a configuration stepped itself is predicted from its own, any other from the
nearest stepped one's, changed by the rules of :meth:`autotune.speed.model_work.ModelWork.at` (another micro
batch, precision, checkpointing or compilation; its collectives are its own, from its configuration), with a
wider interval. Each measured trial is a calibration sample: the profile's efficiencies are refitted after it
(:mod:`autotune.speed.calibration`), so later predictions, and the intervals the hopeless check reads, learn
this host.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Callable

from autotune.config import FsdpConfig
from autotune.launch.host import ModelInfo
from autotune.speed.calibration import Sample, refit
from autotune.speed.device_profile import DeviceProfile
from autotune.speed.fsdp_schedule import ModelStructure, Placement, schedule
from autotune.speed.model_work import COMPUTE_DTYPE, ModelWork
from autotune.speed.prediction import SpeedPrediction, predict, work_for, work_of_estimate

# The log-space spread a derived prediction adds to the profile's (in quadrature): the rules that change the
# work are approximations of a fake step.
DERIVED_SPREAD = 0.1


def structure_of(model: ModelInfo, trainable: float = 1.0) -> ModelStructure:
    """What the step-time model shards, from the host probe's description of the model."""
    block = model.block_params or 0
    return ModelStructure(model.num_params, block, model.num_layers if block else 0, dict(model.size_units or {}),
                          trainable)


def estimate_speed(model: ModelInfo, profile: DeviceProfile, world_size: int, nnodes: int,
                   micro_batches: int = 1) -> Callable[[FsdpConfig, dict[str, Any]], SpeedPrediction | None]:
    """``autotune estimate``'s speed: each configuration from the work its own fake step counted."""
    placement = Placement(world_size, nnodes)

    def speed(cfg: FsdpConfig, result: dict[str, Any]) -> SpeedPrediction | None:
        found = work_of_estimate(result, cfg.to_dict())
        if found is None:
            return None
        work, trainable = found
        return predict(cfg.to_dict(), work, structure_of(model, trainable), placement, micro_batches, profile)

    return speed


def _distance(a: FsdpConfig, b: FsdpConfig) -> float:
    """How far one configuration's work is from another's, by the rules that would change it."""
    return (4.0 * (COMPUTE_DTYPE[a.mixed_precision] != COMPUTE_DTYPE[b.mixed_precision])
            + 2.0 * (a.activation_checkpointing != b.activation_checkpointing)
            + abs(math.log2(a.micro_batch_size / b.micro_batch_size)) + 0.5 * (a.key() != b.key()))


class SpeedOracle:
    """See the module. Thread-safe: trials on several device slots finish in threads of their own."""

    def __init__(self, model: ModelInfo, profile: DeviceProfile, placement: Placement,
                 micro_batches: Callable[[int], int] = lambda mbs: 1) -> None:
        self.model = model
        self.base = profile
        self.profile = profile
        self.placement = placement
        self.micro_batches = micro_batches
        # Configuration key -> (the configuration stepped, its work, the share of its parameters that train).
        self._works: dict[str, tuple[FsdpConfig, ModelWork, float]] = {}
        self._samples: dict[int, Sample] = {}
        # Predictions already made with the current work and profile (cleared when either changes), and how many
        # times they changed: a prediction begun before a change is not kept after it.
        self._predicted: dict[str, SpeedPrediction | None] = {}
        self._changes = 0
        self._lock = threading.Lock()

    @property
    def calibrated(self) -> int:
        """Measured trials the profile was refitted to."""
        return len(self._samples)

    def take(self, cfg: FsdpConfig, answer: dict[str, Any]) -> None:
        """A fake step's answer for ``cfg`` (its work, where it counted one)."""
        found = work_of_estimate(answer, cfg.to_dict())
        if found is not None:
            with self._lock:
                self._works[cfg.replace(compile=False).key()] = (cfg.replace(compile=False), *found)
                self._changed()

    def known(self) -> int:
        return len(self._works)

    def _basis(self, cfg: FsdpConfig) -> tuple[FsdpConfig, ModelWork, float] | None:
        with self._lock:
            own = self._works.get(cfg.replace(compile=False).key())
            if own is not None:
                return own
            if not self._works:
                return None
            return min(self._works.values(), key=lambda entry: _distance(cfg, entry[0]))

    def predict(self, cfg: FsdpConfig) -> SpeedPrediction | None:
        """``cfg``'s predicted speed on the study's (refitted) profile, or None before any fake step."""
        key = cfg.key()
        with self._lock:
            if key in self._predicted:
                return self._predicted[key]
            begun = self._changes
        predicted = self._predict(cfg)
        with self._lock:
            if self._changes == begun:
                self._predicted[key] = predicted
        return predicted

    def _predict(self, cfg: FsdpConfig) -> SpeedPrediction | None:
        basis = self._basis(cfg)
        if basis is None:
            return None
        stepped, work, trainable = basis
        own = stepped.key() == cfg.replace(compile=False).key()
        spread = self.profile.uncertainty if own else math.hypot(self.profile.uncertainty, DERIVED_SPREAD)
        return predict(cfg.to_dict(), work, structure_of(self.model, trainable), self.placement,
                       self.micro_batches(cfg.micro_batch_size), self.profile,
                       "own fake step" if own else f"derived from {stepped.describe()}", spread)

    def observe(self, trial_number: int, cfg: FsdpConfig, step_seconds: float, refit_now: bool = True) -> None:
        """A measured trial: a calibration sample, and (``refit_now``) the profile refitted to every sample so far."""
        basis = self._basis(cfg)
        if basis is None or not step_seconds > 0:
            return
        _, work, trainable = basis
        fields = cfg.to_dict()
        events = schedule(fields, work_for(fields, work), structure_of(self.model, trainable), self.placement,
                          self.micro_batches(cfg.micro_batch_size))
        with self._lock:
            self._samples[trial_number] = Sample(events, self.placement.node_size, step_seconds)
        if refit_now:
            self.refit()

    def refit(self) -> None:
        """The profile refitted to every sample so far."""
        with self._lock:
            samples = list(self._samples.values())
        fitted = refit(self.base, samples)
        with self._lock:
            self.profile = fitted
            self._changed()

    def _changed(self) -> None:
        """The work or the profile changed (under the lock): every kept prediction is stale."""
        self._predicted.clear()
        self._changes += 1

    def summary(self) -> dict[str, Any]:
        return {"profile": self.profile.name, "source": self.profile.source,
                "efficiencies": dataclasses.asdict(self.profile.efficiencies),
                "uncertainty": self.profile.uncertainty, "calibration_trials": self.calibrated}
