"""Trials over several nodes: simulated nodes on this host (torchrun agents joined by a c10d rendezvous), hybrid
sharding on one node and across two, a node lost mid-trial, and `autotune run --nnodes 2` end to end."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import optuna
import pytest

from autotune.config import FsdpConfig, TrialRequest
from autotune.launch.launcher import launch_trial, process_tree
from autotune.launch.multinode import launch_local, node_devices, srun_command
from tests.conftest import REPO, processes_mentioning, run_cli
from tests.models import PID_DIR_VAR, wait_for_ranks_in_forward

LAYER = ("LlamaDecoderLayer",)


def test_simulated_nodes_split_the_slot_and_srun_places_one_agent_per_node():
    assert [node_devices((0, 1, 2, 3), 2, n) for n in (0, 1)] == [(0, 1), (2, 3)]
    assert [node_devices((0,), 2, n) for n in (0, 1)] == [(0,), (0,)]
    on_nodes = srun_command(2, 8, 2, "node1:29500", "autotune-x", Path("c.json"), Path("t"))
    assert on_nodes[:8] == ["srun", "--ntasks", "2", "--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    assert "--rdzv-endpoint=node1:29500" in on_nodes and "--nproc-per-node=8" in on_nodes and "--nnodes=2" in on_nodes
    # An allocation with fewer nodes than the trial spans: the agents share them.
    assert "--overcommit" in srun_command(2, 1, 1, "n:1", "x", Path("c.json"), Path("t"))


@pytest.mark.torchrun
def test_hybrid_sharding_on_one_node_with_shard_groups_of_two(tmp_path, forks):
    # 4 ranks on one node, sharded within pairs and replicated across the two pairs.
    cfg = FsdpConfig(fsdp_version=1, sharding_strategy="HYBRID_SHARD", shard_group_size=2, transformer_layer_cls=LAYER)
    outcome = launch_trial(TrialRequest(fsdp=cfg, seq_len=32, timed_steps=3), tmp_path, 4, 240, forks=forks)
    result = outcome.result
    assert result.status == "ok", result.error
    assert (result.world_size, result.nnodes, result.nproc_per_node, result.mesh_shape) == (4, 1, 4, [2, 2])


@pytest.mark.torchrun
def test_two_simulated_nodes_measure_a_hybrid_trial_end_to_end(tmp_path, forks):
    cfg = FsdpConfig(fsdp_version=2, sharding_strategy="HYBRID_SHARD", transformer_layer_cls=LAYER, micro_batch_size=2)
    outcome = launch_local(TrialRequest(fsdp=cfg, seq_len=64, timed_steps=3, nnodes=2), tmp_path, 1, 240, "cpu",
                           (0, 1), forks)
    result = outcome.result
    assert result.status == "ok", result.error
    # One node's rank per shard group, replicated across the 2 nodes: the 2 x 1 mesh.
    assert (result.world_size, result.nnodes, result.nproc_per_node, result.mesh_shape) == (2, 2, 1, [2, 1])
    assert result.tokens_per_step == 2 * 64 * 2 and result.peak_memory_bytes > 0


@pytest.mark.torchrun
def test_a_node_lost_mid_trial_ends_it_at_once_and_leaves_nothing(tmp_path):
    cfg = FsdpConfig(fsdp_version=2, transformer_layer_cls=("Linear",))
    request = TrialRequest(fsdp=cfg, model="tests.models:hang", seq_len=16, timed_steps=3, nnodes=2)
    box = {}
    env_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env_path]))
    (tmp_path / "pids").mkdir()
    os.environ[PID_DIR_VAR] = str(tmp_path / "pids")
    try:
        worker = threading.Thread(target=lambda: box.update(out=launch_local(request, tmp_path, 1, 120, "cpu", (0, 1),
                                                                             None)))
        start = time.monotonic()
        worker.start()
        agent = None
        while agent is None and time.monotonic() - start < 60:
            agent = next((pid for pid in processes_mentioning("--node-rank=1") if str(tmp_path) in
                          Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")), None)
            time.sleep(0.2)
        assert agent is not None, "node 1's agent never started"
        # Both ranks are training (hung in the test model's forward).
        assert wait_for_ranks_in_forward(tmp_path / "pids", 2), "the ranks never reached their forward"
        for pid in process_tree(agent):  # the whole node goes away
            os.kill(pid, signal.SIGKILL)
        worker.join(60)
    finally:
        os.environ.pop("PYTHONPATH") if env_path is None else os.environ.update(PYTHONPATH=env_path)
        os.environ.pop(PID_DIR_VAR, None)
    result = box["out"].result
    assert result.status == "node_lost" and "node 1" in result.error
    assert time.monotonic() - start < 60, "the trial waited for its timeout"
    deadline = time.monotonic() + 15
    while processes_mentioning(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(tmp_path)) == [], "an agent or rank outlived the lost node"


@pytest.mark.torchrun
def test_autotune_run_with_two_nodes_records_the_mesh_and_runs_one_rank_hybrids_as_no_shard(tmp_path, forks):
    """Two nodes of one rank each: hybrid sharding's shard groups would hold one rank, so the space's
    HYBRID_SHARD is NO_SHARD (its 2-D mesh, two replicas of one-rank shards) and is launched as that."""
    space = tmp_path / "space.yaml"
    space.write_text("fsdp_version: 2\nsharding_strategy: [FULL_SHARD, HYBRID_SHARD]\nmixed_precision: fp32\n"
                     "micro_batch_size: 2\n")
    # Shallow trials: copies of 1 and 2 of llama-tiny's 4 blocks, timed one after the other in each two-node job.
    done = run_cli("run", "--mem-budget", "20GB", "--nnodes", "2", "--nproc", "1", "--space", str(space), "--seq-len",
                   "64",
                   "--timed-steps", "3", "--trials", "3", "--confirm", "0", "--trial-depth", "1,2", cwd=tmp_path,
                   forks=forks)
    assert done.returncode == 0, done.stderr[-3000:]
    storage = f"sqlite:///{tmp_path / 'studies' / 'autotune.db'}"
    (name,) = optuna.get_all_study_names(storage)
    assert "-w1x2-" in name
    study = optuna.load_study(study_name=name, storage=storage)
    measured = [t for t in study.trials if t.user_attrs.get("status") == "ok"]
    assert not [t for t in study.trials if t.user_attrs.get("config", {}).get("sharding_strategy") == "HYBRID_SHARD"]
    replicated = [t for t in measured if t.user_attrs["config"]["sharding_strategy"] == "NO_SHARD"]
    assert replicated and replicated[0].user_attrs["mesh_shape"] == [2, 1] and replicated[0].user_attrs["nnodes"] == 2
    assert all(t.user_attrs["world_size"] == 2 and t.user_attrs["nproc_per_node"] == 1 for t in measured)
    for t in measured:
        assert t.user_attrs["extrapolated"] and t.user_attrs["full_depth"] == 4
        points = t.user_attrs["depth_points"]
        assert [p["depth"] for p in points] == [1, 2] and points[0]["step_time_s"] < points[1]["step_time_s"] * 1.5
        # Each copy measured its tensor peak, and the line through them is the trial's figure at full depth.
        assert 0 < points[0]["tensor_peak_bytes"] < points[1]["tensor_peak_bytes"] < t.user_attrs["line_tensor_peak_bytes"]
    # The copies' order alternates from one shallow trial to the next.
    assert {t.user_attrs["copies_order"] for t in measured} == {"shallowest first", "deepest first"}
    doc = json.loads((tmp_path / "studies" / name / "best_config.json").read_text())
    assert doc["nnodes"] == 2


def test_a_lost_node_is_read_from_the_node_records_never_from_the_log(tmp_path):
    from autotune.launch.multinode import lost_node
    from autotune.launch.trial_files import node_record_path as record_path

    def record(node, **fields):
        record_path(tmp_path, node).write_text(json.dumps({"node": node, "exit_code": None, "signal": None,
                                                           "stopped": False, **fields}))

    assert lost_node(tmp_path, 2, step_ended=False, step_failed=False) is None  # still running: no record yet
    record(0, exit_code=1)  # a rank failed on its own: a crash, not a lost node
    record(1, stopped=True)  # Slurm told the other node to stop
    assert lost_node(tmp_path, 2, step_ended=True, step_failed=True) is None
    record(1, signal="SIGKILL", exit_code=-9)
    assert lost_node(tmp_path, 2, step_ended=False, step_failed=False).node == 1  # at once, while the step runs
    record_path(tmp_path, 1).unlink()
    assert lost_node(tmp_path, 2, step_ended=False, step_failed=False) is None
    assert lost_node(tmp_path, 2, step_ended=True, step_failed=True).node == 1
    assert lost_node(tmp_path, 2, step_ended=True, step_failed=False) is None
