"""The best configuration in the formats other tools read: accelerate, transformers, torchtitan, Python.

Each renderer takes an ``autotune.fsdp-config/v1`` document and returns the
file's text and the notes on what the target cannot express. Nothing is
dropped silently: every note is written into the file (as a comment where the
format has them) and printed on stderr by ``autotune export``.
"""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any, Callable, Sequence

import yaml

from autotune.config import FsdpConfig
from autotune.config.dimensions import shard_ranks
from autotune.errors import UsageError

_ACCELERATE_WRAP = {"transformer_layer": "TRANSFORMER_BASED_WRAP", "size_based": "SIZE_BASED_WRAP", "none": "NO_WRAP"}
_MIXED = {"fp32": "no", "bf16": "bf16", "bf16_fp32_reduce": "bf16", "fp16": "fp16"}


def _common_notes(cfg: FsdpConfig, target: str, device: str | None = None) -> list[str]:
    notes = []
    if device == "cpu":
        # Measured with accelerate 1.15 and transformers 5.25 (tests/test_consumers_train.py).
        notes.append(f"device=cpu: {target} applies FSDP on GPUs and other accelerators only; on a CPU host it trains "
                     "unsharded replicas with these settings unused; the python export's apply_fsdp shards on CPU")
    if cfg.is_hybrid and cfg.shard_group_size is not None:
        notes.append(f"shard_group_size={cfg.shard_group_size}: {target} shards hybrid strategies within a node; "
                     f"build the (replicate, shard) device mesh with shard groups of {cfg.shard_group_size} ranks "
                     "yourself, or use the python export's apply_fsdp")
    notes += _partial_reshard_notes(cfg, target)
    if cfg.activation_checkpointing == "every_other_layer":
        notes.append(f"activation_checkpointing=every_other_layer: {target} checkpoints every layer or none; "
                     "exported as every layer (more recompute, less memory than measured)")
    if cfg.compile:
        notes.append(f"compile=true: {target} compiles the whole model, not each block before sharding as measured; "
                     "apply_fsdp in the python export does what the trial did")
    if cfg.activation_checkpointing == "selective":
        notes.append(f"activation_checkpointing=selective: {target} has no op-level selective checkpointing; exported "
                     "as full (more recompute, less memory than measured); use the python export's apply_fsdp for it")
    if cfg.mixed_precision == "bf16_fp32_reduce":
        notes.append(f"mixed_precision=bf16_fp32_reduce: {target} has no key for an fp32 gradient reduce; "
                     "exported as bf16 (set reduce_dtype=float32 in code to match the measurement)")
    return notes


def _partial_reshard_notes(cfg: FsdpConfig, target: str) -> list[str]:
    """A reshard group (fully_shard's reshard_after_forward as an int), which no consumer's config can say."""
    if cfg.reshard_group_size is None:
        return []
    return [f"reshard_group_size={cfg.reshard_group_size}: {target} reshards after forward over every rank or none; "
            "exported as resharding over every rank (less memory, more backward all-gather traffic than measured); "
            f"pass fully_shard(..., reshard_after_forward={cfg.reshard_group_size}) in code, or use the python "
            "export's apply_fsdp"]


def _lora_notes(doc: dict[str, Any], target: str, how: str) -> list[str]:
    """A consumer that has no LoRA keys: where the measured LoRA settings go instead."""
    lora = doc.get("lora")
    if not lora:
        return []
    return [f"LoRA (rank {lora['rank']}, alpha {lora['lora_alpha']}, dropout {lora['lora_dropout']:g}, on "
            f"{','.join(lora['target_modules'])}): {target} has no LoRA keys; {how} "
            "(autotune export -f peft writes that LoraConfig)"]


_PEFT_WITH_FSDP = ("wrap the model with peft.get_peft_model(model, LoraConfig(...)) before it is prepared; for FSDP1, "
                   "accelerate and the Trainer then wrap the adapters as units of their own, which the trial did not")


def to_accelerate(doc: dict[str, Any]) -> tuple[str, list[str]]:
    cfg = FsdpConfig.from_dict(doc["fsdp"])
    notes = _common_notes(cfg, "accelerate", doc["measured"].get("device"))
    notes += _lora_notes(doc, "accelerate's config file", _PEFT_WITH_FSDP)
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
    fsdp.update(_accelerate_version_keys(cfg, notes))
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
    if cfg.compile:
        data["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
    steps = doc.get("gradient_accumulation_steps", 1)
    if steps > 1:
        notes.append(f"gradient_accumulation_steps={steps}: accelerate's config file has no key for it outside "
                     f"DeepSpeed; pass Accelerator(gradient_accumulation_steps={steps}) (or set "
                     "ACCELERATE_GRADIENT_ACCUMULATION_STEPS)")
    header = _comment_block("#", doc, notes, [f"Micro batch size per process: {cfg.micro_batch_size} (set it in your "
                                              "data loader).",
                                              f"Gradient accumulation steps: {steps} (global batch "
                                              f"{doc.get('global_batch_size')})."])
    return header + yaml.safe_dump(data, sort_keys=True), notes


def _accelerate_version_keys(cfg: FsdpConfig, notes: list[str]) -> dict[str, Any]:
    """accelerate's keys for FSDP1's own options, or FSDP2's, with the notes on what they cannot say."""
    if cfg.fsdp_version == 1:
        if not cfg.limit_all_gathers:
            notes.append("limit_all_gathers=false: accelerate's config file has no key for it (its default is true); "
                         "pass limit_all_gathers=False to FullyShardedDataParallelPlugin in code")
        return {"fsdp_sharding_strategy": cfg.sharding_strategy, "fsdp_forward_prefetch": cfg.forward_prefetch,
                "fsdp_backward_prefetch": "NO_PREFETCH" if cfg.backward_prefetch == "none" else cfg.backward_prefetch,
                "fsdp_use_orig_params": True}
    if cfg.sharding_strategy in ("NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        notes.append(f"sharding_strategy={cfg.sharding_strategy} with FSDP2: accelerate's FSDP2 config shards "
                     "over one mesh dimension only; exported as reshard_after_forward, which is not the same")
    if cfg.forward_prefetch:
        notes.append("forward_prefetch=true with FSDP2: accelerate's FSDP2 config has no forward prefetch key; "
                     "dropped (call set_modules_to_forward_prefetch in code)")
    return {"fsdp_reshard_after_forward": bool(cfg.reshard_after_forward)}


def to_hf(doc: dict[str, Any]) -> tuple[str, list[str]]:
    cfg = FsdpConfig.from_dict(doc["fsdp"])
    notes = _common_notes(cfg, "transformers", doc["measured"].get("device"))
    notes += _lora_notes(doc, "TrainingArguments", "give the Trainer the peft model: " + _PEFT_WITH_FSDP)
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
        if doc["measured"].get("device") == "cpu":
            # The Trainer turns it on for FSDP1, and accelerate's plugin refuses it on CPU ("FSDP parameter
            # initialization with sync_module_states=True is not supported on cpu"): the Trainer would not start.
            fsdp_config["sync_module_states"] = False
    else:
        fsdp_config["reshard_after_forward"] = bool(cfg.reshard_after_forward)
        if cfg.sharding_strategy in ("NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
            notes.append(f"sharding_strategy={cfg.sharding_strategy} with FSDP2: transformers expresses FSDP2 "
                         "sharding only as reshard_after_forward; exported as that, which is not the same")
        if cfg.forward_prefetch:
            notes.append("forward_prefetch=true with FSDP2: transformers has no FSDP2 forward prefetch key; dropped")
    # Keyword arguments of TrainingArguments and nothing else, so that
    # TrainingArguments(output_dir=..., **json.load(f)) takes the file as it is;
    # what it cannot express goes to stderr (``autotune export``), not in here.
    data = {
        "fsdp": True,
        "fsdp_config": fsdp_config,
        "bf16": cfg.mixed_precision.startswith("bf16"),
        "fp16": cfg.mixed_precision == "fp16",
        "per_device_train_batch_size": cfg.micro_batch_size,
        "gradient_accumulation_steps": doc.get("gradient_accumulation_steps", 1),
        "torch_compile": cfg.compile,
        "use_cpu": doc["measured"].get("device") == "cpu",
    }
    return json.dumps(data, indent=2) + "\n", notes


def _torchtitan_common(doc: dict[str, Any], notes: list[str]) -> tuple[FsdpConfig, int, int, str, str]:
    """What both torchtitan formats say alike: the (replicate, shard) mesh and the precisions, with the notes on
    what torchtitan has no way to say."""
    cfg = FsdpConfig.from_dict(doc["fsdp"])
    world = doc["measured"]["world_size"]
    notes += _lora_notes(doc, "torchtitan", "it trains every parameter, so this configuration was measured for "
                         "another workload than torchtitan runs")
    if cfg.fsdp_version == 1:
        notes.append("fsdp_version=1: torchtitan always uses FSDP2 (fully_shard); FSDP1-only choices "
                     f"(backward_prefetch={cfg.backward_prefetch}, "
                     f"limit_all_gathers={str(cfg.limit_all_gathers).lower()}) do not apply")
    if cfg.auto_wrap_policy != "transformer_layer":
        notes.append(f"auto_wrap_policy={cfg.auto_wrap_policy}: torchtitan shards each transformer block; not "
                     "expressible")
    if cfg.forward_prefetch:
        notes.append("forward_prefetch=true: torchtitan has no forward prefetch option; dropped")
    if cfg.mixed_precision == "fp16":
        notes.append("mixed_precision=fp16: torchtitan trains in bf16 or fp32 only; exported as bfloat16")
    notes += _partial_reshard_notes(cfg, "torchtitan")
    shard = shard_ranks(cfg.to_dict(), world, doc.get("nnodes", 1))
    replicate = world // shard
    param = {"fp32": "float32", "fp16": "bfloat16"}.get(cfg.mixed_precision, "bfloat16")
    reduce = "bfloat16" if cfg.mixed_precision in ("bf16", "fp16") else "float32"
    return cfg, shard, replicate, param, reduce


def to_torchtitan(doc: dict[str, Any]) -> tuple[str, list[str]]:
    """Overrides for torchtitan 0.3's ConfigManager (tyro): one per line, to follow ``--module M --config C`` on
    its command line. Booleans are flags; activation checkpointing is a subcommand, so it comes last."""
    notes: list[str] = []
    cfg, shard, replicate, param, reduce = _torchtitan_common(doc, notes)
    world = doc["measured"]["world_size"]
    ac = {"none": "none", "full": "full", "selective": "selective",
          "every_other_layer": "full"}[cfg.activation_checkpointing]
    if cfg.activation_checkpointing == "every_other_layer":
        notes.append("activation_checkpointing=every_other_layer: torchtitan 0.3 checkpoints every block or none "
                     "(its per-layer option is gone); exported as full, which needs no more memory and runs slower")
    if reduce != "float32":
        notes.append(f"mixed_precision={cfg.mixed_precision} reduces gradients in {reduce}: torchtitan 0.3 reduces in "
                     "float32 only; exported as float32 (twice the gradient traffic the trial had)")
        reduce = "float32"
    lines = [
        f"--parallelism.data_parallel_shard_degree {shard}",
        f"--parallelism.data_parallel_replicate_degree {replicate}",
        f"--parallelism.fsdp_reshard_after_forward {'always' if cfg.reshard_after_forward else 'never'}",
        f"--training.mixed_precision_param {param}",
        f"--training.mixed_precision_reduce {reduce}",
        "--training.enable_cpu_offload" if cfg.cpu_offload else "--training.no_enable_cpu_offload",
        f"--training.local_batch_size {cfg.micro_batch_size}",
        # torchtitan accumulates gradients to reach the global batch.
        f"--training.global_batch_size {doc.get('global_batch_size', cfg.micro_batch_size * world)}",
        f"--training.seq_len {doc['seq_len']}",
        # torchtitan compiles each transformer block, as the trial did.
        *(["--compile.enable", "--compile.components model"] if cfg.compile else ["--compile.no_enable"]),
        f"activation-checkpoint:{ac}",
    ]
    usage = [
        "torchtitan 0.3 overrides (ConfigManager, parsed by tyro); the line to launch with:",
        f"  torchrun --nproc-per-node {doc['measured'].get('world_size')} -m torchtitan.train --module MODULE "
        "--config CONFIG $(grep -v '^#' THIS_FILE)",
        "torchtitan 0.2.x read a TOML job file instead: autotune export -f torchtitan-0.2",
    ]
    return _comment_block("#", doc, notes, usage) + "\n".join(lines) + "\n", notes


def to_torchtitan_toml(doc: dict[str, Any]) -> tuple[str, list[str]]:
    """The job-file fragment torchtitan 0.2.x read (``--job.config_file``); 0.3 reads no job file."""
    notes: list[str] = []
    cfg, shard, replicate, param, reduce = _torchtitan_common(doc, notes)
    world = doc["measured"]["world_size"]
    ac_mode = {"none": "none", "full": "full", "every_other_layer": "selective", "selective": "selective"}[
        cfg.activation_checkpointing]
    lines = [
        _comment_block("#", doc, notes, ["torchtitan 0.2.x job file (--job.config_file); torchtitan 0.3 reads "
                                         "overrides instead: autotune export -f torchtitan"]).rstrip("\n"),
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
        # torchtitan accumulates gradients to reach the global batch.
        f"global_batch_size = {doc.get('global_batch_size', cfg.micro_batch_size * world)}",
        f"seq_len = {doc['seq_len']}",
        "",
        "[activation_checkpoint]",
        f'mode = "{ac_mode}"',
    ]
    if cfg.activation_checkpointing == "every_other_layer":
        lines.append('selective_ac_option = "2"  # checkpoint every 2nd layer')
    elif cfg.activation_checkpointing == "selective":
        lines.append('selective_ac_option = "op"  # keep matmul and attention outputs, recompute the rest')
    if cfg.compile:
        # torchtitan compiles each transformer block, as the trial did.
        lines += ["", "[compile]", "enable = true", 'components = ["model"]']
    return "\n".join(lines) + "\n", notes


def to_peft(doc: dict[str, Any]) -> tuple[str, list[str]]:
    """peft's ``LoraConfig`` keyword arguments, as JSON: ``LoraConfig(**json.load(f))``."""
    lora = doc.get("lora")
    if not lora:
        raise UsageError(f"-f peft: study {doc['study']['name']!r} trained every parameter, so it has no LoRA "
                         "settings to export; tune with --lora RANK, or choose another format")
    data = {"r": lora["rank"], "lora_alpha": lora["lora_alpha"], "lora_dropout": lora["lora_dropout"],
            "target_modules": list(lora["target_modules"]), "bias": "none", "task_type": "CAUSAL_LM"}
    return json.dumps(data, indent=2, sort_keys=True) + "\n", []


def to_python(doc: dict[str, Any]) -> tuple[str, list[str]]:
    """A module that needs torch only: the worker's own ``fsdp.py``, verbatim,
    then the measured configuration and ``apply_fsdp(model)`` calling it."""
    cfg = FsdpConfig.from_dict(doc["fsdp"])
    notes = _lora_notes(doc, "apply_fsdp", "wrap the model with peft.get_peft_model(model, LoraConfig(...)) before "
                        "apply_fsdp, as the trial did")
    if cfg.is_hybrid and cfg.shard_group_size is None:
        notes.append(f"sharding_strategy={cfg.sharding_strategy} with one node's ranks per shard group: pass the "
                     "number of nodes as apply_fsdp(..., nnodes=N)")
    usage = [
        "Use it inside an initialized process group (torchrun):",
        "    from fsdp_config import apply_fsdp, grad_scaler",
        "    model = apply_fsdp(model)      # then build the optimizer from model.parameters()",
        "    scaler = grad_scaler()         # fp16 only, else None",
        f"Accumulate {doc.get('gradient_accumulation_steps', 1)} micro batch(es) of {cfg.micro_batch_size} per "
        "optimizer step (GRADIENT_ACCUMULATION_STEPS), syncing on the last: gradient_sync(model, enabled=last).",
        "A model built on the meta device is given storage shard by shard, as the trial did;",
        "a model with real weights on the host is sharded first and only each shard moves to the device.",
    ]
    header = _comment_block("#", doc, notes, usage)
    source = files("autotune.worker").joinpath("fsdp.py").read_text()
    literal = "{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in sorted(cfg.to_dict().items())) + "}"
    accum = str(doc.get("gradient_accumulation_steps", 1))
    tail = _PYTHON_TAIL.replace("__CONFIG__", literal).replace("__ACCUM__", accum)
    return header + source + tail, notes


def _comment_block(mark: str, doc: dict[str, Any], notes: list[str], extra: Sequence[str] = ()) -> str:
    measured = doc.get("measured", {})
    lines = [
        f"Exported by autotune from study {doc['study']['name']!r}, trial {doc['study']['trial_number']}:",
        f"{measured.get('tokens_per_s', 0):,.0f} tokens/s, peak {measured.get('peak_memory_bytes', 0) / 2**30:.3g} GiB "
        f"per rank on {measured.get('world_size')} x {measured.get('device')}, model {doc.get('model')}, seq len "
        f"{doc.get('seq_len')}.",
    ]
    lines += list(extra)
    lines += [f"NOT EXPRESSIBLE HERE: {note}" for note in notes]
    return "".join(f"{mark} {line}\n" for line in lines)


RENDERERS: dict[str, Callable[[dict[str, Any]], tuple[str, list[str]]]] = {
    "json": lambda doc: (json.dumps(doc, indent=2, sort_keys=True) + "\n", []),
    "accelerate": to_accelerate,
    "hf": to_hf,
    "torchtitan": to_torchtitan,
    "torchtitan-0.2": to_torchtitan_toml,
    "python": to_python,
    "peft": to_peft,
}


FORMATS = tuple(RENDERERS)


def render(doc: dict[str, Any], fmt: str) -> tuple[str, list[str]]:
    """The text of ``doc`` in ``fmt`` and the notes on what ``fmt`` could not express."""
    return RENDERERS[fmt](doc)


_PYTHON_TAIL = '''

# -- The configuration autotune measured, and how to apply it -----------------

CONFIG = __CONFIG__
# Micro batches per optimizer step that the global batch measured needs; sync
# gradients on the last only: `with gradient_sync(model, enabled=last): ...backward()`.
GRADIENT_ACCUMULATION_STEPS = __ACCUM__


def apply_fsdp(model: nn.Module, device: torch.device | None = None, nnodes: int = 1) -> nn.Module:
    """Checkpoint and shard ``model`` as tuned; returns the model to train."""
    return apply_tuned(model, CONFIG, device=device, nnodes=nnodes)


def grad_scaler(device: torch.device | None = None):
    """The sharded grad scaler fp16 trains with, on ``device``'s type; None for other precisions."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return make_grad_scaler(CONFIG["mixed_precision"], device)
'''
