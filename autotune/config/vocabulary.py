"""The words both sides of a trial share: the choices of each knob, how a trial ended, and the error for a value
the vocabulary does not allow. Imports neither torch nor optuna."""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Mapping

FSDP_VERSIONS = (1, 2)
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
AUTO_WRAP_POLICIES = ("transformer_layer", "size_based", "none")
MIXED_PRECISIONS = ("fp32", "bf16", "bf16_fp32_reduce", "fp16")
ACTIVATION_CHECKPOINTING = ("none", "full", "every_other_layer", "selective")
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "none")
# FSDP2 only: after forward, parameters are resharded onto groups of this many ranks (None: the whole shard group).

# Which strategies keep parameters sharded after forward. FSDP2 spells the same
# choice as ``reshard_after_forward``; keeping one table makes the two agree.
RESHARD_AFTER_FORWARD = {
    "FULL_SHARD": True,
    "HYBRID_SHARD": True,
    "SHARD_GRAD_OP": False,
    "HYBRID_SHARD_ZERO2": False,
    "NO_SHARD": False,
}
HYBRID_STRATEGIES = ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


# "auto" picks CUDA + NCCL when GPUs are visible, else CPU + gloo.
DEVICES = ("auto", "cpu", "cuda")
# What starts a trial's torchrun agents when it spans several nodes (autotune.launch.multinode).
LAUNCHERS = ("local", "slurm")
# What picks a study's next configuration (autotune.study.search, or an Optuna sampler).
SEARCHES = ("autotune", "tpe", "gp", "random")


class Choice(str, enum.Enum):
    """A string enum: compares, hashes, prints and serializes as its value, as
    Python 3.11's StrEnum does (this package runs on 3.10 too)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Status(Choice):
    """How a trial's torchrun job ended (a TrialResult's status)."""

    OK = "ok"
    OOM = "oom"  # out of memory (on CUDA: under the allocator cap): does not fit
    CRASH = "crash"
    TIMEOUT = "timeout"
    ABORTED = "aborted"  # stopped after its first steps as hopeless
    NODE_LOST = "node_lost"  # a node of a multi-node trial went away


TRIAL_STATUSES = tuple(s.value for s in Status)


class ConfigError(ValueError):
    """A value or a combination the vocabulary does not allow; the message says why."""


def check_choice(name: str, value: Any, allowed: tuple) -> None:
    # bool is an int subclass: fsdp_version=True must not pass as 1.
    if isinstance(value, bool) and not all(isinstance(a, bool) for a in allowed):
        raise ConfigError(f"{name}={value!r} is not allowed; choose one of {list(allowed)}")
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not allowed; choose one of {list(allowed)}")


def check_type(name: str, value: Any, kind: type) -> None:
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{name}={value!r} must be an integer")
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be true or false")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{name}={value!r} must be a number")
    if kind is str and not isinstance(value, str):
        raise ConfigError(f"{name}={value!r} must be a string")


@functools.cache
def field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def from_mapping(cls: type, data: Mapping[str, Any], what: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what} must be a JSON object, got {type(data).__name__}")
    names = field_names(cls)
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{what} has unknown key(s) {unknown}; known keys: {sorted(names)}")
    return cls(**dict(data))
