"""Coarsening merges cheap neighbours until the downsets fit, keeping the DAG and the costs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import condensed_graphs

from fxsplit.ir import Block, CondensedGraph, Edge
from fxsplit.ir.downsets import count_downsets
from fxsplit.passes.coarsen import _quotient_graph, coarsen_blocks


def _wide(width: int, depth: int) -> CondensedGraph:
    """``width`` independent chains of ``depth`` cheap blocks feeding one heavy block."""
    blocks, edges = [Block(0, "src", fwd_s=1.0)], []
    for _ in range(width):
        prev = 0
        for _ in range(depth):
            b = len(blocks)
            blocks.append(Block(b, f"b{b}", fwd_s=1e-6))
            edges.append(Edge(prev, b, 4))
            prev = b
        edges.append(Edge(prev, width * depth + 1, 4))
    blocks.append(Block(width * depth + 1, "sink", fwd_s=1.0))
    return CondensedGraph(tuple(blocks), tuple(edges), name="wide")


def test_wide_chains_are_merged_until_the_downsets_fit():
    g = _wide(width=6, depth=5)
    assert count_downsets(g, limit=500) is None  # 6^6 downsets and more
    mapping = coarsen_blocks(g, max_downsets=500)
    assert mapping is not None
    coarse = _quotient_graph(g, mapping)
    assert count_downsets(coarse, limit=500) is not None
    # The two heavy blocks stay apart: only cheap split points were given up.
    assert mapping[0] != mapping[len(g) - 1]


@settings(max_examples=60, deadline=None)
@given(graph=condensed_graphs(min_blocks=2, max_blocks=9), budget=st.integers(2, 40))
def test_coarsening_keeps_a_dag_and_every_block(graph, budget):
    mapping = coarsen_blocks(graph, budget)
    if mapping is None:
        return
    assert len(mapping) == len(graph)
    coarse = _quotient_graph(graph, mapping)
    assert coarse.validate() == []  # acyclic: every edge goes forward in the new order
    assert count_downsets(coarse, limit=budget) is not None
    # every merged pair was joined along an edge chain, never across unrelated blocks
    for group in set(mapping):
        members = [b for b in range(len(graph)) if mapping[b] == group]
        if len(members) > 1:
            assert any(e.src in members and e.dst in members for e in graph.edges)
