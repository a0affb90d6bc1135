"""Several hosts, one study, on a real PostgreSQL server: claims that hold across
hosts, a dead tuner found by its heartbeat, and a server that restarts or goes away.

Two "hosts" are two host identities (``AUTOTUNE_HOST_ID``), each with its own
working folder and device locks, as two machines would have.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.conftest import REPO

pytestmark = pytest.mark.torchrun

FAST = ["--mem-budget", "20GB", "--seq-len", "32", "--warmup-steps", "2", "--timed-steps", "2", "--space", "smoke",
        "--no-estimate"]


def _tuner(url: str, study: str, host: str, root: Path, *extra: str, env: dict | None = None, forks=None
           ) -> subprocess.Popen:
    """A tuner on ``host``; with ``forks``, forking from the session's fork server (tests/conftest.py: run_cli)."""
    folder = root / host
    folder.mkdir(exist_ok=True)
    environ = {**os.environ, "PYTHONPATH": str(REPO), "AUTOTUNE_HOST_ID": host,
               "AUTOTUNE_LOCK_DIR": str(folder / "locks"), **(forks.env() if forks else {}), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "autotune", "run", "--storage", url, "--study-name", study,
                             *FAST, *extra], cwd=folder, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _launched(trials: list) -> list[str]:
    """The configuration of every trial that ran a job of its own (not reused, not a confirmation round)."""
    return [str(sorted(t.user_attrs["config"].items())) for t in trials
            if "started_at" in t.user_attrs and "reused_from" not in t.user_attrs
            and "confirmation_round" not in t.user_attrs]


def _wait_for_running(url: str, study: str, timeout: float = 120) -> optuna.trial.FrozenTrial:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            trials = optuna.load_study(study_name=study, storage=url).get_trials(states=(TrialState.RUNNING,))
        except KeyError:  # the study is not created yet
            trials = []
        started = [t for t in trials if "runner" in t.user_attrs]
        if started:
            return started[0]
        time.sleep(0.3)
    raise AssertionError("no trial started running")


def test_three_tuners_on_two_hosts_measure_each_configuration_once(postgres, tmp_path, forks):
    tuners = [_tuner(postgres.url, "two-hosts", host, tmp_path, "--trials", "3", "--confirm", "1", forks=forks)
              for host in ("host-a", "host-a", "host-b")]
    outputs = [t.communicate(timeout=600) for t in tuners]
    for tuner, (_, err) in zip(tuners, outputs):
        assert tuner.returncode == 0, err[-3000:]
        assert "Traceback" not in err
    trials = optuna.load_study(study_name="two-hosts", storage=postgres.url).trials
    assert all(t.state.is_finished() for t in trials), "a trial was left unfinished"
    launched = _launched(trials)
    seen = [(t.number, t.state.name, t.user_attrs.get("status"), t.user_attrs.get("cause"),
             t.user_attrs.get("retry_of"),
             t.user_attrs.get("runner", {}).get("host"), t.user_attrs.get("config", {}).get("sharding_strategy"),
             t.user_attrs.get("config", {}).get("activation_checkpointing"), "confirmation_round" in t.user_attrs)
            for t in trials]
    # The smoke space (4) and the baseline: five configurations, each measured once, by either host.
    assert len(launched) == len(set(launched)) == 5, f"a configuration was measured twice: {seen}"
    hosts = {t.user_attrs["runner"]["host"] for t in trials if "runner" in t.user_attrs}
    assert hosts == {"host-a", "host-b"}
    # Each round of each configuration measured once; a round that failed (a crash, a timeout, a tuner taken for
    # dead under load) is queued again, which is no double measurement.
    confirmations = [t for t in trials if "confirmation_round" in t.user_attrs]
    rounds = [(str(sorted(t.user_attrs["config"].items())), t.user_attrs["confirmation_round"])
              for t in confirmations if t.state == TrialState.COMPLETE and t.user_attrs.get("status") == "ok"]
    seen = [(t.number, t.state.name, t.user_attrs.get("status"), t.user_attrs.get("cause"),
             t.user_attrs["confirmation_round"], t.user_attrs.get("runner", {}).get("host")) for t in confirmations]
    assert rounds and len(rounds) == len(set(rounds)), f"a confirmation round was measured twice: {seen}"


def test_a_tuner_killed_on_one_host_is_recovered_by_another_after_the_heartbeat_grace(postgres, tmp_path):
    grace = {"AUTOTUNE_HEARTBEAT_GRACE_S": "6"}
    victim = _tuner(postgres.url, "kill-9", "host-a", tmp_path, "--trials", "2", "--confirm", "0", env=grace)
    stale = _wait_for_running(postgres.url, "kill-9")
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    killed_at = time.monotonic()
    # host-b cannot see host-a's processes: only the heartbeat tells it host-a's tuner is gone.
    # Its own fork server, as the victim had: one forked from the session's finishes both its trials inside the
    # grace period, before the dead tuner's trial is due to be taken back.
    rescuer = _tuner(postgres.url, "kill-9", "host-b", tmp_path, "--trials", "2", "--confirm", "0", env=grace)
    _, err = rescuer.communicate(timeout=600)
    assert rescuer.returncode == 0, err[-3000:]
    trials = optuna.load_study(study_name="kill-9", storage=postgres.url).trials
    dead = trials[stale.number]
    assert dead.state == TrialState.FAIL and dead.user_attrs["cause"] == "tuner died"
    retry = next(t for t in trials if t.user_attrs.get("retry_of") == stale.number)
    # Measured, or stopped early as hopeless against the other trial (a measurement too: it happened under load).
    assert (retry.state == TrialState.COMPLETE and "tokens_per_s" in retry.user_attrs
            or retry.state == TrialState.PRUNED and "tokens_per_s_partial" in retry.user_attrs), \
        (retry.state, retry.user_attrs.get("status"), retry.user_attrs.get("error"))
    assert retry.user_attrs["runner"]["host"] == "host-b"
    assert retry.user_attrs["config"] == dead.user_attrs["config"]
    assert retry.datetime_start.timestamp() - dead.datetime_start.timestamp() >= 6, "recovered before the grace period"
    assert time.monotonic() - killed_at < 300
    launched = _launched([t for t in trials if t.number != stale.number])
    assert len(launched) == len(set(launched))


def test_a_server_restart_mid_trial_loses_nothing_and_records_nothing_twice(postgres, tmp_path, forks):
    tuner = _tuner(postgres.url, "restart", "host-a", tmp_path, "--trials", "3", "--confirm", "0", forks=forks)
    _wait_for_running(postgres.url, "restart")
    postgres.stop("fast")
    time.sleep(2)
    postgres.start()
    _, err = tuner.communicate(timeout=600)
    assert tuner.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    trials = optuna.load_study(study_name="restart", storage=postgres.url).trials
    # Measured, or stopped early as hopeless (a measurement too): none lost to the restart.
    assert all(t.state == TrialState.COMPLETE and "tokens_per_s" in t.user_attrs
               or t.state == TrialState.PRUNED and "tokens_per_s_partial" in t.user_attrs for t in trials), \
        [(t.number, t.state, t.user_attrs.get("error")) for t in trials]
    launched = _launched(trials)
    # The 3 trials asked for and the standard recipe, a reference outside the smoke space (not one of them).
    assert len(launched) == len(set(launched)) == len(trials) == 4


def test_a_server_gone_past_the_limit_stops_the_run_in_one_line_and_the_rerun_resumes(postgres, tmp_path, forks):
    limit = {"AUTOTUNE_STORAGE_OUTAGE_S": "5"}
    tuner = _tuner(postgres.url, "outage", "host-a", tmp_path, "--trials", "2", "--confirm", "0", env=limit,
                   forks=forks)
    _wait_for_running(postgres.url, "outage")
    postgres.stop("fast")
    try:
        _, err = tuner.communicate(timeout=300)
    finally:
        postgres.start()
    assert tuner.returncode == 1, err[-3000:]
    assert "Traceback" not in err
    (last,) = [line for line in err.splitlines() if "stopped:" in line]
    assert "unreachable" in last and "rerun the same command" in last and postgres.password not in err

    again = _tuner(postgres.url, "outage", "host-a", tmp_path, "--trials", "2", "--confirm", "0", env=limit,
                   forks=forks)
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    trials = optuna.load_study(study_name="outage", storage=postgres.url).trials
    assert all(t.state.is_finished() for t in trials)
    # Two measured (or stopped early as hopeless, a measurement too), none of them twice.
    measured = [t for t in trials if t.state == TrialState.COMPLETE or t.user_attrs.get("aborted")]
    assert len(measured) == 2 and len(_launched(measured)) == len(set(_launched(measured)))
