"""Count the work of a fake training step: every operator's FLOPs or bytes and every collective, by moment.

The memory estimate already runs the trial's whole training step under fake tensors
(:mod:`autotune.worker.fake_step`); this dispatch mode rides along and counts what each operator would cost,
without running anything: the matmuls by dtype and shape (their FLOPs by torch's own flop formulas), scaled
dot-product attention by its shapes, the bytes memory-bound operators read and write, the kernels and operators
issued, and each collective with its bytes and the group it runs over. Counts are kept by the moment they happen
in (:mod:`autotune.worker.step_moments`): phase, region (block), and whether a checkpointed block is being
recomputed. The driver turns them into seconds with a device profile (:mod:`autotune.speed`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from autotune.config.step_work import RECOMPUTE, AttentionShape, CollectiveCall, MatmulShape, StepWork, Work
from autotune.worker.step_moments import StepMoments

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
               torch.int64: "int64", torch.int32: "int32", torch.int8: "int8", torch.bool: "bool",
               torch.uint8: "int8"}

# Operators that launch no kernel: views, metadata, allocation, the profiler's records.
NO_KERNEL = {"aten._unsafe_view", "aten.alias", "aten.detach", "aten.lift_fresh", "aten._local_scalar_dense",
             "aten.empty", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided", "aten.empty_like",
             "aten.set_", "aten.resize_", "aten._has_compatible_shallow_copy_type", "aten.sym_size",
             "aten.sym_stride", "aten.sym_numel", "aten.is_same_size", "aten._to_copy_meta"}

# c10d's collectives (and the functional ones DTensor uses) by what they do.
COLLECTIVES = {
    "c10d._allgather_base_": "all_gather", "c10d.allgather_": "all_gather",
    "c10d.allgather_into_tensor_coalesced_": "all_gather", "c10d._reduce_scatter_base_": "reduce_scatter",
    "c10d.reduce_scatter_": "reduce_scatter", "c10d.reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d.allreduce_": "all_reduce", "c10d.allreduce_coalesced_": "all_reduce", "c10d.broadcast_": "broadcast",
    "c10d.alltoall_base_": "all_to_all", "c10d.alltoall_": "all_to_all", "c10d.barrier": "barrier",
    "_c10d_functional.all_gather_into_tensor": "all_gather", "_c10d_functional.reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional.all_reduce": "all_reduce", "_c10d_functional.all_reduce_": "all_reduce",
    "_c10d_functional.broadcast": "broadcast", "_c10d_functional.all_to_all_single": "all_to_all",
}
# Collectives whose bytes per rank are their output's (what an all-gather gathers), not their input's.
BY_OUTPUT = ("all_gather",)

# Attention operators: where q, k and v are among the tensor arguments, and whether it is the gradient.
ATTENTION = {
    "aten._scaled_dot_product_flash_attention_for_cpu": (0, False),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": (1, True),
    "aten._scaled_dot_product_flash_attention": (0, False),
    "aten._scaled_dot_product_flash_attention_backward": (1, True),
    "aten._scaled_dot_product_efficient_attention": (0, False),
    "aten._scaled_dot_product_efficient_attention_backward": (1, True),
    "aten._scaled_dot_product_cudnn_attention": (0, False),
    "aten._scaled_dot_product_cudnn_attention_backward": (1, True),
    "aten._flash_attention_forward": (0, False), "aten._flash_attention_backward": (1, True),
    "aten._efficient_attention_forward": (0, False), "aten._efficient_attention_backward": (1, True),
}
MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._grouped_mm")


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


class WorkCounter(TorchDispatchMode):
    """Counts each operator's work into the current moment's :class:`Work` (see the module)."""

    def __init__(self, moments: StepMoments, micro_batch_size: int, seq_len: int, nnodes: int = 1,
                 param_shapes: frozenset[tuple[int, ...]] = frozenset()) -> None:
        super().__init__()
        self.moments = moments
        # The model's parameters' own shapes: a tensor shaped like one holds no micro batch's tokens.
        self.param_shapes = param_shapes
        self.micro_batch_size, self.seq_len = micro_batch_size, seq_len
        self.tokens = micro_batch_size * seq_len
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.node_size = max(1, self.world // max(1, nnodes))
        self.regions: dict[str, Work] = {}
        self.collectives: list[CollectiveCall] = []
        self._kinds: dict[Any, tuple[str, str]] = {}
        self._groups: dict[Any, tuple[int, int]] = {}

    def step_work(self, depth: int, micro_batches: int, optimizer_numel: int, param_numel: int,
                  trainable_numel: int) -> StepWork:
        return StepWork(depth, self.micro_batch_size, self.seq_len, micro_batches, dict(self.regions),
                        list(self.collectives), optimizer_numel, param_numel, trainable_numel)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind, name = self._kind(func)
        if kind != "skip":
            self._count(kind, name, func, args, kwargs, out)
        return out

    def _kind(self, func: Any) -> tuple[str, str]:
        known = self._kinds.get(func)
        if known is None:
            known = self._kinds[func] = operator_kind(func)
        return known

    def _work(self) -> Work:
        m = self.moments
        key = f"{m.phase}/{m.region}" + (f"/{RECOMPUTE}" if m.recomputing else "")
        work = self.regions.get(key)
        if work is None:
            work = self.regions[key] = Work()
        return work

    def _count(self, kind: str, name: str, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if kind == "collective":
            self._collective(name, args, kwargs, out)
            return
        work = self._work()
        work.ops += 1
        if kind == "view":
            return
        work.kernels += 1
        if kind == "matmul" and self._matmul(work, name, args):
            return
        if kind == "attention" and self._attention(work, name, args, kwargs):
            return
        if kind == "counted" and self._counted(work, func, args, kwargs, out):
            return
        self._memory_bound(work, name, func, args, kwargs, out)

    def _counted(self, work: Work, func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
        """An operator torch's flop counter has a formula for (a convolution): its FLOPs, by its input's dtype."""
        try:
            flops = float(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
        except Exception:  # noqa: BLE001 - a formula that cannot read these arguments: counted as bytes instead
            return False
        first = next((t for t in tree_leaves(args) if isinstance(t, torch.Tensor)), None)
        dtype = dtype_name(first.dtype) if first is not None else "fp32"
        work.other_flops[dtype] = work.other_flops.get(dtype, 0.0) + flops
        return True

    def _matmul(self, work: Work, name: str, args: tuple) -> bool:
        dims = matmul_dims(name, args)
        if dims is None:
            return False
        dtype, batch, m, n, k = dims
        shape = MatmulShape(dtype, batch, m, n, k, self._token_dim(batch, m, n, k))
        work.matmuls[shape] = work.matmuls.get(shape, 0) + 1
        return True

    def _token_dim(self, batch: int, m: int, n: int, k: int) -> str:
        """Which dimension grows with the micro batch: a batched product's batch when it holds whole samples (eager
        attention's heads), else the one that is this micro batch's tokens, rows first (a linear layer's input and
        its gradient), then the contraction (its weight's gradient)."""
        if batch > 1 and batch % self.micro_batch_size == 0 and self.micro_batch_size > 1:
            return "b"
        for name, value in (("m", m), ("k", k), ("n", n)):
            if value == self.tokens:
                return name
        return "b" if batch > 1 else ""

    def _attention(self, work: Work, name: str, args: tuple, kwargs: dict) -> bool:
        shape = attention_shape(name, args, kwargs)
        if shape is not None:
            work.attention[shape] = work.attention.get(shape, 0) + 1
        return shape is not None

    def _memory_bound(self, work: Work, name: str, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        seen: set[int] = set()
        leaves = [_local(t) for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        # An operator that writes into an argument reads and writes it.
        written = [_local(t) for t in tree_leaves(args[:1]) if isinstance(t, torch.Tensor)] if name.endswith("_") \
            else []
        unique = []
        for t in leaves:
            if id(t) not in seen:
                seen.add(id(t))
                unique.append(t)
        for t in unique + written:
            size = t.numel() * t.element_size()
            half = t.element_size() == 2 and t.is_floating_point()
            if self._is_activation(t):
                work.token_bytes += size
                work.token_half_bytes += size if half else 0
            else:
                work.fixed_bytes += size
                work.fixed_half_bytes += size if half else 0

    def _is_activation(self, t: torch.Tensor) -> bool:
        """Whether a tensor holds this micro batch's samples: (batch, seq, ...), (batch, heads, seq, ...), or its
        tokens flattened into the first dimension."""
        shape = t.shape
        if len(shape) >= 2 and shape[0] == self.micro_batch_size and self.seq_len in shape[1:3]:
            return True
        return len(shape) >= 1 and shape[0] == self.tokens and tuple(shape) not in self.param_shapes

    def _collective(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        size, nodes = self._group(args, kwargs)
        m = self.moments
        self.collectives.append(CollectiveCall(COLLECTIVES[name], payload_bytes(name, args, out), size, nodes,
                                               m.phase, str(m.region)))
        self._work().ops += 1

    def _group(self, args: tuple, kwargs: dict) -> tuple[int, int]:
        """(ranks, nodes) of the collective's process group, by the group's name (a boxed group is a new object at
        every call: its id names nothing for long)."""
        group = next((a for a in tree_leaves((args, kwargs)) if isinstance(a, (torch.ScriptObject, str))
                      and not isinstance(a, bool)), None)
        pg = _process_group(group) if group is not None else None
        if pg is None:
            return self.world, -(-self.world // self.node_size)
        name = str(getattr(pg, "group_name", id(pg)))
        known = self._groups.get(name)
        if known is None:
            ranks = list(dist.get_process_group_ranks(pg))
            known = self._groups[name] = (len(ranks), len({r // self.node_size for r in ranks}))
        return known


def operator_kind(func: Any) -> tuple[str, str]:
    """(what the counter does with an operator, its name): skip, collective, attention, matmul, view, kernel."""
    name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
    if name.startswith("profiler."):
        kind = "skip"
    elif name.startswith("prim."):  # metadata (prim.device): answered on the host
        kind = "view"
    elif name in COLLECTIVES:
        kind = "collective"
    elif name in ATTENTION:
        kind = "attention"
    elif name in MATMULS:
        kind = "matmul"
    elif name in NO_KERNEL or getattr(func, "is_view", False):
        kind = "view"
    elif getattr(func, "overloadpacket", None) in flop_registry:
        kind = "counted"
    else:
        kind = "kernel"
    return kind, name


def _process_group(group: Any) -> Any:
    """The ProcessGroup a collective names (boxed, or a functional collective's group name), or None."""
    try:
        if isinstance(group, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            return _resolve_process_group(group)  # type: ignore[arg-type]  # a group name is its str
        return torch._C._distributed_c10d.ProcessGroup.unbox(group)
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return None


def matmul_dims(name: str, args: tuple) -> tuple[str, int, int, int, int] | None:
    """(dtype, batch, m, n, k) of a matmul operator's (m x k) @ (k x n) products, or None for a form not known."""
    tensors = [_local(a) for a in args if isinstance(a, torch.Tensor)]
    if name in ("aten.addmm", "aten.baddbmm"):
        tensors = tensors[1:]
    if len(tensors) < 2:
        return None
    a, b = tensors[0], tensors[1]
    if a.dim() == 2 and b.dim() == 2:
        batch, (m, k), n = 1, a.shape, b.shape[1]
    elif a.dim() == 3 and b.dim() == 3:
        batch, m, k, n = a.shape[0], a.shape[1], a.shape[2], b.shape[2]
    elif a.dim() == 2 and b.dim() == 3:  # grouped: each row of a meets one expert of b
        batch, (m, k), n = 1, a.shape, b.shape[-1]
    else:
        return None
    return dtype_name(a.dtype), int(batch), int(m), int(n), int(k)


def attention_shape(name: str, args: tuple, kwargs: dict) -> AttentionShape | None:
    """An attention operator's shape, from its q and k (b, heads, length, head_dim), or None."""
    first, backward = ATTENTION[name]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len(tensors) < first + 3 or tensors[first].dim() != 4:
        return None
    q, k = tensors[first], tensors[first + 1]
    causal = bool(kwargs.get("is_causal", False)) or any(a is True for a in args if isinstance(a, bool))
    return AttentionShape(dtype_name(q.dtype), int(q.shape[0] * q.shape[1]), int(q.shape[2]), int(k.shape[2]),
                          int(q.shape[3]), causal, backward)


def payload_bytes(name: str, args: tuple, out: Any) -> int:
    """A collective's bytes per rank: what an all-gather gathers, what a reduce-scatter, all-reduce or all-to-all
    reduces or sends."""
    kind = COLLECTIVES[name]
    if name.startswith("_c10d_functional"):
        # (input, ...) -> output: an all-gather's payload is what it returns.
        payload = out if kind in BY_OUTPUT else args[:1]
    else:
        # c10d's ops take (outputs, inputs, ...): an all-gather's payload is its outputs, a reduce-scatter's and
        # an all-to-all's their inputs; an all-reduce and a broadcast work on their one list in place.
        payload = args[1:2] if kind in ("reduce_scatter", "all_to_all") else args[:1]
    return int(sum(_local(t).numel() * _local(t).element_size() for t in tree_leaves(payload)
                   if isinstance(t, torch.Tensor)))


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes an operator on ``t`` touches on this rank: a DTensor's local shard (its operators
    run again on the shard inside DTensor's dispatch, which a mode that is handling the outer call does not see)."""
    return getattr(t, "_local_tensor", t)


def optimizer_numel(optimizer: torch.optim.Optimizer) -> int:
    """Elements of this rank's shards of the parameters the optimizer steps."""
    return sum(int(_local(p).numel()) for group in optimizer.param_groups for p in group["params"] if p.requires_grad)

