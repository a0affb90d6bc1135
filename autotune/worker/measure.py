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
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from autotune.config import RankMemory

from autotune.stats import median_ci95


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


@dataclass(frozen=True)
class MemoryCap:
    """What a CUDA rank's caching allocator was capped at, and why that figure."""

    budget_bytes: int
    outside_bytes: int
    cap_bytes: int


class BudgetBelowOverheadError(RuntimeError):
    """The budget does not even cover the device memory outside the allocator: nothing can fit."""


def cap_allocator(budget_bytes: int, device: torch.device, groups: Iterable[Any] = ()) -> MemoryCap:
    """Cap this rank's caching allocator at ``budget_bytes`` less the device memory
    outside it, measured now, so that the trial runs as on a GPU of the budget's size.

    Past the cap the allocator frees its cached blocks and retries before it
    raises out of memory (``num_alloc_retries`` counts the retries): a
    configuration that trains under the cap fits, and its speed is what a
    user with such a GPU would see. What lives outside the allocator (the CUDA
    context, cuBLAS handles, NCCL's buffers) is brought up first: one
    collective on each of ``groups`` creates its communicator.
    """
    for group in groups:
        dist.all_reduce(torch.zeros(1, device=device), group=group)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    cap = allocator_cap(budget_bytes, total, free, torch.cuda.memory_reserved(device))
    torch.cuda.set_per_process_memory_fraction(cap.cap_bytes / total, device)
    return cap


def allocator_cap(budget_bytes: int, total: int, free: int, reserved: int) -> MemoryCap:
    """The cap for a rank's caching allocator: the budget less the device memory in
    use outside the allocator (``total - free - reserved``), never above the device."""
    outside = max(0, total - free - reserved)
    cap = min(budget_bytes - outside, total)
    if cap <= 0:
        raise BudgetBelowOverheadError(
            f"out of memory: the budget of {budget_bytes} bytes does not cover the {outside} bytes this rank holds "
            "outside the caching allocator (CUDA context, NCCL buffers)")
    return MemoryCap(budget_bytes, outside, cap)


def add_run_figures(memory: RankMemory, device: torch.device) -> None:
    """What only the whole run shows, added to the memory step's figures: the
    allocator's pool can still grow after that step, and it may have retried at
    its cap (freed its cache to make room) any time since the model was built."""
    memory.peak_reserved = max(memory.peak_reserved or 0, torch.cuda.max_memory_reserved(device))
    memory.alloc_retries = int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def _has_own_storage(obj: Any, count_fake: bool) -> bool:
    """Plain tensors and parameters (and fake ones, when counting them); not wrapper
    subclasses such as DTensor, whose bytes live in the local tensor they wrap
    (counted on its own)."""
    if type(obj) in (torch.Tensor, torch.nn.Parameter):
        return True
    return count_fake and isinstance(obj, FakeTensor)


class LiveStorageTracker(TorchDispatchMode):
    """Track the peak total bytes of live tensor storages while active.

    Storages are held weakly, so one that is freed drops out by itself. Sizes
    are re-read at every operator because FSDP frees and re-allocates unsharded
    parameters by resizing storages in place, which no operator reports.

    ``count_fake`` counts fake tensors as if real: the estimator's step is all
    fake. A real trial must not: torch.compile keeps fake copies of the tensors
    it traced, which hold no memory.
    """

    def __init__(self, count_fake: bool = False) -> None:
        super().__init__()
        self._storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.peak_bytes = 0
        self.count_fake = count_fake

    def __enter__(self) -> LiveStorageTracker:
        # Tensors alive before the step (parameters, optimizer state, buffers)
        # count too, though no operator of the step created them.
        gc.collect()
        for obj in gc.get_objects():
            if _has_own_storage(obj, self.count_fake):
                self._add(obj)
        self._update_peak()
        return super().__enter__()

    def _add(self, tensor: Any) -> None:
        if not _has_own_storage(tensor, self.count_fake) or tensor.device.type == "meta":
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
