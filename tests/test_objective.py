"""Every branch of the objective, through its seams: a scripted launch and estimator, Optuna's in-memory storage.

No process starts here; the real torchrun path is tests/test_trials_torchrun.py and tests/test_study_end_to_end.py.
"""

import subprocess
import sys
import threading
import time

import optuna
import pytest
from optuna.trial import TrialState

from autotune.config import FsdpConfig, RankMemory, TrialResult
from autotune.launch.host import HostInfo, ModelInfo
from autotune.launch.launcher import LaunchOutcome
from autotune.study import RunSettings, run_study
from autotune.study.settings import ExecutionSettings, SearchSettings, StudySettings
from autotune.study.baseline import standard_recipe
from autotune.study.claims import runner_identity
from autotune.study.record import CONSTRAINT_KEY, Attr, StudyAttr
from autotune.study.space import parse_space

LAYER = ("LlamaDecoderLayer",)
HOST = HostInfo(device_type="cpu", cuda_device_count=0, cpu_count=2, device_name=None, device_memory_bytes=None,
                bf16_supported=True, fp16_supported=True, bf16_speedup=2.0, torch_version="2.x",
                transformers_version="5.x")
MODEL = ModelInfo(num_params=1000, layer_classes=LAYER, num_layers=2, vocab_size=100, class_name="Tiny")
MiB = 2**20


class ScriptedLaunch:
    """Answers each launch from ``answer(cfg, request)``; records what was launched."""

    def __init__(self, answer):
        self.answer = answer
        self.launched: list[FsdpConfig] = []

    def __call__(self, request, trial_dir, slot):
        self.launched.append(request.fsdp)
        result = self.answer(request.fsdp, request)
        return LaunchOutcome(result=result, wall_s=0.01, log_path=trial_dir / "log.txt", trial_dir=trial_dir,
                             started_at=time.time(), ended_at=time.time())


class ScriptedEstimator:
    """Predicts ``peak(cfg)`` tensor bytes; counts the estimates asked for."""

    def __init__(self, peak):
        self.peak = peak
        self.asked = 0

    def estimate(self, cfg):
        self.asked += 1
        return {"peak_bytes": self.peak(cfg), "breakdown": {}, "method": "scripted", "seconds": 0.0}

    def close(self):
        pass


def ok(tokens: float = 1000.0, peak: int = 10 * MiB) -> TrialResult:
    return TrialResult(status="ok", tokens_per_s=tokens, peak_memory_bytes=peak, world_size=2, device="cpu",
                       rank_memory=[RankMemory(rank=0, tracked=peak)])


@pytest.fixture(autouse=True)
def private_locks(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_LOCK_DIR", str(tmp_path / "locks"))


def settings(tmp_path, space: str, budget: int = 100 * MiB, trials: int = 5, **changes) -> RunSettings:
    import yaml

    changes.setdefault("confirm", 0)  # the confirmation round has tests of its own

    search = {("sampler" if key == "search" else key): value for key, value in changes.items()}
    return RunSettings(
        study=StudySettings(model="tiny", model_label="tiny", nproc=2, seq_len=32, budget_bytes=budget,
                            budget_text="100MiB", space=parse_space(yaml.safe_load(space), "test.yaml"), name="s",
                            storage_url=f"sqlite:///{tmp_path}/unused.db"),
        search=SearchSettings(trials=trials, **search), execution=ExecutionSettings(trial_timeout_s=30, quiet=True))


TWO = "fsdp_version: [1, 2]\nsharding_strategy: FULL_SHARD\nmixed_precision: fp32\nmicro_batch_size: 1\n"
# A space of one configuration: the standard recipe itself (the first trial on HOST, where bf16 is fast).
RECIPE = "fsdp_version: 2\nsharding_strategy: FULL_SHARD\nmixed_precision: bf16\nactivation_checkpointing: full\nmicro_batch_size: 1\n"


def run(tmp_path, space=TWO, answer=lambda cfg, req: ok(), estimator=None, storage=None, model_info=MODEL, **kw):
    launch = ScriptedLaunch(answer)
    storage = storage or optuna.storages.InMemoryStorage()
    outcome = run_study(settings(tmp_path, space, use_estimate=estimator is not None, **kw), HOST, model_info,
                        launch=launch, estimator=estimator, storage=storage)
    return outcome, launch, storage


def by_state(study, state):
    return [t for t in study.trials if t.state == state]


def test_ok_trials_are_complete_with_their_figures_and_a_feasible_constraint(tmp_path):
    outcome, launch, _ = run(tmp_path)
    study = outcome.study
    # The baseline (FSDP2 SHARD_GRAD_OP bf16) and the space's two configurations, each launched once.
    assert len(launch.launched) == 3 and outcome.stop_reason == "space exhausted"
    # The baseline lies outside the space: a reference, not one of the run's trials.
    assert study.trials[0].user_attrs[Attr.OUTSIDE_SPACE]
    for t in by_state(study, TrialState.COMPLETE):
        assert t.value == 1000.0 and t.user_attrs[Attr.PEAK_MEMORY_BYTES] == 10 * MiB
        assert t.constraints[CONSTRAINT_KEY] == 10 * MiB - 100 * MiB
        assert t.system_attrs["constraints"] == [10 * MiB - 100 * MiB]
    assert (outcome.counts.launched, outcome.counts.references, outcome.counts.failed) == (2, 1, 0)


def test_the_baseline_is_enqueued_once_across_runs(tmp_path):
    first, _, storage = run(tmp_path)
    second, launch, _ = run(tmp_path, storage=storage)
    baselines = [t for t in second.study.trials if t.user_attrs.get(Attr.BASELINE)]
    assert len(baselines) == 1 and baselines[0].number == 0
    assert baselines[0].user_attrs[Attr.CONFIG] == standard_recipe(HOST, LAYER, settings(tmp_path,
                                                                                         TWO).study.space).to_dict()
    assert launch.launched == []  # the space was measured in the first run


def test_out_of_memory_is_complete_and_infeasible(tmp_path):
    oom = TrialResult(status="oom", error="OutOfMemoryError", failed_rank=1, peak_memory_bytes=200 * MiB)
    outcome, _, _ = run(tmp_path, answer=lambda cfg, req: oom)
    for t in outcome.study.trials:
        assert t.state == TrialState.COMPLETE and t.value == 0.0
        assert t.user_attrs[Attr.CAUSE] == "oom" and t.constraints[CONSTRAINT_KEY] == 100 * MiB


def test_a_crash_fails_and_is_reused_not_launched_again(tmp_path):
    crash = TrialResult(status="crash", error="rank 1 failed: RuntimeError: boom", failed_rank=1, exit_code=1)
    space = "fsdp_version: 2\nsharding_strategy: FULL_SHARD\nmixed_precision: fp32\nmicro_batch_size: [1, 2, 4, 8]\n"
    outcome, launch, _ = run(tmp_path, space=space, answer=lambda cfg, req: crash, trials=10)
    study = outcome.study
    crashed = by_state(study, TrialState.FAIL)
    assert crashed and all(t.user_attrs[Attr.CAUSE] == "crash" for t in crashed)
    assert len({c.key() for c in launch.launched}) == len(launch.launched), "a crashed configuration was launched again"
    assert outcome.stop_reason == "same crash" and len(launch.launched) == 3  # three alike, nothing measured


def test_a_timeout_fails_and_is_retried(tmp_path):
    calls = []

    def answer(cfg, req):
        calls.append(cfg.key())
        if len(calls) == 1:
            return TrialResult(status="timeout", error="no result within --trial-timeout 30s")
        return ok()

    outcome, launch, _ = run(tmp_path, space=RECIPE, answer=answer)
    (failed,) = by_state(outcome.study, TrialState.FAIL)
    assert failed.user_attrs[Attr.CAUSE] == "timeout"
    assert len(launch.launched) == 2 and launch.launched[0] == launch.launched[1]  # a timeout may not repeat


def test_a_hopeless_trial_is_stopped_early_and_pruned(tmp_path):
    def answer(cfg, req):
        if req.abort_below_tokens_per_s is None:
            return ok(tokens=10_000.0)
        return TrialResult(status="aborted", tokens_per_s=req.abort_below_tokens_per_s / 10)

    outcome, _, _ = run(tmp_path, answer=answer)
    aborted = [t for t in outcome.study.trials if t.user_attrs.get(Attr.ABORTED)]
    assert aborted and all(t.state == TrialState.PRUNED for t in aborted)
    assert all(t.user_attrs[Attr.TOKENS_PER_S_PARTIAL] == 500.0 for t in aborted)  # 1/10 of best / 2
    assert outcome.counts.aborted == len(aborted)


def test_configurations_predicted_over_budget_are_never_drawn_and_the_reason_is_kept(tmp_path):
    # NO_SHARD is predicted at 500 MiB (over the 100 MiB budget), the rest at 50 MiB.
    space = "fsdp_version: [1, 2]\nsharding_strategy: [FULL_SHARD, NO_SHARD]\nmixed_precision: fp32\nmicro_batch_size: 1\n"
    estimator = ScriptedEstimator(lambda cfg: 500 * MiB if cfg.sharding_strategy == "NO_SHARD" else 50 * MiB)
    outcome, launch, _ = run(tmp_path, space=space, estimator=estimator)
    study = outcome.study
    assert launch.launched and all(cfg.sharding_strategy != "NO_SHARD" for cfg in launch.launched)
    assert not [t for t in study.trials if "NO_SHARD" in (t.user_attrs.get(Attr.LABEL)
                                                          or "")], "an excluded draw became a trial"
    excluded = study.user_attrs[StudyAttr.EXCLUDED]
    assert excluded["count"] == 2 and all("predicted peak" in e["reason"] for e in excluded["examples"])
    assert outcome.stop_reason == "space exhausted" and outcome.plan.active
    # The run stops before a draw finds nothing: no trial without a configuration.
    assert all(t.user_attrs.get(Attr.CONFIG) for t in study.trials)


def test_an_enqueued_configuration_predicted_over_budget_is_pruned_with_its_prediction(tmp_path):
    # The baseline (the standard recipe, in bf16 here) is queued, not drawn: the gate still stops it.
    space = "fsdp_version: 2\nsharding_strategy: [FULL_SHARD, NO_SHARD]\nmixed_precision: fp32\nmicro_batch_size: 1\n"
    estimator = ScriptedEstimator(lambda cfg: 500 * MiB if "NO_SHARD" in cfg.sharding_strategy
                                  or cfg.mixed_precision == "bf16"
                                  else 50 * MiB)
    outcome, launch, _ = run(tmp_path, space=space, estimator=estimator)
    baseline = outcome.study.trials[0]
    assert baseline.user_attrs[Attr.BASELINE] and baseline.state == TrialState.PRUNED
    assert "predicted peak" in baseline.user_attrs[Attr.PRUNE_REASON]
    assert baseline.constraints[CONSTRAINT_KEY] > 0 and baseline.user_attrs[Attr.PREDICTED_PEAK_BYTES] == 500 * MiB
    assert launch.launched and all(cfg.mixed_precision == "fp32" for cfg in launch.launched)
    assert outcome.counts.predicted_over == 1


def test_optunas_samplers_still_see_over_budget_draws_as_pruned_trials(tmp_path):
    space = "fsdp_version: 2\nsharding_strategy: [FULL_SHARD, NO_SHARD]\nmixed_precision: fp32\nmicro_batch_size: 1\n"
    estimator = ScriptedEstimator(lambda cfg: 500 * MiB if cfg.sharding_strategy == "NO_SHARD" else 50 * MiB)
    outcome, launch, _ = run(tmp_path, space=space, estimator=estimator, search="tpe", trials=3)
    pruned = [t for t in outcome.study.trials if "predicted peak" in t.user_attrs.get(Attr.PRUNE_REASON, "")]
    assert pruned and all(t.state == TrialState.PRUNED and t.constraints[CONSTRAINT_KEY] > 0 for t in pruned)
    assert all(cfg.sharding_strategy != "NO_SHARD" for cfg in launch.launched)


def test_micro_batches_above_the_cap_are_never_launched(tmp_path):
    space = "fsdp_version: 2\nsharding_strategy: FULL_SHARD\nmixed_precision: bf16\nactivation_checkpointing: full\nmicro_batch_size: [1, 2, 4]\n"
    estimator = ScriptedEstimator(lambda cfg: 40 * MiB * cfg.micro_batch_size)
    outcome, launch, _ = run(tmp_path, space=space, estimator=estimator)
    assert outcome.plan.mbs_cap == 2
    assert launch.launched and all(cfg.micro_batch_size <= 2 for cfg in launch.launched)
    excluded = outcome.study.user_attrs[StudyAttr.EXCLUDED]["examples"]
    assert any("above 2" in e["reason"] and "mbs=4" in e["label"] for e in excluded)


def test_a_configuration_measured_before_is_reused(tmp_path):
    """The claim on a configuration measured before (by an earlier run, or another tuner) hands back that trial
    instead of a launch. (A second run used to check this, but autotune's search never proposes a measured
    configuration and a finished space stops before drawing: the check held for no trial at all.)"""
    import contextlib

    from autotune.study.claims import Claims
    from autotune.study.record import trial_config

    first, _, _ = run(tmp_path)
    measured = [t for t in first.study.trials if t.state == TrialState.COMPLETE]
    assert measured
    claims = Claims(first.study, contextlib.nullcontext, 60)
    again = first.study.ask()
    previous = claims.claim(again, trial_config(measured[-1]), on_wait=lambda running: pytest.fail("none is running"))
    assert previous is not None and previous.number == measured[-1].number
    fresh = first.study.ask()
    other = trial_config(measured[-1]).replace(micro_batch_size=8)
    assert claims.claim(fresh, other, on_wait=lambda running: pytest.fail("none is running")) is None


def test_a_configuration_another_tuner_is_measuring_is_waited_for_and_reused(tmp_path, monkeypatch):
    from autotune.study.claims import Claims

    space = RECIPE
    storage = optuna.storages.InMemoryStorage()
    other = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    cfg = standard_recipe(HOST, LAYER, settings(tmp_path, space).study.space)
    running = other.ask()
    for name, value in ((Attr.CONFIG, cfg.to_dict()), (Attr.CLAIMED, True), (Attr.RUNNER, runner_identity())):
        running.set_user_attr(name, value)

    # The other tuner finishes only once this one waits for it: the race is run, whatever the machine's speed.
    waiting = threading.Event()
    wait_for = Claims.wait_for

    def wait_noted(self, trial):
        waiting.set()
        return wait_for(self, trial)

    monkeypatch.setattr(Claims, "wait_for", wait_noted)

    def finish():
        waiting.wait(60)
        running.set_user_attr(Attr.PEAK_MEMORY_BYTES, 7 * MiB)
        running.set_constraint(CONSTRAINT_KEY, -1.0)
        other.tell(running, 4321.0)

    threading.Thread(target=finish).start()
    # autotune's own search never proposes a configuration another trial holds;
    # an Optuna sampler does, and the claim makes it wait and reuse.
    outcome, launch, _ = run(tmp_path, space=space, storage=storage, search="tpe")
    assert waiting.is_set(), "the tuner never waited for the trial another one was running"
    assert launch.launched == [], "the configuration was measured a second time"
    reused = [t for t in outcome.study.trials if t.user_attrs.get(Attr.REUSED_FROM) == running.number]
    assert reused and reused[0].value == 4321.0


def test_a_running_trial_left_by_a_dead_tuner_is_failed_and_queued_again(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    space = RECIPE
    storage = optuna.storages.InMemoryStorage()
    other = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    stale = other.ask()
    cfg = standard_recipe(HOST, LAYER, settings(tmp_path, space).study.space)
    stale.set_user_attr(Attr.CONFIG, cfg.to_dict())
    stale.set_user_attr(Attr.RUNNER, {**runner_identity(), "pid": dead.pid})
    outcome, launch, _ = run(tmp_path, space=space, storage=storage)
    trials = outcome.study.trials
    assert trials[0].state == TrialState.FAIL and trials[0].user_attrs[Attr.CAUSE] == "tuner died"
    retry = next(t for t in trials if t.user_attrs.get(Attr.RETRY_OF) == 0)
    assert retry.state == TrialState.COMPLETE and launch.launched == [cfg]


def test_a_run_is_checked_against_its_stored_study_once(tmp_path, monkeypatch):
    """The command line checks the settings against the study they resume (the trial depth it started with comes
    from there); run_study takes settings so checked as they are, and checks only those that were not."""
    from autotune.study import settings as settings_module

    calls = []
    real = settings_module.check_resumable
    monkeypatch.setattr(settings_module, "check_resumable", lambda s: calls.append(s.study.name) or real(s))
    checked = settings_module.checked_for_resume(settings(tmp_path, TWO, use_estimate=False))
    assert checked.stored_identity == {} and str(checked.study.trial_depth) == "auto" and len(calls) == 1
    assert settings_module.checked_for_resume(checked) is checked
    run_study(checked, HOST, MODEL, launch=ScriptedLaunch(lambda cfg, req: ok()),
              storage=optuna.storages.InMemoryStorage())
    assert len(calls) == 1
    run_study(settings(tmp_path, TWO, use_estimate=False), HOST, MODEL, launch=ScriptedLaunch(lambda cfg, req: ok()),
              storage=optuna.storages.InMemoryStorage())
    assert len(calls) == 2
