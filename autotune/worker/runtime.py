"""The process side of a rank: choosing its device and joining the process group."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Rank:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def select_device(requested: str, local_rank: int) -> torch.device:
    """CUDA when asked for or, with "auto", when a GPU is visible; otherwise CPU."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda was requested but torch sees no CUDA device")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(requested_device: str) -> Rank:
    """Join the torchrun job: NCCL on CUDA, gloo on CPU."""
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        # OpenMP reads this variable when torch loads; a rank forked from the
        # fork server loaded torch under the server's environment, not its own.
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    device = select_device(requested_device, local_rank)
    if device.type == "cuda":
        # Binding the device eagerly lets NCCL create its communicator now,
        # not inside the first timed collective. The gloo half carries
        # collectives on host tensors: with CPU offload, fp16's sharded grad
        # scaler all-reduces found-inf flags that live on the CPU.
        dist.init_process_group("cuda:nccl,cpu:gloo", device_id=device)
    else:
        dist.init_process_group("gloo")
    return Rank(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def groups_in_use(fsdp: Any, mesh: Any) -> list[Any]:
    """The process groups a trial's collectives run on: the default group (the
    timing's and the result's, and FSDP1's unless it shards hybrid) and the
    groups of the mesh dimensions FSDP2 or hybrid FSDP1 shards and replicates
    over. Each once, and none of one rank (nothing to connect). FSDP1 is
    handed the mesh only when hybrid (autotune.worker.fsdp.apply_fsdp1): a
    group it never uses would count its NCCL buffers outside the allocator."""
    groups = [dist.group.WORLD]
    if fsdp.fsdp_version == 2 or fsdp.is_hybrid:
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            if mesh.size(dim) > 1 and all(group is not g for g in groups):
                groups.append(group)
    return groups


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
