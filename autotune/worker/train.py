"""The measured run: warm-up steps, timed steps, then one memory step.

The training step is deliberately plain (forward, backward, optimizer step) so
that what is timed is what a user's training loop does, and nothing else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from autotune.config import RankMemory, TrialRequest
from autotune.worker.measure import LiveStorageTracker
from autotune.worker.runtime import Rank, synchronize


def make_batch(vocab_size: int, micro_batch_size: int, seq_len: int, device: torch.device, seed: int) -> torch.Tensor:
    """Synthetic tokens: throughput and memory do not depend on what the tokens say."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (micro_batch_size, seq_len), generator=generator).to(device)


def make_grad_scaler(mixed_precision: str, device: torch.device):
    """fp16 gradients underflow without loss scaling; the sharded scaler agrees on
    inf/nan across ranks, so every rank skips the same steps."""
    if mixed_precision != "fp16":
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device.type)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, scaler) -> torch.Tensor:
    output = model(input_ids=tokens, labels=tokens)
    loss = output.loss if hasattr(output, "loss") else output
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@dataclass
class Measurement:
    step_times: list[float] = field(default_factory=list)
    loss_first: float | None = None
    loss_last: float | None = None
    aborted_tokens_per_s: float | None = None
    memory: RankMemory | None = None
    phases: dict[str, float] = field(default_factory=dict)


def _max_across_ranks(value: float, device: torch.device) -> float:
    # The job is as slow as its slowest rank.
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure(model: nn.Module, request: TrialRequest, vocab_size: int, rank: Rank) -> Measurement:
    device = rank.device
    cfg = request.fsdp
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = make_grad_scaler(cfg.mixed_precision, device)
    tokens = make_batch(vocab_size, cfg.micro_batch_size, request.seq_len, device, request.seed + rank.rank)
    tokens_per_step = cfg.micro_batch_size * request.seq_len * rank.world_size
    result = Measurement()

    def timed_step() -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        loss = train_step(model, optimizer, tokens, scaler)
        synchronize(device)
        return time.perf_counter() - start, loss

    phase_start = time.perf_counter()
    last_warmup = 0.0
    for i in range(request.warmup_steps):
        last_warmup, loss = timed_step()
        if i == 0:
            result.loss_first = float(loss.item())
    result.phases["warmup_s"] = time.perf_counter() - phase_start

    if request.abort_below_tokens_per_s is not None:
        estimate = tokens_per_step / _max_across_ranks(last_warmup, device)
        if estimate < request.abort_below_tokens_per_s:
            result.aborted_tokens_per_s = estimate
            return result

    dist.barrier()
    phase_start = time.perf_counter()
    for _ in range(request.timed_steps):
        seconds, loss = timed_step()
        result.step_times.append(seconds)
    result.loss_last = float(loss.item())
    dist.barrier()
    result.phases["timed_s"] = time.perf_counter() - phase_start

    phase_start = time.perf_counter()
    result.memory = measure_memory_step(lambda: train_step(model, optimizer, tokens, scaler), rank)
    result.phases["memory_step_s"] = time.perf_counter() - phase_start
    return result


def measure_memory_step(step, rank: Rank) -> RankMemory:
    """Run one more step on its own and report this rank's peak memory.

    On CUDA, ``peak_allocated`` is the step's peak of live tensors and
    ``peak_reserved`` the allocator's peak over the whole run, which is what an
    out-of-memory error is decided on.
    """
    device = rank.device
    if device.type == "cuda":
        synchronize(device)
        run_reserved = torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        synchronize(device)
        return RankMemory(
            rank=rank.rank,
            peak_allocated=torch.cuda.max_memory_allocated(device),
            peak_reserved=max(run_reserved, torch.cuda.max_memory_reserved(device)),
        )
    with LiveStorageTracker() as tracker:
        step()
    return RankMemory(rank=rank.rank, tracked=tracker.peak_bytes)
