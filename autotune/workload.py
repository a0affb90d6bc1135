"""A workload: the user's own model and training step, for ``--workload module:function``.

::

    from autotune import Workload

    def workload() -> Workload:
        return Workload(
            build_model=build,            # build(num_blocks=None) -> nn.Module; num_blocks for shallow copies
            blocks=(MyBlock,),            # classes of the repeated blocks
            make_batch=make_batch,        # make_batch(micro_batch_size, device, generator) -> tensor, tuple or dict
            loss=loss,                    # loss(model, batch) -> scalar tensor
            optimizer=None,               # optimizer(params) -> torch.optim.Optimizer; None: AdamW(lr=1e-4)
            clip_grad_norm=None,          # max norm, or None
            unit="samples",               # what throughput counts
            units_per_sample=1,           # e.g. the sequence length for tokens
        )

The function is imported and called in the worker processes only (the driver never imports torch or the user's
code): in the host probe, which checks it before any launch, in each trial and in the memory estimator's fake
step. ``build_model`` is called under autotune's device contexts (the meta device for trials, fake tensors for
estimates), so it must create its tensors without naming a device. ``make_batch`` gets the device the batch goes
to and a seeded CPU ``torch.Generator``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Workload:
    """What a trial trains and how: see the module."""

    build_model: Callable[..., Any]
    blocks: tuple[type, ...]
    make_batch: Callable[[int, Any, Any], Any]
    loss: Callable[[Any, Any], Any]
    optimizer: Callable[[list[Any]], Any] | None = None
    clip_grad_norm: float | None = None
    unit: str = "samples"
    units_per_sample: int = 1

    def check(self) -> None:
        """A ValueError naming the first field that is not what it should be."""
        if not callable(self.build_model):
            raise ValueError("build_model is not callable; give build(num_blocks=None) -> nn.Module")
        if not isinstance(self.blocks, (tuple, list)) or not self.blocks or not all(
                isinstance(c, type) for c in self.blocks):
            raise ValueError(f"blocks is {self.blocks!r}; give a tuple of the repeated blocks' classes")
        for name in ("make_batch", "loss"):
            if not callable(getattr(self, name)):
                raise ValueError(f"{name} is not callable")
        if self.optimizer is not None and not callable(self.optimizer):
            raise ValueError("optimizer is not callable; give optimizer(params) -> torch.optim.Optimizer, or None")
        if self.clip_grad_norm is not None and not (isinstance(self.clip_grad_norm, (int, float))
                                                    and self.clip_grad_norm > 0):
            raise ValueError(f"clip_grad_norm is {self.clip_grad_norm!r}; give a positive max norm, or None")
        if not isinstance(self.unit, str) or not self.unit.isidentifier():
            raise ValueError(f"unit is {self.unit!r}; give a plural noun like samples, images or tokens")
        if not isinstance(self.units_per_sample, int) or self.units_per_sample < 1:
            raise ValueError(f"units_per_sample is {self.units_per_sample!r}; give a positive whole number")
