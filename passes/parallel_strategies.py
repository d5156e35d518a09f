"""Per-node parallelization strategies from DTensor, as a :class:`~fxsplit.ir.strategy.StrategyGraph`.

For every node of a captured graph, the candidate strategies over a 1-D mesh of ``N`` devices are
the sharding strategies ``torch.distributed.tensor`` (DTensor) defines for its aten op (its
sharding propagator: single-dim rules, full-mesh strategy functions, or the op's decomposition),
not a table of ours: output placement (``Shard(d)``, ``Replicate()``, ``Partial()``), the input
placements it expects, and DTensor's redistribution cost from each producer strategy. Graph
inputs and parameters may take any placement. An op DTensor has no strategy for runs
replicated (as autoparallel does). No process group is needed: the mesh is metadata only.

Costs per option: the node's forward + backward seconds (``node.meta["fxsplit.cost"]``) divided
by ``N`` when any of its operands is split, in full when all are replicated; per-device memory
of a parameter (times parameters + gradients + optimizer state) divided by ``N`` when sharded.
Edges: the collective that turns the producer's placement into the one the consumer expects,
costed on ``link`` with ring formulas (:func:`redistribute_s`; where DTensor finds no way, the
pair is forbidden), twice in training (the backward moves the gradient back the opposite way),
and for a replicated parameter read by a node that splits its other operands, the gradient
all-reduce (``2 (N-1)/N * bytes / bandwidth + 2 (N-1) * latency``).

References:
    Elango, "Automatic Parallelization Strategies for Efficient DNN Training" (PaSE), IPDPS 2021;
    meta-pytorch/autoparallel (DTensor placements on the FX graph);
    torch/distributed/tensor/_sharding_prop.py (the strategies).
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from fxsplit.errors import ConfigError
from fxsplit.ir.devices import LinkSpec
from fxsplit.ir.strategy import StrategyEdge, StrategyGraph, StrategyOption, StrategyVertex

__all__ = ["NodeStrategies", "strategy_graph", "placement_name", "redistribute_s"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeStrategies:
    """The strategy graph of a captured graph and which node each vertex is.

    Attributes:
        graph: One vertex per tensor node (inputs, parameters, ops), its options DTensor's.
        nodes: ``[num_vertices]`` the FX node names.
        placements: ``[num_vertices][options]`` each option's output placement, e.g. ``"S(0)"``.
        fallback: Nodes whose op has no DTensor strategy (run replicated).
        mesh_size: ``N``.
        parameters: ``[num_vertices]`` whether the vertex is a trainable parameter.
        item_of: ``[num_vertices]`` for an output of a multi-output op, the op's vertex (its
            options are the op's), else -1.
    """

    graph: StrategyGraph
    nodes: tuple[str, ...]
    placements: tuple[tuple[str, ...], ...]
    fallback: tuple[str, ...]
    mesh_size: int
    parameters: tuple[bool, ...] = ()
    item_of: tuple[int, ...] = ()

    def choice_of(self, prefer: Sequence[str]) -> tuple[int, ...]:
        """Per vertex, the first option whose output placement (each output's, for a
        multi-output op) is in ``prefer`` (else option 0); an op's outputs take the op's option.
        ``("R",)`` is every device doing everything."""
        return self._consistent([next((k for want in prefer for k, p in enumerate(opts) if _all_are(p, want)), 0)
                                 for opts in self.placements])

    def data_parallel_choice(self) -> tuple[int, ...]:
        """Data parallelism: parameters replicated, every other value split on dim 0 (the
        batch) where it can be, else replicated."""
        params = self.parameters or (False,) * len(self.placements)
        return self._consistent([next((k for want in (("R",) if is_param else ("S(0)", "R")) for k, p in enumerate(opts)
                                       if _all_are(p, want)), 0)
                                 for opts, is_param in zip(self.placements, params, strict=True)])

    def _consistent(self, choice: list[int]) -> tuple[int, ...]:
        for v, parent in enumerate(self.item_of):
            if parent >= 0:
                choice[v] = choice[parent]
        return tuple(choice)


def _all_are(name: str, want: str) -> bool:
    """``"S(0)"`` is ``"S(0)"``; ``"(S(0),S(0))"`` (a multi-output op's) is too."""
    if name.startswith("(") and name.endswith(")"):
        return all(part == want for part in name[1:-1].split(","))
    return name == want


def placement_name(spec: Any) -> str:
    """``"R"``, ``"S(1)"``, ``"P"`` (or one per mesh dimension) of a ``DTensorSpec``."""
    if isinstance(spec, tuple | list):
        return "(" + ",".join(placement_name(s) for s in spec) + ")"
    if spec is None:
        return "-"
    names = []
    for p in spec.placements:
        text = str(p)
        names.append("R" if text.startswith("Replicate") else "P" if text.startswith("Partial")
                     else text.replace("Shard(dim=", "S(").replace("_StridedShard(dim=", "SS("))
    return "".join(names)


def _all_placements(mesh: Any, val: torch.Tensor) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
    from torch.distributed.tensor._ops.utils import is_tensor_shardable

    meta = TensorMeta(val.shape, val.stride(), val.dtype)
    specs = []
    for placement in [Replicate()] + [Shard(d) for d in range(val.dim())]:
        spec = DTensorSpec(mesh, (placement,), tensor_meta=meta)
        if is_tensor_shardable(val.shape, spec):
            specs.append(OpSpec(spec))
    return OpStrategy(specs)


def _op_strategy(node: torch.fx.Node, mesh: Any, strategies: dict[torch.fx.Node, Any]) -> tuple[Any, bool]:
    """DTensor's strategies for ``node`` (an OpStrategy) and whether they are the replicated
    fallback. Single-dim rules first (DTensor's dispatcher prefers them), then the op's strategy
    function, then its decomposition."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, TupleStrategy
    from torch.distributed.tensor._ops.single_dim_strategy import (
        _fill_single_dim_strategy_placeholders,
        _get_num_tensor_inputs,
        _insert_single_dim_replication_strategy,
    )
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    propagator = DTensor._op_dispatcher.sharding_propagator
    op = node.target

    def arg(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return strategies[a] if a in strategies else a.meta.get("val")
        if isinstance(a, list | tuple):
            items = [arg(x) for x in a]
            if items and all(isinstance(x, OpStrategy) for x in items):
                return TupleStrategy(items)
            return type(a)(items)
        return a

    info = propagator.op_to_schema_info.get(op) or propagator.op_to_schema_info_for_single_dim_strategy.get(op)
    schema = OpSchema(op, tuple(arg(a) for a in node.args), {k: arg(v) for k, v in node.kwargs.items()},
                      schema_info=info)
    val = node.meta["val"]
    multi = isinstance(val, list | tuple)
    out_meta: Any = (tuple(TensorMeta(v.shape, v.stride(), v.dtype) for v in val) if multi
                     else TensorMeta(val.shape, val.stride(), val.dtype))
    n_out = len(val) if multi else 1
    try:
        if op in propagator.op_single_dim_strategy_funcs:
            single = propagator.op_single_dim_strategy_funcs[op]
            rules = single.func(op, schema.args_meta, schema.kwargs_meta)
            rules = _insert_single_dim_replication_strategy(rules, n_out, _get_num_tensor_inputs(schema), out_meta)
            rules = _fill_single_dim_strategy_placeholders({Shard(0)}, rules)
            return expand_to_full_mesh_op_strategy(
                mesh, schema, rules, output_tensor_meta=out_meta, input_index=n_out,
                inplace_op=str(op).split(".")[-2].endswith("_"),
                allow_unbacked_sharding=single.allow_unbacked_sharding,
                allow_uneven_sharding=single.allow_uneven_sharding), False
        if op in propagator.op_strategy_funcs:
            return propagator.op_strategy_funcs[op](schema), False
        decomposed = _decomposed(node, mesh, schema, out_meta, n_out)
        if decomposed is not None:
            return decomposed, False
    except (NotImplementedError, AssertionError, RuntimeError, IndexError, ValueError, KeyError) as exc:
        log.debug("no DTensor strategy for %s (%s): %s", node.name, op, exc)
    return _replicated(mesh, val, _tensor_inputs(node, strategies), strategies), True


def _replicated(mesh: Any, val: Any, inputs: list[torch.fx.Node], strategies: dict[torch.fx.Node, Any]) -> Any:
    """One strategy: every operand gathered whole, the output whole on every device (what an op
    DTensor has no strategy for costs: its inputs' all-gathers, its full work)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy

    def whole(t: torch.Tensor) -> Any:
        return DTensorSpec(mesh, (Replicate(),), tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype))

    out = tuple(whole(v) for v in val) if isinstance(val, list | tuple) else whole(val)
    spec = OpSpec(out, input_specs=[whole(a.meta["val"]) for a in inputs],
                  redistribute_cost=[[0.0] * len(strategies[a].strategies) for a in inputs])
    return OpStrategy([spec])


def _decomposed(node: torch.fx.Node, mesh: Any, schema: Any, out_meta: Any, n_out: int = 1) -> Any:
    """Strategies of a composite op (``aten.linear``, ``layer_norm``, ``softmax.int``) through
    its decomposition: each combination of input placements that propagates through the
    decomposition without a redistribution inside it is a strategy (DTensor's own decomposition
    path only tries the placements its inputs have). None when the op has no decomposition."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._decompositions import DecompShardingStrategy
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    op = node.target
    if not DecompShardingStrategy.has_decomp(op):
        return None

    def spec(a: Any) -> Any:  # contiguous strides: the decomposition's views need them
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor):
                return v
            meta = TensorMeta(v.shape, torch.empty(v.shape, device="meta").stride(), v.dtype)
            return DTensorSpec(mesh, (Replicate(),), tensor_meta=meta)
        if isinstance(a, list | tuple):
            return type(a)(spec(x) for x in a)
        return a

    decomp = DTensor._op_dispatcher.sharding_propagator.decomp_strategy
    decomp.ensure_schema_info(op)
    spec_schema = OpSchema(op, tuple(spec(a) for a in node.args), {k: spec(v) for k, v in node.kwargs.items()})
    leaves = torch.utils._pytree.tree_leaves(list(spec_schema.args_schema) + list(spec_schema.kwargs_schema.values()))
    candidates = [[Replicate(), Partial(), *(Shard(d) for d in range(x.ndim))] if isinstance(x, DTensorSpec) else [None]
                  for x in leaves]
    fake_mesh = decomp._get_fake_mesh(mesh.device_type)
    rules = []
    for combo in itertools.product(*candidates):
        try:
            out = decomp._propagate_through_decomp(spec_schema, combo, fake_mesh)
        except (RuntimeError, KeyError, IndexError, AssertionError, ValueError):
            continue  # would need a redistribution inside the decomposition
        outs = list(out) if isinstance(out, tuple | list) else [out]
        if len(outs) != n_out:
            continue
        rules.append([*outs, *(p for p in combo if p is not None)])
    if not rules:
        return None
    return expand_to_full_mesh_op_strategy(mesh, schema, rules, output_tensor_meta=out_meta, input_index=n_out)


def _normalise(strategy: Any, val: Any) -> None:
    """Give output specs their tensor meta (some strategy functions leave it out) and drop the
    strategies that shard a dimension an output does not have (``val``: a tensor, or the tuple of
    a multi-output op's tensors)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    vals = list(val) if isinstance(val, list | tuple) else [val]
    kept = []
    for spec in strategy.strategies:
        outs = spec.output_specs if isinstance(spec.output_specs, list | tuple) else [spec.output_specs]
        if len(outs) != len(vals) or any(o is None for o in outs):
            continue
        for o, v in zip(outs, vals, strict=True):
            if o.tensor_meta is None:
                o.tensor_meta = TensorMeta(v.shape, v.stride(), v.dtype)
        if all(p.dim < v.dim() for o, v in zip(outs, vals, strict=True) for p in o.placements if isinstance(p, Shard)):
            kept.append(spec)
    if not kept:
        raise ValueError("no strategy with valid outputs")
    strategy.strategies = kept


def _costs_complete(strategy: Any, inputs: list[Any]) -> None:
    """Give every option its redistribution costs from each input's strategies (some strategy
    functions leave them out) and its output's tensor meta."""
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs

    for spec in strategy.strategies:
        if spec.input_specs is not None and (spec.redistribute_cost is None
                                             or len(spec.redistribute_cost) != len(inputs)):
            spec.redistribute_cost = [generate_redistribute_costs(s, want)
                                      for s, want in zip(inputs, spec.input_specs, strict=False)]


def _sharded(spec: Any) -> bool:
    if isinstance(spec, list | tuple):
        return any(_sharded(s) for s in spec)
    return spec is not None and placement_name(spec).startswith(("S", "SS"))


def _split(spec: Any) -> bool:
    """Whether each device does ``1/N`` of the op's work: an operand or the output is sharded
    (partial sums alone do not shrink the work)."""
    outs = spec.output_specs if isinstance(spec.output_specs, list | tuple) else [spec.output_specs]
    return any(_sharded(s) for s in [*outs, *(spec.input_specs or [])])


def _nbytes(val: Any) -> int:
    if isinstance(val, list | tuple):
        return sum(_nbytes(v) for v in val)
    return val.numel() * val.element_size()


def strategy_graph(
    gm: torch.fx.GraphModule,
    mesh_size: int,
    *,
    training: bool = True,
    state_bytes_per_param_byte: float = 4.0,
    link: LinkSpec | None = None,
) -> NodeStrategies:
    """The strategy graph of ``gm`` (annotated: ``"val"`` and ``"fxsplit.cost"``) over ``mesh_size``
    devices.

    Args:
        gm: A captured, cost-annotated graph.
        mesh_size: Devices of the (1-D) mesh, ``>= 2``.
        training: Count backward redistributions and gradient all-reduces.
        state_bytes_per_param_byte: Parameters + gradients + optimizer state per parameter byte
            (Adam in fp32: 4).
        link: The mesh's links for the gradient all-reduce (default :class:`LinkSpec`).

    Returns:
        The :class:`NodeStrategies`.

    Raises:
        ConfigError: for ``mesh_size < 2`` or a graph without shapes.
    """
    if mesh_size < 2:
        raise ConfigError(f"mesh_size={mesh_size}; per-layer strategies split work over at least 2 devices")
    from torch.distributed.device_mesh import DeviceMesh

    link = link or LinkSpec()
    mesh = DeviceMesh("cpu", torch.arange(mesh_size), _init_backend=False, _rank=0)
    strategies: dict[torch.fx.Node, Any] = {}
    inputs_of: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    order: list[torch.fx.Node] = []
    fallback: list[str] = []
    items: dict[torch.fx.Node, tuple[torch.fx.Node, int]] = {}  # getitem -> (multi-output op, index)
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        tensors = isinstance(val, torch.Tensor) or (isinstance(val, list | tuple) and len(val) > 0 and all(
            isinstance(v, torch.Tensor) for v in val) and node.op == "call_function")
        if not tensors or node.op not in ("placeholder", "get_attr", "call_function"):
            continue
        if node.target is operator.getitem and node.args[0] in strategies:
            # output i of a multi-output op (chunk, split): option k of the op gives its placement
            parent, i = node.args[0], int(node.args[1])
            items[node] = (parent, i)
            strategies[node], inputs_of[node] = _item_strategy(strategies[parent], i), [parent]
        elif node.op in ("placeholder", "get_attr") or not any(a in strategies for a in node.all_input_nodes):
            strategies[node] = _all_placements(mesh, val)  # inputs, parameters, factories (arange)
        else:
            inputs = _tensor_inputs(node, strategies)
            try:
                strategy, fell_back = _op_strategy(node, mesh, strategies)
                _normalise(strategy, val)
                _costs_complete(strategy, [strategies[a] for a in inputs])
            except (AssertionError, RuntimeError, IndexError, ValueError, KeyError, NotImplementedError) as exc:
                log.info("no strategy for %s (%s), run replicated: %s", node.name, node.target, exc)
                strategy, fell_back = _replicated(mesh, val, inputs, strategies), True
            if fell_back:
                fallback.append(node.name)
            strategies[node], inputs_of[node] = strategy, inputs
        order.append(node)
    if not order:
        raise ConfigError("the graph has no tensor values with shapes; capture and annotate it first")
    outputs = {a for a in _flat(next(n for n in gm.graph.nodes if n.op == "output").args) if isinstance(a, torch.fx.Node)}
    return _assemble(order, strategies, inputs_of, outputs, items, mesh_size, training, state_bytes_per_param_byte,
                     link, tuple(fallback))


def _item_strategy(parent: Any, i: int) -> Any:
    """The options of ``getitem(op, i)``: one per option of the multi-output ``op``, its output
    ``i`` (joined to the op by an edge that only lets both take the same option)."""
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy

    return OpStrategy([OpSpec(spec.output_specs[i]) for spec in parent.strategies])


def _tensor_inputs(node: torch.fx.Node, strategies: dict[torch.fx.Node, Any]) -> list[torch.fx.Node]:
    """The node's tensor operands in the order DTensor's input specs list them."""
    flat = _flat(node.args) + _flat(tuple(node.kwargs.values()))
    return [a for a in flat if isinstance(a, torch.fx.Node) and a in strategies]


def _flat(args: Any) -> list[Any]:
    out: list[Any] = []
    for a in args:
        if isinstance(a, list | tuple):
            out.extend(_flat(a))
        else:
            out.append(a)
    return out


def _assemble(order: list[torch.fx.Node], strategies: dict[torch.fx.Node, Any],
              inputs_of: dict[torch.fx.Node, list[torch.fx.Node]], outputs: set[torch.fx.Node],
              items: dict[torch.fx.Node, tuple[torch.fx.Node, int]], n: int, training: bool, state_factor: float,
              link: LinkSpec, fallback: tuple[str, ...]) -> NodeStrategies:
    index = {node: i for i, node in enumerate(order)}
    vertices, placements = [], []
    edges: dict[tuple[int, int], list[list[float]]] = {}
    for v, node in enumerate(order):
        specs = strategies[node].strategies
        cost = node.meta.get("fxsplit.cost")
        work_s = (cost.fwd_s + (cost.bwd_s if training else 0.0)) if cost is not None else 0.0
        val = node.meta["val"]
        is_param = node.op == "get_attr" and isinstance(val, torch.Tensor) and val.requires_grad
        nbytes = _nbytes(val)
        if node in items:
            work_s = 0.0  # the op did the work
        options = []
        for k, spec in enumerate(specs):
            shards = n if _split(spec) else 1
            memory = nbytes * (state_factor if is_param else 1.0) / (n if _sharded(spec.output_specs) else 1)
            out = placement_name(spec.output_specs)
            # a model output ends whole, or split on the batch (the loss reads it there)
            finish = min(redistribute_s(out, "R", nbytes, n, link), redistribute_s(out, "S(0)", nbytes, n, link)) \
                if node in outputs else 0.0
            options.append(StrategyOption(f"{k}:{out}", work_s / shards + finish * (2.0 if training else 1.0), memory))
        vertices.append(StrategyVertex(node.name, tuple(options)))
        placements.append(tuple(placement_name(s.output_specs) for s in specs))
        inputs = inputs_of.get(node, [])
        if node in items:  # the op's option k gives this output's option k
            rows = len(strategies[inputs[0]].strategies)
            edges[index[inputs[0]], v] = [[0.0 if k == j else math.inf for j in range(len(specs))] for k in range(rows)]
            continue
        for i, src in enumerate(inputs):
            u = index[src]
            rows = len(strategies[src].strategies)
            matrix = edges.setdefault((u, v), [[0.0] * len(specs) for _ in range(rows)])
            src_names = [placement_name(s.output_specs) for s in strategies[src].strategies]
            nbytes = _nbytes(src.meta["val"])
            for j, spec in enumerate(specs):
                redistribute = spec.redistribute_cost[i] if spec.redistribute_cost else [0.0] * rows
                want = placement_name(spec.input_specs[i]) if spec.input_specs else "R"
                for k in range(rows):
                    if math.isinf(redistribute[k]):  # DTensor: no redistribution gets there
                        matrix[k][j] = math.inf
                        continue
                    matrix[k][j] += redistribute_s(src_names[k], want, nbytes, n, link) * (2.0 if training else 1.0)
                    if training and _grad_all_reduce(src, strategies[src].strategies[k], spec, i):
                        matrix[k][j] += _all_reduce_s(src.meta["val"], n, link)
    graph = StrategyGraph(tuple(vertices), tuple(StrategyEdge(u, v, tuple(map(tuple, m))) for (u, v), m in edges.items()))
    params = tuple(node.op == "get_attr" and bool(node.meta["val"].requires_grad) for node in order)
    item_of = tuple(index[items[node][0]] if node in items else -1 for node in order)
    return NodeStrategies(graph, tuple(node.name for node in order), tuple(placements), fallback, n, params, item_of)


def redistribute_s(src: str, dst: str, nbytes: float, n: int, link: LinkSpec) -> float:
    """Seconds to turn a tensor of ``nbytes`` (whole) placed ``src`` into ``dst`` over a ring of
    ``n`` devices joined by ``link`` (placement names as :func:`placement_name` gives them):
    nothing from a replica or to the same placement; all-gather ``S -> R`` and reduce-scatter
    ``P -> S``, ``(n-1)/n * bytes / bandwidth + (n-1) * latency``; all-reduce ``P -> R``, twice
    that; all-to-all ``S(i) -> S(j)``, ``(n-1)/n^2 * bytes / bandwidth + (n-1) * latency``;
    ``math.inf`` into a partial sum from a shard (no collective makes one).

    Example:
        >>> round(redistribute_s("S(0)", "R", 1e9, 4, LinkSpec(bytes_per_s=1e9, latency_s=0.0)), 3)
        0.75
    """
    if src == dst or src == "R":
        return 0.0
    steps, frac = n - 1, (n - 1) / n
    if src.startswith("P"):
        if dst == "R":
            return 2 * (frac * nbytes / link.bytes_per_s + steps * link.latency_s)
        if dst.startswith(("S", "SS")):
            return frac * nbytes / link.bytes_per_s + steps * link.latency_s
        return math.inf
    if dst == "R":
        return frac * nbytes / link.bytes_per_s + steps * link.latency_s
    if dst.startswith(("S", "SS")):
        return frac * nbytes / n / link.bytes_per_s + steps * link.latency_s
    return math.inf


def _grad_all_reduce(src: torch.fx.Node, src_spec: Any, consumer: Any, i: int) -> bool:
    """Whether a parameter read replicated by a consumer that splits its other operands gets a
    partial gradient on each device (data parallelism: summed by an all-reduce)."""
    val = src.meta["val"]
    if src.op != "get_attr" or not val.requires_grad or placement_name(src_spec.output_specs) != "R":
        return False
    others = [s for k, s in enumerate(consumer.input_specs or []) if k != i]
    return any(not placement_name(s).startswith("R") for s in others if s is not None)


def _all_reduce_s(val: torch.Tensor, n: int, link: LinkSpec) -> float:
    size = val.numel() * val.element_size()
    return 2 * (n - 1) / n * size / link.bytes_per_s + 2 * (n - 1) * link.latency_s
