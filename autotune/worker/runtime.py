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


@dataclass(frozen=True)
class GroupUse:
    """A process group a trial's collectives run on, and whether it carries
    FSDP's all-gathers, reduce-scatters and all-reduces (``bulk``) or only the
    barriers and scalars of the timing and the result."""

    group: Any
    bulk: bool


def groups_in_use(fsdp: Any, mesh: Any) -> list[GroupUse]:
    """The process groups a trial's collectives run on, each once, and none of
    one rank (nothing to connect): the default group, and the groups of the
    mesh dimensions FSDP2 or hybrid FSDP1 shards and replicates over. The
    default group carries FSDP's collectives only where FSDP1 shards without
    the mesh, or where a mesh group is the default group itself (a 1-D mesh
    over the world); on a 2-D mesh it carries scalars, and warming it at
    FSDP's sizes would count NCCL buffers it never fills outside the
    allocator. FSDP1 is handed the mesh only when hybrid
    (autotune.worker.fsdp.apply_fsdp1)."""
    world = dist.group.WORLD
    if not (fsdp.fsdp_version == 2 or fsdp.is_hybrid):
        return [GroupUse(world, bulk=True)]
    dims = [(mesh.get_group(dim), mesh.size(dim)) for dim in range(mesh.ndim)]
    uses = [GroupUse(world, bulk=any(group is world for group, _ in dims))]
    for group, size in dims:
        if size > 1 and all(group is not u.group for u in uses):
            uses.append(GroupUse(group, bulk=True))
    return uses


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
