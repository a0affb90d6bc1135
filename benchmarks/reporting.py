"""What every benchmark result carries (the machine it ran on) and where it goes."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def publish(report: str, out: str | None) -> None:
    """Print the Markdown report; with ``out``, also write it there."""
    print(report)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(report + "\n")


def run_tuner(folder: Path, *args: str, timeout: float = 7200) -> tuple[Any, float, str]:
    """``autotune run ARGS`` in ``folder`` (the default storage there): the study it made, the wall seconds, and
    its summary. A failed run ends the benchmark with its error."""
    import optuna

    start = time.time()
    done = subprocess.run([sys.executable, "-m", "autotune", "run", *args, "--quiet"], cwd=folder, capture_output=True,
                          text=True, timeout=timeout)
    wall = time.time() - start
    if done.returncode != 0:
        raise SystemExit(f"autotune run {' '.join(args)} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    storage = f"sqlite:///{folder / 'studies' / 'autotune.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage), wall, done.stdout
