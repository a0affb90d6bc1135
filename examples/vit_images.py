"""A vision transformer classifying synthetic images, tuned in images/s.

    autotune run --workload examples/vit_images.py:workload --mem-budget 2GB

Its blocks are plain torch modules; the images and labels are random (speed and memory do not depend on what the
pixels show). Swap ``make_batch`` for a draw from your own data loader to time the real input pipeline too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autotune import Workload

IMAGE_SIZE, PATCH, CHANNELS, CLASSES = 64, 8, 3, 100
WIDTH, HEADS, DEPTH = 192, 3, 8


class Block(nn.Module):
    """Pre-norm self-attention and MLP: the repeated unit FSDP wraps, checkpoints and copies."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, WIDTH))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, depth: int = DEPTH) -> None:
        super().__init__()
        self.patches = nn.Conv2d(CHANNELS, WIDTH, kernel_size=PATCH, stride=PATCH)
        self.cls = nn.Parameter(torch.empty(1, 1, WIDTH))
        self.position = nn.Parameter(torch.empty(1, (IMAGE_SIZE // PATCH) ** 2 + 1, WIDTH))
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # The parameters this module makes itself: autotune materializes a meta-built model by calling each
        # module's reset_parameters.
        nn.init.normal_(self.cls, std=0.02)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.position
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def build(num_blocks: int | None = None) -> nn.Module:
    return VisionTransformer(num_blocks or DEPTH)


def make_batch(micro_batch_size: int, device: torch.device, generator: torch.Generator):
    images = torch.randn(micro_batch_size, CHANNELS, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    labels = torch.randint(0, CLASSES, (micro_batch_size,), generator=generator)
    return images.to(device), labels.to(device)


def loss(model: nn.Module, batch) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def workload() -> Workload:
    return Workload(build_model=build, blocks=(Block,), make_batch=make_batch, loss=loss, unit="images",
                    units_per_sample=1)
