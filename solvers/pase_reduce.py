"""Exact reductions of a strategy graph before PaSE's DP: fold leaves, bridge chains (torch-free).

Most vertices of a graph of aten ops have one or two neighbours: a parameter read by one op, a
view between two ops. Such a vertex can be removed without losing the optimum (variable
elimination of a pairwise cost function):

* a vertex with no neighbour takes its cheapest option;
* a *leaf* ``u`` with one neighbour ``v`` adds ``min_i cost(u, i) + edge(u, v)[i][j]`` to each
  option ``j`` of ``v``;
* a *link* ``u`` between ``a`` and ``b`` becomes an edge ``a - b`` with
  ``min_j edge(a, u)[i][j] + cost(u, j) + edge(u, b)[j][k]`` (added to an existing ``a - b`` edge).

Repeated until every vertex left has three or more neighbours, the DP runs on what is left, and
the removed vertices take their recorded best options in reverse order. Memory is not tracked by
the reductions: with a memory limit the full graph goes to CP-SAT.

Example:
    >>> from fxsplit.ir.strategy import StrategyEdge, StrategyGraph, StrategyOption, StrategyVertex
    >>> opts = (StrategyOption("a", 1.0), StrategyOption("b", 2.0))
    >>> chain = StrategyGraph(tuple(StrategyVertex(f"v{i}", opts) for i in range(4)),
    ...                       tuple(StrategyEdge(i, i + 1, ((0.0, 5.0), (5.0, 0.0))) for i in range(3)))
    >>> reduced = reduce_graph(chain)
    >>> len(reduced.graph), reduced.expand({})
    (0, (0, 0, 0, 0))

References:
    Dechter, "Bucket elimination: a unifying framework for reasoning", Artificial Intelligence
    113, 1999 (variable elimination); PaSE (Elango, IPDPS 2021) for the DP that runs after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fxsplit.ir.strategy import StrategyEdge, StrategyGraph, StrategyOption, StrategyVertex

__all__ = ["ReducedGraph", "reduce_graph"]

Matrix = list[list[float]]
Record = tuple[Any, ...]
"""An elimination, to undo in :meth:`ReducedGraph.expand`: ``("free", u, option)``,
``("leaf", u, w, best option of u per option of w)`` or ``("link", u, w1, w2, best option of u per
pair)``."""


@dataclass
class ReducedGraph:
    """What is left after the reductions, and how to put the removed vertices back.

    Attributes:
        graph: The vertices with three or more neighbours (options' ``compute_s`` include what
            the removed neighbours cost), their edges.
        kept: ``[len(graph)]`` the original index of each vertex left.
    """

    graph: StrategyGraph
    kept: tuple[int, ...]
    num_vertices: int
    _records: list[Record] = field(default_factory=list, repr=False)

    def expand(self, choice: Mapping[int, int]) -> tuple[int, ...]:
        """The choice of every original vertex from ``choice`` (reduced index -> option)."""
        full: dict[int, int] = {self.kept[r]: o for r, o in choice.items()}
        for record in reversed(self._records):
            kind, u = record[0], record[1]
            if kind == "free":
                full[u] = record[2]
            elif kind == "leaf":
                full[u] = record[3][full[record[2]]]
            else:
                full[u] = record[4][full[record[2]]][full[record[3]]]
        return tuple(full[v] for v in range(self.num_vertices))


def _argmin(values: list[float]) -> tuple[float, int]:
    best = min(range(len(values)), key=lambda i: (values[i], i))
    return values[best], best


def reduce_graph(graph: StrategyGraph) -> ReducedGraph:
    """Remove every vertex with at most two neighbours, exactly (see the module docstring)."""
    cost = [[o.compute_s for o in v.options] for v in graph.vertices]
    edges: dict[tuple[int, int], Matrix] = {}
    for e in graph.edges:  # parallel edges add up; stored with the smaller index first
        a, b = sorted((e.src, e.dst))
        m = [list(r) for r in e.cost_s] if a == e.src else [list(c) for c in zip(*e.cost_s, strict=True)]
        if (a, b) in edges:
            edges[a, b] = [[x + y for x, y in zip(r, s, strict=True)] for r, s in zip(edges[a, b], m, strict=True)]
        else:
            edges[a, b] = m
    nbrs: list[set[int]] = [set() for _ in graph.vertices]
    for a, b in edges:
        nbrs[a].add(b)
        nbrs[b].add(a)
    records: list[Record] = []
    alive = set(range(len(graph)))
    todo = [v for v in range(len(graph)) if len(nbrs[v]) <= 2]
    while todo:
        u = todo.pop()
        if u not in alive or len(nbrs[u]) > 2:
            continue
        alive.discard(u)
        touched = _eliminate(u, cost, edges, nbrs, records)
        todo.extend(w for w in touched if len(nbrs[w]) <= 2)
    kept = tuple(sorted(alive))
    index = {v: i for i, v in enumerate(kept)}
    vertices = tuple(StrategyVertex(graph.vertices[v].name, tuple(
        StrategyOption(o.name, c, o.memory_bytes) for o, c in zip(graph.vertices[v].options, cost[v], strict=True)))
        for v in kept)
    reduced = tuple(StrategyEdge(index[a], index[b], tuple(map(tuple, m))) for (a, b), m in edges.items())
    return ReducedGraph(StrategyGraph(vertices, reduced), kept, len(graph), records)


def _matrix(edges: dict[tuple[int, int], Matrix], u: int, v: int) -> Matrix:
    """The edge's matrix with ``u``'s options as rows; removes the edge."""
    if (u, v) in edges:
        return edges.pop((u, v))
    return [list(c) for c in zip(*edges.pop((v, u)), strict=True)]


def _eliminate(u: int, cost: list[list[float]], edges: dict[tuple[int, int], Matrix], nbrs: list[set[int]],
               records: list[Record]) -> list[int]:
    """Remove ``u`` (at most two neighbours); return the neighbours whose degree changed."""
    around = sorted(nbrs[u])
    for w in around:
        nbrs[w].discard(u)
    nbrs[u].clear()
    if not around:
        records.append(("free", u, _argmin(cost[u])[1]))
        return []
    if len(around) == 1:
        (v,) = around
        m = _matrix(edges, u, v)
        best = [_argmin([cost[u][i] + m[i][j] for i in range(len(cost[u]))]) for j in range(len(cost[v]))]
        cost[v] = [c + b for c, (b, _) in zip(cost[v], best, strict=True)]
        records.append(("leaf", u, v, [i for _, i in best]))
        return [v]
    a, b = around
    ma, mb = _matrix(edges, a, u), _matrix(edges, u, b)
    table = [[_argmin([ma[i][j] + cost[u][j] + mb[j][k] for j in range(len(cost[u]))]) for k in range(len(cost[b]))]
             for i in range(len(cost[a]))]
    bridge = [[v for v, _ in row] for row in table]
    if (a, b) in edges:
        edges[a, b] = [[x + y for x, y in zip(r, s, strict=True)] for r, s in zip(edges[a, b], bridge, strict=True)]
    else:
        edges[a, b] = bridge
        nbrs[a].add(b)
        nbrs[b].add(a)
    records.append(("link", u, a, b, [[j for _, j in row] for row in table]))
    return [a, b]
