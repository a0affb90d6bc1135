"""What a training step needs to run under fake tensors: each piece works around one thing PyTorch cannot do
there, and says which (the collectives of torch < 2.11, peft's adapters, the fp16 grad scaler's read, an MoE's
grouped matmul, FSDP2's partial-reshard mesh), so that :mod:`autotune.worker.fake_step` runs the trial's own step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily

from autotune.config import LoraSpec
from autotune.worker.models import BuiltModel, apply_lora
from autotune.worker.step_recipe import StepRecipe
from autotune.worker.train import accumulate, clip_gradients, train_step


def fake_process_group(world_size: int) -> None:
    """PyTorch's ``fake`` process group of ``world_size`` ranks, this process as rank 0 (kept between estimates
    of the same world size)."""
    register_fake_collectives()
    if dist.is_initialized() and dist.get_world_size() == world_size:
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


def add_fake_adapters(built: BuiltModel, lora: LoraSpec) -> None:
    """LoRA's adapters on a fake-tensor model, as :func:`apply_lora` puts them on a trial's.

    peft moves each new adapter to its base layer's device with ``.to()``,
    which cannot swap a fake parameter (torch 2.13: "Couldn't swap
    Linear.weight"). So peft runs outside the fake mode, making its adapters
    on the meta device, and each gets fake storage of its shape here.
    """
    with unset_fake_temporarily():
        built.module, built.lora_targets = apply_lora(built.module, lora)
    for module in built.module.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                fake = torch.empty(param.shape, dtype=param.dtype, device="cpu")
                module.register_parameter(name, torch.nn.Parameter(fake, requires_grad=param.requires_grad))


def fake_train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, recipe: StepRecipe, batch: Any,
                    scaler, micro_batches: int = 1) -> None:
    """``train_step`` as a fake tensor can run it.

    The grad scaler's ``step`` and ``update`` read whether any gradient was
    inf (a data-dependent ``.item()``), which fake tensors cannot answer. The
    scaler's public pieces do the same work without that read: unscale (its
    inverse scale, the found-inf flag and their all-reduce are counted), the
    optimizer step a finite step takes, and the scale reset to a given value.
    """
    if scaler is None:
        train_step(model, optimizer, recipe, batch, scaler, micro_batches)
        return
    accumulate(model, recipe, batch, micro_batches, scaler)
    scaler.unscale_(optimizer)
    if recipe.clip_grad_norm is not None:
        clip_gradients(model, recipe.clip_grad_norm)
    optimizer.step()
    scaler.update(new_scale=FP16_SCALE)
    optimizer.zero_grad(set_to_none=True)


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state as its first step creates it (a step count, two moments per
    parameter), without that step: a fake step costs a second or two, and a
    first training step gave the same peak as this, to within 136 bytes, over
    FSDP1 and FSDP2, every sharding, checkpointing and precision, with and
    without gradient accumulation. Another optimizer (a workload's own) takes one
    step on zero gradients, which makes whatever state it keeps."""
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam) or any(
            g.get("amsgrad") for g in optimizer.param_groups):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                optimizer.state[p] = {"step": torch.tensor(0.0),
                                      "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                      "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


@contextlib.contextmanager
def grouped_mm_in_any_dtype() -> Iterator[None]:
    """Mixture-of-experts blocks through transformers' own grouped matmul where
    fake tensors cannot run torch's in the trial's dtype.

    transformers runs a block's experts with ``torch._grouped_mm`` on CPU in
    any dtype, but its fake-tensor kernel takes bf16 only ("Expected inputs of
    BF16 type but got mat_a.dtype=torch.float32", torch 2.13): every fp32 and
    fp16 estimate of a Mixtral failed. transformers' fallback op has a fake
    kernel for every dtype, and like the grouped matmul it makes one output and
    saves its two inputs for backward: the same memory.
    """
    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return
    def in_bf16_only(input: Any, weight: Any, offs: Any) -> bool:
        return weight.dtype == torch.bfloat16 and original(input, weight, offs)

    moe._can_use_grouped_mm = in_bf16_only
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


@contextlib.contextmanager
def real_post_forward_meshes() -> Iterator[None]:
    """FSDP2's partial resharding (``reshard_after_forward`` as an int) built outside fake mode.

    ``fully_shard`` builds the post-forward device mesh from a view of the mesh's rank tensor and reads
    its ranks back: under fake mode the view is a fake tensor and the read is data-dependent
    ("DataDependentOutputException: aten._local_scalar_dense", torch 2.13). The mesh is real metadata,
    as the trial's mesh is, so it is built with real tensors.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

    name = "_get_post_forward_mesh_info"
    original = getattr(_fsdp_init, name)

    def built_for_real(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    patched = [m for m in (_fsdp_init, _fully_shard) if getattr(m, name, None) is original]
    for module in patched:
        setattr(module, name, built_for_real)
    try:
        yield
    finally:
        for module in patched:
            setattr(module, name, original)


# Any value will do: the scale is one float, whatever it holds.
FP16_SCALE = 2.0**16


# c10d's collectives as a fake tensor runs them: each returns its output and a finished work.
_COLLECTIVES = {
    "broadcast_": True, "allreduce_": True, "allgather_": True, "_allgather_base_": True, "reduce_scatter_": True,
    "_reduce_scatter_base_": True, "scatter_": True, "alltoall_": True, "reduce_": False, "gather_": False,
    "alltoall_base_": False, "barrier": False, "send": False, "recv_": False, "recv_any_source_": False,
}
_fake_collectives: list[Any] = []


def register_fake_collectives() -> None:
    """Fake kernels for c10d's collectives where torch has none of its own.

    torch 2.11 registers them (``torch.distributed._meta_registrations``);
    before it, a fake step fails on its first collective
    (``UnsupportedOperatorException: c10d._allgather_base_.default``, torch
    2.6 and 2.9). Each kernel returns the collective's first argument and a
    work that is already done, as 2.11's do: no data moves in a fake step.
    """
    import importlib.util

    if _fake_collectives:
        return
    if importlib.util.find_spec("torch.distributed._meta_registrations") is not None:
        _fake_collectives.append(importlib.import_module("torch.distributed._meta_registrations"))
        return
    from torch._C import _distributed_c10d as c10d

    def done() -> Any:
        if hasattr(c10d, "FakeWork"):
            return c10d.FakeWork().boxed()
        # torch < 2.9 has no FakeWork: a work made from a future that has its result.
        future: torch.futures.Future[None] = torch.futures.Future()
        future.set_result(None)
        return c10d._create_work_from_future(future).boxed()  # type: ignore[attr-defined]  # torch < 2.9 only

    def kernel(returns_first: bool) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            return (args[0], done()) if returns_first else done()
        return run

    library = torch.library.Library("c10d", "IMPL")
    for name, returns_first in _COLLECTIVES.items():
        try:
            library.impl(name, kernel(returns_first), "Meta")
        except RuntimeError:  # an op this version does not have
            continue
    _fake_collectives.append(library)
