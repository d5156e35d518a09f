"""What autograd keeps for backward, per node, read from autograd itself on fake tensors.

The activation memory of a stage is what autograd saves during its forward: a linear layer
keeps its input, a ReLU its output, an addition nothing. Counting every node's output instead
(the first model) overstated it 1.5-1.8x on GPT and U-Net (bench/README.md, *Activation
recomputation*). Here the graph runs once under ``FakeTensorMode`` (no memory, no compute) with
``torch.autograd.graph.saved_tensors_hooks`` recording every tensor autograd packs; each is
charged once, by its storage, to the node that produced that storage (a view is its base's), or,
for a tensor made inside a node and never handed on (dropout's mask, attention's internals, a
copy a reshape made), to the node that was running when autograd saved it. Parameters, buffers
and other constants the graph reads are state, not activations, and are not charged.

References:
    https://pytorch.org/docs/stable/autograd.html#saved-tensors-hooks
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from fxsplit.passes.shapes import (
    MetaDevicesMoved,
    autocast_run_device,
    fake_like,
    fake_mode_of,
    fake_state,
)

__all__ = ["autograd_saved_bytes"]

log = logging.getLogger(__name__)


def _key(t: torch.Tensor) -> int:
    return int(StorageWeakRef(t.untyped_storage()).cdata)


class _Producers(MetaDevicesMoved):
    """Runs the graph, noting which node first produced each storage."""

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device | None = None) -> None:
        # every value stays alive until the run ends: a freed storage's address (its key) could
        # be reused by a later one and be charged to the wrong node
        super().__init__(gm, garbage_collect_values=False)
        self.device = device  # meta graphs under CPU autocast run as on this device
        self.producer: dict[int, str] = {}
        self.nbytes: dict[int, Any] = {}
        self.constants: set[int] = set()  # storages of what get_attr reads: state, never charged
        self.running_node = [""]  # the node running now (a list: autograd's pack hook reads it)

    def run_node(self, n: torch.fx.Node) -> Any:
        self.running_node[0] = n.name
        result = super().run_node(n)
        if n.op == "get_attr":
            self.constants |= {_key(t) for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)}
        else:
            for t in pytree.tree_leaves(result):
                if isinstance(t, torch.Tensor):
                    key = _key(t)
                    self.producer.setdefault(key, n.name)
                    # a tensor's own size (symbolic when its shape is; a fake input's storage may
                    # carry the example's size), its storage's for a view
                    self.nbytes.setdefault(key, t.numel() * t.element_size() if t._base is None
                                           else t.untyped_storage().nbytes())
        return result


def autograd_saved_bytes(gm: torch.fx.GraphModule) -> dict[str, Any] | None:
    """``{node name: bytes autograd keeps of the storages it produced}`` (ints, or ``SymInt``
    when the graph's shapes are symbolic), or ``None`` when the graph does not run on fake
    tensors (then the caller keeps its own estimate).

    The placeholders' ``"val"`` are the inputs (not requiring gradients, as a model's inputs);
    parameters keep their ``requires_grad``.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    vals = [p.meta.get("val") for p in placeholders]
    mode = fake_mode_of(gm) or FakeTensorMode(allow_non_fake_inputs=True)
    saved: set[int] = set()
    held: list[torch.Tensor] = []  # alive until the end, for the same reason
    state = {_key(t) for t in [*gm.parameters(), *gm.buffers()]}

    device = autocast_run_device(gm, [v for v in vals if isinstance(v, torch.Tensor)])
    interp = _Producers(gm, device)
    inside: dict[int, tuple[str, Any]] = {}  # saved storages no node handed on: the node then running
    producer = interp.producer
    running = interp.running_node  # ``pack`` must not hold ``interp`` (see below)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        saved.add(key)
        held.append(t)
        if key not in producer and key not in inside:
            inside[key] = (running[0], t.untyped_storage().nbytes())
        return t

    try:
        with fake_state(gm, mode, device), mode, torch.enable_grad():
            state |= {_key(t) for t in [*gm.parameters(), *gm.buffers()]}  # the fakes standing for the state
            # clones: an in-place op on an input must not touch the placeholders' "val"
            inputs = [fake_like(v, mode, device).detach().clone() if isinstance(v, torch.Tensor) else v for v in vals]
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                interp.run(*inputs)
    except Exception as exc:  # noqa: BLE001 - an op without a fake kernel: keep the caller's estimate
        log.warning("activation memory: the graph did not run on fake tensors (%s: %s); each node's output counts "
                    "instead, which can overstate what autograd keeps 1.5-1.8x", type(exc).__name__, exc)
        return None
    finally:
        # The fake autograd graph holds ``pack`` from C++ (invisible to Python's collector): were
        # the interpreter (and so the graph module and the model's weights) in ``pack``'s closure,
        # nothing would ever free them. Dropping the values that hold the autograd graph frees it.
        interp.env.clear()
        held.clear()
    out: dict[str, Any] = {}
    for key in saved - state - interp.constants:
        name, nbytes = (interp.producer[key], interp.nbytes[key]) if key in interp.producer else inside.get(key, ("", 0))
        if name:
            out[name] = out.get(name, 0) + nbytes
    return out
