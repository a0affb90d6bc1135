"""Where a fake training step is at each operator: its phase, the block it works on, and whether it recomputes.

The memory tracker (:mod:`autotune.worker.breakdown_tracker`) and the work counter
(:mod:`autotune.worker.work_counter`) both read the moment: a deep model's peak and its step time are each
extended from shallow copies block by block, so both need to know which block an operator belongs to.

A moment's phase is each micro batch's forward and backward (``forward0``, ``backward0``, ...), then the optimizer
step. Its region is where in the stack of blocks it falls: before the first block (``start``), in block *i*, or
after the last (``end``). Backward runs the blocks in reverse and names its moments after the forward region whose
saved tensors (or recomputed block) it is working on: the saved-tensor hooks of :meth:`StepMoments.pack` and
:meth:`StepMoments.unpack` carry the region from forward to backward. A checkpointed block's forward run again in
backward is a recomputation (:attr:`StepMoments.recomputing`): autograd runs backward with gradients off, and
checkpointing turns them on to recompute. (Not the block's forward hook: checkpointing stops a recomputation as
soon as it has what backward needs, so the hook that would end it never runs.)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


class StepMoments:
    """Hooks that name the moment as the step goes; read :attr:`phase`, :attr:`region` and :attr:`recomputing`."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 blocks: Sequence[torch.nn.Module] = ()) -> None:
        self.model = model
        self.optimizer = optimizer
        self.blocks = list(blocks)
        self.phase = "setup"
        self.region: int | str = "all"
        # Called with each saved tensor (the tracker counts them as activations).
        self.on_save: list[Callable[[torch.Tensor], None]] = []
        self._hooks: list[Any] = []

    @property
    def recomputing(self) -> bool:
        return self.phase.startswith("backward") and torch.is_grad_enabled()

    def enter(self, phase: str, region: int | str) -> None:
        self.phase, self.region = phase, region

    def watch(self, micro_batches: int) -> StepMoments:
        """Register the hooks (:meth:`remove` takes them off)."""
        count = [-1]

        def forward(*_: Any) -> None:
            count[0] = min(count[0] + 1, micro_batches - 1)
            self.enter(f"forward{count[0]}", "start")

        def block_starts(index: int) -> Callable[..., None]:
            # Forward, or its recomputation in backward (checkpointed blocks).
            return lambda *_: setattr(self, "region", index)

        self._hooks = [self.model.register_forward_pre_hook(forward),
                       # Backward starts with what forward did last.
                       self.model.register_forward_hook(lambda *_: self.enter(f"backward{count[0]}", "end")),
                       self.optimizer.register_step_pre_hook(lambda *_: self.enter("optimizer", "all"))]
        self._hooks += [b.register_forward_pre_hook(block_starts(i)) for i, b in enumerate(self.blocks)]
        if self.blocks:
            self._hooks.append(self.blocks[-1].register_forward_hook(lambda *_: setattr(self, "region", "end")))
        return self

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def pack(self, tensor: torch.Tensor) -> Any:
        for save in self.on_save:
            save(tensor)
        return tensor, self.region

    def unpack(self, packed: Any) -> torch.Tensor:
        # Backward is working on what this region saved.
        tensor, self.region = packed
        return tensor

    def saved_tensors_hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
