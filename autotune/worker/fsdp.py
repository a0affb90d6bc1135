"""Apply one FSDP configuration to a model: activation checkpointing, then FSDP, then real storage.

The order is fixed, as in torchtitan's ``parallelize``: checkpoint wrappers go
on first so that each FSDP unit is the (possibly checkpointed) block, and
FSDP's all-gathers are re-issued inside the recomputation. Each ``apply_*``
step takes explicit arguments and can be read on its own; :func:`parallelize`
calls them in order from a plain mapping of configuration fields.

This file imports torch and nothing else: ``autotune export -f python`` ships
it verbatim, so what a user applies is exactly what a trial measured.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# mixed_precision -> (param dtype, gradient reduce dtype); fp32 is None.
PRECISION_DTYPES: dict[str, tuple[torch.dtype, torch.dtype] | None] = {
    "fp32": None,
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16_fp32_reduce": (torch.bfloat16, torch.float32),
    "fp16": (torch.float16, torch.float16),
}


def parallelize(
    model: nn.Module,
    layers: list[nn.Module],
    config: Mapping[str, Any],
    device: torch.device,
    mesh: DeviceMesh,
) -> nn.Module:
    """Checkpoint, shard and materialize ``model`` as ``config`` says; returns the model to train.

    ``config`` holds the fields of autotune's ``FsdpConfig`` (its ``to_dict()``).
    ``layers`` are the repeated blocks in forward order. Parameters still on
    the meta device get real storage only for this rank's shard, initialized
    by the model's own init (transformers' ``_init_weights``, else each
    module's ``reset_parameters``); tied parameters stay tied and buffers keep
    the values they were built with.
    """
    on_meta = any(p.is_meta for p in model.parameters())
    # FSDP2's offload keeps the sharded parameters in host memory; buffers stay on the device either way.
    offloaded = config["cpu_offload"] and config["fsdp_version"] == 2
    materializer = Materializer(model, torch.device("cpu") if offloaded else device, buffer_device=device)
    blocks = apply_activation_checkpointing(model, layers, config["activation_checkpointing"])
    if config.get("compile"):
        apply_compile(blocks)
    if config["fsdp_version"] == 1:
        return apply_fsdp1(
            model, blocks, device=device, mesh=mesh, param_init_fn=materializer.module,
            sharding_strategy=config["sharding_strategy"], auto_wrap_policy=config["auto_wrap_policy"],
            min_num_params=config["min_num_params"], mixed_precision=config["mixed_precision"],
            backward_prefetch=config["backward_prefetch"], forward_prefetch=config["forward_prefetch"],
            limit_all_gathers=config["limit_all_gathers"], cpu_offload=config["cpu_offload"],
        )  # fmt: skip
    apply_fsdp2(
        model, blocks, mesh=mesh, reshard_after_forward=config["reshard_after_forward"],
        reshard_group_size=config.get("reshard_group_size"),
        mixed_precision=config["mixed_precision"], cpu_offload=config["cpu_offload"],
        auto_wrap_policy=config["auto_wrap_policy"], min_num_params=config["min_num_params"],
        forward_prefetch=config["forward_prefetch"],
    )  # fmt: skip
    if on_meta:
        materializer.whole()
    return model


def apply_activation_checkpointing(model: nn.Module, layers: list[nn.Module], mode: str) -> list[nn.Module]:
    """Wrap the chosen layers in non-reentrant checkpoint wrappers.

    ``full`` checkpoints every layer, ``every_other_layer`` the even-numbered
    ones (half the recompute for roughly half the saving), ``selective`` every
    layer but keeps the outputs of its matmuls and attention (see
    :func:`selective_checkpoint_context`): the cheap elementwise work is
    recomputed, the expensive ops are not. Returns the blocks in forward order,
    each either the layer or its wrapper: the units FSDP wraps.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
        apply_activation_checkpointing as wrap_layers,
        checkpoint_wrapper,
    )

    if mode == "none":
        return list(layers)
    options: dict[str, Any] = {}
    if mode in ("full", "selective"):
        chosen = {id(layer) for layer in layers}
        if mode == "selective":
            options["context_fn"] = selective_checkpoint_context
    elif mode == "every_other_layer":
        chosen = {id(layer) for i, layer in enumerate(layers) if i % 2 == 0}
    else:
        raise ValueError(f"activation_checkpointing={mode!r}; expected none, full, every_other_layer or selective")
    wrap_layers(
        model,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **options),
        check_fn=lambda m: id(m) in chosen,
    )
    wrapper_of = {
        id(m._checkpoint_wrapped_module): m for m in model.modules() if isinstance(m, CheckpointWrapper)
    }
    return [wrapper_of.get(id(layer), layer) for layer in layers]


def apply_compile(blocks: list[nn.Module]) -> None:
    """``torch.compile`` each block in place, before sharding (torchtitan's order):
    the blocks are identical, so one compiled graph serves them all, and the
    all-gathers FSDP adds around each block stay outside the graph."""
    for block in blocks:
        block.compile()


# Ops whose outputs selective checkpointing keeps: the matmuls and attention,
# which cost most to recompute (torchtitan's op-level selective policy).
_SAVED_OPS = (
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default", "aten.linear.default",
    "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
)


def selective_checkpoint_context():
    """The (forward, recompute) contexts of op-level selective checkpointing:
    save what :data:`_SAVED_OPS` produce, recompute the rest in backward."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = set()
    for name in _SAVED_OPS:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            saved.add(getattr(packet, overload))

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def build_mesh(device_type: str, strategy: str, world_size: int, nnodes: int,
               shard_group_size: int | None = None) -> DeviceMesh:
    """The data-parallel mesh: 1-D for plain sharding, 2-D (replicate, shard) otherwise.

    Hybrid strategies shard within groups of ``shard_group_size`` consecutive
    ranks (default: one node's) and replicate across the groups: with 8 ranks
    on one node and groups of 4, two replicas of a 4-way sharded model. NO_SHARD
    is the degenerate 2-D mesh whose shard groups have one rank, which is how
    FSDP2 expresses DDP-style replication.
    """
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    if strategy == "NO_SHARD":
        shape = (world_size, 1)
    elif strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        if world_size % nnodes:
            raise ValueError(f"world_size={world_size} is not a multiple of nnodes={nnodes}")
        shard = shard_group_size or world_size // nnodes
        if world_size % shard:
            raise ValueError(f"shard_group_size={shard} does not divide world_size={world_size}")
        shape = (world_size // shard, shard)
    else:
        raise ValueError(f"sharding_strategy={strategy!r} is not a known strategy")
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))


def apply_fsdp1(
    model: nn.Module,
    blocks: list[nn.Module],
    *,
    device: torch.device,
    mesh: DeviceMesh,
    param_init_fn: Callable[[nn.Module], None],
    sharding_strategy: str,
    auto_wrap_policy: str,
    min_num_params: int,
    mixed_precision: str,
    backward_prefetch: str,
    forward_prefetch: bool,
    limit_all_gathers: bool,
    cpu_offload: bool,
) -> nn.Module:
    """Wrap with ``FullyShardedDataParallel``; ``param_init_fn`` gives each unit's meta tensors storage."""
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        FullyShardedDataParallel,
        MixedPrecision,
        ShardingStrategy,
    )
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    # Wrap exactly the units FSDP2 would shard (the blocks, the checkpoint wrapper
    # where there is one; or the size-based units), so FSDP1 and FSDP2 shard alike.
    if auto_wrap_policy in ("transformer_layer", "size_based"):
        units = blocks if auto_wrap_policy == "transformer_layer" else size_based_units(model, min_num_params)
        unit_ids = {id(u) for u in units}
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in unit_ids)
    else:
        policy = None
    dtypes = PRECISION_DTYPES[mixed_precision]
    # Buffers keep their own dtype (buffer_dtype=None), as under FSDP2: a rotary
    # inv_freq cast to bf16 would make the two versions compute differently.
    mixed = None if dtypes is None else MixedPrecision(param_dtype=dtypes[0], reduce_dtype=dtypes[1], buffer_dtype=None)
    prefetch = None if backward_prefetch == "none" else BackwardPrefetch[backward_prefetch]
    wrapped = FullyShardedDataParallel(
        model,
        auto_wrap_policy=policy,
        # FSDP1 spells the hybrid ZeRO-2 strategy with a leading underscore.
        sharding_strategy=ShardingStrategy[sharding_strategy.replace("HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2")],
        mixed_precision=mixed,
        # With offload, units are still initialized on the device (fast,
        # parallel) and FSDP moves the shards to the host after sharding.
        cpu_offload=CPUOffload(offload_params=cpu_offload),
        backward_prefetch=prefetch,
        forward_prefetch=forward_prefetch,
        limit_all_gathers=limit_all_gathers,
        use_orig_params=True,
        device_id=device,
        device_mesh=mesh if mesh.ndim == 2 and sharding_strategy.startswith("HYBRID") else None,
        param_init_fn=param_init_fn,
        sync_module_states=False,
    )
    if mixed is not None:
        allow_low_precision_grads_on_tied(wrapped)
    return wrapped


def allow_low_precision_grads_on_tied(model: nn.Module) -> None:
    """Let a tied parameter hold FSDP1's low-precision gradient between micro batches.

    Unsynced (``no_sync``, gradient accumulation) and unsharded (NO_SHARD, or
    any strategy on one rank), FSDP1 keeps the gradient in the compute dtype
    and points each parameter's ``.grad`` at it through ``.data``, which
    skips the dtype check; but a tied parameter (embeddings shared with the
    output head) is handed its gradient by plain assignment, which since
    torch 2.10 checks ``grad_dtype``: "attempting to assign a gradient with
    dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'" (found on an
    H200 with torch 2.11, reproduced on CPU with 2.11 and 2.13). ``grad_dtype
    = None`` allows that one assignment; the synced backward still hands the
    optimizer full-precision gradients.
    """
    counts: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        counts[id(param)] = counts.get(id(param), 0) + 1
    for param in model.parameters():
        if counts[id(param)] > 1 and hasattr(param, "grad_dtype"):
            param.grad_dtype = None


def apply_fsdp2(
    model: nn.Module,
    blocks: list[nn.Module],
    *,
    mesh: DeviceMesh,
    reshard_after_forward: bool,
    mixed_precision: str,
    cpu_offload: bool,
    auto_wrap_policy: str,
    min_num_params: int,
    forward_prefetch: bool,
    reshard_group_size: int | None = None,
) -> None:
    """Shard with ``fully_shard``: the chosen units first, then the root.

    ``reshard_group_size``: after forward, each unit keeps its parameters sharded over groups of that many
    ranks instead of all of them (``reshard_after_forward`` as an int): backward all-gathers within the
    group, one node's ranks for example, at the cost of holding a larger shard between forward and backward.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    dtypes = PRECISION_DTYPES[mixed_precision]
    kwargs: dict[str, Any] = dict(
        mesh=mesh,
        # An int is a partial reshard; torch takes the whole group's size as True.
        reshard_after_forward=(reshard_group_size or True) if reshard_after_forward else False,
        mp_policy=(MixedPrecisionPolicy() if dtypes is None
                   else MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1])),
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    if auto_wrap_policy == "transformer_layer":
        units = list(blocks)
    elif auto_wrap_policy == "size_based":
        units = size_based_units(model, min_num_params)
    else:
        units = []
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    apply_fsdp2_prefetch(units, forward_prefetch)


def apply_fsdp2_prefetch(units: list[nn.Module], forward: bool) -> None:
    """Explicit prefetching between consecutive units, one ahead.

    Forward prefetch issues unit i+1's all-gather when unit i starts. Backward
    prefetch of the previous unit matches FSDP2's default; setting it explicitly
    keeps it when units are not run in their registration order.
    """
    for i, module in enumerate(units):
        unit: Any = module  # an FSDPModule since fully_shard; nn.Module's typing cannot say so
        if forward and i + 1 < len(units):
            unit.set_modules_to_forward_prefetch([units[i + 1]])
        if i > 0:
            unit.set_modules_to_backward_prefetch([units[i - 1]])


def size_based_units(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """The units of size-based wrapping, for FSDP1 and FSDP2 alike, in post-order:
    a module becomes a unit once the parameters not yet in a unit below it
    reach ``min_num_params``, as FSDP1's ``size_based_auto_wrap_policy`` counts
    them, with two exceptions that its policy does not make:

    - a module that holds a parameter tied to a module outside it (a word
      embedding tied to the output head) is never a unit: its parameters pass
      up to a module that holds every user of the tie, so the tie is sharded
      once, in one unit (FSDP1 otherwise fails on a flat parameter of the wrong
      size, FSDP2 on a parameter "shared with another FSDP group");
    - nothing inside a checkpointed block is a unit, only the block itself:
      an all-gather inside the recomputed region runs in the recomputation
      too, which selective checkpointing finds out of step with the forward.
    """
    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    counted: set[int] = set()
    units: list[nn.Module] = []

    def visit(module: nn.Module, in_checkpoint: bool) -> tuple[int, dict[int, int]]:
        """(parameters below not yet in a unit, each once; tied parameters seen below: id -> users seen)."""
        remaining, seen = 0, dict[int, int]()
        for p in module.parameters(recurse=False):
            if id(p) not in counted:
                counted.add(id(p))
                remaining += p.numel()
            if users[id(p)] > 1:
                seen[id(p)] = seen.get(id(p), 0) + 1
        inside = in_checkpoint or _is_checkpoint_wrapper(module)
        for child in module.children():
            count, tied = visit(child, inside)
            remaining += count
            for key, n in tied.items():
                seen[key] = seen.get(key, 0) + n
        splits_a_tie = any(n < users[key] for key, n in seen.items())
        # Containers have no forward of their own to hook, so, as in FSDP1's
        # policy, they pass their parameters up to the module that runs them.
        eligible = (module is not model and not isinstance(module, (nn.ModuleList, nn.ModuleDict)) and not splits_a_tie
                    and (not in_checkpoint or _is_checkpoint_wrapper(module)))
        if eligible and remaining >= min_num_params:
            units.append(module)
            return 0, {}
        return remaining, seen

    visit(model, False)
    return units


def _is_checkpoint_wrapper(module: nn.Module) -> bool:
    return type(module).__name__ == "CheckpointWrapper"


class Materializer:
    """Give a meta-device model real storage on ``device``, shard by shard, and
    its buffers on ``buffer_device`` (default: ``device``).

    ``Module.to_empty`` alone loses two things, which this keeps:

    - ties: moving a meta parameter makes a new Parameter, so a weight shared
      by two modules (tied embeddings) becomes two when FSDP1 materializes
      one module at a time; the second module is given the first's;
    - buffer values: ``to_empty`` leaves garbage in every buffer, and no init
      function recomputes a buffer the model computed in its constructor (a
      rotary ``inv_freq``, a mask); their values are taken before wrapping and
      put back after.

    The two devices differ under FSDP2's CPU offload: the parameters' shards
    live in host memory, while the buffers stay on the GPU, where
    ``fully_shard`` moved them (a rotary buffer on the host would be copied
    to the GPU in every forward, and a model that uses a buffer directly
    would fail on the device mismatch; torchtitan's ``buffer_device``).
    """

    def __init__(self, model: nn.Module, device: torch.device, buffer_device: torch.device | None = None) -> None:
        self.model = model
        self.device = device
        self.buffer_device = buffer_device or device
        self._replacement: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        self._buffers: dict[tuple[int, str], torch.Tensor] = {
            (id(module), name): buffer.detach().clone()
            for module in model.modules()
            for name, buffer in module.named_buffers(recurse=False)
            if buffer is not None and not buffer.is_meta
        }

    @torch.no_grad()
    def module(self, module: nn.Module) -> None:
        """One module's own tensors (FSDP1's ``param_init_fn`` hands them over one module at a time)."""
        before = dict(module.named_parameters(recurse=False, remove_duplicate=False))
        module.to_empty(device=self.device, recurse=False)
        for name, old in before.items():
            if id(old) in self._replacement:
                module.register_parameter(name, self._replacement[id(old)][1])
            else:
                # The old meta parameter is kept alive so that its id is not reused.
                self._replacement[id(old)] = (old, module.get_parameter(name))
        init_weights(module, self.model, recurse=False)
        self._restore_buffers(module, recurse=False)

    @torch.no_grad()
    def whole(self) -> None:
        """Every tensor of the model, after FSDP2 sharded it (DTensor parameters are
        swapped in place, so ties hold). Buffers that hold values already stay
        as they are, where ``fully_shard`` put them; meta ones get storage on
        ``buffer_device``."""
        held = {(id(m), name): b for m in self.model.modules() for name, b in m.named_buffers(recurse=False)
                if b is not None and not b.is_meta}
        self.model.to_empty(device=self.device)
        for module in self.model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                kept = held.get((id(module), name))
                module._buffers[name] = kept if kept is not None else buffer.to(self.buffer_device)
        init_weights(self.model, self.model)
        self._restore_buffers(self.model)

    def _restore_buffers(self, root: nn.Module, recurse: bool = True) -> None:
        for module in root.modules() if recurse else [root]:
            for name, buffer in module.named_buffers(recurse=False):
                kept = self._buffers.get((id(module), name))
                if kept is not None and buffer is not None:
                    buffer.copy_(kept.to(buffer.dtype))


@torch.no_grad()
def init_weights(module: nn.Module, owner: nn.Module, recurse: bool = True) -> None:
    """Initialize ``module``'s parameters (its own only, without ``recurse``).

    ``owner`` is the whole model: a transformers model's ``_init_weights``
    decides every submodule's values; other models fall back to each
    submodule's ``reset_parameters``.
    """
    targets = module.modules() if recurse else [module]
    init: Any = getattr(owner, "_init_weights", None)
    for sub in targets:
        reset: Any = getattr(sub, "reset_parameters", None)
        if init is not None:
            init(sub)
        elif reset is not None:
            reset()


@contextlib.contextmanager
def gradient_sync(model: Any, enabled: bool) -> Iterator[None]:
    """Sync gradients across ranks in this backward (``enabled``), or keep them
    on the rank to accumulate: FSDP1's ``no_sync()``, FSDP2's
    ``set_requires_gradient_sync(False)``. Accumulated gradients are unsharded
    until the synced backward, so they cost memory: a trial measures it."""
    if enabled:
        yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with model.no_sync():
            yield


def make_grad_scaler(mixed_precision: str, device: torch.device):
    """fp16 gradients underflow without loss scaling; the sharded scaler agrees on
    inf/nan across ranks, so every rank skips the same steps. None otherwise."""
    if mixed_precision != "fp16":
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device.type)


def find_layers(model: nn.Module, class_names: tuple[str, ...] | list[str]) -> list[nn.Module]:
    """The repeated blocks, in forward (registration) order."""
    return [m for m in model.modules() if type(m).__name__ in class_names]


def apply_tuned(
    model: nn.Module, config: Mapping[str, Any], device: torch.device | None = None, nnodes: int = 1
) -> nn.Module:
    """Apply ``config`` to a model of the user's, inside an initialized process group.

    A model on the meta device is materialized shard by shard, as in a trial; a
    model with real weights on the host is sharded first, and only each
    rank's shard moves to ``device``.
    """
    import torch.distributed as dist

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = build_mesh(device.type, config["sharding_strategy"], dist.get_world_size(), nnodes,
                      config.get("shard_group_size"))
    return parallelize(model, find_layers(model, config["transformer_layer_cls"]), config, device, mesh)
