"""Collective latency and bandwidth among this host's ranks, as a trial's ranks would see them (part of the host
probe).

``nproc`` processes are forked, each pinned to its share of the cores (a CPU host) or given its GPU, join one
process group (gloo on CPU, NCCL on CUDA) over a file store, and time an all-gather, a reduce-scatter and an
all-reduce at three sizes (the median of five, after one untimed). The parent must not have run a
tensor operator or touched CUDA yet: OpenMP's thread pool and a CUDA context do not survive a fork. Links
between nodes cannot be measured from one host: the profile takes those from a named profile or a flag.
"""

from __future__ import annotations

import json
import os
import select
import signal
import statistics
import tempfile
import time
from typing import Any

from autotune.launch.process_life import die_with_parent

# Bytes per rank of the sizes timed: from where latency dominates to where bandwidth does.
SIZES = {"cpu": (64 << 10, 1 << 20, 8 << 20), "cuda": (1 << 20, 16 << 20, 256 << 20)}
# Timings of each size, of which the median is kept: gloo on a busy host varies by a factor of ten.
SAMPLES = 5
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def measure_links(nproc: int, device_type: str, timeout_s: float = 60.0) -> dict[str, Any] | None:
    """``{"group": nproc, "points": {kind: [[bytes, seconds], ...]}, "seconds"}``, or None with one rank, with
    more ranks than this host has devices (cores on CPU), or where the ranks cannot be forked (a CUDA context
    already made here) or do not answer in ``timeout_s``."""
    if nproc < 2:
        return None
    # More ranks than cores measure the scheduler, not the links, and forking 512 of them took 107 s before the
    # driver refused --nproc 512 on a 2-core host.
    if device_type == "cpu" and nproc > len(os.sched_getaffinity(0)):
        return None
    import torch

    if device_type == "cuda" and (torch.cuda.is_initialized() or torch.cuda.device_count() < nproc):
        return None
    start = time.perf_counter()
    store = os.path.join(tempfile.mkdtemp(prefix="autotune-links-"), "store")
    read_fd, write_fd = os.pipe()
    cores = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cores) // nproc)
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            # A probe killed mid-measurement (the driver stopped, a timeout) must not leave its ranks waiting on
            # each other: they did, for the process group's 30-minute timeout, 390 of them after a killed
            # 'run --nproc 512'.
            die_with_parent()
            os.close(read_fd)
            code = 0
            try:
                answer = _rank_main(rank, nproc, device_type, store, cores[rank * per_rank:(rank + 1) * per_rank],
                                    timeout_s)
                if rank == 0:
                    os.write(write_fd, json.dumps(answer).encode())
            except BaseException:  # noqa: BLE001 - the parent sees no answer and goes on without one
                code = 1
            os._exit(code)
        pids.append(pid)
    os.close(write_fd)
    data = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([read_fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(read_fd, 1 << 16)
        if not chunk:
            break
        data += chunk
    os.close(read_fd)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    if not data:
        return None
    return {"group": nproc, "device_type": device_type, "points": json.loads(data),
            "seconds": round(time.perf_counter() - start, 3)}


def _rank_main(rank: int, nproc: int, device_type: str, store_path: str, cores: list[int],
               timeout_s: float) -> dict[str, Any]:
    import datetime
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    if device_type == "cpu" and cores:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(store_path, nproc)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=store, rank=rank, world_size=nproc,
                            timeout=datetime.timedelta(seconds=timeout_s))
    points: dict[str, list[list[float]]] = {}
    try:
        for kind in KINDS:
            points[kind] = [[float(size), _time(kind, size, nproc, device)] for size in SIZES[device_type]]
    finally:
        dist.destroy_process_group()
    return points


def _time(kind: str, nbytes: int, nproc: int, device: Any) -> float:
    """The median seconds of :data:`SAMPLES` collectives of ``nbytes`` per rank (the slowest rank's, after a
    barrier)."""
    import torch
    import torch.distributed as dist

    numel = max(nproc, nbytes // 4 // nproc * nproc)
    full = torch.zeros(numel, device=device)
    shard = torch.zeros(numel // nproc, device=device)

    def run() -> None:
        if kind == "all_gather":
            dist.all_gather_into_tensor(full, shard)
        elif kind == "reduce_scatter":
            dist.reduce_scatter_tensor(shard, full)
        else:
            dist.all_reduce(full)

    run()
    samples = []
    for _ in range(SAMPLES):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        samples.append(float(elapsed.item()))
    return statistics.median(samples)
