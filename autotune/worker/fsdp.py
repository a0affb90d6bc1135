"""Apply one :class:`FsdpConfig` to a model: activation checkpointing, then FSDP.

The order is fixed, as in torchtitan's ``parallelize``: checkpoint wrappers go on
first so that each FSDP unit is the (possibly checkpointed) block, and FSDP's
all-gathers are re-issued inside the recomputation. Each ``apply_*`` step takes
explicit arguments and can be read on its own.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autotune.config import FsdpConfig
from autotune.worker.models import BuiltModel, init_module_weights, materialize

# FsdpConfig.mixed_precision -> (param dtype, gradient reduce dtype); fp32 is None.
PRECISION_DTYPES: dict[str, tuple[torch.dtype, torch.dtype] | None] = {
    "fp32": None,
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16_fp32_reduce": (torch.bfloat16, torch.float32),
    "fp16": (torch.float16, torch.float16),
}


def parallelize(built: BuiltModel, cfg: FsdpConfig, device: torch.device, mesh: DeviceMesh) -> nn.Module:
    """Return the FSDP-wrapped, initialized model for ``cfg`` over ``mesh`` (see :func:`build_mesh`)."""
    blocks = apply_activation_checkpointing(built.module, built.layers, cfg.activation_checkpointing)
    if cfg.fsdp_version == 1:
        return apply_fsdp1(built.module, blocks, cfg, device, mesh)
    apply_fsdp2(built.module, blocks, cfg, mesh)
    materialize(built.module, torch.device("cpu") if cfg.cpu_offload else device)
    return built.module


def apply_activation_checkpointing(model: nn.Module, layers: list[nn.Module], mode: str) -> list[nn.Module]:
    """Wrap the chosen layers in non-reentrant checkpoint wrappers.

    ``full`` checkpoints every layer, ``every_other_layer`` the even-numbered
    ones (half the recompute for roughly half the saving). Returns the blocks in
    forward order, each either the layer or its wrapper: the units FSDP wraps.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
        apply_activation_checkpointing as wrap_layers,
        checkpoint_wrapper,
    )

    if mode == "none":
        return list(layers)
    if mode == "full":
        chosen = {id(layer) for layer in layers}
    elif mode == "every_other_layer":
        chosen = {id(layer) for i, layer in enumerate(layers) if i % 2 == 0}
    else:
        raise ValueError(f"activation_checkpointing={mode!r}; expected none, full or every_other_layer")
    wrap_layers(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: id(m) in chosen,
    )
    wrapper_of = {
        id(m._checkpoint_wrapped_module): m for m in model.modules() if isinstance(m, CheckpointWrapper)
    }
    return [wrapper_of.get(id(layer), layer) for layer in layers]


def build_mesh(device_type: str, strategy: str, world_size: int, nnodes: int) -> DeviceMesh:
    """The data-parallel mesh: 1-D for plain sharding, 2-D (replicate, shard) otherwise.

    Hybrid strategies shard within a node and replicate across nodes. NO_SHARD
    is the degenerate 2-D mesh whose shard groups have one rank, which is how
    FSDP2 expresses DDP-style replication.
    """
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    if strategy == "NO_SHARD":
        shape = (world_size, 1)
    elif strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        if nnodes < 2 or world_size % nnodes:
            raise ValueError(
                f"sharding_strategy={strategy} needs several nodes and a world size they divide "
                f"(nnodes={nnodes}, world_size={world_size})"
            )
        shape = (nnodes, world_size // nnodes)
    else:
        raise ValueError(f"sharding_strategy={strategy!r} is not a known strategy")
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))


def apply_fsdp1(
    model: nn.Module, blocks: list[nn.Module], cfg: FsdpConfig, device: torch.device, mesh: DeviceMesh
) -> nn.Module:
    """Wrap with ``FullyShardedDataParallel``, materializing each unit's meta parameters."""
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        FullyShardedDataParallel,
        MixedPrecision,
        ShardingStrategy,
    )
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy, size_based_auto_wrap_policy

    if cfg.auto_wrap_policy == "transformer_layer":
        # Wrap exactly the blocks (the checkpoint wrapper where there is one),
        # so FSDP1 and FSDP2 shard the same units.
        unit_ids = {id(b) for b in blocks}
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in unit_ids)
    elif cfg.auto_wrap_policy == "size_based":
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=cfg.min_num_params)
    else:
        policy = None
    dtypes = PRECISION_DTYPES[cfg.mixed_precision]
    mixed = None if dtypes is None else MixedPrecision(param_dtype=dtypes[0], reduce_dtype=dtypes[1], buffer_dtype=dtypes[0])
    prefetch = None if cfg.backward_prefetch == "none" else BackwardPrefetch[cfg.backward_prefetch]
    init_device = torch.device("cpu") if cfg.cpu_offload else device

    def param_init_fn(module: nn.Module) -> None:
        # FSDP1 hands over one module at a time, before flattening it into a unit.
        module.to_empty(device=init_device, recurse=False)
        init_module_weights(module, owner=model, recurse=False)

    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=policy,
        sharding_strategy=ShardingStrategy[cfg.sharding_strategy],
        mixed_precision=mixed,
        cpu_offload=CPUOffload(offload_params=cfg.cpu_offload),
        backward_prefetch=prefetch,
        forward_prefetch=cfg.forward_prefetch,
        limit_all_gathers=cfg.limit_all_gathers,
        use_orig_params=True,
        device_id=device,
        device_mesh=mesh if mesh.ndim == 2 and cfg.is_hybrid else None,
        param_init_fn=param_init_fn,
        sync_module_states=False,
    )


def apply_fsdp2(model: nn.Module, blocks: list[nn.Module], cfg: FsdpConfig, mesh: DeviceMesh) -> None:
    """Shard with ``fully_shard``: the chosen units first, then the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    dtypes = PRECISION_DTYPES[cfg.mixed_precision]
    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=cfg.reshard_after_forward,
        mp_policy=MixedPrecisionPolicy() if dtypes is None else MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1]),
        offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy(),
    )
    if cfg.auto_wrap_policy == "transformer_layer":
        units = list(blocks)
    elif cfg.auto_wrap_policy == "size_based":
        units = _size_based_units(model, cfg.min_num_params)
    else:
        units = []
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    apply_fsdp2_prefetch(units, cfg.forward_prefetch, cfg.backward_prefetch)


def apply_fsdp2_prefetch(units: list[nn.Module], forward: bool, backward: str) -> None:
    """Explicit prefetching between consecutive units, one ahead.

    Forward prefetch issues unit i+1's all-gather when unit i starts. Backward
    prefetch of the previous unit matches FSDP2's default; setting it explicitly
    keeps it when units are not run in their registration order.
    """
    if len(units) < 2:
        return
    for i, unit in enumerate(units):
        if forward and i + 1 < len(units):
            unit.set_modules_to_forward_prefetch([units[i + 1]])
        if backward == "BACKWARD_PRE" and i > 0:
            unit.set_modules_to_backward_prefetch([units[i - 1]])


def _size_based_units(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """Post-order: shard a module once the parameters not yet in a unit below it
    reach ``min_num_params``, as FSDP1's ``size_based_auto_wrap_policy`` does."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        remaining = sum(p.numel() for p in module.parameters(recurse=False))
        remaining += sum(visit(child) for child in module.children())
        # Containers have no forward of their own to hook, so, as in FSDP1's
        # policy, they pass their parameters up to the module that runs them.
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            return remaining
        if module is not model and remaining >= min_num_params:
            units.append(module)
            return 0
        return remaining

    visit(model)
    return units
