"""A multi-layer perceptron for regression: the simplest chain to split."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fxsplit.errors import ConfigError
from fxsplit.models.case import Batch, ModelCase, batch_maker, mse_loss, seeded

__all__ = ["MlpConfig", "MLP", "PRESETS", "make_case"]


@dataclass(frozen=True)
class MlpConfig:
    """Sizes of an :class:`MLP`.

    Attributes:
        in_features: Input width.
        width: Hidden width.
        layers: Number of hidden ``Linear -> activation`` layers (>= 1).
        out_features: Output width.
        layernorm: Put a LayerNorm before each activation.
    """

    in_features: int = 16
    width: int = 32
    layers: int = 3
    out_features: int = 8
    layernorm: bool = False

    def validate(self) -> None:
        """Raise :class:`ConfigError` when a size is not positive."""
        for name in ("in_features", "width", "layers", "out_features"):
            if getattr(self, name) < 1:
                raise ConfigError(f"MlpConfig.{name} must be >= 1, got {getattr(self, name)}")


PRESETS = {
    "tiny": MlpConfig(),
    "small": MlpConfig(in_features=256, width=1024, layers=6, out_features=64),
    "base": MlpConfig(in_features=1024, width=4096, layers=12, out_features=1024, layernorm=True),
}


class MLP(nn.Module):
    """``[Linear -> (LayerNorm) -> GELU] x layers -> Linear``.

    Args:
        config: The sizes.

    Shape:
        ``x [batch, in_features] -> [batch, out_features]``.
    """

    def __init__(self, config: MlpConfig) -> None:
        super().__init__()
        widths = [config.in_features] + [config.width] * config.layers
        hidden: list[nn.Module] = []
        for w_in, w_out in zip(widths[:-1], widths[1:], strict=True):
            hidden.append(nn.Linear(w_in, w_out))
            if config.layernorm:
                hidden.append(nn.LayerNorm(w_out))
            hidden.append(nn.GELU())
        self.hidden = nn.Sequential(*hidden)
        self.head = nn.Linear(config.width, config.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``x [batch, in_features]`` to ``[batch, out_features]``."""
        return self.head(self.hidden(x))


def make_case(config: MlpConfig, *, seed: int = 0, batch_size: int = 2) -> ModelCase:
    """Build an :class:`MLP` with a regression task (MSE against random targets).

    Args:
        config: The sizes.
        seed: Seed of the weights and of the example batch.
        batch_size: Batch size of the example inputs.

    Returns:
        The model case.
    """
    with seeded(seed):
        model = MLP(config)

    def draw(gen: torch.Generator, batch_size: int) -> Batch:
        x = torch.randn(batch_size, config.in_features, generator=gen, device="cpu")
        y = torch.randn(batch_size, config.out_features, generator=gen, device="cpu")
        return (x,), y

    make_batch = batch_maker(model, draw)

    return ModelCase(
        name="mlp",
        model=model,
        example_inputs=make_batch(batch_size, seed)[0],
        make_batch=make_batch,
        loss_fn=mse_loss,
        description=f"MLP {config.in_features}->{config.width}x{config.layers}->{config.out_features}",
        config=config,
    )
