"""Host-wide locks: one trial per device at a time, and one claim per configuration.

Timings are only honest when no other trial shares the devices, including
trials of other ``autotune run`` processes on the same host. Each physical
device (a GPU by its UUID, whatever mask each tuner runs under and however
it spells the GPU, or a CPU core) has a lock file; a trial takes every device of its slot,
all or none, so slots that overlap can never run together. The locks are
``flock`` locks: the kernel drops them when the holder dies, even by SIGKILL,
so a killed tuner never leaves a device locked.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from autotune import interrupts
from autotune.launch.devices import physical_ids

POLL_S = 0.5


def lock_dir() -> Path:
    path = Path(os.environ.get("AUTOTUNE_LOCK_DIR") or Path(tempfile.gettempdir()) / "autotune-locks")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _try_lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _release(fds: list[int]) -> None:
    for fd in fds:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def device_lock_name(device_type: str, physical_id: str) -> str:
    """One lock file per physical device (a GPU UUID is a name in its own right)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in physical_id)
    return f"{socket.gethostname()}-{device_type}-{safe}.lock"


def lock_ids(device_type: str, devices: tuple[int, ...], names: Sequence[str] | None = None) -> tuple[str, ...]:
    """What the locks of a slot's devices are named after: each GPU's UUID where
    the probe reported them (``names``, by index), so that an index, a UUID and
    a MIG name in two tuners' masks lock one device alike; else the physical
    ids the mask gives (cores on a CPU host)."""
    if names:
        return tuple(names[index] for index in devices)
    return physical_ids(device_type, devices)


def _try_slot(device_type: str, devices: tuple[int, ...], names: Sequence[str] | None) -> list[int] | None:
    held: list[int] = []
    # A fixed order keeps two holders of overlapping slots from deadlocking.
    for physical_id in sorted(lock_ids(device_type, devices, names)):
        fd = _try_lock(lock_dir() / device_lock_name(device_type, physical_id))
        if fd is None:
            _release(held)
            return None
        held.append(fd)
    return held


@contextmanager
def device_slot(
    device_type: str, slots: list[tuple[int, ...]], on_wait: Callable[[], None] | None = None,
    names: Sequence[str] | None = None,
) -> Iterator[tuple[int, ...]]:
    """Hold the first free slot of ``slots`` while the block runs; wait for one if
    none is free. ``names``: the UUID of each GPU index (see :func:`lock_ids`)."""
    waited = False
    while True:
        for slot in slots:
            held = _try_slot(device_type, slot, names)
            if held is not None:
                try:
                    yield slot
                finally:
                    _release(held)
                return
        if not waited and on_wait is not None:
            on_wait()
            waited = True
        interrupts.check()
        time.sleep(POLL_S)


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """A blocking lock on ``path``: a critical section across processes of this host."""
    with _flock(path, fcntl.LOCK_EX):
        yield


@contextmanager
def shared(path: Path) -> Iterator[None]:
    """A blocking shared lock on ``path``: many holders at once, none while anyone holds it exclusively."""
    with _flock(path, fcntl.LOCK_SH):
        yield


@contextmanager
def _flock(path: Path, how: int) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def timing_lock_path() -> Path:
    """This tuner's timing lock. Trials time their steps holding it shared (trials
    of several device slots time at once); the tuner runs a background memory
    estimate on cores its trials use only holding it exclusively, so no step is
    ever timed while an estimate competes for its cores."""
    return lock_dir() / f"{socket.gethostname()}-timing-{os.getpid()}.lock"
