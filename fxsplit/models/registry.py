"""The registry of built-in zoo models: :func:`get` and :func:`list_models`."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from fxsplit.errors import ConfigError
from fxsplit.models import gpt, inception, mlp, resnet, unet
from fxsplit.models.case import (
    SIZES,
    Batch,
    ModelCase,
    batch_maker,
    mse_loss,
    resolve_config,
    seeded,
)
from fxsplit.models.dag import build_dag_module, random_dag_spec
from fxsplit.models.hf import HF_MODELS, hf

__all__ = ["DagConfig", "get", "list_models"]


@dataclass(frozen=True)
class DagConfig:
    """Sizes of the ``"dag"`` zoo entry: a :func:`random_dag_spec` drawn from ``seed``.

    Attributes:
        max_nodes: Largest number of DAG nodes.
        width: Feature width of every value.
    """

    max_nodes: int = 12
    width: int = 8

    def validate(self) -> None:
        """Raise :class:`ConfigError` when a size is not positive."""
        if self.max_nodes < 1 or self.width < 1:
            raise ConfigError(f"DagConfig sizes must be >= 1, got {self}")


_DAG_PRESETS = {
    "tiny": DagConfig(),
    "small": DagConfig(max_nodes=40, width=64),
    "base": DagConfig(max_nodes=200, width=256),
}


def _dag_case(config: DagConfig, *, seed: int = 0, batch_size: int = 2) -> ModelCase:
    """A random DAG module (spec and weights from ``seed``), MSE of every output to one target."""
    spec = random_dag_spec(random.Random(seed), config.max_nodes)
    with seeded(seed):
        model = build_dag_module(spec, config.width)

    def draw(gen: torch.Generator, batch_size: int) -> Batch:
        x = torch.randn(batch_size, config.width, generator=gen, device="cpu")
        return (x,), torch.randn(batch_size, config.width, generator=gen, device="cpu")

    make_batch = batch_maker(model, draw)
    return ModelCase(
        name="dag",
        model=model,
        example_inputs=make_batch(batch_size, seed)[0],
        make_batch=make_batch,
        loss_fn=mse_loss,
        description=f"random DAG: {len(spec.nodes)} nodes, {len(spec.outputs)} outputs, "
        f"width={config.width} (seed {seed})",
        config=config,
    )


@dataclass(frozen=True)
class _Entry:
    presets: Mapping[str, Any]
    build: Callable[..., ModelCase]
    summary: str


_REGISTRY: Mapping[str, _Entry] = MappingProxyType(
    {
        "mlp": _Entry(mlp.PRESETS, mlp.make_case, "MLP regression (chain)"),
        "resnet": _Entry(resnet.PRESETS, resnet.make_case, "ResNet CNN (residual skips, BN)"),
        "gpt": _Entry(gpt.PRESETS, gpt.make_case, "GPT decoder (causal attn, tied head)"),
        "unet": _Entry(unet.PRESETS, unet.make_case, "U-Net (long concat skips)"),
        "inception": _Entry(inception.PRESETS, inception.make_case, "Inception (wide branches)"),
        "dag": _Entry(_DAG_PRESETS, _dag_case, "random DAG (branches, merges, multi-output)"),
    }
)


def list_models() -> dict[str, str]:
    """Zoo model names with a one-line summary each, in registry order.

    Example:
        >>> "gpt" in list_models()
        True
    """
    return {name: entry.summary for name, entry in _REGISTRY.items()}


def get(
    name: str,
    size: str = "tiny",
    *,
    seed: int = 0,
    batch_size: int = 2,
    device: str | torch.device | None = None,
    **overrides: Any,
) -> ModelCase:
    """Build a zoo model with example inputs, synthetic data and a loss.

    Args:
        name: A key of :func:`list_models`, or ``"hf:NAME"`` for :func:`fxsplit.models.hf`.
        size: One of ``"tiny"`` (forward+backward in milliseconds on CPU), ``"small"``, ``"base"``
            (real-world sizes, e.g. GPT-2 small, ResNet-18). ``hf:`` names take only ``"tiny"``
            (their default small config); pass config fields or ``preset=`` instead.
        seed: Seed of the weights and the example batch; the caller's RNG state is left untouched.
        batch_size: Batch size of the example inputs.
        device: Build the model and inputs on this device, e.g. ``"meta"`` (no memory allocated).
            ``None`` uses torch's current default (a ``with torch.device(...)`` block applies).
        **overrides: Fields of the model's config dataclass, e.g. ``layers=4, width=64`` for
            ``gpt`` (see ``GptConfig``, ``ResNetConfig``, ``UNetConfig``, ...).

    Returns:
        The model case, model in training mode.

    Raises:
        ConfigError: Unknown name (the message lists the known ones), size or override, or an
            ``hf:`` name without transformers installed.

    Example:
        >>> case = get("gpt", layers=1)
        >>> case.model.lm_head.weight is case.model.tok_emb.weight
        True
    """
    context = torch.device(device) if device is not None else contextlib.nullcontext()
    with context:
        if name.startswith("hf:"):
            if size != "tiny":
                raise ConfigError(
                    f"size={size!r} applies to zoo models only; Hugging Face models take config "
                    "fields, or preset= for hf:llama (e.g. preset='7b')"
                )
            return hf(name, seed=seed, batch_size=batch_size, **overrides)
        if name not in _REGISTRY:
            known = ", ".join([*_REGISTRY, *(f"hf:{n}" for n in HF_MODELS)])
            raise ConfigError(f"unknown model {name!r}; known models: {known}")
        entry = _REGISTRY[name]
        if size not in SIZES:
            raise ConfigError(f"unknown size {size!r}; known sizes: {', '.join(SIZES)}")
        config = resolve_config(entry.presets, size, overrides)
        return entry.build(config, seed=seed, batch_size=batch_size)
