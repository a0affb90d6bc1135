"""The calibration: a profile refitted to measured steps learns what they say, leaves alone what they do not, and
says how far off it still is."""

import dataclasses
import math

import pytest

from autotune.config import FsdpConfig
from autotune.speed.calibration import Sample, refit, residuals
from autotune.speed.device_profile import Efficiencies
from autotune.speed.fsdp_schedule import ModelStructure, Placement, schedule
from autotune.speed.overlap import simulate
from tests.speed_fixtures import gpu, model_work

LAYER = ("LlamaDecoderLayer",)
STRUCTURE = ModelStructure(num_params=4 * 10_000_000, block_params=10_000_000, num_layers=4)


def samples(truth, configs, dtype="bf16", noise=()):
    """What ``truth`` measures for each configuration (times a noise factor each, if given)."""
    out = []
    for i, (block_ms, strategy) in enumerate(configs):
        cfg = FsdpConfig(transformer_layer_cls=LAYER, mixed_precision="fp32" if dtype == "fp32" else "bf16",
                         sharding_strategy=strategy)
        events = schedule(cfg.to_dict(), model_work(block_ms, dtype=dtype), STRUCTURE, Placement(4, 1))
        seconds = simulate(events, truth, 4).seconds * (noise[i] if noise else 1.0)
        out.append(Sample(events, 4, seconds))
    return out


CONFIGS = [(2.0, "FULL_SHARD"), (8.0, "FULL_SHARD"), (1.0, "SHARD_GRAD_OP"), (20.0, "NO_SHARD")]


def test_a_device_twice_as_slow_is_learned_from_four_trials():
    base = gpu()
    truth = base.with_efficiencies(Efficiencies(compute=0.5))
    before = residuals(base, samples(truth, CONFIGS))
    assert all(r < -0.3 for r in before)  # the base predicts every step too fast
    fitted = refit(base, samples(truth, CONFIGS))
    assert fitted.efficiencies.compute == pytest.approx(0.5, rel=0.1)
    assert max(abs(r) for r in residuals(fitted, samples(truth, CONFIGS))) < 0.03
    # What the four left unsaid stays where it was: no fp32 trial ran.
    assert fitted.efficiencies.compute_fp32 == pytest.approx(1.0, abs=0.05)
    assert "refitted on 4" in fitted.source


def test_a_slow_link_is_told_apart_from_slow_compute():
    base = gpu(link_gbps=10.0)
    truth = base.with_efficiencies(Efficiencies(communication=0.4))
    # Steps whose all-gathers outlast their compute say how fast the link is.
    fitted = refit(base, samples(truth, [(0.5, "FULL_SHARD"), (1.0, "FULL_SHARD"), (30.0, "NO_SHARD"),
                                         (0.5, "SHARD_GRAD_OP")]))
    assert fitted.efficiencies.communication == pytest.approx(0.4, rel=0.15)
    assert fitted.efficiencies.compute == pytest.approx(1.0, rel=0.1)


def test_the_uncertainty_shrinks_to_what_the_fit_leaves_and_no_further():
    base = gpu()
    truth = base.with_efficiencies(Efficiencies(compute=0.7))
    exact = refit(base, samples(truth, CONFIGS))
    # Four exact samples and the profile's own 0.2 counted as two: sqrt(2 x 0.04 / 6).
    assert exact.uncertainty == pytest.approx(math.sqrt(2 * 0.2**2 / 6), rel=0.1)
    noisy = refit(base, samples(truth, CONFIGS, noise=(1.3, 0.8, 1.25, 0.75)))
    assert noisy.uncertainty > exact.uncertainty
    many = refit(base, samples(truth, CONFIGS * 25))
    assert many.uncertainty == pytest.approx(0.04)  # the floor


def test_nothing_measured_leaves_the_profile_as_it_was():
    base = gpu()
    assert refit(base, []) is base
    assert refit(base, [dataclasses.replace(samples(base, CONFIGS)[0], seconds=0.0)]) is base


def test_a_factor_the_trials_never_moved_keeps_its_prior_spread_in_the_interval():
    from autotune.speed.device_profile import DeviceProfile
    from autotune.speed.prediction import predict

    base = gpu()
    fitted = refit(base, samples(base.with_efficiencies(Efficiencies(compute=0.7)), CONFIGS))
    # The bf16 trials pin bf16's compute; fp32's factor keeps its prior (0.3 in log).
    sd = [math.sqrt(fitted.factor_covariance[i][i]) for i in range(5)]
    assert sd[0] < 0.1 and sd[1] == pytest.approx(0.3)

    def spread(dtype):
        cfg = FsdpConfig(transformer_layer_cls=LAYER, mixed_precision="fp32" if dtype == "fp32" else "bf16")
        return predict(cfg.to_dict(), model_work(8.0, dtype=dtype), STRUCTURE, Placement(4, 1), 1,
                       fitted).uncertainty

    # A bf16 step like the measured ones is as sure as the fit; an fp32 step leans on the unmeasured factor.
    assert spread("bf16") < 0.15
    assert spread("fp32") > 0.25
    assert spread("fp32") == pytest.approx(math.hypot(fitted.uncertainty, 0.3), rel=0.1)
    # Before any calibration the profile's own spread is the whole of it.
    assert predict(FsdpConfig(transformer_layer_cls=LAYER).to_dict(), model_work(8.0), STRUCTURE, Placement(4, 1), 1,
                   base).uncertainty == pytest.approx(0.2)
    assert DeviceProfile.from_dict(fitted.to_dict()) == fitted
