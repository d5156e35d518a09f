"""Symbolic costs: each block's FLOPs, time and memory as sympy formulas of the batch size.

The analytic cost model (:mod:`fxsplit.passes.costs`) is arithmetic on shapes. Run on fake
tensors whose batch dimension is a symbol of a ``ShapeEnv`` (what ``torch.export`` does with a
dynamic batch), the same code yields ``SymInt`` / ``SymFloat`` values, whose sympy expressions
are the formulas: ``98304*b`` FLOPs for a linear layer, ``Max(2.9e-10*b, 1.3e-11*b + ...) +
5e-6`` seconds for its roofline time. A block's formula is the sum of its nodes'. Instantiating
them at a batch size gives that batch's costs without capturing or annotating again; the tests
check them against concrete annotations at three sizes.

Only the batch is a symbol here: every batched input's first dimension becomes ``b`` (the
sequence length stays as captured).

References:
    torch.fx.experimental.symbolic_shapes (``ShapeEnv``, ``SymInt``); sympy.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from fxsplit.ir.graph import CondensedGraph
from fxsplit.passes.costs import cost_nodes
from fxsplit.passes.shapes import _ShapeProp, fake_state

__all__ = ["BATCH", "BlockFormulas", "FORMULA_FIELDS", "block_formulas", "graph_at", "symbolic_node_costs"]

BATCH = sympy.Symbol("b", positive=True, integer=True)
"""The batch-size symbol of every formula."""

#: The :class:`~fxsplit.ir.Block` fields kept as formulas (``output_bytes``: what leaves the block).
FORMULA_FIELDS = ("flops", "fwd_s", "bwd_s", "activation_bytes", "output_bytes", "param_bytes")
_NODE_FIELDS = ("flops", "fwd_s", "bwd_s", "activation_bytes", "value_bytes", "param_bytes")


@dataclass(frozen=True)
class BlockFormulas:
    """One block's costs as sympy expressions of :data:`BATCH` (``fields``: FORMULA_FIELDS), and
    the bytes it sends to each later block (``edges``: ``{dst: expr}``)."""

    block: int
    name: str
    fields: dict[str, sympy.Expr]
    edges: dict[int, sympy.Expr]

    def at(self, batch: int) -> dict[str, float]:
        """The costs at ``batch`` samples."""
        return {k: float(v.subs(BATCH, batch)) for k, v in self.fields.items()}



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


def _symbolic_inputs(flat: Sequence[Any], batched: Sequence[bool], mode: FakeTensorMode) -> list[Any]:
    out = []
    for x, b in zip(flat, batched, strict=True):
        if not isinstance(x, torch.Tensor):
            out.append(x)
        elif b and x.dim() >= 1:
            dims = [DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (x.dim() - 1)
            out.append(mode.from_tensor(x, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims)))
        else:
            out.append(mode.from_tensor(x, static_shapes=True))
    return out


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
                        device: DeviceSpec) -> dict[str, dict[str, sympy.Expr]]:
    """Every node's analytic costs as formulas of the batch: ``{node: {field: expr}}``, fields
    ``flops``, ``fwd_s``, ``bwd_s``, ``activation_bytes`` (its ``saved_bytes``), ``value_bytes``
    (what it hands its consumers; 0 for a state read) and ``param_bytes``.

    Args:
        gm: A captured graph (placeholders: the flat inputs).
        flat_inputs: Example flat inputs (real, fake or meta tensors); None: empty tensors shaped
            like the placeholders' ``"val"``, on their device.
        batched: ``[num_inputs]`` which inputs carry the batch on dim 0 (None: those whose dim 0
            is the first input's).
        device: The reference device of the roofline.

    The graph's own ``node.meta["val"]`` are left as they were.

    Raises:
        ConfigError: when no cost depends on the batch (a graph captured at batch 1, which
            ``torch.export`` fixes as a constant).
    """
    if flat_inputs is None:
        vals = [p.meta.get("val") for p in gm.graph.find_nodes(op="placeholder")]
        flat_inputs = [torch.empty(tuple(int(d) for d in v.shape), dtype=v.dtype, device=v.device)
                       if isinstance(v, torch.Tensor) else v for v in vals]
    if batched is None:  # every tensor whose dim 0 is the first input's
        first = next((x.shape[0] for x in flat_inputs if isinstance(x, torch.Tensor) and x.dim() >= 1), None)
        batched = [isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == first for x in flat_inputs]
    # specialize_zero_one=False: an example batch of 1 stays a symbol (else every formula is a constant)
    mode = FakeTensorMode(shape_env=ShapeEnv(specialize_zero_one=False), allow_non_fake_inputs=True)
    inputs = _symbolic_inputs(flat_inputs, batched, mode)
    symbols = {s for x in inputs if isinstance(x, torch.Tensor) for d in x.shape
               if isinstance(d, torch.SymInt) for s in _free_symbols(d)}
    out: dict[str, dict[str, sympy.Expr]] = {}
    with _vals_kept(gm):
        with fake_state(gm, mode), mode:
            _ShapeProp(gm, mode).propagate_dont_convert_inputs(*inputs)
        costs = cost_nodes(gm, device)
        for node, c in costs.items():
            fields = {"flops": c.flops, "fwd_s": c.fwd_s, "bwd_s": c.bwd_s, "activation_bytes": c.saved_bytes,
                      "value_bytes": 0 if node.op == "get_attr" else c.output_bytes, "param_bytes": c.param_bytes}
            out[node.name] = {k: _plain(_expr(v)).subs({s: BATCH for s in symbols}) for k, v in fields.items()}
    if not any(BATCH in f.free_symbols for costs_of in out.values() for f in costs_of.values()):
        sizes = sorted({int(x.shape[0]) for x, b in zip(flat_inputs, batched, strict=True) if b and isinstance(x, torch.Tensor)})
        raise ConfigError(
            f"no cost depends on the batch size (example batch {sizes or 'none'}): the graph fixed it when it was "
            "captured (torch.export treats a batch of 1 as a constant). Capture with a batch of at least 2 and "
            "dynamic_batch=True for formulas of b")
    return out


def block_formulas(gm: torch.fx.GraphModule, graph: CondensedGraph,
                   node_formulas: dict[str, dict[str, sympy.Expr]]) -> list[BlockFormulas]:
    """``[num_blocks]`` each block's formulas, summed over its nodes as
    :mod:`fxsplit.passes.condense` sums their costs: a value that leaves the block counts once in
    its ``output_bytes`` and once on the edge to each other block that reads it.

    Args:
        gm: The graph the nodes belong to (for who reads whom).
        graph: Its condensed graph (``Block.nodes`` names the nodes of each block).
        node_formulas: :func:`symbolic_node_costs`.
    """
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
    return [BlockFormulas(blk.id, blk.name, {k: sympy.simplify(v) for k, v in sums[blk.id].items()},
                          {d: sympy.simplify(v) for d, v in edges[blk.id].items()}) for blk in graph.blocks]


def graph_at(graph: CondensedGraph, formulas: Sequence[BlockFormulas], batch: int) -> CondensedGraph:
    """``graph`` (annotated at some batch) with every formula evaluated at ``batch``: the
    condensed graph a capture and annotation at ``batch`` would give, without either. The fixed
    per-operator times stay; the weight-gradient share of each backward stays."""
    blocks = []
    for blk, f in zip(graph.blocks, formulas, strict=True):
        v = f.at(batch)
        share = blk.bwd_weight_s / blk.bwd_s if blk.bwd_s > 0 else 0.0
        blocks.append(dataclasses.replace(
            blk, flops=v["flops"], fwd_s=v["fwd_s"], bwd_s=v["bwd_s"], bwd_weight_s=v["bwd_s"] * share,
            activation_bytes=round(v["activation_bytes"]), output_bytes=round(v["output_bytes"]),
            param_bytes=round(v["param_bytes"])))
    edges = tuple(dataclasses.replace(e, size_bytes=round(float(formulas[e.src].edges.get(e.dst, 0).subs(BATCH, batch))))
                  for e in graph.edges)
    return CondensedGraph(tuple(blocks), edges, graph.name)
