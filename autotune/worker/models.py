"""Build the model a trial trains, on the meta device, and initialize it after sharding.

Every rank builds the model on the meta device, so no rank ever holds the whole
model: a 70B configuration can be measured on 80 GB GPUs, which DeepSpeed's
profiling run cannot always do. Weights are random and nothing is downloaded.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass

import torch
from torch import nn

from autotune.presets import PRESETS, ModelSpec, parse_model_spec


@dataclass
class BuiltModel:
    module: nn.Module
    vocab_size: int
    # The repeated blocks, in forward order: the unit for wrapping, checkpointing
    # and explicit prefetching.
    layers: list[nn.Module]
    layer_classes: tuple[str, ...]


def _transformers_config(spec: ModelSpec):
    from transformers import AutoConfig

    if spec.kind == "preset":
        data = dict(PRESETS[spec.value])
    else:
        with open(spec.value) as f:
            data = json.load(f)
    model_type = data.pop("model_type")
    return AutoConfig.for_model(model_type, **data)


def _causal_lm_class(config):
    if config.model_type == "llama":
        # Importing the Llama module directly skips transformers' auto-class
        # registry, about 1.5 s of every trial's start-up.
        from transformers.models.llama.modeling_llama import LlamaForCausalLM

        return LlamaForCausalLM
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)]


def build_model(model: str, layer_cls_names: tuple[str, ...] = (), device: str = "meta") -> BuiltModel:
    """Build ``model`` (preset, config.json path or ``module:function``) on ``device``.

    ``layer_cls_names`` names the repeated block; empty means the model's
    ``_no_split_modules``. A ValueError names a class the model does not have.
    The estimator builds on "cpu" inside FakeTensorMode: fake tensors that
    FSDP1 can flatten, which meta tensors it cannot swap.
    """
    spec = parse_model_spec(model)
    with torch.device(device):
        if spec.kind == "factory":
            module_name, _, function_name = spec.value.partition(":")
            module = getattr(importlib.import_module(module_name), function_name)()
            if not isinstance(module, nn.Module):
                raise TypeError(f"{spec.value} returned {type(module).__name__}, not a torch.nn.Module")
            vocab_size = getattr(getattr(module, "config", None), "vocab_size", None) or getattr(module, "vocab_size")
        else:
            config = _transformers_config(spec)
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
    layers = [m for m in module.modules() if type(m).__name__ in names]
    return BuiltModel(module=module, vocab_size=int(vocab_size), layers=layers, layer_classes=names)


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate the (sharded) parameters on ``device`` and give them real initial values.

    Runs after FSDP2 has sharded the model, so each rank initializes only its
    shard. transformers models use their own ``_init_weights`` (which also
    recomputes rotary buffers); other modules use ``reset_parameters``.
    """
    module.to_empty(device=device)
    init_module_weights(module)


@torch.no_grad()
def init_module_weights(module: nn.Module, owner: nn.Module | None = None, recurse: bool = True) -> None:
    """Initialize ``module``'s parameters and buffers (its own only, without ``recurse``).

    ``owner`` is the whole model: a transformers model's ``_init_weights``
    decides every submodule's values, rotary buffers included; other models
    fall back to each submodule's ``reset_parameters``.
    """
    from transformers import PreTrainedModel

    owner = owner if owner is not None else module
    targets = module.modules() if recurse else [module]
    for sub in targets:
        if isinstance(owner, PreTrainedModel):
            owner._init_weights(sub)
        elif hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
