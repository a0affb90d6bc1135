"""What one training step is made of: the batch, the loss, the optimizer and gradient clipping.

The built-in recipe is a causal language model's on random token ids, stepped by AdamW; a workload
(:mod:`autotune.workload`) brings its own. The trial (:mod:`autotune.worker.train`) and the estimator's fake step
run the same recipe, so that what is estimated is what is measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from autotune.presets import parse_model_spec


def default_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def token_batch(vocab_size: int, seq_len: int) -> Callable[[int, torch.device, torch.Generator], torch.Tensor]:
    """Synthetic tokens: throughput and memory do not depend on what the tokens say."""
    def make(micro_batch_size: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, vocab_size, (micro_batch_size, seq_len), generator=generator).to(device)
    return make


def language_model_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The language-modelling loss, from a transformers output or a bare loss."""
    output = model(input_ids=tokens, labels=tokens)
    return output.loss if hasattr(output, "loss") else output


@dataclass(frozen=True)
class StepRecipe:
    make_batch: Callable[[int, torch.device, torch.Generator], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = default_optimizer
    clip_grad_norm: float | None = None

    def batch(self, micro_batch_size: int, device: torch.device, seed: int) -> Any:
        return self.make_batch(micro_batch_size, device, torch.Generator().manual_seed(seed))

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over the parameters that train: frozen ones (LoRA's base) get no state."""
        return self.optimizer([p for p in model.parameters() if p.requires_grad])


def recipe_for(model: str, vocab_size: int, seq_len: int) -> StepRecipe:
    """The step ``model`` trains with: its workload's, or the causal LM's on random tokens."""
    spec = parse_model_spec(model)
    if spec.kind != "workload":
        return StepRecipe(token_batch(vocab_size, seq_len), language_model_loss)
    from autotune.worker.workload_loader import load_workload

    workload = load_workload(spec.value)
    return StepRecipe(workload.make_batch, workload.loss, workload.optimizer or default_optimizer,
                      workload.clip_grad_norm)


def batch_device(batch: Any) -> torch.device:
    """The device of a batch's first tensor (a tensor, a tuple or list, or a dict)."""
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")
