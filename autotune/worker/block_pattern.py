"""Where a model's blocks differ from one another, read from its transformers config: the repeating pattern both
the memory estimator's copies (:mod:`autotune.worker.depth_extrapolation`) and a study's shallow trials
(:mod:`autotune.study.trial_depth`) are built along.

A step's figures are affine in depth only over whole repeats of the blocks. Blocks differ by their attention
(Gemma's sliding and full layers, ``layer_types``), by whether their feed-forward is a mixture of experts
(Qwen2-MoE's ``decoder_sparse_step`` and ``mlp_only_layers``, DeepSeek's ``first_k_dense_replace`` and
``moe_layer_freq``, Llama 4's ``moe_layers``) and by whether they apply rotary embeddings (Llama 4's
``no_rope_layers``). A line through copies of one block kind's depths extends that kind's slope to every block:
a model alternating dense and MoE blocks needs copies a whole period apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Where configs count their experts (Mixtral, Qwen2-MoE and Qwen3-MoE, DeepSeek).
EXPERT_COUNT_NAMES = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class BlockPattern:
    """The first ``prefix`` blocks stand apart (DeepSeek's dense ones); after them the blocks repeat every
    ``period``."""

    prefix: int = 0
    period: int = 1


# Blocks all alike: what a model whose config says nothing of its blocks has.
UNIFORM = BlockPattern()


def layer_kinds(config: Any) -> list[tuple[Any, ...]] | None:
    """Each block's kind (its attention, whether it routes to experts, whether it applies rotary embeddings), or
    None where the config says nothing about blocks differing."""
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        return None
    layer_types = getattr(config, "layer_types", None)
    attention = list(layer_types)[:n] if isinstance(layer_types, (list, tuple)) and len(layer_types) >= n else None
    no_rope = getattr(config, "no_rope_layers", None)
    rope = list(no_rope)[:n] if isinstance(no_rope, (list, tuple)) and len(no_rope) >= n else None
    experts = [_routes_to_experts(config, i) for i in range(n)]
    if attention is None and rope is None and len(set(experts)) <= 1:
        return None
    return [(attention[i] if attention else None, experts[i], rope[i] if rope else None) for i in range(n)]


def has_experts(config: Any) -> bool:
    """Whether a transformers config routes tokens to experts (Mixtral, Qwen2-MoE, DeepSeek)."""
    return any(isinstance(getattr(config, name, None), int) and getattr(config, name) > 1
               for name in EXPERT_COUNT_NAMES)


def _routes_to_experts(config: Any, i: int) -> bool:
    if not has_experts(config):
        return False
    moe_layers = getattr(config, "moe_layers", None)
    if isinstance(moe_layers, (list, tuple)):
        return i in moe_layers
    if i in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    step = getattr(config, "decoder_sparse_step", None)
    if isinstance(step, int) and step > 1:
        return (i + 1) % step == 0
    first_dense = getattr(config, "first_k_dense_replace", None)
    frequency = getattr(config, "moe_layer_freq", None)
    if isinstance(first_dense, int) or isinstance(frequency, int):
        return i >= (first_dense or 0) and i % (frequency if isinstance(frequency, int) and frequency > 0 else 1) == 0
    return True


def block_pattern(config: Any) -> BlockPattern:
    """The shortest prefix and period after which the config's blocks repeat (at least twice; else the whole
    model is one period)."""
    kinds = layer_kinds(config)
    if kinds is None:
        return UNIFORM
    n = len(kinds)
    best = BlockPattern(0, n)
    for prefix in range(n):
        for period in range(1, (n - prefix) // 2 + 1):
            if prefix + period >= best.prefix + best.period:
                break
            if all(kinds[i] == kinds[prefix + (i - prefix) % period] for i in range(prefix, n)):
                best = BlockPattern(prefix, period)
                break
    return best
