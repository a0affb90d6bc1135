"""The work of one training step, as the fake step counted it: what the step-time model turns into seconds.

It holds no time: the same work runs at one speed on this host's CPU and at another on an H100, so a device
profile (:mod:`autotune.speed.device_profile`) is applied to it later, on the driver's side, and can be swapped
(a named GPU, a refit after measured trials) without stepping again.

- :class:`Work` is an amount of compute: each matmul by dtype and shape, each attention call, the bytes that
  memory-bound operators move, and how many kernels and operators that takes;
- :class:`CollectiveCall` is one collective: its kind, its bytes per rank, and the group it runs over;
- :class:`StepWork` is one fake step's work, by phase and by region (which block it belongs to, see
  :mod:`autotune.worker.step_moments`), with its collectives in the order they were issued.

The worker (:mod:`autotune.worker.work_counter`) fills it; JSON carries it to the driver unchanged.

>>> w = Work(matmuls={MatmulShape("bf16", 1, 256, 1024, 4096, "m"): 2})
>>> w.flops()
4294967296.0
>>> w.at_micro_batch(tokens=256, new_tokens=512).flops()
8589934592.0
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

# Bytes per element of the dtypes the counter names.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8, "fp8": 1, "int8": 1, "int32": 4, "int64": 8, "bool": 1}


class MatmulShape(NamedTuple):
    """``batch`` products of (m x k) @ (k x n) in ``dtype``; ``token_dim`` names the dimension that grows with the
    micro batch ("b", "m", "n" or "k"; "" for none), so the same work can be asked at another micro batch."""

    dtype: str
    batch: int
    m: int
    n: int
    k: int
    token_dim: str

    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    def bytes(self) -> float:
        """What the product reads and writes at least: both operands and the result."""
        return DTYPE_BYTES.get(self.dtype, 4) * self.batch * (self.m * self.k + self.k * self.n + self.m * self.n)

    def scaled(self, ratio: float) -> MatmulShape:
        if not self.token_dim:
            return self
        value = max(1, round(getattr(self, {"b": "batch"}.get(self.token_dim, self.token_dim)) * ratio))
        return self._replace(**{{"b": "batch"}.get(self.token_dim, self.token_dim): value})


class AttentionShape(NamedTuple):
    """Scaled dot-product attention over ``heads`` (batch x heads) of ``q_len`` queries and ``kv_len`` keys of
    ``head_dim``; ``backward`` for its gradient. ``heads`` grows with the micro batch."""

    dtype: str
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    causal: bool
    backward: bool

    def flops(self) -> float:
        """The conventional count (the flop counter's and MFU's): two matmuls forward, four backward, the whole
        score matrix (a causal mask halves what a kernel need do, not what the model is said to cost)."""
        forward = 4.0 * self.heads * self.q_len * self.kv_len * self.head_dim
        return 2 * forward if self.backward else forward

    def scaled(self, ratio: float) -> AttentionShape:
        return self._replace(heads=max(1, round(self.heads * ratio)))


def _merge(a: Mapping[Any, float], b: Mapping[Any, float], scale: float = 1.0) -> dict[Any, float]:
    out = dict(a)
    for key, count in b.items():
        out[key] = out.get(key, 0) + count * scale
    return out


@dataclass
class Work:
    """An amount of compute (counts may be fractional: the mean over several blocks)."""

    matmuls: dict[MatmulShape, float] = field(default_factory=dict)
    attention: dict[AttentionShape, float] = field(default_factory=dict)
    # FLOPs of counted operators that are neither (a convolution), by dtype.
    other_flops: dict[str, float] = field(default_factory=dict)
    # Bytes memory-bound kernels read and write: those whose tensors grow with the micro batch (activations), and
    # the rest (parameters, gradients, optimizer state, FSDP's copies of them); of each, the part in 16-bit
    # dtypes (a CPU converts them element by element, at about half its fp32 rate in bytes).
    token_bytes: float = 0.0
    fixed_bytes: float = 0.0
    token_half_bytes: float = 0.0
    fixed_half_bytes: float = 0.0
    # Kernels launched, and operators dispatched (views and metadata included: what the host spends issuing).
    kernels: float = 0.0
    ops: float = 0.0

    def flops(self) -> float:
        return (sum(s.flops() * n for s, n in self.matmuls.items())
                + sum(s.flops() * n for s, n in self.attention.items()) + sum(self.other_flops.values()))

    def __add__(self, other: Work) -> Work:
        return self.plus(other)

    def plus(self, other: Work, scale: float = 1.0) -> Work:
        """This work and ``scale`` times ``other`` (a negative scale takes it away, never below zero)."""
        def clip(d: dict[Any, float]) -> dict[Any, float]:
            return {k: v for k, v in d.items() if v > 1e-9}

        def add(name: str) -> float:
            return max(0.0, getattr(self, name) + scale * getattr(other, name))

        return Work(clip(_merge(self.matmuls, other.matmuls, scale)),
                    clip(_merge(self.attention, other.attention, scale)),
                    clip(_merge(self.other_flops, other.other_flops, scale)),
                    *(add(name) for name in SCALARS))

    def times(self, scale: float) -> Work:
        return Work().plus(self, scale)

    def memory_bound(self) -> Work:
        """This work less its matmuls and attention: what selective checkpointing recomputes."""
        counted = sum(self.matmuls.values()) + sum(self.attention.values())
        return dataclasses.replace(self, matmuls={}, attention={}, kernels=max(0.0, self.kernels - counted),
                                   ops=max(0.0, self.ops - counted))

    def at_micro_batch(self, tokens: int, new_tokens: int) -> Work:
        """The same work with ``new_tokens`` tokens per micro batch instead of ``tokens``: each matmul's token
        dimension, each attention's batch and the activations' bytes grow in proportion; the rest stays."""
        if tokens == new_tokens:
            return self
        ratio = new_tokens / tokens
        matmuls: dict[MatmulShape, float] = {}
        for shape, n in self.matmuls.items():
            scaled = shape.scaled(ratio)
            matmuls[scaled] = matmuls.get(scaled, 0) + n
        attention: dict[AttentionShape, float] = {}
        for a, n in self.attention.items():
            scaled_a = a.scaled(ratio)
            attention[scaled_a] = attention.get(scaled_a, 0) + n
        return dataclasses.replace(self, matmuls=matmuls, attention=attention,
                                   other_flops={k: v * ratio for k, v in self.other_flops.items()},
                                   token_bytes=self.token_bytes * ratio, token_half_bytes=self.token_half_bytes * ratio)

    @property
    def memory_bytes(self) -> float:
        return self.token_bytes + self.fixed_bytes

    @property
    def half_bytes(self) -> float:
        return self.token_half_bytes + self.fixed_half_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"matmuls": [[*s, n] for s, n in self.matmuls.items()],
                "attention": [[*a, n] for a, n in self.attention.items()],
                "other_flops": dict(self.other_flops), **{name: getattr(self, name) for name in SCALARS}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Work:
        return cls({MatmulShape(*row[:-1]): row[-1] for row in data.get("matmuls", [])},
                   {AttentionShape(*row[:-1]): row[-1] for row in data.get("attention", [])},
                   dict(data.get("other_flops", {})), *(float(data.get(name, 0.0)) for name in SCALARS))


# The plain numbers of a Work, in field order.
SCALARS = ("token_bytes", "fixed_bytes", "token_half_bytes", "fixed_half_bytes", "kernels", "ops")


class CollectiveCall(NamedTuple):
    """One collective as the step issued it: ``bytes`` per rank (what an all-gather gathers, what a
    reduce-scatter or all-reduce reduces), over ``group`` ranks spread across ``nodes`` nodes."""

    kind: str  # all_gather, reduce_scatter, all_reduce, broadcast, all_to_all, barrier
    bytes: int
    group: int
    nodes: int
    phase: str
    region: str


# What a region key says: "forward0/start", "backward1/3", "backward0/3/recompute", "optimizer/all".
RECOMPUTE = "recompute"


@dataclass
class StepWork:
    """One fake step's work (one copy of the model, ``depth`` blocks deep), by "phase/region" key."""

    depth: int
    micro_batch_size: int
    seq_len: int
    micro_batches: int
    regions: dict[str, Work] = field(default_factory=dict)
    collectives: list[CollectiveCall] = field(default_factory=list)
    # Elements of the parameters the optimizer steps on this rank (its shard), of the whole model (the copy
    # stepped), and of the parameters that train (LoRA: its adapters).
    optimizer_numel: int = 0
    param_numel: int = 0
    trainable_numel: int = 0

    @property
    def trainable_fraction(self) -> float:
        return min(1.0, self.trainable_numel / self.param_numel) if self.param_numel and self.trainable_numel \
            else 1.0

    @property
    def tokens(self) -> int:
        """Tokens of one micro batch on one rank."""
        return self.micro_batch_size * self.seq_len

    def total(self, prefix: str = "") -> Work:
        out = Work()
        for key, work in self.regions.items():
            if key.startswith(prefix):
                out = out + work
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"depth": self.depth, "micro_batch_size": self.micro_batch_size, "seq_len": self.seq_len,
                "micro_batches": self.micro_batches,
                "regions": {k: w.to_dict() for k, w in self.regions.items()},
                "collectives": [list(c) for c in self.collectives],
                "optimizer_numel": self.optimizer_numel, "param_numel": self.param_numel,
                "trainable_numel": self.trainable_numel}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepWork:
        return cls(int(data["depth"]), int(data["micro_batch_size"]), int(data["seq_len"]),
                   int(data["micro_batches"]), {k: Work.from_dict(w) for k, w in data.get("regions", {}).items()},
                   [CollectiveCall(*c) for c in data.get("collectives", [])], int(data.get("optimizer_numel", 0)),
                   int(data.get("param_numel", 0)), int(data.get("trainable_numel", 0)))
