"""The best configuration in the formats other tools read: accelerate, transformers, torchtitan, Python.

Each renderer takes an ``autotune.fsdp-config/v1`` document and returns the
file's text and the notes on what the target cannot express. Nothing is
dropped silently: every note is written into the file (as a comment where the
format has them) and printed on stderr by ``autotune export``.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import yaml

from autotune.config import FsdpConfig

FORMATS = ("json", "accelerate", "hf", "torchtitan", "python")

_ACCELERATE_WRAP = {"transformer_layer": "TRANSFORMER_BASED_WRAP", "size_based": "SIZE_BASED_WRAP", "none": "NO_WRAP"}
_MIXED = {"fp32": "no", "bf16": "bf16", "bf16_fp32_reduce": "bf16", "fp16": "fp16"}


def _common_notes(cfg: FsdpConfig, target: str) -> list[str]:
    notes = []
    if cfg.activation_checkpointing == "every_other_layer":
        notes.append(f"activation_checkpointing=every_other_layer: {target} checkpoints every layer or none; "
                     "exported as every layer (more recompute, less memory than measured)")
    if cfg.mixed_precision == "bf16_fp32_reduce":
        notes.append(f"mixed_precision=bf16_fp32_reduce: {target} has no key for an fp32 gradient reduce; "
                     "exported as bf16 (set reduce_dtype=float32 in code to match the measurement)")
    return notes


def to_accelerate(doc: dict[str, Any]) -> tuple[str, list[str]]:
    cfg = FsdpConfig.from_dict(doc["fsdp"])
    notes = _common_notes(cfg, "accelerate")
    fsdp: dict[str, Any] = {
        "fsdp_version": cfg.fsdp_version,
        "fsdp_auto_wrap_policy": _ACCELERATE_WRAP[cfg.auto_wrap_policy],
        "fsdp_offload_params": cfg.cpu_offload,
        "fsdp_activation_checkpointing": cfg.activation_checkpointing != "none",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        # Load weights on rank 0 only and broadcast them: accelerate requires
        # the two together and refuses the broadcast on CPU hosts.
        "fsdp_cpu_ram_efficient_loading": doc["measured"].get("device") != "cpu",
        "fsdp_sync_module_states": doc["measured"].get("device") != "cpu",
    }
    if cfg.auto_wrap_policy == "transformer_layer":
        fsdp["fsdp_transformer_layer_cls_to_wrap"] = ",".join(cfg.transformer_layer_cls)
    if cfg.auto_wrap_policy == "size_based":
        fsdp["fsdp_min_num_params"] = cfg.min_num_params
    if cfg.fsdp_version == 1:
        fsdp["fsdp_sharding_strategy"] = cfg.sharding_strategy
        fsdp["fsdp_backward_prefetch"] = "NO_PREFETCH" if cfg.backward_prefetch == "none" else cfg.backward_prefetch
        fsdp["fsdp_forward_prefetch"] = cfg.forward_prefetch
        fsdp["fsdp_use_orig_params"] = True
        if not cfg.limit_all_gathers:
            notes.append("limit_all_gathers=false: accelerate's config file has no key for it (its default is true); "
                         "pass limit_all_gathers=False to FullyShardedDataParallelPlugin in code")
    else:
        fsdp["fsdp_reshard_after_forward"] = bool(cfg.reshard_after_forward)
        if cfg.sharding_strategy in ("NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
            notes.append(f"sharding_strategy={cfg.sharding_strategy} with FSDP2: accelerate's FSDP2 config shards "
                         "over one mesh dimension only; exported as reshard_after_forward, which is not the same")
        if cfg.forward_prefetch:
            notes.append("forward_prefetch=true with FSDP2: accelerate's FSDP2 config has no forward prefetch key; "
                         "dropped (call set_modules_to_forward_prefetch in code)")
    data = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "downcast_bf16": "no",
        "fsdp_config": fsdp,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": _MIXED[cfg.mixed_precision],
        "num_machines": 1,
        "num_processes": doc["measured"]["world_size"],
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": doc["measured"].get("device") == "cpu",
    }
    header = _comment_block("#", doc, notes, [f"Micro batch size per process: {cfg.micro_batch_size} (set it in your data loader)."])
    return header + yaml.safe_dump(data, sort_keys=True), notes


def to_hf(doc: dict[str, Any]) -> tuple[str, list[str]]:
    cfg = FsdpConfig.from_dict(doc["fsdp"])
    notes = _common_notes(cfg, "transformers")
    fsdp_config: dict[str, Any] = {
        "version": cfg.fsdp_version,
        "auto_wrap_policy": _ACCELERATE_WRAP[cfg.auto_wrap_policy],
        "cpu_offload": cfg.cpu_offload,
        "activation_checkpointing": cfg.activation_checkpointing != "none",
        "state_dict_type": "SHARDED_STATE_DICT",
    }
    if cfg.auto_wrap_policy == "transformer_layer":
        fsdp_config["transformer_layer_cls_to_wrap"] = list(cfg.transformer_layer_cls)
    if cfg.auto_wrap_policy == "size_based":
        fsdp_config["min_num_params"] = cfg.min_num_params
    if cfg.fsdp_version == 1:
        notes.append("fsdp_version=1: transformers 5 still runs FSDP1 but warns that it is deprecated")
        # transformers 5 reads the FSDP1 strategy from reshard_after_forward.
        fsdp_config["reshard_after_forward"] = cfg.sharding_strategy.lower()
        fsdp_config["backward_prefetch"] = "NO_PREFETCH" if cfg.backward_prefetch == "none" else cfg.backward_prefetch
        fsdp_config["forward_prefetch"] = cfg.forward_prefetch
        fsdp_config["limit_all_gathers"] = cfg.limit_all_gathers
        fsdp_config["use_orig_params"] = True
    else:
        fsdp_config["reshard_after_forward"] = bool(cfg.reshard_after_forward)
        if cfg.sharding_strategy in ("NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
            notes.append(f"sharding_strategy={cfg.sharding_strategy} with FSDP2: transformers expresses FSDP2 "
                         "sharding only as reshard_after_forward; exported as that, which is not the same")
        if cfg.forward_prefetch:
            notes.append("forward_prefetch=true with FSDP2: transformers has no FSDP2 forward prefetch key; dropped")
    legacy = [cfg.sharding_strategy.lower()] + (["offload"] if cfg.cpu_offload else []) + (["auto_wrap"] if cfg.auto_wrap_policy != "none" else [])
    data = {
        "fsdp": True,
        "fsdp_config": fsdp_config,
        "bf16": cfg.mixed_precision.startswith("bf16"),
        "fp16": cfg.mixed_precision == "fp16",
        "per_device_train_batch_size": cfg.micro_batch_size,
        "use_cpu": doc["measured"].get("device") == "cpu",
        # transformers 4.x takes the strategy as this string instead of fsdp=True.
        "fsdp_for_transformers_4": " ".join(legacy),
        "notes": notes,
    }
    return json.dumps(data, indent=2) + "\n", notes


def to_torchtitan(doc: dict[str, Any]) -> tuple[str, list[str]]:
    cfg = FsdpConfig.from_dict(doc["fsdp"])
    world = doc["measured"]["world_size"]
    notes = []
    if cfg.fsdp_version == 1:
        notes.append("fsdp_version=1: torchtitan always uses FSDP2 (fully_shard); FSDP1-only choices "
                     f"(backward_prefetch={cfg.backward_prefetch}, limit_all_gathers={str(cfg.limit_all_gathers).lower()}) do not apply")
    if cfg.auto_wrap_policy != "transformer_layer":
        notes.append(f"auto_wrap_policy={cfg.auto_wrap_policy}: torchtitan shards each transformer block; not expressible")
    if cfg.forward_prefetch:
        notes.append("forward_prefetch=true: torchtitan's job file has no forward prefetch option; dropped")
    if cfg.mixed_precision == "fp16":
        notes.append("mixed_precision=fp16: torchtitan trains in bf16 or fp32 only; exported as bfloat16")
    if cfg.sharding_strategy == "NO_SHARD":
        shard, replicate = 1, world
    elif cfg.is_hybrid:
        shard, replicate = -1, 1
        notes.append(f"sharding_strategy={cfg.sharding_strategy}: set data_parallel_replicate_degree to your node count")
    else:
        shard, replicate = world, 1
    param = {"fp32": "float32", "fp16": "bfloat16"}.get(cfg.mixed_precision, "bfloat16")
    reduce = "bfloat16" if cfg.mixed_precision in ("bf16", "fp16") else "float32"
    ac_mode = {"none": "none", "full": "full", "every_other_layer": "selective"}[cfg.activation_checkpointing]
    lines = [
        _comment_block("#", doc, notes).rstrip("\n"),
        "[parallelism]",
        f"data_parallel_shard_degree = {shard}",
        f"data_parallel_replicate_degree = {replicate}",
        f'fsdp_reshard_after_forward = "{"always" if cfg.reshard_after_forward else "never"}"',
        "",
        "[training]",
        f'mixed_precision_param = "{param}"',
        f'mixed_precision_reduce = "{reduce}"',
        f"enable_cpu_offload = {str(cfg.cpu_offload).lower()}",
        f"local_batch_size = {cfg.micro_batch_size}",
        f"seq_len = {doc['seq_len']}",
        "",
        "[activation_checkpoint]",
        f'mode = "{ac_mode}"',
    ]
    if ac_mode == "selective":
        lines.append('selective_ac_option = "2"  # checkpoint every 2nd layer')
    return "\n".join(lines) + "\n", notes


def to_python(doc: dict[str, Any]) -> tuple[str, list[str]]:
    cfg = FsdpConfig.from_dict(doc["fsdp"])
    notes = []
    if cfg.is_hybrid:
        notes.append(f"sharding_strategy={cfg.sharding_strategy}: pass the number of nodes as apply_fsdp(..., nnodes=N)")
    header = _comment_block("#", doc, notes)
    return header + _PYTHON_TEMPLATE.replace("__CONFIG__", json.dumps(cfg.to_dict(), indent=4, sort_keys=True)), notes


def _comment_block(mark: str, doc: dict[str, Any], notes: list[str], extra: list[str] = ()) -> str:
    measured = doc.get("measured", {})
    lines = [
        f"Exported by autotune from study {doc['study']['name']!r}, trial {doc['study']['trial_number']}:",
        f"{measured.get('tokens_per_s', 0):,.0f} tokens/s, peak {measured.get('peak_memory_bytes', 0) / 2**30:.3g} GiB per rank "
        f"on {measured.get('world_size')} x {measured.get('device')}, model {doc.get('model')}, seq len {doc.get('seq_len')}.",
    ]
    lines += list(extra)
    lines += [f"NOT EXPRESSIBLE HERE: {note}" for note in notes]
    return "".join(f"{mark} {line}\n" for line in lines)


RENDERERS: dict[str, Callable[[dict[str, Any]], tuple[str, list[str]]]] = {
    "json": lambda doc: (json.dumps(doc, indent=2, sort_keys=True) + "\n", []),
    "accelerate": to_accelerate,
    "hf": to_hf,
    "torchtitan": to_torchtitan,
    "python": to_python,
}


def render(doc: dict[str, Any], fmt: str) -> tuple[str, list[str]]:
    """The text of ``doc`` in ``fmt`` and the notes on what ``fmt`` could not express."""
    return RENDERERS[fmt](doc)


_PYTHON_TEMPLATE = '''"""Apply the tuned FSDP configuration to a model. Needs torch only, not autotune.

    import torch.distributed as dist
    from fsdp_config import apply_fsdp
    dist.init_process_group(...)
    model = apply_fsdp(model)          # then build the optimizer from model.parameters()
"""

import functools
import json

import torch
from torch import nn

CONFIG = json.loads("""__CONFIG__""")

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
'''
