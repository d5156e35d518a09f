"""The torch-free IR: JSON round-trips, the shared cost model, plan validation, lower bounds."""

from __future__ import annotations

import math
import pickle

import pytest
from hypothesis import given, settings
from strategies import problems

from fxsplit.errors import ConfigError, PlanError
from fxsplit.ir import (
    Block,
    CondensedGraph,
    DeviceSpec,
    Edge,
    LinkSpec,
    Plan,
    Problem,
    evaluate,
    trivial_lower_bound,
)


@settings(max_examples=30, deadline=None)
@given(problems(heterogeneous=True, device_order=None, objective=None))
def test_problem_json_round_trip(problem: Problem) -> None:
    assert Problem.from_json(problem.to_json()) == problem


@settings(max_examples=30, deadline=None)
@given(problems(objective=None))
def test_single_stage_plan_validates_and_round_trips(problem: Problem) -> None:
    plan = evaluate(problem, [list(range(len(problem.graph)))], [0])
    assert plan.lower_bound_s <= plan.objective_s + 1e-12
    assert Plan.from_json(plan.to_json()) == plan


def test_plan_stats_are_read_only_and_survive_a_json_round_trip() -> None:
    # Issue 15: stats were a mutable dict inside a frozen plan; a writer could change a plan
    # other code already held. Now they are a read-only view of the writer's copy.
    pb = Problem(CondensedGraph.chain([1.0, 2.0, 3.0]), (DeviceSpec("a"), DeviceSpec("b")))
    given = {"cp_status": "OPTIMAL", "auto": {"dp_timed_out": False}, "downsets": [1, 2]}
    plan = evaluate(pb, [[0, 1], [2]], stats=given)
    given["cp_status"] = "UNKNOWN"  # the plan holds its own copy
    assert plan.stats["cp_status"] == "OPTIMAL"
    with pytest.raises(TypeError):
        plan.stats["cp_status"] = "FEASIBLE"  # type: ignore[index]
    with pytest.raises(AttributeError):
        plan.stats.update(certified=True)  # type: ignore[attr-defined]
    data = plan.to_dict()
    assert type(data["stats"]) is dict and data["stats"] == {**given, "cp_status": "OPTIMAL"}
    again = Plan.from_json(plan.to_json())
    assert again == plan and dict(again.stats) == dict(plan.stats)
    with pytest.raises(TypeError):
        again.stats["x"] = 1  # type: ignore[index]
    more = plan.with_(stats={**plan.stats, "certified": True})
    assert more.stats["certified"] is True and "certified" not in plan.stats and more == plan  # stats not compared
    assert dict(pickle.loads(pickle.dumps(more)).stats) == dict(more.stats)


def test_evaluate_costs_communication_and_memory() -> None:
    blocks = (Block(0, "a", fwd_s=1.0, bwd_s=2.0, param_bytes=10, activation_bytes=5),
              Block(1, "b", fwd_s=1.0, bwd_s=1.0, param_bytes=10, activation_bytes=5))
    g = CondensedGraph(blocks, (Edge(0, 1, 100),))
    pb = Problem(g, (DeviceSpec("x"), DeviceSpec("y", speed=2.0)), link=LinkSpec(100.0, 0.5), microbatches=2,
                 schedule="gpipe")
    plan = evaluate(pb, [[0], [1]])
    s0, s1 = plan.stages
    assert s0.comm_s == pytest.approx(2 * (0.5 + 1.0)) and s0.compute_s == pytest.approx(3.0)
    assert s1.compute_s == pytest.approx(1.0)
    assert s0.memory_bytes == 10 * 4 + 5 * 2 + 100 and s1.memory_bytes == 10 * 4 + (5 + 100) * 2
    assert plan.bottleneck_s == pytest.approx(6.0)
    assert plan.makespan_s == pytest.approx(6.0 + 4.0 + 6.0)


def test_validate_lists_every_fault() -> None:
    g = CondensedGraph.chain([1.0, 1.0, 1.0])
    pb = Problem(g, (DeviceSpec("a"), DeviceSpec("b")))
    bad = evaluate(pb, [[1], [0, 2]])
    faults = bad.validate(pb)
    assert any("not a downset" in f for f in faults)
    with pytest.raises(PlanError):
        bad.check(pb)


def test_trivial_lower_bound() -> None:
    pb = Problem(CondensedGraph.chain([4.0, 1.0, 1.0]), (DeviceSpec("a"), DeviceSpec("b", speed=3.0)))
    assert trivial_lower_bound(pb) == pytest.approx(max(4.0 / 3.0, 6.0 / 4.0))


def test_problem_check_rejects_bad_fields() -> None:
    with pytest.raises(ConfigError, match="schedule"):
        Problem(CondensedGraph.chain([1.0]), (DeviceSpec("a"),), schedule="zb").check()


def test_infinite_link_means_free_communication() -> None:
    assert LinkSpec(math.inf, 0.0).transfer_s(10**9) == 0.0
