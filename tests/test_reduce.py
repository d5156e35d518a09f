"""Exact reduction: free boundary blocks placed before the search never change the optimum."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import MiB, problems
from test_solvers_dp import _check_against_brute, brute_force

import fxsplit.solvers.reduce as reduce_mod
from fxsplit.errors import InfeasibleError
from fxsplit.ir import Block, CondensedGraph, DeviceSpec, Edge, LinkSpec, Problem
from fxsplit.ir.downsets import count_downsets
from fxsplit.ir.formats import load_pipedream
from fxsplit.solvers import solve
from fxsplit.solvers.reduce import FIRST, LAST, fold_free_blocks

PIPEDREAM = Path(__file__).parent / "data" / "pipedream"
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems_with_free_ends(draw: st.DrawFn) -> Problem:
    """Random problems whose sources and sinks are often free (no time), some also holding no
    memory and sending no bytes, so every fold rule fires; some keep a backward time (not free:
    they must stay where the search puts them)."""
    pb = draw(problems(max_blocks=8, max_devices=4, heterogeneous=True, device_order=None, objective=None,
                       memory_mib=(4, 40)))
    if pb.device_order == "fixed" and pb.num_devices > 1 and draw(st.sampled_from([True, True, True, False])):
        # a slow or small first device: a position worse than the others
        first = pb.devices[0].with_(speed=0.5, memory_bytes=draw(st.sampled_from([MiB, pb.devices[0].memory_bytes])))
        pb = pb.with_(devices=(first, *pb.devices[1:]))
    if pb.num_devices > 1 and pb.device_order == "fixed" and draw(st.booleans()):  # a slow link: a worse position
        pb = pb.with_(links=((0, 1, LinkSpec(bytes_per_s=pb.link.bytes_per_s / 8, latency_s=1.0)),))
    if draw(st.sampled_from([False, False, False, True])):  # identical devices, where fixed order folds too
        pb = pb.with_(devices=tuple(DeviceSpec(f"d{i}", memory_bytes=pb.devices[0].memory_bytes)
                                    for i in range(pb.num_devices)))
    if draw(st.sampled_from([False, False, True])):  # a device that pays no transfers (dp.cpp's CPU)
        which = draw(st.integers(0, pb.num_devices - 1))
        pb = pb.with_(devices=tuple(d.with_(comm_free=i == which) for i, d in enumerate(pb.devices)))
    g = pb.graph
    ends = [b.id for b in g.blocks if not g.predecessors(b.id) or not g.successors(b.id)]
    free = (set(ends) if draw(st.booleans()) else draw(st.sets(st.sampled_from(ends)))) if ends else set()
    blocks, no_bytes = list(g.blocks), set()
    for b in free:
        blocks[b] = replace(blocks[b], fwd_s=0.0, bwd_s=draw(st.sampled_from([0.0, 0.0, 3.0])))
        if draw(st.booleans()):
            blocks[b] = replace(blocks[b], param_bytes=0, activation_bytes=0)
            if draw(st.booleans()):
                no_bytes.add(b)
    edges = tuple(replace(e, size_bytes=0) if {e.src, e.dst} & no_bytes else e for e in g.edges)
    return pb.with_(graph=CondensedGraph(tuple(blocks), edges, name=g.name),
                    allow_idle_devices=draw(st.sampled_from([True, True, False])))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems_with_free_ends())
def test_dp_with_free_blocks_folded_equals_brute_force_over_the_original(problem: Problem) -> None:
    _check_against_brute(problem)


@SETTINGS
@given(problems_with_free_ends())
def test_reduction_places_every_block_and_keeps_the_optimum(problem: Problem) -> None:
    red = fold_free_blocks(problem)
    if red is None:
        return
    n = len(problem.graph)
    assert len(red.place) == n and red.folded == n - len(red.problem.graph) > 0
    assert all(p in (FIRST, LAST) or 0 <= p < len(red.problem.graph) for p in red.place)
    assert problem.allow_idle_devices  # every device must get a stage: never reduced
    assert problem.device_order == "free" or (
        not problem.links and len({(d.speed, d.memory_bytes, d.comm_free) for d in problem.devices}) == 1)
    assert not red.problem.graph.validate()
    folded = [b for b in range(n) if red.place[b] in (FIRST, LAST)
              or red.problem.graph.blocks[red.place[b]].name != problem.graph.blocks[b].name]
    assert all(problem.graph.blocks[b].time_s == 0 for b in folded)  # only free blocks move
    assert sum(b.time_s for b in red.problem.graph.blocks) == pytest.approx(problem.graph.total_time_s)
    try:
        direct = solve(red.problem, "dp")
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            solve(problem, "dp")
        return
    lifted = red.lift(problem, direct)
    assert not lifted.validate(problem)
    assert lifted.objective_s == pytest.approx(direct.objective_s, rel=1e-9, abs=1e-12)


def test_a_free_sink_that_holds_memory_folds_only_where_memory_cannot_bind() -> None:
    """A free sink keeping activations moves memory to its producer's stage: folded when the whole
    graph fits every device, left to the search when memory may bind."""
    blocks = (Block(0, "a", fwd_s=1.0, param_bytes=4 * MiB), Block(1, "b", fwd_s=1.0, param_bytes=4 * MiB),
              Block(2, "getitem", activation_bytes=8 * MiB))
    g = CondensedGraph(blocks, (Edge(0, 1, MiB), Edge(0, 2, MiB)))
    roomy = Problem(g, (DeviceSpec("d0", memory_bytes=10**9), DeviceSpec("d1", memory_bytes=10**9)))
    tight = roomy.with_(devices=(DeviceSpec("d0", memory_bytes=20 * MiB), DeviceSpec("d1", memory_bytes=20 * MiB)))
    red = fold_free_blocks(roomy)
    assert red is not None and red.place == (0, 1, 0)
    assert fold_free_blocks(tight) is None
    no_memory = tight.with_(graph=replace(g, blocks=(*blocks[:2], replace(blocks[2], activation_bytes=0))))
    assert fold_free_blocks(no_memory) is not None


def test_free_ends_sending_nothing_go_to_the_first_and_last_stage() -> None:
    """An input feeding two blocks and an unused output of two: no bytes, no time, no memory."""
    blocks = (Block(0, "input"), Block(1, "x", fwd_s=1.0), Block(2, "y", fwd_s=1.0), Block(3, "unused"))
    g = CondensedGraph(blocks, (Edge(0, 1), Edge(0, 2), Edge(1, 3), Edge(2, 3)))
    pb = Problem(g, (DeviceSpec("d0"), DeviceSpec("d1")), link=LinkSpec(bytes_per_s=1.0))
    red = fold_free_blocks(pb)
    assert red is not None and red.place == (FIRST, 0, 1, LAST)
    plan = solve(pb, "dp")
    assert plan.status == "optimal" and plan.bottleneck_s == pytest.approx(1.0)
    assert 0 in plan.stages[0].blocks and 3 in plan.stages[-1].blocks
    assert plan.stats["folded_blocks"] == 2


@pytest.mark.parametrize("case", ["slow first device", "slow first link", "small middle device", "comm-free middle device"])
def test_a_spacer_stage_of_free_blocks_can_help_in_fixed_order_so_it_is_not_reduced(case: str) -> None:
    """Found by review: in fixed device order a stage holding only a free block lets the real
    stages skip a slow or small device or a slow link, so folding lost the optimum (claimed
    optimal) or declared a feasible problem infeasible. Such problems are not reduced."""
    if case == "slow first device":
        g = CondensedGraph((Block(0, "F"), Block(1, "A", fwd_s=1.0)), (Edge(0, 1, 0),))
        pb = Problem(g, (DeviceSpec("slow", speed=0.5), DeviceSpec("fast")), training=False)
        best = 1.0
    elif case == "slow first link":
        g = CondensedGraph((Block(0, "F"), Block(1, "A", fwd_s=1.0), Block(2, "B", fwd_s=1.0)),
                           (Edge(0, 1, 0), Edge(1, 2, 1000)))
        pb = Problem(g, tuple(DeviceSpec(f"d{i}") for i in range(3)), link=LinkSpec(1e9, 0.0),
                     links=((0, 1, LinkSpec(bytes_per_s=100.0, latency_s=0.0)),), training=False)
        best = 1.000001
    elif case == "comm-free middle device":  # A on the CPU that pays no transfers, B after it: 5
        g = CondensedGraph((Block(0, "F"), Block(1, "A", fwd_s=4.0), Block(2, "B", fwd_s=3.0)),
                           (Edge(0, 1, 0), Edge(1, 2, 2)))
        pb = Problem(g, (DeviceSpec("acc0"), DeviceSpec("cpu", comm_free=True), DeviceSpec("acc1")),
                     link=LinkSpec(bytes_per_s=1.0, latency_s=0.0), training=False)
        best = 5.0
    else:
        g = CondensedGraph((Block(0, "A", fwd_s=1.0, param_bytes=10 * MiB), Block(1, "F"),
                            Block(2, "B", fwd_s=1.0, param_bytes=10 * MiB)), (Edge(0, 1, 0), Edge(0, 2, 0)))
        pb = Problem(g, (DeviceSpec("d0", memory_bytes=15 * MiB), DeviceSpec("d1", memory_bytes=MiB),
                         DeviceSpec("d2", memory_bytes=15 * MiB)), training=False)
        best = 1.0
    assert fold_free_blocks(pb) is None
    assert brute_force(pb) == pytest.approx(best)
    for solver in ("dp", "auto"):
        plan = solve(pb, solver)
        assert plan.status == "optimal" and plan.objective_s == pytest.approx(best), solver


def test_an_infeasible_reduced_problem_is_diagnosed_on_the_original() -> None:
    """The error names the user's blocks (the reduced graph merged them)."""
    blocks = (Block(0, "A", fwd_s=1.0, param_bytes=40 * MiB), Block(1, "unused", activation_bytes=0))
    pb = Problem(CondensedGraph(blocks, (Edge(0, 1),)), (DeviceSpec("d0", memory_bytes=8 * MiB),
                                                          DeviceSpec("d1", memory_bytes=8 * MiB)))
    assert fold_free_blocks(pb) is not None
    with pytest.raises(InfeasibleError, match="2 blocks"):
        solve(pb, "dp")


def test_every_device_busy_is_never_reduced() -> None:
    blocks = (Block(0, "x", fwd_s=1.0), Block(1, "unused"))
    pb = Problem(CondensedGraph(blocks, (Edge(0, 1),)), (DeviceSpec("d0"), DeviceSpec("d1")),
                 allow_idle_devices=False)
    assert fold_free_blocks(pb) is None
    assert [list(s.blocks) for s in solve(pb, "dp").stages] == [[0], [1]]


def test_gnmt_downsets_shrink_and_the_optimum_is_the_unreduced_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """PipeDream's GNMT graph: 4 inputs and 9 unused LSTM outputs multiply the downsets by 164."""
    g = load_pipedream(PIPEDREAM / "gnmt.txt")
    pb = Problem(g, tuple(DeviceSpec(f"d{i}", memory_bytes=2**34) for i in range(4)), microbatches=4)
    red = fold_free_blocks(pb)
    assert red is not None
    assert (count_downsets(g), count_downsets(red.problem.graph)) == (7874, 48)
    fast = solve(pb, "auto")
    monkeypatch.setattr(reduce_mod, "fold_free_blocks", lambda problem: None)
    slow = solve(pb, "dp")
    assert fast.status == slow.status == "optimal"
    assert fast.objective_s == pytest.approx(slow.objective_s, rel=1e-12)
    assert "folded_blocks" not in slow.stats and fast.stats["folded_blocks"] == 16
