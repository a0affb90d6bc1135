"""How a trial measures: step-time statistics and peak device memory.

On CUDA the caching allocator's own peaks are the truth. A CPU host has no
device memory, and process RSS mixes in the interpreter, libraries and freed
pages, so on CPU the peak is the largest total size of live tensor storages,
observed after every operator of one dedicated step
(:class:`~autotune.worker.live_storages.LiveStorageTracker`). The same tracker
counts fake tensors, which is how the estimator measures a step that never runs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist

from autotune.config import RankMemory
from autotune.worker.runtime import GroupUse
from autotune.worker.live_storages import LiveStorageTracker  # noqa: F401 - the CPU trial's memory measure

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


# The cap in force on this rank, for the record of a trial that fails under it.
_in_force: list[MemoryCap] = []


def cap_in_force() -> MemoryCap | None:
    return _in_force[-1] if _in_force else None


# Elements of the collectives that bring up NCCL's buffers: NCCL picks its
# protocol by message size (LL for small, LL128, Simple for large ones) and
# connects each on first use, so one of each size, fp32. The size is the
# whole message, the gathered tensor, whatever the group's size: NCCL's
# buffers do not grow with the ranks, and a warm-up sized by the world
# (8 Mi elements a rank) allocated 16 GiB a GPU at 512 ranks before any cap.
WARM_COLLECTIVE_NUMELS = (1024, 256 * 1024, 8 * 1024 * 1024)


def warm_outside_allocator(device: torch.device, groups: Iterable[GroupUse], dtypes: Iterable[torch.dtype]) -> None:
    """Bring up what lives outside the caching allocator before it is measured:
    cuBLAS's handles (a matmul in each dtype the trial computes in; their
    workspace comes from the allocator and stays there), and each group's
    NCCL communicator: a scalar all-reduce on a group that carries only
    barriers and scalars, and on one that carries FSDP's collectives an
    all-reduce, an all-gather and a reduce-scatter of each size they come
    in. The tensors go back to the allocator's cache, which is emptied."""
    for dtype in dtypes:
        a = torch.ones(256, 256, device=device, dtype=dtype)
        (a @ a).sum().item()
    for use in groups:
        if not use.bulk:
            dist.all_reduce(torch.ones(1, device=device), group=use.group)
            continue
        size = dist.get_world_size(use.group)
        for numel in WARM_COLLECTIVE_NUMELS:
            shard = torch.ones(max(1, numel // size), device=device)
            whole = torch.empty(shard.numel() * size, device=device)
            dist.all_reduce(whole, group=use.group)
            dist.all_gather_into_tensor(whole, shard, group=use.group)
            dist.reduce_scatter_tensor(shard, whole, group=use.group)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def cap_allocator(budget_bytes: int, device: torch.device) -> MemoryCap:
    """Cap this rank's caching allocator at ``budget_bytes`` (at most the device)
    less the device memory outside it, measured now, so that the trial runs as
    on a GPU of the budget's size.

    Past the cap the allocator frees its cached blocks and retries before it
    raises out of memory (``num_alloc_retries`` counts the retries): a
    configuration that trains under the cap fits, and its speed is what a
    user with such a GPU would see. Called again once the outside has grown
    (the first step loads kernels lazily, connects NCCL's channels), the cap
    drops by that growth, cached blocks above it are released, and the
    allocator's peaks start again, so the peak is the one under the cap.
    """
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    cap = allocator_cap(budget_bytes, total, free, reserved)
    torch.cuda.set_per_process_memory_fraction(cap.cap_bytes / total, device)
    if reserved > cap.cap_bytes:
        torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    _in_force.append(cap)
    return cap


def allocator_cap(budget_bytes: int, total: int, free: int, reserved: int) -> MemoryCap:
    """The cap for a rank's caching allocator: the budget, never more than the
    device, less the device memory in use outside the allocator (``total - free - reserved``)."""
    outside = max(0, total - free - reserved)
    cap = min(budget_bytes, total) - outside
    if cap <= 0:
        raise BudgetBelowOverheadError(
            f"out of memory: the budget of {budget_bytes} bytes does not cover the {outside} bytes this rank holds "
            "outside the caching allocator (CUDA context, NCCL buffers)")
    return MemoryCap(budget_bytes, outside, cap)


def outside_allocator(device: torch.device) -> int:
    """Device memory in use outside the caching allocator now (context, cuBLAS, NCCL)."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def add_run_figures(memory: RankMemory, device: torch.device) -> None:
    """What only the whole run shows, added to the memory step's figures: the
    allocator's pool can still grow after that step, and it may have retried at
    its cap (freed its cache to make room) any time since the model was built.

    The memory outside the allocator is the largest measured, at the memory
    step or at the end of the run, never the figure a cap left room for: a
    rank whose outside grew past that room after the cap was last set held
    more of the device than the budget, and its peak says so
    (``outside_growth`` is by how much the outside outgrew the cap's room)."""
    memory.peak_reserved = max(memory.peak_reserved or 0, torch.cuda.max_memory_reserved(device))
    memory.alloc_retries = int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
    outside = max(memory.outside_allocator or 0, outside_allocator(device))
    memory.outside_allocator = outside
    cap = cap_in_force()
    if cap is not None:
        memory.cap_bytes = cap.cap_bytes
        memory.outside_growth = max(0, outside - cap.outside_bytes)
