"""The first trial: the configuration experts recommend, measured before anything the sampler draws."""

from __future__ import annotations

from typing import Any

import optuna

from autotune.config import FsdpConfig
from autotune.launch.host import HostInfo
from autotune.study.record import Attr
from autotune.study.space import SearchSpace


def baseline_config(host: HostInfo, layer_classes: tuple[str, ...], space: SearchSpace | None = None) -> FsdpConfig:
    """The commonly recommended starting point: SHARD_GRAD_OP, one FSDP unit per
    transformer layer, bf16 where the device runs it fast, else fp32; at the
    space's smallest micro batch (the micro batch is the user's workload, not an
    FSDP setting, so the baseline stays within the sizes they asked for)."""
    sizes = space.choices.get("micro_batch_size", (1,)) if space is not None else (1,)
    return FsdpConfig(
        fsdp_version=2,
        sharding_strategy="SHARD_GRAD_OP",
        auto_wrap_policy="transformer_layer",
        transformer_layer_cls=layer_classes,
        mixed_precision="bf16" if host.bf16_is_fast else "fp32",
        micro_batch_size=min(sizes),
    )


def enqueue_baseline(study: optuna.Study, host: HostInfo, layer_classes: tuple[str, ...], space: SearchSpace) -> None:
    """Measure the recommended starting point first: every later trial is
    compared with it, and the early abort needs a best to compare against."""
    study.enqueue_trial(as_params(baseline_config(host, layer_classes, space)), user_attrs={Attr.BASELINE: True})


def as_params(cfg: FsdpConfig) -> dict[str, Any]:
    """Enqueued parameters: every field, so the trial is exactly ``cfg`` even
    where the space file does not offer that value."""
    data = cfg.to_dict()
    data.pop("transformer_layer_cls")
    data.pop("reshard_after_forward")
    return data
