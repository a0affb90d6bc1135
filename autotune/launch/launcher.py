"""Run one trial as one ``torchrun`` job and classify how it ended.

Each job gets its own process group and dies with the driver, so a timeout or
a killed tuner leaves no orphans. The outcome comes from exit codes and the
files the worker writes (``result.json``, ``rank<N>.error.json``), never from
searching the log for words.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Protocol

from autotune import interrupts
from autotune.config import RankMemory, Status, TrialRequest, TrialResult, write_json_atomic
from autotune.launch.devices import CUDA_MASK, cpu_cores, physical_ids
from autotune.launch.forkserver import ForkedProcess, ForkServer, spawn
from autotune.launch.process_life import die_with_parent

# Seconds between SIGTERM and SIGKILL when a trial is stopped.
KILL_GRACE_S = 5.0
LOG_TAIL_LINES = 15


@dataclass
class LaunchOutcome:
    result: TrialResult
    wall_s: float
    log_path: Path
    trial_dir: Path
    # Wall-clock seconds since the epoch: when the job started and ended.
    started_at: float = 0.0
    ended_at: float = 0.0


def torchrun_command(nproc: int, config_path: Path, trial_dir: Path) -> list[str]:
    # ``python -m torch.distributed.run`` is torchrun, run by this interpreter,
    # so the trial uses the same environment as the driver. --standalone keeps
    # the rendezvous on a free localhost port.
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc-per-node={nproc}",
        "-m", "autotune.worker.supervise", str(config_path), str(trial_dir),
    ]  # fmt: skip


def trial_env(nproc: int, device_type: str, devices: tuple[int, ...] | None,
              environ: dict[str, str] | None = None) -> dict[str, str]:
    """The job's environment: the slot's GPUs by their physical names (the
    user's own CUDA_VISIBLE_DEVICES entries, UUIDs kept), and intra-op threads
    set explicitly, on CUDA too (CPU-offloaded optimizer steps run on them)."""
    env = dict(os.environ if environ is None else environ)
    env["AUTOTUNE_LAUNCHED_AT"] = repr(time.time())
    env.setdefault("PYTHONUNBUFFERED", "1")
    if device_type == "cuda" and devices is not None:
        env[CUDA_MASK] = ",".join(physical_ids("cuda", devices, env))
    # Ranks share the cores; more threads than cores makes timings noise.
    cores = len(devices) if device_type == "cpu" and devices is not None else len(os.sched_getaffinity(0))
    env["OMP_NUM_THREADS"] = str(max(1, cores // nproc))
    return env


def _start_in_slot(device_type: str, devices: tuple[int, ...] | None):
    """The child's set-up between fork and exec: die with the driver and, on a
    CPU host with a device slot, run only on the slot's cores."""
    cores = cpu_cores(devices) if device_type == "cpu" and devices is not None else None

    def preexec() -> None:
        die_with_parent()
        if cores is not None:
            os.sched_setaffinity(0, cores)

    return preexec


def process_tree(root_pid: int) -> list[int]:
    """``root_pid`` and all its descendants, read from /proc.

    torchrun starts each rank in a session of its own, so signalling torchrun's
    process group does not reach the ranks; walking the tree does.
    """
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # The command name may hold spaces; fields after its ")" are fixed.
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_process_tree(proc: subprocess.Popen | ForkedProcess) -> None:
    """Stop torchrun and every rank: SIGTERM first so torchrun can shut its
    workers down, then SIGKILL for anything still alive after a grace period."""
    tree = process_tree(proc.pid)
    _signal_all(tree, signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    # Ranks started after the first snapshot are included by taking it again.
    _signal_all(sorted(set(tree) | set(process_tree(proc.pid))), signal.SIGKILL)
    proc.wait()


def start_torchrun(
    command: list[str],
    log: IO[bytes],
    env: dict[str, str],
    device_type: str,
    devices: tuple[int, ...] | None,
    forks: ForkServer | None,
) -> subprocess.Popen | ForkedProcess:
    """torchrun's agent, forked from the fork server when one is ready (its
    ranks are then forked too), else exec'd as a fresh interpreter."""
    if forks is not None and forks.ready():
        affinity = cpu_cores(devices) if device_type == "cpu" and devices is not None else None
        try:
            # command is [python, "-m", "torch.distributed.run", *arguments]
            return spawn(forks.socket_path, "torch.distributed.run:main", command[3:], stdout_fd=log.fileno(),
                         env={**env, **forks.env()}, affinity=affinity, new_session=True)
        except OSError as exc:
            log.write(f"autotune: fork server unavailable ({exc}); starting torchrun afresh\n".encode())
            log.flush()
    return subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
        preexec_fn=_start_in_slot(device_type, devices),
    )


# How often the wait loop looks at the agents, their records and a stop request from another thread.
POLL_S = 0.1
# How long the other agents get to write their ranks' error records after one
# failed on its own, before they are stopped.
PEER_GRACE_S = 3.0


@dataclass(frozen=True)
class LostNode:
    """A node of a multi-node trial that went away mid-trial, and how that was known."""

    node: int
    how: str


class Agents(Protocol):
    """A trial's running torchrun agents, however they were started: one local
    process (one node), one per simulated node, or the tasks of a Slurm step.
    :func:`run_agents` watches and stops every kind with the same loop."""

    def poll(self) -> list[int | None]:
        """Each watched process's exit code, None while it runs."""

    def lost(self) -> LostNode | None:
        """The node that went away, decided from exit codes and the records the
        nodes write, never from words in the log."""

    def exit_code(self) -> int | None:
        """The job's exit code once it has ended: the first failure, else 0."""

    def stop(self) -> None:
        """Take down every agent and its ranks (a no-op for those already ended)."""


class LocalAgents:
    """torchrun agents this driver started on this host and watches as their parent."""

    def __init__(self, agents: list[subprocess.Popen | ForkedProcess]) -> None:
        self.agents = agents

    def poll(self) -> list[int | None]:
        return [a.poll() for a in self.agents]

    def exit_code(self) -> int | None:
        """The first agent's failure, else 0 (None while any runs)."""
        codes = [a.returncode for a in self.agents]
        return next((c for c in codes if c), 0 if all(c == 0 for c in codes) else None)

    def stop(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                kill_process_tree(agent)


class OneAgent(LocalAgents):
    """One torchrun agent on this host: a one-node trial, which has no node to lose."""

    def __init__(self, proc: subprocess.Popen | ForkedProcess) -> None:
        super().__init__([proc])

    def lost(self) -> LostNode | None:
        return None


@dataclass(frozen=True)
class Ending:
    timed_out: bool = False
    lost: LostNode | None = None


def watch(agents: Agents, timeout_s: float) -> Ending:
    """Wait for the agents to end, a node to be lost, or ``timeout_s``. An agent
    that fails on its own (a rank's error) leaves its peers a moment to record
    theirs. In the main thread a signal interrupts the wait by itself; in a
    slot's thread the stop request is polled."""
    deadline = time.monotonic() + timeout_s
    failed_at = None
    while True:
        interrupts.check()
        codes = agents.poll()
        lost = agents.lost()
        if lost is not None:
            return Ending(lost=lost)
        if all(code is not None for code in codes):
            return Ending()
        if any(code for code in codes if code is not None):
            failed_at = failed_at or time.monotonic()
            if time.monotonic() - failed_at > PEER_GRACE_S:
                return Ending()
        left = deadline - time.monotonic()
        if left <= 0:
            return Ending(timed_out=True)
        time.sleep(min(POLL_S, left))


def run_agents(request: TrialRequest, trial_dir: Path, timeout_s: float,
               start: Callable[[Path, IO[bytes]], Agents]) -> LaunchOutcome:
    """Run one trial to its end, however its agents are started: write its
    request, start the agents (``start(config_path, log)``), watch them, stop
    whatever is left, and classify how the trial ended."""
    trial_dir.mkdir(parents=True, exist_ok=True)
    config_path = trial_dir / "config.json"
    write_json_atomic(config_path, request.to_dict())
    log_path = trial_dir / "log.txt"
    start_s, started_at = time.perf_counter(), time.time()
    agents: Agents | None = None
    with open(log_path, "ab") as log:
        try:
            agents = start(config_path, log)
            ending = watch(agents, timeout_s)
        finally:
            # A timeout, a lost node, Ctrl-C, SIGTERM or any other interruption
            # of the driver stops the whole job.
            if agents is not None:
                agents.stop()
    if ending.lost is not None:
        result = TrialResult(status=Status.NODE_LOST, exit_code=agents.exit_code(),
                             error=f"node {ending.lost.node} was lost mid-trial: {ending.lost.how}; its peers were "
                                   "stopped")
    else:
        result = classify(trial_dir, agents.exit_code(), ending.timed_out, timeout_s, log_path)
    return LaunchOutcome(result=result, wall_s=time.perf_counter() - start_s, log_path=log_path, trial_dir=trial_dir,
                         started_at=started_at, ended_at=time.time())


def launch_trial(
    request: TrialRequest,
    trial_dir: Path,
    nproc: int,
    timeout_s: float,
    device_type: str = "cpu",
    devices: tuple[int, ...] | None = None,
    forks: ForkServer | None = None,
) -> LaunchOutcome:
    """Run one one-node trial to its end; ``devices`` (GPU indices, or CPU cores)
    confines it to a slot; ``forks`` starts its processes without paying imports."""

    def start(config_path: Path, log: IO[bytes]) -> Agents:
        return OneAgent(start_torchrun(torchrun_command(nproc, config_path, trial_dir), log,
                                       trial_env(nproc, device_type, devices), device_type, devices, forks))

    return run_agents(request, trial_dir, timeout_s, start)


def _log_tail(log_path: Path) -> str:
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-LOG_TAIL_LINES:])


def classify(trial_dir: Path, exit_code: int | None, timed_out: bool, timeout_s: float, log_path: Path) -> TrialResult:
    """ok / aborted from ``result.json``; oom / crash from rank error files and
    exit codes; timeout when the driver had to stop the job."""
    if timed_out:
        return TrialResult(status=Status.TIMEOUT, error=f"no result within --trial-timeout {timeout_s:.0f}s; the job "
                                                        "was killed", exit_code=exit_code)
    failures = []
    for path in sorted(trial_dir.glob("rank*.error.json")):
        try:
            failures.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    failures.sort(key=lambda f: f.get("time", float("inf")))
    oom = next((f for f in failures if f.get("status") == Status.OOM), None)
    if oom is not None:
        # The figure it reached: on CUDA, its allocator's peaks and what lay outside it.
        memory = RankMemory(rank=oom.get("rank", 0), peak_allocated=oom.get("peak_allocated"),
                            peak_reserved=oom.get("peak_reserved"), outside_allocator=oom.get("outside_allocator"))
        return TrialResult(
            status=Status.OOM,
            error=oom.get("error"),
            failed_rank=oom.get("rank"),
            exit_code=exit_code,
            peak_memory_bytes=memory.peak or None,
            rank_memory=[memory] if memory.peak else [],
            memory_cap_bytes=oom.get("cap_bytes"),
        )
    result_path = trial_dir / "result.json"
    if exit_code == 0 and result_path.exists():
        return TrialResult.from_dict(json.loads(result_path.read_text()))
    # The root cause: a rank that died on its own without a word (a signal
    # other than torchrun's SIGTERM, a hard exit: its peers then report broken
    # collectives), else the earliest rank that reported its own error, else
    # whichever rank ended first.
    died = _first_abnormal_exit(trial_dir, unreported_only=True)
    if died is None and failures:
        first = failures[0]
        return TrialResult(
            status=Status.CRASH,
            error=f"rank {first.get('rank')} failed: {first.get('error')}",
            failed_rank=first.get("rank"),
            exit_code=exit_code,
        )
    died = died or _first_abnormal_exit(trial_dir, unreported_only=False)
    if died is not None:
        how = f"was killed by {died['signal']}" if died.get("signal") else f"exited with code {died['exit_code']}"
        rank_log = trial_dir / f"rank{died['rank']}.log"
        return TrialResult(
            status=Status.CRASH,
            error=(f"rank {died['rank']} {how} without reporting an error; last lines of its log:\n"
                   f"{_log_tail(rank_log)}"),
            failed_rank=died["rank"],
            exit_code=died["exit_code"],
        )
    return TrialResult(
        status=Status.CRASH,
        error=f"torchrun exited with code {exit_code} and no rank reported why; log tail:\n{_log_tail(log_path)}",
        exit_code=exit_code,
    )


def _first_abnormal_exit(trial_dir: Path, unreported_only: bool) -> dict | None:
    """The earliest rank whose supervisor saw it end badly (signal or non-zero
    code); with ``unreported_only``, only ranks that wrote no error record and
    were not stopped by torchrun's SIGTERM."""
    reported = {int(p.name[4:].split(".")[0]) for p in trial_dir.glob("rank*.error.json")}
    records = []
    for path in trial_dir.glob("rank*.exit.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if record.get("exit_code") == 0:
            continue
        if unreported_only and (record.get("rank") in reported or record.get("signal") == "SIGTERM"):
            continue
        records.append(record)
    return min(records, key=lambda r: r.get("time", float("inf"))) if records else None
