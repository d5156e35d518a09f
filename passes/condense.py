"""Antichain condensation: from an annotated FX graph to a torch-free :class:`CondensedGraph`.

Two steps:

1. **Fold** the nodes that cost nothing (views, getitems, reshapes, placeholders, parameter
   reads) into a neighbour: a group of free nodes whose consumers all lie in one group joins it,
   else one whose producers all lie in one group joins that. Contracting an edge ``X -> Y`` where
   ``Y`` is ``X``'s only successor (or ``X`` is ``Y``'s only predecessor) never creates a cycle, so
   the quotient stays a DAG. Each group becomes a :class:`~fxsplit.ir.Block` (its costs are the
   sums of its nodes': cost is conserved) and ``node.meta["fxsplit.block"]`` is written back.
2. **Antichain DAG**: the states the solvers walk are the downsets of the block DAG; the
   frontier of a downset is an antichain, and adding one block links a state to the next.
   Enumeration is bounded by ``max_downsets`` so wide graphs (Inception, NASNet) stay fast: past
   the budget the result says so and the solvers use CP-SAT instead of the DP.

References:
    Narayanan et al., "PipeDream: generalized pipeline parallelism for DNN training", SOSP 2019,
    §3.1 and its optimizer (antichain DAG); Ju et al., "Task segmentation and parallel
    optimization of DNN model", 2024 (augmented antichains, topological state sequence).
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Any

import torch.fx

from fxsplit.ir.downsets import (
    DEFAULT_MAX_DOWNSETS,
    DownsetBudgetError,
    enumerate_downsets,
    members,
)
from fxsplit.ir.graph import Block, CondensedGraph, Edge
from fxsplit.passes.capture import writes_in_place
from fxsplit.passes.coarsen import UnionFind, coarsen_blocks
from fxsplit.passes.costs import NodeCost
from fxsplit.passes.manager import PassResult, getattr_path, require_meta

__all__ = ["Condensed", "CondenseAntichains", "condense_antichains", "fold_free_nodes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Condensed:
    """Result of :func:`condense_antichains`.

    Attributes:
        graph: Blocks in topological order with edge bytes.
        node_block: FX node name -> block id (also in ``node.meta["fxsplit.block"]``).
        downsets: The downsets as bitmasks (``[num_downsets]``, by size), or ``None`` past the budget.
        num_downsets: ``len(downsets)``, or a lower bound (``> max_downsets``) when truncated.
        truncated: True when enumeration stopped at the budget.
        fine_blocks: Blocks before coarsening (``== num_blocks`` when nothing was merged).
    """

    graph: CondensedGraph
    node_block: dict[str, int]
    downsets: tuple[int, ...] | None
    num_downsets: int
    truncated: bool
    fine_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.graph)

    def frontier(self, downset: int) -> list[int]:
        """The antichain of a downset: its blocks with no successor inside it."""
        inside = set(members(downset))
        return [b for b in inside if not any(s in inside for s in self.graph.successors(b))]

    def __repr__(self) -> str:
        more = "+" if self.truncated else ""
        merged = f" (coarsened from {self.fine_blocks})" if self.fine_blocks > self.num_blocks else ""
        return (
            f"Condensed({self.graph.name!r}: {self.num_blocks} blocks{merged}, {len(self.graph.edges)} edges, "
            f"{self.num_downsets}{more} downsets)"
        )


class _Groups(UnionFind):
    """Union-find over node indices with member lists."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.members = {i: [i] for i in range(n)}

    def union(self, a: int, b: int) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra
        if len(self.members[ra]) < len(self.members[rb]):
            ra, rb = rb, ra
        self.parent[rb] = ra
        self.members[ra] += self.members.pop(rb)
        return ra


def fold_free_nodes(nodes: list[torch.fx.Node], costs: list[NodeCost]) -> list[int]:
    """Group index of each node after folding the free nodes into their neighbours.

    Args:
        nodes: Graph nodes in order, without the output node, ``[n]``.
        costs: Their costs, ``[n]``.

    Returns:
        ``[n]`` representative index of each node's group.
    """
    index = {node: i for i, node in enumerate(nodes)}
    succ = [[index[u] for u in node.users if u in index] for node in nodes]
    pred = [[index[a] for a in node.all_input_nodes if a in index] for node in nodes]
    groups = _Groups(len(nodes))
    free = {i for i, c in enumerate(costs) if c.is_free}
    for i in range(len(nodes)):
        r = groups.find(i)
        if not all(m in free for m in groups.members[r]):
            continue
        outs = {groups.find(j) for m in groups.members[r] for j in succ[m]} - {r}
        if len(outs) == 1:
            groups.union(r, outs.pop())
            continue
        ins = {groups.find(j) for m in groups.members[r] for j in pred[m]} - {r}
        if len(ins) == 1:
            groups.union(r, ins.pop())
    _attach_in_place_chains(nodes, succ, groups)
    _attach_side_effects(nodes, succ, pred, groups)
    _attach_shared_state(nodes, succ, pred, groups)
    return [groups.find(i) for i in range(len(nodes))]


def _reaches(start: set[int], target: int, succ: list[list[int]], groups: _Groups) -> bool:
    """True when a path of group edges leads from a group in ``start`` to group ``target``."""
    seen, stack = set(start), list(start)
    while stack:
        g = stack.pop()
        if g == target:
            return True
        for m in groups.members[g]:
            for j in succ[m]:
                h = groups.find(j)
                if h not in seen:
                    seen.add(h)
                    stack.append(h)
    return False


def _attach_shared_state(nodes: list[torch.fx.Node], succ: list[list[int]], pred: list[list[int]], groups: _Groups) -> None:
    """Give a parameter or buffer read by several groups (a tied embedding, a shared mask) to the
    group of its first reader, so that reader's block owns it and the other readers are charged a
    copy (``Block.replica_param_bytes``). Merging a source into a successor is safe unless another
    successor reaches that one (checked)."""
    for i, node in enumerate(nodes):
        r = groups.find(i)
        if node.op != "get_attr" or len(groups.members[r]) != 1:
            continue
        outs = sorted({groups.find(j) for j in succ[i]} - {r}, key=lambda g: min(groups.members[g]))
        if len(outs) < 2:
            continue
        first, others = outs[0], set(outs[1:])
        if not _reaches(others, first, succ, groups):
            groups.union(r, first)


def _attach_in_place_chains(nodes: list[torch.fx.Node], succ: list[list[int]], groups: _Groups) -> None:
    """Keep an in-place chain (``add_(mul_(ema, 0.9), x)``) in one group: split between stages,
    the later op wrote into what the earlier stage sent (a copy on another device: the buffer's
    update lost), and a recomputed stage wrote into it twice. Merging the op that writes into a
    value with that value's in-place producer is safe unless another successor of the producer
    reaches the op (checked; such a chain is left as it is)."""
    index = {node: i for i, node in enumerate(nodes)}
    for i, node in enumerate(nodes):
        source = node.args[0] if writes_in_place(node) else None
        if not isinstance(source, torch.fx.Node) or not writes_in_place(source) or source not in index:
            continue
        a, b = groups.find(index[source]), groups.find(i)
        if a == b:
            continue
        others = {groups.find(j) for m in groups.members[a] for j in succ[m]} - {a, b}
        if not _reaches(others, b, succ, groups):
            groups.union(a, b)


def _attach_side_effects(nodes: list[torch.fx.Node], succ: list[list[int]], pred: list[list[int]], groups: _Groups) -> None:
    """Attach groups whose results nobody reads (in-place buffer updates such as BatchNorm's
    ``num_batches_tracked += 1``) to a neighbour, so they neither float between stages nor
    multiply the number of downsets: to their only producer group, or, when they read nothing
    but state, to the group of the next node in graph order (safe: no edge touches them)."""
    feeds_output = {i for i, node in enumerate(nodes) if any(u.op == "output" for u in node.users)}
    for i in range(len(nodes)):
        r = groups.find(i)
        mem = groups.members[r]
        if any(m in feeds_output for m in mem) or any(groups.find(j) != r for m in mem for j in succ[m]):
            continue
        ins = {groups.find(j) for m in mem for j in pred[m]} - {r}
        if len(ins) == 1:
            groups.union(r, ins.pop())
        elif not ins:
            later = [j for j in range(max(mem) + 1, len(nodes)) if groups.find(j) != r]
            earlier = [j for j in range(min(mem)) if groups.find(j) != r]
            target = later[0] if later else (earlier[-1] if earlier else None)
            if target is not None:
                groups.union(r, target)


def _topo_blocks(num_nodes: int, group: list[int], nodes: list[torch.fx.Node]) -> dict[int, int]:
    """Number the groups in a deterministic topological order (ties: earliest node first)."""
    index = {node: i for i, node in enumerate(nodes)}
    first: dict[int, int] = {}
    for i, g in enumerate(group):
        first.setdefault(g, i)
    succ: dict[int, set[int]] = {g: set() for g in first}
    indeg = {g: 0 for g in first}
    for i, node in enumerate(nodes):
        for u in node.users:
            if u in index and group[index[u]] != group[i] and group[index[u]] not in succ[group[i]]:
                succ[group[i]].add(group[index[u]])
                indeg[group[index[u]]] += 1
    heap = [(first[g], g) for g, d in indeg.items() if d == 0]
    heapq.heapify(heap)
    order: dict[int, int] = {}
    while heap:
        _, g = heapq.heappop(heap)
        order[g] = len(order)
        for h in succ[g]:
            indeg[h] -= 1
            if indeg[h] == 0:
                heapq.heappush(heap, (first[h], h))
    return order


def _value_bytes(node: torch.fx.Node, cost: NodeCost) -> int:
    return 0 if node.op == "get_attr" else cost.output_bytes


def _state_read(node: torch.fx.Node) -> list[tuple[int, int]]:
    """``(id, bytes)`` of the trainable parameters ``node`` holds (a ``get_attr``) or owns (a
    ``call_module``); by identity, since a tied tensor has a name per module."""
    gm = node.graph.owning_module
    if gm is None:
        return []
    if node.op == "get_attr":
        t = getattr_path(gm, str(node.target))
        return [(id(t), t.numel() * t.element_size())] if isinstance(t, torch.nn.Parameter) and t.requires_grad else []
    if node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        return [(id(p), p.numel() * p.element_size()) for p in sub.parameters() if p.requires_grad]
    return []


def _add_replicas(nodes: list[torch.fx.Node], costs: list[NodeCost], block_of: list[int], acc: list[dict[str, Any]]) -> None:
    """Charge each block a copy of every trainable parameter it reads that another block owns
    (owner: the block of the node whose cost counts the bytes, i.e. the first reader)."""
    index = {node: i for i, node in enumerate(nodes)}
    owner: dict[int, int] = {}
    readers: dict[int, set[int]] = {}
    size: dict[int, int] = {}
    for i, node in enumerate(nodes):
        for key, nbytes in _state_read(node):
            size[key] = nbytes
            if costs[i].param_bytes:
                owner.setdefault(key, block_of[i])
            users = [index[u] for u in node.users if u in index] if node.op == "get_attr" else [i]
            readers.setdefault(key, set()).update(block_of[u] for u in users)
    for key, blocks in readers.items():
        home = owner.get(key, min(blocks))
        for b in blocks - {home}:
            acc[b]["replica_param_bytes"] += size[key]


def _build_graph(nodes: list[torch.fx.Node], costs: list[NodeCost], block_of: list[int], name: str) -> CondensedGraph:
    n_blocks = max(block_of, default=-1) + 1
    index = {node: i for i, node in enumerate(nodes)}
    acc: list[dict[str, Any]] = [
        {"nodes": [], "name": "", "replica_param_bytes": 0, "flops": 0.0, "fwd_s": 0.0, "bwd_s": 0.0, "param_bytes": 0, "buffer_bytes": 0,
         "activation_bytes": 0, "output_bytes": 0, "fwd_fixed_s": 0.0, "bwd_fixed_s": 0.0, "bwd_weight_s": 0.0}
        for _ in range(n_blocks)
    ]
    edge_bytes: dict[tuple[int, int], int] = {}
    grad_bytes: dict[tuple[int, int], int] = {}  # of the values that get a gradient back
    for i, (node, c) in enumerate(zip(nodes, costs, strict=True)):
        a, b = acc[block_of[i]], block_of[i]
        a["nodes"].append(node.name)
        if not a["name"] and not c.is_free:
            a["name"] = node.name
        for key, value in (("flops", c.flops), ("fwd_s", c.fwd_s), ("bwd_s", c.bwd_s),
                           ("fwd_fixed_s", c.fwd_fixed_s), ("bwd_fixed_s", c.bwd_fixed_s),
                           ("bwd_weight_s", c.bwd_weight_s), ("param_bytes", c.param_bytes), ("buffer_bytes", c.buffer_bytes),
                           ("activation_bytes", c.saved_bytes)):
            a[key] += value
        consumers = {block_of[index[u]] if u in index else -1 for u in node.users} - {b}
        if consumers:  # leaves its block (-1: a graph output)
            a["output_bytes"] += _value_bytes(node, c)
        for d in consumers - {-1}:
            edge_bytes[(b, d)] = edge_bytes.get((b, d), 0) + _value_bytes(node, c)
            grad_bytes[(b, d)] = grad_bytes.get((b, d), 0) + (_value_bytes(node, c) if c.needs_grad else 0)
    _add_replicas(nodes, costs, block_of, acc)
    blocks = tuple(
        Block(id=i, name=a["name"] or a["nodes"][0], nodes=tuple(a["nodes"]), flops=a["flops"], fwd_s=a["fwd_s"],
              bwd_s=a["bwd_s"], param_bytes=a["param_bytes"], buffer_bytes=a["buffer_bytes"],
              activation_bytes=a["activation_bytes"], output_bytes=a["output_bytes"],
              replica_param_bytes=a["replica_param_bytes"], fwd_fixed_s=a["fwd_fixed_s"],
              bwd_fixed_s=a["bwd_fixed_s"], bwd_weight_s=a["bwd_weight_s"])
        for i, a in enumerate(acc)
    )
    edges = tuple(Edge(s, d, nb, None if grad_bytes[s, d] == nb else grad_bytes[s, d])
                  for (s, d), nb in sorted(edge_bytes.items()))
    return CondensedGraph(blocks=blocks, edges=edges, name=name)


@dataclass(frozen=True)
class CondenseAntichains:
    """Fold free nodes, build blocks and enumerate the downsets (see the module docstring).

    Args:
        max_downsets: Budget of the downset enumeration (the exact DP's budget by default).
        name: Name of the condensed graph.
        coarsen: Past the budget, merge cheap neighbouring blocks (:mod:`fxsplit.passes.coarsen`)
            until the downsets fit; if they never do, ``downsets`` is ``None`` and the solvers use
            CP-SAT.

    Raises:
        AnnotationError: when a node lacks ``"fxsplit.cost"`` (run ``annotate_costs`` first).
    """

    max_downsets: int = DEFAULT_MAX_DOWNSETS
    name: str = "graph"
    coarsen: bool = True
    requires: tuple[str, ...] = ("fxsplit.cost",)
    produces: tuple[str, ...] = ("fxsplit.block",)

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        nodes = [n for n in gm.graph.nodes if n.op != "output"]
        costs = [require_meta(n, "fxsplit.cost", "annotate_costs") for n in nodes]
        group = fold_free_nodes(nodes, costs)
        order = _topo_blocks(len(nodes), group, nodes)
        block_of = [order[g] for g in group]
        graph = _build_graph(nodes, costs, block_of, self.name)
        downsets, num, truncated = _downsets(graph, self.max_downsets)
        fine_blocks = len(graph)
        if truncated and self.coarsen:
            mapping = coarsen_blocks(graph, self.max_downsets)
            if mapping is not None:
                group = [mapping[b] for b in block_of]
                order = _topo_blocks(len(nodes), group, nodes)
                block_of = [order[g] for g in group]
                graph = _build_graph(nodes, costs, block_of, self.name)
                downsets, num, truncated = _downsets(graph, self.max_downsets)
        for node, b in zip(nodes, block_of, strict=True):
            node.meta["fxsplit.block"] = b
        result = Condensed(
            graph, {n.name: b for n, b in zip(nodes, block_of, strict=True)}, downsets, num, truncated, fine_blocks
        )
        log.info("condense_antichains: %d nodes -> %r", len(nodes), result)
        return PassResult(gm, modified=True, artifact=result)


def _downsets(graph: CondensedGraph, budget: int) -> tuple[tuple[int, ...] | None, int, bool]:
    try:
        downsets = tuple(enumerate_downsets(graph, budget))
    except DownsetBudgetError as exc:
        return None, exc.seen, True
    return downsets, len(downsets), False


def condense_antichains(
    gm: torch.fx.GraphModule, *, max_downsets: int = DEFAULT_MAX_DOWNSETS, name: str = "graph", coarsen: bool = True
) -> Condensed:
    """Functional form of :class:`CondenseAntichains`; returns the :class:`Condensed` result."""
    return CondenseAntichains(max_downsets, name, coarsen)(gm).artifact
