"""Benchmarks are scripts, not timed tests; CI only keeps them working in --quick mode."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torchrun
REPO = Path(__file__).resolve().parent.parent


def test_default_run_benchmark_quick(tmp_path):
    out = tmp_path / "report.md"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "default_run.py"), "--quick", "--repeats", "1", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = out.read_text()
    for phase in ("launch_and_import", "build", "wrap", "warmup", "timed", "memory_step", "other"):
        assert f"| {phase} |" in report
    assert "exit 1; No configuration fits in 1MB" in report
