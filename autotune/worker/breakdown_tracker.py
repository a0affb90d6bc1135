"""The live-storage peak of a fake step at each kind of moment, split by what each storage holds then."""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.weak import WeakIdKeyDictionary

from autotune.worker.live_storages import LiveStorageTracker
from autotune.worker.step_moments import StepMoments

# What CPU offload keeps in host memory.
HOST_GROUPS = ("parameters", "gradients", "optimizer_state")


class BreakdownTracker(LiveStorageTracker):
    """The live-storage peak at each kind of moment of the step, split by what each storage holds then.

    A moment's kind is its phase and where in the stack of blocks it falls (see
    :mod:`autotune.worker.step_moments`): before the first block (``start``), in
    one of the first few blocks (``head0``, ``head1``...), in one of the last
    few (``tail0`` is the last), in between (``middle``), or after the last
    block (``end``).

    Why: a deep model's peak is extrapolated from two shallow copies, and
    each kind of moment's live bytes are affine in the number of identical
    blocks, but the step's peak is not: it is the largest of them, and which
    kind that is can change with depth. A shallow copy may peak at the start
    of backward, with its activations, and the whole model at the end, when
    its gradients are reduced, or in the optimizer step, with its larger
    state (a 10-block Qwen2 at size-based wrapping peaked 6% above the line
    through 3 and 4 blocks; autotune issue 35). So every kind is
    extrapolated on its own and the largest taken
    (:func:`autotune.worker.depth_extrapolation.extrapolate_moments`).
    Blocks between the first and the last few repeat the same moments with
    a drift linear in their index, so they never exceed both ends.

    ``parameters`` and ``gradients`` are the sharded ones, as they are when the
    step starts: a unit's all-gathered parameters and its unsharded gradients
    are temporaries. With ``offloaded``, those sharded parameters and their
    gradients and the optimizer state are left out of every figure: CPU
    offload keeps them in host memory.
    """

    def __init__(self, moments: StepMoments, fake_mode: FakeTensorMode, period: int = 1,
                 offloaded: bool = False) -> None:
        super().__init__(fake_mode=fake_mode)
        self.moments = moments
        # Blocks at each end that are moments of their own: one more than the pattern's period.
        self.ends = period + 1
        self.offloaded = offloaded
        # Saved activations.
        self.saved: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # "phase/kind" -> (its peak bytes, their breakdown)
        self.peaks: dict[str, tuple[int, dict[str, int]]] = {}
        self._sharded: list[torch.nn.Parameter] = []
        self._fixed_groups: dict[str, dict[int, Any]] = {}
        moments.on_save.append(self._saved)

    def __enter__(self) -> BreakdownTracker:
        # The step starts resharded: what the model holds now is what FSDP keeps between steps.
        self._sharded = list(self.moments.model.parameters())
        # The optimizer state keeps its storages through the step (a parameter does not: FSDP1 points it at the
        # unsharded flat parameter while its unit runs).
        optimizer = self.moments.optimizer
        self._fixed_groups = {"optimizer_state": _storages(v for s in optimizer.state.values() for v in s.values()
                                                           if isinstance(v, torch.Tensor))}
        super().__enter__()
        return self

    def kinds(self) -> list[str]:
        """The kinds of the current moment: a block near both ends is both a head and a tail."""
        phase, region = self.moments.phase, self.moments.region
        if not isinstance(region, int):
            return [f"{phase}/{region}"]
        i, last = region, len(self.moments.blocks) - 1
        kinds = [f"{phase}/head{i}"] if i < self.ends else []
        kinds += [f"{phase}/tail{last - i}"] if last - i < self.ends else []
        return kinds or [f"{phase}/middle"]

    @property
    def breakdown(self) -> dict[str, int]:
        """The breakdown at the step's peak."""
        return max(self.peaks.values(), key=lambda p: p[0])[1] if self.peaks else {}

    def moment_figures(self) -> dict[str, dict[str, Any]]:
        return {kind: {"peak_bytes": peak, "breakdown": dict(split)} for kind, (peak, split) in self.peaks.items()}

    def _saved(self, tensor: torch.Tensor) -> None:
        try:
            self.saved[tensor.untyped_storage()] = None
        except (RuntimeError, NotImplementedError):
            pass

    def _update_peak(self) -> int:
        current = super()._update_peak()
        groups = None
        if self.offloaded:
            groups = self._groups()
            current -= sum(s.nbytes() for name in HOST_GROUPS for s in groups[name].values())
        for kind in self.kinds():
            best = self.peaks.get(kind)
            if best is None or current > best[0]:
                groups = groups or self._groups()
                self.peaks[kind] = (current, self._split(current, groups))
        return current

    def _groups(self) -> dict[str, dict[int, Any]]:
        return {"parameters": _storages(self._sharded),
                "gradients": _storages(p.grad for p in self._sharded if p.grad is not None),
                "optimizer_state": self._fixed_groups["optimizer_state"]}

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


def _storages(tensors: Any) -> dict[int, Any]:
    found = {}
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        try:
            s = local.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        found[id(s)] = s
    return found
