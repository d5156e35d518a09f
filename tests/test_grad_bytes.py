"""Gradients smaller than the values they flow back over (``Edge.grad_bytes``): masks, positions
and integer values cross a stage boundary forward and get no gradient back. The front end
records it, the cost model charges it, and every solver optimises it (against brute force)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from strategies import problems
from test_condense import _front_end
from test_solvers_dp import assert_solvers_equal_brute_force
from torch import nn

from fxsplit.ir import CondensedGraph, DeviceSpec, Edge, LinkSpec, Problem, evaluate
from fxsplit.ir.downsets import count_downsets, members
from fxsplit.solvers import solve
from fxsplit.solvers.tables import build_tables


@st.composite
def with_grad_bytes(draw: st.DrawFn, problem: Problem) -> Problem:
    """``problem`` with some edges' gradients drawn smaller than their values (0 to the value)."""
    edges = tuple(Edge(e.src, e.dst, e.size_bytes,
                       draw(st.one_of(st.none(), st.integers(0, e.size_bytes // 2**20).map(lambda x: x * 2**20))))
                  for e in problem.graph.edges)
    g = problem.graph
    return problem.with_(graph=CondensedGraph(g.blocks, edges, g.name), training=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_blocks=8, memory_mib=(8, 64)).flatmap(with_grad_bytes))
def test_grad_cut_of_every_downset_in_the_tables(problem: Problem) -> None:
    assume(count_downsets(problem.graph, limit=80) is not None)
    g, tb = problem.graph, build_tables(problem)
    if g.gradients_mirror:
        assert tb.grad_cut_bytes is None
        return
    assert tb.grad_cut_bytes is not None
    assert tb.grad_cut_bytes.tolist() == [g.grad_cut_bytes(set(members(m))) for m in tb.masks]
    assert np.all(tb.grad_cut_bytes <= tb.cut_bytes + 1e-9) or any(
        e.grad_bytes is not None and e.grad_bytes > e.size_bytes for e in g.edges)
    flipped = tb.flipped()
    assert flipped.grad_cut_bytes is not None and flipped.grad_cut_bytes.tolist() == tb.grad_cut_bytes[::-1].tolist()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_blocks=7, max_devices=4, heterogeneous=True, device_order=None, objective=None,
                memory_mib=(8, 64)).flatmap(with_grad_bytes))
def test_dp_cpsat_and_auto_equal_brute_force_with_smaller_gradients(problem: Problem) -> None:
    assert_solvers_equal_brute_force(problem)


def test_a_boundary_pays_the_values_forward_and_their_gradients_back() -> None:
    g = CondensedGraph.chain([1.0, 1.0])
    link = LinkSpec(bytes_per_s=1.0, latency_s=0.5)
    devices = (DeviceSpec("a"), DeviceSpec("b"))

    def comm(grad: int | None, training: bool = True) -> list[float]:
        graph = CondensedGraph(g.blocks, (Edge(0, 1, 4, grad),))
        return [st.comm_s for st in evaluate(Problem(graph, devices, link=link, training=training), [[0], [1]],
                                             [0, 1]).stages]

    assert comm(None) == [9.0, 9.0]  # (0.5 + 4) forward, the same back
    assert comm(1) == [6.0, 6.0]  # 4.5 forward, 1.5 back
    assert comm(0) == [4.5, 4.5]  # nothing comes back: no message, no latency
    assert comm(0, training=False) == comm(None, training=False) == [4.5, 4.5]


def test_grad_bytes_survive_json_scaling_and_reduction() -> None:
    g = CondensedGraph.chain([1.0, 1.0, 1.0])
    g = CondensedGraph(g.blocks, (Edge(0, 1, 8, 2), Edge(1, 2, 8)))
    assert [e.grad_bytes for e in CondensedGraph.from_json(g.to_json()).edges] == [2, None]
    assert "grad_bytes" not in g.to_dict()["edges"][1]
    assert [e.grad_bytes for e in g.scaled(0.5).edges] == [1, None]
    assert g.grad_cut_bytes({0}) == 2 and g.cut_bytes({0}) == 8 and g.grad_cut_bytes({0, 1}) == 8
    bad = CondensedGraph(g.blocks, (Edge(0, 1, 8, -1),))
    assert any("grad_bytes=-1" in f for f in bad.validate())


class _MaskAcross(nn.Module):
    """A float value, a boolean mask and integer positions made early and read late."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        mask = x > 0
        pos = torch.arange(x.shape[1]).expand_as(x)
        y = self.b(torch.relu(h))
        return self.c(y.masked_fill(mask, 0.0) + pos.to(y.dtype) + h)


@pytest.mark.parametrize("method", ["export", "symbolic_trace"])
def test_the_front_end_sends_no_gradient_back_for_masks_and_integers(method: str) -> None:
    _, condensed = _front_end(_MaskAcross(), (torch.randn(4, 8),), method)
    g = condensed.graph
    smaller = [e for e in g.edges if e.grad_bytes is not None]
    assert smaller, g.edges
    for e in smaller:
        assert 0 <= e.grad_bytes < e.size_bytes
    # everything leaving the first blocks: the float activations come back, mask and positions do not
    whole = set(range(len(g)))
    for cut in range(1, len(g)):
        down = set(range(cut))
        assert g.grad_cut_bytes(down) <= g.cut_bytes(down)
    assert any(g.grad_cut_bytes(set(range(cut))) < g.cut_bytes(set(range(cut))) for cut in range(1, len(g)))
    assert g.grad_cut_bytes(whole) == g.cut_bytes(whole) == 0


def test_the_solvers_prefer_the_cut_whose_gradients_are_cheaper() -> None:
    # cut after block 0: 4 bytes forward, none back (8 bytes both ways if gradients mirrored);
    # cut after block 1: 1 forward, 2 back -> the second cut is optimal (5 s) only when each
    # direction is charged its own bytes once
    blocks = CondensedGraph.chain([1.0, 1.0, 1.0]).blocks
    g = CondensedGraph(blocks, (Edge(0, 1, 4, 0), Edge(1, 2, 1, 2)))
    pb = Problem(g, (DeviceSpec("a"), DeviceSpec("b")), link=LinkSpec(1.0, 0.0), training=True,
                 allow_idle_devices=False)
    for solver in ("dp", "cpsat", "auto"):
        plan = solve(pb, solver)
        assert plan.objective_s == pytest.approx(5.0) and [st.blocks for st in plan.stages] == [(0, 1), (2,)], solver
    mirrored = pb.with_(graph=CondensedGraph(blocks, (Edge(0, 1, 4), Edge(1, 2, 1))))
    assert solve(mirrored, "dp").objective_s == pytest.approx(4.0)  # 1 + 1 forward and back, both cuts


def test_the_simulator_puts_the_gradients_part_of_comm_on_the_backward() -> None:
    from fxsplit.schedule.simulate import simulate_plan

    blocks = CondensedGraph.chain([1.0, 1.0]).blocks
    link = LinkSpec(bytes_per_s=1.0, latency_s=0.0)
    devices = (DeviceSpec("a"), DeviceSpec("b"))
    for grad, back in ((0, 0.0), (2, 2.0), (None, 4.0)):
        pb = Problem(CondensedGraph(blocks, (Edge(0, 1, 4, grad),)), devices, link=link, training=True)
        plan = evaluate(pb, [[0], [1]], [0, 1])
        assert plan.stages[0].backward_comm_s == pytest.approx(back)
        spans = {(e.action.kind, e.action.stage): e.end_s - e.start_s for e in simulate_plan(plan).events
                 if e.action.microbatch == 0}
        assert spans[("F", 0)] == pytest.approx(1.0 + 4.0)  # the values always go forward
        assert spans[("B", 0)] == pytest.approx(back)  # blocks have no backward time of their own
