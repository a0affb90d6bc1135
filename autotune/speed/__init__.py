"""How fast a configuration trains, predicted before any launch: a small public API over modules with one job each.

The fake step that predicts memory (:mod:`autotune.worker.fake_step`) also counts its step's work
(:class:`~autotune.config.step_work.StepWork`). This package turns that work into time on a device, without torch:

- :mod:`.model_work`: the work by part of the model, asked for at any micro batch, precision, checkpointing;
- :mod:`.fsdp_schedule`: the order FSDP issues compute and collectives in, for a configuration;
- :mod:`.overlap`: that order played against a device: what runs at once, what is left exposed;
- :mod:`.device_profile`, :mod:`.named_profiles`, :mod:`.host_profile`: the device's rates, for a named GPU or
  measured on this host;
- :mod:`.calibration`: the profile's efficiencies refitted from measured trials;
- :mod:`.prediction`: step time, tokens/s and MFU with an interval.
"""

from autotune.speed.device_profile import DeviceProfile, Efficiencies, Link, RateCurve
from autotune.speed.fsdp_schedule import ModelStructure, Placement
from autotune.speed.model_work import ModelWork, model_work
from autotune.speed.named_profiles import named_profile, named_profiles
from autotune.speed.prediction import SpeedPrediction, predict

__all__ = ["DeviceProfile", "Efficiencies", "Link", "ModelStructure", "ModelWork", "Placement", "RateCurve",
           "SpeedPrediction", "model_work", "named_profile", "named_profiles", "predict"]
