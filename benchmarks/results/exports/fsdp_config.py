# Exported by autotune from study 'llama-tiny-w2-s256-20GB', trial 13:
# 13,517 tokens/s, peak 0.0877 GiB per rank on 2 x cpu, model llama-tiny, seq len 256.
"""Apply the tuned FSDP configuration to a model. Needs torch only, not autotune.

    import torch.distributed as dist
    from fsdp_config import apply_fsdp
    dist.init_process_group(...)
    model = apply_fsdp(model)          # then build the optimizer from model.parameters()
"""

import functools
import json

import torch
from torch import nn

CONFIG = json.loads("""{
    "activation_checkpointing": "none",
    "auto_wrap_policy": "none",
    "backward_prefetch": "none",
    "cpu_offload": false,
    "forward_prefetch": false,
    "fsdp_version": 1,
    "limit_all_gathers": true,
    "micro_batch_size": 4,
    "min_num_params": 100000000,
    "mixed_precision": "bf16",
    "reshard_after_forward": false,
    "sharding_strategy": "SHARD_GRAD_OP",
    "transformer_layer_cls": [
        "LlamaDecoderLayer"
    ]
}""")

_DTYPES = {
    "fp32": None,
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16_fp32_reduce": (torch.bfloat16, torch.float32),
    "fp16": (torch.float16, torch.float16),
}


def _blocks(model: nn.Module, names) -> list:
    return [m for m in model.modules() if type(m).__name__ in names]


def apply_activation_checkpointing(model: nn.Module, blocks: list) -> list:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, CheckpointWrapper, apply_activation_checkpointing as wrap, checkpoint_wrapper)

    mode = CONFIG["activation_checkpointing"]
    if mode == "none":
        return blocks
    chosen = {id(b) for i, b in enumerate(blocks) if mode == "full" or i % 2 == 0}
    wrap(model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
         check_fn=lambda m: id(m) in chosen)
    wrapper_of = {id(m._checkpoint_wrapped_module): m for m in model.modules() if isinstance(m, CheckpointWrapper)}
    return [wrapper_of.get(id(b), b) for b in blocks]


def _mesh(device_type: str, nnodes: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    strategy = CONFIG["sharding_strategy"]
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return init_device_mesh(device_type, (world,))
    shape = (world, 1) if strategy == "NO_SHARD" else (nnodes, world // nnodes)
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))


def apply_fsdp(model: nn.Module, device: torch.device | None = None, nnodes: int = 1) -> nn.Module:
    """Checkpoint, then shard ``model`` as tuned; returns the model to train."""
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    blocks = apply_activation_checkpointing(model, _blocks(model, CONFIG["transformer_layer_cls"]))
    dtypes = _DTYPES[CONFIG["mixed_precision"]]
    mesh = _mesh(device.type, nnodes)
    if CONFIG["fsdp_version"] == 1:
        from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload, FullyShardedDataParallel, MixedPrecision,
                                            ShardingStrategy)
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy, size_based_auto_wrap_policy

        ids = {id(b) for b in blocks}
        policy = {
            "transformer_layer": functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in ids),
            "size_based": functools.partial(size_based_auto_wrap_policy, min_num_params=CONFIG["min_num_params"]),
            "none": None,
        }[CONFIG["auto_wrap_policy"]]
        prefetch = CONFIG["backward_prefetch"]
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=policy,
            sharding_strategy=ShardingStrategy[CONFIG["sharding_strategy"]],
            mixed_precision=None if dtypes is None else MixedPrecision(dtypes[0], dtypes[1], dtypes[0]),
            cpu_offload=CPUOffload(offload_params=CONFIG["cpu_offload"]),
            backward_prefetch=None if prefetch == "none" else BackwardPrefetch[prefetch],
            forward_prefetch=CONFIG["forward_prefetch"],
            limit_all_gathers=CONFIG["limit_all_gathers"],
            use_orig_params=True,
            device_id=device,
            device_mesh=mesh if mesh.ndim == 2 and CONFIG["sharding_strategy"].startswith("HYBRID") else None,
        )
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=CONFIG["reshard_after_forward"],
        mp_policy=MixedPrecisionPolicy() if dtypes is None else MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1]),
        offload_policy=CPUOffloadPolicy() if CONFIG["cpu_offload"] else OffloadPolicy(),
    )
    if CONFIG["auto_wrap_policy"] == "transformer_layer":
        units = blocks
    elif CONFIG["auto_wrap_policy"] == "size_based":
        units = _size_based_units(model, CONFIG["min_num_params"])
    else:
        units = []
    if not CONFIG["cpu_offload"]:
        model.to(device)
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    for i, unit in enumerate(units):
        if CONFIG["forward_prefetch"] and i + 1 < len(units):
            unit.set_modules_to_forward_prefetch([units[i + 1]])
        if i > 0:
            unit.set_modules_to_backward_prefetch([units[i - 1]])
    return model


def _size_based_units(model: nn.Module, min_num_params: int) -> list:
    units = []

    def visit(module):
        remaining = sum(p.numel() for p in module.parameters(recurse=False)) + sum(visit(c) for c in module.children())
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            return remaining
        if module is not model and remaining >= min_num_params:
            units.append(module)
            return 0
        return remaining

    visit(model)
    return units


def make_grad_scaler():
    """fp16 needs loss scaling that agrees across ranks; None for other precisions."""
    if CONFIG["mixed_precision"] != "fp16":
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler()
