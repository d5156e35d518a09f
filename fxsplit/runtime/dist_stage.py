"""One stage as a ``torch.distributed.pipelining`` submodule: flat tensors in, flat tensors out.

``PipelineStage`` sends and receives tuples of tensors only. A fxsplit stage may receive or send
a list of tensors (``torch.chunk`` outputs), a Python scalar (a size computed from a shape) or
``None``; :class:`StageModule` wraps the stage's ``GraphModule`` so that, on the wire, every value
is tensors:

============  ===========================================  ==========================
value          on the wire                                   rebuilt by the receiver
============  ===========================================  ==========================
tensor         itself                                        itself
list/tuple     its tensors, one after another                a list of them
int/float      a 0-d ``int64`` / ``float64`` tensor           ``tensor.item()``
bool           a 0-d ``bool`` tensor                          ``bool(tensor)``
None           nothing                                       ``None``
============  ===========================================  ==========================

The layout of every boundary value comes from ``node.meta["val"]`` of the stage's placeholders
and output arguments, so both neighbours agree on it without talking. A scalar travels in the
*contents* of a tensor, so no stage may ever run on receive buffers that were not received:
``PipelineStage`` is given every shape up front (:mod:`~fxsplit.runtime.dist_shapes`) instead of
inferring them by running the stages on ``torch.empty`` placeholders. The first stage receives
the model's flat inputs: batched tensors come positionally from the schedule (which splits them
into micro-batches), everything else is bound per step with :meth:`StageModule.bind_static`.

References:
    torch.distributed.pipelining, https://pytorch.org/docs/stable/distributed.pipelining.html
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.distributed.pipelining import PipelineStage

from fxsplit.errors import PlanError
from fxsplit.options import precision
from fxsplit.runtime.recompute import RecomputedForward
from fxsplit.runtime.split_backward import backward_input, backward_weight

__all__ = ["Layout", "Packing", "SCALAR_DTYPES", "StageModule", "SplitBackwardStage", "layout_of", "boundary_layouts",
           "encode", "decode"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """How one boundary value travels.

    Attributes:
        kind: ``"tensor"``, ``"list"``, ``"scalar"`` or ``"none"``.
        length: Number of tensors of a ``"list"``.
        pytype: ``"int"``, ``"float"`` or ``"bool"`` for a ``"scalar"``.
    """

    kind: str
    length: int = 0
    pytype: str = ""

    @property
    def width(self) -> int:
        """Number of tensors on the wire."""
        return {"tensor": 1, "scalar": 1, "none": 0}.get(self.kind, self.length)


def layout_of(node: torch.fx.Node) -> Layout:
    """The :class:`Layout` of a node's value, from ``node.meta["val"]``.

    Raises:
        PlanError: for a value that is none of tensor, list of tensors, scalar or None.
    """
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return Layout("tensor")
    if isinstance(val, list | tuple) and all(isinstance(v, torch.Tensor) for v in val):
        return Layout("list", len(val))
    if isinstance(val, bool):
        return Layout("scalar", pytype="bool")
    if isinstance(val, int | torch.SymInt):
        return Layout("scalar", pytype="int")
    if isinstance(val, float | torch.SymFloat):
        return Layout("scalar", pytype="float")
    if val is None:
        return Layout("none")
    raise PlanError(
        f"value {node.name!r} ({type(val).__name__}) cannot cross a process boundary; only tensors, "
        "lists of tensors, Python scalars and None can: move the split point"
    )


def boundary_layouts(gm: torch.fx.GraphModule) -> tuple[list[Layout], list[Layout]]:
    """Layouts of a stage's placeholders and of its output arguments, in order."""
    ins = [layout_of(n) for n in gm.graph.find_nodes(op="placeholder")]
    outs = []
    out_args: Sequence[Any] = gm.graph.output_node().args[0]  # type: ignore[assignment]
    for arg in out_args:
        outs.append(layout_of(arg) if isinstance(arg, torch.fx.Node) else Layout("none"))
    return ins, outs


SCALAR_DTYPES = {"int": torch.int64, "float": torch.float64, "bool": torch.bool}
"""The dtype of the 0-d tensor that carries a Python scalar of each type (exact: int64 and
float64 hold every Python int size and float there is in a graph)."""


def encode(values: Sequence[Any], layouts: Sequence[Layout], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Flatten boundary values into the tensors that go on the wire.

    Tensors are made contiguous: gloo sends and receives contiguous buffers only, and
    ``PipelineStage`` sizes the gradient buffers by the activations' strides.
    """
    wire: list[torch.Tensor] = []
    for value, layout in zip(values, layouts, strict=True):
        if layout.kind == "tensor":
            wire.append(value.contiguous())
        elif layout.kind == "list":
            wire.extend(v.contiguous() for v in value)
        elif layout.kind == "scalar":
            wire.append(torch.tensor(value, dtype=SCALAR_DTYPES[layout.pytype], device=device))
    return tuple(wire)


def decode(wire: Sequence[torch.Tensor], layouts: Sequence[Layout]) -> list[Any]:
    """Rebuild boundary values from the tensors received (inverse of :func:`encode`)."""
    values: list[Any] = []
    pos = 0
    for layout in layouts:
        if layout.kind == "tensor":
            values.append(wire[pos])
        elif layout.kind == "list":
            values.append(list(wire[pos : pos + layout.length]))
        elif layout.kind == "scalar":
            values.append(wire[pos].item())
        else:
            values.append(None)
        pos += layout.width
    return values


@dataclass(frozen=True)
class Packing:
    """The wire tensors of one boundary gathered into fewer messages.

    Every message costs the runtime and gloo a send, a receive and their bookkeeping whatever its
    size (a few hundred microseconds on a busy CPU), and the plan charges one message per boundary
    and direction: a boundary through an attention block (the residual stream and the ``chunk``
    of q, k, v) was four. Wire tensors of one dtype that alike need a gradient or not travel
    flattened into one buffer (``torch.cat``; a group of one goes as it is, without a copy); the
    receiver takes them back as views of that buffer, so autograd returns the gradients packed
    the same way.

    Attributes:
        groups: ``[messages]`` the wire-tensor indices each message carries, ascending, the
            messages ordered by their first index.
        shapes: ``[wire tensors]`` each wire tensor's shape at the micro-batch size this packing
            is for.
    """

    groups: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, metas: Sequence[torch.Tensor]) -> Packing:
        """The packing of wire tensors like ``metas`` (meta tensors: shape, dtype, requires_grad).

        Example:
            >>> m = [torch.empty(2, 3, device="meta", requires_grad=True), torch.empty((), dtype=torch.int64, device="meta"),
            ...      torch.empty(4, device="meta", requires_grad=True)]
            >>> Packing.of(m).groups
            ((0, 2), (1,))
        """
        keys: dict[tuple[torch.dtype, bool], list[int]] = {}
        for i, t in enumerate(metas):
            keys.setdefault((t.dtype, bool(t.requires_grad)), []).append(i)
        return cls(tuple(tuple(g) for g in keys.values()), tuple(tuple(t.shape) for t in metas))

    def metas(self, metas: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Meta tensors of the messages (what ``PipelineStage`` sizes its buffers by)."""
        out = []
        for group in self.groups:
            if len(group) == 1:
                out.append(metas[group[0]])
            else:
                first = metas[group[0]]
                numel = sum(math.prod(self.shapes[i]) for i in group)
                out.append(torch.empty(numel, dtype=first.dtype, device="meta", requires_grad=first.requires_grad))
        return tuple(out)

    def pack(self, wire: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The messages of ``wire`` (the sender's side)."""
        return tuple(wire[g[0]] if len(g) == 1 else torch.cat([wire[i].reshape(-1) for i in g]) for g in self.groups)

    def unpack(self, messages: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The wire tensors, views of the received ``messages`` (the receiver's side)."""
        wire: list[torch.Tensor | None] = [None] * len(self.shapes)
        for group, message in zip(self.groups, messages, strict=True):
            if len(group) == 1:
                wire[group[0]] = message
                continue
            pieces = message.split([math.prod(self.shapes[i]) for i in group])
            for i, piece in zip(group, pieces, strict=True):
                wire[i] = piece.view(self.shapes[i])
        return wire  # type: ignore[return-value]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous.

    The gradient of a received activation is often a view (the backward of ``cat`` slices the
    incoming gradient); ``PipelineStage`` sizes the previous rank's receive buffer by its
    strides, and gloo only receives into contiguous buffers.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _contiguous_grads(wire: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [_ContiguousGrad.apply(t) if isinstance(t, torch.Tensor) and t.requires_grad else t for t in wire]


class StageModule(nn.Module):
    """A stage ``GraphModule`` behind a tensors-only interface, for ``PipelineStage``.

    Args:
        gm: The stage's code (placeholders: values received; output: values sent).
        first: True for stage 0, whose inputs are the model's flat inputs.
        last: True for the last stage, whose outputs (the model's flat outputs) go to the loss
            and are not encoded.
        batched: For the first stage, which flat inputs are batched tensors (``[num_inputs]``);
            those arrive positionally, the others through :meth:`bind_static`.
        recompute: Keep only the received tensors for backward and run ``gm`` again there
            (:class:`~fxsplit.runtime.recompute.RecomputedForward`; a split stage runs over its
            tensor-parallel ranks again, collectives included).
        autocast: ``(device type, dtype)``: run ``gm`` under ``torch.autocast`` (mixed precision).
        parallel: Run ``gm`` split over a tensor-parallel mesh instead
            (:func:`~fxsplit.runtime.tensor_parallel.shard_stage`'s
            :class:`~fxsplit.runtime.tensor_parallel.ParallelGraph`: whole values in and out).

    Shape:
        ``forward(*wire)``: the tensors of the received values (first stage: the batched
        inputs of one micro-batch, ``[micro_batch, ...]``) -> the tensors of the values sent;
        both packed into fewer messages when :meth:`use_packing` says so.
    """

    def __init__(self, gm: torch.fx.GraphModule, *, first: bool, last: bool, batched: Sequence[bool] = (),
                 recompute: bool = False, autocast: tuple[str, torch.dtype] | None = None,
                 parallel: Any = None) -> None:
        super().__init__()
        self.gm = gm
        self.parallel = parallel  # a ParallelGraph over gm (a plain object: its tensors are gm's)
        split = functools.partial(_run_split, parallel) if parallel is not None else None
        self.recomputed = RecomputedForward(gm, split) if recompute else None  # a plain object: no state of its own
        self.autocast = autocast
        self.first, self.last = first, last
        self.in_layouts, self.out_layouts = boundary_layouts(gm)
        self.batched = list(batched) if first else []
        self._static: list[Any] = [None] * len(self.batched)
        self.forwards = 0
        self.in_packing: Packing | None = None
        self.out_packing: Packing | None = None

    def use_packing(self, received: Packing | None, sent: Packing | None) -> None:
        """Unpack the messages received and pack the tensors sent as these say (None: one message
        per wire tensor); set before each run at a micro-batch size
        (:meth:`~fxsplit.runtime.dist_shapes.WireShapes.packings`)."""
        self.in_packing, self.out_packing = received, sent

    def bind_static(self, flat_inputs: Sequence[Any]) -> list[torch.Tensor]:
        """First stage: keep the non-batched inputs, return the batched ones for the schedule."""
        self._static = [None if b else v for v, b in zip(flat_inputs, self.batched, strict=True)]
        return [v for v, b in zip(flat_inputs, self.batched, strict=True) if b]

    def _inputs(self, wire: Sequence[torch.Tensor]) -> list[Any]:
        if not self.first:
            received = _contiguous_grads(wire)
            return decode(self.in_packing.unpack(received) if self.in_packing is not None else received, self.in_layouts)
        it = iter(wire)
        return [next(it) if b else s for b, s in zip(self.batched, self._static, strict=True)]

    def forward(self, *wire: torch.Tensor) -> Any:
        self.forwards += 1
        run: Any = self.gm
        if self.recomputed is not None:  # also over a split stage's ranks
            run = self.recomputed
        elif self.parallel is not None:
            run = functools.partial(_run_split, self.parallel)
        with precision(*self.autocast) if self.autocast is not None else precision("cpu", None):
            out = tuple(run(*self._inputs(wire)))
        if self.last:
            return out
        device = next((t.device for t in wire if isinstance(t, torch.Tensor)), torch.device("cpu"))
        sent = encode(out, self.out_layouts, device)
        return self.out_packing.pack(sent) if self.out_packing is not None else sent


def _run_split(parallel: Any, *inputs: Any) -> list[Any]:
    return parallel.run_flat(inputs, check=False)


class SplitBackwardStage(PipelineStage):
    """torch's ``PipelineStage`` whose zero-bubble halves are fxsplit's
    (:func:`~fxsplit.runtime.split_backward.backward_input` / ``backward_weight``): torch's own
    split loses the part of a weight's gradient that reaches an output without meeting the
    stage's inputs, and frees graph nodes two parameter groups share; fxsplit's runs such a
    stage's whole backward in its input half and keeps shared nodes. The whole backward, and
    the first stage (whose input half torch skips), are torch's."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict,
                                   last_backward: bool = False) -> tuple[tuple[torch.Tensor | None, ...], Any]:
        if backward_type == "input":
            out = bwd_kwargs["stage_output"]
            outputs = list(out) if isinstance(out, list | tuple) else [out]
            grads = bwd_kwargs["output_grads"]
            weights = [p for p in self.submod.parameters() if p.requires_grad]
            recomputed = getattr(self.submod, "recomputed", None) is not None  # one recompute: whole backward in I
            in_grads, pending = backward_input(outputs, None if grads is None else list(grads),
                                               list(bwd_kwargs["input_values"]), weights, whole=recomputed)
            return tuple(in_grads), pending
        if backward_type == "weight":
            backward_weight(bwd_kwargs["param_groups"])
            return (), None
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
