"""Predicted peak memory per rank, for pruning before launch and for ``autotune estimate``.

The prediction comes from the worker side (``python -m autotune.worker.estimate``,
a fake training step; see there), run as one long-lived subprocess so the driver
never imports torch and pays the imports once. This module adds the device
margin and calibrates it against what the study has measured.
"""

from __future__ import annotations

import json
import os
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable

from autotune import interrupts
from autotune.config import FsdpConfig
from autotune.lifeline import die_with_parent

# CUDA needs memory that no tensor accounts for: the context (about 0.5 GiB),
# NCCL's buffers, and the caching allocator's rounding and fragmentation.
CUDA_MARGIN_BYTES = int(1.5 * 2**30)
CUDA_MARGIN_FACTOR = 1.10
# Calibrate from the study only once it has this many measured trials.
MIN_CALIBRATION_TRIALS = 3
# How often a waiting estimate looks for a stop request from another thread.
POLL_S = 0.25


@dataclass(frozen=True)
class Margin:
    """Predicted device peak = tensor peak * factor + fixed bytes."""

    factor: float
    fixed_bytes: int
    source: str

    def apply(self, tensor_peak: int) -> int:
        return int(tensor_peak * self.factor + self.fixed_bytes)


def default_margin(device_type: str) -> Margin:
    if device_type == "cuda":
        return Margin(CUDA_MARGIN_FACTOR, CUDA_MARGIN_BYTES, "default CUDA margin")
    # On CPU the trial measures the same quantity the estimator predicts.
    return Margin(1.0, 0, "none (CPU trials measure tensor bytes too)")


def calibrated_margin(pairs: Iterable[tuple[int, int]], device_type: str) -> Margin:
    """The margin from (measured, predicted) pairs of this study, the default
    until enough trials exist.

    The fixed term (context, NCCL buffers) stays: the measured peak includes
    that memory outside the allocator, so the factor fitted on top of it is
    the largest ratio of what remains to the prediction, and a configuration
    that fitted is never pruned by a model that under-predicts.
    """
    fixed = default_margin(device_type).fixed_bytes
    ratios = [(m - fixed) / p for m, p in pairs if m and p]
    if len(ratios) < MIN_CALIBRATION_TRIALS:
        return default_margin(device_type)
    factor = max(1.0, max(ratios))
    return Margin(round(factor, 4), fixed, f"calibrated on {len(ratios)} trials (median ratio {statistics.median(ratios):.3f})"
                  + (f" + {fixed / 2**30:.1f} GiB fixed" if fixed else ""))


def memory_key(cfg: FsdpConfig) -> str:
    """What decides the peak: the configuration less its all-gather rate limit,
    which changes when host-side work waits, not what is allocated."""
    data = cfg.to_dict()
    data.pop("limit_all_gathers")
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


class EstimatorClient:
    """A long-lived ``python -m autotune.worker.estimate --serve``; thread-safe."""

    def __init__(self, model: str, world_size: int, nnodes: int, seq_len: int, timeout_s: float = 600) -> None:
        self.request = {"model": model, "world_size": world_size, "nnodes": nnodes, "seq_len": seq_len}
        # A model whose forward hangs must not hang the tuner: past this, the
        # estimate is abandoned and the configuration is launched unestimated.
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _ensure(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "autotune.worker.estimate", "--serve"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                preexec_fn=die_with_parent, start_new_session=True,
            )
        return self._proc

    def estimate(self, cfg: FsdpConfig) -> dict[str, Any]:
        """``{"peak_bytes", "breakdown", "method", "seconds"}`` or ``{"error"}``."""
        with self._lock:
            proc = self._ensure()
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
            ready, _, _ = select.select([proc.stdout], [], [], min(POLL_S, left))
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
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
