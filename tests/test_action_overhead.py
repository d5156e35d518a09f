"""The runtime's own work per stage action (``Problem.action_overhead_s``) in the cost model:
every non-empty stage pays it per action, and every solver's optimum counts it (DP = brute
force = CP-SAT), so a plan weighs an extra stage against what it saves."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import problems
from test_solvers_dp import brute_force

from fxsplit.errors import ConfigError, InfeasibleError
from fxsplit.ir import CondensedGraph, DeviceSpec, LinkSpec, Problem, evaluate
from fxsplit.ir.downsets import count_downsets
from fxsplit.ir.plan import trivial_lower_bound
from fxsplit.solvers import solve

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OVERHEADS = st.sampled_from([0.05, 0.3, 1.0, 4.0])


def _devices(k: int) -> tuple[DeviceSpec, ...]:
    return tuple(DeviceSpec(f"d{i}") for i in range(k))


def test_every_nonempty_stage_pays_it_per_action() -> None:
    pb = Problem(CondensedGraph.chain([1.0, 2.0, 3.0]), _devices(2), link=LinkSpec(math.inf, 0.0),
                 action_overhead_s=0.25)
    plan = evaluate(pb, [[0, 1], [2]])
    base = evaluate(pb.with_(action_overhead_s=0.0), [[0, 1], [2]])
    for st_, b in zip(plan.stages, base.stages, strict=True):
        assert st_.fwd_s == pytest.approx(b.fwd_s + 0.25)
        assert st_.bwd_s == pytest.approx(b.bwd_s + 0.25)
    assert plan.bottleneck_s == pytest.approx(base.bottleneck_s + 0.5)
    assert plan.makespan_s == pytest.approx(base.makespan_s + 2 * 0.5)  # m = 1: both stages once
    inference = evaluate(pb.with_(training=False), [[0, 1], [2]])
    assert [s.fwd_s for s in inference.stages] == pytest.approx([b.fwd_s + 0.25 for b in base.stages])
    assert pb.stage_overhead_s() == 0.5 and pb.with_(training=False).stage_overhead_s() == 0.25


def test_a_recomputing_stage_pays_it_once_per_action() -> None:
    # recomputing runs the forward's compute inside the backward action: no third overhead
    pb = Problem(CondensedGraph.chain([1.0, 2.0]), _devices(1), recompute="all", action_overhead_s=0.25)
    st_ = evaluate(pb, [[0, 1]]).stages[0]
    base = evaluate(pb.with_(recompute="none", action_overhead_s=0.0), [[0, 1]]).stages[0]
    assert st_.recompute
    assert st_.fwd_s == pytest.approx(base.fwd_s + 0.25)
    assert st_.bwd_s == pytest.approx(base.bwd_s + base.fwd_s + 0.25)


def test_a_large_overhead_makes_fewer_stages_optimal() -> None:
    # two equal blocks, 4 micro-batches: split, 5 x (1 + 2a) against one stage's 4 x (2 + 2a);
    # past a = 1.5 the split loses (the unmodelled runtime work is what made split plans slow)
    g = CondensedGraph.chain([1.0, 1.0])
    pb = Problem(g, _devices(2), link=LinkSpec(math.inf, 0.0), objective="makespan", microbatches=4)
    assert solve(pb, "dp").num_stages == 2
    assert solve(pb.with_(action_overhead_s=1.0), "dp").objective_s == pytest.approx(5 * 3.0)
    slow = pb.with_(action_overhead_s=2.0)
    for name in ("dp", "cpsat"):
        plan = solve(slow, name)
        assert plan.num_stages == 1, name
        assert plan.objective_s == pytest.approx(4 * (2.0 + 4.0))


@SETTINGS
@given(problems(max_blocks=7, max_devices=3, objective=None, memory_mib=(8, 64), device_order=None), OVERHEADS)
def test_dp_equals_brute_force(problem: Problem, overhead: float) -> None:
    _dp_is_brute_force(problem.with_(action_overhead_s=overhead * sum(b.time_s for b in problem.graph.blocks) / 4))


def _dp_is_brute_force(pb: Problem) -> None:
    """The DP's plan is proven optimal and costs what brute force finds (small graphs only)."""
    if count_downsets(pb.graph, limit=40) is None:
        return
    expected = brute_force(pb)
    if math.isinf(expected):
        return
    plan = solve(pb, "dp")
    assert plan.status == "optimal"
    assert plan.objective_s == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert trivial_lower_bound(pb) <= expected * (1 + 1e-9)


@SETTINGS
@given(problems(max_blocks=7, max_devices=3, objective="makespan", memory_mib=(8, 64), device_order=None,
                comm=False, heterogeneous=True), OVERHEADS, st.booleans())
def test_dp_equals_brute_force_without_links(problem: Problem, overhead: float, idle: bool) -> None:
    """Without links every plan's stages add up to the graph's work plus the runtime's work of
    each stage, so the makespan DP may stop at the optimal bottleneck's plan when it meets
    ``L + (m - 1)·τ``; what it returns is still the optimum."""
    _dp_is_brute_force(problem.with_(action_overhead_s=overhead * sum(b.time_s for b in problem.graph.blocks) / 4,
                                     allow_idle_devices=idle))


def test_the_makespan_dp_stops_at_the_bottleneck_when_every_split_costs_the_same_work() -> None:
    """Four devices alike, no links, every device used: the sum of stage times is the same for
    every split, so the optimal bottleneck's plan is the optimal makespan's and no sweep runs."""
    pb = Problem(CondensedGraph.chain([1.0, 3.0, 2.0, 2.0, 1.0, 4.0, 1.0, 2.0]), _devices(4),
                 link=LinkSpec(math.inf, 0.0), objective="makespan", microbatches=4, schedule="1f1b",
                 allow_idle_devices=False, action_overhead_s=0.1)
    plan = solve(pb, "dp")
    assert plan.stats["rounds"] == 0 and plan.status == "optimal"
    assert plan.objective_s == pytest.approx(brute_force(pb), rel=1e-12)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_blocks=7, max_devices=3, heterogeneous=True, device_order=None, objective=None,
                memory_mib=(8, 64)), OVERHEADS)
def test_cpsat_equals_dp(problem: Problem, overhead: float) -> None:
    pytest.importorskip("ortools")
    pb = problem.with_(action_overhead_s=overhead * sum(b.time_s for b in problem.graph.blocks) / 4)
    try:
        expected = solve(pb, "dp").objective_s
    except InfeasibleError:  # CP-SAT on infeasible problems: test_solvers_cpsat
        return
    plan = solve(pb, "cpsat", hint=None, num_workers=2, time_limit_s=20)
    assert plan.status == "optimal"
    assert plan.objective_s == pytest.approx(expected, rel=1e-8, abs=1e-12)
    assert plan.lower_bound_s <= plan.objective_s * (1 + 1e-12)


@pytest.mark.parametrize("bad", [-1e-3, math.nan, math.inf, True, "1"])
def test_bad_overhead_is_a_config_error(bad: object) -> None:
    pb = Problem(CondensedGraph.chain([1.0]), _devices(1), action_overhead_s=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="action_overhead_s"):
        pb.check()


def test_json_round_trip_and_old_files() -> None:
    pb = Problem(CondensedGraph.chain([1.0, 2.0]), _devices(2), action_overhead_s=1.5e-4)
    assert Problem.from_json(pb.to_json()).action_overhead_s == 1.5e-4
    old = pb.to_dict()
    del old["action_overhead_s"]
    assert Problem.from_dict(old).action_overhead_s == 0.0


@settings(max_examples=40, deadline=None)
@given(times=st.lists(st.floats(0.1, 5.0), min_size=3, max_size=6), overhead=st.floats(0.0, 0.5),
       factor=st.floats(0.5, 3.0), cut=st.integers(1, 2), recompute=st.booleans())
def test_calibrate_refit_takes_the_overhead_off_before_scaling_blocks(times: list[float], overhead: float,
                                                                      factor: float, cut: int, recompute: bool) -> None:
    """A refit to measured stage times (which hold the runtime's work) re-predicts them, the
    overhead counted once: the blocks get the rest."""
    from fxsplit.calibrate import Measurement, StageTimes, refit_problem

    graph = CondensedGraph.chain(times)
    graph = CondensedGraph(tuple(b.__class__(**{**b.__dict__, "bwd_s": 2 * b.fwd_s}) for b in graph.blocks), graph.edges)
    problem = Problem(graph, _devices(2), link=LinkSpec(math.inf, 0.0), action_overhead_s=overhead,
                      recompute="all" if recompute else "none")
    stages = [list(range(cut)), list(range(cut, len(times)))]
    plan = evaluate(problem, stages)
    # the true blocks are `factor` times slower; the runtime's work is what the probe said
    truth = evaluate(problem.with_(graph=graph.with_time_factors([factor] * len(times), [factor] * len(times))), stages)
    rows = tuple(StageTimes(s, p.fwd_s, p.bwd_s, t.fwd_s, t.bwd_s) for s, (p, t) in
                 enumerate(zip(plan.stages, truth.stages, strict=True)))
    refit = refit_problem(problem, [Measurement.of(plan, rows)], 1, "gpipe")
    again = evaluate(refit, stages)
    for a, t in zip(again.stages, truth.stages, strict=True):
        assert a.fwd_s == pytest.approx(t.fwd_s, rel=1e-6)
        assert a.bwd_s == pytest.approx(t.bwd_s, rel=1e-6)
