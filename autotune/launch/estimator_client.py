"""The memory estimator's processes: each estimate forked from the fork server, or one long-lived server of its own.

The prediction comes from the worker side (a fake training step; see
:mod:`autotune.worker.fake_step`), run out of the driver so that it never
imports torch. With a ready fork server (:mod:`autotune.launch.forkserver`)
every estimate is a process forked from it: no imports to pay, several at
once where the host has cores to spare, each on the cores it is given.
Without one, ``python -m autotune.worker.fake_step --serve`` pays the imports
once and answers one estimate at a time. The device margin on top of it is
:mod:`autotune.study.margin`.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from autotune import interrupts
from autotune.config import FsdpConfig, LoraSpec
from autotune.launch.forkserver import ForkServer, run_forked
from autotune.launch.process_life import die_with_parent

# How often a waiting estimate looks for a stop request from another thread.
POLL_S = 0.25
# Fake steps run side by side on at most this many cores: each holds the model's structure, not its
# tensors, a few hundred MB.
MAX_SIDE_BY_SIDE = 16


class EstimatorClient:
    """A long-lived ``python -m autotune.worker.fake_step --serve``; thread-safe."""

    def __init__(self, model: str, world_size: int, nnodes: int, seq_len: int, timeout_s: float = 600,
                 global_batch_size: int | None = None, exact: bool = False, forks: ForkServer | None = None,
                 lora: LoraSpec | None = None) -> None:
        # With a global batch, each configuration is estimated with the
        # gradient accumulation its micro batch needs. ``exact`` runs every
        # block of a deep model instead of extrapolating from two shallow copies.
        self.request = {"model": model, "world_size": world_size, "nnodes": nnodes, "seq_len": seq_len,
                        "global_batch_size": global_batch_size, "exact": exact,
                        "lora": lora.to_dict() if lora is not None else None}
        # A model whose forward hangs must not hang the tuner: past this, the
        # estimate is abandoned and the configuration is launched unestimated.
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.forks = forks

    def _ensure(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "autotune.worker.fake_step", "--serve"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                preexec_fn=die_with_parent, start_new_session=True,
            )
        return self._proc

    def estimate(self, cfg: FsdpConfig, cores: tuple[int, ...] | None = None) -> dict[str, Any]:
        """``{"peak_bytes", "breakdown", "method", "seconds"}`` or ``{"error"}``; ``cores``:
        where to run it (forked estimates only; several may run at once)."""
        request = json.dumps({**self.request, "fsdp": cfg.to_dict()})
        try:
            done = run_forked(self.forks, "autotune.worker.fake_step:main", [request], self.timeout_s, affinity=cores)
        except TimeoutError:
            return {"error": f"no estimate within {self.timeout_s:.0f}s; abandoned"}
        if done is not None:
            code, output = done
            answer = next((line for line in reversed(output.splitlines()) if line.startswith("{")), None)
            return json.loads(answer) if answer else {"error": f"the estimating process exited {code}: {output[-300:]}"}
        with self._lock:
            proc = self._ensure()
            assert proc.stdin is not None and proc.stdout is not None  # both piped by _ensure
            try:
                proc.stdin.write(json.dumps({**self.request, "fsdp": cfg.to_dict()}) + "\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                return {"error": f"the estimator process failed: {exc}"}
            try:
                ready = self._wait_for_answer(proc)
            except BaseException:
                # Interrupted mid-estimate: the server cannot be asked anything
                # else until it answers, which may take a minute.
                self._kill()
                raise
            if not ready:
                self._kill()
                return {"error": f"no estimate within {self.timeout_s:.0f}s; abandoned"}
            line = proc.stdout.readline()
        if not line:
            return {"error": "the estimator process exited"}
        return json.loads(line)

    def _wait_for_answer(self, proc: subprocess.Popen) -> bool:
        deadline = time.monotonic() + self.timeout_s
        while True:
            interrupts.check()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([proc.stdout], [], [], min(POLL_S, left))  # type: ignore[type-var]  # piped
            if ready:
                return True

    def _kill(self) -> None:
        # The server and the child it forked for the estimate share a session.
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
