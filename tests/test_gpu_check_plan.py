"""The one-shot GPU check prints its plan on a CPU host (it runs for real only where a GPU is lent), and its
deadline holds: a step past its allotment is stopped with its processes, and one without its minimum left is not
started."""

import re
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))


def test_gpu_check_dry_run_prints_the_plan_its_deadline_enforces(tmp_path):
    import gpu_check

    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    plan = done.stdout
    allotted, deadline = map(int, re.search(r"allotments (\d+) s in all, deadline (\d+) s \(enforced", plan).groups())
    # One call of at most 5 minutes of a GPU, with room for a rerun in a 15-minute loan; the plan printed is the
    # one the run enforces.
    assert deadline == gpu_check.LIMIT_S[False] == 300 and allotted <= deadline
    assert allotted == sum(s.seconds for s in gpu_check.plan(False))
    # Every figure the GPU issue asks the 5-minute call to show has a step that measures it.
    for what in ("allocated + outside", "reserved + outside", "retries > 0", "no outside growth after the second cap",
                 "NVML", "holding all but", "same fit verdict", "oom both", "28-block", "--confirm 2",
                 "extrapolation error", "standard recipe with its interval", "recipe was a finalist",
                 "over the budget (0)", "depth plan auto chose", "allocated peak", "MFU"):
        assert what in plan, what
    assert "fork server" not in plan and "dense bf16 matmul, the MFU" not in plan  # folded into the study and probe
    # The held-out model is deep enough that auto starts shallow.
    from autotune.study.depth_setting import TrialDepth
    from autotune.study.trial_depth import plan_depths

    blocks = gpu_check.MODEL_CONFIG["num_hidden_layers"]
    assert 24 <= blocks <= 32 and plan_depths(TrialDepth.parse("auto"), blocks, 1, True, True).shallow
    assert not list(tmp_path.iterdir()), "a dry run must not write anything"
    full = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--full"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert full.returncode == 0 and "(--full)" in full.stdout and "deadline 600 s" in full.stdout


def test_the_deadline_stops_a_step_with_its_processes_and_skips_what_has_no_time_left(tmp_path):
    import gpu_check

    pid_file = tmp_path / "pid"

    def hangs(ctx):
        ctx.deadline.run(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"])
        return ["never"]

    def fails(ctx):
        raise AssertionError("a check failed")

    def quick(ctx):
        return [f"{ctx.deadline.left():.0f} s left"]

    steps = [gpu_check.Step("hangs", "", hangs, 2, 1), gpu_check.Step("fails", "", fails, 1, 0),
             gpu_check.Step("quick", "", quick, 1, 0), gpu_check.Step("too late", "", quick, 10, 5)]
    ctx = gpu_check.Context(work=tmp_path, deadline=gpu_check.Deadline(4.5))
    start = time.monotonic()
    sections = gpu_check.run_steps(steps, ctx)
    elapsed = time.monotonic() - start
    assert elapsed < 4.5, elapsed
    heads = [line for line in sections if line.startswith("## ")]
    assert heads[0].startswith("## hangs: STOPPED") and heads[1].startswith("## fails: FAILED")
    assert heads[2].startswith("## quick: ok") and heads[3].startswith("## too late: NOT RUN")
    assert [f.split(":")[0] for f in ctx.failed] == ["hangs", "fails", "too late"]
    # The stopped step's whole process group is gone, its grandchild too (a zombie until init reaps it).
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    time.sleep(0.2)
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
