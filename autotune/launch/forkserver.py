"""Start trial processes by forking a pre-imported interpreter instead of exec'ing a new one.

Importing torch and transformers takes about 3 s of CPU per process, and a
2-rank trial starts three such processes (torchrun's agent and two ranks): on a
2-core machine that was half of every trial's wall time. A fork server
(``python -m autotune.worker.preload``) pays those imports once per tuner and
forks each process from then on. What runs is unchanged: torchrun's own
``main`` as the agent, one fresh process and one fresh process group per rank.

Standard library only: the driver (which never imports torch) and each rank's
supervisor (which must start in milliseconds) are the clients.

Each request forks a *keeper* that forks the process itself:

    server ─ keeper ─ process (dies with its keeper: PR_SET_PDEATHSIG)
               └─ holds the client's connection

The keeper reports the process's pid and, when it ends, its wait status over
the connection; when the connection drops (the client died, even by SIGKILL)
it kills the process. So a forked process dies with whoever asked for it, just
as an exec'd child with ``die_with_parent`` would.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Collection, Sequence

from autotune.launch.process_life import die_with_parent

ENV_VAR = "AUTOTUNE_FORKSERVER"
# Set to 1 to start every trial process as a fresh interpreter instead.
DISABLE_VAR = "AUTOTUNE_NO_FORKSERVER"
READY_TIMEOUT_S = 120.0
_HEADER = struct.Struct("!I")


# -- client side -------------------------------------------------------------
class ForkedProcess:
    """The part of ``subprocess.Popen`` the launcher and supervisor use, for a
    process forked by the server: ``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``kill``."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn = conn
        self._buffer = b""
        self.pid = pid
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._conn], [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout or 0.0)
            chunk = self._conn.recv(4096)
            if not chunk:
                # The keeper died without a word: it was killed, and its process with it.
                return self._finish(-signal.SIGKILL)
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return self._finish(os.waitstatus_to_exitcode(json.loads(line)["wait_status"]))

    def _finish(self, code: int) -> int:
        self.returncode = code
        self._conn.close()
        return code

    def poll(self) -> int | None:
        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _recv_exact(conn: socket.socket, size: int, start: bytes = b"") -> bytes:
    data = start
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("connection closed mid-message")
        data += chunk
    return data


def spawn(
    socket_path: str,
    target: str,
    argv: Sequence[str],
    *,
    stdout_fd: int,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    affinity: Collection[int] | None = None,
    new_session: bool = False,
) -> ForkedProcess:
    """Fork ``target`` (``"module:function"``, called with ``argv``; its return
    value is the exit code) in the server, writing stdout and stderr to
    ``stdout_fd``. Raises OSError when no server answers: callers fall back to
    starting a fresh interpreter."""
    request = {
        "target": target,
        "argv": list(argv),
        "env": dict(os.environ if env is None else env),
        "cwd": cwd or os.getcwd(),
        "affinity": sorted(affinity) if affinity is not None else None,
        "new_session": new_session,
    }
    payload = json.dumps(request).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(socket_path)
        socket.send_fds(conn, [_HEADER.pack(len(payload)) + payload], [stdout_fd])
        reply = b""
        while b"\n" not in reply:
            chunk = conn.recv(4096)
            if not chunk:
                raise ConnectionError("the fork server closed the connection")
            reply += chunk
    except BaseException:
        conn.close()
        raise
    line, _, rest = reply.partition(b"\n")
    answer = json.loads(line)
    if "error" in answer:
        conn.close()
        raise ConnectionError(f"the fork server refused: {answer['error']}")
    process = ForkedProcess(conn, int(answer["pid"]))
    process._buffer = rest
    return process


class ForkServer:
    """The driver's handle on ``python -m autotune.worker.preload``.

    Started first (its imports overlap the driver's own start-up); ``ready()``
    waits for it. The host probe, every memory estimate and every trial's
    processes are forked from it, so a run imports torch and transformers once.
    A server that fails to start is reported once and the tuner
    carries on with fresh interpreters, so this is a speed-up, never a
    dependency.
    """

    def __init__(self, model: str | None = None) -> None:
        # ``model``: whose code the server imports too (a preset, config.json or module:function).
        self._dir: str | None = None
        self.error: str | None = None
        self._ready: bool | None = None
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        if os.environ.get(DISABLE_VAR, "") not in ("", "0"):
            # A switch for comparing against, or for ruling out, the fork server.
            self._ready, self.error, self.socket_path = False, f"{DISABLE_VAR} is set", ""
            return
        shared = os.environ.get(ENV_VAR, "")
        if shared and _answers(shared):
            # A server already running in this environment (the test suite keeps one per worker): forking from it
            # spares this tuner the imports. It is not ours to stop, and it has not imported ``model``'s code, so
            # each rank imports that itself.
            self.socket_path, self._ready = shared, True
            return
        self._dir = tempfile.mkdtemp(prefix="autotune-fork-")
        self.socket_path = os.path.join(self._dir, "sock")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "autotune.worker.preload", self.socket_path, *([model] if model else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent, start_new_session=True,
        )  # fmt: skip

    def ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        with self._lock:
            return self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> bool:
        if self._ready is None:
            assert self._proc is not None and self._proc.stdout is not None  # started with the server, piped
            deadline = time.monotonic() + timeout_s
            last = f"not ready within {timeout_s:.0f}s"
            # Imports may print warnings first; the server's last word is "ready".
            while True:
                ready, _, _ = select.select([self._proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
                line = self._proc.stdout.readline().decode(errors="replace").strip() if ready else ""
                if line == "ready" or not ready or (ready and not line and self._proc.poll() is not None):
                    break
                last = line or last
            self._ready = line == "ready"
            if not self._ready:
                self.error = last
                self.close()
        return self._ready

    def env(self) -> dict[str, str]:
        """What a trial's environment needs so its ranks are forked too."""
        return {ENV_VAR: self.socket_path} if self.ready() else {}

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            if not self._ready:
                # Still importing (or failed): it has nothing to finish.
                self._proc.kill()
                self._proc.wait()
            else:
                try:
                    if self._proc.stdin is not None:
                        self._proc.stdin.close()
                    self._proc.wait(timeout=5)
                except (subprocess.TimeoutExpired, OSError):
                    self._proc.kill()
                    self._proc.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _answers(socket_path: str) -> bool:
    """Whether a fork server listens at ``socket_path`` (a stale path from a server that has ended does not)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(socket_path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


# -- server side -------------------------------------------------------------
def serve(socket_path: str) -> None:
    """Answer fork requests until stdin closes (the driver is done or dead)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    # Keepers are reaped by the kernel; each keeper waits for its own process.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
            return
        if listener in ready:
            conn, _ = listener.accept()
            try:
                request, fds = _read_request(conn)
            except (OSError, ValueError, ConnectionError):
                conn.close()
                continue
            if os.fork() == 0:
                listener.close()
                _keeper(conn, request, fds[0])
            for fd in fds:
                os.close(fd)
            conn.close()


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 1)
    if len(fds) != 1:
        raise ValueError("a request must pass exactly one output descriptor")
    data = _recv_exact(conn, _HEADER.size, data)
    (size,) = _HEADER.unpack(data[: _HEADER.size])
    data = _recv_exact(conn, _HEADER.size + size, data)
    return json.loads(data[_HEADER.size :]), fds


def _keeper(conn: socket.socket, request: dict[str, Any], out_fd: int) -> None:
    """Fork the requested process, report its pid and its end; kill it if the
    client goes away first. Never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _become(request, out_fd)
    os.close(out_fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    pidfd = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([conn, pidfd], [], [])  # type: ignore[type-var]  # a socket and a pidfd
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            try:
                conn.sendall(json.dumps({"wait_status": status}).encode() + b"\n")
            finally:
                os._exit(0)
        if conn in ready and not conn.recv(4096):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os._exit(0)


def _become(request: dict[str, Any], out_fd: int) -> None:
    """In the forked process: take the client's environment, working
    directory, cores and output, then run the target. Never returns."""
    code = 1
    try:
        die_with_parent()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if request["new_session"]:
            os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if request["affinity"] is not None:
            os.sched_setaffinity(0, request["affinity"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(null)
        os.close(out_fd)
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # the interpreter's own TextIOWrapper
        module_name, _, function_name = request["target"].partition(":")
        sys.argv = [module_name, *request["argv"]]
        function = getattr(importlib.import_module(module_name), function_name)
        returned = function(request["argv"])
        code = 0 if returned is None else int(returned)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - report it the way an interpreter would
        traceback.print_exc()
        code = 1
    finally:
        # No interpreter teardown: the server's state is not this process's to clean up.
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def run_forked(forks: ForkServer | None, target: str, argv: Sequence[str], timeout_s: float,
               affinity: Collection[int] | None = None) -> tuple[int, str] | None:
    """Run ``target`` forked from ``forks`` and collect its output; (exit code, output),
    or None when no server answers (the caller starts a fresh interpreter instead).
    Past ``timeout_s`` the process is killed and TimeoutError raised."""
    from autotune import interrupts

    if forks is None or not forks.ready():
        return None
    read_fd, write_fd = os.pipe()
    try:
        process = spawn(forks.socket_path, target, argv, stdout_fd=write_fd, affinity=affinity, new_session=True)
    except OSError:
        os.close(read_fd)
        return None
    finally:
        os.close(write_fd)
    chunks, deadline = [], time.monotonic() + timeout_s
    try:
        while True:
            interrupts.check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{target} gave no answer within {timeout_s:.0f}s")
            ready, _, _ = select.select([read_fd], [], [], min(0.25, left))
            if ready:
                chunk = os.read(read_fd, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        return process.wait(), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(read_fd)
        if process.returncode is None:
            process.kill()
            process.wait()
