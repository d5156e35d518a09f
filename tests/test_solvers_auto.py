"""``auto``: picks by estimated DP work, races the DP against CP-SAT, falls back to CP-SAT on a
DP time-out; proofs of infeasibility and time-outs are told apart."""

from __future__ import annotations

import gzip
import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from strategies import problems

from fxsplit.errors import InfeasibleError, SolverError
from fxsplit.ir import Block, CondensedGraph, DeviceSpec, Problem
from fxsplit.solvers import auto, solve, solve_dp
from fxsplit.solvers.cancel import Cancel
from fxsplit.solvers.dpcore import DPCancelledError
from fxsplit.solvers.estimate import DPEstimate, estimate_dp

pytest.importorskip("ortools")

DATA = pathlib.Path(__file__).parent / "data"


def _independent(n: int, k: int) -> Problem:
    """``n`` independent blocks: ``2^n`` downsets, so the DP is slow while CP-SAT is not."""
    blocks = tuple(Block(i, f"b{i}", fwd_s=1.0 + i % 3) for i in range(n))
    return Problem(CondensedGraph(blocks, ()), tuple(DeviceSpec(f"d{i}") for i in range(k)))


def test_estimate_counts_pairs_moves_and_runs() -> None:
    est = estimate_dp(_independent(4, 2))
    assert est.downsets == 16 and est.moves == 2 and est.runs == 2
    assert est.pairs == sum(c * s for c, s in ((4, 1), (6, 5), (4, 11), (1, 15)))  # by size layer
    assert estimate_dp(_independent(4, 2).with_(objective="makespan")).runs > 2
    assert estimate_dp(_independent(4, 2), max_downsets=10).downsets is None


def test_auto_picks_cpsat_when_the_dp_estimate_exceeds_the_time() -> None:
    pb = _independent(14, 3)  # 16384 downsets: under the downset budget, seconds of DP
    assert estimate_dp(pb).seconds > 0.5 * 2.0
    plan = solve(pb, "auto", time_limit_s=2.0)
    assert plan.solver == "cpsat" and plan.stats["auto"]["dp_timed_out"] is False


def test_auto_falls_back_to_cpsat_when_dp_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # Root cause (issue 3, point 2): auto chose dp by the number of downsets alone (6485 for a
    # 70B Llama, under the 20000 budget) although 32 devices with 1F1B memory make 528 moves per
    # pair, and let dp's time-out SolverError escape. Now auto estimates the work, and when the
    # DP still times out it runs cpsat with the time left. Here the estimate is forced to lie.
    # The DP itself is too quick on any small graph now (work bands, solvers.dpcore.Bands), so its
    # clock runs out at the first check.
    from fxsplit.solvers import dpcore

    def out_of_time(cancel, deadline, done, num) -> None:
        raise dpcore.DPTimeoutError(f"dp timed out after {done}/{num} downsets (forced by the test)")

    monkeypatch.setattr(auto, "estimate_dp", lambda problem, max_downsets=None: DPEstimate(1, seconds=0.0))
    monkeypatch.setattr(dpcore, "check_stop", out_of_time)
    plan = solve(_independent(14, 3), "auto", time_limit_s=1.0)
    assert plan.solver == "cpsat" and plan.stats["auto"]["dp_timed_out"] is True
    assert plan.solve_time_s < 3.0


def test_auto_still_uses_dp_when_it_is_cheap() -> None:
    pb = Problem(CondensedGraph.chain([3.0, 1.0, 1.0, 1.0]), (DeviceSpec("a"), DeviceSpec("b")))
    assert solve(pb, "auto", time_limit_s=10).solver == "dp"
    assert solve(pb, "auto").solver == "dp"


def test_llama70b_on_32_a100_is_proven_infeasible_at_once() -> None:
    # bench/planning_memory.py --models llama-70b: 2249 blocks, 6485 downsets, 32 A100-80GB,
    # 1F1B, 8 micro-batches of batch 1 x seq 2048, fp32 with Adam. auto used to run the DP
    # (minutes) and then CP-SAT, and reported "... (or the search gave up)". It is truly
    # infeasible: params x 4 = 1028 GiB, activations 557 GiB per micro-batch, 8 in flight on
    # stages 0-24; the memory bound proves it in well under a second, with the arithmetic, before
    # auto runs a solver (the DP would take ~15 s to prove it).
    pb = Problem.from_json(gzip.decompress((DATA / "llama70b-32xa100.problem.json.gz").read_bytes()).decode())
    with pytest.raises(InfeasibleError, match=r"1027.83 GiB plus activations 557.06 GiB") as info:
        solve(pb, "auto", time_limit_s=120)
    err = info.value
    assert err.min_devices_at_least == 55
    assert "gave up" not in str(err)


def test_race_cpsat_proof_stops_the_dp() -> None:
    # 16384 downsets: the DP needs seconds, CP-SAT proves these independent blocks at once; the
    # race returns CP-SAT's optimum and the DP is stopped, not waited for.
    pb = _independent(14, 3)
    assert auto.AUTO_RACE_FROM_S < estimate_dp(pb).seconds <= auto.AUTO_DP_MAX_S
    plan = solve(pb, "auto")
    race = plan.stats["auto"]["race"]
    assert (race["winner"], race["dp"], plan.solver, plan.status) == ("cpsat", "stopped", "cpsat", "optimal")
    assert plan.objective_s == pytest.approx(solve(pb, "cpsat").objective_s)


def test_no_race_runs_the_dp_alone_where_it_would_race() -> None:
    pb = _independent(14, 3)  # CP-SAT would win the race (test_race_cpsat_proof_stops_the_dp)
    assert auto.AUTO_RACE_FROM_S < estimate_dp(pb).seconds <= 0.5 * 60
    plan = solve(pb, "auto", time_limit_s=60, race=False)
    assert plan.solver == "dp" and plan.status == "optimal" and "race" not in plan.stats.get("auto", {})


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_blocks=8, max_devices=3, objective=None, memory_mib=(8, 64)))
def test_race_finds_the_dp_optimum(problem: Problem) -> None:
    # Forced race on small problems: whichever solver proves first, the optimum is the DP's.
    try:
        expected = solve(problem, "dp")
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            auto._race(problem, 30.0, 30.0, 10**6, {}, {})
        return
    plan = auto._race(problem, 30.0, 30.0, 10**6, {}, {})
    assert plan.status == "optimal" and plan.stats["auto"]["race"]["winner"] in ("dp", "cpsat")
    assert plan.objective_s == pytest.approx(expected.objective_s, rel=1e-9, abs=1e-12)


def test_cancel_stops_the_dp_and_cpsat() -> None:
    from fxsplit.solvers.cpsat import solve_cpsat

    pb = _independent(10, 3)
    stop = Cancel()
    stop.set()
    with pytest.raises(DPCancelledError, match="another solver finished first"):
        solve_dp(pb, cancel=stop)
    with pytest.raises(SolverError, match="another solver finished first"):
        solve_cpsat(pb, cancel=stop, hint="greedy")  # stopped before its search


def test_stop_search_is_repeated_until_the_solve_returns() -> None:
    # OR-Tools ignores stop_search before its search starts: the watcher calls it until finished().
    import time

    from fxsplit.solvers.cancel import stop_search_when

    calls: list[float] = []
    stop = Cancel()
    finished = stop_search_when(stop, lambda: calls.append(time.perf_counter()), every_s=0.005)
    time.sleep(0.02)
    assert calls == []  # not set: never called
    stop.set()
    deadline = time.perf_counter() + 5.0
    while len(calls) < 2 and time.perf_counter() < deadline:
        time.sleep(0.005)
    finished()
    after = len(calls)
    time.sleep(0.02)
    assert after >= 2 and len(calls) == after
