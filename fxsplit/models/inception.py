"""An Inception-style CNN: blocks of parallel branches whose outputs are concatenated.

Wide, shallow blocks give the condensed graph many antichains, which is what the solvers' state
space is bounded against.

References:
    Szegedy et al., "Going Deeper with Convolutions", CVPR 2015, §4 and Figure 2(b) (the Inception
    module with 1x1 reductions: 1x1, 1x1->3x3, 1x1->5x5 and pool->1x1 branches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fxsplit.errors import ConfigError
from fxsplit.models.case import ModelCase, image_classification_case, seeded

__all__ = ["InceptionConfig", "InceptionBlock", "Inception", "PRESETS", "make_case"]


@dataclass(frozen=True)
class InceptionConfig:
    """Sizes of an :class:`Inception` network.

    Attributes:
        blocks: Inception blocks per stage; a stride-2 max-pool separates stages.
        width: Output channels of each of the four branches in the first stage (doubles per stage).
        in_channels: Image channels.
        image_size: Height and width of the example images, in pixels.
        num_classes: Classifier outputs.
    """

    blocks: tuple[int, ...] = (1, 1)
    width: int = 4
    in_channels: int = 3
    image_size: int = 16
    num_classes: int = 10

    def validate(self) -> None:
        """Raise :class:`ConfigError` when a size is not positive."""
        if not self.blocks or min(self.blocks) < 1:
            raise ConfigError(f"InceptionConfig.blocks must be non-empty, >= 1; got {self.blocks}")
        for name in ("width", "in_channels", "image_size", "num_classes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"InceptionConfig.{name} must be >= 1, got {getattr(self, name)}")


PRESETS = {
    "tiny": InceptionConfig(),
    "small": InceptionConfig(blocks=(2, 2), width=16, image_size=32),
    "base": InceptionConfig(blocks=(2, 5, 2), width=64, image_size=224, num_classes=1000),
}


def _conv(c_in: int, c_out: int, kernel: int) -> nn.Sequential:
    """``conv(kernel, same padding) -> BatchNorm -> ReLU``."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
    )


class InceptionBlock(nn.Module):
    """Four parallel branches concatenated on channels: 1x1, 1x1->3x3, 1x1->5x5, maxpool->1x1.

    Args:
        c_in: Input channels.
        width: Output channels of each branch; the block outputs ``4 * width``.

    Shape:
        ``[batch, c_in, h, w] -> [batch, 4 * width, h, w]``.
    """

    def __init__(self, c_in: int, width: int) -> None:
        super().__init__()
        reduce = max(width // 2, 1)
        self.branch1 = _conv(c_in, width, 1)
        self.branch3 = nn.Sequential(_conv(c_in, reduce, 1), _conv(reduce, width, 3))
        self.branch5 = nn.Sequential(_conv(c_in, reduce, 1), _conv(reduce, width, 5))
        self.branch_pool = nn.Sequential(
            nn.MaxPool2d(3, stride=1, padding=1), _conv(c_in, width, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the four branches to ``x [batch, c_in, h, w]`` and concatenate them."""
        branches = [self.branch1(x), self.branch3(x), self.branch5(x), self.branch_pool(x)]
        return torch.cat(branches, dim=1)


class Inception(nn.Module):
    """Stem conv, stages of :class:`InceptionBlock` separated by max-pools, avgpool, classifier.

    Args:
        config: The sizes.

    Shape:
        ``images [batch, in_channels, h, w] -> logits [batch, num_classes]``.
    """

    def __init__(self, config: InceptionConfig) -> None:
        super().__init__()
        self.stem = _conv(config.in_channels, 4 * config.width, 3)
        layers: list[nn.Module] = []
        c_in = 4 * config.width
        for i, depth in enumerate(config.blocks):
            if i > 0:
                layers.append(nn.MaxPool2d(3, stride=2, padding=1))
            for _ in range(depth):
                layers.append(InceptionBlock(c_in, config.width * 2**i))
                c_in = 4 * config.width * 2**i
        self.blocks = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, config.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Classify ``images [batch, in_channels, h, w]`` into logits ``[batch, num_classes]``."""
        x = self.blocks(self.stem(images))
        return self.fc(torch.flatten(self.pool(x), 1))


def make_case(config: InceptionConfig, *, seed: int = 0, batch_size: int = 2) -> ModelCase:
    """Build an :class:`Inception` network with an image classification task (cross entropy).

    Args:
        config: The sizes.
        seed: Seed of the weights and of the example batch.
        batch_size: Batch size of the example inputs.

    Returns:
        The model case.
    """
    with seeded(seed):
        model = Inception(config)
    description = (
        f"Inception blocks={list(config.blocks)} width={config.width}x4 "
        f"image={config.image_size}px classes={config.num_classes}"
    )
    return image_classification_case("inception", model, config, description, seed=seed, batch_size=batch_size)
