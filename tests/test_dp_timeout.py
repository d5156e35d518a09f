"""The DP cut short by its time limit once it has a plan: the best plan so far, ``feasible``, with
a proven bound; ``auto`` then gives CP-SAT the rest of the time and keeps the better plan and
the higher bound."""

from __future__ import annotations

import pytest

import fxsplit.solvers.auto as auto_mod
import fxsplit.solvers.dp as dp_mod
from fxsplit.errors import SolverError
from fxsplit.ir import Block, CondensedGraph, DeviceSpec, Edge, LinkSpec, Plan, Problem
from fxsplit.solvers import solve
from fxsplit.solvers.dpcore import DPCancelledError, DPTimeoutError

# a chain whose exact makespan takes 9 sweep runs (found by search): optimum 97
_TIMES = [7.0, 7.0, 2.0, 4.0, 6.0, 1.0, 6.0, 2.0]
_SIZES = [6, 8, 7, 5, 2, 3, 1]


def _problem() -> Problem:
    blocks = tuple(Block(i, f"b{i}", (f"b{i}",), fwd_s=t) for i, t in enumerate(_TIMES))
    g = CondensedGraph(blocks, tuple(Edge(i, i + 1, s) for i, s in enumerate(_SIZES)))
    return Problem(g, tuple(DeviceSpec(f"d{i}") for i in range(3)), link=LinkSpec(bytes_per_s=1.0, latency_s=0.5),
                   training=False, objective="makespan", microbatches=3)


def _stop_sweep_at(monkeypatch: pytest.MonkeyPatch, run: int, error: type[Exception] = DPTimeoutError) -> None:
    """The makespan sweep's ``run``-th DP (1-based) raises ``error``, as its deadline would."""
    real = dp_mod._Sweep.__call__
    calls = {"n": 0}

    def call(self: dp_mod._Sweep, cap_s: float) -> dp_mod.DPResult:
        calls["n"] += 1
        if calls["n"] >= run:
            raise error("out of time (test)")
        return real(self, cap_s)

    monkeypatch.setattr(dp_mod._Sweep, "__call__", call)


def test_the_chain_needs_several_sweep_runs() -> None:
    plan = solve(_problem(), "dp")
    assert plan.status == "optimal" and plan.objective_s == pytest.approx(97.0) and plan.stats["rounds"] == 9


@pytest.mark.parametrize("run", [1, 2, 3, 5, 8])
def test_a_sweep_cut_short_returns_its_best_plan_with_a_proven_bound(monkeypatch: pytest.MonkeyPatch, run: int) -> None:
    pb = _problem()
    optimum = solve(pb, "dp").objective_s
    _stop_sweep_at(monkeypatch, run)
    plan = solve(pb, "dp", time_limit_s=60)
    assert not plan.validate(pb)
    assert plan.lower_bound_s <= optimum + 1e-9 <= plan.objective_s + 1e-9  # a bound, and a plan, both true
    assert plan.status == ("optimal" if plan.gap <= 1e-9 else "feasible")
    if plan.status == "feasible":
        assert plan.stats["timed_out"] is True


def test_a_cancelled_sweep_still_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    _stop_sweep_at(monkeypatch, 2, DPCancelledError)  # another solver won the race: nothing to return
    with pytest.raises(DPCancelledError):
        solve(_problem(), "dp", time_limit_s=60)


def test_max_rounds_is_not_a_time_out() -> None:
    plan = solve(_problem(), "dp", max_rounds=2)
    assert plan.status == "feasible" and "timed_out" not in plan.stats


def _cut_short_dp(pb: Problem, monkeypatch: pytest.MonkeyPatch) -> Plan:
    """Make auto's DP return the plan of a sweep stopped after its first run."""
    _stop_sweep_at(monkeypatch, 2)
    cut = dp_mod.solve_dp(pb, time_limit_s=60)
    monkeypatch.undo()
    assert cut.status == "feasible" and cut.stats["timed_out"]
    monkeypatch.setattr(auto_mod, "solve_dp", lambda *a, **k: cut)
    monkeypatch.setattr(auto_mod, "AUTO_RACE_FROM_S", 1e9)  # the DP alone, whatever the estimate
    return cut


def test_auto_gives_cpsat_the_rest_and_keeps_the_better_plan_and_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    pb = _problem()
    cut = _cut_short_dp(pb, monkeypatch)
    plan = solve(pb, "auto", time_limit_s=20)
    assert plan.stats["auto"]["dp_timed_out"] is True
    assert plan.objective_s <= cut.objective_s and plan.lower_bound_s >= cut.lower_bound_s
    assert plan.status == "optimal" and plan.objective_s == pytest.approx(97.0)  # CP-SAT proves it here


def test_auto_returns_the_dp_plan_when_cpsat_finds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    pb = _problem()
    cut = _cut_short_dp(pb, monkeypatch)

    def no_plan(*args: object, **kwargs: object) -> Plan:
        raise SolverError("cpsat: no plan in time (test)")

    import fxsplit.solvers.cpsat as cpsat_mod
    monkeypatch.setattr(cpsat_mod, "solve_cpsat", no_plan)
    plan = solve(pb, "auto", time_limit_s=20)
    assert plan.objective_s == cut.objective_s and plan.lower_bound_s == cut.lower_bound_s
    assert plan.status == "feasible" and plan.stats["auto"]["dp_timed_out"] is True


def test_combined_takes_the_cheaper_plan_and_the_higher_bound() -> None:
    pb = _problem()
    base = solve(pb, "dp")
    dp_plan = base.with_(status="feasible", lower_bound_s=90.0, objective_s=99.0)
    other = base.with_(status="feasible", lower_bound_s=95.0)
    best, took = auto_mod._combined(dp_plan, other)
    assert took and best.objective_s == base.objective_s and best.lower_bound_s == 95.0 and best.status == "feasible"
    closing = base.with_(status="feasible", lower_bound_s=base.objective_s)
    best, took = auto_mod._combined(dp_plan, closing)
    assert best.status == "optimal" and best.gap == 0.0
    best, took = auto_mod._combined(base.with_(status="feasible", lower_bound_s=96.0), None)
    assert not took and best.lower_bound_s == 96.0


def test_a_tie_break_cut_short_keeps_the_optimal_bottleneck(monkeypatch: pytest.MonkeyPatch) -> None:
    pb = _problem().with_(objective="bottleneck")
    optimum = solve(pb, "dp").objective_s
    real = dp_mod.run_dp

    def run(*args: object, **kwargs: object) -> dp_mod.DPResult:
        if kwargs.get("combine") == "sum":  # the tie-break among optimal splits
            raise DPTimeoutError("out of time (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(dp_mod, "run_dp", run)
    plan = solve(pb, "dp", time_limit_s=60)
    assert plan.status == "optimal" and plan.objective_s == pytest.approx(optimum)
