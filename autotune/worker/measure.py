"""How a trial measures: step-time statistics and peak device memory.

On CUDA the caching allocator's own peaks are the truth. A CPU host has no
device memory, and process RSS mixes in the interpreter, libraries and freed
pages, so on CPU the peak is the largest total size of live tensor storages,
observed after every operator of one dedicated step. The same tracker counts
fake tensors, which is how the estimator measures a step that never runs.
"""

from __future__ import annotations

import gc
import statistics
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from autotune.stats import median_ci95, relative_ci95, relative_median_ci95  # noqa: F401 (re-exported)


def step_time_stats(times: list[float]) -> dict[str, float]:
    """Median, p10, p90 and coefficient of variation of step times (seconds)."""
    ordered = sorted(times)

    def quantile(q: float) -> float:
        # Linear interpolation between closest ranks, as numpy's default does.
        pos = q * (len(ordered) - 1)
        lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    mean = statistics.fmean(ordered)
    cv = statistics.pstdev(ordered) / mean if len(ordered) > 1 and mean > 0 else 0.0
    lo, hi = median_ci95(ordered)
    return {
        "median": statistics.median(ordered),
        "p10": quantile(0.10),
        "p90": quantile(0.90),
        "cv": cv,
        "ci_low": lo,
        "ci_high": hi,
    }


def _has_own_storage(obj: Any) -> bool:
    """Plain tensors and parameters, real or fake; not wrapper subclasses such as
    DTensor, whose bytes live in the local tensor they wrap (counted on its own)."""
    if type(obj) in (torch.Tensor, torch.nn.Parameter):
        return True
    return isinstance(obj, FakeTensor)


class LiveStorageTracker(TorchDispatchMode):
    """Track the peak total bytes of live tensor storages while active.

    Storages are held weakly, so one that is freed drops out by itself. Sizes
    are re-read at every operator because FSDP frees and re-allocates unsharded
    parameters by resizing storages in place, which no operator reports.
    """

    def __init__(self) -> None:
        super().__init__()
        self._storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.peak_bytes = 0

    def __enter__(self) -> LiveStorageTracker:
        # Tensors alive before the step (parameters, optimizer state, buffers)
        # count too, though no operator of the step created them.
        gc.collect()
        for obj in gc.get_objects():
            if _has_own_storage(obj):
                self._add(obj)
        self._update_peak()
        return super().__enter__()

    def _add(self, tensor: Any) -> None:
        if not _has_own_storage(tensor) or tensor.device.type == "meta":
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or opaque tensors have no storage
            return
        self._storages[storage] = None

    def _update_peak(self) -> None:
        current = sum(storage.nbytes() for storage in list(self._storages.keys()))
        if current > self.peak_bytes:
            self.peak_bytes = current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves((args, kwargs, out)):
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
        self._update_peak()
        return out
