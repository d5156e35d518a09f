"""Baselines and the registry."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from strategies import problems

from fxsplit.errors import InfeasibleError, SolverError
from fxsplit.ir import Block, CondensedGraph, DeviceSpec, Edge, Plan, Problem
from fxsplit.solvers import FunctionSolver, SolverRegistry, available_solvers, get_solver, solve
from fxsplit.solvers.baselines import block_partition, min_max_partition


def test_block_partition_matches_torchgpipe_example() -> None:
    sizes = block_partition([5, 1, 1, 1, 1, 1, 1, 1, 1], 3)
    assert sizes == [3, 3, 3]  # largest part 7 where 5 is optimal (a heuristic)


def test_min_max_partition_is_optimal_on_the_example() -> None:
    sizes = min_max_partition([5, 1, 1, 1, 1, 1, 1, 1, 1], 3)
    assert len(sizes) == 3 and sizes[0] == 1


def test_uniform_and_params_splits() -> None:
    blocks = tuple(Block(i, f"b{i}", fwd_s=1.0, param_bytes=(100 if i == 0 else 1)) for i in range(7))
    pb = Problem(CondensedGraph(blocks, tuple(Edge(i, i + 1) for i in range(6))),
                 tuple(DeviceSpec(f"d{i}") for i in range(3)))
    assert [len(s.blocks) for s in solve(pb, "uniform").stages] == [3, 2, 2]
    assert len(solve(pb, "params").stages[0].blocks) == 1


@settings(max_examples=30, deadline=None)
@given(problems(max_blocks=9, max_devices=4, heterogeneous=True, objective=None))
def test_every_baseline_plan_validates_and_is_no_better_than_dp(problem: Problem) -> None:
    best = solve(problem, "dp").objective_s
    for name in ("uniform", "params", "blockpartition", "greedy"):
        plan = solve(problem, name)  # solve() validates
        assert plan.status == "feasible" and plan.objective_s >= best * (1 - 1e-9)


def test_baseline_memory_overflow_is_infeasible() -> None:
    blocks = tuple(Block(i, f"b{i}", fwd_s=1.0, param_bytes=100) for i in range(4))
    pb = Problem(CondensedGraph(blocks), (DeviceSpec("a", memory_bytes=500), DeviceSpec("b", memory_bytes=500)))
    with pytest.raises(InfeasibleError, match="needs"):
        solve(pb, "uniform")


def test_registry_refuses_duplicates_and_unknown_names() -> None:
    reg = SolverRegistry()
    reg.register(FunctionSolver("mine", lambda pb, **_: solve(pb, "uniform")))
    with pytest.raises(SolverError, match="already registered"):
        reg.register(FunctionSolver("mine", lambda pb, **_: solve(pb, "uniform")))
    with pytest.raises(SolverError, match="unknown solver 'nope'"):
        get_solver("nope")
    pb = Problem(CondensedGraph.chain([1.0, 2.0]), (DeviceSpec("a"),))
    assert isinstance(solve(pb, "mine", registry=reg), Plan)
    assert {"auto", "dp", "cpsat", "uniform", "params", "blockpartition", "greedy"} <= set(available_solvers())


def test_data_parallel_baseline_by_hand_and_zero_1_shards_the_optimizer_state() -> None:
    """Issue 13's bench baseline: 4 devices, 2 blocks of (fwd 1 s, bwd 2 s) per micro-batch, 8
    micro-batches, 100 MB of parameters, a 1 GB/s ring: each device runs 2 micro-batches' worth
    (6 s of compute), the all-reduce moves 2 * 3/4 * 100 MB = 150 ms, hidden by the backward."""
    from fxsplit.ir import Block, CondensedGraph, DeviceSpec, LinkSpec, Problem
    from fxsplit.solvers.data_parallel import data_parallel

    blocks = tuple(Block(i, f"b{i}", fwd_s=1.0, bwd_s=2.0, param_bytes=50_000_000, activation_bytes=10_000_000)
                   for i in range(2))
    pb = Problem(CondensedGraph(blocks), tuple(DeviceSpec(f"d{i}", memory_bytes=10**9) for i in range(4)),
                 link=LinkSpec(bytes_per_s=1e9, latency_s=0.0), microbatches=8)
    plain, zero = data_parallel(pb), data_parallel(pb, zero_stage=1)
    assert plain.compute_s == pytest.approx(2 * 3.0 * 2)
    assert plain.allreduce_s == pytest.approx(0.15)
    assert plain.step_s == pytest.approx(2 * 1.0 * 2 + 2 * 2.0 * 2)  # forward + backward (all-reduce hidden)
    assert plain.memory_bytes == pytest.approx(100e6 * 4 + 2 * 10e6 * 2)  # params x (1 + grad + Adam 2) + acts
    assert zero.memory_bytes == pytest.approx(100e6 * (2 + 2 / 4) + 2 * 10e6 * 2)
    assert plain.fits and zero.fits and zero.step_s == plain.step_s
    one = data_parallel(pb.with_(devices=pb.devices[:1]))
    assert one.allreduce_s == 0.0 and one.compute_s == pytest.approx(4 * plain.compute_s)
