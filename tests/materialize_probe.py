"""Run under torchrun: build a model as a trial does, wrap it, report parameter counts and ties.

    torchrun --nproc-per-node 2 tests/materialize_probe.py MODEL FSDP_VERSION STRATEGY [MODEL FSDP_VERSION STRATEGY ...]

Rank 0 prints one ``REPORT {...}`` line per case, in order; the cases share the job's start-up.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from autotune.config import FsdpConfig
from autotune.worker.fsdp import build_mesh, parallelize
from autotune.worker.models import build_model


def tied(module) -> bool:
    inner = getattr(module, "module", module)  # FSDP1 wraps the model
    return inner.get_input_embeddings().weight is inner.get_output_embeddings().weight


def expert_units(model) -> list[str]:
    """FSDP2: the class of the sharded unit that owns each expert parameter (a
    parameter owned by the root only would be all-gathered for the whole model)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    owners = set()
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule) and module is not model:
            for pname, param in module.named_parameters():
                if "expert" in f"{name}.{pname}" and isinstance(param, DTensor):
                    owners.add(type(module).__name__.removeprefix("FSDP"))
    return sorted(owners)


def report(model: str, version: int, strategy: str) -> dict:
    built = build_model(model)
    before = {"params": sum(p.numel() for p in built.module.parameters()), "tied": tied(built.module)}
    cfg = FsdpConfig(fsdp_version=version, sharding_strategy=strategy, transformer_layer_cls=built.layer_classes)
    mesh = build_mesh("cpu", strategy, dist.get_world_size(), 1)
    wrapped = parallelize(built.module, built.layers, cfg.to_dict(), torch.device("cpu"), mesh)
    # Unique parameters, counted at their full size on every rank.
    if version == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(wrapped):
            after = sum(p.numel() for p in wrapped.parameters())
    else:
        after = sum(p.numel() for p in wrapped.parameters())  # DTensors report their global shape
    return {"before": before, "after": {"params": after, "tied": tied(wrapped)},
            "meta_left": any(t.is_meta for t in [*wrapped.parameters(), *wrapped.buffers()]),
            "expert_units": expert_units(wrapped) if version == 2 else None}


def main() -> None:
    args = sys.argv[1:]
    dist.init_process_group("gloo")
    for model, version, strategy in zip(args[0::3], args[1::3], args[2::3]):
        case = report(model, int(version), strategy)
        if dist.get_rank() == 0:
            print("REPORT " + json.dumps(case), flush=True)
        dist.barrier()
    os._exit(0)  # gloo + FSDP1 destructors can abort after the work is done


if __name__ == "__main__":
    main()
