"""The one-shot GPU check prints its plan on a CPU host (it runs for real only where a GPU is lent)."""

import subprocess
import sys

from tests.conftest import REPO


def test_gpu_check_dry_run_prints_the_plan(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    plan = done.stdout
    assert "budget: 10 min" in plan
    # Every figure the GPU issue asks a GPU to show has a step that measures it.
    for what in ("saturation curve", "forked child runs a kernel", "<= 5 s", "until its CI", "set_per_process_memory_fraction",
                 "num_alloc_retries", "oom under the cap", "dense bf16 matmul", "autotune run", "tuner <= 10%",
                 "over the budget (0)", "standard recipe in the same rounds (>= 1.0x)", "MFU", "allocated peak"):
        assert what in plan, what
    assert not list(tmp_path.iterdir()), "a dry run must not write anything"
