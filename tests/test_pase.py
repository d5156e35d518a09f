"""PaSE's per-layer strategy search: the DP equals brute force and CP-SAT; dependent sets; the IR."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxsplit.errors import ConfigError, InfeasibleError, SolverError
from fxsplit.ir.strategy import StrategyEdge, StrategyGraph, StrategyOption, StrategyVertex
from fxsplit.solvers.pase import (
    dependent_sets,
    elimination_order,
    order_vertices,
    solve_brute_force,
    solve_pase_cpsat,
    solve_pase_dp,
    solve_pase_elimination,
    solve_pase_lagrangian,
    solve_strategies,
)


@st.composite
def strategy_graphs(draw: st.DrawFn, max_vertices: int = 7, max_options: int = 3) -> StrategyGraph:
    """Random DAG-shaped strategy graphs: each vertex reads up to 2 of the 3 before it; costs are
    multiples of 0.5 s so ties are exact."""
    n = draw(st.integers(1, max_vertices))
    vertices = []
    for v in range(n):
        k = draw(st.integers(1, max_options))
        vertices.append(StrategyVertex(f"v{v}", tuple(
            StrategyOption(f"o{o}", draw(st.integers(0, 8)) * 0.5, draw(st.integers(0, 4)) * 100.0) for o in range(k))))
    edges = []
    for v in range(1, n):
        for u in draw(st.sets(st.integers(max(0, v - 3), v - 1), max_size=2)):
            rows, cols = len(vertices[u].options), len(vertices[v].options)
            edges.append(StrategyEdge(u, v, tuple(tuple(draw(st.sampled_from([math.inf] + [k * 0.5 for k in range(7)]))
                                                        for _ in range(cols)) for _ in range(rows))))
    return StrategyGraph(tuple(vertices), tuple(edges))


@settings(max_examples=300, deadline=None)
@given(graph=strategy_graphs())
def test_dp_finds_the_brute_force_optimum(graph: StrategyGraph) -> None:
    try:
        brute = solve_brute_force(graph)
    except InfeasibleError:  # every choice has a pair that cannot follow each other
        for reduce in (True, False):
            with pytest.raises(InfeasibleError):
                solve_pase_dp(graph, reduce=reduce)
        return
    for reduce in (True, False):
        dp = solve_pase_dp(graph, reduce=reduce)
        assert dp.cost_s == pytest.approx(brute.cost_s), reduce
        assert graph.cost_s(dp.choice) == pytest.approx(dp.cost_s)


@st.composite
def graphs_with_hubs(draw: st.DrawFn) -> StrategyGraph:
    """A strategy graph plus up to two hub vertices, each joined (either way round) to many others,
    and duplicate edges: the elimination tables then span several vertices."""
    base = draw(strategy_graphs(max_vertices=6))
    vertices, edges = list(base.vertices), list(base.edges)
    for h in range(draw(st.integers(0, 2))):
        k = draw(st.integers(1, 3))
        hub = len(vertices)
        vertices.append(StrategyVertex(f"hub{h}", tuple(StrategyOption(f"o{o}", draw(st.integers(0, 4)) * 0.5)
                                                         for o in range(k))))
        for v in draw(st.sets(st.integers(0, hub - 1), max_size=hub)):
            rows, cols = k, len(vertices[v].options)
            matrix = tuple(tuple(draw(st.integers(0, 6)) * 0.5 for _ in range(cols)) for _ in range(rows))
            edges.append(StrategyEdge(hub, v, matrix) if draw(st.booleans()) else
                         StrategyEdge(v, hub, tuple(zip(*matrix, strict=True))))
    if edges and draw(st.booleans()):
        edges.append(edges[0])
    return StrategyGraph(tuple(vertices), tuple(edges))


@settings(max_examples=300, deadline=None)
@given(graph=graphs_with_hubs())
def test_variable_elimination_finds_the_brute_force_optimum(graph: StrategyGraph) -> None:
    try:
        brute = solve_brute_force(graph)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            solve_pase_elimination(graph)
        return
    found = solve_pase_elimination(graph)
    assert found.cost_s == pytest.approx(brute.cost_s)
    assert graph.cost_s(found.choice) == pytest.approx(found.cost_s)
    assert found.max_states == elimination_order(graph)[1]  # the order's size is what is built


def test_elimination_equals_the_dp_on_layers_that_share_vertices() -> None:
    # 40 layers, each a -> {b, c} -> d, all four reading two shared tables (as every transformer
    # layer reads the rotary cos and sin): 5^162 choices; the tables hold a layer's few vertices
    # and the two shared ones
    opts = tuple(StrategyOption(f"o{k}", 1.0 + 0.1 * k) for k in range(5))
    vertices = [StrategyVertex("cos", opts), StrategyVertex("sin", opts)]
    edges: list[StrategyEdge] = []
    swap = tuple(tuple(0.0 if i == j else 0.5 for j in range(5)) for i in range(5))
    prev = None
    for layer in range(40):
        a, b, c, d = (len(vertices) + i for i in range(4))
        vertices += [StrategyVertex(f"{x}{layer}", opts) for x in "abcd"]
        edges += [StrategyEdge(a, b, swap), StrategyEdge(a, c, swap), StrategyEdge(b, d, swap), StrategyEdge(c, d, swap),
                  StrategyEdge(b, c, swap)]
        edges += [StrategyEdge(shared, x, swap) for shared in (0, 1) for x in (a, b, c, d)]
        if prev is not None:
            edges.append(StrategyEdge(prev, a, swap))
        prev = d
    graph = StrategyGraph(tuple(vertices), tuple(edges))
    found = solve_pase_elimination(graph)
    assert found.cost_s == pytest.approx(len(vertices) * 1.0) and found.max_states <= 5**5
    assert found.cost_s == pytest.approx(solve_pase_dp(graph).cost_s)


@settings(max_examples=40, deadline=None)
@given(graph=strategy_graphs(max_vertices=5), limit=st.integers(0, 1500))
def test_cpsat_with_a_memory_limit_equals_brute_force(graph: StrategyGraph, limit: int) -> None:
    try:
        brute = solve_brute_force(graph, memory_limit_bytes=limit)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            solve_pase_cpsat(graph, memory_limit_bytes=limit)
        return
    cp = solve_pase_cpsat(graph, memory_limit_bytes=limit)
    assert cp.proven and cp.memory_bytes <= limit
    assert cp.cost_s == pytest.approx(brute.cost_s)
    auto = solve_strategies(graph, memory_limit_bytes=limit)
    assert auto.cost_s == pytest.approx(brute.cost_s) and auto.memory_bytes <= limit


@settings(max_examples=150, deadline=None)
@given(graph=strategy_graphs(max_vertices=6), limit=st.integers(0, 1500))
def test_lagrangian_choices_fit_and_bracket_the_constrained_optimum(graph: StrategyGraph, limit: int) -> None:
    try:
        brute = solve_brute_force(graph, memory_limit_bytes=limit)
    except InfeasibleError:
        return  # (the relaxation may still find a choice with an infinite pair; nothing to compare)
    found = solve_pase_lagrangian(graph, limit)
    assert found.memory_bytes <= limit and graph.cost_s(found.choice) == pytest.approx(found.cost_s)
    assert found.cost_s >= brute.cost_s - 1e-9
    assert found.lower_bound_s <= brute.cost_s + 1e-9
    if found.proven:
        assert found.cost_s == pytest.approx(brute.cost_s)


def test_a_memory_limit_picks_the_lean_one_of_two_equally_fast_choices() -> None:
    # the replicated and the sharded option take the same time; only the sharded one fits
    opts = (StrategyOption("R", 1.0, 100.0), StrategyOption("S", 1.0, 10.0))
    graph = StrategyGraph(tuple(StrategyVertex(f"v{i}", opts) for i in range(3)),
                          (StrategyEdge(0, 1, ((0.0, 0.0), (0.0, 0.0))), StrategyEdge(1, 2, ((0.0, 0.0), (0.0, 0.0)))))
    free = solve_strategies(graph)
    lean = solve_strategies(graph, memory_limit_bytes=50.0)
    assert lean.cost_s == free.cost_s == 3.0 and lean.memory_bytes == 30.0 and lean.proven
    with pytest.raises(InfeasibleError, match="smallest option"):
        solve_pase_lagrangian(graph, 20.0)


def test_a_duality_gap_leaves_the_lagrangian_unproven_and_cpsat_closes_it() -> None:
    # two independent vertices, each fast-and-big or slow-and-small; the limit fits one big one:
    # every price makes both choose alike, so the relaxation cannot reach the optimum (5 s)
    opts = (StrategyOption("big", 0.0, 10.0), StrategyOption("small", 5.0, 0.0))
    graph = StrategyGraph((StrategyVertex("a", opts), StrategyVertex("b", opts)))
    relaxed = solve_pase_lagrangian(graph, 10.0)
    assert not relaxed.proven and relaxed.cost_s == 10.0
    assert relaxed.lower_bound_s == pytest.approx(5.0, abs=1e-6)
    best = solve_strategies(graph, memory_limit_bytes=10.0)
    assert best.proven and best.cost_s == 5.0 and best.memory_bytes == 10.0


@settings(max_examples=200, deadline=None)
@given(graph=strategy_graphs())
def test_dependent_sets_hold_exactly_the_placed_vertices_with_later_neighbours(graph: StrategyGraph) -> None:
    order = order_vertices(graph)
    assert sorted(order) == list(range(len(graph)))
    nbrs = graph.neighbours()
    for i, dep in enumerate(dependent_sets(graph, order)):
        later = set(order[i + 1:])
        assert set(dep) == {u for u in order[: i + 1] if nbrs[u] & later}


def test_a_chain_keeps_one_vertex_in_its_dependent_set() -> None:
    opts = tuple(StrategyOption(f"o{k}", 1.0) for k in range(4))
    chain = StrategyGraph(tuple(StrategyVertex(f"v{i}", opts) for i in range(30)),
                          tuple(StrategyEdge(i, i + 1, tuple((0.0,) * 4 for _ in range(4))) for i in range(29)))
    best = solve_pase_dp(chain, reduce=False)
    assert best.max_states == 4 and best.cost_s == 30.0
    assert solve_pase_dp(chain).cost_s == 30.0  # reduced away entirely


def test_a_table_past_the_limit_goes_to_cpsat() -> None:
    opts = tuple(StrategyOption(f"o{k}", float(k)) for k in range(3))
    # a hub read by every other vertex and read back at the end keeps all of them dependent
    n = 8
    edges = [StrategyEdge(0, i, ((0.0, 1.0, 1.0),) * 3) for i in range(1, n)]
    edges += [StrategyEdge(i, n, ((0.0, 1.0, 1.0),) * 3) for i in range(1, n)]
    graph = StrategyGraph(tuple(StrategyVertex(f"v{i}", opts) for i in range(n + 1)), tuple(edges))
    with pytest.raises(SolverError, match="max_states"):
        solve_pase_dp(graph, max_states=2, reduce=False)
    with pytest.raises(SolverError, match="max_states"):
        solve_pase_elimination(graph, max_states=2)
    assert solve_strategies(graph, max_states=2).cost_s == solve_pase_dp(graph).cost_s == 0.0


@pytest.mark.parametrize("build, match", [
    (lambda: StrategyGraph((StrategyVertex("a", ()),)), "no strategy"),
    (lambda: StrategyGraph((StrategyVertex("a", (StrategyOption("x", -1.0),)),)), ">= 0"),
    (lambda: StrategyGraph((StrategyVertex("a", (StrategyOption("x", 1.0),)),) * 2,
                           (StrategyEdge(0, 1, ((math.nan,),)),)), ">= 0 seconds"),
    (lambda: StrategyGraph((StrategyVertex("a", (StrategyOption("x", 1.0),)),), (StrategyEdge(0, 0, ((0.0,),)),)),
     "joins two"),
    (lambda: StrategyGraph((StrategyVertex("a", (StrategyOption("x", 1.0),)),) * 2, (StrategyEdge(0, 1, ((0.0, 1.0),)),)),
     "1 x 1"),
])
def test_bad_graphs_are_refused(build: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build()  # type: ignore[operator]


@settings(max_examples=50, deadline=None)
@given(graph=strategy_graphs())
def test_json_round_trip(graph: StrategyGraph) -> None:
    assert StrategyGraph.from_json(graph.to_json()) == graph


def test_cpsat_rounding_does_not_hide_small_costs_behind_a_large_unused_one() -> None:
    """Regression: costs were scaled by the largest / 2^20, so a large cost no good plan uses
    rounded the small ones to 0 or 1 unit and CP-SAT returned a plan 71 % above the optimum as
    proven."""
    opts = (StrategyOption("a", 3e-6), StrategyOption("b", 1e-6), StrategyOption("huge", 1e3))
    graph = StrategyGraph(tuple(StrategyVertex(f"v{i}", opts) for i in range(6)),
                          tuple(StrategyEdge(i, i + 1, ((0.0, 4e-7, 0.0), (4e-7, 1.5e-6, 0.0), (0.0, 0.0, 0.0)))
                                for i in range(5)))
    dp, cp = solve_pase_dp(graph), solve_pase_cpsat(graph)
    assert cp.proven and cp.cost_s == pytest.approx(dp.cost_s, rel=1e-6)


def test_restricting_options_is_solving_a_family() -> None:
    opts = (StrategyOption("a", 1.0), StrategyOption("b", 2.0))
    graph = StrategyGraph((StrategyVertex("x", opts), StrategyVertex("y", opts)), (StrategyEdge(0, 1, ((0.0, 3.0), (3.0, 0.0))),))
    assert solve_pase_dp(graph).choice == (0, 0)
    only_b = solve_pase_dp(graph.restricted({0: {1}}))
    assert only_b.choice == (1, 1) and only_b.cost_s == 4.0
    with pytest.raises(ConfigError, match="at least one"):
        graph.restricted({0: set()})
