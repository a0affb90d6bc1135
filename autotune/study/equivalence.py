"""Configurations that are one program: each class is enumerated, drawn and launched once, under its simplest name.

Two configurations belong to one class when, at this world size and on this
model, FSDP runs the same thing for both. Every rule below was checked by
measuring (2-rank and 1-rank trials of llama-tiny on CPU, torch 2.13: equal
peak memory to the byte and equal losses, step times within noise; see
tests/test_equivalence.py, which measures them again):

- a hybrid strategy whose shard groups span every rank has one replica
  group: it is its non-hybrid strategy (HYBRID_SHARD is FULL_SHARD,
  HYBRID_SHARD_ZERO2 is SHARD_GRAD_OP). FSDP2's hybrid form only adds an
  all-reduce over a group of one rank;
- a hybrid strategy whose shard groups hold one rank replicates everything:
  it is NO_SHARD. FSDP1 even runs it as NO_SHARD *within* the one-rank group
  (it clamps any strategy to NO_SHARD when its process group has one rank),
  so its gradients are never averaged across ranks: faster, and wrong;
- at one rank nothing is sharded: FSDP1 runs every strategy as NO_SHARD (the
  same clamp), and FSDP2's SHARD_GRAD_OP and NO_SHARD keep the same unsharded
  parameters (its FULL_SHARD differs: it frees them after forward);
- with one FSDP unit (``auto_wrap_policy: none``, or size-based wrapping whose
  threshold exceeds the whole model, which wraps nothing but the root) there
  is no other unit to prefetch: forward and backward prefetch do nothing
  (``limit_all_gathers`` still changes FSDP1's peak, so it stays);
- FSDP1 NO_SHARD in fp32 never unshards (no all-gather, no cast), so neither
  backward prefetch nor the all-gather limit does anything (forward prefetch
  does: 1.5% more peak at seq 64, though none at seq 128);
- checkpointing every other layer of a one-layer model is checkpointing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from autotune.config import HYBRID_STRATEGIES, FsdpConfig

# The values a field falls back to when a rule makes it meaningless, so that
# every member of a class has one key.
_DEFAULTS = {name: getattr(FsdpConfig, name) for name in
             ("forward_prefetch", "backward_prefetch", "limit_all_gathers", "min_num_params", "shard_group_size")}


@dataclass(frozen=True)
class Topology:
    """What decides which configurations are one program: the ranks, the nodes and the model."""

    world_size: int
    nnodes: int = 1
    # Parameters and repeated blocks of the model (None: unknown, and the rules
    # that need them do not apply).
    num_params: int | None = None
    num_layers: int | None = None

    @property
    def node_size(self) -> int:
        return self.world_size // self.nnodes


def canonical(cfg: FsdpConfig, topology: Topology) -> FsdpConfig:
    """The simplest member of ``cfg``'s class (``cfg`` itself when it is one)."""
    fields = cfg.to_dict()
    changes = {k: v for k, v in canonical_fields(fields, topology).items() if fields[k] != v}
    return cfg.replace(**changes) if changes else cfg


def canonical_fields(fields: Mapping[str, Any], topology: Topology) -> dict[str, Any]:
    """:func:`canonical` on a mapping of searchable fields (what enumeration walks
    through before any configuration object exists): the fields that change."""
    changes: dict[str, Any] = {}
    strategy = fields["sharding_strategy"]
    if strategy in HYBRID_STRATEGIES:
        group = fields["shard_group_size"] or topology.node_size
        if group == topology.world_size:
            strategy = "FULL_SHARD" if strategy == "HYBRID_SHARD" else "SHARD_GRAD_OP"
        elif group == 1:
            strategy = "NO_SHARD"
        elif fields["shard_group_size"] == topology.node_size:
            changes["shard_group_size"] = None  # "node" is the simpler name of the same groups
    version = fields["fsdp_version"]
    if topology.world_size == 1 and (version == 1 or strategy == "SHARD_GRAD_OP"):
        strategy = "NO_SHARD"
    if strategy != fields["sharding_strategy"]:
        changes.update(sharding_strategy=strategy, shard_group_size=None)
    wrap = fields["auto_wrap_policy"]
    if wrap == "size_based" and topology.num_params is not None and fields["min_num_params"] > topology.num_params:
        wrap = changes["auto_wrap_policy"] = "none"
    if wrap != "size_based":
        changes["min_num_params"] = _DEFAULTS["min_num_params"]
    never_unshards = version == 1 and strategy == "NO_SHARD" and fields["mixed_precision"] == "fp32"
    if wrap == "none":
        changes["forward_prefetch"] = _DEFAULTS["forward_prefetch"]
    if version == 1 and (wrap == "none" or never_unshards):
        changes["backward_prefetch"] = _DEFAULTS["backward_prefetch"]
    if never_unshards:
        changes["limit_all_gathers"] = _DEFAULTS["limit_all_gathers"]
    if fields["activation_checkpointing"] == "every_other_layer" and topology.num_layers == 1:
        changes["activation_checkpointing"] = "full"
    return {k: v for k, v in changes.items() if fields[k] != v}


def classes(configs: Iterable[FsdpConfig], topology: Topology) -> list[FsdpConfig]:
    """The distinct classes among ``configs``, each as its simplest member, in first-seen order."""
    seen: dict[str, FsdpConfig] = {}
    for cfg in configs:
        simplest = canonical(cfg, topology)
        seen.setdefault(simplest.key(), simplest)
    return list(seen.values())
