"""The study's database as a server: its lock, lost connections, and giving up cleanly."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import sqlalchemy

from autotune.study.mutex import database_lock
from autotune.study.outages import is_connection_loss
from tests.conftest import REPO, run_cli


def _holder(url: str) -> subprocess.Popen:
    """Another process, as a tuner on another host would be, holding the study's lock."""
    code = textwrap.dedent(f"""
        import sqlalchemy, sys, time
        from pathlib import Path
        from autotune.study.mutex import database_lock
        with database_lock(sqlalchemy.create_engine({url!r}), "study:x", Path("/nonexistent")):
            print("held", flush=True)
            time.sleep(600)
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def test_the_study_lock_holds_across_processes_and_dies_with_its_holder(postgres, tmp_path):
    holder = _holder(postgres.url)
    assert holder.stdout.readline().strip() == "held"
    engine = sqlalchemy.create_engine(postgres.url)
    got = threading.Event()

    def take() -> None:
        # The file fallback is never used on PostgreSQL: a path that cannot exist proves it.
        with database_lock(engine, "study:x", tmp_path / "no" / "such" / "folder" / "lock"):
            got.set()

    waiter = threading.Thread(target=take, daemon=True)
    waiter.start()
    assert not got.wait(2), "two processes held the study's lock at once"
    # SIGKILL: no clean-up runs; the server drops the lock with the connection.
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert got.wait(10), "the lock outlived its killed holder"
    waiter.join(5)
    with database_lock(engine, "study:other", tmp_path / "unused"):
        pass  # another study's lock is independent
    engine.dispose()


def test_a_studys_own_mutex_is_the_database_lock_another_host_holds(postgres, tmp_path):
    # The runner builds the mutex from the study that optuna.load_study returns: its storage wraps the
    # database's in a cache with no engine of its own. Read naively, each host fell back to a lock file of
    # its own, and two hosts queued the same confirmation rounds (tests/test_many_hosts.py).
    import optuna

    from autotune.study.mutex import study_mutex
    from autotune.study.storage import open_storage

    optuna.create_study(study_name="x", storage=postgres.url)
    study = optuna.load_study(study_name="x", storage=open_storage(postgres.url, heartbeat=True))
    holder = _holder(postgres.url)
    assert holder.stdout.readline().strip() == "held"
    got = threading.Event()

    def take() -> None:
        with study_mutex(study, tmp_path / "claims.lock")():
            got.set()

    waiter = threading.Thread(target=take, daemon=True)
    waiter.start()
    assert not got.wait(2), "a tuner entered the study's critical section while another host held it"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert got.wait(10), "the study's mutex never came free"
    waiter.join(5)


def test_a_server_unreachable_at_the_start_is_one_line_and_exit_2(tmp_path, forks):
    # A wrong host, port or password is a URL to fix, not an outage to wait out
    # (a server lost mid-run is retried: tests/test_many_hosts.py).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql+psycopg://tuner:hunter2-secret@127.0.0.1:{port}/autotune"
    started = time.monotonic()
    for args in (["trials"], ["run", "--mem-budget", "20GB", "--space", "smoke"]):
        done = run_cli(*args, "--storage", url, cwd=tmp_path, forks=forks)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
        assert "hunter2-secret" not in done.stderr + done.stdout and "tuner:***@127.0.0.1" in lines[0]
        assert "cannot connect" in lines[0] and "Connection refused" in lines[0]
    assert time.monotonic() - started < 60, "it waited instead of saying so"
    assert not (tmp_path / "studies").exists()


def test_only_lost_connections_count_as_outages(tmp_path):
    from optuna.exceptions import StorageInternalError

    sqlite = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    with pytest.raises(sqlalchemy.exc.OperationalError) as missing_table:
        with sqlite.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT * FROM nowhere"))
    assert not is_connection_loss(missing_table.value)  # SQLite's OperationalError is a bad file or schema
    refused = sqlalchemy.create_engine("postgresql+psycopg://u:p@127.0.0.1:1/db")
    with pytest.raises(sqlalchemy.exc.OperationalError) as lost:
        refused.connect()
    assert is_connection_loss(lost.value)
    try:
        raise StorageInternalError("An exception is raised during the commit.") from lost.value
    except StorageInternalError as wrapped:  # how Optuna's RDBStorage passes it on
        assert is_connection_loss(wrapped)
    assert not is_connection_loss(ValueError("no"))
