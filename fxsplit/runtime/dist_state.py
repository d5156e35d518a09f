"""Materialise one stage of a model captured on the meta device, and name its state.

A rank never holds the whole model: the model is built under ``torch.device("meta")``, captured
and split there, and only this rank's stage is allocated (``to_empty``) and filled, in order:

1. from a state dict with the original model's keys (a mapping, or a file loaded with
   ``mmap=True`` so that only the needed tensors are read);
2. from a per-stage initialiser ``init_fn(original_name, tensor)`` that fills ``tensor`` in place;
3. otherwise as the model's constructor would (:mod:`~fxsplit.runtime.dist_init`): a Hugging Face
   model's ``_init_weights``, else each module's ``reset_parameters()``, run on this stage's
   modules on the real device; what is still left (buffers such as causal masks and position
   ids, which ``state_dict`` leaves out when non-persistent) from a second ``model_fn()`` call
   whose parameters move to the meta device as they are registered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from fxsplit.errors import ConfigError
from fxsplit.runtime.dist_init import Pending, default_init, parameters_on_meta
from fxsplit.runtime.state import check_loadable

__all__ = ["StageState", "chunk_bounds", "materialise", "parameters_on_meta", "retarget_meta_devices"]

log = logging.getLogger(__name__)

InitFn = Callable[[str, torch.Tensor], None]


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner_name, _, leaf = name.rpartition(".")
    return (module.get_submodule(owner_name) if owner_name else module), leaf


def get_tensor(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer ``name`` (dotted) of ``module``."""
    owner, leaf = _owner(module, name)
    return owner._parameters[leaf] if leaf in owner._parameters else owner._buffers[leaf]  # type: ignore[return-value]


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace the parameter or buffer ``name`` of ``module`` by ``value`` (a parameter stays a
    parameter, with its ``requires_grad``)."""
    owner, leaf = _owner(module, name)
    if leaf in owner._parameters:
        old = owner._parameters[leaf]
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=old is not None and old.requires_grad)
    else:
        owner._buffers[leaf] = value


class StageState:
    """The graph names of one stage's state and their original names.

    Args:
        names: Graph state names the stage owns (``Stage.state``).
        aliases: Graph name -> every original name of that tensor (``Captured.aliases``).
    """

    def __init__(self, names: Sequence[str], aliases: Mapping[str, Sequence[str]]) -> None:
        self.names = list(names)
        self.originals = {g: tuple(aliases.get(g, (g,))) for g in self.names}

    def keys(self) -> list[str]:
        """Every original key this stage holds (tied tensors under each alias)."""
        return [o for g in self.names for o in self.originals[g]]

    def items(self, module: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
        """``(graph name, first original name, tensor)`` of each state tensor."""
        for g in self.names:
            yield g, self.originals[g][0], get_tensor(module, g)

    def sources(self, module: nn.Module, source: Mapping[str, Any]
                ) -> list[tuple[str, str, torch.Tensor, str | None]]:
        """:meth:`items` with the key of ``source`` (an original-model state dict) holding each
        tensor's value: its first original name ``source`` has, or None."""
        return [(g, name, t, next((o for o in self.originals[g] if o in source), None))
                for g, name, t in self.items(module)]


def retarget_meta_devices(gm: torch.fx.GraphModule, device: torch.device) -> int:
    """Point factory calls the meta capture recorded on ``meta`` to ``device``.

    Capturing on the meta device bakes ``device=meta`` into factory nodes (``aten.arange(16,
    device=meta)`` for position ids); run on a real device, such a tensor would silently hold
    garbage. Every ``torch.device("meta")`` in a node's arguments becomes ``device``.

    Returns:
        The number of nodes changed.
    """

    def swap(value: Any) -> Any:
        if isinstance(value, torch.device) and value.type == "meta":
            return device
        if isinstance(value, list | tuple):
            return type(value)(swap(v) for v in value)
        return value

    changed = 0
    for node in gm.graph.nodes:
        args, kwargs = swap(node.args), {k: swap(v) for k, v in node.kwargs.items()}
        if args != node.args or kwargs != dict(node.kwargs):
            node.args, node.kwargs = args, kwargs
            changed += 1
    if changed:
        gm.recompile()
        log.debug("retargeted %d factory node(s) from meta to %s", changed, device)
    return changed


def _load_source(state_dict: Mapping[str, torch.Tensor] | str | None) -> Mapping[str, torch.Tensor]:
    if state_dict is None:
        return {}
    if isinstance(state_dict, str):
        return torch.load(state_dict, map_location="cpu", mmap=True, weights_only=True)
    return state_dict


def chunk_bounds(size: int, index: int, count: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` of ``count`` of a dimension of ``size``, as
    ``torch.chunk`` and DTensor's ``Shard`` cut it: chunks of ``ceil(size / count)``, the last
    ones shorter or empty.

    Example:
        >>> [chunk_bounds(5, i, 4) for i in range(4)]
        [(0, 2), (2, 2), (4, 1), (5, 0)]
    """
    step = -(-size // count)
    start = min(index * step, size)
    return start, min(step, size - start)


def _chunk(tensor: torch.Tensor, dim: int, index: int, count: int) -> torch.Tensor:
    """Chunk ``index`` of ``count`` of ``tensor`` on ``dim`` (a view)."""
    return tensor.narrow(dim, *chunk_bounds(tensor.shape[dim], index, count))


def materialise(
    module: nn.Module,
    state: StageState,
    device: torch.device,
    *,
    state_dict: Mapping[str, torch.Tensor] | str | None,
    init_fn: InitFn | None,
    meta_model: nn.Module,
    model_fn: Callable[[], nn.Module] | None,
    shards: Mapping[str, tuple[int, int, int]] | None = None,
    chunks_given: Collection[str] = (),
) -> dict[str, str]:
    """Allocate ``module`` on ``device`` and fill every state tensor; see the module docstring.

    Args:
        module: The stage (its tensors on the meta device).
        state: Its state names.
        device: Where the stage runs.
        state_dict: Original-key state dict (or a path to one), or None.
        init_fn: ``init_fn(original_name, tensor)`` filling ``tensor`` in place, or None.
        meta_model: The model built on the meta device (its own initialisation runs on it, with
            this stage's tensors swapped in; it is left as it was).
        model_fn: Builds the model (for constructor values such as buffers); None to not
            rebuild.
        shards: Graph name -> ``(dim, index, count)``: a tensor this rank holds only chunk
            ``index`` of ``count`` of, cut on ``dim`` (:func:`chunk_bounds`; a tensor-parallel
            ``Shard(dim)``). It is allocated at that chunk's shape and never whole: read from
            that chunk of the state dict; else filled whole by ``init_fn`` or the model's own
            initialisation one module at a time (peak: one module's tensors) and cut. Every rank
            that cuts one tensor must initialise it alike (the same random state).
        chunks_given: Graph names of ``shards`` whose ``state_dict`` value is this rank's chunk
            already (checked against the chunk's shape, taken as it is; calibrate's exchange
            of a tensor-parallel stage's state).

    Returns:
        Original name -> where its value came from (``"state_dict"``, ``"init_fn"``,
        ``"_init_weights"``, ``"reset_parameters"``, ``"model_fn"``), for logs and tests.

    Raises:
        ConfigError: naming every tensor no source could fill, with the fix.
    """
    source = _load_source(state_dict)
    whole: dict[str, torch.Tensor] = {}  # graph name -> the meta tensor of the whole
    for g, _name, tensor in state.items(module) if shards else ():
        if g in shards:  # type: ignore[operator]
            whole[g] = tensor
            _set_tensor(module, g, _chunk(tensor, *shards[g]).clone())  # type: ignore[index]  # meta: no memory
    module.to_empty(device=device)
    if isinstance(module, torch.fx.GraphModule):
        retarget_meta_devices(module, device)
    origin: dict[str, str] = {}
    todo: Pending = {}
    chunked: Pending = {}  # filled whole, then cut
    rows = state.sources(module, source)
    given = set(chunks_given) & set(whole)
    check_loadable([(key, source[key], t if g in given else whole.get(g, t)) for g, _n, t, key in rows
                    if key is not None], "this rank's stage")
    with torch.no_grad():
        for g, name, tensor, key in rows:
            if key is not None:
                value = source[key] if g not in whole or g in given else _chunk(source[key], *shards[g])  # type: ignore[index]
                tensor.copy_(value.to(tensor.dtype))
                origin[name] = "state_dict"
            elif init_fn is not None and g in whole:
                full = torch.empty(whole[g].shape, dtype=tensor.dtype, device=tensor.device)
                init_fn(name, full)
                tensor.copy_(_chunk(full, *shards[g]))  # type: ignore[index]
                origin[name] = "init_fn"
            elif init_fn is not None:
                init_fn(name, tensor)
                origin[name] = "init_fn"
            else:
                (chunked if g in whole else todo)[g] = (state.originals[g], tensor)
    _fill_defaults(todo, origin, meta_model, model_fn)
    if chunked:
        _fill_chunks(chunked, whole, shards or {}, origin, meta_model, model_fn)
    return origin


def _fill_chunks(chunked: Pending, whole: Mapping[str, torch.Tensor], shards: Mapping[str, tuple[int, int, int]],
                 origin: dict[str, str], meta_model: nn.Module, model_fn: Any) -> None:
    """The model's own initialisation of the tensors held as chunks: each module's tensors
    filled whole, cut and freed before the next module's (the constructor's values, step 3 of
    :func:`~fxsplit.runtime.dist_init.default_init`, in one call at the end for what is left)."""
    by_module: dict[str, list[str]] = {}
    for g, (aliases, _t) in chunked.items():
        by_module.setdefault(aliases[0].rpartition(".")[0], []).append(g)
    left: Pending = {}

    def cut(filled: Pending, how: Mapping[str, str]) -> None:
        with torch.no_grad():
            for g, label in how.items():
                aliases, full = filled[g]
                chunked[g][1].copy_(_chunk(full, *shards[g]))
                origin[aliases[0]] = label

    for names in by_module.values():
        temps = {g: (chunked[g][0], torch.empty(whole[g].shape, dtype=chunked[g][1].dtype, device=chunked[g][1].device))
                 for g in names}
        filled, missing = default_init(meta_model, temps, None)
        cut(temps, filled)
        left.update({g: temps[g] for g in missing})
    if left:
        _fill_defaults(left, origin, meta_model, model_fn)
        cut(left, {g: origin[left[g][0][0]] for g in left})


def _fill_defaults(todo: Pending, origin: dict[str, str], meta_model: nn.Module, model_fn: Any) -> None:
    filled, left = default_init(meta_model, todo, model_fn)
    origin.update({todo[g][0][0]: how for g, how in filled.items()})
    missing = [todo[g][0][0] for g in left]
    if missing:
        raise ConfigError(
            f"no value for {len(missing)} tensor(s) of this stage: {missing[:8]}: neither the model's own "
            "initialisation (Hugging Face _init_weights, reset_parameters) nor a second model_fn() call gave "
            "them one; pass state_dict= with these keys or init_fn=lambda name, tensor: ... that fills them in place"
        )
