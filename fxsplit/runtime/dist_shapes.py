"""What a stage sends and receives at a given micro-batch size, known before anything runs.

``PipelineStage`` needs the shape, dtype and ``requires_grad`` of every tensor a stage receives
and sends. Left to itself it infers them at the first step by running each stage's forward on
``torch.empty`` placeholders made from the previous stage's metadata. That is harmless for
activations but wrong for a value that crosses as the *contents* of a tensor (a size such as the
micro-batch size, which :mod:`~fxsplit.runtime.dist_stage` sends as a 0-d ``int64`` tensor): the
receiving stage then computed with uninitialised memory (``view(140659449077104, 128, 2048)``).

:class:`WireShapes` gives ``PipelineStage`` that metadata up front (its "static" mode, in which
no stage runs on placeholders): every rank runs the whole captured graph once per micro-batch size
under ``FakeTensorMode`` (no memory, no compute; the graph is captured with a symbolic batch, so
it runs at any size), reads the values crossing its two boundaries, and lays them out as
:func:`~fxsplit.runtime.dist_stage.encode` puts them on the wire. Both neighbours compute the same
metadata from the same graph without talking, so their send and receive buffers agree.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxsplit.errors import InternalError, PlanError
from fxsplit.options import precision
from fxsplit.passes.shapes import fake_state
from fxsplit.runtime.dist_stage import SCALAR_DTYPES, Layout, Packing

__all__ = ["WireShapes", "boundary_values", "wire_metas"]

log = logging.getLogger(__name__)


class _Recorder(torch.fx.Interpreter):
    """An interpreter that keeps the values of the nodes named in ``names``."""

    def __init__(self, gm: torch.fx.GraphModule, names: set[str]) -> None:
        super().__init__(gm)
        self.names = names
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if n.name in self.names:
            self.values[n.name] = result
        return result


def boundary_values(
    gm: torch.fx.GraphModule,
    flat_inputs: Sequence[Any],
    names: Sequence[str],
    *,
    batch: int | None = None,
    batched: Sequence[bool] = (),
    autocast: tuple[torch.device, torch.dtype] | None = None,
) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """Run ``gm`` under ``FakeTensorMode`` and keep the values of the nodes in ``names``.

    Gradient mode is on, so a fake's ``requires_grad`` says whether the real value needs a
    gradient. The state of ``gm`` (real or meta) is swapped for fakes and never touched, and no
    input is allocated.

    Args:
        gm: A flat captured graph (placeholders in flat input order).
        flat_inputs: Its inputs (real, meta or fake tensors, or other values).
        names: Node names whose values to keep.
        batch: Run at this batch size: the inputs flagged in ``batched`` get it on dim 0.
        batched: Which flat inputs carry the batch (``[num_inputs]``; used with ``batch``).
        autocast: ``(device, dtype)``: run as the stages run under ``torch.autocast`` on that
            device, so the values crossing have the dtypes autocast gives them.

    Returns:
        ``({name: value}, flat outputs)``; tensors are fakes, sizes plain ``int``.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    flags = list(batched) if batch is not None else [False] * len(flat_inputs)
    recorder = _Recorder(gm, set(names))
    device = autocast[0] if autocast is not None else None
    mixed = precision(*autocast) if autocast is not None else precision("cpu", None)
    with fake_state(gm, mode, device), mode, torch.enable_grad():
        fakes = [
            _fake_input(mode, x, batch if b else None, device)
            for x, b in zip(flat_inputs, flags, strict=True)
        ]
        with mixed:
            out = recorder.run(*fakes)
    return recorder.values, tuple(out)


def _fake_input(mode: FakeTensorMode, x: Any, batch: int | None, device: torch.device | None = None) -> Any:
    """``x`` as a fake (inside ``mode``), with ``batch`` samples on dim 0 when given, on
    ``device`` when given."""
    if not isinstance(x, torch.Tensor):
        return x
    if batch is None and device is None:
        return mode.from_tensor(x, static_shapes=True)
    shape = (batch, *x.shape[1:]) if batch is not None else tuple(x.shape)
    return torch.empty(shape, dtype=x.dtype, device=device or x.device, requires_grad=x.requires_grad)


def _meta_like(value: Any, requires_grad: bool, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InternalError(
            f"{what} is a {type(value).__name__} where the stage's layout expects a tensor (a bug in fxsplit)"
        )
    shape = []
    for d in value.shape:
        if not isinstance(d, int):
            raise PlanError(
                f"{what} has a data-dependent shape {tuple(value.shape)}; a pipeline boundary needs shapes fixed "
                "by the micro-batch size: move the split point so that this value stays inside one stage"
            )
        shape.append(d)
    grad = (
        requires_grad and value.requires_grad and (value.is_floating_point() or value.is_complex())
    )
    return torch.empty(shape, dtype=value.dtype, device="meta", requires_grad=grad)


def wire_metas(
    values: Sequence[Any], layouts: Sequence[Layout], requires_grad: bool, what: str
) -> tuple[torch.Tensor, ...]:
    """Meta tensors shaped like the wire of ``values`` (contiguous, as ``encode`` sends them).

    Args:
        values: Boundary values (fakes, ints, floats, bools, None), one per layout.
        layouts: Their :class:`Layout`.
        requires_grad: False for inference: then no metadata asks for a gradient.
        what: Names the boundary in errors (``"stage 1 inputs"``).

    Returns:
        One meta tensor per wire tensor (``Layout.width`` per value).

    Raises:
        PlanError: for a tensor whose shape depends on the data.
    """
    wire: list[torch.Tensor] = []
    for i, (value, layout) in enumerate(zip(values, layouts, strict=True)):
        label = f"{what}[{i}]"
        if layout.kind == "tensor":
            wire.append(_meta_like(value, requires_grad, label))
        elif layout.kind == "list":
            wire.extend(_meta_like(v, requires_grad, f"{label}[{j}]") for j, v in enumerate(value))
        elif layout.kind == "scalar":
            wire.append(torch.empty((), dtype=SCALAR_DTYPES[layout.pytype], device="meta"))
    return tuple(wire)


class WireShapes:
    """The wire metadata of one stage at any micro-batch size, for ``PipelineStage``.

    Args:
        gm: The whole captured graph (its state may be on the meta device).
        flat_inputs: The model's flat example inputs (meta tensors suffice).
        batched: Which flat inputs carry the batch on dim 0 (``[num_inputs]``).
        inputs: Names of the values the stage receives (``Stage.inputs``).
        outputs: Names of the values it sends (``Stage.outputs``); unused for the last stage,
            whose outputs are the model's flat outputs.
        in_layouts, out_layouts: Their layouts (``StageModule.in_layouts`` / ``out_layouts``).
        first, last: The stage's position.
        index: The stage index (for messages).
        autocast: ``(device, dtype)`` when the stages run under ``torch.autocast``.
    """

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        flat_inputs: Sequence[Any],
        batched: Sequence[bool],
        *,
        inputs: Sequence[str],
        outputs: Sequence[str],
        in_layouts: Sequence[Layout],
        out_layouts: Sequence[Layout],
        first: bool,
        last: bool,
        index: int,
        autocast: tuple[torch.device, torch.dtype] | None = None,
    ) -> None:
        self.gm, self.flat_inputs, self.batched = gm, list(flat_inputs), list(batched)
        self.autocast = autocast
        self.inputs, self.outputs = list(inputs), list(outputs)
        self.in_layouts, self.out_layouts = list(in_layouts), list(out_layouts)
        self.first, self.last, self.index = first, last, index
        self._values: dict[int, tuple[dict[str, Any], tuple[Any, ...]]] = {}
        self._packings: dict[tuple[int, bool], tuple[Packing | None, Packing | None]] = {}

    def _at(self, size: int) -> tuple[dict[str, Any], tuple[Any, ...]]:
        if size not in self._values:
            names = ([] if self.first else self.inputs) + ([] if self.last else self.outputs)
            try:
                self._values[size] = boundary_values(
                    self.gm, self.flat_inputs, names, batch=size, batched=self.batched, autocast=self.autocast
                )
            except Exception as exc:
                raise PlanError(
                    f"the shapes stage {self.index} sends and receives at micro-batch size {size} could not "
                    f"be computed ({type(exc).__name__}: {exc}); a pipeline boundary needs shapes the "
                    "micro-batch size fixes: move the split point (plan=) so that the value stays inside one stage"
                ) from exc
            log.debug("stage %d: wire shapes at micro-batch size %d computed", self.index, size)
        return self._values[size]

    def example_args(
        self, size: int, train: bool
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """``(input_args, output_args)`` for ``PipelineStage`` at micro-batch size ``size``.

        Args:
            size: Samples per micro-batch.
            train: Whether the schedule runs a backward (else no tensor requires a gradient).

        Returns:
            Meta tensors: the stage's messages in (first stage: the batched inputs of one
            micro-batch) and out (last stage: the model's flat outputs), packed as
            :meth:`packings` says.
        """
        ins, outs = self._wire(size, train)
        received, sent = self.packings(size, train)
        return (received.metas(ins) if received is not None else ins,
                sent.metas(outs) if sent is not None else outs)

    def packings(self, size: int, train: bool) -> tuple[Packing | None, Packing | None]:
        """How the stage's received and sent wire tensors travel at micro-batch size ``size``
        (:class:`~fxsplit.runtime.dist_stage.Packing`); None for a side with one message per
        wire tensor anyway (the first stage's inputs, the last stage's outputs, a boundary
        whose tensors all differ in dtype or in needing a gradient). Both neighbours compute the
        same packing of their common boundary. Memoised per size and ``train``."""
        key = (size, train)
        if key not in self._packings:
            ins, outs = self._wire(size, train)

            def of(metas: tuple[torch.Tensor, ...], end: bool) -> Packing | None:
                packing = None if end else Packing.of(metas)
                return packing if packing is not None and len(packing.groups) < len(metas) else None

            self._packings[key] = (of(ins, self.first), of(outs, self.last))
        return self._packings[key]

    def _wire(self, size: int, train: bool) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The wire tensors in and out, one meta tensor each, before packing."""
        values, model_out = self._at(size)
        if self.first:
            ins = tuple(
                torch.empty((size, *x.shape[1:]), dtype=x.dtype, device="meta")
                for x, b in zip(self.flat_inputs, self.batched, strict=True)
                if b
            )
        else:
            ins = wire_metas(
                [values[n] for n in self.inputs],
                self.in_layouts,
                train,
                f"stage {self.index} inputs",
            )
        if self.last:
            outs = tuple(
                _meta_like(v, train, f"model output {i}")
                if isinstance(v, torch.Tensor)
                else torch.empty((), device="meta")
                for i, v in enumerate(model_out)
            )
        else:
            outs = wire_metas(
                [values[n] for n in self.outputs],
                self.out_layouts,
                train,
                f"stage {self.index} outputs",
            )
        return ins, outs
