"""Symbolic costs: each block's FLOPs, time and memory as sympy formulas of the batch size
(and of the sequence length).

The analytic cost model (:mod:`fxsplit.passes.costs`) is arithmetic on shapes. Run on fake
tensors whose batch dimension is a symbol of a ``ShapeEnv`` (what ``torch.export`` does with a
dynamic batch), the same code yields ``SymInt`` / ``SymFloat`` values, whose sympy expressions
are the formulas: ``98304*b`` FLOPs for a linear layer, ``Max(2.9e-10*b, 1.3e-11*b + ...) +
5e-6`` seconds for its roofline time. A block's formula is the sum of its nodes'. Instantiating
them at a batch size gives that batch's costs without capturing or annotating again; the tests
check them against concrete annotations at three sizes.

Every batched input's first dimension becomes ``b`` (:data:`BATCH`). With ``seq_dim`` the
sequence length is a second symbol ``s`` (:data:`SEQ`): dimension ``seq_dim`` of every batched
input of the example's length. That needs a graph whose length is not baked in (``arange(16)``, a
``narrow`` to 16): capture it with ``capture(..., dynamic_batch=True, seq_dim=1)``, which exports
that dimension symbolic too.

References:
    torch.fx.experimental.symbolic_shapes (``ShapeEnv``, ``SymInt``); sympy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from fxsplit.errors import ConfigError
from fxsplit.ir.devices import DeviceSpec
from fxsplit.ir.graph import CondensedGraph, Edge
from fxsplit.passes.costs import cost_nodes
from fxsplit.passes.shapes import _ShapeProp, autocast_run_device, fake_state

__all__ = ["BATCH", "SEQ", "BlockFormulas", "FORMULA_FIELDS", "NodeFormulas", "block_formulas", "graph_at", "graphs_at",
           "symbolic_node_costs", "where_fixed"]

log = logging.getLogger(__name__)

BATCH = sympy.Symbol("b", positive=True, integer=True)
"""The batch-size symbol of every formula."""

SEQ = sympy.Symbol("s", positive=True, integer=True)
"""The sequence-length symbol (formulas made with ``seq_dim``), in tokens."""

#: The :class:`~fxsplit.ir.Block` fields kept as formulas (``output_bytes``: what leaves the block).
FORMULA_FIELDS = ("flops", "fwd_s", "bwd_s", "activation_bytes", "output_bytes", "param_bytes")
_NODE_FIELDS = ("flops", "fwd_s", "bwd_s", "activation_bytes", "value_bytes", "param_bytes")

#: Plain-Python forms of the integer functions torch's symbolic shapes put in formulas (a
#: ``reshape(-1, k)`` gives ``FloorDiv(b, ...)``). At a fraction of a sample (the solvers' mean
#: micro-batch) they are evaluated as Python evaluates them on floats.
_TORCH_SYMPY_FUNCTIONS: dict[str, Any] = {
    "FloorDiv": lambda a, b: a // b,
    "CleanDiv": lambda a, b: a // b,
    "CeilDiv": lambda a, b: -(-a // b),
    "IntTrueDiv": lambda a, b: a / b,
    "FloatTrueDiv": lambda a, b: a / b,
    "Mod": lambda a, b: a % b,
    "PythonMod": lambda a, b: a % b,
    "ModularIndexing": lambda a, d, m: (a // d) % m,
    "PowByNatural": lambda a, b: a**b,
    "FloatPow": lambda a, b: a**b,
    "ToFloat": float,
    "Identity": lambda a: a,
    "FloorToInt": math.floor,
    "CeilToInt": math.ceil,
    "TruncToInt": math.trunc,
    "TruncToFloat": lambda a: float(math.trunc(a)),
    "RoundToInt": round,
    "Max": max,
    "Min": min,
}


def _numbers(exprs: Sequence[sympy.Expr]) -> Any:
    """``exprs`` compiled to one Python function of :data:`BATCH` returning their values."""
    return sympy.lambdify([BATCH], list(exprs), modules=[_TORCH_SYMPY_FUNCTIONS, "math"])


def _number(expr: sympy.Expr) -> float:
    """``expr``, whose symbols are all substituted, as a float (torch's integer functions of a
    fraction included, see :data:`_TORCH_SYMPY_FUNCTIONS`)."""
    try:
        return float(expr)
    except TypeError:
        return float(_numbers([expr])(0)[0])


@dataclass(frozen=True)
class BlockFormulas:
    """One block's costs as sympy expressions of :data:`BATCH` (and :data:`SEQ`).

    Attributes:
        block, name: The block's id and name in the condensed graph.
        fields: ``{field: expr}`` for each of :data:`FORMULA_FIELDS` (FLOPs, seconds, bytes).
        edges: ``{dst: expr}`` the bytes it sends to each later block.
        seq_len: The captured sequence length (tokens), which :meth:`at` puts for ``s`` unless
            told otherwise; None when the formulas are of ``b`` only.
    """

    block: int
    name: str
    fields: dict[str, sympy.Expr]
    edges: dict[int, sympy.Expr]
    seq_len: int | None = None

    def at(self, batch: int, seq: int | None = None) -> dict[str, float]:
        """The costs at ``batch`` samples of ``seq`` tokens (None: the captured length).

        Raises:
            ConfigError: for a ``seq`` when the formulas are of the batch only.
        """
        return {k: _number(self.subs(v, batch, seq)) for k, v in self.fields.items()}

    def subs(self, expr: sympy.Expr | int, batch: int, seq: int | None = None) -> sympy.Expr:
        """``expr`` (one of this block's formulas) at ``batch`` and ``seq`` (None: the captured
        length).

        Raises:
            ConfigError: for a ``seq`` when the formulas are of the batch only.
        """
        if seq is not None and self.seq_len is None:
            raise ConfigError(
                f"seq={seq} asked of block {self.block} ({self.name}), but its formulas are of the batch size b "
                "only: the sequence length stayed as captured. Capture with capture(..., dynamic_batch=True, "
                "seq_dim=D) and pass seq_dim=D to symbolic_node_costs for formulas of b and s")
        length = self.seq_len if seq is None else seq
        return sympy.sympify(expr).subs({BATCH: batch, SEQ: length} if length is not None else {BATCH: batch})


class NodeFormulas(dict[str, dict[str, sympy.Expr]]):
    """``{node: {field: expr}}`` (:func:`symbolic_node_costs`), with the captured sequence
    length ``seq_len`` (tokens; None when the formulas are of the batch only)."""

    seq_len: int | None = None


def _free_symbols(size: Any) -> Any:
    """The symbols of a symbolic size (a ``torch.SymInt``, typed ``int`` in shapes)."""
    return size.node.expr.free_symbols

def _plain(expr: sympy.Expr) -> sympy.Expr:
    """``expr`` with torch's sympy helpers (``ToFloat``, ``FloatTrueDiv``, ...) as plain sympy."""
    from torch.utils._sympy.functions import FloatTrueDiv, IntTrueDiv, ToFloat

    expr = expr.replace(lambda e: isinstance(e, ToFloat), lambda e: e.args[0])
    return expr.replace(lambda e: isinstance(e, FloatTrueDiv | IntTrueDiv), lambda e: e.args[0] / e.args[1])


def _expr(value: Any) -> sympy.Expr:
    if isinstance(value, torch.SymInt | torch.SymFloat):
        return sympy.sympify(value.node.expr)
    return sympy.sympify(value)


def _seq_len(flat: Sequence[Any], batched: Sequence[bool], seq_dim: int) -> int:
    """The example's sequence length: dim ``seq_dim`` of the first batched tensor that has it.

    Raises:
        ConfigError: when no batched input has a dimension ``seq_dim``.
    """
    for x, b in zip(flat, batched, strict=True):
        if b and isinstance(x, torch.Tensor) and x.dim() > seq_dim:
            return int(x.shape[seq_dim])
    shapes = [list(x.shape) for x, b in zip(flat, batched, strict=True) if b and isinstance(x, torch.Tensor)]
    raise ConfigError(f"seq_dim={seq_dim}, but no batched input has dimension {seq_dim} (batched input shapes "
                      f"{shapes}); give the sequence dimension of the batched inputs, counted from 0 (tokens "
                      "[batch, seq]: seq_dim=1)")


def _symbolic_inputs(flat: Sequence[Any], batched: Sequence[bool], mode: FakeTensorMode,
                     seq: tuple[int, int] | None = None) -> tuple[list[Any], dict[sympy.Symbol, sympy.Symbol]]:
    """Fakes of ``flat`` with dim 0 of each batched input a fresh symbol, and with ``seq =
    (seq_dim, seq_len)`` dim ``seq_dim`` of each batched input of that length too; and which of
    :data:`BATCH`, :data:`SEQ` each symbol stands for."""
    out, meaning = [], {}
    for x, b in zip(flat, batched, strict=True):
        if not isinstance(x, torch.Tensor):
            out.append(x)
            continue
        if not (b and x.dim() >= 1):
            out.append(mode.from_tensor(x, static_shapes=True))
            continue
        dims = [DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (x.dim() - 1)
        seq_at = seq[0] if seq is not None and 0 < seq[0] < x.dim() and x.shape[seq[0]] == seq[1] else None
        if seq_at is not None:
            dims[seq_at] = DimDynamic.DYNAMIC
        fake = mode.from_tensor(x, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))
        meaning.update(dict.fromkeys(_free_symbols(fake.shape[0]), BATCH))
        if seq_at is not None:
            meaning.update(dict.fromkeys(_free_symbols(fake.shape[seq_at]), SEQ))
        out.append(fake)
    return out, meaning


class _WatchedProp(_ShapeProp):
    """Shape propagation that notes the first node whose guard fixed one of ``watched``."""

    def __init__(self, gm: torch.fx.GraphModule, mode: FakeTensorMode, watched: dict[sympy.Symbol, sympy.Symbol]):
        super().__init__(gm, mode)
        self.watched = watched
        self.fixed_at: tuple[str, sympy.Symbol, Any] | None = None  # (node, BATCH or SEQ, value)

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if self.fixed_at is None:
            shape_env = self._mode.shape_env
            for sym, meaning in self.watched.items():
                value = shape_env.replacements.get(sym) if shape_env is not None else None
                if value is not None and value.is_number:
                    self.fixed_at = (n.name, meaning, value)
                    break
        return result


@contextlib.contextmanager
def _vals_kept(gm: torch.fx.GraphModule) -> Iterator[None]:
    """Put every node's ``"val"`` back as it was (the symbolic run writes its own)."""
    saved = {n: n.meta.get("val") for n in gm.graph.nodes}
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is None:
                n.meta.pop("val", None)
            else:
                n.meta["val"] = v


def symbolic_node_costs(gm: torch.fx.GraphModule, flat_inputs: Sequence[Any] | None, batched: Sequence[bool] | None,
                        device: DeviceSpec, *, seq_dim: int | None = None) -> NodeFormulas:
    """Every node's analytic costs as formulas of the batch (and sequence length):
    ``{node: {field: expr}}``, fields ``flops``, ``fwd_s``, ``bwd_s``, ``activation_bytes`` (its
    ``saved_bytes``), ``value_bytes`` (what it hands its consumers; 0 for a state read) and
    ``param_bytes``.

    Args:
        gm: A captured graph (placeholders: the flat inputs).
        flat_inputs: Example flat inputs (real, fake or meta tensors); None: empty tensors shaped
            like the placeholders' ``"val"``, on their device.
        batched: ``[num_inputs]`` which inputs carry the batch on dim 0 (None: those whose dim 0
            is the first input's).
        device: The reference device of the roofline.
        seq_dim: Keyword only. The sequence dimension of the batched inputs (``tokens [batch,
            seq]``: 1), an int >= 1: dim ``seq_dim`` of every batched input with the first one's
            length becomes :data:`SEQ`. ``gm`` must not have the length baked in: capture it
            with ``capture(..., dynamic_batch=True, seq_dim=seq_dim)``. None (default): formulas
            of the batch only.

    Returns:
        The :class:`NodeFormulas` (a dict), ``seq_len`` set to the example's length with ``seq_dim``.

    The graph's own ``node.meta["val"]`` are left as they were.

    Raises:
        ConfigError: when no cost depends on the batch (a graph captured at batch 1, which
            ``torch.export`` fixes as a constant); with ``seq_dim``: for a ``seq_dim`` that is not
            an int >= 1 or that no batched input has, when no cost depends on the sequence
            length, and when the graph fixes the batch or the length to a constant (a length baked
            in by a capture without ``seq_dim``; the message names the node).
    """
    if flat_inputs is None:
        vals = [p.meta.get("val") for p in gm.graph.find_nodes(op="placeholder")]
        flat_inputs = [torch.empty(tuple(int(d) for d in v.shape), dtype=v.dtype, device=v.device)
                       if isinstance(v, torch.Tensor) else v for v in vals]
    if batched is None:  # every tensor whose dim 0 is the first input's
        first = next((x.shape[0] for x in flat_inputs if isinstance(x, torch.Tensor) and x.dim() >= 1), None)
        batched = [isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == first for x in flat_inputs]
    seq = None if seq_dim is None else (_check_seq_dim(seq_dim), _seq_len(flat_inputs, batched, seq_dim))
    out = NodeFormulas()
    out.seq_len = None if seq is None else seq[1]
    with _vals_kept(gm):
        prop = _propagate(gm, flat_inputs, batched, seq)
        costs = cost_nodes(gm, device)
        for node, c in costs.items():
            fields = {"flops": c.flops, "fwd_s": c.fwd_s, "bwd_s": c.bwd_s, "activation_bytes": c.saved_bytes,
                      "value_bytes": 0 if node.op == "get_attr" else c.output_bytes, "param_bytes": c.param_bytes}
            out[node.name] = {k: _plain(_expr(v)).subs(prop.watched) for k, v in fields.items()}
    if seq is not None:
        _check_symbolic(gm, out, prop.fixed_at, seq)
    if not any(BATCH in f.free_symbols for costs_of in out.values() for f in costs_of.values()):
        sizes = sorted({int(x.shape[0]) for x, b in zip(flat_inputs, batched, strict=True) if b and isinstance(x, torch.Tensor)})
        raise ConfigError(
            f"no cost depends on the batch size (example batch {sizes or 'none'}): the graph fixed it when it was "
            "captured (torch.export treats a batch of 1 as a constant). Capture with a batch of at least 2 and "
            "dynamic_batch=True for formulas of b")
    return out


def _check_seq_dim(seq_dim: Any) -> int:
    """``seq_dim`` as given: an int >= 1 (dim 0 is the batch).

    Raises:
        ConfigError: for anything else.
    """
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 1:
        raise ConfigError(f"seq_dim={seq_dim!r}; pass the sequence dimension of the batched inputs, an int >= 1 "
                          "(dim 0 is the batch; tokens [batch, seq]: seq_dim=1)")
    return seq_dim


def _propagate(gm: torch.fx.GraphModule, flat: Sequence[Any], batched: Sequence[bool],
               seq: tuple[int, int] | None) -> _WatchedProp:
    """Run ``gm`` on fakes of ``flat`` with a symbolic batch (and ``seq = (seq_dim, seq_len)``),
    writing symbolic ``"val"``; the propagation says which symbol means what and what fixed one."""
    # specialize_zero_one=False: an example batch of 1 stays a symbol (else every formula is a constant);
    # with a sequence, no duck sizing: a batch and a length of the same size stay two symbols
    mode = FakeTensorMode(shape_env=ShapeEnv(specialize_zero_one=False, duck_shape=seq is None),
                          allow_non_fake_inputs=True)
    device = autocast_run_device(gm, flat)  # a meta model under CPU autocast runs as on a CPU
    if device is not None:
        flat = [torch.empty(tuple(x.shape), dtype=x.dtype, device=device) if isinstance(x, torch.Tensor) and x.is_meta
                else x for x in flat]
    inputs, meaning = _symbolic_inputs(flat, batched, mode, seq)
    prop = _WatchedProp(gm, mode, meaning)
    prop.device = device
    with fake_state(gm, mode, device), mode:
        prop.propagate_dont_convert_inputs(*inputs)
    return prop


def where_fixed(gm: torch.fx.GraphModule, seq_dim: int) -> str | None:
    """The node of ``gm`` that fixes the sequence length (or the batch size) to a constant, and
    the model's source line that made it, e.g. ``"node 'add' (File "m.py", line 9, in forward:
    return self.emb(t) + self.pos)"``; None when the shapes keep both symbolic.

    Args:
        gm: A captured graph; its placeholders' ``"val"`` give the example shapes and which
            inputs are batched (dim 0 of the first input's size).
        seq_dim: The sequence dimension of the batched inputs (>= 1).

    Raises:
        ConfigError: for a ``seq_dim`` not an int >= 1 or that no batched input has.
    """
    vals = [p.meta.get("val") for p in gm.graph.find_nodes(op="placeholder")]
    flat = [torch.empty(tuple(int(d) for d in v.shape), dtype=v.dtype, device=v.device)
            if isinstance(v, torch.Tensor) else v for v in vals]
    first = next((x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.dim() >= 1), None)
    batched = [isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == first for x in flat]
    seq = (_check_seq_dim(seq_dim), _seq_len(flat, batched, seq_dim))
    with _vals_kept(gm):
        fixed_at = _propagate(gm, flat, batched, seq).fixed_at
    return None if fixed_at is None else _where(gm, fixed_at[0])


def _where(gm: torch.fx.GraphModule, name: str) -> str:
    """``node 'add'`` and the last frame of its stack trace outside torch, if it has one."""
    node = next((n for n in gm.graph.nodes if n.name == name), None)
    trace = [line.strip() for line in str(node.meta.get("stack_trace") or "").strip().splitlines()] if node else []
    frame = [i for i, line in enumerate(trace) if line.startswith("File ")]
    if not frame:
        return f"node {name!r}"
    torch_dir = os.path.dirname(torch.__file__)
    i = next((i for i in reversed(frame) if torch_dir not in trace[i]), frame[-1])  # the model's line, not nn's
    return f"node {name!r} ({trace[i]}: {trace[i + 1] if i + 1 < len(trace) else ''})"


def _check_symbolic(gm: torch.fx.GraphModule, out: NodeFormulas, fixed_at: tuple[str, sympy.Symbol, Any] | None,
                    seq: tuple[int, int]) -> None:
    """Refuse formulas of a graph that fixed the batch or the length to a constant (silently
    wrong at other sizes), or in which no cost depends on the length.

    Raises:
        ConfigError: naming the node that fixed it, and the fix.
    """
    seq_dim, seq_len = seq
    if fixed_at is not None:
        node, what, value = fixed_at
        kind = "sequence length" if what == SEQ else "batch size"
        raise ConfigError(
            f"{_where(gm, node)} fixes the {kind} to {value}, so formulas of {what} would be wrong at any other size: the "
            f"graph has it baked in. Capture with capture(model, inputs, dynamic_batch=True, seq_dim={seq_dim}) "
            "(torch.export then keeps it symbolic) and pass that graph; a model that itself fixes the length "
            "(a position table added whole, a view to a constant length) has no formulas of s")
    if not any(SEQ in f.free_symbols for costs_of in out.values() for f in costs_of.values()):
        raise ConfigError(
            f"no cost depends on the sequence length (dim {seq_dim} of the batched inputs, {seq_len} in the example): "
            f"check seq_dim={seq_dim} names the sequence dimension, and capture with dynamic_batch=True, "
            f"seq_dim={seq_dim}")


def block_formulas(gm: torch.fx.GraphModule, graph: CondensedGraph,
                   node_formulas: dict[str, dict[str, sympy.Expr]], *, seq_len: int | None = None,
                   simplify: bool = True) -> list[BlockFormulas]:
    """``[num_blocks]`` each block's formulas, summed over its nodes as
    :mod:`fxsplit.passes.condense` sums their costs: a value that leaves the block counts once in
    its ``output_bytes`` and once on the edge to each other block that reads it.

    Args:
        gm: The graph the nodes belong to (for who reads whom).
        graph: Its condensed graph (``Block.nodes`` names the nodes of each block).
        node_formulas: :func:`symbolic_node_costs`.
        seq_len: Keyword only. The captured sequence length (tokens) the formulas take for
            ``s`` by default (None: ``node_formulas.seq_len`` when it is a :class:`NodeFormulas`).
        simplify: Keyword only. ``sympy.simplify`` each sum (readable formulas, seconds per
            hundred blocks); False keeps the plain sums, equal in value, for evaluation
            (:func:`graphs_at`).
    """
    tidy = sympy.simplify if simplify else (lambda e: e)
    if seq_len is None:
        seq_len = getattr(node_formulas, "seq_len", None)
    block_of = {n: b.id for b in graph.blocks for n in b.nodes}
    zero = sympy.Integer(0)
    sums = [{k: zero for k in FORMULA_FIELDS} for _ in graph.blocks]
    edges: list[dict[int, sympy.Expr]] = [{} for _ in graph.blocks]
    for node in gm.graph.nodes:
        if node.name not in block_of or node.name not in node_formulas:
            continue
        b, f = block_of[node.name], node_formulas[node.name]
        for k in ("flops", "fwd_s", "bwd_s", "activation_bytes", "param_bytes"):
            sums[b][k] += f[k]
        consumers = {block_of.get(u.name, -1) for u in node.users} - {b}
        if consumers:
            sums[b]["output_bytes"] += f["value_bytes"]
        for d in consumers - {-1}:
            edges[b][d] = edges[b].get(d, zero) + f["value_bytes"]
    return [BlockFormulas(blk.id, blk.name, {k: tidy(v) for k, v in sums[blk.id].items()},
                          {d: tidy(v) for d, v in edges[blk.id].items()}, seq_len) for blk in graph.blocks]


def graph_at(graph: CondensedGraph, formulas: Sequence[BlockFormulas], batch: int, *,
             seq: int | None = None) -> CondensedGraph:
    """``graph`` (annotated at some batch) with every formula evaluated at ``batch``: the
    condensed graph a capture and annotation at ``batch`` would give, without either. The fixed
    per-operator times stay; the weight-gradient share of each backward stays.

    Args:
        graph: The condensed graph the formulas were made for.
        formulas: ``[num_blocks]`` :func:`block_formulas`.
        batch: Samples per batch.
        seq: Keyword only. Tokens per sample (formulas of ``s``); None: the captured length.

    Raises:
        ConfigError: for a ``seq`` when the formulas are of the batch only.
    """
    values = [f.at(batch, seq) for f in formulas]
    sizes = [_number(formulas[e.src].subs(formulas[e.src].edges.get(e.dst, 0), batch, seq)) for e in graph.edges]
    return _graph_with(graph, values, sizes)


def _graph_with(graph: CondensedGraph, values: Sequence[dict[str, float]], edge_bytes: Sequence[float]) -> CondensedGraph:
    """``graph`` with each block's :data:`FORMULA_FIELDS` and each edge's bytes replaced; the
    weight-gradient share of each backward and the fixed per-operator times kept."""
    blocks = []
    for blk, v in zip(graph.blocks, values, strict=True):
        share = blk.bwd_weight_s / blk.bwd_s if blk.bwd_s > 0 else 0.0
        blocks.append(dataclasses.replace(
            blk, flops=v["flops"], fwd_s=v["fwd_s"], bwd_s=v["bwd_s"], bwd_weight_s=v["bwd_s"] * share,
            activation_bytes=round(v["activation_bytes"]), output_bytes=round(v["output_bytes"]),
            param_bytes=round(v["param_bytes"])))
    edges = tuple(dataclasses.replace(e, size_bytes=round(x), grad_bytes=_grad_share(e, x))
                  for e, x in zip(graph.edges, edge_bytes, strict=True))
    return CondensedGraph(tuple(blocks), edges, graph.name)


def _grad_share(edge: Edge, size_bytes: float) -> int | None:
    """The gradient bytes of ``edge`` at a new size: the same share of its values (``None``: all)."""
    if edge.grad_bytes is None:
        return None
    return round(size_bytes * edge.grad_bytes / edge.size_bytes) if edge.size_bytes else edge.grad_bytes


def graphs_at(graph: CondensedGraph, formulas: Sequence[BlockFormulas], batches: Sequence[float], *,
              seq: int | None = None) -> list[CondensedGraph | None]:
    """:func:`graph_at` for each of ``batches`` (samples; a fraction of one is allowed), with
    every formula compiled once (``sympy.lambdify``): milliseconds per batch size where
    :func:`graph_at` substitutes symbol by symbol. Falls back to :func:`graph_at` where a
    formula has no plain-Python form.

    Returns:
        One graph per batch size; None where the formulas have no value at that size (a
        division by zero: a ``reshape(-1, k)`` of fewer elements than ``k``, which the model
        cannot run either).

    Raises:
        ConfigError: for a ``seq`` when the formulas are of the batch only.
    """
    if not formulas:
        return [graph for _ in batches]
    first = formulas[0]
    first.subs(0, 1, seq)  # a seq asked of batch-only formulas fails here
    length = first.seq_len if seq is None else seq
    exprs = [f.fields[k] for f in formulas for k in FORMULA_FIELDS]
    exprs += [formulas[e.src].edges.get(e.dst, sympy.Integer(0)) for e in graph.edges]
    exprs = [sympy.sympify(x).subs(SEQ, length) if length is not None else sympy.sympify(x) for x in exprs]
    try:
        evaluate = _numbers(exprs)
    except (NameError, TypeError, ValueError, AttributeError) as exc:  # a torch sympy function python lacks
        log.debug("graphs_at: lambdify failed (%s), substituting instead", exc)
        evaluate = None
    width, n = len(FORMULA_FIELDS), len(graph.blocks)
    out: list[CondensedGraph | None] = []
    for b in batches:
        try:
            if evaluate is None:
                out.append(graph_at(graph, formulas, b, seq=seq))  # type: ignore[arg-type]
                continue
            row = [float(v) for v in evaluate(b)]
        except ZeroDivisionError as exc:
            log.debug("graphs_at: no costs at %s samples (%s)", b, exc)
            out.append(None)
            continue
        except (NameError, TypeError, ValueError, AttributeError) as exc:
            log.debug("graphs_at: lambdify failed at %s samples (%s), substituting instead", b, exc)
            out.append(graph_at(graph, formulas, b, seq=seq))  # type: ignore[arg-type]
            continue
        out.append(_graph_with(graph, [dict(zip(FORMULA_FIELDS, row[i * width:(i + 1) * width], strict=True))
                                       for i in range(n)], row[n * width:]))
    return out
