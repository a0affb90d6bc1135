"""Build the model a trial trains, with its parameters on the meta device.

Every rank builds the model's parameters on the meta device, so no rank ever
holds the whole model: a 70B configuration can be measured on 80 GB GPUs,
which DeepSpeed's profiling run cannot always do. Buffers are built for real
(they are small, and only the constructor knows their values);
:class:`autotune.worker.fsdp.Materializer` gives each rank's shard storage
after wrapping. Weights are random and nothing is downloaded.
"""

from __future__ import annotations

import importlib
import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from autotune.worker.block_pattern import UNIFORM, BlockPattern, block_pattern, has_experts
from autotune.config import LoraSpec
from autotune.presets import PRESETS, ModelSpec, parse_model_spec
from autotune.worker.fsdp import find_layers


@dataclass
class BuiltModel:
    module: nn.Module
    vocab_size: int
    # The repeated blocks, in forward order: the unit for wrapping, checkpointing
    # and explicit prefetching.
    layers: list[nn.Module]
    layer_classes: tuple[str, ...]
    # LoRA: the modules its adapters went on; None: every parameter trains.
    lora_targets: list[str] | None = None

    def count_parameters(self) -> tuple[int, int]:
        """(all parameters, those the optimizer steps), each tied tensor once."""
        params = list(self.module.parameters())
        return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def _transformers_config(spec: ModelSpec, num_blocks: int | None = None):
    from transformers import AutoConfig

    if spec.kind == "preset":
        data = dict(PRESETS[spec.value])
    else:
        with open(spec.value) as f:
            data = json.load(f)
    model_type = data.pop("model_type")
    config = AutoConfig.for_model(model_type, **data)
    # Training keeps no key-value cache. With one, each layer appends this
    # step's keys to the cache, so a checkpointed layer's recomputation sees
    # a longer cache than its forward did: selective checkpointing then fails
    # ("aten.slice.Tensor invocation index 4 ... not found in storage") on
    # every model whose config.json leaves use_cache at its default (true).
    config.use_cache = False
    if num_blocks is not None:
        # attribute_map turns this into n_layer, num_layers, ... as the model names it.
        config.num_hidden_layers = num_blocks
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:num_blocks]
    return config


def block_count(model: str) -> int | None:
    """How many repeated blocks a preset or config.json model has (None for a
    ``module:function`` factory, whose depth only its code knows)."""
    spec = parse_model_spec(model)
    if spec.kind in ("factory", "workload"):
        return None
    count = getattr(_transformers_config(spec), "num_hidden_layers", None)
    return int(count) if isinstance(count, int) else None


def model_block_pattern(model: str) -> BlockPattern:
    """How a preset or config.json model's blocks repeat (:mod:`autotune.worker.block_pattern`); a
    ``module:function`` factory's are taken as alike."""
    spec = parse_model_spec(model)
    if spec.kind in ("factory", "workload"):
        return UNIFORM
    return block_pattern(_transformers_config(spec))


def is_mixture_of_experts(model: str) -> bool:
    """Whether a preset or config.json model routes tokens to experts (False for a factory: unknown)."""
    spec = parse_model_spec(model)
    if spec.kind in ("factory", "workload"):
        return False
    return has_experts(_transformers_config(spec))


def _causal_lm_class(config):
    if config.model_type == "llama":
        # Importing the Llama module directly skips transformers' auto-class
        # registry, about 1.5 s of every trial's start-up.
        from transformers.models.llama.modeling_llama import LlamaForCausalLM

        return LlamaForCausalLM
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)]


def import_model_code(model: str) -> None:
    """Import the code that builds ``model`` without building it (no tensor is
    made): what the fork server does once, so that no trial pays for it."""
    spec = parse_model_spec(model)
    if spec.kind == "factory":
        importlib.import_module(spec.value.partition(":")[0])
    elif spec.kind == "workload":
        from autotune.worker.workload_loader import load_workload

        load_workload(spec.value)
    else:
        _causal_lm_class(_transformers_config(spec))


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered meanwhile lands on the meta device; buffers stay real.

    ``torch.device("meta")`` would put buffers on meta too, and the values the
    constructor computed for them (rotary frequencies, masks) would be lost.
    A parameter is moved as it is registered, before its module initializes
    it, so its host storage (``torch.empty``, never touched) costs nothing.
    """
    from torch.nn.modules.module import register_module_parameter_registration_hook

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta:
            return None
        return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    handle = register_module_parameter_registration_hook(to_meta)  # type: ignore[arg-type]  # it may return one
    try:
        yield
    finally:
        handle.remove()


def build_model(model: str, layer_cls_names: tuple[str, ...] = (), device: str = "meta",
                num_blocks: int | None = None, lora: LoraSpec | None = None) -> BuiltModel:
    """Build ``model`` (preset, config.json path or ``module:function``).

    ``device="meta"`` puts its parameters on the meta device and keeps its
    buffers real (see :func:`parameters_on_meta`); any other device builds
    everything there: the estimator builds on "cpu" inside FakeTensorMode,
    fake tensors that FSDP1 can flatten, which meta tensors it cannot swap.
    ``layer_cls_names`` names the repeated block; empty means the model's
    ``_no_split_modules``. A ValueError names a class the model does not have.
    ``lora`` freezes the base weights and adds adapters (see :func:`apply_lora`).
    """
    spec = parse_model_spec(model)
    if spec.kind == "workload":
        return _build_workload(spec.value, device, num_blocks, lora)
    with parameters_on_meta() if device == "meta" else torch.device(device):
        if spec.kind == "factory":
            module_name, _, function_name = spec.value.partition(":")
            module = getattr(importlib.import_module(module_name), function_name)()
            if not isinstance(module, nn.Module):
                raise TypeError(f"{spec.value} returned {type(module).__name__}, not a torch.nn.Module")
            # getattr gives Any, where a Module's attribute is typed Tensor | Module.
            vocab_size = getattr(getattr(module, "config", None), "vocab_size",
                                 None) or getattr(module, "vocab_size")  # noqa: B009
        else:
            config = _transformers_config(spec, num_blocks)
            module = _causal_lm_class(config)(config)
            vocab_size = config.vocab_size
    names = tuple(layer_cls_names) or tuple(getattr(module, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(
            f"{model}: cannot tell which class is the repeated block (no _no_split_modules); "
            "name it with --wrap-class"
        )
    present = {type(m).__name__ for m in module.modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise ValueError(
            f"{model} has no module class {missing[0]!r}; classes it has include "
            f"{sorted(c for c in present if 'Layer' in c or 'Block' in c) or sorted(present)[:10]}"
        )
    layers = find_layers(module, names)
    targets = None
    if lora is not None:
        module, targets = apply_lora(module, lora)
    return BuiltModel(module=module, vocab_size=int(vocab_size), layers=layers, layer_classes=names,
                      lora_targets=targets)


def _build_workload(reference: str, device: str, num_blocks: int | None, lora: LoraSpec | None) -> BuiltModel:
    """A workload's model (:mod:`autotune.workload`), with its blocks; a ValueError says what is wrong with it."""
    from autotune.worker.workload_loader import load_workload

    workload = load_workload(reference)
    with parameters_on_meta() if device == "meta" else torch.device(device):
        try:
            module = workload.build_model(num_blocks=num_blocks)
        except Exception as exc:  # noqa: BLE001 - the user's code may raise anything
            raise ValueError(f"build_model(num_blocks={num_blocks}) raised {type(exc).__name__}: {exc}") from None
    if not isinstance(module, nn.Module):
        raise ValueError(f"build_model returned {type(module).__name__}, not a torch.nn.Module")
    names = tuple(c.__name__ for c in workload.blocks)
    layers = [m for m in module.modules() if isinstance(m, tuple(workload.blocks))]
    if not layers:
        present = sorted({type(m).__name__ for m in module.modules()})
        raise ValueError(f"blocks {list(names)} are not in the model built; its module classes include {present[:10]}")
    if num_blocks is not None and len(layers) != num_blocks:
        raise ValueError(f"build_model(num_blocks={num_blocks}) built {len(layers)} blocks; build as many as asked")
    targets = None
    if lora is not None:
        module, targets = apply_lora(module, lora)
    return BuiltModel(module=module, vocab_size=0, layers=layers, layer_classes=names, lora_targets=targets)


def apply_lora(module: nn.Module, lora: LoraSpec) -> tuple[nn.Module, list[str]]:
    """Freeze ``module`` and add LoRA adapters with peft, as a user's fine-tuning does.

    Adapters are made on the meta device (peft's ``low_cpu_mem_usage``) and
    get storage, shard by shard, with the rest of the model: a fake-tensor
    model cannot take them otherwise (``.to()`` cannot swap a fake parameter). The repeated
    blocks stay the same module objects (peft swaps the linear layers inside
    them), so they are still the units to wrap and checkpoint. Returns the
    model to train and the module names the adapters went on.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise RuntimeError("LoRA trials need peft: pip install 'autotune[lora]'") from exc
    config = LoraConfig(r=lora.rank, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                        target_modules=list(lora.target_modules) or None, task_type="CAUSAL_LM")
    model = get_peft_model(module, config, low_cpu_mem_usage=True)
    resolved: Any = model.peft_config["default"]  # a LoraConfig: peft types it as its base class
    return model, sorted(resolved.target_modules)
