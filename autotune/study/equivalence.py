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
- checkpointing every other layer of a one-layer model is checkpointing it;
- an FSDP2 reshard group of every rank a parameter is sharded over is plain
  resharding (torch turns that int into True).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from autotune.config import FsdpConfig, Topology
from autotune.config.dimensions import simplest_fields

__all__ = ["Topology", "canonical", "canonical_fields", "classes"]


def canonical(cfg: FsdpConfig, topology: Topology) -> FsdpConfig:
    """The simplest member of ``cfg``'s class (``cfg`` itself when it is one)."""
    fields = cfg.to_dict()
    changes = canonical_fields(fields, topology)
    return cfg.replace(**changes) if changes else cfg


def canonical_fields(fields: Mapping[str, Any], topology: Topology) -> dict[str, Any]:
    """:func:`canonical` on a mapping of searchable fields (what enumeration walks
    through before any configuration object exists): the fields that change. Each
    dimension declares its own rule (``autotune.config.fsdp_configuration``)."""
    simplest = simplest_fields(fields, topology)
    return {k: v for k, v in simplest.items() if fields[k] != v}


def classes(configs: Iterable[FsdpConfig], topology: Topology) -> list[FsdpConfig]:
    """The distinct classes among ``configs``, each as its simplest member, in first-seen order."""
    seen: dict[str, FsdpConfig] = {}
    for cfg in configs:
        simplest = canonical(cfg, topology)
        seen.setdefault(simplest.key(), simplest)
    return list(seen.values())
