"""A U-Net-style encoder/decoder whose skip connections jump several blocks.

The first encoder level's features skip over every deeper level, the bottleneck and every decoder
level but the last, and are concatenated back just before the output head: the long-range edges that
make a graph hard to cut into a pipeline.

References:
    Ronneberger et al., "U-Net: Convolutional Networks for Biomedical Image Segmentation",
    MICCAI 2015, §2 (contracting path, expansive path, concatenated skip features).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fxsplit.errors import ConfigError
from fxsplit.models.case import Batch, ModelCase, batch_maker, mse_loss, seeded

__all__ = ["UNetConfig", "ConvBlock", "UNet", "PRESETS", "make_case"]


@dataclass(frozen=True)
class UNetConfig:
    """Sizes of a :class:`UNet`.

    Attributes:
        depth: Number of downsampling levels; ``image_size`` must be divisible by ``2**depth``.
        width: Channels of the first level; each deeper level doubles them.
        in_channels: Input image channels.
        out_channels: Output image channels.
        image_size: Height and width of the example images, in pixels.
    """

    depth: int = 2
    width: int = 8
    in_channels: int = 3
    out_channels: int = 3
    image_size: int = 16

    def validate(self) -> None:
        """Raise :class:`ConfigError` for non-positive sizes or an indivisible image size."""
        for name in ("depth", "width", "in_channels", "out_channels", "image_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"UNetConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.image_size % 2**self.depth:
            raise ConfigError(
                f"UNetConfig.image_size={self.image_size} must be divisible by "
                f"2**depth={2**self.depth}; use image_size={2**self.depth * 4}"
            )


PRESETS = {
    "tiny": UNetConfig(),
    "small": UNetConfig(depth=3, width=16, image_size=64),
    "base": UNetConfig(depth=4, width=64, image_size=256),
}


class ConvBlock(nn.Module):
    """``[conv3x3 -> GroupNorm -> ReLU] x 2``, the unit of each U-Net level.

    Args:
        c_in: Input channels.
        c_out: Output channels.

    Shape:
        ``[batch, c_in, h, w] -> [batch, c_out, h, w]``.
    """

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        groups = math.gcd(8, c_out)
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
            nn.GroupNorm(groups, c_out),
            nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
            nn.GroupNorm(groups, c_out),
            nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x [batch, c_in, h, w]``."""
        return self.body(x)


class UNet(nn.Module):
    """Encoder (ConvBlock, max-pool) x depth, bottleneck, decoder (up-conv, concat skip, ConvBlock).

    Args:
        config: The sizes.

    Shape:
        ``images [batch, in_channels, h, w] -> [batch, out_channels, h, w]``.
    """

    def __init__(self, config: UNetConfig) -> None:
        super().__init__()
        widths = [config.width * 2**i for i in range(config.depth + 1)]
        self.down = nn.ModuleList()
        c_in = config.in_channels
        for w in widths[:-1]:
            self.down.append(ConvBlock(c_in, w))
            c_in = w
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = ConvBlock(widths[-2], widths[-1])
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        for w_deep, w in zip(reversed(widths[1:]), reversed(widths[:-1]), strict=True):
            self.up.append(nn.ConvTranspose2d(w_deep, w, 2, stride=2))
            self.merge.append(ConvBlock(2 * w, w))
        self.head = nn.Conv2d(config.width, config.out_channels, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Map ``images [batch, in_channels, h, w]`` to ``[batch, out_channels, h, w]``."""
        skips: list[torch.Tensor] = []
        x = images
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips), strict=True):
            x = merge(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def make_case(config: UNetConfig, *, seed: int = 0, batch_size: int = 2) -> ModelCase:
    """Build a :class:`UNet` with a denoising task (MSE between output and clean image).

    Args:
        config: The sizes.
        seed: Seed of the weights and of the example batch.
        batch_size: Batch size of the example inputs.

    Returns:
        The model case; inputs are noisy images, the target is a random image of the output shape.
    """
    with seeded(seed):
        model = UNet(config)

    def draw(gen: torch.Generator, batch_size: int) -> Batch:
        size = (config.image_size, config.image_size)
        images = torch.randn(batch_size, config.in_channels, *size, generator=gen, device="cpu")
        target = torch.randn(batch_size, config.out_channels, *size, generator=gen, device="cpu")
        return (images,), target

    make_batch = batch_maker(model, draw)
    return ModelCase(
        name="unet",
        model=model,
        example_inputs=make_batch(batch_size, seed)[0],
        make_batch=make_batch,
        loss_fn=mse_loss,
        description=(
            f"U-Net depth={config.depth} width={config.width} image={config.image_size}px "
            f"(skips jump up to {2 * config.depth} blocks)"
        ),
        config=config,
    )
