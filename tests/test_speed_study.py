"""A study with a speed model, through its seams: each trial keeps its prediction beside its measurement, the
profile learns from the measurements, a configuration predicted hopeless is never launched and says why, the
search starts from predicted speed, and the summary states how far off the predictions were."""

import dataclasses

import optuna
import pytest
from optuna.trial import TrialState

from autotune.config import FsdpConfig, RankMemory, TrialResult
from autotune.launch.host import HostInfo, ModelInfo
from autotune.speed.device_profile import Efficiencies
from autotune.speed.fsdp_schedule import Placement
from autotune.speed.host_profile import host_profile
from autotune.speed.prediction import predict, work_of_estimate
from autotune.study import run_study
from autotune.study.record import Attr, StudyAttr
from autotune.study.speed_checks import MIN_CALIBRATION, hopeless_reason
from autotune.study.speed_oracle import structure_of
from tests.speed_fixtures import HOST_RATES, fake_step_answer
from tests.test_objective import LAYER, MiB, ScriptedLaunch, settings

HOST = HostInfo(device_type="cpu", cuda_device_count=0, cpu_count=2, device_name=None, device_memory_bytes=None,
                bf16_supported=True, fp16_supported=False, bf16_speedup=4.0, torch_version="2.x",
                transformers_version="5.x", rates=HOST_RATES)
MODEL = ModelInfo(num_params=4000, layer_classes=LAYER, num_layers=2, vocab_size=100, class_name="Tiny",
                  block_params=1000)
SPACE = ("fsdp_version: 2\nsharding_strategy: [FULL_SHARD, NO_SHARD]\nmixed_precision: [fp32, bf16]\n"
         "activation_checkpointing: [none, full]\nmicro_batch_size: [1, 2, 4]\n")
# The host as it really is: its compute 30% slower than the probe measured.
TRUTH = host_profile(HOST).with_efficiencies(Efficiencies(compute=0.7))


class Estimator:
    def __init__(self):
        self.asked = 0

    def estimate(self, cfg):
        self.asked += 1
        return fake_step_answer(cfg, seq_len=32)

    def close(self):
        pass


def measured(cfg: FsdpConfig, request) -> TrialResult:
    """What the true host measures: the step-time model on TRUTH, from the configuration's own work."""
    work, trainable = work_of_estimate(fake_step_answer(cfg, seq_len=32), cfg.to_dict())
    speed = predict(cfg.to_dict(), work, structure_of(MODEL, trainable), Placement(2, 1), 1, TRUTH)
    tokens = cfg.micro_batch_size * 32 * 2
    return TrialResult(status="ok", tokens_per_s=speed.tokens_per_s, tokens_per_step=tokens, peak_memory_bytes=MiB,
                       world_size=2, device="cpu", rank_memory=[RankMemory(rank=0, tracked=MiB)])


@pytest.fixture
def study(tmp_path):
    launch = ScriptedLaunch(measured)
    run = run_study(settings(tmp_path, SPACE, trials=8, use_estimate=True), HOST, MODEL, launch=launch,
                    estimator=Estimator(), storage=optuna.storages.InMemoryStorage())
    return run, launch


def test_every_launched_trial_keeps_its_prediction_beside_its_measurement(study):
    run, _ = study
    measured_trials = [t for t in run.study.trials if t.state == TrialState.COMPLETE]
    assert len(measured_trials) >= MIN_CALIBRATION
    for t in measured_trials:
        prediction = t.user_attrs[Attr.PREDICTED_SPEED]
        assert prediction["tokens_per_s_low"] < prediction["tokens_per_s"] < prediction["tokens_per_s_high"]
        assert t.user_attrs[Attr.PREDICTED_TOKENS_PER_S] == pytest.approx(prediction["tokens_per_s"], rel=1e-6)
    # Before any measurement the probe's profile over-predicts (its compute is 1/0.7 too fast; the step's
    # collectives and memory-bound work are as measured); refitted, the later ones come close.
    first, last = measured_trials[0], measured_trials[-1]
    assert first.user_attrs[Attr.PREDICTED_TOKENS_PER_S] / first.value > 1.08
    assert last.user_attrs[Attr.PREDICTED_TOKENS_PER_S] / last.value == pytest.approx(1.0, abs=0.03)
    model = run.study.user_attrs[StudyAttr.SPEED_MODEL]
    assert model["calibration_trials"] == len(measured_trials)
    # The prior holds every factor near 1 (compute tightest, the probe measures it best), so the fit shares the
    # slow-down among the factors that explain it; compute moves the right way.
    assert model["efficiencies"]["compute"] < 1.0


def test_a_configuration_predicted_hopeless_is_never_launched_and_says_why(study):
    run, launch = study
    # fp32 runs at a quarter of bf16's rate here: once the profile is refitted, every fp32 configuration is
    # predicted below the best measured even at its high side.
    skipped = run.study.user_attrs[StudyAttr.SKIPPED_SLOW]
    assert any(s["config"]["mixed_precision"] == "fp32" for s in skipped)
    for s in skipped:
        assert s["high"] < s["best"] and "below the best measured" in s["reason"]
    launched_keys = {c.key() for c in launch.launched}
    assert not launched_keys & {FsdpConfig.from_dict(s["config"]).key() for s in skipped}
    assert not [c for c in launch.launched[MIN_CALIBRATION:] if c.mixed_precision == "fp32"]
    # The search's exclusions carry the same reason.
    examples = run.study.user_attrs[StudyAttr.EXCLUDED]["examples"]
    assert any("below the best measured" in e["reason"] for e in examples)


def test_the_search_starts_from_predicted_speed(study):
    _, launch = study
    # The recipe first (full checkpointing), then the frontier: the fastest predicted first, no checkpointing.
    assert launch.launched[1].activation_checkpointing == "none"
    assert launch.launched[1].mixed_precision == "bf16" and launch.launched[1].micro_batch_size == 4


def test_the_trials_command_lists_what_was_skipped(tmp_path, monkeypatch, capsys):
    from tests.conftest import cli_in_process

    url = f"sqlite:///{tmp_path}/speed.db"
    run_settings = settings(tmp_path, SPACE, trials=8, use_estimate=True)
    run_settings = dataclasses.replace(run_settings, study=dataclasses.replace(run_settings.study, storage_url=url))
    run_study(run_settings, HOST, MODEL, launch=ScriptedLaunch(measured), estimator=Estimator())
    code, out, _ = cli_in_process(["trials", "--storage", url], tmp_path, monkeypatch, capsys)
    assert code == 0
    assert "predicted" in out.splitlines()[1]
    assert "Not launched, predicted below the best measured" in out and "fp32" in out.split("Not launched")[1]


def test_nothing_is_ruled_out_before_the_profile_is_calibrated():
    prediction = dataclasses.make_dataclass("P", ["tokens_per_s", "tokens_per_s_low", "tokens_per_s_high"])(
        10.0, 5.0, 20.0)
    assert hopeless_reason(prediction, 100.0, MIN_CALIBRATION - 1) is None
    assert "below the best measured 100" in hopeless_reason(prediction, 100.0, MIN_CALIBRATION)
    assert hopeless_reason(prediction, 15.0, MIN_CALIBRATION) is None  # within its interval: launched


def test_a_resumed_study_calibrates_on_the_trials_it_measured_before(tmp_path):
    storage = optuna.storages.InMemoryStorage()
    first = run_study(settings(tmp_path, SPACE, trials=4, use_estimate=True), HOST, MODEL,
                      launch=ScriptedLaunch(measured), estimator=Estimator(), storage=storage)
    before = len([t for t in first.study.trials if t.state == TrialState.COMPLETE])
    second = run_study(settings(tmp_path, SPACE, trials=6, use_estimate=True), HOST, MODEL,
                       launch=ScriptedLaunch(measured), estimator=Estimator(), storage=storage)
    after = len([t for t in second.study.trials if t.state == TrialState.COMPLETE])
    # The first run's trials calibrate the second's model (which may then find every configuration left hopeless).
    assert after >= before >= MIN_CALIBRATION
    assert second.study.user_attrs[StudyAttr.SPEED_MODEL]["calibration_trials"] == after


def test_a_prediction_made_while_the_profile_changes_is_not_kept():
    """The oracle keeps each prediction until the work or the profile changes; one begun before a refit (another
    device slot's trial finished meanwhile) is answered but not kept, so the next asks the refitted profile."""
    from autotune.study.speed_oracle import SpeedOracle

    oracle = SpeedOracle(MODEL, host_profile(HOST), Placement(2, 1))
    cfg = FsdpConfig(transformer_layer_cls=LAYER, micro_batch_size=2)
    oracle.take(cfg, fake_step_answer(cfg, seq_len=32))
    first = oracle.predict(cfg)
    assert oracle.predict(cfg) is first  # kept
    unchanged = oracle._predict

    def refitted_meanwhile(asked):
        answer = unchanged(asked)
        oracle.observe(0, asked, 10 * first.step_s)  # ten times slower than predicted: a slower profile
        return answer

    oracle._predict = refitted_meanwhile
    oracle.take(cfg, fake_step_answer(cfg, seq_len=32))  # its fake step again: the kept prediction goes
    during = oracle.predict(cfg)
    oracle._predict = unchanged
    after = oracle.predict(cfg)
    assert after is not during and after.tokens_per_s < during.tokens_per_s
