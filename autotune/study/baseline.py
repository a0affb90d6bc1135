"""The first trial: the standard recipe, the configuration most users would write by hand, measured before
anything else."""

from __future__ import annotations

from typing import Any, Callable

import optuna

from autotune.config import DIMENSIONS, FsdpConfig
from autotune.launch.host import HostInfo
from autotune.study.record import Attr
from autotune.study.space import SearchSpace


def standard_recipe(host: HostInfo, layer_classes: tuple[str, ...], space: SearchSpace | None = None,
                    fit_chance: Callable[[FsdpConfig], tuple[float, str | None]] | None = None) -> FsdpConfig:
    """FSDP2 FULL_SHARD, one FSDP unit per transformer layer, bf16 where the device
    runs it fast (else fp32), full activation checkpointing, at the largest of the
    space's micro batches predicted to fit (``fit_chance``, the memory gate's;
    without it, the smallest: a recipe that runs out of memory tells nothing).

    This is what the tuner has to beat: the README recipe of FSDP tutorials and
    of torchtitan's defaults, checkpointing everything to make room for a
    larger batch.
    """
    sizes = sorted(space.choices.get("micro_batch_size", (1,)) if space is not None else (1,))
    recipe = FsdpConfig(fsdp_version=2, sharding_strategy="FULL_SHARD", auto_wrap_policy="transformer_layer",
                        transformer_layer_cls=layer_classes, mixed_precision="bf16" if host.bf16_is_fast else "fp32",
                        activation_checkpointing="full", micro_batch_size=sizes[0])
    if fit_chance is None:
        return recipe
    chances = [(mbs, fit_chance(recipe.replace(micro_batch_size=mbs))[0]) for mbs in reversed(sizes)]
    sure = [mbs for mbs, chance in chances if chance >= 1.0]
    likely = [mbs for mbs, chance in chances if chance > 0.0]
    return recipe.replace(micro_batch_size=(sure or likely or sizes)[0])


def enqueue_baseline(study: optuna.Study, recipe: FsdpConfig, in_space: bool = True) -> None:
    """Measure the standard recipe first: every later trial is compared with it,
    and the early abort needs a best to compare against. When the space does not
    offer it, it is a reference: measured, never the answer, not one of --trials."""
    attrs: dict[str, Any] = {Attr.BASELINE: True}
    if not in_space:
        attrs[Attr.OUTSIDE_SPACE] = True
    study.enqueue_trial(as_params(recipe), user_attrs=attrs)


def as_params(cfg: FsdpConfig) -> dict[str, Any]:
    """Every searchable field of ``cfg``: what an enqueued or planned trial fixes, so the trial is exactly ``cfg``
    even where the space file does not offer that value."""
    return {f.name: getattr(cfg, f.name) for f in DIMENSIONS}
