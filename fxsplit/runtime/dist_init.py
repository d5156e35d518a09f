"""Default values of a stage's tensors: the model's own initialisation, run for this stage only.

When neither a state dict nor ``init_fn`` gives a tensor its value, it gets what the model's
constructor would have given it, without the whole model ever being materialised on one rank.
Each step only sees the tensors the steps before it left:

1. **Hugging Face models** (a ``transformers.PreTrainedModel``): the model's ``_init_weights``,
   applied to every module in post-order, each module by the ``_init_weights`` of the nearest
   ``PreTrainedModel`` holding it, as ``PreTrainedModel.initialize_weights`` does (so GPT-2's
   ``Conv1D`` gets ``normal(0, initializer_range)`` and the residual projections their scaled
   variant).
2. **Every module's** ``reset_parameters()`` (torch's own layers, and any module that has one),
   for the modules directly holding a tensor still without a value.
3. **The constructor's value**: ``model_fn()`` is called once more with every parameter moved to
   the meta device as it is registered (peak: one parameter), except the parameters still needed
   (matched by module class, name, shape and dtype); buffers stay real (they are small: causal
   masks, position ids, rotary tables). Only then is a tensor reported missing.

Steps 1 and 2 run on the model built on the meta device, with this stage's tensors (on the
stage's device) swapped in under every original name, tied aliases included: the init code
writes them in place, on the real device, while the same code on the other (meta) tensors
allocates and computes nothing. Which tensors an init step wrote is read off the tensors: the
floating ones are filled with NaN first and count as initialised once no NaN is left; integer and
bool tensors (position ids, masks) always take the constructor's value (step 3).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn

__all__ = ["Pending", "default_init", "hf_pretrained_base", "parameters_on_meta", "swapped_in"]

log = logging.getLogger(__name__)

Pending = dict[str, tuple[tuple[str, ...], torch.Tensor]]
"""Graph name -> (every original name, the stage's tensor) of the tensors to fill."""


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner_name, _, leaf = name.rpartition(".")
    return (module.get_submodule(owner_name) if owner_name else module), leaf


@contextlib.contextmanager
def swapped_in(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block, ``model``'s tensor ``name`` is ``tensors[name]`` (the same object).

    Restores the original tensors on exit, so ``model`` keeps no reference to the stage's.
    """
    saved: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for name, tensor in tensors.items():
            owner, leaf = _owner(model, name)
            slots = cast(
                dict[str, Any], owner._parameters if leaf in owner._parameters else owner._buffers
            )
            saved.append((slots, leaf, slots[leaf]))
            slots[leaf] = tensor
        yield
    finally:
        for slots, leaf, original in reversed(saved):
            slots[leaf] = original


def _unset(tensor: torch.Tensor) -> bool:
    """True while an init step has not written every element of ``tensor``."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return True
    return bool(torch.isnan(tensor).any())


def hf_pretrained_base() -> type | None:
    """``transformers.PreTrainedModel`` when transformers is imported (a Hugging Face model
    implies it is); None otherwise, without importing it."""
    module = sys.modules.get("transformers")
    return getattr(module, "PreTrainedModel", None) if module is not None else None


def _holders(model: nn.Module, names: set[str]) -> set[int]:
    """Ids of the modules with one of ``names`` anywhere in their subtree."""
    ids: set[int] = set()
    for name in names:
        path = name.split(".")[:-1]
        module = model
        ids.add(id(module))
        for part in path:
            module = module.get_submodule(part)
            ids.add(id(module))
    return ids


def _apply_hf_init(model: nn.Module, names: set[str]) -> bool:
    """Step 1: ``_init_weights`` on every module holding one of ``names``, post-order."""
    base = hf_pretrained_base()
    if base is None or not isinstance(model, base):
        return False
    wanted = _holders(model, names)

    def walk(module: nn.Module, init: Callable[[nn.Module], None]) -> None:
        for child in module.children():
            if id(child) in wanted:
                walk(child, child._init_weights if isinstance(child, base) else init)  # type: ignore[arg-type]
        init(module)

    walk(model, model._init_weights)  # type: ignore[arg-type]
    return True


def _apply_reset(model: nn.Module, names: set[str]) -> None:
    """Step 2: ``reset_parameters()`` of each module directly holding one of ``names``."""
    done: set[int] = set()
    for name in sorted(names):
        owner, _ = _owner(model, name)
        reset = getattr(owner, "reset_parameters", None)
        if id(owner) not in done and callable(reset):
            reset()
            done.add(id(owner))


def _run_inits(meta_model: nn.Module, pending: Pending, origin: dict[str, str]) -> None:
    """Steps 1 and 2 on the stage's tensors swapped into ``meta_model``."""
    with torch.no_grad():
        for _aliases, tensor in pending.values():
            if tensor.is_floating_point() or tensor.is_complex():
                tensor.fill_(float("nan"))
        swap = {alias: t for aliases, t in pending.values() for alias in aliases}
        with swapped_in(meta_model, swap):
            steps = [("_init_weights", _apply_hf_init), ("reset_parameters", _apply_reset)]
            for label, step in steps:
                left = {n for n, (_a, t) in pending.items() if n not in origin and _unset(t)}
                if left:
                    step(meta_model, {a for n in left for a in pending[n][0]})
                    origin.update({n: label for n in left if not _unset(pending[n][1])})


@contextlib.contextmanager
def parameters_on_meta(
    keep: Callable[[nn.Module, str, nn.Parameter], bool] | None = None,
) -> Iterator[None]:
    """Inside the block, every parameter a module registers moves to the meta device at once.

    Buffers stay real. The peak extra memory is one parameter (the one being registered) plus
    those kept. Uses torch's global parameter-registration hook
    (``torch.nn.modules.module.register_module_parameter_registration_hook``), removed when the
    block ends; modules built in other threads meanwhile are affected too.

    Args:
        keep: ``keep(module, name, parameter)``: True leaves that parameter real (default: none).
    """
    from torch.nn.modules.module import register_module_parameter_registration_hook

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.device.type == "meta" or (keep is not None and keep(module, name, param)):
            return None  # keep it as it is
        return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    handle = register_module_parameter_registration_hook(to_meta)  # type: ignore[arg-type]  # torch's stub says None; a Parameter replaces
    try:
        yield
    finally:
        handle.remove()


def _constructor_values(
    model_fn: Callable[[], nn.Module], meta_model: nn.Module, names: set[str]
) -> dict[str, torch.Tensor]:
    """Step 3: the values ``model_fn()`` gives ``names`` (aliases), all else on meta."""
    wanted = set()
    for name in names:
        owner, leaf = _owner(meta_model, name)
        if leaf in owner._parameters:
            p = owner._parameters[leaf]
            wanted.add((type(owner), leaf, tuple(p.shape), p.dtype))  # type: ignore[union-attr]

    def keep(module: nn.Module, leaf: str, param: nn.Parameter) -> bool:
        return (type(module), leaf, tuple(param.shape), param.dtype) in wanted

    with parameters_on_meta(keep):
        model = model_fn()
    tensors = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    return {n: t for n, t in tensors if n in names and t.device.type != "meta"}


def default_init(
    meta_model: nn.Module, pending: Pending, model_fn: Callable[[], nn.Module] | None
) -> tuple[dict[str, str], list[str]]:
    """Fill ``pending`` tensors as the model's constructor would; see the module docstring.

    Args:
        meta_model: The model built on the meta device (its tensors are swapped, not changed).
        pending: The tensors to fill, in place, on their own device.
        model_fn: Builds the model (for step 3); None skips step 3.

    Returns:
        ``(origin, missing)``: key of ``pending`` -> the step that filled it
        (``"_init_weights"``, ``"reset_parameters"``, ``"model_fn"``), and the names no step
        could fill.
    """
    origin: dict[str, str] = {}
    _run_inits(meta_model, pending, origin)
    left = [n for n in pending if n not in origin]
    if left and model_fn is not None:
        values = _constructor_values(model_fn, meta_model, {a for n in left for a in pending[n][0]})
        with torch.no_grad():
            for name in left:
                source = next((values[a] for a in pending[name][0] if a in values), None)
                if source is not None:
                    pending[name][1].copy_(source.to(pending[name][1].dtype))
                    origin[name] = "model_fn"
    missing = [n for n in pending if n not in origin]
    log.debug("default init: %s; missing %s", sorted(set(origin.values())), missing)
    return origin, missing
