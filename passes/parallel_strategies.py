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

import logging
import math
import operator
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from fxsplit.errors import ConfigError
from fxsplit.ir.devices import LinkSpec
from fxsplit.ir.strategy import StrategyEdge, StrategyGraph, StrategyOption, StrategyVertex
from fxsplit.passes.costs import value_bytes
from fxsplit.passes.dtensor_strategies import (
    all_placements,
    complete_costs,
    flatten_args,
    normalise,
    op_strategy,
    replicated,
    tensor_inputs,
)

__all__ = ["NodeLayout", "NodeStrategies", "is_trainable", "megatron_placements", "strategy_graph", "placement_name", "redistribute_s"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeLayout:
    """Where one node's values live: its output's placement (``"S(0)"``, ``"R"``, ``"P"``; a
    multi-output op: ``"(S(0),S(0))"``) and the placement it expects of each tensor operand, in
    the order of :attr:`NodeStrategies.inputs`."""

    output: str
    inputs: tuple[str, ...] = ()


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
        inputs: ``[num_vertices]`` the vertex's tensor operands (vertex indices) in the order
            DTensor lists them (the node's args then kwargs, depth first; a value read twice is
            listed twice).
        input_placements: ``[num_vertices][options][len(inputs)]`` the placement each option
            expects of each operand (``"R"``, ``"S(1)"``, ``"P"``), what the runtime
            redistributes an operand to before the op runs.
    """

    graph: StrategyGraph
    nodes: tuple[str, ...]
    placements: tuple[tuple[str, ...], ...]
    fallback: tuple[str, ...]
    mesh_size: int
    parameters: tuple[bool, ...] = ()
    item_of: tuple[int, ...] = ()
    inputs: tuple[tuple[int, ...], ...] = ()
    input_placements: tuple[tuple[tuple[str, ...], ...], ...] = ()

    def layout(self, choice: Sequence[int]) -> dict[str, NodeLayout]:
        """Node name -> its placements under ``choice`` (one option per vertex): what
        :class:`fxsplit.runtime.tensor_parallel.ParallelGraph` runs.

        Raises:
            ConfigError: for a choice of the wrong length or an option out of range.
        """
        if len(choice) != len(self.nodes) or any(not 0 <= c < len(p) for c, p in zip(choice, self.placements, strict=True)):
            raise ConfigError(f"choice of {len(choice)} options does not pick one option of each of the "
                              f"{len(self.nodes)} vertices")
        return {name: NodeLayout(self.placements[v][c],
                                 self.input_placements[v][c] if self.input_placements else ())
                for v, (name, c) in enumerate(zip(self.nodes, choice, strict=True))}

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

    def allowing(self, placements: Mapping[str, Collection[str]]) -> dict[int, set[int]]:
        """Vertex -> the options whose placement is in ``placements[node name]`` (for
        :meth:`~fxsplit.ir.strategy.StrategyGraph.restricted`); nodes not named are free."""
        allowed = {}
        for v, name in enumerate(self.nodes):
            if name in placements:
                allowed[v] = {k for k, p in enumerate(self.placements[v]) if p in placements[name]}
        return allowed

    def replicated_parameters(self) -> dict[str, set[str]]:
        """Every parameter replicated, the rest free: the data-parallel family."""
        return {name: {"R"} for name, is_param in zip(self.nodes, self.parameters, strict=True) if is_param}

    def _consistent(self, choice: list[int]) -> tuple[int, ...]:
        for v, parent in enumerate(self.item_of):
            if parent >= 0:
                choice[v] = choice[parent]
        return tuple(choice)


def megatron_placements(gm: torch.fx.GraphModule) -> dict[str, set[str]]:
    """Megatron-LM's tensor parallelism as placements of the parameters: the linear layers in
    graph order alternately column-split (weight ``S(0)``, bias ``S(0)``) and row-split (weight
    ``S(1)``, bias ``R``), as attention's qkv/projection and the MLP's up/down pairs are; every
    other parameter replicated (Shoeybi et al., "Megatron-LM", 2019, §3)."""
    placements: dict[str, set[str]] = {}
    column = True
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
            continue
        weight = node.args[1] if len(node.args) > 1 else None
        bias = node.args[2] if len(node.args) > 2 else None
        if isinstance(weight, torch.fx.Node) and weight.op == "get_attr" and weight.name not in placements:
            placements[weight.name] = {"S(0)" if column else "S(1)"}
            if isinstance(bias, torch.fx.Node) and bias.op == "get_attr":
                placements[bias.name] = {"S(0)" if column else "R"}
            column = not column
    for node in gm.graph.nodes:  # the rest replicated
        if is_trainable(gm, node):
            placements.setdefault(node.name, {"R"})
    return placements


def is_trainable(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether ``node`` reads a trainable parameter of ``gm`` (the module's own tensor decides:
    shape propagation may leave ``requires_grad`` out of ``node.meta["val"]``)."""
    if node.op != "get_attr":
        return False
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return isinstance(value, torch.Tensor) and value.requires_grad


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


def _sharded(spec: Any) -> bool:
    if isinstance(spec, list | tuple):
        return any(_sharded(s) for s in spec)
    return spec is not None and placement_name(spec).startswith(("S", "SS"))


def _all_replicated(spec: Any) -> bool:
    """Whether the op's output and every operand are whole on every device (it runs plain)."""
    outs = spec.output_specs if isinstance(spec.output_specs, list | tuple) else [spec.output_specs]
    return all(s is None or placement_name(s) == "R" for s in [*outs, *(spec.input_specs or [])])


def _split(spec: Any) -> bool:
    """Whether each device does ``1/N`` of the op's work: an operand or the output is sharded
    (partial sums alone do not shrink the work)."""
    outs = spec.output_specs if isinstance(spec.output_specs, list | tuple) else [spec.output_specs]
    return any(_sharded(s) for s in [*outs, *(spec.input_specs or [])])


def strategy_graph(
    gm: torch.fx.GraphModule,
    mesh_size: int,
    *,
    training: bool = True,
    state_bytes_per_param_byte: float = 4.0,
    link: LinkSpec | None = None,
    op_overhead_s: float = 0.0,
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
        op_overhead_s: Seconds of dispatch each op pays when it runs on DTensors (any operand or
            its output split or partial; an all-replicated op runs plain), in forward and twice
            in backward: what :class:`~fxsplit.runtime.tensor_parallel.ParallelGraph` pays per
            op beyond the op itself (``bench/layers.py`` measures it).

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
            strategies[node] = all_placements(mesh, val)  # inputs, parameters, factories (arange)
        else:
            inputs = tensor_inputs(node, strategies)
            try:
                strategy, fell_back = op_strategy(node, mesh, strategies)
                normalise(strategy, val)
                complete_costs(strategy, [strategies[a] for a in inputs])
            except (AssertionError, RuntimeError, IndexError, ValueError, KeyError, NotImplementedError) as exc:
                log.info("no strategy for %s (%s), run replicated: %s", node.name, node.target, exc)
                strategy, fell_back = replicated(mesh, val, inputs, strategies), True
            if fell_back:
                fallback.append(node.name)
            strategies[node], inputs_of[node] = strategy, inputs
        order.append(node)
    if not order:
        raise ConfigError("the graph has no tensor values with shapes; capture and annotate it first")
    outputs = {a for a in flatten_args(next(n for n in gm.graph.nodes if n.op == "output").args) if isinstance(a, torch.fx.Node)}
    trainable = {node for node in order if is_trainable(gm, node)}
    return _assemble(order, strategies, inputs_of, outputs, items, trainable, mesh_size, training, state_bytes_per_param_byte,
                     link, tuple(fallback), op_overhead_s)


def _item_strategy(parent: Any, i: int) -> Any:
    """The options of ``getitem(op, i)``: one per option of the multi-output ``op``, its output
    ``i`` (joined to the op by an edge that only lets both take the same option)."""
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy

    return OpStrategy([OpSpec(spec.output_specs[i]) for spec in parent.strategies])


def _assemble(order: list[torch.fx.Node], strategies: dict[torch.fx.Node, Any],
              inputs_of: dict[torch.fx.Node, list[torch.fx.Node]], outputs: set[torch.fx.Node],
              items: dict[torch.fx.Node, tuple[torch.fx.Node, int]], trainable: set[torch.fx.Node], n: int,
              training: bool, state_factor: float, link: LinkSpec, fallback: tuple[str, ...],
              op_overhead_s: float = 0.0) -> NodeStrategies:
    index = {node: i for i, node in enumerate(order)}
    vertices, placements = [], []
    wants: list[tuple[tuple[str, ...], ...]] = []
    edges: dict[tuple[int, int], list[list[float]]] = {}
    for v, node in enumerate(order):
        specs = strategies[node].strategies
        cost = node.meta.get("fxsplit.cost")
        work_s = (cost.fwd_s + (cost.bwd_s if training else 0.0)) if cost is not None else 0.0
        val = node.meta["val"]
        is_param = node in trainable
        nbytes = value_bytes(val)
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
            dispatch = 0.0 if node in items or node.op != "call_function" or _all_replicated(spec) else \
                op_overhead_s * (3.0 if training else 1.0)
            options.append(StrategyOption(f"{k}:{out}", work_s / shards + finish * (2.0 if training else 1.0) + dispatch,
                                          memory))
        vertices.append(StrategyVertex(node.name, tuple(options)))
        placements.append(tuple(placement_name(s.output_specs) for s in specs))
        inputs = inputs_of.get(node, [])
        if node in items:  # the op's option gives it; nothing to redistribute
            wants.append(((),) * len(specs))
        else:
            wants.append(tuple(tuple(placement_name(w) for w in spec.input_specs) if spec.input_specs
                               else ("R",) * len(inputs) for spec in specs))
        if node in items:  # the op's option k gives this output's option k
            rows = len(strategies[inputs[0]].strategies)
            edges[index[inputs[0]], v] = [[0.0 if k == j else math.inf for j in range(len(specs))] for k in range(rows)]
            continue
        for i, src in enumerate(inputs):
            u = index[src]
            rows = len(strategies[src].strategies)
            matrix = edges.setdefault((u, v), [[0.0] * len(specs) for _ in range(rows)])
            src_names = [placement_name(s.output_specs) for s in strategies[src].strategies]
            nbytes = value_bytes(src.meta["val"])
            for j, spec in enumerate(specs):
                redistribute = spec.redistribute_cost[i] if spec.redistribute_cost else [0.0] * rows
                want = placement_name(spec.input_specs[i]) if spec.input_specs else "R"
                for k in range(rows):
                    if math.isinf(redistribute[k]):  # DTensor: no redistribution gets there
                        matrix[k][j] = math.inf
                        continue
                    matrix[k][j] += redistribute_s(src_names[k], want, nbytes, n, link) * (2.0 if training else 1.0)
                    if training and src in trainable and _grad_all_reduce(strategies[src].strategies[k], spec, i):
                        matrix[k][j] += _all_reduce_s(src.meta["val"], n, link)
    graph = StrategyGraph(tuple(vertices), tuple(StrategyEdge(u, v, tuple(map(tuple, m))) for (u, v), m in edges.items()))
    params = tuple(node in trainable for node in order)
    item_of = tuple(index[items[node][0]] if node in items else -1 for node in order)
    operands = tuple(tuple(index[a] for a in inputs_of.get(node, [])) if node not in items else () for node in order)
    return NodeStrategies(graph, tuple(node.name for node in order), tuple(placements), fallback, n, params, item_of,
                          operands, tuple(wants))


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


def _grad_all_reduce(src_spec: Any, consumer: Any, i: int) -> bool:
    """Whether a parameter read replicated by a consumer that splits its other operands gets a
    partial gradient on each device (data parallelism: summed by an all-reduce)."""
    if placement_name(src_spec.output_specs) != "R":
        return False
    others = [s for k, s in enumerate(consumer.input_specs or []) if k != i]
    return any(not placement_name(s).startswith("R") for s in others if s is not None)


def _all_reduce_s(val: torch.Tensor, n: int, link: LinkSpec) -> float:
    size = val.numel() * val.element_size()
    return 2 * (n - 1) / n * size / link.bytes_per_s + 2 * (n - 1) * link.latency_s
