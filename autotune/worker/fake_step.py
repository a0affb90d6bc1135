"""Predict a configuration's peak memory per rank without the hardware.

One real training step runs under ``FakeTensorMode`` with PyTorch's ``fake``
process group: the model is built, checkpointed and wrapped with FSDP1 or FSDP2
exactly as a trial does it, at the real world size, but every tensor is fake, so
nothing is allocated and no collective moves data. The live-storage tracker the
CPU trials use counts the fake tensors, so the prediction and the CPU
measurement are the same quantity. Saved-tensor hooks tell activations apart.

``python -m autotune.worker.fake_step --serve`` answers one JSON request per
line on stdin with one JSON line on stdout, so the driver pays the imports once.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils.weak import WeakIdKeyDictionary

from autotune.config import FsdpConfig, LoraSpec, accumulation_steps
from autotune.config.dimensions import shard_ranks
from autotune.worker.fsdp import build_mesh, make_grad_scaler, parallelize
from autotune.worker.measure import LiveStorageTracker
from autotune.worker.models import BuiltModel, apply_lora, block_count, build_model, is_mixture_of_experts
from autotune.worker.train import accumulate, make_optimizer, train_step

METHOD = "fake_tensor_step"


# What CPU offload keeps in host memory.
HOST_GROUPS = ("parameters", "gradients", "optimizer_state")


class BreakdownTracker(LiveStorageTracker):
    """The live-storage peak at each kind of moment of the step, split by what each storage holds then.

    A moment's kind is its phase (each micro batch's forward and backward,
    then the optimizer step) and where in the stack of blocks it falls:
    before the first block (``start``), in one of the first few blocks
    (``head0``, ``head1``...), in one of the last few (``tail0`` is the last),
    in between (``middle``), or after the last block (``end``). Backward
    runs the blocks in reverse and names its moments after the forward region
    whose saved tensors (or recomputed block) it is working on.

    Why: a deep model's peak is extrapolated from two shallow copies, and
    each kind of moment's live bytes are affine in the number of identical
    blocks, but the step's peak is not: it is the largest of them, and which
    kind that is can change with depth. A shallow copy may peak at the start
    of backward, with its activations, and the whole model at the end, when
    its gradients are reduced, or in the optimizer step, with its larger
    state (a 10-block Qwen2 at size-based wrapping peaked 6% above the line
    through 3 and 4 blocks; autotune issue 35). So every kind is
    extrapolated on its own and the largest taken (:func:`estimate_config`).
    Blocks between the first and the last few repeat the same moments with
    a drift linear in their index, so they never exceed both ends.

    ``parameters`` and ``gradients`` are the sharded ones, as they are when the
    step starts: a unit's all-gathered parameters and its unsharded gradients
    are temporaries. With ``offloaded``, those sharded parameters and their
    gradients and the optimizer state are left out of every figure: CPU
    offload keeps them in host memory.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, fake_mode: FakeTensorMode,
                 blocks: Sequence[torch.nn.Module] = (), period: int = 1, offloaded: bool = False) -> None:
        super().__init__(fake_mode=fake_mode)
        self.model = model
        self.optimizer = optimizer
        self.blocks = list(blocks)
        # Blocks at each end that are moments of their own: one more than the pattern's period.
        self.ends = period + 1
        self.offloaded = offloaded
        # Saved activations, and the region each was saved in.
        self.saved: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.phase = "setup"
        self.region: int | str = "all"
        # "phase/kind" -> (its peak bytes, their breakdown)
        self.peaks: dict[str, tuple[int, dict[str, int]]] = {}
        self._sharded: list[torch.nn.Parameter] = []

    def __enter__(self) -> BreakdownTracker:
        # The step starts resharded: what the model holds now is what FSDP keeps between steps.
        self._sharded = list(self.model.parameters())
        super().__enter__()
        return self

    def enter(self, phase: str, region: int | str) -> None:
        self.phase, self.region = phase, region

    def watch(self, micro_batches: int) -> list[Any]:
        """Hooks that name the moment as the step goes (see the class); returns their handles."""
        count = [-1]

        def forward(*_: Any) -> None:
            count[0] = min(count[0] + 1, micro_batches - 1)
            self.enter(f"forward{count[0]}", "start")

        def block(index: int) -> Callable[..., None]:
            # Forward, or its recomputation in backward (checkpointed blocks).
            return lambda *_: setattr(self, "region", index)

        hooks = [self.model.register_forward_pre_hook(forward),
                 # Backward starts with what forward did last.
                 self.model.register_forward_hook(lambda *_: self.enter(f"backward{count[0]}", "end")),
                 self.optimizer.register_step_pre_hook(lambda *_: self.enter("optimizer", "all"))]
        hooks += [b.register_forward_pre_hook(block(i)) for i, b in enumerate(self.blocks)]
        if self.blocks:
            hooks.append(self.blocks[-1].register_forward_hook(lambda *_: setattr(self, "region", "end")))
        return hooks

    def kinds(self) -> list[str]:
        """The kinds of the current moment: a block near both ends is both a head and a tail."""
        if not isinstance(self.region, int):
            return [f"{self.phase}/{self.region}"]
        i, last = self.region, len(self.blocks) - 1
        kinds = [f"{self.phase}/head{i}"] if i < self.ends else []
        kinds += [f"{self.phase}/tail{last - i}"] if last - i < self.ends else []
        return kinds or [f"{self.phase}/middle"]

    @property
    def breakdown(self) -> dict[str, int]:
        """The breakdown at the step's peak."""
        return max(self.peaks.values(), key=lambda p: p[0])[1] if self.peaks else {}

    def moment_figures(self) -> dict[str, dict[str, Any]]:
        return {kind: {"peak_bytes": peak, "breakdown": dict(split)} for kind, (peak, split) in self.peaks.items()}

    def pack(self, tensor: torch.Tensor) -> Any:
        try:
            self.saved[tensor.untyped_storage()] = None
        except (RuntimeError, NotImplementedError):
            pass
        return tensor, self.region

    def unpack(self, packed: Any) -> torch.Tensor:
        # Backward is working on what this region saved.
        tensor, self.region = packed
        return tensor

    def _update_peak(self) -> int:
        current = sum(s.nbytes() for s in list(self._storages.keys()))
        groups = None
        if self.offloaded:
            groups = self._groups()
            current -= sum(s.nbytes() for name in HOST_GROUPS for s in groups[name].values())
        self.peak_bytes = max(self.peak_bytes, current)
        for kind in self.kinds():
            best = self.peaks.get(kind)
            if best is None or current > best[0]:
                groups = groups or self._groups()
                self.peaks[kind] = (current, self._split(current, groups))
        return current

    def _groups(self) -> dict[str, dict[int, Any]]:
        def storages(tensors) -> dict[int, Any]:
            found = {}
            for t in tensors:
                local = getattr(t, "_local_tensor", t)
                try:
                    s = local.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                found[id(s)] = s
            return found

        return {"parameters": storages(self._sharded),
                "gradients": storages(p.grad for p in self._sharded if p.grad is not None),
                "optimizer_state": storages(v for s in self.optimizer.state.values() for v in s.values()
                                            if isinstance(v, torch.Tensor))}

    def _split(self, current: int, groups: dict[str, dict[int, Any]]) -> dict[str, int]:
        groups = {**groups, "activations": {id(s): s for s in list(self.saved.keys())}}
        seen: set[int] = set()
        split = {}
        for name, group in groups.items():
            split[name] = 0 if self.offloaded and name in HOST_GROUPS else \
                sum(s.nbytes() for k, s in group.items() if k not in seen)
            seen.update(group)
        split["temporaries"] = max(0, current - sum(split.values()))
        return split


def add_fake_adapters(built: BuiltModel, lora: LoraSpec) -> None:
    """LoRA's adapters on a fake-tensor model, as :func:`apply_lora` puts them on a trial's.

    peft moves each new adapter to its base layer's device with ``.to()``,
    which cannot swap a fake parameter (torch 2.13: "Couldn't swap
    Linear.weight"). So peft runs outside the fake mode, making its adapters
    on the meta device, and each gets fake storage of its shape here.
    """
    with unset_fake_temporarily():
        built.module, built.lora_targets = apply_lora(built.module, lora)
    for module in built.module.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                fake = torch.empty(param.shape, dtype=param.dtype, device="cpu")
                module.register_parameter(name, torch.nn.Parameter(fake, requires_grad=param.requires_grad))


def fake_train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, scaler,
                    micro_batches: int = 1) -> None:
    """``train_step`` as a fake tensor can run it.

    The grad scaler's ``step`` and ``update`` read whether any gradient was
    inf (a data-dependent ``.item()``), which fake tensors cannot answer. The
    scaler's public pieces do the same work without that read: unscale (its
    inverse scale, the found-inf flag and their all-reduce are counted), the
    optimizer step a finite step takes, and the scale reset to a given value.
    """
    if scaler is None:
        train_step(model, optimizer, tokens, scaler, micro_batches)
        return
    accumulate(model, tokens, micro_batches, scaler)
    scaler.unscale_(optimizer)
    optimizer.step()
    scaler.update(new_scale=FP16_SCALE)
    optimizer.zero_grad(set_to_none=True)


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state as its first step creates it (a step count, two moments per
    parameter), without that step: a fake step costs a second or two, and a
    first training step gave the same peak as this, to within 136 bytes, over
    FSDP1 and FSDP2, every sharding, checkpointing and precision, with and
    without gradient accumulation."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                optimizer.state[p] = {"step": torch.tensor(0.0),
                                      "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                      "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


@contextlib.contextmanager
def grouped_mm_in_any_dtype() -> Iterator[None]:
    """Mixture-of-experts blocks through transformers' own grouped matmul where
    fake tensors cannot run torch's in the trial's dtype.

    transformers runs a block's experts with ``torch._grouped_mm`` on CPU in
    any dtype, but its fake-tensor kernel takes bf16 only ("Expected inputs of
    BF16 type but got mat_a.dtype=torch.float32", torch 2.13): every fp32 and
    fp16 estimate of a Mixtral failed. transformers' fallback op has a fake
    kernel for every dtype, and like the grouped matmul it makes one output and
    saves its two inputs for backward: the same memory.
    """
    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return
    def in_bf16_only(input: Any, weight: Any, offs: Any) -> bool:
        return weight.dtype == torch.bfloat16 and original(input, weight, offs)

    moe._can_use_grouped_mm = in_bf16_only
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


@contextlib.contextmanager
def real_post_forward_meshes() -> Iterator[None]:
    """FSDP2's partial resharding (``reshard_after_forward`` as an int) built outside fake mode.

    ``fully_shard`` builds the post-forward device mesh from a view of the mesh's rank tensor and reads
    its ranks back: under fake mode the view is a fake tensor and the read is data-dependent
    ("DataDependentOutputException: aten._local_scalar_dense", torch 2.13). The mesh is real metadata,
    as the trial's mesh is, so it is built with real tensors.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

    name = "_get_post_forward_mesh_info"
    original = getattr(_fsdp_init, name)

    def built_for_real(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    patched = [m for m in (_fsdp_init, _fully_shard) if getattr(m, name, None) is original]
    for module in patched:
        setattr(module, name, built_for_real)
    try:
        yield
    finally:
        for module in patched:
            setattr(module, name, original)


# Any value will do: the scale is one float, whatever it holds.
FP16_SCALE = 2.0**16


# c10d's collectives as a fake tensor runs them: each returns its output and a finished work.
_COLLECTIVES = {
    "broadcast_": True, "allreduce_": True, "allgather_": True, "_allgather_base_": True, "reduce_scatter_": True,
    "_reduce_scatter_base_": True, "scatter_": True, "alltoall_": True, "reduce_": False, "gather_": False,
    "alltoall_base_": False, "barrier": False, "send": False, "recv_": False, "recv_any_source_": False,
}
_fake_collectives: list[Any] = []


def register_fake_collectives() -> None:
    """Fake kernels for c10d's collectives where torch has none of its own.

    torch 2.11 registers them (``torch.distributed._meta_registrations``);
    before it, a fake step fails on its first collective
    (``UnsupportedOperatorException: c10d._allgather_base_.default``, torch
    2.6 and 2.9). Each kernel returns the collective's first argument and a
    work that is already done, as 2.11's do: no data moves in a fake step.
    """
    import importlib.util

    if _fake_collectives:
        return
    if importlib.util.find_spec("torch.distributed._meta_registrations") is not None:
        _fake_collectives.append(importlib.import_module("torch.distributed._meta_registrations"))
        return
    from torch._C import _distributed_c10d as c10d

    def done() -> Any:
        if hasattr(c10d, "FakeWork"):
            return c10d.FakeWork().boxed()
        # torch < 2.9 has no FakeWork: a work made from a future that has its result.
        future: torch.futures.Future[None] = torch.futures.Future()
        future.set_result(None)
        return c10d._create_work_from_future(future).boxed()  # type: ignore[attr-defined]  # torch < 2.9 only

    def kernel(returns_first: bool) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            return (args[0], done()) if returns_first else done()
        return run

    library = torch.library.Library("c10d", "IMPL")
    for name, returns_first in _COLLECTIVES.items():
        try:
            library.impl(name, kernel(returns_first), "Meta")
        except RuntimeError:  # an op this version does not have
            continue
    _fake_collectives.append(library)


def estimate(model: str, world_size: int, nnodes: int, seq_len: int, cfg: FsdpConfig, grad_accum_steps: int = 1,
             num_blocks: int | None = None, lora: LoraSpec | None = None, offloaded: bool = False) -> dict[str, Any]:
    """Peak bytes per rank of one steady-state training step, its breakdown, and
    the peak of each kind of moment (``moments``: see :class:`BreakdownTracker`).

    With gradient accumulation the step runs two micro batches, the first
    unsynced: from the second on, the accumulated unsharded gradients are held
    as they are in every later one, so two show the peak of any number.
    ``offloaded`` leaves out what CPU offload keeps in host memory."""
    micro_batches = min(grad_accum_steps, 2)
    if world_size % nnodes:
        raise ValueError(f"world size {world_size} is not a multiple of nnodes {nnodes}")
    start = time.perf_counter()
    register_fake_collectives()
    if not dist.is_initialized() or dist.get_world_size() != world_size:
        if dist.is_initialized():
            dist.destroy_process_group()
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    # The mesh is real metadata; only tensors are fake.
    mesh = build_mesh("cpu", cfg.sharding_strategy, world_size, nnodes, cfg.shard_group_size)
    partial_reshard = real_post_forward_meshes() if cfg.reshard_group_size else contextlib.nullcontext()
    with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode, grouped_mm_in_any_dtype(), partial_reshard:
        built = build_model(model, cfg.transformer_layer_cls, device="cpu", num_blocks=num_blocks)
        if lora is not None:
            add_fake_adapters(built, lora)
        num_params = built.count_parameters()[0]
        wrapped = parallelize(built.module, built.layers, cfg.to_dict(), torch.device("cpu"), mesh)
        optimizer = make_optimizer(wrapped)
        scaler = make_grad_scaler(cfg.mixed_precision, torch.device("cpu"))
        tokens = torch.randint(0, built.vocab_size, (cfg.micro_batch_size, seq_len))
        # The step measured is a steady one: its optimizer state exists before it starts.
        create_optimizer_state(optimizer)
        tracker = BreakdownTracker(wrapped, optimizer, fake_mode, built.layers, block_period(cfg), offloaded)
        hooks = tracker.watch(micro_batches)
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack), tracker:
            fake_train_step(wrapped, optimizer, tokens, scaler, micro_batches)
        for hook in hooks:
            hook.remove()
    result = {"peak_bytes": tracker.peak_bytes, "breakdown": tracker.breakdown, "moments": tracker.moment_figures(),
              "method": METHOD, "seconds": round(time.perf_counter() - start, 3), "num_params": num_params}
    del tracker, optimizer, wrapped, built, tokens
    gc.collect()
    return result


# Models with at least this many blocks are estimated from 3- and 4-block copies;
# shallower ones run whole, which costs little more.
EXTRAPOLATE_FROM_BLOCKS = 8


def block_period(cfg: FsdpConfig) -> int:
    """Blocks after which the step repeats itself: checkpointing every other
    block repeats in pairs, everything else block by block (a size-based unit
    never spans two blocks: their container is never a unit)."""
    return 2 if cfg.activation_checkpointing == "every_other_layer" else 1


def extrapolation_points(cfg: FsdpConfig, blocks: int) -> tuple[int, int]:
    """The two depths to run for a model of ``blocks`` blocks: one period
    apart, each with room for the first and last few blocks of
    :class:`BreakdownTracker` (one more than the period), and for pairs of
    the model's parity, so that its last block is checkpointed as theirs is.
    Not 2 blocks: there the first block's and the last block's special cases
    (the last one is not resharded after forward, backward starts on it)
    overlap at the peak, and 2 -> 3 grew 19% more than any later block did
    (HSDP with selective checkpointing on llama-tiny)."""
    if block_period(cfg) == 2:
        return (4, 6) if blocks % 2 == 0 else (5, 7)
    return 3, 4


def not_extrapolated(model: str, cfg: FsdpConfig) -> str | None:
    """Why ``cfg`` of ``model`` is estimated whole however deep the model, or None.

    FSDP1's size-based units of a mixture-of-experts block are not affine in
    depth: from 3 and 4 blocks an 8-block Mixtral came out 1.6-7.3% over the
    whole step in 5 of 12 such configurations, against under 0.3% for every
    other class sampled (benchmarks/results/estimator_extrapolation_cpu.md)."""
    if cfg.fsdp_version == 1 and cfg.auto_wrap_policy == "size_based" and is_mixture_of_experts(model):
        return "fsdp1_size_based_moe"
    return None


def runnable(cfg: FsdpConfig) -> tuple[FsdpConfig, list[str]]:
    """The configuration a fake step can run in ``cfg``'s place, and what its
    figures are then derived for (see :func:`estimate_config`)."""
    notes = []
    run_cfg = cfg
    if cfg.compile:
        # Fake tensors do not run inductor, whose fused kernels hold fewer
        # intermediate buffers than eager: the eager step's peak stands in, as
        # an upper side, with the wider slack of a derived figure.
        run_cfg = run_cfg.replace(compile=False)
        notes.append("compile_as_eager")
    if cfg.cpu_offload:
        run_cfg = run_cfg.replace(cpu_offload=False)
        notes.append("offload")
    if _is_fsdp1_zero2(cfg):
        run_cfg = run_cfg.replace(sharding_strategy="FULL_SHARD" if cfg.sharding_strategy == "SHARD_GRAD_OP"
                                  else "HYBRID_SHARD")
        notes.append("fsdp1_shard_grad_op")
    return run_cfg, notes


def _is_fsdp1_zero2(cfg: FsdpConfig) -> bool:
    return cfg.fsdp_version == 1 and cfg.sharding_strategy in ("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2")


def derived_step(model: str, world_size: int, nnodes: int, seq_len: int, cfg: FsdpConfig, grad_accum_steps: int = 1,
                 num_blocks: int | None = None, lora: LoraSpec | None = None) -> dict[str, Any]:
    """One fake step standing in for ``cfg`` (:func:`runnable`), its figures derived phase by phase."""
    run_cfg, notes = runnable(cfg)
    result = estimate(model, world_size, nnodes, seq_len, run_cfg, grad_accum_steps, num_blocks, lora,
                      offloaded=cfg.cpu_offload)
    if _is_fsdp1_zero2(cfg):
        # Forward leaves each unit unsharded until its backward: every parameter
        # but this rank's shard, in the compute dtype, through forward and backward.
        itemsize = 4 if cfg.mixed_precision == "fp32" else 2
        kept = int(result["num_params"] * itemsize * (1 - 1 / shard_ranks(cfg.to_dict(), world_size, nnodes)))
        for kind, moment in result["moments"].items():
            if kind.startswith(("forward", "backward")):
                moment["peak_bytes"] += kept
                moment["breakdown"]["temporaries"] += kept
    result.update(_largest(result["moments"]))
    if notes:
        result["method"] += f"+derived({','.join(notes)})"
    return result


def _largest(moments: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The step's peak and its breakdown: those of the kind of moment that peaks highest."""
    kind = max(moments, key=lambda k: moments[k]["peak_bytes"])
    return {"peak_bytes": moments[kind]["peak_bytes"], "breakdown": dict(moments[kind]["breakdown"]), "peak_at": kind}


def estimate_config(model: str, world_size: int, nnodes: int, seq_len: int, cfg: FsdpConfig,
                    grad_accum_steps: int = 1, exact: bool = False, lora: LoraSpec | None = None) -> dict[str, Any]:
    """The peak bytes per rank of ``cfg``'s training step and their breakdown, from
    the whole model or, for a deep one, extrapolated from two shallow copies.

    Every phase's peak (:class:`BreakdownTracker`) is affine in the number of
    identical blocks: parameters, gradients, optimizer state and saved
    activations grow by one block's worth per block, and the transient at the
    peak (one unit unsharded, one block's recomputation, the optimizer's
    scratch) is the same shape whatever the depth. So each phase's
    peak(L) = peak(3) + (L - 3) * (peak(4) - peak(3)), and the step's is the
    largest of them, at the cost of seven blocks instead of L (ten when
    checkpointing every other block, whose unit is a pair). ``exact`` runs all
    L (``autotune estimate --exact``; benchmarks/estimator_accuracy.py compares the two).

    Figures are derived where a fake step cannot run the configuration:

    - CPU offload cannot be set up on a host without an accelerator: the step
      runs without it, and leaves out the sharded parameters, their gradients
      and the optimizer state, which offload keeps in host memory.
    - torch.compile does not run under fake tensors: the eager step stands in.
    - FSDP1 SHARD_GRAD_OP (and HYBRID_SHARD_ZERO2) fails under fake tensors
      in PyTorch's flat-parameter bookkeeping: the step runs as FULL_SHARD,
      and the unsharded parameters that SHARD_GRAD_OP keeps from forward to
      backward are added to those phases (all of them but this rank's shard,
      in the compute dtype).
    """
    blocks = None if exact else block_count(model)
    low_n, high_n = extrapolation_points(cfg, blocks or 0)
    whole = not_extrapolated(model, cfg)
    # Only where the two copies together are shallower than the model itself.
    if blocks is None or blocks < max(EXTRAPOLATE_FROM_BLOCKS, low_n + high_n + 1) or whole:
        result = _public(derived_step(model, world_size, nnodes, seq_len, cfg, grad_accum_steps, lora=lora))
        if whole and blocks is not None:
            result["method"] += f"+whole({whole})"
        return result
    start = time.perf_counter()
    low = derived_step(model, world_size, nnodes, seq_len, cfg, grad_accum_steps, num_blocks=low_n, lora=lora)
    high = derived_step(model, world_size, nnodes, seq_len, cfg, grad_accum_steps, num_blocks=high_n, lora=lora)

    def at_depth(a: int, b: int) -> int:
        return round(a + (blocks - low_n) * (b - a) / (high_n - low_n))

    moments = {}
    # A middle block is the same moment as the blocks on either side of it (see BreakdownTracker).
    for kind in high["moments"].keys() & low["moments"].keys() - {k for k in high["moments"] if k.endswith("/middle")}:
        a, b = low["moments"][kind], high["moments"][kind]
        moments[kind] = {"peak_bytes": at_depth(a["peak_bytes"], b["peak_bytes"]),
                        "breakdown": {k: max(0, at_depth(a["breakdown"].get(k, 0), v)) for k,
                                      v in b["breakdown"].items()}}
    method = high["method"].replace(METHOD, f"{METHOD}+extrapolated({low_n},{high_n}->{blocks})", 1)
    return _public({**_largest(moments), "moments": moments, "method": method,
                    "seconds": round(time.perf_counter() - start, 3)})


def _public(result: dict[str, Any]) -> dict[str, Any]:
    """What the driver records of an estimate: the peak, its breakdown and phase, the method and its seconds."""
    return {k: result[k] for k in ("peak_bytes", "breakdown", "peak_at", "method", "seconds")}


def answer(request: dict[str, Any]) -> dict[str, Any]:
    try:
        cfg = FsdpConfig.from_dict(request["fsdp"])
        world_size = int(request["world_size"])
        accum = accumulation_steps(request.get("global_batch_size"), cfg.micro_batch_size, world_size)
        lora = LoraSpec.from_dict(request["lora"]) if request.get("lora") else None
        return estimate_config(request["model"], world_size, int(request.get("nnodes", 1)), int(request["seq_len"]),
                               cfg, accum, exact=bool(request.get("exact", False)), lora=lora)
    except Exception as exc:  # noqa: BLE001 - one bad configuration must not end the server
        return {"error": f"{type(exc).__name__}: {exc}"}


def answer_in_child(request: dict[str, Any]) -> dict[str, Any]:
    """Estimate in a forked child: imports are paid once by the server, and no
    tensor, hook or process group of one estimate can leak into the next."""
    import os

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            data = json.dumps(answer(request)).encode()
        except BaseException as exc:  # noqa: BLE001
            data = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
        with os.fdopen(write_fd, "wb") as pipe:
            pipe.write(data)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return {"error": f"the estimating process died (wait status {status})"}
    return json.loads(data)


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    if argv == ["--serve"]:
        # Import once here, so each forked estimate starts with them loaded.
        import transformers  # noqa: F401
        from transformers.models.llama import modeling_llama  # noqa: F401

        for line in sys.stdin:
            if line.strip():
                print(json.dumps(answer_in_child(json.loads(line))), flush=True)
        return 0
    if len(argv) == 1:
        # A request inline (as the fork server passes it) or in a file.
        text = argv[0] if argv[0].lstrip().startswith("{") else open(argv[0]).read()
        print(json.dumps(answer(json.loads(text))))
        return 0
    print("usage: python -m autotune.worker.fake_step (--serve | REQUEST_JSON | REQUEST_FILE)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
