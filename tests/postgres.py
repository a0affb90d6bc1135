"""A real PostgreSQL server for tests: Debian's binaries, a temporary cluster, a free port on 127.0.0.1.

Never the system service: ``initdb`` and ``pg_ctl`` run as the ``postgres``
user (initdb refuses root) on a folder of their own, and the server stops at
the end of the session. ``.ci/run`` installs the ``postgresql`` package where
it is missing.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Server:
    port: int
    data_dir: Path
    bin_dir: Path
    user: str
    password: str
    database: str
    _as: list[str]

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{self.user}:{self.password}@127.0.0.1:{self.port}/{self.database}"

    def pg_ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([*self._as, str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), *args],
                              capture_output=True, text=True, timeout=timeout)

    def start(self) -> None:
        done = self.pg_ctl("-l", str(self.data_dir / "server.log"), "-w", "-o",
                           f"-p {self.port} -k {self.data_dir} -c listen_addresses=127.0.0.1", "start")
        if done.returncode != 0:
            log = (self.data_dir / "server.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"pg_ctl start failed: {done.stderr or done.stdout}\n{log}")

    def stop(self, mode: str = "fast") -> None:
        self.pg_ctl("-m", mode, "-w", "stop")

    def psql(self, sql: str) -> str:
        done = subprocess.run([*self._as, str(self.bin_dir / "psql"), "-h", str(self.data_dir), "-p", str(self.port),
                               "-U", "postgres", "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-Atc", sql],
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"psql failed: {done.stderr}")
        return done.stdout


def find_bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server() -> Server:
    """initdb a new cluster in a temporary folder and start it; raises with the reason when it cannot."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise RuntimeError("no PostgreSQL server binaries in /usr/lib/postgresql/*/bin: apt-get install postgresql "
                           "(.ci/run does)")
    run_as: list[str] = []
    data_dir = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
    if os.geteuid() == 0:
        # initdb refuses to run as root.
        run_as = ["runuser", "-u", "postgres", "--"]
        shutil.chown(data_dir, "postgres", "postgres")
    cluster = data_dir / "cluster"
    password = "pw-" + secrets.token_hex(8)
    server = Server(port=_free_port(), data_dir=cluster, bin_dir=bin_dir, user="autotune", password=password,
                    database="autotune", _as=run_as)
    done = subprocess.run([*run_as, str(bin_dir / "initdb"), "-D", str(cluster), "-U", "postgres",
                           "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8"],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"initdb failed: {done.stderr or done.stdout}")
    server.start()
    server.psql(f"CREATE USER autotune WITH PASSWORD '{password}'")
    server.psql("CREATE DATABASE autotune OWNER autotune")
    return server
