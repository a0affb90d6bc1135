"""The torch this tuner runs on: the range it is tested on, checked at start without importing torch.

Tested on CPU with gloo (the fast tests and the family matrix in CI): 2.9.1,
2.11.0, 2.13.0 and 2.14.1; on CUDA, 2.11.0 (one H200, 2026-12-04). Below
2.9, FSDP2 fails inside torch on a CPU, in trials and in the memory
estimate's fake step alike (torch 2.6: "'Stream' object has no attribute
'record_event'"), so the tuner refuses to start. A torch newer than the
newest tested gets a warning and runs.
"""

from __future__ import annotations

import re
from importlib import metadata

from autotune.errors import UsageError

OLDEST = (2, 9)
NEWEST_TESTED = (2, 14)
TESTED = "2.9.1, 2.11.0, 2.13.0 and 2.14.1"


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``2.11.0+cu130``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def installed_torch() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def check_torch(version: str | None = None) -> str | None:
    """Refuse a torch the tuner cannot run on (UsageError); a warning line for one
    newer than the newest tested, else None. ``version``: the installed one by default."""
    version = version if version is not None else installed_torch()
    if version is None:
        raise UsageError("torch is not installed; pip install torch==2.13.0 (CPU) or a CUDA build of torch>=2.9")
    if release(version) < OLDEST:
        raise UsageError(f"torch {version} is older than {OLDEST[0]}.{OLDEST[1]}, the oldest autotune is tested on "
                         f"(FSDP2 fails inside torch {release(version)[0]}.{release(version)[1]} on a CPU); "
                         f"pip install 'torch>={OLDEST[0]}.{OLDEST[1]}'")
    if release(version) > NEWEST_TESTED:
        return (f"autotune: warning: torch {version} is newer than the versions autotune is tested on ({TESTED}); "
                "it runs, but report what breaks")
    return None
