"""Put stages on their devices; give tied tensors one copy per device.

A tensor read by several stages (a tied embedding and LM head) stays one object for stages on the
same device, so autograd sums its gradient as in the original. Stages on another device get their
own copy (``copy_tied=True`` forces a copy per stage even on one device, which is how the CPU tests
exercise the multi-device path); :class:`StagedProgram.tied` lists the copies and the runtime sums
their gradients after backward, so every copy sees the same gradient and the same update.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from fxsplit.codegen.split import StagedProgram
from fxsplit.errors import InternalError

__all__ = ["place_stages", "get_state"]

log = logging.getLogger(__name__)


def _set_state(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if isinstance(value, nn.Parameter):
        owner._parameters[leaf] = value
    else:
        owner._buffers[leaf] = value


def get_state(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer ``name`` (dotted path) of ``module``, the object itself."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    tensor: torch.Tensor | None = owner._parameters.get(leaf)
    if tensor is None:
        tensor = owner._buffers.get(leaf)
    if tensor is None:
        raise InternalError(f"stage module has no parameter or buffer {name!r} (a bug in fxsplit)")
    return tensor


def _clone(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, nn.Parameter):
        return nn.Parameter(t.detach().clone(), requires_grad=t.requires_grad)
    return t.detach().clone()


def place_stages(program: StagedProgram, *, copy_tied: bool = False) -> StagedProgram:
    """Copy tied tensors where needed, then move every stage to its device.

    Args:
        program: Output of :func:`~fxsplit.codegen.split_graph`.
        copy_tied: Copy tied tensors for every extra stage, even on the same device.

    Returns:
        The program with ``tied`` filled in (state name -> stages holding separate copies).
    """
    users: dict[str, list[int]] = {}
    for st in program.stages:
        for name in st.state:
            users.setdefault(name, []).append(st.index)
    tied: dict[str, tuple[int, ...]] = {}
    for name, stages in users.items():
        if len(stages) < 2:
            continue
        first = program.stages[stages[0]]
        holders = [stages[0]]
        for s in stages[1:]:
            st = program.stages[s]
            if copy_tied or torch.device(st.device) != torch.device(first.device):
                _set_state(st.gm, name, _clone(get_state(first.gm, name)))
                holders.append(s)
        if len(holders) > 1:
            tied[name] = tuple(holders)
            log.info("tied tensor %s: copies in stages %s", name, holders)
    for st in program.stages:
        st.gm.to(torch.device(st.device))
    return dataclasses.replace(program, tied=tied)
