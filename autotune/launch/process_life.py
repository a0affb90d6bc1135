"""Tie a process's life to its parent's (Linux), with the standard library only.

Every level of a trial uses it: torchrun dies with the tuner, each rank's
supervisor with torchrun, and each rank with its supervisor. A tuner killed
with SIGKILL therefore leaves no trial processes behind, although it could not
run any clean-up of its own.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` (SIGKILL) to this process when its parent thread exits.

    Safe between fork and exec (``preexec_fn``). A no-op where prctl is missing.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(_PR_SET_PDEATHSIG, sig)
    # The parent may have died before prctl ran; then we were re-parented to init.
    if os.getppid() == 1:
        os._exit(1)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot: with the pid, it names
    one process even after the pid number is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
