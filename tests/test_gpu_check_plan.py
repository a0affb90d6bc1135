"""The one-shot GPU check prints its plan on a CPU host (it runs for real only where a GPU is lent)."""

import re
import subprocess
import sys

from tests.conftest import REPO


def test_gpu_check_dry_run_prints_the_plan(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    plan = done.stdout
    # One call of at most 5 minutes of a GPU, with room for a rerun in a 15-minute loan.
    assert "budget: 5 min" in plan
    minutes, seconds = re.search(r"about (\d+) min (\d+) s", plan).groups()
    assert 60 * int(minutes) + int(seconds) <= 300
    # Every figure the GPU issue asks a GPU to show has a step that measures it.
    for what in ("saturation curve", "forked child runs a kernel", "<= 5 s", "until its CI",
                 "set_per_process_memory_fraction",
                 "num_alloc_retries", "oom under the cap", "dense bf16 matmul", "autotune run", "tuner <= 10%",
                 "over the budget (0)", "standard recipe in the same rounds (>= 1.0x)", "MFU", "allocated peak"):
        assert what in plan, what
    assert not list(tmp_path.iterdir()), "a dry run must not write anything"
    full = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--full"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert full.returncode == 0 and "(--full)" in full.stdout and "8 launches and 2 confirmation rounds" in full.stdout
