"""A causal language model with its own loss (label-smoothed next-token cross-entropy), a foreach AdamW with
weight decay, and gradient clipping: the step a training script runs, tuned in tokens/s.

    autotune run --workload examples/causal_lm_own_step.py:workload --mem-budget 2GB
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from autotune import Workload

SEQ_LEN, VOCAB = 128, 1024
CONFIG = dict(hidden_size=128, intermediate_size=344, num_attention_heads=4, num_key_value_heads=4,
              vocab_size=VOCAB, max_position_embeddings=SEQ_LEN, tie_word_embeddings=False, use_cache=False)


def build(num_blocks: int | None = None) -> nn.Module:
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=num_blocks or 4, **CONFIG))


def make_batch(micro_batch_size: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (micro_batch_size, SEQ_LEN), generator=generator).to(device)


def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1), label_smoothing=0.1)


def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, foreach=True)


def workload() -> Workload:
    return Workload(build_model=build, blocks=(LlamaDecoderLayer,), make_batch=make_batch, loss=loss,
                    optimizer=optimizer, clip_grad_norm=1.0, unit="tokens", units_per_sample=SEQ_LEN)
