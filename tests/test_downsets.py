"""Downset enumeration: complete, unique, sorted by size, budgeted."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from strategies import condensed_graphs

from fxsplit.ir import Block, CondensedGraph, Edge
from fxsplit.ir.downsets import (
    DownsetBudgetError,
    count_downsets,
    enumerate_downsets,
    mask_of,
    members,
)


def _antichain(n: int) -> CondensedGraph:
    return CondensedGraph(tuple(Block(i, f"b{i}") for i in range(n)))


def test_chain_has_n_plus_one_downsets() -> None:
    assert count_downsets(CondensedGraph.chain([1.0] * 7)) == 8


def test_antichain_has_two_to_the_n() -> None:
    assert count_downsets(_antichain(6)) == 64


def test_diamond() -> None:
    g = CondensedGraph(tuple(Block(i, f"b{i}") for i in range(4)), (Edge(0, 1), Edge(0, 2), Edge(1, 3), Edge(2, 3)))
    assert sorted(enumerate_downsets(g)) == [0b0, 0b1, 0b11, 0b101, 0b111, 0b1111]


@settings(max_examples=60, deadline=None)
@given(condensed_graphs(max_blocks=8, max_back=4, source_prob=0.3))
def test_enumeration_matches_brute_force(g: CondensedGraph) -> None:
    got = enumerate_downsets(g, max_count=None)
    expected = {m for m in range(1 << len(g)) if g.is_downset(set(members(m)))}
    assert len(got) == len(set(got)) and set(got) == expected
    sizes = [bin(m).count("1") for m in got]
    assert sizes == sorted(sizes) and got[0] == 0 and got[-1] == (1 << len(g)) - 1


def test_budget_raises_with_numbers_and_fix() -> None:
    with pytest.raises(DownsetBudgetError, match="cpsat") as info:
        enumerate_downsets(_antichain(12), max_count=100)
    assert info.value.max_count == 100 and info.value.seen > 100
    assert count_downsets(_antichain(12), limit=100) is None


def test_mask_helpers_round_trip() -> None:
    assert members(mask_of([3, 0, 5])) == [0, 3, 5] and mask_of([]) == 0
