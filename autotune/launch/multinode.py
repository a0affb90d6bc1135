"""One trial over several nodes: one torchrun agent per node, joined by torchrun's c10d rendezvous.

Two launchers, one shape of job:

- ``local``: the nodes are simulated on this host, one agent each, every agent
  on its own share of the slot's devices (cores, or GPUs). This is how the
  tests run the multi-node path, and how a configuration is checked before
  paying for nodes.
- ``slurm``: inside an allocation, one job step (``srun``) whose tasks are the
  agents, one per node, ``--kill-on-bad-exit`` so a lost task ends the step.

A node lost mid-trial (its agent killed, or its Slurm task gone) ends the
trial at once as ``node_lost``, naming the node, rather than leaving its
peers blocked in a collective until the trial timeout; a timeout, or the
tuner stopping, takes down every agent (locally) or the whole step (Slurm).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from autotune import interrupts
from autotune.config import Status, TrialRequest, TrialResult, write_json_atomic
from autotune.errors import UsageError
from autotune.launch.forkserver import ForkServer
from autotune.launch.process_life import die_with_parent
from autotune.launch.launcher import POLL_S, LaunchOutcome, classify, kill_process_tree, start_torchrun, trial_env

# How long the other agents get to write their ranks' error records after one
# failed on its own, before they are stopped.
PEER_GRACE_S = 3.0


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


def launch_local(request: TrialRequest, trial_dir: Path, nproc: int, timeout_s: float, device_type: str,
                 devices: tuple[int, ...] | None, forks: ForkServer | None) -> LaunchOutcome:
    """``request.nnodes`` agents on this host, one simulated node each."""
    nnodes = request.nnodes
    config_path = _write_config(request, trial_dir)
    log_path = trial_dir / "log.txt"
    endpoint, rdzv_id = f"127.0.0.1:{free_port()}", f"autotune-{uuid.uuid4().hex[:12]}"
    start, started_at = time.perf_counter(), time.time()
    agents = []
    with open(log_path, "ab") as log:
        try:
            for node in range(nnodes):
                mine = node_devices(devices, nnodes, node)
                command = [sys.executable, "-m", "torch.distributed.run", *agent_args(nnodes, nproc, endpoint, rdzv_id),
                           f"--node-rank={node}", *worker_args(config_path, trial_dir)]
                log.write(f"autotune: simulated node {node} of {nnodes}, devices {mine}: {' '.join(command[1:])}\n".encode())
                log.flush()
                agents.append(start_torchrun(command, log, trial_env(nproc, device_type, mine), device_type, mine, forks))
            timed_out, lost = _watch(agents, timeout_s)
        finally:
            for agent in agents:
                if agent.poll() is None:
                    kill_process_tree(agent)
    if lost is not None:
        result = TrialResult(status=Status.NODE_LOST, failed_rank=None, exit_code=agents[lost].returncode,
                             error=f"node {lost} was lost mid-trial: its torchrun agent was killed by "
                                   f"{signal.Signals(-agents[lost].returncode).name}; its peers were stopped")
    else:
        result = classify(trial_dir, _job_exit_code(agents), timed_out, timeout_s, log_path)
    return LaunchOutcome(result=result, wall_s=time.perf_counter() - start, log_path=log_path, trial_dir=trial_dir,
                         started_at=started_at, ended_at=time.time())


def _watch(agents: list, timeout_s: float) -> tuple[bool, int | None]:
    """Wait for every agent; (timed out, the node lost if one was). An agent that
    dies by a signal is a lost node; one that fails on its own (a rank's error)
    leaves its peers a moment to record theirs, then they are stopped."""
    deadline = time.monotonic() + timeout_s
    failed_at = None
    while True:
        interrupts.check()
        codes = [a.poll() for a in agents]
        lost = next((i for i, code in enumerate(codes) if code is not None and code < 0), None)
        if lost is not None:
            return False, lost
        if all(code is not None for code in codes):
            return False, None
        if any(code for code in codes if code is not None):
            failed_at = failed_at or time.monotonic()
            if time.monotonic() - failed_at > PEER_GRACE_S:
                return False, None
        if time.monotonic() >= deadline:
            return True, None
        time.sleep(POLL_S)


def _job_exit_code(agents: list) -> int | None:
    """The job's exit code: the first agent's failure, else 0."""
    codes = [a.returncode for a in agents]
    return next((c for c in codes if c), 0 if all(c == 0 for c in codes) else None)


def _write_config(request: TrialRequest, trial_dir: Path) -> Path:
    trial_dir.mkdir(parents=True, exist_ok=True)
    path = trial_dir / "config.json"
    write_json_atomic(path, request.to_dict())
    return path


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
    shown = subprocess.run(["scontrol", "show", "node", nodes[0]], capture_output=True, text=True, env=env, timeout=30).stdout
    address = next((part.split("=", 1)[1] for part in shown.split() if part.startswith("NodeAddr=")), nodes[0])
    return address


def srun_command(nnodes: int, nproc: int, allocated_nodes: int, endpoint: str, rdzv_id: str, config_path: Path,
                 trial_dir: Path) -> list[str]:
    """One job step, one torchrun agent per node: ``--ntasks-per-node 1`` when the
    allocation has a node for each, else the agents share nodes (``--overcommit``)."""
    placement = ["--nodes", str(nnodes), "--ntasks-per-node", "1"] if allocated_nodes >= nnodes else \
        ["--nodes", str(allocated_nodes), "--overcommit"]
    return ["srun", "--ntasks", str(nnodes), *placement, "--kill-on-bad-exit=1", "--job-name", rdzv_id,
            sys.executable, "-m", "torch.distributed.run", *agent_args(nnodes, nproc, endpoint, rdzv_id),
            *worker_args(config_path, trial_dir)]


def launch_slurm(request: TrialRequest, trial_dir: Path, nproc: int, timeout_s: float, device_type: str) -> LaunchOutcome:
    """The trial as one Slurm job step of the current allocation."""
    allocation = slurm_allocation()
    if allocation is None:
        raise RuntimeError("--launcher slurm runs inside a Slurm allocation (salloc or sbatch): SLURM_JOB_ID is not set")
    job, allocated = allocation
    config_path = _write_config(request, trial_dir)
    log_path = trial_dir / "log.txt"
    rdzv_id = f"autotune-{uuid.uuid4().hex[:12]}"
    command = srun_command(request.nnodes, nproc, allocated, f"{first_node_address()}:{free_port()}", rdzv_id,
                           config_path, trial_dir)
    start, started_at = time.perf_counter(), time.time()
    with open(log_path, "ab") as log:
        log.write(f"autotune: job {job}, step {rdzv_id}: {' '.join(command)}\n".encode())
        log.flush()
        # srun dies with the tuner by SIGTERM, not SIGKILL: it passes SIGTERM on
        # to the step's tasks, whereas a killed srun would leave the step running.
        step = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=trial_env(nproc, device_type, None), start_new_session=True,
                                preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        try:
            timed_out = not _wait(step, timeout_s)
        finally:
            if step.poll() is None:
                cancel_step(job, rdzv_id)
                kill_process_tree(step)
    result = classify(trial_dir, step.returncode, timed_out, timeout_s, log_path)
    if result.status == Status.CRASH and _task_lost(log_path):
        result = TrialResult(status=Status.NODE_LOST, exit_code=step.returncode,
                             error=f"a node was lost mid-trial (Slurm: {_task_lost(log_path)}); the step was ended")
    return LaunchOutcome(result=result, wall_s=time.perf_counter() - start, log_path=log_path, trial_dir=trial_dir,
                         started_at=started_at, ended_at=time.time())


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        interrupts.check()
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def cancel_step(job: str, step_name: str) -> None:
    """End the trial's job step on every node (SIGKILL to its tasks), found by its name."""
    steps = subprocess.run(["squeue", "--steps", "--job", job, "--noheader", "--format", "%i %j"], capture_output=True,
                           text=True, timeout=30).stdout.split("\n")
    for line in steps:
        parts = line.split()
        if len(parts) == 2 and parts[1] == step_name:
            subprocess.run(["scancel", "--signal=KILL", parts[0]], capture_output=True, timeout=30)
            subprocess.run(["scancel", parts[0]], capture_output=True, timeout=30)


def _task_lost(log_path: Path) -> str | None:
    """Slurm's own line about a task or node that went away, if the step log has one."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("srun:") and ("Killed" in line or "lost" in line.lower() or "NODE_FAIL" in line
                                         or "task" in line and "terminated" in line and "signal" in line):
            return line.strip()
    return None


def check_launcher(launcher: str, nnodes: int, trial_root: Path) -> None:
    """Refuse, up front, a launcher this host cannot use: Slurm outside an allocation or
    without srun, or trial folders the nodes would not all see."""
    if launcher == "slurm":
        if slurm_allocation() is None:
            raise UsageError("--launcher slurm: SLURM_JOB_ID is not set; run inside an allocation "
                             "(salloc --nodes N, or an sbatch script), or use --launcher local")
        if shutil.which("srun") is None:
            raise UsageError("--launcher slurm: srun is not on PATH")
        if min(nnodes, slurm_allocation()[1]) > 1 and _is_node_local(trial_root):
            raise UsageError(f"--launcher slurm: the trial folders ({trial_root}) are on a node-local filesystem; "
                             "put the study (--storage sqlite:///path/on/shared/fs/autotune.db) where every node sees it")


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
