"""Several stages per device (interleaved 1F1B): plans, solvers, the schedule search and the local runtime."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from strategies import problems

import fxsplit
import fxsplit.models as zoo
from fxsplit.api import CompileOptions
from fxsplit.errors import ConfigError, InfeasibleError
from fxsplit.ir import CondensedGraph, DeviceSpec, Problem, evaluate
from fxsplit.schedule import explore, peak_in_flight, plan_step_s, simulate_plan
from fxsplit.solvers import solve
from fxsplit.solvers.looped import chunk_problem

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _looped(problem: Problem, v: int) -> Problem:
    return problem.with_(schedule="interleaved-1f1b", stages_per_device=v)


@SETTINGS
@given(problem=problems(max_blocks=9, max_devices=3, heterogeneous=True, memory_mib=(4, 64)),
       v=st.integers(2, 3))
def test_dp_and_cpsat_agree_on_looping_placements(problem, v):
    """Differential: the exact DP and CP-SAT find the same optimum on the chunk problem, and the
    plan (validated by ``solve``) puts stage ``s`` on the ``s mod p``-th device, with every
    device's stages fitting its memory together."""
    pb = _looped(problem.with_(device_order="fixed"), v)
    assume(len(pb.graph) >= v * pb.num_devices)
    try:
        dp = solve(pb, "dp")
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            solve(pb, "cpsat")
        return
    cp = solve(pb, "cpsat")
    assert cp.objective_s == pytest.approx(dp.objective_s, rel=1e-6, abs=1e-12)
    p = pb.num_devices
    for plan in (dp, cp):
        assert plan.num_stages == v * p and plan.num_ranks == p
        assert [st.device for st in plan.stages] == [s % p for s in range(v * p)]
        for d in range(p):
            assert sum(st.memory_bytes for st in plan.stages if st.device == d) <= pb.devices[d].memory_bytes
        assert plan.objective_s == pytest.approx(solve(chunk_problem(pb), "dp").objective_s, rel=1e-9)


def test_a_device_runs_several_stages_only_when_looped():
    pb = Problem(CondensedGraph.chain([1.0] * 4), (DeviceSpec("a"), DeviceSpec("b")))
    stages = [[0], [1], [2], [3]]
    assert any("a device runs two stages" in f for f in evaluate(pb, stages, [0, 1, 0, 1]).validate(pb))
    looped = pb.with_(schedule="interleaved-1f1b")
    assert evaluate(looped, stages, [0, 1, 0, 1]).validate(looped) == []
    faults = evaluate(looped, stages, [0, 1, 1, 0]).validate(looped)
    assert any("looping placement" in f for f in faults), faults
    with pytest.raises(ConfigError, match="stages_per_device=2 needs a schedule"):
        pb.with_(stages_per_device=2).check()


def test_too_few_blocks_for_the_chunks_is_infeasible():
    pb = _looped(Problem(CondensedGraph.chain([1.0] * 3), (DeviceSpec("a"), DeviceSpec("b"))), 2)
    with pytest.raises(InfeasibleError, match="need 4 blocks; the graph has 3"):
        solve(pb, "dp")


def test_explore_sizes_each_device_by_its_stages_in_flight():
    """A device holding two chunks needs both chunks' state and each chunk's activations times
    the micro-batches that chunk holds at once under the interleaved order."""
    graph = CondensedGraph.chain([1.0] * 8)
    graph = replace(graph, blocks=tuple(replace(b, activation_bytes=1000 * (i + 1)) for i, b in enumerate(graph.blocks)))
    pb = Problem(graph, (DeviceSpec("a"), DeviceSpec("b")), schedule="interleaved-1f1b")
    stages, devs = [[0, 1], [2, 3], [4, 5], [6, 7]], [0, 1, 0, 1]
    choice = explore(pb, stages, devs, batch_size=4, schedules=["interleaved-1f1b"], microbatch_candidates=[4],
                     looped=(stages, devs))
    (cand,) = choice.table_of_candidates
    flight = peak_in_flight(choice.schedule)
    plan = choice.plan
    per_stage = [st.memory_bytes - (sum(graph.scaled(0.25).blocks[b].activation_bytes for b in blocks) + st.in_bytes) * (4 - n)
                 for blocks, st, n in zip(stages, plan.stages, flight, strict=True)]
    assert cand.rank_stages == ((0, 2), (1, 3))
    assert cand.memory_bytes == (per_stage[0] + per_stage[2], per_stage[1] + per_stage[3])
    assert flight[0] > flight[2]  # the first chunk holds more micro-batches than the later one
    assert choice.step_time_s == pytest.approx(simulate_plan(plan).makespan_s) == pytest.approx(plan_step_s(plan))


@pytest.fixture(scope="module")
def gpt_case():
    return zoo.get("gpt", size="tiny", batch_size=8)


@pytest.mark.parametrize("executor", ["sequential", "threads"])
def test_interleaved_pipeline_computes_what_the_model_computes(gpt_case, executor):
    """Transparency: a tied-embedding GPT on 2 devices x 2 stages each, interleaved 1F1B: same
    output, loss, every gradient and state_dict keys as the unsplit model."""
    torch.manual_seed(0)
    model = copy.deepcopy(gpt_case.model)
    reference = copy.deepcopy(model)
    pipe = fxsplit.compile(model, ["cpu", "cpu"], gpt_case.example_inputs, schedule="interleaved-1f1b",
                           microbatches=4, cost_model="analytic", options=CompileOptions(executor=executor))
    assert pipe.schedule_kind == "interleaved-1f1b" and pipe.num_stages == 4
    assert [st.device for st in pipe.plan.stages] == [0, 1, 0, 1]
    assert pipe.schedule.stage_to_rank == (0, 1, 0, 1)
    inputs, target = gpt_case.make_batch(8, 3)
    loss = pipe.train_step(*inputs, target=target, loss_fn=gpt_case.loss_fn)
    ref_loss = gpt_case.loss_fn(reference(*inputs), target)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    assert list(pipe.state_dict()) == list(reference.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(pipe(*inputs), reference(*inputs), rtol=1e-5, atol=1e-6)


def test_interleaved_needs_the_blocks(gpt_case):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    with pytest.raises((ConfigError, InfeasibleError), match="stages"):
        fxsplit.compile(model, ["cpu"] * 4, (torch.randn(8, 4),), schedule="interleaved-1f1b", cost_model="analytic")


def test_calibrate_judges_an_interleaved_plan_by_its_own_schedule(gpt_case):
    """calibrate on a looped plan: stage times measured per chunk, the plan re-solved (the auto
    search weighs interleaving again), the step predicted by simulation; nothing is trained."""
    torch.manual_seed(0)
    model = copy.deepcopy(gpt_case.model)
    reference = copy.deepcopy(model)
    pipe = fxsplit.compile(model, ["cpu", "cpu"], gpt_case.example_inputs, schedule="interleaved-1f1b",
                           microbatches=4, cost_model="analytic")
    inputs, target = gpt_case.make_batch(8, 1)
    report = pipe.calibrate(*inputs, target=target, loss_fn=gpt_case.loss_fn, steps=1, rounds=1)
    assert len(report.before) == 4 and all(r.meas_fwd_s > 0 and r.meas_bwd_s > 0 for r in report.before)
    assert pipe.schedule_kind == "interleaved-1f1b" and pipe.plan.num_ranks == 2
    with torch.no_grad():
        torch.testing.assert_close(pipe(*inputs), reference(*inputs), rtol=1e-5, atol=1e-6)


def test_the_distributed_runtime_checks_the_stage_count_of_an_interleaved_plan():
    """Under interleaved 1F1B rank r of R runs stages r, r + R, ...: a plan's stage count must be
    a multiple of R, at least 2R; one stage per rank is 1F1B's plan."""
    from fxsplit.distributed import _check_args

    _check_args("interleaved-1f1b", 4, 2, 4)
    _check_args("interleaved-1f1b", 4, 2, 6)
    with pytest.raises(ConfigError, match="multiple of 2"):
        _check_args("interleaved-1f1b", 4, 2, 5)
    with pytest.raises(ConfigError, match="stages_per_device >= 2"):
        _check_args("interleaved-1f1b", 4, 2, 2)
    with pytest.raises(ConfigError, match="rank i runs stage i"):
        _check_args("1f1b", 4, 2, 4)


def test_the_winning_looped_schedule_runs_on_the_looping_placement():
    """Regression: with two looped kinds under ``auto``, the winner that was not the first looped
    kind was solved again on the one-stage-per-device problem (interleaved zero-bubble won and ran
    3 stages on 3 devices, its step simulated on 6)."""
    from fxsplit.compiler import plan_pipeline

    graph = CondensedGraph(tuple(replace(b, bwd_s=2.0, bwd_weight_s=1.0) for b in CondensedGraph.chain([1.0] * 12).blocks),
                           CondensedGraph.chain([1.0] * 12).edges)
    pb = Problem(graph, (DeviceSpec("a"), DeviceSpec("b"), DeviceSpec("c")), allow_idle_devices=False)
    choice = plan_pipeline(pb, 8, "auto", "auto", "dp", CompileOptions(stages_per_device=2),
                           schedules=("interleaved-1f1b", "interleaved-zero-bubble"))
    assert choice.schedule == "interleaved-zero-bubble"  # the weight halves fill interleaved 1F1B's bubble
    assert choice.plan.num_stages == 6 and choice.plan.num_ranks == 3
    assert choice.plan.schedule == "interleaved-zero-bubble"


def test_the_exact_solvers_refuse_a_looped_problem_called_directly() -> None:
    """Regression: ``solve_cpsat`` on a problem with ``stages_per_device=2`` (not through
    ``fxsplit.solvers.solve``) returned an "optimal" plan of another problem."""
    from fxsplit.errors import ConfigError
    from fxsplit.solvers import solve
    from fxsplit.solvers.cpsat import solve_cpsat
    from fxsplit.solvers.dp import solve_dp

    pb = Problem(CondensedGraph.chain([1.0] * 8), (DeviceSpec("a"), DeviceSpec("b")), schedule="interleaved-1f1b",
                 stages_per_device=2, microbatches=4)
    for direct in (solve_dp, solve_cpsat):
        with pytest.raises(ConfigError, match="stages_per_device=2; use fxsplit.solvers.solve"):
            direct(pb)
    assert solve(pb, "dp").num_stages == 4 and solve(pb, "cpsat").num_stages == 4
