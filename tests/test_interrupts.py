"""Ctrl-C (SIGINT) and SIGTERM at every stage of a run: start-up, the memory
estimate, mid-trial and while a result is being recorded.

One handler serves both signals (``autotune.interrupts.SIGNALS``): start-up
gets each, and every later stage one of them, in turn, so that each signal
still meets a running job and a blocked write.

Each time: exit 130 or 143, no traceback, no process of the run left, the
summary so far printed, and a trial that was under way recorded as FAIL with
cause ``interrupted`` and queued to run again.
"""

import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.conftest import REPO, process_running, run_cli

pytestmark = pytest.mark.torchrun

FAST = ["--mem-budget", "20GB", "--space", "smoke", "--seq-len", "32", "--timed-steps", "2", "--trial-timeout", "120",
        "--confirm", "0"]
SIGNALS = [signal.SIGINT, signal.SIGTERM]


def _tagged_processes(tag: str) -> list[int]:
    """Every live process started by the run: they all inherit its environment."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if tag.encode() in environ and process_running(int(entry)):
            found.append(int(entry))
    return found


def _start(tmp_path: Path, *args: str, command: str = "run") -> tuple[subprocess.Popen, str]:
    tag = f"AUTOTUNE_TEST_TAG={uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "AUTOTUNE_TEST_TAG": tag.split("=", 1)[1]}
    tuner = subprocess.Popen([sys.executable, "-m", "autotune", command, *args], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return tuner, tag


def _wait_for(path: Path, tuner: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert tuner.poll() is None, tuner.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _finish(tuner: subprocess.Popen, tag: str, sig: int) -> tuple[str, str]:
    out, err = tuner.communicate(timeout=60)
    assert tuner.returncode == 128 + sig, (tuner.returncode, out, err)
    assert "Traceback" not in err and "Traceback" not in out, err
    deadline = time.monotonic() + 15
    while _tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _tagged_processes(tag) == [], "a process of the interrupted run is still alive"
    return out, err


def _study(root: Path) -> optuna.Study:
    storage = f"sqlite:///{root / 'studies' / 'autotune.db'}"
    (name,) = optuna.get_all_study_names(storage)
    return optuna.load_study(study_name=name, storage=storage)


def _assert_interrupted_and_queued(study: optuna.Study, number: int, sig: int) -> None:
    trial = next(t for t in study.trials if t.number == number)
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs["cause"] == "interrupted"
    assert signal.Signals(sig).name in trial.user_attrs["error"]
    retry = [t for t in study.trials if t.user_attrs.get("retry_of") == number]
    assert len(retry) == 1 and retry[0].state == TrialState.WAITING


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_during_start_up(tmp_path, sig):
    tuner, tag = _start(tmp_path, *FAST)
    time.sleep(1.5)  # the host probe is still building the model
    tuner.send_signal(sig)
    out, err = _finish(tuner, tag, sig)
    assert f"interrupted by {signal.Signals(sig).name}" in err
    assert not (tmp_path / "studies" / "autotune.db").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
def test_during_the_memory_estimate(tmp_path, sig):
    tuner, tag = _start(tmp_path, *FAST, "--model", "tests.models:slow_to_estimate")
    _wait_for(tmp_path / "estimating.marker", tuner)
    tuner.send_signal(sig)
    out, err = _finish(tuner, tag, sig)
    assert f"Interrupted by {signal.Signals(sig).name}" in out
    assert "Study slow_to_estimate-w2-s32-20GB: 0 trials launched" in out


@pytest.mark.parametrize("sig", [signal.SIGINT], ids=lambda s: signal.Signals(s).name)
def test_mid_trial(tmp_path, sig):
    tuner, tag = _start(tmp_path, *FAST, "--model", "tests.models:hang_marked", "--no-estimate")
    _wait_for(tmp_path / "trial.marker", tuner)
    tuner.send_signal(sig)
    out, err = _finish(tuner, tag, sig)
    # The interrupted trial is the standard recipe, a reference outside the smoke space, not one of --trials.
    assert f"Interrupted by {signal.Signals(sig).name}" in out and "1 reference outside the space" in out
    _assert_interrupted_and_queued(_study(tmp_path), 0, sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
def test_while_recording_a_result(tmp_path, sig):
    tuner, tag = _start(tmp_path, *FAST, "--no-estimate", "--trials", "1")
    _wait_for(tmp_path / "studies" / "llama-tiny-w2-s32-20GB" / "trials" / "0" / "result.json", tuner)
    # Hold the database's write lock: the tuner, done with the job, blocks in
    # its first write of the result, and the signal lands there.
    db = sqlite3.connect(tmp_path / "studies" / "autotune.db", isolation_level=None, timeout=60)
    db.execute("BEGIN EXCLUSIVE")
    try:
        time.sleep(1.5)
        assert tuner.poll() is None
        tuner.send_signal(sig)
        time.sleep(0.5)
    finally:
        db.execute("COMMIT")
        db.close()
    out, err = _finish(tuner, tag, sig)
    assert f"Interrupted by {signal.Signals(sig).name}" in out
    _assert_interrupted_and_queued(_study(tmp_path), 0, sig)


def test_estimate_stops_every_fake_step_it_runs_side_by_side(tmp_path):
    """`autotune estimate` runs its fake steps in threads, one to a core: the signal reaches the main thread
    only, and before the handler was installed for it the interrupted command waited on steps that sleep an hour."""
    space = tmp_path / "space.yaml"
    space.write_text("fsdp_version: [1, 2]\nsharding_strategy: [FULL_SHARD, SHARD_GRAD_OP]\nmicro_batch_size: 1\n")
    tuner, tag = _start(tmp_path, "--mem-budget", "1GB", "--model", "tests.models:slow_to_estimate", "--space",
                        str(space), "--seq-len", "32", command="estimate")
    _wait_for(tmp_path / "estimating.marker", tuner)
    tuner.send_signal(signal.SIGINT)
    _, err = _finish(tuner, tag, signal.SIGINT)
    assert err.strip().splitlines()[-1] == "autotune estimate: interrupted by SIGINT"


def test_the_rerun_measures_the_interrupted_configuration(tmp_path, forks):
    tuner, tag = _start(tmp_path, *FAST, "--model", "tests.models:hang_once", "--no-estimate", "--trials", "1")
    _wait_for(tmp_path / "hang-once.marker", tuner)
    time.sleep(0.5)
    tuner.send_signal(signal.SIGTERM)
    _finish(tuner, tag, signal.SIGTERM)
    again = run_cli("run", *FAST, "--model", "tests.models:hang_once", "--no-estimate", "--trials", "1", cwd=tmp_path,
                    forks=forks)
    assert again.returncode == 0, again.stderr
    study = _study(tmp_path)
    retry = next(t for t in study.trials if t.user_attrs.get("retry_of") == 0)
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["config"] == study.trials[0].user_attrs["config"]
