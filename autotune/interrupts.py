"""Ctrl-C and SIGTERM: stop the tuner cleanly, whatever it is doing.

The first SIGINT or SIGTERM raises :class:`Interrupted` in the main thread
(a ``KeyboardInterrupt``, so Optuna records the running trial as FAIL and
re-raises it) and sets a flag that waiting loops in other threads poll with
:func:`check`. Later signals are only noted: the clean-up the first one
started (stopping a trial's torchrun job, recording the trial, printing the
summary) must not itself be cut short.

Inside :func:`critical` (every call into the study's database) the exception
waits until the section ends: raised inside SQLAlchemy, it could leave a
connection holding the database's write lock, and the clean-up that records
the interrupted trial would then wait on it forever.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_requested = threading.Event()
_signum: int | None = None
# A signal that arrived inside a critical section of the main thread, to raise at its end.
_pending = False
_local = threading.local()


class Interrupted(KeyboardInterrupt):
    """The tuner was asked to stop by ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        # What a shell reports for a process that a signal ended: 130, 143.
        return 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def _handle(signum: int, frame: Any) -> None:
    global _signum, _pending
    if _requested.is_set():
        return
    _signum = signum
    _requested.set()
    # Handlers run in the main thread, so this is the main thread's depth.
    if getattr(_local, "depth", 0) > 0:
        _pending = True
        return
    raise Interrupted(signum)


@contextmanager
def critical() -> Iterator[None]:
    """A section a signal must not cut in two; its :class:`Interrupted` comes at the end."""
    global _pending
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth
    if depth == 0 and _pending and threading.current_thread() is threading.main_thread():
        _pending = False
        raise Interrupted(_signum or signal.SIGINT)


def install() -> None:
    """Route SIGINT and SIGTERM through :class:`Interrupted` (main thread only)."""
    for sig in SIGNALS:
        signal.signal(sig, _handle)


def requested() -> int | None:
    """The signal that asked the tuner to stop, or None."""
    return _signum if _requested.is_set() else None


def check() -> None:
    """Raise :class:`Interrupted` in this thread if a stop was requested: the
    signal itself only reaches the main thread."""
    if _requested.is_set():
        raise Interrupted(_signum or signal.SIGINT)


def reset() -> None:
    """Forget a request (tests run several tuners in one process)."""
    global _signum, _pending
    _signum = None
    _pending = False
    _requested.clear()
