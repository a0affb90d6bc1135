"""Riding out a database server that restarts or drops connections.

A study on a server outlives many connections: the server restarts for an
upgrade, a proxy drops idle ones, the network blinks. The engine pings a
pooled connection before using it (``pool_pre_ping``), which covers a
connection that died while idle. A call that loses its connection midway is
retried with backoff until the server has been away for
:func:`outage_limit_s`; then the tuner stops with :class:`StorageUnavailable`,
one line and exit 1, and the study resumes when the same command is rerun.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, TypeVar

from autotune import interrupts

T = TypeVar("T")

# How long the server may be away before the tuner gives up (seconds).
DEFAULT_OUTAGE_LIMIT_S = 300.0
OUTAGE_LIMIT_ENV = "AUTOTUNE_STORAGE_OUTAGE_S"
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)
BACKOFF_MAX_S = 10.0

# Once one call gave up, every later one fails at once: the clean-up after
# the first failure must not wait out the limit again for each write.
_gave_up: str | None = None


class StorageUnavailable(Exception):
    """The study's database stayed unreachable past the outage limit."""


def given_up() -> str | None:
    """Why the study's database was given up on, once it was: whatever
    exception then surfaced (Optuna's clean-up after a failed write can raise
    one of its own) stems from that."""
    return _gave_up


def seconds_from_env(name: str, default: float) -> float:
    """A period the environment may set (``name``), else ``default``; an
    unreadable value counts as unset."""
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        return default


def outage_limit_s() -> float:
    return seconds_from_env(OUTAGE_LIMIT_ENV, DEFAULT_OUTAGE_LIMIT_S)


def is_connection_loss(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a lost or refused connection to a
    database server: not SQLite, whose OperationalError means a bad file or
    schema and whose lock waits have a timeout of their own."""
    from sqlalchemy import exc as sa

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, sa.DBAPIError):
            if seen.connection_invalidated:
                return True
            module = type(seen.orig).__module__ if seen.orig is not None else ""
            return isinstance(seen, (sa.OperationalError, sa.InterfaceError)) and not module.startswith("sqlite3")
        if isinstance(seen, sa.DisconnectionError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def connection_error(exc: BaseException) -> str:
    """The driver's own first line for a failed connection (it names no password)."""
    from sqlalchemy import exc as sa

    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, sa.DBAPIError):
        seen = seen.__cause__ or seen.__context__
    shown = seen.orig if isinstance(seen, sa.DBAPIError) and seen.orig is not None else exc
    return (str(shown).strip().splitlines() or [type(shown).__name__])[0]


def retry_connection_loss(call: Callable[[], T], quiet: bool = False) -> T:
    """``call()``, again after each lost connection, until the outage limit.

    ``quiet`` calls (the heartbeat thread's) say nothing while they retry.
    """
    global _gave_up
    if _gave_up is not None:
        raise StorageUnavailable(_gave_up)
    started, attempt, told = time.monotonic(), 0, False
    while True:
        try:
            return call()
        except Exception as exc:
            if not is_connection_loss(exc):
                raise
            away = time.monotonic() - started
            limit = outage_limit_s()
            if away >= limit:
                _gave_up = (f"the study's database was unreachable for {away:.0f} s ({connection_error(exc)}); "
                            f"the study is intact: rerun the same command once the server is back "
                            f"(the limit is {limit:g} s, set by {OUTAGE_LIMIT_ENV})")
                raise StorageUnavailable(_gave_up) from None
            if not told and not quiet:
                print(f"autotune: lost the study's database ({connection_error(exc)}); retrying for up to {limit:g} s",
                      file=sys.stderr, flush=True)
                told = True
            delay = BACKOFF_S[attempt] if attempt < len(BACKOFF_S) else BACKOFF_MAX_S
            attempt += 1
            deadline = time.monotonic() + min(delay, max(0.0, limit - away))
            while time.monotonic() < deadline:
                interrupts.check()
                time.sleep(0.1)
