"""Capture a model as a flat-input, flat-output FX graph.

Two methods, tried in this order by ``method="auto"``:

* ``"export"``: ``torch.export.export(model, args, kwargs, strict=False)`` then
  ``ExportedProgram.module()``; aten-level graph, works on Hugging Face models, fake and meta
  tensors.
* ``"symbolic_trace"``: ``torch.fx.symbolic_trace``; module-level graph (``call_module`` nodes).

Either way the result is a :class:`Captured`: a ``GraphModule`` whose placeholders are the
pytree leaves of ``(args, kwargs)`` and whose output is a flat tuple, plus the pytree specs to go
back and forth, and the original name(s) of every parameter and buffer the graph reads.
"""

from __future__ import annotations

import inspect
import logging
import operator
import os
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from fxsplit.errors import CaptureError, ConfigError
from fxsplit.passes.batch_layout import (
    BatchLayout,
    batch_dims,
    batch_dynamic_shapes,
    make_batch_first,
    primary_input,
)
from fxsplit.passes.manager import getattr_path

__all__ = ["BatchLayout", "Captured", "InputGuard", "capture", "flatten_to_spec", "unflatten_to_spec", "in_place_root", "reads_inputs", "writes_in_place",
           "METHODS"]

log = logging.getLogger(__name__)

METHODS = ("auto", "export", "symbolic_trace")
_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass(frozen=True)
class InputGuard:
    """What a capture fixed of one flat input, checked at every call (as ``torch.export``'s own
    module checks its guards): the value of a constant (a Python number, bool, string or None the
    graph computed or branched with), or a tensor's sizes where export specialised them.

    Attributes:
        where: The input's place in ``(args, kwargs)``, e.g. ``"args[0]"``, ``"kwargs['scale']"``.
        kind: ``"constant"`` (``value`` must match), ``"tensor"`` (``sizes`` must match), or
            ``"any"`` (nothing to check: an object export took as it is).
        value: The example's value of a constant.
        sizes: Per dimension of a tensor (batch first, as the graph takes it): the size export
            fixed, or None where it kept the size symbolic (the batch, a ``seq_dim``).
    """

    where: str
    kind: str = "any"
    value: Any = None
    sizes: tuple[int | None, ...] = ()

    def check(self, leaf: Any) -> None:
        """Raise :class:`ConfigError` when ``leaf`` (a call's input at :attr:`where`) is not what
        the graph was captured with."""
        if self.kind == "constant":
            if not _same_constant(leaf, self.value):
                raise ConfigError(
                    f"{self.where} is {_describe(leaf)} but the model was captured with {self.value!r}: torch.export "
                    "fixed that value into the graph (the model computes or branches with it), so the staged "
                    "model would compute with the captured value; compile again with this value in example "
                    "inputs, or pass it as a tensor")
        elif self.kind == "tensor":
            shape = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None
            if shape is None or len(shape) != len(self.sizes):
                raise ConfigError(
                    f"{self.where} is {_describe(leaf)} but the model was captured with a tensor of "
                    f"{len(self.sizes)} dimension(s); call with inputs of the structure of example_inputs")
            fixed = [(d, got, want) for d, (got, want) in enumerate(zip(shape, self.sizes, strict=True))
                     if want is not None and got != want]
            if fixed:
                dims = ", ".join(f"dim {d} is {got} (captured {want})" for d, got, want in fixed)
                raise ConfigError(
                    f"{self.where} has shape {list(shape)}: {dims}; torch.export fixed those sizes when it "
                    "captured the model (it computes with them or needs them, e.g. x.shape[1] used as a number), "
                    "so the staged model would compute for the captured sizes. Call with those sizes, or compile "
                    "with an example of these (a sequence length that varies: compile(seq_dim=...) where the "
                    "model allows it)")


def _same_constant(got: Any, want: Any) -> bool:
    """``got == want`` as export's guard takes it (``1 == 1.0``), but a bool only equals a bool
    and None only None."""
    if want is None or got is None or isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    try:
        return bool(got == want)
    except Exception:  # noqa: BLE001 - an object that cannot be compared is not the captured one
        return False


def _describe(leaf: Any) -> str:
    return f"a tensor of shape {list(leaf.shape)}" if isinstance(leaf, torch.Tensor) else f"{type(leaf).__name__} {leaf!r}"


@dataclass(frozen=True)
class Captured:
    """A captured model: flat graph plus what is needed to call it like the original.

    Attributes:
        gm: Flat ``GraphModule``: one placeholder per leaf of ``(args, kwargs)`` (in
            ``in_spec`` order), output a flat tuple (in ``out_spec`` order). Parameters and
            buffers are ``get_attr`` nodes (export) or live in ``call_module`` submodules
            (symbolic_trace) under their original names.
        in_spec: Pytree spec of ``(args, kwargs)``.
        out_spec: Pytree spec of the model's output.
        method: ``"export"`` or ``"symbolic_trace"``.
        aliases: For every parameter/buffer name the graph uses, every original name of the
            same tensor (tied weights have several), e.g. ``{"head.weight": ("emb.weight",
            "head.weight")}``.
        trainable: Names (graph side) of trainable parameters.
        batched_inputs, batched_outputs: Which flat inputs / outputs carry the batch on dim 0,
            read from the symbolic batch dimension of a ``dynamic_batch`` export (``None``
            otherwise: the runtime then goes by shape; an output no input reaches is False
            there, never batched whatever its shape). Always dim 0 of the graph: see
            ``layout``.
        layout: Where the batch is in the model's own inputs and outputs when that is not dim 0
            everywhere (``capture(batch_dim=...)``, or an output with the batch elsewhere);
            None when the graph's boundary is the model's.
        guards: One :class:`InputGuard` per flat input (export), checked by
            :meth:`flatten_inputs`; None (symbolic_trace: tensors only, no size fixed).
        size_outputs: Flat output index -> its formula (sympy) in the inputs' symbolic sizes,
            for each output that is a number computed from them (``x.shape[0]`` returned): a
            micro-batch computes it for its own sizes, the batch's is
            :meth:`size_output_values`.
        size_symbols: ``(symbol, input, dim)``: where each symbol of those formulas is a size of
            the flat inputs (the capture's symbols; later passes may annotate new ones).
    """

    gm: torch.fx.GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    method: str
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    trainable: frozenset[str] = frozenset()
    batched_inputs: tuple[bool, ...] | None = None
    batched_outputs: tuple[bool | None, ...] | None = None
    layout: BatchLayout | None = None
    guards: tuple[InputGuard, ...] | None = None
    size_outputs: Mapping[int, Any] = field(default_factory=dict)
    size_symbols: tuple[tuple[Any, int, int], ...] = ()

    def size_output_values(self, flat: Sequence[Any]) -> dict[int, int | float]:
        """The value of each :attr:`size_outputs` output for the flat inputs ``flat`` (the whole
        batch, as :meth:`flatten_inputs` gives them): its formula evaluated at their sizes.

        Raises:
            ConfigError: for a formula in a size no input has (data-dependent).
        """
        if not self.size_outputs:
            return {}
        import sympy

        sizes = {sym: sympy.Integer(int(flat[i].shape[d])) for sym, i, d in self.size_symbols}
        out: dict[int, int | float] = {}
        for j, expr in self.size_outputs.items():
            value = sympy.sympify(expr).xreplace(sizes)
            if value.free_symbols:  # a size no input has (a data-dependent count, such as nonzero's)
                raise ConfigError(
                    f"output {j} of the model is a number computed from sizes ({expr}) that are not the inputs' "
                    f"({sorted(map(str, value.free_symbols))} depend on the data): its value on the batch is not "
                    "what the micro-batches' values make; return it as a tensor or run with microbatches=1")
            out[j] = int(value) if value.is_Integer else float(value)
        return out

    @property
    def input_names(self) -> list[str]:
        """Placeholder names, in flat input order."""
        return [n.name for n in self.gm.graph.find_nodes(op="placeholder")]

    @property
    def num_outputs(self) -> int:
        return self.out_spec.num_leaves

    def flatten_inputs(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> list[Any]:
        """Leaves of ``(args, kwargs)`` in placeholder order (see :func:`flatten_to_spec`), batch
        first as the graph takes them (``layout``)."""
        return flatten_to_spec(args, kwargs, self.in_spec, self.layout, self.guards)

    def unflatten_outputs(self, flat: Sequence[Any]) -> Any:
        """Rebuild the model's output structure (and layout) from the graph's flat outputs."""
        return unflatten_to_spec(flat, self.out_spec, self.layout)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.unflatten_outputs(self.gm(*self.flatten_inputs(args, kwargs)))

    def __repr__(self) -> str:
        n = len(self.gm.graph.nodes)
        return (
            f"Captured(method={self.method!r}, nodes={n}, inputs={self.input_names}, "
            f"outputs={self.num_outputs}, params={len(self.trainable)})"
        )


def flatten_to_spec(args: Sequence[Any], kwargs: Mapping[str, Any] | None, in_spec: pytree.TreeSpec,
                    layout: BatchLayout | None = None, guards: Sequence[InputGuard] | None = None) -> list[Any]:
    """Leaves of ``(args, kwargs)`` in the order of ``in_spec`` (keyword order never matters),
    batch first as the captured graph takes them when a ``layout`` says where the batch is.

    Raises:
        ConfigError: when the structure differs from the captured example inputs, or a leaf
            from what ``guards`` says the capture fixed (:meth:`InputGuard.check`).
    """
    kwargs = dict(kwargs or {})
    if in_spec.num_children == 2 and in_spec.child(1).type is dict:
        order = list(in_spec.child(1).context)
        if set(order) == set(kwargs):
            kwargs = {k: kwargs[k] for k in order}
    leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
    if spec != in_spec:
        raise ConfigError(
            f"inputs have structure {spec} but the model was captured with {in_spec}; "
            "call with the same positional/keyword structure as example_inputs"
        )
    leaves = layout.inputs_to_batch_first(leaves) if layout is not None else leaves
    for guard, leaf in zip(guards or (), leaves, strict=False):
        guard.check(leaf)
    return leaves


def _size_outputs(gm: torch.fx.GraphModule) -> tuple[dict[int, Any], tuple[tuple[Any, int, int], ...]]:
    """Flat output index -> the formula of each output that is a symbolic number (a ``SymInt``
    or ``SymFloat`` of the inputs' sizes, such as ``x.shape[0]``), and ``(symbol, input, dim)``
    for the symbols of the placeholders' sizes."""
    out = {}
    for j, leaf in enumerate(gm.graph.output_node().args[0]):  # type: ignore[arg-type]
        val = leaf.meta.get("val") if isinstance(leaf, torch.fx.Node) else None
        if isinstance(val, torch.SymInt | torch.SymFloat) and val.node.expr.free_symbols:
            out[j] = val.node.expr
    if not out:
        return {}, ()
    where: list[tuple[Any, int, int]] = []
    for i, ph in enumerate(gm.graph.find_nodes(op="placeholder")):
        val = ph.meta.get("val")
        for d, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                where.append((size.node.expr, i, d))
    return out, tuple(where)


def _input_free_outputs(gm: torch.fx.GraphModule) -> tuple[bool | None, ...] | None:
    """Where the capture kept no symbolic batch (a fixed-batch export, symbolic_trace): False for
    each flat output no input reaches (a parameter, a constant: never batched, whatever its
    dim 0), None for the others (the runtime then goes by shape); None when every output
    reaches an input."""
    outputs = list(gm.graph.output_node().args[0])  # type: ignore[arg-type]
    flags = tuple(None if isinstance(out, torch.fx.Node) and (out.op == "placeholder" or reads_inputs(out)) else False
                  for out in outputs)
    return flags if False in flags else None


def reads_inputs(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value depends on a placeholder (the model's inputs, or a stage's)."""
    seen, todo = set(), list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return True
        todo.extend(n.all_input_nodes)
    return False


def _input_guards(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> tuple[InputGuard, ...]:
    """What export fixed of each flat input of ``(args, kwargs)`` (placeholder order): constants'
    values, and each tensor's sizes that its placeholder holds as plain ints (batch first)."""
    paths, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(paths):  # (not seen: export keeps one placeholder per leaf)
        log.warning("no input guards: %d placeholders for %d inputs", len(placeholders), len(paths))
        return tuple(InputGuard(pytree.keystr(path)) for path, _ in paths)
    out = []
    for (path, leaf), ph in zip(paths, placeholders, strict=True):
        where = ("args" if getattr(path[0], "idx", 0) == 0 else "kwargs") + pytree.keystr(path[1:])
        val = ph.meta.get("val")
        if isinstance(leaf, torch.Tensor) and isinstance(val, torch.Tensor):
            sizes = tuple(int(d) if is_concrete_int(d) else None for d in val.shape)
            out.append(InputGuard(where, "tensor", sizes=sizes))
        elif leaf is None or isinstance(leaf, (bool, int, float, str, torch.dtype, torch.device)):
            out.append(InputGuard(where, "constant", value=leaf))
        else:
            out.append(InputGuard(where))
    return tuple(out)


def unflatten_to_spec(flat: Sequence[Any], out_spec: pytree.TreeSpec, layout: BatchLayout | None = None) -> Any:
    """The model's output (structure ``out_spec``, and its own batch layout) from the graph's
    flat outputs; the inverse of :func:`flatten_to_spec` for outputs."""
    flat = layout.outputs_from_batch_first(flat) if layout is not None else list(flat)
    return pytree.tree_unflatten(flat, out_spec)


def capture(
    model: nn.Module,
    example_inputs: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    method: str = "auto",
    dynamic_batch: bool = False,
    batch_dim: int = 0,
    seq_dim: int | None = None,
) -> Captured:
    """Capture ``model`` as a flat FX graph.

    Args:
        model: The module. May live on ``cpu``, ``cuda`` or ``meta`` (no weights allocated).
        example_inputs: Positional inputs, e.g. ``(tokens,)`` with ``tokens: [batch, seq]``;
            real, fake or meta tensors.
        example_kwargs: Keyword inputs, same kinds.
        method: ``"auto"`` (export, then symbolic_trace), ``"export"`` or ``"symbolic_trace"``.
        dynamic_batch: Export with dim 0 of every batched input symbolic (``Dim.AUTO``), so the
            graph runs on any micro-batch size; ``node.meta["val"]`` then holds symbolic shapes
            until ``propagate_shapes(force=True)`` makes them concrete again.
        batch_dim: The batch dimension of the first tensor input (with more than ``batch_dim``
            dimensions); needs ``dynamic_batch`` and export. Every other input's and output's
            batch dimension is read from the graph: the dimension export proves equal to it
            (``src_key_padding_mask [batch, seq]`` next to ``src [seq, batch, d]``). The graph is
            then made batch-first at its boundary (:class:`BatchLayout`).
        seq_dim: Also export the sequence symbolic: dim ``seq_dim`` (an int >= 1) of every
            batched input of the first one's length (``tokens [batch, seq]``: 1), so the graph
            has no length baked in (``arange(seq)``, a ``narrow`` to it) and
            :func:`fxsplit.passes.symbolic.symbolic_node_costs` gives formulas of it. Needs
            ``dynamic_batch``, export and ``batch_dim == 0``. None (default): the length is
            fixed as in the example.

    Returns:
        The :class:`Captured` graph.

    Raises:
        ConfigError: for an unknown ``method`` or a ``model`` that is not an ``nn.Module``; for
            a ``batch_dim`` no input has, one the model fixes to a constant, or a value whose
            batch dimension cannot be told (two dimensions of the batch's size, neither tied to
            the first input's batch), and for ``batch_dim != 0`` without export; for a ``seq_dim``
            that is not an int >= 1, that the first input lacks, without ``dynamic_batch`` or export,
            with ``batch_dim != 0``, or that export fixes to a constant (the model specialises the
            length: a position table added whole, a view to a constant length).
        CaptureError: when no method captures the model; the message names the failing source
            line torch reports, what each method said, and what to change.

    Example:
        >>> import torch
        >>> cap = capture(torch.nn.Linear(4, 2), (torch.randn(3, 4),))
        >>> cap.method, cap.num_outputs
        ('export', 1)
    """
    if method not in METHODS:
        raise ConfigError(f"capture method={method!r} is unknown; choose one of {METHODS}")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"capture needs an nn.Module, got {type(model).__name__}")
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    if batch_dim != 0 and (not dynamic_batch or method == "symbolic_trace"):
        raise ConfigError(
            f"batch_dim={batch_dim} needs capture by torch.export with a symbolic batch (dynamic_batch=True, "
            f"method 'auto' or 'export'; got method={method!r}, dynamic_batch={dynamic_batch}): the batch dimension "
            "of every other input and output is read from export's symbolic shapes")
    if seq_dim is not None:
        _check_seq_options(args, kwargs, method, dynamic_batch, batch_dim, seq_dim)
    only_export = batch_dim or seq_dim is not None
    tried = ("export",) if only_export else ("export", "symbolic_trace") if method == "auto" else (method,)
    failures: dict[str, BaseException] = {}
    for name in tried:
        try:
            if name == "export":
                gm, in_spec, out_spec = _capture_export(model, args, kwargs, dynamic_batch, batch_dim, seq_dim)
            else:
                gm, in_spec, out_spec = _capture_symbolic(model, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - every failure is reported in CaptureError
            log.info("capture with %s failed: %s", name, exc)
            failures[name] = exc
            continue
        aliases, trainable = _aliases(model, gm)
        log.info("captured %s with %s: %d nodes", type(model).__name__, name, len(gm.graph.nodes))
        batched_in: tuple[bool, ...] | None = None
        batched_out: tuple[bool | None, ...] | None = None
        layout: BatchLayout | None = None
        if seq_dim is not None:
            _check_seq_symbolic(gm, args, kwargs, seq_dim)
        if name == "export" and dynamic_batch:
            batched_in, batched_out, layout = make_batch_first(gm, batch_dims(gm, args, kwargs, batch_dim), batch_dim)
        if batched_out is None:
            batched_out = _input_free_outputs(gm)
        guards = _input_guards(gm, args, kwargs) if name == "export" else None
        return Captured(gm, in_spec, out_spec, name, aliases, trainable, batched_in, batched_out, layout, guards,
                        *_size_outputs(gm))
    note = None if seq_dim is None else (
        f"seq_dim={seq_dim}: if the model captures without seq_dim, it cannot run other sequence lengths; drop "
        "seq_dim (formulas of the batch only)")
    raise _capture_error(model, failures, note)


# -- export ----------------------------------------------------------------------------------
def _capture_export(
    model: nn.Module, args: tuple, kwargs: dict, dynamic_batch: bool = False, batch_dim: int = 0,
    seq_dim: int | None = None,
) -> tuple[torch.fx.GraphModule, Any, Any]:
    if seq_dim is not None:
        dynamic = _batch_seq_dynamic_shapes(model, args, kwargs, seq_dim)
    else:
        dynamic = batch_dynamic_shapes(model, args, kwargs, batch_dim) if dynamic_batch else None
    try:
        ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False)
    except AssertionError as exc:  # name the keywords a **kwargs takes, for the error's fix
        params = inspect.signature(model.forward).parameters
        exc.var_keywords = [k for k in kwargs if k not in params]  # type: ignore[attr-defined]
        raise
    gm = ep.module()
    in_spec, out_spec = gm._in_spec, gm._out_spec
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:  # tied weights: export reads one alias
            gm.graph.erase_node(node)
    _inline_no_grad_regions(gm)
    _drop_dtype_asserts(gm)
    _functionalize_view_writes(gm)
    _drop_self_copies(gm)
    gm._forward_pre_hooks.clear()  # export's input-spec check; we call the graph flat
    gm.graph._codegen = torch.fx.graph.CodeGen()
    _flatten_output(gm)
    gm.recompile()
    return gm, in_spec, out_spec


# -- sequence length -------------------------------------------------------------------------
def _check_seq_options(args: tuple, kwargs: dict, method: str, dynamic_batch: bool, batch_dim: int,
                       seq_dim: Any) -> None:
    """``capture(seq_dim=...)``'s preconditions.

    Raises:
        ConfigError: for a ``seq_dim`` not an int >= 1 or one the first input lacks, and without
            ``dynamic_batch`` and export, or with ``batch_dim != 0``.
    """
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 1:
        raise ConfigError(f"seq_dim={seq_dim!r}; pass the sequence dimension of the batched inputs, an int >= 1 "
                          "(dim 0 is the batch; tokens [batch, seq]: seq_dim=1)")
    if not dynamic_batch or method == "symbolic_trace" or batch_dim != 0:
        raise ConfigError(
            f"seq_dim={seq_dim} needs capture by torch.export with a symbolic batch on dim 0 (dynamic_batch=True, "
            f"batch_dim=0, method 'auto' or 'export'; got method={method!r}, dynamic_batch={dynamic_batch}, "
            f"batch_dim={batch_dim}): the sequence is the dimension seq_dim of the batched inputs")
    first = primary_input(args, kwargs, 0)
    if first is None or first[1].dim() <= seq_dim:
        shapes = [list(t.shape) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        raise ConfigError(f"seq_dim={seq_dim}, but the first input has no dimension {seq_dim} (input shapes {shapes}); "
                          "give the sequence dimension of the batched inputs, counted from 0 (tokens [batch, seq]: 1)")


def _batch_seq_dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict, seq_dim: int) -> Any:
    """Dim.AUTO on dim 0 of every input of the batch's size, and on dim ``seq_dim`` of those of
    them with the first input's length there."""
    first = primary_input(args, kwargs, 0)
    if first is None:
        return None
    batch, length = first[1].shape[0], first[1].shape[seq_dim]
    shapes = torch.export.ShapesCollection()
    for t in pytree.tree_leaves((args, kwargs)):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != batch:
            continue
        dims = [0] + ([seq_dim] if t.dim() > seq_dim and t.shape[seq_dim] == length else [])
        shapes[t] = dict.fromkeys(dims, torch.export.Dim.AUTO)
    return shapes.dynamic_shapes(model, args, kwargs)


def _check_seq_symbolic(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, seq_dim: int) -> None:
    """Export's sequence dimension of the first input stayed a symbol of its own.

    Raises:
        ConfigError: when export fixed it (the model specialises the length), or tied it to the
            batch (an example whose batch equals its length, which export cannot tell apart).
    """
    first = primary_input(args, kwargs, 0)
    vals = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    val = vals[first[0]] if first is not None and first[0] < len(vals) else None
    if not isinstance(val, torch.Tensor) or val.dim() <= seq_dim:
        return
    size, batch = val.shape[seq_dim], val.shape[0]
    if not isinstance(size, torch.SymInt) or is_concrete_int(size):
        from fxsplit.passes.symbolic import where_fixed  # (symbolic imports the cost model)

        try:  # where, for the message: best effort, the error below stands either way
            where = where_fixed(gm, seq_dim) if int(size) > 1 else None
        except Exception:  # noqa: BLE001
            log.info("could not locate what fixed the sequence length", exc_info=True)
            where = None
        raise ConfigError(
            f"torch.export fixed the sequence length (dim {seq_dim} of the first input, {int(size)} in the example)"
            f"{f' at {where}' if where else ''}: the model specialises it (a position table or mask added whole, a view "
            "or reshape to a constant length; a length of 1), so no formula of s exists. Fix: check seq_dim names the "
            "sequence dimension, derive lengths from the input (x.size(1), narrow a table to it), use an example "
            "length of at least 2, or drop seq_dim (formulas of b only)")
    if isinstance(batch, torch.SymInt) and batch.node.expr == size.node.expr:
        raise ConfigError(
            f"torch.export tied the sequence length to the batch size (both {int(size)} in the example): use example "
            "inputs whose batch size differs from their length")


# -- symbolic trace --------------------------------------------------------------------------
def _capture_symbolic(model: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.fx.GraphModule, Any, Any]:
    sig = inspect.signature(model.forward)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
        raise CaptureError("symbolic_trace needs a forward without *args/**kwargs; use method='export'")
    bound = sig.bind(*args, **kwargs)
    for name, value in bound.arguments.items():
        if not isinstance(value, torch.Tensor):
            raise CaptureError(
                f"the symbolic_trace path takes tensor inputs only; argument {name!r} is "
                f"{type(value).__name__}; use method='export' for structured inputs"
            )
    concrete = {n: p.default for n, p in sig.parameters.items() if n not in bound.arguments}
    with torch.no_grad():
        before = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        gm = torch.fx.symbolic_trace(model, concrete_args=concrete or None)
    finally:
        changed = _restore_changed(model, before)
    if changed:
        raise CaptureError(
            f"{type(model).__name__}'s forward updates buffers {changed} on tensors symbolic_trace does not trace (it "
            "ran the update once while tracing, now undone, and recorded none): the graph would read a constant; "
            "use method='export' (or 'auto'), which captures buffer updates")
    _, in_spec = pytree.tree_flatten((args, kwargs))
    positional = list(sig.parameters)[: len(args)]
    _order_placeholders(gm, positional + list(kwargs))
    out_spec = _flatten_output(gm)
    gm.recompile()
    return gm, in_spec, out_spec


def _restore_changed(model: nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """Put back the buffers tracing changed (leaf modules such as BatchNorm run on proxies and
    change nothing); return their names."""
    changed = []
    with torch.no_grad():
        for name, b in model.named_buffers():
            old = before.get(name)
            if old is not None and (old.shape != b.shape or not torch.equal(old, b)):
                changed.append(name)
                if old.shape == b.shape:
                    b.copy_(old)
    return changed


def _order_placeholders(gm: torch.fx.GraphModule, flat_names: list[str]) -> None:
    """Drop placeholders of arguments not given; order the rest as the leaves of ``(args, kwargs)``."""
    placeholders = {str(n.target): n for n in gm.graph.find_nodes(op="placeholder")}
    for target, node in placeholders.items():
        if target not in flat_names:
            if node.users:
                raise CaptureError(f"forward argument {target!r} is used but no example was given for it")
            gm.graph.erase_node(node)
    for name in reversed(flat_names):
        first = next(iter(gm.graph.nodes))
        if placeholders[name] is not first:
            first.prepend(placeholders[name])


def writes_in_place(node: Any) -> bool:
    """Whether ``node`` calls an op that writes its first argument (``add_``, ``relu_``,
    ``copy_``), as the op's schema declares."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or not node.args:
        return False
    schema = getattr(node.target, "_schema", None)
    info = schema.arguments[0].alias_info if schema is not None and schema.arguments else None
    return info is not None and info.is_write


def in_place_root(node: Any) -> Any:
    """The value an in-place chain writes into: ``add_(mul_(ema, 0.9), x)`` -> the ``ema`` node."""
    while writes_in_place(node):
        node = node.args[0]
    return node


def _inline_no_grad_regions(gm: torch.fx.GraphModule) -> int:
    """Inline export's ``wrap_with_set_grad_enabled(False, subgraph, *operands)`` (a
    ``torch.no_grad()`` block in ``forward``) into the graph, its operands detached, and return
    how many were inlined.

    A buffer updated in such a block (``self.count += 1``, an EMA of activations) is written
    inside the subgraph, where fxsplit's buffer and per-sample passes do not look: the update ran
    once per micro-batch, silently. Inlined, the write is an ordinary in-place op on the buffer,
    which those passes handle (once per step, or a NotPerSampleWarning). Detaching every operand
    but the buffers keeps the block's meaning: nothing computed in it has a gradient, and an
    in-place write into a buffer still writes the buffer. A block that writes into an operand
    other than a buffer (an activation or a parameter modified under ``no_grad``), or holds
    nested subgraphs, is left as it is (logged).
    """
    inlined = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.wrap_with_set_grad_enabled)):
        enabled, sub_node, *operands = node.args
        sub = getattr_path(gm, str(sub_node.target)) if isinstance(sub_node, torch.fx.Node) else None
        if enabled is not False or not isinstance(sub, torch.fx.GraphModule):
            continue
        placeholders = list(sub.graph.find_nodes(op="placeholder"))
        buffers = {ph for ph, op in zip(placeholders, operands, strict=False) if _is_buffer(gm, op)}
        writes_other = any(writes_in_place(n) and in_place_root(n).op == "placeholder" and in_place_root(n) not in buffers
                           for n in sub.graph.nodes)
        if len(placeholders) != len(operands) or writes_other or sub.graph.find_nodes(op="get_attr"):
            log.info("kept the no_grad block %s as a subgraph (it writes into an operand that is not a buffer, or "
                     "nests subgraphs)", node.name)
            continue
        env: dict[torch.fx.Node, Any] = {}
        with gm.graph.inserting_before(node):
            for ph, op in zip(placeholders, operands, strict=True):
                if ph in buffers or not isinstance(op, torch.fx.Node):
                    env[ph] = op
                else:
                    env[ph] = gm.graph.call_function(torch.ops.aten.detach.default, (op,))
                    env[ph].meta = {k: v for k, v in op.meta.items() if k in ("val", "tensor_meta", "stack_trace")}
            result: Any = None
            lookup = env.__getitem__
            for n in sub.graph.nodes:
                if n.op == "output":
                    result = torch.fx.map_arg(n.args[0], lookup)
                elif n.op != "placeholder":
                    env[n] = gm.graph.node_copy(n, lookup)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem and isinstance(result, (tuple, list)):
                user.replace_all_uses_with(result[user.args[1]])
                gm.graph.erase_node(user)
        if node.users:
            node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
        if isinstance(sub_node, torch.fx.Node) and not sub_node.users:
            gm.graph.erase_node(sub_node)
        inlined += 1
    if inlined:
        gm.delete_all_unused_submodules()
    return inlined


def _is_buffer(gm: torch.fx.GraphModule, op: Any) -> bool:
    """Whether ``op`` is a ``get_attr`` of a tensor that takes no gradient (a buffer, a frozen
    parameter)."""
    if not isinstance(op, torch.fx.Node) or op.op != "get_attr":
        return False
    value = getattr_path(gm, str(op.target))
    return isinstance(value, torch.Tensor) and not value.requires_grad


def _drop_dtype_asserts(gm: torch.fx.GraphModule) -> int:
    """Erase export's ``_assert_tensor_metadata`` checks (recorded before a ``.to(dtype)`` or
    ``.float()``: the value's dtype when captured). Under autocast the value is bf16 where it
    was captured as float32, and the check failed the pipeline (a Hugging Face model's
    ``logits.float()`` before its loss) where the unsplit model runs; ``to`` converts whatever
    it is given, so the check guards nothing the graph needs."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
            dropped += 1
    return dropped


def _drop_self_copies(gm: torch.fx.GraphModule) -> int:
    """Erase export's write-backs ``copy_(buf, y)`` where ``y`` is ``buf`` itself (the result of
    an in-place op on it, ``add_(buf, 1)``): a no-op copy that still bumps the buffer's version
    counter, so autograd refused the backward of any op that saved the updated buffer."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default or node.users:
            continue
        dest, src = node.args[0], node.args[1]
        if isinstance(dest, torch.fx.Node) and dest.op == "get_attr" and src is not dest and in_place_root(src) is dest:
            gm.graph.erase_node(node)
            dropped += 1
    return dropped  # (the buffer's get_attr stays: the in-place op reads it)


def _functional_twin(target: Any) -> Any:
    """``aten.relu_.default`` -> ``aten.relu.default`` (None when there is no such overload)."""
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "__name__", "")
    if not name.endswith("_") or name.startswith("_"):
        return None
    base = getattr(torch.ops.aten, name[:-1], None)
    return getattr(base, target._overloadname, None) if base is not None else None


_aten = torch.ops.aten
_INVERTED_VIEWS = {_aten.t.default, _aten.transpose.int, _aten.permute.default, _aten.alias.default}
_SCATTERED_VIEWS = {_aten.slice.Tensor: _aten.slice_scatter.default, _aten.select.int: _aten.select_scatter.default,
                    _aten.diagonal.default: _aten.diagonal_scatter.default}


def _is_view(node: Any) -> bool:
    """Whether ``node`` calls an op whose result aliases its first argument (a view)."""
    schema = getattr(getattr(node, "target", None), "_schema", None)
    return (isinstance(node, torch.fx.Node) and node.op == "call_function" and bool(node.args)
            and isinstance(node.args[0], torch.fx.Node) and schema is not None and bool(schema.returns)
            and schema.returns[0].alias_info is not None and not writes_in_place(node))


def _views_to_base(node: Any) -> tuple[list[Any], Any] | None:
    """The view ops from ``node`` back to the tensor it views (innermost first) and that tensor;
    None when a view on the way is one :func:`_functionalize_view_writes` cannot invert."""
    chain = []
    while _is_view(node):
        if node.target not in _SCATTERED_VIEWS and node.target not in _INVERTED_VIEWS:
            return None
        chain.append(node)
        node = node.args[0]
    return chain, node


def _copy_meta(new: torch.fx.Node, shaped_as: torch.fx.Node, where: torch.fx.Node) -> None:
    """Give a node made by :func:`_functionalize_view_writes` the value metadata of the node it
    is shaped as and the source location of the write it replaces."""
    new.meta.update({k: v for k, v in where.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
    for key in ("val", "tensor_meta"):
        if key in shaped_as.meta:
            new.meta[key] = shaped_as.meta[key]


def _dtype_of(node: Any) -> torch.dtype | None:
    """The dtype export recorded for ``node``'s value (None when it recorded none)."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _put_back(graph: torch.fx.Graph, view: Any, base: Any, value: Any) -> Any:
    """A node: ``base`` with the part ``view`` shows replaced by ``value`` (``view``'s shape)."""
    if view.target in _SCATTERED_VIEWS:
        return graph.call_function(_SCATTERED_VIEWS[view.target], (base, value, *view.args[1:]), dict(view.kwargs))
    if view.target is _aten.permute.default:
        order = [int(d) for d in view.args[1]]
        dims = [d % len(order) for d in order]
        return graph.call_function(_aten.permute.default, (value, [dims.index(i) for i in range(len(dims))]))
    if view.target is _aten.alias.default:
        return value
    return graph.call_function(view.target, (value, *view.args[1:]), dict(view.kwargs))  # t, transpose: self-inverse


def _functionalize_view_writes(gm: torch.fx.GraphModule) -> int:
    """Rewrite in-place writes into activations, also through views, as functional ops.

    Export keeps in-place ops (``relu_``, ``add_``, ``copy_``) and points later readers at the
    op's result, but readers that ran *before* the mutation still name the old value: once
    stages are split, such a reader may run after the mutation (and a value received from
    another stage is a leaf that autograd forbids mutating).

    ``shifted = labels.new_zeros(...); shifted[:, 1:] = labels[:, :-1]`` is exported as
    ``copy_(slice(shifted), ...)``: the write reaches ``shifted`` through the view, and the later
    readers of ``shifted`` name ``shifted``, with no edge to the write. Split into stages, a
    reader could run before the write (T5's and BART's decoder inputs, derived so from
    ``labels``, came out all zeros: another answer than the model's, silently). Here each such
    write becomes ``value = op(view, ...)`` (``aten.copy``, or the op's functional twin such as
    ``aten.fill``) put back into what the view shows (``slice_scatter``, ``select_scatter``,
    ``diagonal_scatter``, the inverse of a transpose or permute), and every later reader of the
    written tensor, or of a view of it, reads the new value (a view of it made again). A write
    into the tensor itself is the same without views (``early = buf[:, :3]; buf.copy_(y)``:
    ``early`` shows ``y``); ``copy_`` becomes its source broadcast and cast (``aten.copy`` has no
    gradient). Writes into
    parameters, buffers or the model's inputs (state the caller sees), and writes through views
    it cannot invert (reshapes, ``as_strided``), are left as they are.

    Returns:
        The number of writes rewritten.
    """
    graph = gm.graph
    changed = 0
    for node in list(graph.nodes):
        if not writes_in_place(node):
            continue
        found = _views_to_base(node.args[0])
        if found is None:  # through a view it cannot invert: say where, the split may separate its readers
            log.warning("%s writes in place through a view fxsplit cannot rewrite (%s); if the plan puts it and a later "
                        "reader of that tensor in different stages, the reader gets the value before the write. Write "
                        "the value functionally (torch.where, index_put, slice_scatter) to be safe; at: %s",
                        node.name, node.format_node(), (node.meta.get("stack_trace") or "?").strip().splitlines()[-1])
            continue
        chain, base = found
        twin = _aten.copy.default if node.target is _aten.copy_.default else _functional_twin(node.target)
        if base.op in ("get_attr", "placeholder") or writes_in_place(base) or twin is None:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        here = order[node]
        views = [base]  # the base and every view of it made before the write, with their readers after it
        for v in views:
            views += [u for u in v.users if _is_view(u) and u.args[0] is v and order[u] < here and u not in views]
        with graph.inserting_before(node.next):  # in creation order, right after the write
            if twin is _aten.copy.default:  # copy_ broadcasts and casts its source (aten.copy has no gradient)
                src, dest = node.args[0:2][::-1]
                dtype = _dtype_of(dest)
                if isinstance(src, torch.fx.Node) and dtype is not None and _dtype_of(src) != dtype:
                    src = graph.call_function(_aten._to_copy.default, (src,), {"dtype": dtype})
                value = graph.call_function(_aten.expand_as.default, (src, dest))
            else:
                value = graph.call_function(twin, node.args, dict(node.kwargs))
            written, shaped = value, [(value, node.args[0])]
            for view in chain:  # innermost first: each part put back into what it views
                written = _put_back(graph, view, view.args[0], written)  # type: ignore[arg-type]
                shaped.append((written, view.args[0]))
            again = {base: written}
            for v in views[1:]:  # every view of the written tensor made again (parents first); unread ones go
                again[v] = graph.call_function(v.target, (again[v.args[0]], *v.args[1:]), dict(v.kwargs))  # type: ignore[index]
        for old, new in again.items():
            for user in [u for u in list(old.users) if order.get(u, -1) > here]:
                user.replace_input_with(old, new)
        node.replace_all_uses_with(value)  # the write's own result: the view, written
        for made, like in shaped:
            _copy_meta(made, like, node)  # type: ignore[arg-type]
        for v in reversed(views[1:]):
            if again[v].users:
                _copy_meta(again[v], v, node)
            else:
                graph.erase_node(again[v])
        graph.erase_node(node)
        changed += 1
    if changed:
        graph.lint()
        gm.recompile()
    return changed


def _flatten_output(gm: torch.fx.GraphModule) -> pytree.TreeSpec:
    out = gm.graph.output_node()
    leaves, spec = pytree.tree_flatten(out.args[0])
    out.args = (tuple(leaves),)
    return spec


# -- names -----------------------------------------------------------------------------------
def _aliases(model: nn.Module, gm: torch.fx.GraphModule) -> tuple[dict[str, tuple[str, ...]], frozenset[str]]:
    """Map each parameter/buffer name of ``gm`` to every original name of the same tensor."""
    by_id: dict[int, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        by_id.setdefault(id(t), []).append(name)
    orig: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    orig.update(dict(model.named_buffers(remove_duplicate=False)))
    aliases: dict[str, tuple[str, ...]] = {}
    for name in _graph_state_names(gm):
        tensor = orig.get(name)
        aliases[name] = tuple(by_id[id(tensor)]) if tensor is not None else (name,)
    trainable = frozenset(n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad)
    return aliases, trainable


def _graph_state_names(gm: torch.fx.GraphModule) -> list[str]:
    """Names of the parameters and buffers the graph reads. A ``get_attr`` of a submodule (the
    subgraph of a higher-order op such as export's ``wrap_with_set_grad_enabled`` for a
    ``torch.no_grad()`` block) is no state: only the tensors it owns are."""
    names: list[str] = []
    for node in gm.graph.nodes:
        is_module = node.op == "get_attr" and isinstance(getattr_path(gm, str(node.target)), nn.Module)
        if node.op == "get_attr" and not is_module:
            names.append(str(node.target))
        elif node.op == "call_module" or is_module:
            sub = gm.get_submodule(str(node.target))
            names += [f"{node.target}.{k}" for k, _ in sub.named_parameters()]
            names += [f"{node.target}.{k}" for k, _ in sub.named_buffers()]
    return list(dict.fromkeys(names))


# -- errors ----------------------------------------------------------------------------------
def _user_frame(exc: BaseException) -> str | None:
    """The last traceback frame outside torch: the model line that broke capture."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
    frames = [f for f in frames if not f.filename.endswith(os.path.join("passes", "capture.py"))]
    if frames:
        f = frames[-1]
        return f'File "{f.filename}", line {f.lineno}, in {f.name}: {(f.line or "").strip()}'
    return None


def _reported_line(exc: BaseException) -> str | None:
    """The user source line torch names in its message, if any."""
    lines = str(exc).splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("File ") and _TORCH_DIR not in line:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{line.strip()}: {code}"
    return None


def _var_keyword_names(failures: dict[str, BaseException]) -> list[str]:
    """The keyword arguments of the failed export call that land in ``forward``'s ``**kwargs``
    (recorded on the exception by :func:`_capture_export`)."""
    return sorted(getattr(failures.get("export"), "var_keywords", ()))


def _capture_error(model: nn.Module, failures: dict[str, BaseException], note: str | None = None) -> CaptureError:
    parts = [f"could not capture {type(model).__name__} as an FX graph."]
    where = None
    for name, exc in failures.items():
        where = where or _reported_line(exc) or _user_frame(exc)
        summary = " ".join(str(exc).strip().splitlines()[:3])[:400]
        parts.append(f"  {name}: {type(exc).__name__}: {summary}")
    if where:
        parts.insert(1, f"  failing construct: {where}")
    var_keywords = any("Must provide a tree_name" in str(exc) for exc in failures.values())  # torch.export, 2.13
    if not var_keywords and not all(isinstance(exc, CaptureError) for exc in failures.values()):  # ours name theirs
        parts.append(
            "  fix: remove Python control flow that depends on tensor values (use torch.where or "
            "torch.cond), make shapes static, or wrap the offending code in a leaf module; "
            "then call fxsplit.capture again."
        )
    if var_keywords:
        extra = _var_keyword_names(failures)
        parts.append(
            f"  cause: torch.export cannot take a symbolic batch together with keyword arguments that land in "
            f"the forward's **kwargs{f' ({extra})' if extra else ''}; set them on the model instead (a Hugging Face "
            "model: its config, e.g. config.output_hidden_states=True), or compile with "
            "CompileOptions(dynamic_batch=False) (the batch then stays the example's)")
    if note is not None:
        parts.append(f"  {note}")
    err = CaptureError("\n".join(parts))
    err.__cause__ = next(reversed(failures.values()), None)
    return err
