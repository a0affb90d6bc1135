"""Trials as Slurm job steps, on a real Slurm (slurmctld and one slurmd on this host, started by the fixture)."""

import json
import os
import sys
import time

import optuna
import pytest

from tests.conftest import REPO, processes_mentioning
from tests.models import PID_DIR_VAR, wait_for_ranks_in_forward

pytestmark = pytest.mark.torchrun

# Inside the allocation: one trial through the Slurm launcher, its result on stdout.
TRIAL = """
import json, sys
from pathlib import Path
from autotune.config import FsdpConfig, TrialRequest
from autotune.launch.multinode import launch_slurm
model, timeout, folder = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
layer = ("LlamaDecoderLayer",) if model == "llama-tiny" else ("Linear",)
cfg = FsdpConfig(fsdp_version=2, sharding_strategy="HYBRID_SHARD", transformer_layer_cls=layer, micro_batch_size=2)
out = launch_slurm(TrialRequest(fsdp=cfg, model=model, seq_len=64, timed_steps=3, nnodes=2), folder, 1, timeout, "cpu")
print("RESULT " + json.dumps({**out.result.to_dict(), "wall_s": out.wall_s}))
"""


def _in_allocation(slurm, tmp_path, *command: str, timeout: float = 300):
    env = {**slurm.env, "PYTHONPATH": str(REPO), PID_DIR_VAR: str(_pid_dir(tmp_path))}
    done = __import__("subprocess").run(["salloc", "--nodes", "1", "--ntasks", "2", "--overcommit", "--job-name",
                                         "autotune-test", *command], capture_output=True, text=True, env=env,
                                        cwd=tmp_path, timeout=timeout)
    return done


def _pid_dir(tmp_path):
    """Where tests.models:hang's ranks say they reached their forward."""
    (tmp_path / "pids").mkdir(exist_ok=True)
    return tmp_path / "pids"


def _argv(pid: int) -> list[str]:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _result(done) -> dict:
    line = next((text for text in done.stdout.splitlines() if text.startswith("RESULT ")), None)
    assert line, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


def test_a_two_node_trial_runs_as_one_job_step_of_two_agents(slurm, tmp_path):
    done = _in_allocation(slurm, tmp_path, sys.executable, "-c", TRIAL, "llama-tiny", "240", str(tmp_path / "trial"))
    result = _result(done)
    assert result["status"] == "ok", result["error"]
    assert (result["world_size"], result["nnodes"], result["nproc_per_node"], result["mesh_shape"]) == (2, 2, 1, [2, 1])
    # Both agents were the tasks of one job step.
    first = (tmp_path / "trial" / "log.txt").read_text().splitlines()[0]
    assert first.startswith("autotune: job ") and "srun --ntasks 2 --nodes 1 --overcommit --kill-on-bad-exit=1" in first
    assert result["tokens_per_s"] > 0


def test_a_timed_out_step_leaves_no_step_and_no_process(slurm, tmp_path):
    start = time.monotonic()
    done = _in_allocation(slurm, tmp_path, sys.executable, "-c", TRIAL, "tests.models:hang", "12",
                          str(tmp_path / "trial"))
    result = _result(done)
    assert result["status"] == "timeout" and result["wall_s"] < 60
    assert time.monotonic() - start < 120
    deadline = time.monotonic() + 30
    while processes_mentioning(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(tmp_path)) == [], "a rank or agent outlived the cancelled step"
    steps = slurm.run("squeue", "--steps", "--noheader", "--name", "autotune-test").stdout.strip()
    assert steps == "", f"steps left behind: {steps}"


def test_autotune_run_inside_an_allocation_uses_slurm_for_two_nodes(slurm, tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("fsdp_version: 2\nsharding_strategy: [FULL_SHARD, HYBRID_SHARD]\nmixed_precision: fp32\n"
                     "micro_batch_size: 2\n")
    # A shallow study: each trial times copies of 1 and 2 of llama-tiny's 4 blocks in one job step.
    done = _in_allocation(slurm, tmp_path, sys.executable, "-m", "autotune", "run", "--mem-budget", "20GB", "--nnodes",
                          "2",
                          "--nproc", "1", "--space", str(space), "--seq-len", "64", "--timed-steps", "3", "--trials",
                          "1",
                          "--confirm", "0", "--trial-depth", "1,2", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    storage = f"sqlite:///{tmp_path / 'studies' / 'autotune.db'}"
    (name,) = optuna.get_all_study_names(storage)
    trials = optuna.load_study(study_name=name, storage=storage).trials
    measured = [t for t in trials if t.user_attrs.get("status") == "ok"]
    assert measured and all(t.user_attrs["nnodes"] == 2 for t in measured)
    assert all([p["depth"] for p in t.user_attrs["depth_points"]] == [1, 2] for t in measured)
    # auto chose Slurm: every trial was a job step of the allocation.
    logs = [(tmp_path / t.user_attrs["log_path"]).read_text() for t in measured]
    assert all(log.startswith("autotune: job ") and " srun --ntasks 2 " in log.splitlines()[0] for log in logs)


def test_a_killed_tuner_takes_its_job_step_with_it(slurm, tmp_path):
    import signal
    import subprocess

    env = {**slurm.env, "PYTHONPATH": str(REPO), PID_DIR_VAR: str(_pid_dir(tmp_path))}
    tuner = subprocess.Popen(["salloc", "--nodes", "1", "--ntasks", "2", "--overcommit", "--job-name", "autotune-kill",
                              sys.executable, "-c", TRIAL, "tests.models:hang", "300", str(tmp_path / "trial")],
                             env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # The step runs: both ranks are in their forward.
    assert wait_for_ranks_in_forward(_pid_dir(tmp_path), 2), "the ranks never reached their forward"
    driver = next(pid for pid in processes_mentioning("launch_slurm") if pid != tuner.pid)
    os.kill(driver, signal.SIGKILL)  # the tuner dies without any clean-up of its own
    deadline = time.monotonic() + 45
    while processes_mentioning(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(tmp_path)) == [], "the job step outlived the killed tuner"
    tuner.wait(60)


def test_a_node_whose_task_goes_away_ends_the_step_as_node_lost(slurm, tmp_path):
    """The node agent and everything under it killed: no record of how it ended, and srun's exit code (143) is
    the same as for a failed rank; the missing record is how the driver knows the node was lost."""
    import threading

    from autotune.launch.launcher import process_tree

    box = {}
    thread = threading.Thread(target=lambda: box.update(done=_in_allocation(
        slurm, tmp_path, sys.executable, "-c", TRIAL, "tests.models:hang", "240", str(tmp_path / "trial"))))
    start = time.monotonic()
    thread.start()
    agents = []
    while len(agents) < 2 and time.monotonic() - start < 60:
        agents = [pid for pid in processes_mentioning("autotune.worker.node_agent " + str(tmp_path))
                  if _argv(pid)[1:3] == ["-m", "autotune.worker.node_agent"]]  # not srun, whose arguments name it
        time.sleep(0.2)
    assert len(agents) == 2, "the step's two node agents never started"
    # The ranks are training (hung in the test model's forward).
    assert wait_for_ranks_in_forward(_pid_dir(tmp_path), 2), "the ranks never reached their forward"
    for pid in process_tree(max(agents)):
        os.kill(pid, __import__("signal").SIGKILL)
    thread.join(120)
    result = _result(box["done"])
    assert result["status"] == "node_lost" and "without a record" in result["error"], result
    assert time.monotonic() - start < 90, "the trial waited for its timeout"
    deadline = time.monotonic() + 30
    while processes_mentioning(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(tmp_path)) == [], "a rank or agent outlived the lost node"
