"""Coarsening: merge cheap neighbouring blocks until the downsets fit a budget.

Wide graphs have many downsets: every independent little chain (a causal-mask computation, rotary
tables, the parallel Q/K/V projections) multiplies their number. When the enumeration would exceed
the budget, this pass contracts block edges ``U -> V`` where ``V`` is ``U``'s only successor or
``U`` is ``V``'s only predecessor (such a contraction never creates a cycle), cheapest pair first,
under a time cap that grows geometrically (``1e-4, 1e-3, 1e-2, ...`` of the total) until the
downset count fits. Only split points between cheap blocks are given up, so the exact DP over the
coarse graph stays close to the fine optimum; the solvers still see every block's true cost.

Torch-free: it works on a :class:`~fxsplit.ir.CondensedGraph` and returns a block mapping.

References:
    Tarnawski et al., NeurIPS 2020, §5 (contracting the graph when downsets are too many);
    PipeDream's optimizer (SOSP 2019) which plans on coarse layer graphs for the same reason.
"""

from __future__ import annotations

import logging

from fxsplit.ir.downsets import count_downsets
from fxsplit.ir.graph import CondensedGraph

__all__ = ["coarsen_blocks", "CAP_FRACTIONS", "UnionFind"]

log = logging.getLogger(__name__)

CAP_FRACTIONS = (1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)


class UnionFind:
    """Disjoint sets over ``0..n-1`` with path halving; subclasses decide how to merge."""

    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i


class _Quotient(UnionFind):
    """Block groups with their successor and predecessor groups, updated on every merge."""

    def __init__(self, graph: CondensedGraph) -> None:
        n = len(graph)
        super().__init__(n)
        self.time = [b.time_s for b in graph.blocks]
        self.succ = [set(graph.successors(b)) for b in range(n)]
        self.pred = [set(graph.predecessors(b)) for b in range(n)]

    def can_merge(self, u: int, v: int) -> bool:
        return u != v and v in self.succ[u] and (self.succ[u] == {v} or self.pred[v] == {u})

    def merge(self, u: int, v: int) -> None:
        """Fold group ``u`` into group ``v``."""
        self.parent[u] = v
        self.time[v] += self.time[u]
        for s in self.succ[u] - {v}:
            self.pred[s].discard(u)
            self.pred[s].add(v)
        for p in self.pred[u] - {v}:
            self.succ[p].discard(u)
            self.succ[p].add(v)
        self.succ[v] = (self.succ[v] | self.succ[u]) - {u, v}
        self.pred[v] = (self.pred[v] | self.pred[u]) - {u, v}
        self.succ[u], self.pred[u] = set(), set()


def _merge_under(q: _Quotient, graph: CondensedGraph, cap_s: float) -> int:
    """Contract every safe edge whose two groups together take at most ``cap_s``."""
    merged = 0
    pairs = sorted(graph.edges, key=lambda e: q.time[q.find(e.src)] + q.time[q.find(e.dst)])
    for e in pairs:
        u, v = q.find(e.src), q.find(e.dst)
        if q.can_merge(u, v) and q.time[u] + q.time[v] <= cap_s:
            q.merge(u, v)
            merged += 1
    return merged


def coarsen_blocks(graph: CondensedGraph, max_downsets: int) -> list[int] | None:
    """A mapping ``old block -> group representative`` whose quotient has at most ``max_downsets``
    downsets, or ``None`` when even the largest cap leaves too many.

    Args:
        graph: The fine block graph.
        max_downsets: The downset budget.

    Returns:
        ``[num_blocks]`` representative of each block's group (representatives are block ids of
        the fine graph; renumber them topologically), or ``None``.
    """
    total = max(graph.total_time_s, 1e-30)
    q = _Quotient(graph)
    for fraction in CAP_FRACTIONS:
        if _merge_under(q, graph, fraction * total) == 0:
            continue
        mapping = [q.find(b) for b in range(len(graph))]
        coarse = _quotient_graph(graph, mapping)
        count = count_downsets(coarse, limit=max_downsets)
        log.info("coarsen: cap %.0e of total -> %d blocks, %s downsets", fraction, len(coarse), count)
        if count is not None:
            return mapping
    return None


def _quotient_graph(graph: CondensedGraph, mapping: list[int]) -> CondensedGraph:
    """The group DAG (structure only), blocks numbered topologically, for counting downsets."""
    from fxsplit.ir.graph import Block, Edge

    reps = sorted(set(mapping))
    index = {r: i for i, r in enumerate(reps)}
    edges = {(index[mapping[e.src]], index[mapping[e.dst]]) for e in graph.edges if mapping[e.src] != mapping[e.dst]}
    order = _topo(len(reps), edges)
    pos = {g: i for i, g in enumerate(order)}
    blocks = tuple(Block(id=i, name=str(i)) for i in range(len(reps)))
    return CondensedGraph(blocks, tuple(Edge(pos[a], pos[b]) for a, b in sorted(edges)), name=graph.name)


def _topo(n: int, edges: set[tuple[int, int]]) -> list[int]:
    indeg = [0] * n
    succ: list[list[int]] = [[] for _ in range(n)]
    for a, b in edges:
        succ[a].append(b)
        indeg[b] += 1
    ready = [i for i in range(n) if indeg[i] == 0]
    order = []
    while ready:
        g = ready.pop()
        order.append(g)
        for h in succ[g]:
            indeg[h] -= 1
            if indeg[h] == 0:
                ready.append(h)
    return order
