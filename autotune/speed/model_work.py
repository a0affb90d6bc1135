"""A step's work by part of the model, from the fake step's counts: one block's forward, backward and
recomputation, what lies outside the blocks, and the optimizer step; asked for at any micro batch, precision,
checkpointing or compilation.

The fake step counts the work of the configuration it ran (:class:`~autotune.config.step_work.StepWork`). A
study needs the work of configurations it never stepped, so the parts are kept apart and changed one rule at
a time (:meth:`ModelWork.at`):

- the micro batch: each matmul's token dimension, each attention's batch and the activations' bytes grow in
  proportion (:meth:`~autotune.config.step_work.Work.at_micro_batch`);
- the precision: matmuls and attention in the new compute dtype, activations in its width;
- checkpointing: a checkpointed block's recomputation is its forward (``full``), its forward less the matmuls
  and attention it keeps (``selective``), on every other block (``every_other_layer``), or nothing;
- torch.compile: inductor fuses a block's memory-bound operators (fewer bytes, far fewer kernels and host
  operators) and leaves its matmuls to the same libraries.

What a configuration's own fake step counted is used as it is; the rules are checked against fake steps of the
configurations they stand in for (tests/test_speed_work.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

from autotune.config.step_work import DTYPE_BYTES, RECOMPUTE, AttentionShape, MatmulShape, StepWork, Work

# The dtype a precision computes in.
COMPUTE_DTYPE = {"fp32": "fp32", "bf16": "bf16", "bf16_fp32_reduce": "bf16", "fp16": "fp16"}
# What torch.compile leaves of a block's memory-bound work: inductor fuses chains of elementwise operators and
# norms into one kernel each (torchtitan: +15.7% tokens/s for Llama 3.1 8B on 8 H100s, 5,762 -> 6,667).
COMPILED_BYTES = 0.5
COMPILED_KERNELS = 0.25
COMPILED_OPS = 0.1


def checkpointed_blocks(mode: str, depth: int) -> int:
    """Blocks a checkpointing mode recomputes in a model of ``depth`` blocks (every other: the even ones)."""
    if mode in ("full", "selective"):
        return depth
    return (depth + 1) // 2 if mode == "every_other_layer" else 0


@dataclass(frozen=True)
class ModelWork:
    """One micro batch's work on one rank, by part of the model (see the module)."""

    depth: int
    micro_batch_size: int
    seq_len: int
    dtype: str  # the compute dtype the work was counted in
    checkpointing: str  # the checkpointing mode it ran with
    block_forward: Work
    block_backward: Work
    # One checkpointed block's recomputation, as counted (None where the step checkpointed nothing).
    block_recompute: Work | None
    start_forward: Work  # before the first block: the embedding, FSDP's root pre-forward
    end_forward: Work  # after the last: norm, head, loss
    end_backward: Work
    start_backward: Work
    optimizer: Work
    optimizer_numel: int
    param_numel: int
    compiled: bool = False

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_len

    def recompute(self, mode: str) -> Work:
        """What one checkpointed block recomputes under ``mode``."""
        if mode == "none":
            return Work()
        if self.block_recompute is not None and mode == self.checkpointing:
            return self.block_recompute
        return self.block_forward.memory_bound() if mode == "selective" else self.block_forward

    def forward_flops(self) -> float:
        return self.depth * self.block_forward.flops() + self.start_forward.flops() + self.end_forward.flops()

    def model_flops(self) -> float:
        """A micro batch's model FLOPs on this rank: forward and backward, recomputation left out (MFU's)."""
        return (self.forward_flops() + self.depth * self.block_backward.flops() + self.end_backward.flops()
                + self.start_backward.flops())

    def at(self, micro_batch_size: int | None = None, precision: str | None = None, checkpointing: str | None = None,
           compiled: bool | None = None) -> ModelWork:
        """The same model's work under another micro batch, precision, checkpointing or compilation."""
        work = self
        if micro_batch_size is not None and micro_batch_size != self.micro_batch_size:
            new_tokens = micro_batch_size * self.seq_len
            work = work._map(lambda w: w.at_micro_batch(self.tokens, new_tokens), micro_batch_size=micro_batch_size)
        if precision is not None and COMPUTE_DTYPE[precision] != self.dtype:
            target = COMPUTE_DTYPE[precision]
            work = work._map(lambda w: in_dtype(w, self.dtype, target), dtype=target)
        if checkpointing is not None and checkpointing != self.checkpointing:
            derived = work.recompute(checkpointing) if checkpointing != "none" else None
            work = dataclasses.replace(work, checkpointing=checkpointing, block_recompute=derived)
        if compiled is not None and compiled != work.compiled:
            work = work._compiled() if compiled else work
        return work

    def _map(self, change, **fields) -> ModelWork:
        parts = {name: change(getattr(self, name)) for name in ("block_forward", "block_backward", "start_forward",
                                                                  "end_forward", "end_backward", "start_backward")}
        recompute = change(self.block_recompute) if self.block_recompute is not None else None
        return dataclasses.replace(self, **parts, block_recompute=recompute, **fields)

    def _compiled(self) -> ModelWork:
        def fuse(w: Work) -> Work:
            return dataclasses.replace(w, token_bytes=w.token_bytes * COMPILED_BYTES,
                                       fixed_bytes=w.fixed_bytes * COMPILED_BYTES,
                                       token_half_bytes=w.token_half_bytes * COMPILED_BYTES,
                                       fixed_half_bytes=w.fixed_half_bytes * COMPILED_BYTES,
                                       kernels=w.kernels * COMPILED_KERNELS, ops=w.ops * COMPILED_OPS)

        recompute = fuse(self.block_recompute) if self.block_recompute is not None else None
        return dataclasses.replace(self, block_forward=fuse(self.block_forward),
                                   block_backward=fuse(self.block_backward), block_recompute=recompute,
                                   compiled=True)


def in_dtype(work: Work, source: str, target: str) -> Work:
    """``work`` computed in ``target`` instead of ``source``: its matmuls and attention in the new dtype, its
    activations in the new width (parameters, their gradients and the optimizer state keep theirs)."""
    def moved(dtype: str) -> str:
        return target if dtype == source else dtype

    matmuls: dict[MatmulShape, float] = {}
    for s, n in work.matmuls.items():
        key = s._replace(dtype=moved(s.dtype))
        matmuls[key] = matmuls.get(key, 0) + n
    attention: dict[AttentionShape, float] = {}
    for a, n in work.attention.items():
        key_a = a._replace(dtype=moved(a.dtype))
        attention[key_a] = attention.get(key_a, 0) + n
    ratio = DTYPE_BYTES[target] / DTYPE_BYTES[source]
    half = DTYPE_BYTES[target] == 2
    return dataclasses.replace(work, matmuls=matmuls, attention=attention,
                               other_flops={moved(k): v for k, v in work.other_flops.items()},
                               token_bytes=work.token_bytes * ratio,
                               token_half_bytes=work.token_bytes * ratio if half else 0.0)


def _phase(step: StepWork, phase: str, region: str, recompute: bool = False) -> Work:
    return step.regions.get(f"{phase}/{region}" + (f"/{RECOMPUTE}" if recompute else ""), Work())


def _blocks_total(step: StepWork, phase: str, recompute: bool = False) -> Work:
    return _sum(_phase(step, phase, str(i), recompute) for i in range(step.depth))


def _sum(works: Iterable[Work]) -> Work:
    total = Work()
    for w in works:
        total = total + w
    return total


def _per_block(steps: list[StepWork], phase: str, recompute: bool = False, counted=lambda d: d) -> Work:
    """One block's work in ``phase``: the growth from the shallower copy to the deeper one per block (two
    copies), or the mean of the blocks between the first and the last (one)."""
    if len(steps) >= 2:
        low, high = steps[0], steps[-1]
        blocks = counted(high.depth) - counted(low.depth)
        if blocks > 0:
            return _blocks_total(high, phase, recompute).plus(_blocks_total(low, phase, recompute), -1).times(
                1 / blocks)
    step = steps[-1]
    middle = [i for i in range(1, step.depth - 1)] or list(range(step.depth))
    if recompute:
        middle = [i for i in middle if f"{phase}/{i}/{RECOMPUTE}" in step.regions] or middle
    works = [_phase(step, phase, str(i), recompute) for i in middle]
    return _sum(works).times(1 / max(1, len(works)))


def model_work(steps: list[StepWork], dtype: str, checkpointing: str, depth: int | None = None) -> ModelWork:
    """The parts of a model's step from the fake step of one configuration (one copy, or two shallow copies of a
    deep model whose depth is ``depth``): micro batch 0's forward and backward, and the optimizer step."""
    step = steps[-1]
    forward, backward = "forward0", "backward0"
    block_forward = _per_block(steps, forward)
    block_backward = _per_block(steps, backward)
    recomputed = any(k.startswith(backward) and k.endswith(RECOMPUTE) for k in step.regions)
    block_recompute = (_per_block(steps, backward, True, lambda d: checkpointed_blocks(checkpointing, d))
                       if recomputed else None)
    # What is not a block's: the step's whole forward (FSDP's root pre-forward in "setup" included) less its
    # blocks, split where it fell; the same for backward.
    start_forward = _phase(step, forward, "start") + _phase(step, "setup", "all")
    end_forward = step.total(forward + "/").plus(block_forward, -step.depth).plus(_phase(step, forward, "start"), -1)
    start_backward = _phase(step, backward, "start")
    backward_total = _sum(w for k, w in step.regions.items() if k.startswith(backward + "/")
                          and not k.endswith(RECOMPUTE))
    end_backward = backward_total.plus(block_backward, -step.depth).plus(start_backward, -1)
    return ModelWork(depth or step.depth, step.micro_batch_size, step.seq_len, COMPUTE_DTYPE.get(dtype, dtype),
                     checkpointing, block_forward, block_backward, block_recompute, start_forward, end_forward,
                     end_backward, start_backward, _phase(step, "optimizer", "all"), step.optimizer_numel,
                     step.param_numel)
