"""Train a tiny Llama for 2 steps the way a user's script would, under ``accelerate launch --config_file EXPORT``
(``accelerate``) or under torchrun with ``TrainingArguments(**EXPORT)`` (``hf``), and print, from rank 0, what the
consumer applied: FSDP version, sharding, the wrapped block class, precision, checkpointing, micro batch."""

import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SEQ = 32


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                                        use_cache=False))


def applied(model: torch.nn.Module) -> dict:
    """What the consumer did to the model, read from the modules themselves."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    units, version, strategy, reshard = set(), None, None, None
    for module in model.modules():
        if isinstance(module, FullyShardedDataParallel):
            version, strategy = 1, module.sharding_strategy.name
            inner = module.module  # the wrapped block, under its checkpoint wrapper when it has one
            units.add(type(getattr(inner, "_checkpoint_wrapped_module", inner)).__name__)
        elif isinstance(module, FSDPModule):
            version = 2
            units.add(type(module).__name__.removeprefix("FSDP"))
            state = module._get_fsdp_state()
            group = state._fsdp_param_group
            if group is not None and type(module).__name__ != type(model).__name__:
                reshard = group.post_forward_mesh_info is not None
    checkpointed = sum(type(m).__name__ == "CheckpointWrapper" or hasattr(m, "_checkpoint_wrapped_module")
                       for m in model.modules())
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return {"fsdp_version": version, "sharding_strategy": strategy, "reshard_after_forward": reshard,
            "units": sorted(units), "checkpointed_blocks": checkpointed, "param_dtypes": dtypes}


def configured(plugin=None) -> dict:
    """The FSDP plugin the consumer set up: ``accelerate launch`` writes it into the environment from the config
    file (accelerate reads it back from there); the Trainer builds it from ``TrainingArguments.fsdp_plugin_args``."""
    import os

    from accelerate.utils import FullyShardedDataParallelPlugin

    if plugin is None:
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
            return {"use_fsdp": False}
        plugin = FullyShardedDataParallelPlugin()
    offload = getattr(plugin.cpu_offload, "offload_params", None)
    return {"use_fsdp": True, "fsdp_version": plugin.fsdp_version,
            "sharding_strategy": getattr(plugin.sharding_strategy, "name", None) if plugin.fsdp_version == 1 else None,
            "reshard_after_forward": plugin.reshard_after_forward if plugin.fsdp_version == 2 else None,
            "wrap": sorted(plugin.transformer_cls_names_to_wrap or []),
            "activation_checkpointing": plugin.activation_checkpointing,
            "cpu_offload": bool(offload) if offload is not None
            else type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"}


def batches(n: int, size: int):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        ids = torch.randint(0, 256, (size, SEQ), generator=g)
        yield {"input_ids": ids, "labels": ids}


def with_accelerate() -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator()
    micro = int(sys.argv[2])
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for batch in batches(2, micro):
        with accelerator.autocast():
            loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {**applied(model), "mixed_precision": accelerator.mixed_precision, "losses": losses,
            "distributed_type": str(accelerator.distributed_type), "micro_batch_size": micro,
            "configured": configured(),
            "rank": accelerator.process_index}


def with_trainer() -> dict:
    import torch.distributed as dist
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=sys.argv[3], max_steps=2, report_to=[], save_strategy="no", logging_steps=1,
                             **json.loads(open(sys.argv[2]).read()))
    dataset = [dict(input_ids=b["input_ids"][0], labels=b["labels"][0]) for b in batches(16, 1)]
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=dataset)
    result = trainer.train()
    model = trainer.model_wrapped
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    return {**applied(model), "mixed_precision": precision, "losses": [result.training_loss],
            "micro_batch_size": args.per_device_train_batch_size, "steps": result.global_step,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "configured": configured(getattr(trainer.accelerator.state, "fsdp_plugin", None)
                                     or FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)),
            "rank": dist.get_rank() if dist.is_initialized() else 0}


if __name__ == "__main__":
    report = with_accelerate() if sys.argv[1] == "accelerate" else with_trainer()
    if report["rank"] == 0:
        print("APPLIED " + json.dumps(report), flush=True)
    sys.stderr.flush()
    # The work is done and reported: gloo's threads can abort the interpreter's own exit (SIGABRT, "terminate called
    # without an active exception", rank 1 of the Trainer under DDP, once in a suite run on 2 busy cores).
    os._exit(0)
