"""Gather every rank's figures into the one :class:`TrialResult` rank 0 writes."""

from __future__ import annotations

import math
import os
import platform

import torch
import torch.distributed as dist

from autotune.config import Status, TrialRequest, TrialResult
from autotune.worker.measure import cap_in_force, step_time_stats
from autotune.worker.runtime import Rank
from autotune.worker.train import Measurement


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def build_result(
    request: TrialRequest, rank: Rank, measurement: Measurement, num_params: int, phases: dict[str, float],
    mesh_shape: tuple[int, ...] = (),
) -> TrialResult:
    """Collective: every rank must call it. Only rank 0's return value is complete."""
    gathered: list = [None] * rank.world_size
    # Step times are already the slowest rank's, step by step (see train.measure).
    dist.all_gather_object(gathered, measurement.memory)
    tokens_per_step = request.tokens_per_step(rank.world_size)
    import transformers

    result = TrialResult(
        status=Status.OK,
        tokens_per_step=tokens_per_step,
        loss_first=measurement.loss_first,
        loss_last=measurement.loss_last,
        world_size=rank.world_size,
        nnodes=request.nnodes,
        nproc_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", rank.world_size)),
        mesh_shape=list(mesh_shape),
        device=rank.device.type,
        device_name=_device_name(rank.device),
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        num_params=num_params,
        skipped_steps=measurement.skipped_steps,
        phases={k: round(v, 4) for k, v in phases.items()},
        allocator_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF") if rank.device.type == "cuda" else None,
    )
    cap = cap_in_force()
    result.memory_cap_bytes = cap.cap_bytes if cap is not None else None
    # A trial stopped in its warm-up never reached the memory step.
    result.rank_memory = list(gathered) if all(gathered) else []
    result.timed_steps = len(measurement.step_times)
    result.peak_memory_bytes = max(m.peak for m in result.rank_memory) if result.rank_memory else None
    result.memory_method = "cuda_caching_allocator" if rank.device.type == "cuda" else "live_tensor_storages"
    if measurement.aborted_tokens_per_s is not None:
        result.status = Status.ABORTED
        result.tokens_per_s = measurement.aborted_tokens_per_s
        return result

    stats = step_time_stats(measurement.step_times)
    result.tokens_per_s = tokens_per_step / stats["median"]
    result.step_time_median_s = stats["median"]
    result.step_time_p10_s = stats["p10"]
    result.step_time_p90_s = stats["p90"]
    result.step_time_cv = stats["cv"]
    # A slower step time bounds tokens/s from below.
    # (A step-time bound at or below zero, from a wide t-interval of very few steps, bounds nothing.)
    result.tokens_per_s_ci_low = tokens_per_step / stats["ci_high"] if 0 < stats["ci_high"] < float("inf") else None
    result.tokens_per_s_ci_high = tokens_per_step / stats["ci_low"] if stats["ci_low"] > 0 else None
    for loss in (result.loss_first, result.loss_last):
        if loss is None or not math.isfinite(loss):
            result.status = Status.CRASH
            result.error = f"loss is not finite (first {result.loss_first}, last {result.loss_last})"
    return result
