"""One FSDP configuration: what the tuner searches over, what a trial applies and what is exported.

>>> cfg = FsdpConfig(fsdp_version=1, sharding_strategy="SHARD_GRAD_OP")
>>> cfg.reshard_after_forward
False
>>> FsdpConfig.from_dict(cfg.to_dict()) == cfg
True
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

from autotune.config.dimensions import DIMENSIONS, describe, reshards_partially
from autotune.config.vocabulary import (
    HYBRID_STRATEGIES,
    RESHARD_AFTER_FORWARD,
    ConfigError,
    check_type,
    field_names,
    from_mapping,
)


@dataclass(frozen=True)
class FsdpConfig:
    """One FSDP configuration: what the tuner searches over and what it exports.

    Field names follow PyTorch's FSDP1 arguments; where FSDP2 has no such argument
    the worker maps the field onto FSDP2's own mechanism (a 2-D mesh for NO_SHARD
    and hybrid sharding, ``reshard_after_forward`` for the strategy, explicit
    ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``).
    """

    fsdp_version: int = 2
    sharding_strategy: str = "FULL_SHARD"
    auto_wrap_policy: str = "transformer_layer"
    # Class names of the model's repeated block; empty means "the model's
    # ``_no_split_modules``", resolved by the driver's model probe before export.
    transformer_layer_cls: tuple[str, ...] = ()
    min_num_params: int = 100_000_000
    mixed_precision: str = "fp32"
    activation_checkpointing: str = "none"
    forward_prefetch: bool = False
    backward_prefetch: str = "BACKWARD_PRE"
    limit_all_gathers: bool = True
    # Hybrid strategies: ranks per shard group (replicated across the groups);
    # None: one node's ranks. Must divide the world size.
    shard_group_size: int | None = None
    cpu_offload: bool = False
    # torch.compile each repeated block before sharding, as torchtitan does.
    compile: bool = False
    # FSDP2 FULL_SHARD / HYBRID_SHARD: after forward, parameters are resharded onto groups of this
    # many ranks (fully_shard's reshard_after_forward as an int: the backward all-gather stays within
    # the group, one node's ranks for example), not the whole shard group; None: the whole group.
    reshard_group_size: int | None = None
    micro_batch_size: int = 1
    # Derived from sharding_strategy when left as None; given explicitly it must agree.
    reshard_after_forward: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.transformer_layer_cls, str):
            object.__setattr__(self, "transformer_layer_cls", (self.transformer_layer_cls,))
        elif isinstance(self.transformer_layer_cls, list):
            object.__setattr__(self, "transformer_layer_cls", tuple(self.transformer_layer_cls))
        self._validate()
        if self.reshard_after_forward is None:
            object.__setattr__(
                self, "reshard_after_forward", RESHARD_AFTER_FORWARD[self.sharding_strategy]
            )

    def _validate(self) -> None:
        for dimension in DIMENSIONS:
            dimension.check(getattr(self, dimension.name))
        for cls_name in self.transformer_layer_cls:
            if not isinstance(cls_name, str) or not cls_name.isidentifier():
                raise ConfigError(f"transformer_layer_cls entry {cls_name!r} is not a class name")
        if self.reshard_after_forward is not None:
            check_type("reshard_after_forward", self.reshard_after_forward, bool)
            implied = RESHARD_AFTER_FORWARD[self.sharding_strategy]
            if self.reshard_after_forward != implied:
                raise ConfigError(
                    f"reshard_after_forward={self.reshard_after_forward} contradicts "
                    f"sharding_strategy={self.sharding_strategy}, which implies {implied}; "
                    "choose the strategy and leave reshard_after_forward unset"
                )
        if self.shard_group_size is not None and not self.is_hybrid:
            raise ConfigError(f"shard_group_size={self.shard_group_size} applies to hybrid sharding only "
                              f"(HYBRID_SHARD, HYBRID_SHARD_ZERO2), not {self.sharding_strategy}")
        if self.reshard_group_size is not None and not reshards_partially(self.to_dict()):
            raise ConfigError(f"reshard_group_size={self.reshard_group_size} applies to FSDP2 with FULL_SHARD or "
                              f"HYBRID_SHARD only, not FSDP{self.fsdp_version} {self.sharding_strategy}")
        if self.fsdp_version == 2:
            # FSDP2 always prefetches the next module's all-gather before its
            # backward (an empty explicit list falls back to that default), and it
            # has no post-backward prefetch and no all-gather rate limiter to turn
            # off: these FSDP1 knobs have no FSDP2 counterpart.
            if self.backward_prefetch != "BACKWARD_PRE":
                raise ConfigError(
                    f"backward_prefetch={self.backward_prefetch} is FSDP1-only: FSDP2 always "
                    "prefetches before backward; use BACKWARD_PRE with fsdp_version=2"
                )
            if not self.limit_all_gathers:
                raise ConfigError(
                    "limit_all_gathers=false is FSDP1-only: FSDP2 bounds in-flight all-gathers "
                    "itself; leave it true with fsdp_version=2"
                )

    @property
    def is_hybrid(self) -> bool:
        return self.sharding_strategy in HYBRID_STRATEGIES

    def to_dict(self) -> dict[str, Any]:
        # Every field is a scalar but the class tuple; asdict's deep copy cost
        # most of a replayed study's time, which compares keys of every trial.
        data = {name: getattr(self, name) for name in field_names(FsdpConfig)}
        data["transformer_layer_cls"] = list(self.transformer_layer_cls)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FsdpConfig:
        return from_mapping(cls, data, "fsdp config")

    def replace(self, **changes: Any) -> FsdpConfig:
        # reshard_after_forward is derived: let it follow a changed strategy.
        if "sharding_strategy" in changes and "reshard_after_forward" not in changes:
            changes["reshard_after_forward"] = None
        return dataclasses.replace(self, **changes)

    def key(self) -> str:
        """A canonical string: equal keys mean the same configuration to measure."""
        cached = self.__dict__.get("_key")
        if cached is None:
            cached = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
            object.__setattr__(self, "_key", cached)  # frozen: computed once, never changes
        return cached

    def describe(self) -> str:
        """A short human label, for progress lines and tables."""
        return describe(self.to_dict())
