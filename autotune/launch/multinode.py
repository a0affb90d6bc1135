"""One trial over several nodes: one torchrun agent per node, joined by torchrun's c10d rendezvous.

Two launchers, one shape of job:

- ``local``: the nodes are simulated on this host, one agent each, every agent
  on its own share of the slot's devices (cores, or GPUs). This is how the
  tests run the multi-node path, and how a configuration is checked before
  paying for nodes.
- ``slurm``: inside an allocation, one job step (``srun``) whose tasks are the
  agents, one per node, ``--kill-on-bad-exit`` so a lost task ends the step.

Both are :class:`autotune.launch.launcher.Agents`, watched and stopped by the
same loop as a one-node trial (:func:`autotune.launch.launcher.run_agents`).

A node lost mid-trial (its agent killed, or its Slurm task gone) ends the
trial at once as ``node_lost``, naming the node, rather than leaving its
peers blocked in a collective until the trial timeout; a timeout, or the
tuner stopping, takes down every agent (locally) or the whole step (Slurm).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import IO

from autotune.config import TrialRequest
from autotune.errors import UsageError
from autotune.launch.forkserver import ForkServer
from autotune.launch.process_life import die_with_parent
from autotune.launch.launcher import (LaunchOutcome, LocalAgents, LostNode, kill_process_tree, run_agents,
                                      start_torchrun, trial_env)
from autotune.launch.trial_files import node_record_path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def agent_args(nnodes: int, nproc: int, endpoint: str, rdzv_id: str) -> list[str]:
    """torchrun's arguments for one agent of a c10d rendezvous (every agent gets the same)."""
    return [
        f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}", "--max-restarts=0",
    ]  # fmt: skip


def worker_args(config_path: Path, trial_dir: Path) -> list[str]:
    return ["-m", "autotune.worker.supervise", str(config_path), str(trial_dir)]


def node_devices(devices: tuple[int, ...] | None, nnodes: int, node: int) -> tuple[int, ...] | None:
    """The devices of simulated node ``node``: an equal, contiguous share of the
    slot's, or one each in turn when the nodes outnumber them."""
    if devices is None:
        return None
    if len(devices) < nnodes:
        return (devices[node % len(devices)],)
    share = len(devices) // nnodes
    return tuple(devices[node * share:(node + 1) * share])


class LocalNodes(LocalAgents):
    """One torchrun agent per simulated node, all on this host. The driver is
    every agent's parent, so an agent's exit code is the truth: one killed by
    a signal (the driver sends none while it watches) is a lost node."""

    def lost(self) -> LostNode | None:
        for node, agent in enumerate(self.agents):
            code = agent.returncode
            if code is not None and code < 0:
                return LostNode(node, f"its torchrun agent was killed by {signal.Signals(-code).name}")
        return None


def launch_local(request: TrialRequest, trial_dir: Path, nproc: int, timeout_s: float, device_type: str,
                 devices: tuple[int, ...] | None, forks: ForkServer | None) -> LaunchOutcome:
    """``request.nnodes`` agents on this host, one simulated node each."""
    nnodes = request.nnodes

    def start(config_path: Path, log: IO[bytes]) -> LocalNodes:
        endpoint, rdzv_id = f"127.0.0.1:{free_port()}", f"autotune-{uuid.uuid4().hex[:12]}"
        nodes = LocalNodes([])
        try:
            for node in range(nnodes):
                mine = node_devices(devices, nnodes, node)
                command = [sys.executable, "-m", "torch.distributed.run", *agent_args(nnodes, nproc, endpoint, rdzv_id),
                           f"--node-rank={node}", *worker_args(config_path, trial_dir)]
                said = f"autotune: simulated node {node} of {nnodes}, devices {mine}: {' '.join(command[1:])}\n"
                log.write(said.encode())
                log.flush()
                nodes.agents.append(start_torchrun(command, log, trial_env(nproc, device_type, mine), device_type, mine,
                                                   forks))
        except BaseException:
            nodes.stop()
            raise
        return nodes

    return run_agents(request, trial_dir, timeout_s, start)


def slurm_allocation(environ: dict[str, str] | None = None) -> tuple[str, int] | None:
    """(job id, node count) of the Slurm allocation this runs in, or None outside one."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    return job, int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)


def first_node_address(environ: dict[str, str] | None = None) -> str:
    """Where the rendezvous listens: the first node of the allocation, by the address Slurm has for it."""
    env = os.environ if environ is None else environ
    nodes = subprocess.run(["scontrol", "show", "hostnames", env.get("SLURM_JOB_NODELIST", "")], capture_output=True,
                           text=True, env=env, timeout=30).stdout.split()
    if not nodes:
        raise RuntimeError("scontrol show hostnames gave no node for SLURM_JOB_NODELIST")
    shown = subprocess.run(["scontrol", "show", "node", nodes[0]], capture_output=True, text=True, env=env,
                           timeout=30).stdout
    address = next((part.split("=", 1)[1] for part in shown.split() if part.startswith("NodeAddr=")), nodes[0])
    return address


def srun_command(nnodes: int, nproc: int, allocated_nodes: int, endpoint: str, rdzv_id: str, config_path: Path,
                 trial_dir: Path) -> list[str]:
    """One job step, one torchrun agent per node, each under the node agent that
    records how it ended: ``--ntasks-per-node 1`` when the allocation has a node
    for each, else the agents share nodes (``--overcommit``)."""
    placement = ["--nodes", str(nnodes), "--ntasks-per-node", "1"] if allocated_nodes >= nnodes else \
        ["--nodes", str(allocated_nodes), "--overcommit"]
    return ["srun", "--ntasks", str(nnodes), *placement, "--kill-on-bad-exit=1", "--job-name", rdzv_id,
            sys.executable, "-m", "autotune.worker.node_agent", str(trial_dir), "--",
            sys.executable, "-m", "torch.distributed.run", *agent_args(nnodes, nproc, endpoint, rdzv_id),
            *worker_args(config_path, trial_dir)]


class SlurmStep:
    """The tasks of one Slurm job step, one node agent each, watched through the
    srun that started them. srun's exit code is the same (143) whether a rank
    failed or a node went away, so the nodes' records decide
    (:mod:`autotune.worker.node_agent`)."""

    def __init__(self, step: subprocess.Popen, job: str, step_name: str, nnodes: int, trial_dir: Path) -> None:
        self.step, self.job, self.step_name, self.nnodes, self.trial_dir = step, job, step_name, nnodes, trial_dir

    def poll(self) -> list[int | None]:
        return [self.step.poll()]

    def lost(self) -> LostNode | None:
        return lost_node(self.trial_dir, self.nnodes, step_ended=self.step.poll() is not None,
                         step_failed=bool(self.step.returncode))

    def exit_code(self) -> int | None:
        return self.step.returncode

    def stop(self) -> None:
        if self.step.poll() is None:
            cancel_step(self.job, self.step_name)
            kill_process_tree(self.step)


def lost_node(trial_dir: Path, nnodes: int, step_ended: bool, step_failed: bool) -> LostNode | None:
    """The node whose agent was killed by a signal of its own (not Slurm's
    SIGTERM to a step being ended), or, once a failed step has ended, the first
    node that left no record at all: its task went away before it could write."""
    records = {}
    for node in range(nnodes):
        try:
            records[node] = json.loads(node_record_path(trial_dir, node).read_text())
        except (OSError, ValueError):
            continue
    for node, record in sorted(records.items()):
        if record.get("signal") and record["signal"] != "SIGTERM" and not record.get("stopped"):
            return LostNode(node, f"its torchrun agent was killed by {record['signal']}")
    if step_ended and step_failed:
        missing = [node for node in range(nnodes) if node not in records]
        if missing:
            return LostNode(missing[0], "its Slurm task ended without a record (the node failed, or the task was "
                                        "killed)")
    return None


def launch_slurm(request: TrialRequest, trial_dir: Path, nproc: int, timeout_s: float,
                 device_type: str) -> LaunchOutcome:
    """The trial as one Slurm job step of the current allocation."""
    allocation = slurm_allocation()
    if allocation is None:
        raise RuntimeError("--launcher slurm runs inside a Slurm allocation (salloc or sbatch): SLURM_JOB_ID is not "
                           "set")
    job, allocated = allocation

    def start(config_path: Path, log: IO[bytes]) -> SlurmStep:
        rdzv_id = f"autotune-{uuid.uuid4().hex[:12]}"
        command = srun_command(request.nnodes, nproc, allocated, f"{first_node_address()}:{free_port()}", rdzv_id,
                               config_path, trial_dir)
        log.write(f"autotune: job {job}, step {rdzv_id}: {' '.join(command)}\n".encode())
        log.flush()
        # srun dies with the tuner by SIGTERM, not SIGKILL: it passes SIGTERM on
        # to the step's tasks, whereas a killed srun would leave the step running.
        step = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=trial_env(nproc, device_type, None), start_new_session=True,
                                preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        return SlurmStep(step, job, rdzv_id, request.nnodes, trial_dir)

    return run_agents(request, trial_dir, timeout_s, start)


def cancel_step(job: str, step_name: str) -> None:
    """End the trial's job step on every node (SIGKILL to its tasks), found by its name."""
    steps = subprocess.run(["squeue", "--steps", "--job", job, "--noheader", "--format", "%i %j"], capture_output=True,
                           text=True, timeout=30).stdout.split("\n")
    for line in steps:
        parts = line.split()
        if len(parts) == 2 and parts[1] == step_name:
            subprocess.run(["scancel", "--signal=KILL", parts[0]], capture_output=True, timeout=30)
            subprocess.run(["scancel", parts[0]], capture_output=True, timeout=30)


def check_launcher(launcher: str, nnodes: int, trial_root: Path) -> None:
    """Refuse, up front, a launcher this host cannot use: Slurm outside an allocation or
    without srun, or trial folders the nodes would not all see."""
    if launcher == "slurm":
        allocation = slurm_allocation()
        if allocation is None:
            raise UsageError("--launcher slurm: SLURM_JOB_ID is not set; run inside an allocation "
                             "(salloc --nodes N, or an sbatch script), or use --launcher local")
        if shutil.which("srun") is None:
            raise UsageError("--launcher slurm: srun is not on PATH")
        if min(nnodes, allocation[1]) > 1 and _is_node_local(trial_root):
            raise UsageError(f"--launcher slurm: the trial folders ({trial_root}) are on a node-local filesystem; put "
                             "the study (--storage sqlite:///path/on/shared/fs/autotune.db) where every node sees it")


# Filesystems that only one node ever sees.
NODE_LOCAL_FS = ("tmpfs", "ramfs", "overlay")


def _is_node_local(path: Path) -> bool:
    """Whether ``path`` lies on a filesystem type that no other node can see."""
    path = path.resolve()
    best, fstype = "", ""
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) >= 3 and str(path).startswith(fields[1]) and len(fields[1]) > len(best):
                    best, fstype = fields[1], fields[2]
    except OSError:
        return False
    return fstype in NODE_LOCAL_FS
