"""The fork server: forked processes see the client's argv, environment, cwd,
cores and session, report their exit like Popen, and die with their client."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from autotune.launch.forkserver import DISABLE_VAR, ForkServer, spawn
from autotune.launch.process_life import process_alive

pytestmark = pytest.mark.torchrun


def _read_all(fd: int) -> str:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode()


def _spawn(forks, target, argv, **kw):
    read, write = os.pipe()
    try:
        proc = spawn(forks.socket_path, f"tests.forkserver_targets:{target}", argv, stdout_fd=write, **kw)
    finally:
        os.close(write)
    return proc, read


def test_a_forked_process_runs_in_the_clients_context(forks, tmp_path):
    proc, out = _spawn(forks, "report", ["3", "x"], env={**os.environ, "AUTOTUNE_TEST_MARKER": "m1"},
                       cwd=str(tmp_path), affinity=[0], new_session=True)
    seen = json.loads(_read_all(out).strip().splitlines()[-1])
    assert proc.wait(timeout=30) == 3 and proc.returncode == 3
    assert seen["argv"] == ["3", "x"] and seen["cwd"] == str(tmp_path) and seen["marker"] == "m1"
    assert seen["pid"] == proc.pid and seen["sid"] == proc.pid  # its own session, as torchrun gives a rank
    assert seen["affinity"] == [0]
    assert seen["torch_loaded"]  # the point: imports were paid once, in the server


def test_a_crash_is_exit_1_with_the_traceback_in_the_output(forks):
    proc, out = _spawn(forks, "crash", [])
    text = _read_all(out)
    assert proc.wait(timeout=30) == 1
    assert "RuntimeError: boom from a forked target" in text


def test_wait_times_out_and_kill_reports_the_signal(forks):
    proc, out = _spawn(forks, "sleep", ["60"])
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.3)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    _read_all(out)


def test_a_forked_process_dies_with_its_client(forks):
    client = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from autotune.launch.forkserver import spawn\n"
         f"p = spawn({forks.socket_path!r}, 'tests.forkserver_targets:sleep', ['120'], stdout_fd=1)\n"
         "time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )
    pid = int(client.stdout.readline())
    assert process_alive(pid)
    client.send_signal(signal.SIGKILL)  # no chance to clean up
    client.wait()
    deadline = time.monotonic() + 10
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_alive(pid)


def test_the_switch_turns_the_fork_server_off(monkeypatch):
    monkeypatch.setenv(DISABLE_VAR, "1")
    forks = ForkServer()
    assert not forks.ready() and DISABLE_VAR in forks.error
    assert forks.env() == {}
    forks.close()


def test_a_tuner_started_beside_a_running_server_forks_from_it_and_leaves_it_running(forks, tmp_path, monkeypatch):
    from autotune.launch.forkserver import ENV_VAR

    monkeypatch.setenv(ENV_VAR, forks.socket_path)
    shared = ForkServer()
    assert shared.ready() and shared.socket_path == forks.socket_path and shared._proc is None
    shared.close()  # not its server to stop
    proc, out = _spawn(forks, "report", ["0"], env=dict(os.environ), cwd=str(tmp_path))
    assert proc.wait(timeout=30) == 0 and json.loads(_read_all(out).strip().splitlines()[-1])
    # A path whose server has ended is not used: the tuner starts a server of its own.
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "gone.sock"))
    own = ForkServer()
    try:
        assert own.socket_path != str(tmp_path / "gone.sock") and own.ready(), own.error
    finally:
        own.close()
