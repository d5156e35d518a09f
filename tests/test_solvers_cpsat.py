"""CP-SAT: equal to the DP (up to its time quantum), hinted, bound and incumbent on time-out."""

from __future__ import annotations

import pytest
from fxsplit.solvers import solve
from hypothesis import HealthCheck, given, settings
from strategies import problems

from fxsplit.errors import InfeasibleError
from fxsplit.ir import Block, CondensedGraph, DeviceSpec, Edge, LinkSpec, Problem

pytest.importorskip("ortools")


def _dp_or_none(problem: Problem) -> float | None:
    try:
        return solve(problem, "dp").objective_s
    except InfeasibleError:
        return None


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_blocks=8, max_devices=3, heterogeneous=True, device_order=None, objective=None,
                memory_mib=(8, 64)))
def test_cpsat_equals_dp(problem: Problem) -> None:
    expected = _dp_or_none(problem)
    if expected is None:
        with pytest.raises(InfeasibleError):
            solve(problem, "cpsat", hint=None, num_workers=2, time_limit_s=20)
        return
    plan = solve(problem, "cpsat", hint=None, num_workers=2, time_limit_s=20)
    assert plan.status == "optimal"
    assert plan.objective_s == pytest.approx(expected, rel=1e-4, abs=1e-9)
    assert plan.lower_bound_s <= plan.objective_s


def _wide_dag(n: int) -> CondensedGraph:
    blocks = tuple(Block(i, f"b{i}", fwd_s=1.0 + (i * 37 % 11) / 10, bwd_s=2.0, output_bytes=1000)
                   for i in range(n))
    edges = tuple(Edge(i, j, 1000) for i in range(n) for j in (i + 1, i + 3) if j < n)
    return CondensedGraph(blocks, edges, name="wide")


def test_cpsat_hint_from_dp_and_optimal_status() -> None:
    pb = Problem(_wide_dag(16), tuple(DeviceSpec(f"d{i}") for i in range(3)), link=LinkSpec(1e6, 1e-4))
    plan = solve(pb, "cpsat", hint="dp", time_limit_s=20)
    assert plan.stats["hinted"] and plan.status == "optimal"
    assert plan.objective_s == pytest.approx(solve(pb, "dp").objective_s, rel=1e-4)


def test_cpsat_time_out_returns_incumbent_and_bound() -> None:
    pb = Problem(_wide_dag(60), tuple(DeviceSpec(f"d{i}") for i in range(6)), link=LinkSpec(1e6, 1e-4),
                 objective="makespan", microbatches=4)
    plan = solve(pb, "cpsat", hint="greedy", time_limit_s=0.5, num_workers=1)
    assert plan.status in ("feasible", "optimal")
    assert 0 < plan.lower_bound_s <= plan.objective_s
    assert plan.stats["cp_status"] in ("FEASIBLE", "OPTIMAL", "UNKNOWN")


def test_cpsat_infeasible_is_diagnosed() -> None:
    blocks = tuple(Block(i, f"b{i}", fwd_s=1.0, param_bytes=100) for i in range(6))
    pb = Problem(CondensedGraph(blocks, tuple(Edge(i, i + 1) for i in range(5))),
                 (DeviceSpec("a", memory_bytes=1000), DeviceSpec("b", memory_bytes=1000)))
    with pytest.raises(InfeasibleError, match="3 devices"):
        solve(pb, "cpsat", hint=None)


def test_auto_uses_cpsat_beyond_the_downset_budget() -> None:
    pb = Problem(CondensedGraph(_wide_dag(12).blocks, ()), tuple(DeviceSpec(f"d{i}") for i in range(2)))
    plan = solve(pb, "auto", max_downsets=100, time_limit_s=20)
    assert plan.solver == "cpsat" and plan.status == "optimal"
