import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``autotune ARGS`` as a user runs it: a new process, from ``cwd``."""
    env = dict(os.environ)
    # Factories like tests.models:oom must import in the driver's probe and in every rank.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "autotune", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def cli(tmp_path):
    def call(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return run_cli(*args, cwd=tmp_path, timeout=timeout)

    return call
