"""The measured run: untimed warm-up steps (the last one measures memory), then timed steps.

The training step is deliberately plain (forward, backward, optimizer step) so
that what is timed is what a user's training loop does, and nothing else.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from autotune.config import ABORT_CHECK_STEPS, RankMemory, TrialRequest
from autotune.worker.fsdp import make_grad_scaler
from autotune.worker.measure import LiveStorageTracker, relative_ci95
from autotune.worker.runtime import Rank, synchronize


# Timing stops on convergence no earlier than this many steps: fewer give no
# usable spread.
MIN_TIMED_STEPS = 3


def make_batch(vocab_size: int, micro_batch_size: int, seq_len: int, device: torch.device, seed: int) -> torch.Tensor:
    """Synthetic tokens: throughput and memory do not depend on what the tokens say."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (micro_batch_size, seq_len), generator=generator).to(device)


def forward_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The language-modelling loss, from a transformers output or a bare loss."""
    output = model(input_ids=tokens, labels=tokens)
    return output.loss if hasattr(output, "loss") else output


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, scaler) -> torch.Tensor:
    loss = forward_loss(model, tokens)
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
    """Untimed steps (the last of them measures peak memory), then timed steps.

    Timing stops early in two cases, decided on the same cross-rank step times
    so every rank stops together: the mean step time is known to within
    ``request.timing_ci`` (95% confidence, after MIN_TIMED_STEPS), or, after
    ABORT_CHECK_STEPS steps, the trial is too slow to matter (its partial
    figure is kept).
    """
    device = rank.device
    cfg = request.fsdp
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = make_grad_scaler(cfg.mixed_precision, device)
    tokens = make_batch(vocab_size, cfg.micro_batch_size, request.seq_len, device, request.seed + rank.rank)
    tokens_per_step = cfg.micro_batch_size * request.seq_len * rank.world_size
    result = Measurement()

    def step() -> torch.Tensor:
        return train_step(model, optimizer, tokens, scaler)

    phase_start = time.perf_counter()
    # The first step allocates optimizer state, so memory is measured on a
    # later one; it is untimed anyway, and so serves as a warm-up step too.
    for _ in range(request.warmup_steps - 1):
        loss = step()
        if result.loss_first is None:
            result.loss_first = float(loss.item())
    result.memory = measure_memory_step(step, rank)
    result.phases["warmup_s"] = time.perf_counter() - phase_start

    dist.barrier()
    phase_start = time.perf_counter()
    for _ in range(request.timed_steps):
        start = time.perf_counter()
        loss = step()
        synchronize(device)
        result.step_times.append(_max_across_ranks(time.perf_counter() - start, device))
        n = len(result.step_times)
        if request.abort_below_tokens_per_s is not None and n == min(ABORT_CHECK_STEPS, request.timed_steps):
            estimate = tokens_per_step / statistics.median(result.step_times)
            if estimate < request.abort_below_tokens_per_s:
                result.aborted_tokens_per_s = estimate
                break
        if request.timing_ci and n >= MIN_TIMED_STEPS and relative_ci95(result.step_times) <= request.timing_ci:
            break
    result.loss_last = float(loss.item())
    if device.type == "cuda":
        # The allocator's pool can still grow after the memory step.
        result.memory.peak_reserved = max(result.memory.peak_reserved, torch.cuda.max_memory_reserved(device))
    dist.barrier()
    result.phases["timed_s"] = time.perf_counter() - phase_start
    return result


def measure_memory_step(step, rank: Rank) -> RankMemory:
    """Run one step and report this rank's peak memory.

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
