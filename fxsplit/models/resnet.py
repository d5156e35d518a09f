"""A ResNet-style CNN: stem, BasicBlocks with residual skips and BatchNorm, avgpool, fc.

References:
    He et al., "Deep Residual Learning for Image Recognition", CVPR 2016, §3 and Table 1
    (the BasicBlock of ResNet-18/34, with a 1x1 projection on the skip when the shape changes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fxsplit.errors import ConfigError
from fxsplit.models.case import ModelCase, image_classification_case, seeded

__all__ = ["ResNetConfig", "BasicBlock", "ResNet", "PRESETS", "make_case"]


@dataclass(frozen=True)
class ResNetConfig:
    """Sizes of a :class:`ResNet`.

    Attributes:
        blocks: BasicBlocks per stage; stage ``i > 0`` halves the resolution and doubles the width.
        width: Channels of the stem and the first stage.
        in_channels: Image channels.
        image_size: Height and width of the example images, in pixels.
        num_classes: Classifier outputs.
    """

    blocks: tuple[int, ...] = (1, 1)
    width: int = 8
    in_channels: int = 3
    image_size: int = 16
    num_classes: int = 10

    def validate(self) -> None:
        """Raise :class:`ConfigError` when a size is not positive."""
        if not self.blocks or min(self.blocks) < 1:
            raise ConfigError(f"ResNetConfig.blocks must be non-empty and >= 1, got {self.blocks}")
        for name in ("width", "in_channels", "image_size", "num_classes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ResNetConfig.{name} must be >= 1, got {getattr(self, name)}")


PRESETS = {
    "tiny": ResNetConfig(),
    "small": ResNetConfig(blocks=(2, 2, 2), width=32, image_size=32),
    "base": ResNetConfig(blocks=(2, 2, 2, 2), width=64, image_size=224, num_classes=1000),
}


class BasicBlock(nn.Module):
    """``relu(bn(conv3x3(relu(bn(conv3x3(x))))) + skip(x))``.

    Args:
        c_in: Input channels.
        c_out: Output channels.
        stride: Stride of the first convolution (2 halves the resolution).

    Shape:
        ``[batch, c_in, h, w] -> [batch, c_out, h / stride, w / stride]``.
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.skip = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x [batch, c_in, h, w]``."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.skip(x))


class ResNet(nn.Module):
    """Stem (conv3x3, BN, ReLU), stages of BasicBlocks, global average pool, linear classifier.

    Args:
        config: The sizes.

    Shape:
        ``images [batch, in_channels, h, w] -> logits [batch, num_classes]``.
    """

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        w = config.width
        self.stem = nn.Sequential(
            nn.Conv2d(config.in_channels, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU()
        )
        stages: list[nn.Module] = []
        c_in = w
        for i, depth in enumerate(config.blocks):
            c_out = w * 2**i
            for j in range(depth):
                stride = 2 if i > 0 and j == 0 else 1
                stages.append(BasicBlock(c_in, c_out, stride))
                c_in = c_out
        self.blocks = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, config.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Classify ``images [batch, in_channels, h, w]`` into logits ``[batch, num_classes]``."""
        x = self.blocks(self.stem(images))
        return self.fc(torch.flatten(self.pool(x), 1))


def make_case(config: ResNetConfig, *, seed: int = 0, batch_size: int = 2) -> ModelCase:
    """Build a :class:`ResNet` with an image classification task (cross entropy).

    Args:
        config: The sizes.
        seed: Seed of the weights and of the example batch.
        batch_size: Batch size of the example inputs.

    Returns:
        The model case.
    """
    with seeded(seed):
        model = ResNet(config)
    description = (
        f"ResNet blocks={list(config.blocks)} width={config.width} "
        f"image={config.image_size}px classes={config.num_classes}"
    )
    return image_classification_case("resnet", model, config, description, seed=seed, batch_size=batch_size)
