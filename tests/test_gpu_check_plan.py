"""The one-shot GPU check prints its plan on a CPU host (it runs for real only where a GPU is lent)."""

import subprocess
import sys

from tests.conftest import REPO


def test_gpu_check_dry_run_prints_the_plan(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    plan = done.stdout
    assert "budget: 8 min" in plan
    # Every CUDA-only fix of the GPU-path issue has a step that checks it.
    for item in ("GPU path 1", "GPU path 3", "GPU path 4", "GPU path 6", "GPU path 7", "GPU path 8", "GPU path 9",
                 "GPU path 10"):
        assert item in plan, item
    for what in ("outside the allocator", "cuda:nccl,cpu:gloo", "libcuda", "oom", "MFU", "autotune run"):
        assert what in plan, what
    assert not list(tmp_path.iterdir()), "a dry run must not write anything"
