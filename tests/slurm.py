"""A real Slurm for tests: Debian's slurm-wlm and munge, one slurmctld and one slurmd on this host.

Everything lives in a temporary folder: munge's key, socket and logs, a
generated ``slurm.conf`` (munge auth on that socket, no cgroups, private ports,
one node at 127.0.0.1 with this host's cores, an oversubscribed partition).
No system service is used. ``.ci/system-packages`` installs the packages where
they are missing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Cluster:
    folder: Path
    conf: Path
    node: str
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, env=self.env, timeout=timeout)

    def stop(self) -> None:
        # Every job this cluster still runs goes first: a step left to a stopped slurmd keeps its slurmstepd and
        # its tasks alive, orphaned (a test that failed mid-trial left them for the rest of the suite).
        user = os.environ.get("USER") or __import__("getpass").getuser()
        for extra in (["--signal=KILL", "--full"], []):
            try:
                self.run("scancel", *extra, "--user", user, timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.run("squeue", "--noheader", timeout=30).stdout.strip():
            time.sleep(0.5)
        for proc in self.processes:
            proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        pid_file = self.folder / "munged.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), 15)
            except (ProcessLookupError, ValueError):
                pass


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def start_cluster() -> Cluster:
    """munged, slurmctld and slurmd from a generated configuration; raises with the reason when they cannot start."""
    for binary in ("munged", "slurmctld", "slurmd", "srun"):
        if shutil.which(binary) is None and not Path(f"/usr/sbin/{binary}").exists():
            raise RuntimeError(f"{binary} is not installed: apt-get install slurm-wlm munge (.ci/system-packages does)")
    folder = Path(tempfile.mkdtemp(prefix="autotune-slurm-"))
    for sub in ("state", "spool", "log"):
        (folder / sub).mkdir()
    node = socket.gethostname().split(".")[0]
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    munge_socket = folder / "munge.socket"
    munged = shutil.which("munged") or "/usr/sbin/munged"
    done = subprocess.run([munged, "--force", f"--key-file={key}", f"--socket={munge_socket}",
                           f"--pid-file={folder / 'munged.pid'}", f"--log-file={folder / 'log' / 'munged.log'}",
                           f"--seed-file={folder / 'munged.seed'}"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"munged failed: {done.stderr or done.stdout}")
    ctld_port, slurmd_port = _free_ports(2)
    conf = folder / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=autotune-test",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        "ReturnToService=2",
        f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'log' / 'slurmd.log'}",
        "SchedulerType=sched/backfill",
        "JobCompType=jobcomp/none",
        "KillWait=5",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
        f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        "",
    ]))
    cluster = Cluster(folder=folder, conf=conf, node=node)
    env = cluster.env
    for daemon in ("slurmctld", "slurmd"):
        binary = shutil.which(daemon) or f"/usr/sbin/{daemon}"
        log = open(folder / "log" / f"{daemon}.stdout", "wb")
        cluster.processes.append(subprocess.Popen([binary, "-D", "-f", str(conf)], stdout=log, stderr=subprocess.STDOUT,
                                                  env=env, start_new_session=True))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = cluster.run("sinfo", "--noheader", "--format=%T", timeout=10).stdout.strip()
        if state in ("idle", "mixed", "allocated"):
            return cluster
        if any(p.poll() is not None for p in cluster.processes):
            break
        time.sleep(0.5)
    logs = "; ".join(f"{name}: " + (folder / "log" / name).read_text(errors="replace")[-600:]
                     for name in ("slurmctld.log", "slurmd.log") if (folder / "log" / name).exists())
    cluster.stop()
    raise RuntimeError(f"the node never became idle (sinfo: {state!r}); {logs}")
