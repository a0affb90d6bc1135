"""A T5-style encoder-decoder (transformers' T5ForConditionalGeneration on a small config), trained on synthetic
source and target token ids, tuned in tokens/s (source and target tokens both count).

    autotune run --workload examples/t5_encoder_decoder.py:workload --mem-budget 2GB

Its repeated blocks are T5Block, in the encoder and in the decoder alike: ``num_blocks`` counts both stacks, half
in each, so a shallow copy keeps the model's balance.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Block

from autotune import Workload

SOURCE_LEN, TARGET_LEN, VOCAB, DEPTH = 128, 32, 1024, 8
CONFIG = dict(d_model=128, d_ff=256, d_kv=32, num_heads=4, vocab_size=VOCAB, decoder_start_token_id=0,
              pad_token_id=0, use_cache=False)


def build(num_blocks: int | None = None) -> nn.Module:
    blocks = num_blocks or DEPTH
    if blocks % 2:
        raise ValueError(f"{blocks} blocks: an encoder-decoder splits them evenly between its stacks")
    return T5ForConditionalGeneration(T5Config(num_layers=blocks // 2, num_decoder_layers=blocks // 2, **CONFIG))


def make_batch(micro_batch_size: int, device: torch.device, generator: torch.Generator) -> dict[str, torch.Tensor]:
    source = torch.randint(1, VOCAB, (micro_batch_size, SOURCE_LEN), generator=generator)
    target = torch.randint(1, VOCAB, (micro_batch_size, TARGET_LEN), generator=generator)
    return {"input_ids": source.to(device), "labels": target.to(device)}


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def workload() -> Workload:
    return Workload(build_model=build, blocks=(T5Block,), make_batch=make_batch, loss=loss, unit="tokens",
                    units_per_sample=SOURCE_LEN + TARGET_LEN)
