"""The measured run: untimed warm-up steps (the last one measures memory), then timed steps.

The training step is deliberately plain (forward, backward, optimizer step) so
that what is timed is what a user's training loop does, and nothing else.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from autotune.config import ABORT_CHECK_STEPS, WARMUP_ABORT_SLACK, RankMemory, TrialRequest
from autotune.worker.fsdp import gradient_sync, make_grad_scaler
from autotune.stats import relative_median_ci95
from autotune.worker.measure import LiveStorageTracker, add_run_figures, cap_allocator, cap_in_force, \
    outside_allocator
from autotune.worker.runtime import Rank, synchronize
from autotune.worker.step_recipe import StepRecipe, batch_device


# Timing stops on convergence no earlier than this many steps: fewer give no
# usable spread.
MIN_TIMED_STEPS = 3


def clip_gradients(model: nn.Module, max_norm: float) -> None:
    """Clip the gradients' global norm, as a user's loop does under FSDP: FSDP1's own method reduces the norm
    over every rank's shards; FSDP2's gradients are DTensors, whose norm torch's utility reduces."""
    clip = getattr(model, "clip_grad_norm_", None)
    if clip is not None:
        clip(max_norm)
    else:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)


def accumulate(model: nn.Module, recipe: StepRecipe, batch: Any, micro_batches: int, scaler) -> torch.Tensor:
    """Forward and backward over ``micro_batches`` micro batches, gradients synced
    across ranks on the last one only; returns the mean loss."""
    total = torch.zeros((), device=batch_device(batch))
    for i in range(micro_batches):
        with gradient_sync(model, enabled=i == micro_batches - 1):
            loss = recipe.loss(model, batch) / micro_batches
            (loss if scaler is None else scaler.scale(loss)).backward()
        total += loss.detach()
    return total


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, recipe: StepRecipe, batch: Any, scaler,
               micro_batches: int = 1) -> torch.Tensor:
    """One optimizer step: the training step of a user's loop, and nothing else."""
    loss = accumulate(model, recipe, batch, micro_batches, scaler)
    if recipe.clip_grad_norm is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)
        clip_gradients(model, recipe.clip_grad_norm)
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss


class Trainer:
    """The trial's training loop, one optimizer step at a time.

    fp16's loss scaling skips the optimizer step when a gradient overflowed
    and halves the scale: such a step does less work than a real one, so
    :meth:`step` says whether the optimizer really stepped (the scale did not
    fall), and skipped steps are neither timed nor used to measure memory.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, recipe: StepRecipe, batch: Any, scaler,
                 micro_batches: int = 1) -> None:
        self.model, self.optimizer, self.recipe, self.batch, self.scaler = model, optimizer, recipe, batch, scaler
        self.micro_batches = micro_batches
        self._scale = scaler.get_scale() if scaler is not None else None
        self.loss: torch.Tensor | None = None

    def step(self) -> bool:
        self.loss = train_step(self.model, self.optimizer, self.recipe, self.batch, self.scaler, self.micro_batches)
        if self.scaler is None:
            return True
        scale = self.scaler.get_scale()  # a host read: the step has finished
        stepped = scale >= self._scale
        self._scale = scale
        return stepped

    def last_loss(self) -> float:
        """The last step's mean loss (a host read)."""
        assert self.loss is not None, "no step has run"
        return float(self.loss.item())


@dataclass
class Measurement:
    step_times: list[float] = field(default_factory=list)
    loss_first: float | None = None
    loss_last: float | None = None
    aborted_tokens_per_s: float | None = None
    memory: RankMemory | None = None
    # Steps fp16's loss scaling skipped, warm-up and timing together.
    skipped_steps: int = 0
    phases: dict[str, float] = field(default_factory=dict)


# fp16 warm-up goes on, past --warmup-steps, until the loss scale has settled
# (a step that was not skipped); beyond this many extra steps the trial fails.
MAX_SCALE_SETTLE_STEPS = 16


def _max_across_ranks(value: float, device: torch.device) -> float:
    # The job is as slow as its slowest rank.
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure(model: nn.Module, request: TrialRequest, recipe: StepRecipe, rank: Rank) -> Measurement:
    """The trial's schedule: untimed warm-up steps, one memory step, then timed steps
    (see :func:`time_steps`). A hopeless first step ends it early. A shallow copy
    measures its memory too: the driver extends the copies' peaks to full depth."""
    device, cfg = rank.device, request.fsdp
    optimizer = recipe.make_optimizer(model)
    batch = recipe.batch(cfg.micro_batch_size, device, request.seed + rank.rank)
    trainer = Trainer(model, optimizer, recipe, batch, make_grad_scaler(cfg.mixed_precision, device),
                      request.grad_accum_steps)
    result = Measurement()
    per_step = request.tokens_per_step(rank.world_size)

    start = time.perf_counter()
    hopeless = warm_up(trainer, request, rank, result, per_step)
    if not hopeless:
        result.memory = memory_step(trainer, rank, result)
    result.phases["warmup_s"] = time.perf_counter() - start
    if hopeless:
        return result

    def timed_step() -> tuple[float, bool]:
        start = time.perf_counter()
        stepped = trainer.step()
        synchronize(device)
        return _max_across_ranks(time.perf_counter() - start, device), stepped

    with holding_timing_lock(request.timing_lock, rank):
        dist.barrier()
        start = time.perf_counter()
        result.step_times, skipped, result.aborted_tokens_per_s = time_steps(
            timed_step, request.timed_steps, request.timing_ci, request.abort_below_tokens_per_s, per_step,
            request.timing_budget_s)
        result.skipped_steps += skipped
        result.loss_last = trainer.last_loss()
        if device.type == "cuda" and result.memory is not None:
            add_run_figures(result.memory, device)
        dist.barrier()
    result.phases["timed_s"] = time.perf_counter() - start
    return result


def warm_up(trainer: Trainer, request: TrialRequest, rank: Rank, result: Measurement, per_step: int) -> bool:
    """The untimed steps before the memory step (the first allocates optimizer
    state, and compilation lands in it); True when the first already shows the
    trial hopeless (its speed is then the trial's partial figure).

    A capped CUDA rank is capped again after the first step: that step grew
    the device memory outside the allocator (lazily loaded kernels, NCCL's
    channels connected on first use; 1.29 GiB after a step on an H200), and
    the cap must leave room for it, as a GPU of the budget's size would.
    """
    for i in range(request.warmup_steps - 1):
        start = time.perf_counter()
        result.skipped_steps += not trainer.step()
        if i > 0:
            continue
        result.loss_first = trainer.last_loss()
        synchronize(rank.device)
        result.phases["first_step_s"] = time.perf_counter() - start
        if cap_in_force() is not None and request.memory_budget_bytes is not None:
            cap_allocator(request.memory_budget_bytes, rank.device)
        if first_step_judges(rank.device, request) and request.abort_below_tokens_per_s is not None:
            first = per_step / _max_across_ranks(result.phases["first_step_s"], rank.device)
            if first < request.abort_below_tokens_per_s / WARMUP_ABORT_SLACK:
                result.aborted_tokens_per_s = first
                return True
    return False


def first_step_judges(device: torch.device, request: TrialRequest) -> bool:
    """Whether the first step's speed may end the trial as hopeless. Not on
    CUDA, whose first step pays for cuBLAS's set-up, lazy kernel loading,
    NCCL's connections and the allocator's first segments (8.3x a timed step
    on an H200, against the 1.5x that WARMUP_ABORT_SLACK allows for): there
    the first timed steps judge (:func:`time_steps`). Nor a compiled one,
    which compiles in it."""
    return request.abort_below_tokens_per_s is not None and not request.fsdp.compile and device.type != "cuda"


def memory_step(trainer: Trainer, rank: Rank, result: Measurement) -> RankMemory:
    """Peak memory over one real optimizer step: fp16's loss scaling may skip a
    few while its scale settles, and those are measured again."""
    for _ in range(MAX_SCALE_SETTLE_STEPS):
        memory, stepped = measure_memory_step(trainer.step, rank)
        if stepped:
            return memory
        result.skipped_steps += 1
    raise RuntimeError(f"fp16 loss scaling skipped every step of the warm-up, {MAX_SCALE_SETTLE_STEPS} more "
                       "included: the gradients overflow at every scale")


@contextlib.contextmanager
def holding_timing_lock(lock: str | None, rank: Rank) -> Iterator[None]:
    """Rank 0 holds the tuner's timing lock (shared) while steps are timed: the
    tuner's background estimates on these cores wait for it to end."""
    if lock is None or not rank.is_main:
        yield
        return
    from autotune.launch.locks import shared

    with shared(Path(lock)):
        yield


def time_steps(
    timed_step: Callable[[], tuple[float, bool]],
    timed_steps: int,
    timing_ci: float,
    abort_below_tokens_per_s: float | None,
    tokens_per_step: int,
    timing_budget_s: float | None = None,
) -> tuple[list[float], int, float | None]:
    """Time steps until the median is known, the trial is hopeless, or ``timed_steps``
    are done or ``timing_budget_s`` seconds of them have passed.

    ``timed_step()`` returns the step's seconds (the slowest rank's, so every
    rank decides alike) and whether the optimizer really stepped; a skipped
    step is not timed, and at most as many again are tried. Timing stops
    early when the median step time is known to within ``timing_ci`` (95%
    confidence, after MIN_TIMED_STEPS steps), when the steps timed so far add
    up to ``timing_budget_s`` (after MIN_TIMED_STEPS steps), or when, after ABORT_CHECK_STEPS
    steps, the speed is below ``abort_below_tokens_per_s`` (that partial
    figure is returned). Returns (step times, skipped steps, partial figure or None).
    """
    times: list[float] = []
    skipped = 0
    while len(times) < timed_steps and skipped < timed_steps:
        seconds, stepped = timed_step()
        if not stepped:
            skipped += 1
            continue
        times.append(seconds)
        n = len(times)
        if abort_below_tokens_per_s is not None and n == min(ABORT_CHECK_STEPS, timed_steps):
            partial = tokens_per_step / statistics.median(times)
            if partial < abort_below_tokens_per_s:
                return times, skipped, partial
        if n >= MIN_TIMED_STEPS and timing_ci and relative_median_ci95(times) <= timing_ci:
            break
        if n >= MIN_TIMED_STEPS and timing_budget_s is not None and sum(times) >= timing_budget_s:
            break
    if not times:
        raise RuntimeError(f"fp16 loss scaling skipped all {skipped} timed steps: "
                           "the gradients overflow at every scale")
    return times, skipped, None


def measure_memory_step(step: Callable[[], bool], rank: Rank) -> tuple[RankMemory, bool]:
    """Run one step; this rank's peak memory, and whether the optimizer stepped.

    On CUDA, ``peak_allocated`` is the step's peak of live tensors,
    ``peak_reserved`` the allocator's peak since the model was wrapped or, when
    capped, since the cap was last set (what an out-of-memory error is decided on), and ``outside_allocator`` the device
    memory no allocator statistic shows: the CUDA context and NCCL's buffers.
    """
    device = rank.device
    if device.type == "cuda":
        synchronize(device)
        run_reserved = torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        stepped = step()
        synchronize(device)
        return RankMemory(
            rank=rank.rank,
            peak_allocated=torch.cuda.max_memory_allocated(device),
            peak_reserved=max(run_reserved, torch.cuda.max_memory_reserved(device)),
            outside_allocator=outside_allocator(device),
        ), stepped
    with LiveStorageTracker() as tracker:
        stepped = step()
    return RankMemory(rank=rank.rank, tracked=tracker.peak_bytes), stepped
