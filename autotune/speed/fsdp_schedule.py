"""The order in which FSDP issues one training step's compute and collectives, for a configuration.

FSDP's speed is decided by what overlaps what: an all-gather hidden under the previous unit's compute costs
nothing, one the compute waits for adds to the step. This module writes the step out as the host issues it, a
list of :class:`Compute` and :class:`Comm` events with the dependencies the streams enforce, and
:mod:`autotune.speed.overlap` plays it against a device profile. The rules, by FSDP version (read in
torch 2.13's ``_fully_shard`` and ``_runtime_utils``, and checked against the collectives the fake step
records, ``tests/test_speed_schedule.py``):

- **Units.** One per block with ``transformer_layer`` wrapping (a checkpointed block is its wrapper), the size-based
  units inside each block (a checkpointed block is one unit or none), and the root, which holds what no unit holds.
- **Forward.** Each unit's all-gather precedes its compute. FSDP2 issues the next unit's all-gather when its
  pre-forward hook runs, on a stream of its own, after waiting for the previous all-gather's copy-out (two in
  flight); with ``forward_prefetch`` it issues it one unit earlier. FSDP1 issues it in the unit's pre-forward;
  ``limit_all_gathers`` blocks the host until the unit two back has freed its parameters.
- **Reshard.** FULL_SHARD and HYBRID_SHARD free the parameters after forward, so backward gathers them again:
  every unit under FSDP2 (the root too), every unit but the root under FSDP1; with ``reshard_group_size`` the
  backward all-gather runs within that smaller group. SHARD_GRAD_OP, HYBRID_SHARD_ZERO2 and NO_SHARD keep them.
- **Backward.** Units run in reverse. Prefetch issues the next unit's all-gather before this unit's gradient
  compute (FSDP2 always; FSDP1's ``BACKWARD_PRE``), after it (``BACKWARD_POST``), or not at all (``none``:
  it queues behind this unit's reduce-scatter). Each unit's reduce-scatter waits for its gradients; hybrid
  strategies then all-reduce the shard across the replicas. A micro batch that accumulates (not the last) syncs
  nothing.
- **Optimizer.** After every reduction, on the device, or on the host under CPU offload, whose parameters cross
  PCIe before each all-gather and whose gradients cross back after each reduce-scatter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from autotune.config.step_work import Work
from autotune.speed.model_work import ModelWork, checkpointed_blocks


@dataclass(frozen=True)
class Compute:
    """Work on the device's compute stream (or, with ``on_host``, on the host: an offloaded optimizer step)."""

    work: Work
    label: str
    # Collectives (event indices) whose results this compute reads.
    waits: tuple[int, ...] = ()
    on_host: bool = False


@dataclass(frozen=True)
class Comm:
    """A collective on its link, with the host-device copies that offload adds around it."""

    kind: str
    nbytes: float
    group: int
    nodes: int
    label: str
    # The event whose end the collective's input needs (a reduce-scatter's gradients).
    after: int | None = None
    # The compute whose start the stream waits for (FSDP2's all-gather after the previous copy-out).
    not_before_start: int | None = None
    # The compute the host blocks on before issuing it (FSDP1's all-gather limiter).
    host_waits_for: int | None = None
    # Bytes copied host-to-device before it (offloaded parameters) and device-to-host after it (gradients).
    copy_in: float = 0.0
    copy_out: float = 0.0


Event = Compute | Comm


@dataclass(frozen=True)
class ModelStructure:
    """The parameters a schedule shards: the whole model's, one block's, how many blocks, and for size-based
    wrapping the units inside one block (by minimum size: their parameter counts in forward order)."""

    num_params: int
    block_params: int
    num_layers: int
    size_units: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    # The share of the parameters that train (LoRA: its adapters; their gradients are all that is reduced).
    trainable_fraction: float = 1.0


@dataclass(frozen=True)
class Placement:
    """Ranks in the world and per node."""

    world_size: int
    nnodes: int = 1

    @property
    def node_size(self) -> int:
        return max(1, self.world_size // max(1, self.nnodes))

    def nodes_of(self, ranks: Sequence[int]) -> int:
        return len({r // self.node_size for r in ranks})


PARAM_BYTES = {"fp32": 4, "bf16": 2, "bf16_fp32_reduce": 2, "fp16": 2}
REDUCE_BYTES = {"fp32": 4, "bf16": 2, "bf16_fp32_reduce": 4, "fp16": 2}
HYBRID = ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
RESHARDS = ("FULL_SHARD", "HYBRID_SHARD")


@dataclass(frozen=True)
class Groups:
    """The process groups of one configuration: shard, replicate and post-forward reshard, as (ranks, nodes)."""

    shard: tuple[int, int]
    replicate: tuple[int, int]
    reshard: tuple[int, int]

    @classmethod
    def of(cls, cfg: Mapping, placement: Placement) -> Groups:
        world = placement.world_size
        strategy = cfg["sharding_strategy"]
        if strategy == "NO_SHARD":
            shard = 1
        elif strategy in HYBRID:
            shard = cfg.get("shard_group_size") or placement.node_size
        else:
            shard = world
        replicas = max(1, world // shard)
        reshard = cfg.get("reshard_group_size") or shard
        return cls((shard, placement.nodes_of(range(shard))),
                   (replicas, placement.nodes_of(range(0, world, shard))),
                   (reshard, placement.nodes_of(range(reshard))))


@dataclass(frozen=True)
class Unit:
    """An FSDP unit: its parameters, and the share of its block's compute it runs before the next unit (None:
    the root)."""

    params: int
    block: int | None
    share: float = 1.0


def units(cfg: Mapping, structure: ModelStructure) -> tuple[int, list[list[Unit]]]:
    """(the root's parameters, each block's units in forward order)."""
    policy = cfg["auto_wrap_policy"]
    checkpointed = _checkpointed(cfg["activation_checkpointing"], structure.num_layers)
    blocks: list[list[Unit]] = []
    for i in range(structure.num_layers):
        if policy == "transformer_layer":
            sizes: tuple[int, ...] = (structure.block_params,)
        elif policy == "size_based":
            theta = int(cfg["min_num_params"])
            whole = (structure.block_params,) if structure.block_params >= theta else ()
            sizes = whole if i in checkpointed else structure.size_units.get(theta, whole)
        else:
            sizes = ()
        total = sum(sizes) or 1
        blocks.append([Unit(p, i, p / total) for p in sizes])
    root = structure.num_params - sum(u.params for b in blocks for u in b)
    return max(0, root), blocks


def _share(work: Work, share: float) -> Work:
    return work if share == 1.0 else work.times(share)


def _checkpointed(mode: str, depth: int) -> set[int]:
    if mode == "every_other_layer":
        return set(range(0, depth, 2))
    return set(range(depth)) if checkpointed_blocks(mode, depth) else set()


class _Writer:
    """Appends events and remembers their indices."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def add(self, event: Event) -> int:
        self.events.append(event)
        return len(self.events) - 1


@dataclass
class _Plan:
    """One configuration's facts, as the schedule needs them."""

    cfg: Mapping
    work: ModelWork
    structure: ModelStructure
    groups: Groups
    root: int
    blocks: list[list[Unit]]

    @property
    def fsdp2(self) -> bool:
        return self.cfg["fsdp_version"] == 2

    @property
    def sharded(self) -> bool:
        return self.groups.shard[0] > 1

    def reshards(self, unit: Unit) -> bool:
        if not self.sharded or self.cfg["sharding_strategy"] not in RESHARDS:
            return False
        return self.fsdp2 or unit.block is not None

    def gather(self, unit: Unit, backward: bool) -> Comm:
        size, nodes = self.groups.reshard if backward and self.fsdp2 else self.groups.shard
        nbytes = unit.params * PARAM_BYTES[self.cfg["mixed_precision"]]
        copy = unit.params / self.groups.shard[0] * 4 if self.cfg["cpu_offload"] else 0.0
        return Comm("all_gather", nbytes, size, nodes, f"all-gather {_name(unit)}", copy_in=copy)


def _name(unit: Unit) -> str:
    return "root" if unit.block is None else f"block {unit.block}"


def schedule(cfg: Mapping, work: ModelWork, structure: ModelStructure, placement: Placement,
             micro_batches: int = 1) -> list[Event]:
    """One optimizer step of ``cfg`` (a FsdpConfig's dict) as FSDP issues it: ``micro_batches`` forward and
    backward passes, gradients synced on the last, then the optimizer step (see the module)."""
    root, blocks = units(cfg, structure)
    plan = _Plan(cfg, work, structure, Groups.of(cfg, placement), root, blocks)
    out = _Writer()
    for mb in range(micro_batches):
        _forward(plan, out)
        _backward(plan, out, sync=mb == micro_batches - 1)
    reductions = tuple(i for i, e in enumerate(out.events) if isinstance(e, Comm) and e.kind != "all_gather")
    optimizer = work.optimizer.times((work.optimizer_numel and _optimizer_numel(plan) / work.optimizer_numel) or 1.0)
    out.add(Compute(optimizer, "optimizer step", reductions, on_host=bool(cfg["cpu_offload"])))
    return out.events


def _optimizer_numel(plan: _Plan) -> float:
    return plan.structure.num_params * plan.structure.trainable_fraction / plan.groups.shard[0]


def _forward(plan: _Plan, out: _Writer) -> None:
    root = Unit(plan.root, None)
    # All-gathers issued so far, by unit position in forward order (the root is -1).
    gathered: dict[int, int] = {}
    if plan.sharded and plan.root:
        gathered[-1] = out.add(plan.gather(root, backward=False))
    start = out.add(Compute(plan.work.start_forward, "forward: before the blocks", tuple(gathered.values())))
    order = [u for b in plan.blocks for u in b]
    computes: list[int] = [start]
    k = 0
    for i, block in enumerate(plan.blocks):
        block_work = plan.work.block_forward
        if not block:
            computes.append(out.add(Compute(block_work, f"forward: block {i}")))
            continue
        for unit in block:
            if plan.sharded and k not in gathered:
                gathered[k] = out.add(_forward_gather(plan, unit, computes))
            if plan.sharded and plan.cfg["forward_prefetch"] and k + 1 < len(order) and k + 1 not in gathered:
                gathered[k + 1] = out.add(_forward_gather(plan, order[k + 1], computes))
            waits = (gathered[k],) if k in gathered else ()
            computes.append(out.add(Compute(_share(block_work, unit.share), f"forward: block {i}", waits)))
            k += 1
    out.add(Compute(plan.work.end_forward, "forward: after the blocks"))


def _forward_gather(plan: _Plan, unit: Unit, computes: list[int]) -> Comm:
    gather = plan.gather(unit, backward=False)
    if plan.fsdp2:
        # On the all-gather stream, after the previous unit's copy-out (the start of its compute).
        return dataclasses.replace(gather, not_before_start=computes[-1])
    if plan.cfg["limit_all_gathers"] and len(computes) >= 3:
        return dataclasses.replace(gather, host_waits_for=computes[-2])
    return gather


def _backward(plan: _Plan, out: _Writer, sync: bool) -> None:
    root = Unit(plan.root, None)
    gathered: dict[int, int] = {}
    if plan.sharded and plan.root and plan.reshards(root):
        gathered[-1] = out.add(plan.gather(root, backward=True))
    end = out.add(Compute(plan.work.end_backward, "backward: after the blocks", tuple(gathered.values())))
    # Units in backward order, each with its position in forward order.
    order = [u for b in plan.blocks for u in b]
    backward = list(reversed(list(enumerate(order))))
    prefetch = "BACKWARD_PRE" if plan.fsdp2 else plan.cfg["backward_prefetch"]
    recompute = plan.work.recompute(plan.cfg["activation_checkpointing"])
    checkpointed = _checkpointed(plan.cfg["activation_checkpointing"], plan.structure.num_layers)
    # One Work object for every block alike: the simulation times each object once.
    with_recompute = plan.work.block_backward + recompute
    last, j = end, 0
    for i in reversed(range(len(plan.blocks))):
        block = plan.blocks[i]
        work = with_recompute if i in checkpointed else plan.work.block_backward
        if not block:
            last = out.add(Compute(work, f"backward: block {i}"))
            continue
        for _ in block:
            k, unit = backward[j]
            nxt = backward[j + 1] if j + 1 < len(backward) else None
            j += 1
            if plan.reshards(unit) and k not in gathered:
                gathered[k] = out.add(plan.gather(unit, backward=True))
            if prefetch == "BACKWARD_PRE" and nxt is not None and plan.reshards(nxt[1]) and nxt[0] not in gathered:
                gathered[nxt[0]] = out.add(plan.gather(nxt[1], backward=True))
            waits = (gathered[k],) if k in gathered else ()
            last = out.add(Compute(_share(work, unit.share), f"backward: block {i}", waits))
            if prefetch == "BACKWARD_POST" and nxt is not None and plan.reshards(nxt[1]) and nxt[0] not in gathered:
                gathered[nxt[0]] = out.add(plan.gather(nxt[1], backward=True))
            if sync:
                _reduce(plan, out, unit, last)
    last = out.add(Compute(plan.work.start_backward, "backward: before the blocks"))
    if sync and plan.root:
        _reduce(plan, out, root, last)


def _reduce(plan: _Plan, out: _Writer, unit: Unit, produced: int) -> None:
    """A unit's gradients reduce-scattered over its shard group and all-reduced across replicas."""
    cfg = plan.cfg
    grad_bytes = unit.params * plan.structure.trainable_fraction * REDUCE_BYTES[cfg["mixed_precision"]]
    shard, replicate = plan.groups.shard, plan.groups.replicate
    offload = grad_bytes / shard[0] * 4 / REDUCE_BYTES[cfg["mixed_precision"]] if cfg["cpu_offload"] else 0.0
    last = produced
    if shard[0] > 1:
        last = out.add(Comm("reduce_scatter", grad_bytes, shard[0], shard[1], f"reduce-scatter {_name(unit)}",
                            after=last, copy_out=0.0 if replicate[0] > 1 else offload))
    if replicate[0] > 1:
        out.add(Comm("all_reduce", grad_bytes / shard[0], replicate[0], replicate[1], f"all-reduce {_name(unit)}",
                     after=last, copy_out=offload))
