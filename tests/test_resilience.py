"""A study survives hangs, crashes, OOMs, kill -9 and parallel tuners, and loses nothing."""

import os
from collections import Counter
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.conftest import REPO, processes_mentioning, run_cli

pytestmark = pytest.mark.torchrun

FAST = ["--seq-len", "32", "--warmup-steps", "2", "--timed-steps", "2", "--space", "smoke"]


def _study(root: Path, name: str | None = None) -> optuna.Study:
    storage = f"sqlite:///{root / 'studies' / 'autotune.db'}"
    names = optuna.get_all_study_names(storage)
    return optuna.load_study(study_name=name or names[0], storage=storage)


def test_a_hung_trial_times_out_and_leaves_no_process(tmp_path, forks):
    # The study going on after a timeout is tests/test_objective.py's; this is the real job being killed.
    # A space that holds the standard recipe (full checkpointing, in whichever precision the probe finds fast),
    # so that the one trial is the recipe: a recipe outside the space would be a reference, timed out too.
    (tmp_path / "recipe.yaml").write_text("fsdp_version: 2\nsharding_strategy: FULL_SHARD\nactivation_checkpointing: full\n"
                                          "mixed_precision: [fp32, bf16]\nmicro_batch_size: 1\n")
    done = run_cli("run", "--mem-budget", "20GB", "--model", "tests.models:hang", "--trials", "1",
                   "--trial-timeout", "6", "--no-estimate", *FAST, "--space", "recipe.yaml", cwd=tmp_path, forks=forks)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    trials = _study(tmp_path).trials
    assert [t.state for t in trials] == [TrialState.FAIL]
    for t in trials:
        assert t.user_attrs["cause"] == "timeout"
        assert Path(tmp_path / t.user_attrs["log_path"]).exists()
    assert processes_mentioning(str(tmp_path)) == [], "trial processes outlived the timeout"
    table = run_cli("trials", cwd=tmp_path).stdout
    assert table.count("timeout") >= 1 and "no result within --trial-timeout 6s" in table


def test_kill_9_mid_trial_leaves_no_orphans_and_the_rerun_retries(tmp_path, forks):
    args = [sys.executable, "-m", "autotune", "run", "--mem-budget", "20GB", "--model", "tests.models:hang_once",
            "--trials", "2", "--trial-timeout", "120", "--no-estimate", "--confirm", "0", *FAST]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    tuner = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = tmp_path / "hang-once.marker"
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert marker.exists(), "the trial never started"
    time.sleep(1)
    tuner.send_signal(signal.SIGKILL)
    tuner.wait()
    deadline = time.monotonic() + 20
    while processes_mentioning(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(tmp_path)) == [], "torchrun or a rank outlived the killed tuner"
    (stale,) = _study(tmp_path).trials
    assert stale.state == TrialState.RUNNING

    done = run_cli(*args[3:], cwd=tmp_path, forks=forks)
    assert done.returncode == 0, done.stderr
    assert "left RUNNING by a tuner that died" in done.stderr
    trials = _study(tmp_path).trials
    assert trials[0].state == TrialState.FAIL and trials[0].user_attrs["cause"] == "tuner died"
    retry = next(t for t in trials if t.user_attrs.get("retry_of") == 0)
    assert retry.state == TrialState.COMPLETE
    assert retry.user_attrs["config"] == trials[0].user_attrs["config"]


def test_three_tuners_share_one_study_without_loss_or_overlap(tmp_path, forks):
    args = [sys.executable, "-m", "autotune", "run", "--mem-budget", "20GB", "--trials", "3", "--confirm", "0",
            "--no-estimate", *FAST]
    env = {**os.environ, "PYTHONPATH": str(REPO), **forks.env()}
    tuners = [subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(3)]
    outputs = [t.communicate(timeout=600) for t in tuners]
    for tuner, (_, err) in zip(tuners, outputs):
        assert tuner.returncode == 0, err
        assert "database is locked" not in err and "Traceback" not in err
    trials = _study(tmp_path).trials
    assert all(t.state.is_finished() for t in trials), "a trial was left unfinished"
    launched = [t for t in trials if "started_at" in t.user_attrs and "reused_from" not in t.user_attrs
                and "confirmation_round" not in t.user_attrs]
    keys = [str(sorted(t.user_attrs["config"].items())) for t in launched]
    assert len(keys) == len(set(keys)), "a configuration was measured twice"
    # That the tuners share the confirmation round as well is tests/test_many_hosts.py's (three tuners, two hosts).
    # The smoke space (4) and the baseline: five configurations, each measured once.
    assert len(launched) == 5
    windows = sorted((t.user_attrs["started_at"], t.user_attrs["ended_at"]) for t in trials
                     if "started_at" in t.user_attrs
                     and "reused_from" not in t.user_attrs)
    for (_, end), (start, _) in zip(windows, windows[1:]):
        assert start >= end, "two trials ran on the same devices at once"
    # Each launch is one tuner's, by the record (not the summary's prose): every launched trial names one of the
    # three as its runner, and none ran more than its 3 trials, the standard recipe (a reference outside the
    # smoke space, not one of them) aside.
    by_tuner = Counter(t.user_attrs["runner"]["pid"] for t in launched if not t.user_attrs.get("outside_space"))
    assert set(by_tuner) <= {tuner.pid for tuner in tuners} and sum(by_tuner.values()) == len(launched) - 1
    assert max(by_tuner.values()) <= 3


def test_device_slots_run_trials_side_by_side(tmp_path, forks):
    done = run_cli("run", "--mem-budget", "20GB", "--nproc", "1", "--devices", "0", "--devices", "1",
                   "--trials", "4", "--confirm", "0", "--no-estimate", *FAST, cwd=tmp_path, forks=forks)
    assert done.returncode == 0, done.stderr
    launched = [t for t in _study(tmp_path, "llama-tiny-w1-s32-20GB").trials
                if "started_at" in t.user_attrs and "reused_from" not in t.user_attrs]
    assert {tuple(t.user_attrs["devices"]) for t in launched} == {(0,), (1,)}
    overlaps = [
        (a.number, b.number) for a in launched for b in launched
        if a.number < b.number and a.user_attrs["started_at"] < b.user_attrs["ended_at"]
        and b.user_attrs["started_at"] < a.user_attrs["ended_at"]
    ]
    assert overlaps, "no two trials ran at the same time"
    for a, b in overlaps:
        devices = {n: t.user_attrs["devices"] for n, t in ((t.number, t) for t in launched)}
        assert devices[a] != devices[b], "overlapping trials shared a device"


def test_yaml_is_loaded_safely(tmp_path):
    space = tmp_path / "evil.yaml"
    space.write_text("fsdp_version: !!python/object/apply:os.system ['touch pwned']\n")
    done = run_cli("run", "--mem-budget", "20GB", "--space", str(space), cwd=tmp_path)
    assert done.returncode == 2
    assert not (tmp_path / "pwned").exists()


def test_rendezvous_is_local():
    from autotune.launch.launcher import torchrun_command

    assert "--standalone" in torchrun_command(2, Path("c.json"), Path("d"))
