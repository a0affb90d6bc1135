"""One critical section per study, for every tuner on every host that shares it.

Claiming a configuration, queueing the first trials and queueing a
confirmation round each read the study and then write to it; two tuners must
not interleave there. A database server is the one thing tuners on several
hosts share, so the lock lives in it: a PostgreSQL advisory lock (MySQL's
``GET_LOCK``), held on a connection of its own. The server drops it when that
connection dies, so a tuner killed by SIGKILL on another host never leaves the
study locked. SQLite is a file of one host: there a host-wide ``flock`` does.
"""

from __future__ import annotations

import hashlib
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import optuna

from autotune import interrupts
from autotune.launch.locks import exclusive
from autotune.study.optuna_internals import storage_engine
from autotune.study.outages import retry_connection_loss

# Seconds between tries of a lock another tuner holds: polling, not a blocking
# call, so Ctrl-C and SIGTERM still land while a tuner waits.
POLL_S = 0.1


def lock_key(name: str) -> int:
    """A signed 64-bit key for ``name``: what pg_advisory_lock takes."""
    return int.from_bytes(hashlib.sha256(f"autotune:{name}".encode()).digest()[:8], "big", signed=True)


def _statements(dialect: str, name: str) -> tuple[str, str, dict[str, Any]] | None:
    if dialect == "postgresql":
        return "SELECT pg_try_advisory_lock(:key)", "SELECT pg_advisory_unlock(:key)", {"key": lock_key(name)}
    if dialect in ("mysql", "mariadb"):
        # MySQL lock names are at most 64 characters.
        return "SELECT GET_LOCK(:key, 0)", "SELECT RELEASE_LOCK(:key)", {"key": f"autotune-{lock_key(name):x}"[:64]}
    return None


@contextmanager
def database_lock(engine: Any, name: str, fallback: Path, patient: bool = True) -> Iterator[None]:
    """Hold the lock ``name`` in the database behind ``engine`` (``fallback``, a
    host-wide file lock, for SQLite and any engine without named locks).
    ``patient`` rides out a lost connection (:mod:`autotune.study.outages`);
    otherwise the first failure to connect is raised."""
    statements = None if engine is None else _statements(engine.dialect.name, name)
    if statements is None:
        with exclusive(fallback):
            yield
        return
    from sqlalchemy import text

    take, release, params = statements

    def acquire() -> Any:
        # Autocommit: a session lock needs no transaction, and an open one
        # would sit "idle in transaction" on the server while the section runs.
        conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            while not conn.execute(text(take), params).scalar():
                interrupts.check()
                time.sleep(POLL_S)
        except BaseException:
            conn.close()
            raise
        return conn

    conn = retry_connection_loss(acquire) if patient else acquire()
    try:
        yield
    finally:
        try:
            conn.execute(text(release), params)
        except Exception:  # noqa: BLE001 - a lost connection released the lock already
            conn.invalidate()
        conn.close()


def study_mutex(study: optuna.Study, fallback: Path) -> Callable[[], ContextManager[None]]:
    """The critical section of ``study``: call it to get a ``with`` block."""
    engine = storage_engine(study)
    return lambda: database_lock(engine, f"study:{study.study_name}", fallback)
