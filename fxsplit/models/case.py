"""The :class:`ModelCase` bundle and the helpers every model builder shares.

A model case is everything a test, bench or CLI command needs to run a model without knowing what it
is: the module, example inputs, a synthetic data generator and a loss. Builders are deterministic:
weights and data are drawn from a seed with the caller's global RNG state left untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from fxsplit.errors import ConfigError

__all__ = [
    "ModelCase",
    "Batch",
    "MakeBatch",
    "LossFn",
    "SIZES",
    "seeded",
    "model_device",
    "resolve_config",
    "batch_maker",
    "generator",
    "primary_tensor",
    "cross_entropy_loss",
    "next_token_loss",
    "mse_loss",
    "image_classification_case",
]

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]
"""``(inputs, target)``: positional model inputs and the target the loss compares against."""

MakeBatch = Callable[[int, int], Batch]
"""``make_batch(batch_size, seed) -> (inputs, target)``."""

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
"""``loss_fn(output, target) -> scalar``; ``output`` is whatever the model returns."""

SIZES: tuple[str, ...] = ("tiny", "small", "base")
"""The size presets every zoo model offers, smallest first."""

C = TypeVar("C")


@dataclass(frozen=True)
class ModelCase:
    """A model with example inputs, synthetic training data and a loss.

    Attributes:
        name: Registry name, e.g. ``"gpt"`` or ``"hf:llama"``.
        model: The module, in training mode, on the device it was built on (``cpu`` or ``meta``).
        example_inputs: Positional inputs for capture, from ``make_batch(batch_size, seed)``.
        example_kwargs: Keyword inputs for capture (may be empty).
        make_batch: ``make_batch(batch_size, seed) -> (inputs, target)``; deterministic for a seed,
            tensors on the model's device. ``model(*inputs)`` runs without keyword inputs.
        loss_fn: ``loss_fn(model(*inputs), target) -> scalar tensor``.
        description: One line for people: architecture and sizes.
        config: The frozen config the model was built from (a dataclass or a Hugging Face config).

    Example:
        >>> import fxsplit.models as zoo
        >>> case = zoo.get("mlp")
        >>> inputs, target = case.make_batch(4, 0)
        >>> case.loss_fn(case.model(*inputs), target).ndim
        0
    """

    name: str
    model: nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    make_batch: MakeBatch
    loss_fn: LossFn
    description: str
    example_kwargs: Mapping[str, Any] = field(default_factory=dict)
    config: Any = None

    def num_parameters(self) -> int:
        """Number of distinct parameter elements (tied weights counted once)."""
        return sum(p.numel() for p in self.model.parameters())

    def __repr__(self) -> str:
        shapes = ", ".join(f"{tuple(t.shape)}:{t.dtype}" for t in self.example_inputs)
        return (
            f"ModelCase(name={self.name!r}, params={self.num_parameters():,}, "
            f"inputs=[{shapes}], description={self.description!r})"
        )


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG inside the block and restore the caller's RNG state after it.

    Args:
        seed: The seed for ``torch.manual_seed``.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def model_device(model: nn.Module) -> torch.device:
    """The device of the first parameter or buffer of ``model`` (``cpu`` when it has none)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device
    return torch.device("cpu")


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``; data is drawn on CPU and then moved to the device."""
    return torch.Generator(device="cpu").manual_seed(seed)


def batch_maker(model: nn.Module, draw: Callable[[torch.Generator, int], Batch]) -> MakeBatch:
    """Wrap a CPU data generator as a ``make_batch`` that follows the model's device.

    Args:
        model: The model; batches land on the device of its first parameter at call time.
        draw: ``draw(generator, batch_size) -> (inputs, target)`` drawing CPU tensors from the
            generator (pass ``device="cpu"`` explicitly so a ``torch.device`` context cannot move
            them).

    Returns:
        ``make_batch(batch_size, seed) -> (inputs, target)``.
    """

    def make_batch(batch_size: int, seed: int) -> Batch:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        inputs, target = draw(generator(seed), batch_size)
        device = model_device(model)
        return tuple(t.to(device) for t in inputs), target.to(device)

    return make_batch


def resolve_config(presets: Mapping[str, C], size: str, overrides: Mapping[str, Any]) -> C:
    """Pick a size preset and apply keyword overrides to it.

    Args:
        presets: Frozen config dataclass per size name.
        size: One of the keys of ``presets``.
        overrides: Field name to value; each must be a field of the config.

    Returns:
        The preset with the overrides replaced (and validated when it has ``validate()``).

    Raises:
        ConfigError: ``size`` is unknown, an override names no field, or the config is invalid.
    """
    if size not in presets:
        raise ConfigError(f"unknown size {size!r}; known sizes: {', '.join(presets)}")
    base = presets[size]
    fields = {f.name for f in dataclasses.fields(base)}  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(
            f"unknown option(s) {', '.join(unknown)} for {type(base).__name__}; "
            f"known options: {', '.join(sorted(fields))}"
        )
    config = dataclasses.replace(base, **overrides)  # type: ignore[type-var]
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate()
    return config


def primary_tensor(output: Any) -> torch.Tensor:
    """The tensor a loss reads from a model output.

    Args:
        output: A tensor; a tuple or list (its first element); a mapping or Hugging Face
            ``ModelOutput`` (its ``"logits"`` entry, else its first value).

    Returns:
        The tensor.

    Raises:
        ConfigError: ``output`` holds no tensor where one is expected.
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        if "logits" in output:
            return primary_tensor(output["logits"])
        if output:
            return primary_tensor(next(iter(output.values())))
    if isinstance(output, (tuple, list)) and output:
        return primary_tensor(output[0])
    raise ConfigError(f"cannot find a tensor in a model output of type {type(output).__name__}")


def cross_entropy_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of class logits ``[batch, classes]`` against labels ``[batch]``."""
    return nn.functional.cross_entropy(primary_tensor(output), target)


def next_token_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of token logits ``[batch, seq, vocab]`` against token ids ``[batch, seq]``."""
    logits = primary_tensor(output)
    return nn.functional.cross_entropy(logits.flatten(0, -2), target.flatten())


def mse_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the output tensor (or the sum over a tuple of outputs) and ``target``."""
    if isinstance(output, (tuple, list)):
        return torch.stack([nn.functional.mse_loss(o, target) for o in output]).sum()
    return nn.functional.mse_loss(primary_tensor(output), target)


def image_classification_case(
    name: str, model: nn.Module, config: Any, description: str, *, seed: int, batch_size: int
) -> ModelCase:
    """A :class:`ModelCase` for a classifier of ``[batch, in_channels, image_size, image_size]``
    images into ``config.num_classes`` classes (cross entropy): the ResNet and Inception tasks.

    Args:
        name: Registry name.
        model: The classifier, already built under :func:`seeded`.
        config: Has ``in_channels``, ``image_size`` and ``num_classes``.
        description: One line for people.
        seed: Seed of the example batch.
        batch_size: Batch size of the example inputs.
    """

    def draw(gen: torch.Generator, n: int) -> Batch:
        shape = (n, config.in_channels, config.image_size, config.image_size)
        images = torch.randn(*shape, generator=gen, device="cpu")
        labels = torch.randint(0, config.num_classes, (n,), generator=gen, device="cpu")
        return (images,), labels

    make_batch = batch_maker(model, draw)
    return ModelCase(
        name=name, model=model, example_inputs=make_batch(batch_size, seed)[0], make_batch=make_batch,
        loss_fn=cross_entropy_loss, description=description, config=config,
    )

