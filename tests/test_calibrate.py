"""Calibration in the loop: the least-squares refit and ``pipe.calibrate`` on a mis-costed model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxsplit
from fxsplit.api import CompileOptions
from fxsplit.calibrate import (
    CompiledPipeline,
    Measurement,
    StageTimes,
    fit_link_latency,
    refit_problem,
)
from fxsplit.compiler import per_microbatch
from fxsplit.errors import ConfigError
from fxsplit.ir import CondensedGraph, DeviceSpec, LinkSpec, Problem, evaluate


def _problem(times: list[float]) -> Problem:
    graph = CondensedGraph.chain(times)
    graph = graph.with_time_factors([1.0] * len(times), [1.0] * len(times))
    return Problem(graph, (DeviceSpec("a"), DeviceSpec("b")), microbatches=1)


def _measure(problem: Problem, true_factors: list[float], stages: list[list[int]]) -> Measurement:
    """What a pipeline of ``stages`` would measure if block ``b`` really took ``factor_b x`` its cost."""
    plan = evaluate(problem, stages)
    rows = []
    for s, stage in enumerate(plan.stages):
        real = sum(problem.graph.blocks[b].fwd_s * true_factors[b] for b in stage.blocks)
        rows.append(StageTimes(s, stage.fwd_s, 0.0, real, 0.0))
    return Measurement(tuple(tuple(blocks) for blocks in stages), tuple(range(len(stages))), tuple(rows))


@settings(max_examples=50, deadline=None)
@given(
    times=st.lists(st.floats(0.1, 10.0), min_size=4, max_size=8),
    factor=st.floats(0.2, 20.0), data=st.data(),
)
def test_one_plan_scales_each_stage_by_its_ratio(times: list[float], factor: float, data: st.DataObject) -> None:
    problem = _problem(times)
    cut = data.draw(st.integers(1, len(times) - 1))
    stages = [list(range(cut)), list(range(cut, len(times)))]
    true = [factor] * cut + [1.0] * (len(times) - cut)
    refit = refit_problem(problem, [_measure(problem, true, stages)], 1, "gpipe")
    for b, block in enumerate(refit.graph.blocks):
        assert block.fwd_s == pytest.approx(times[b] * true[b], rel=1e-9)


@settings(max_examples=50, deadline=None)
@given(share=st.floats(0.0, 1.0), cut=st.integers(1, 3))
def test_a_zero_bubble_measurement_sets_the_weight_share_of_its_stages_blocks(share: float, cut: int) -> None:
    """Zero-bubble times W apart: the refit gives the blocks of every stage but the first (whose
    W is its whole backward, having no input gradient to compute) the measured share of their
    backward; the first stage's blocks keep the cost model's (here 0)."""
    graph = CondensedGraph(tuple(replace(b, bwd_s=2.0) for b in CondensedGraph.chain([1.0] * 4).blocks),
                           CondensedGraph.chain([1.0] * 4).edges)
    problem = Problem(graph, (DeviceSpec("a"), DeviceSpec("b")), microbatches=1, schedule="zero-bubble")
    stages = [list(range(cut)), list(range(cut, 4))]
    plan = evaluate(problem, stages)
    rows = [StageTimes(s, st.fwd_s, st.bwd_s, st.fwd_s, st.bwd_s, 0.0, st.bwd_s * (1.0 if s == 0 else share))
            for s, st in enumerate(plan.stages)]
    refit = refit_problem(problem, [Measurement((tuple(stages[0]), tuple(stages[1])), (0, 1), tuple(rows))], 1,
                          "zero-bubble")
    for b, block in enumerate(refit.graph.blocks):
        assert block.bwd_s == pytest.approx(2.0)
        assert block.bwd_weight_s == pytest.approx(0.0 if b < cut else 2.0 * share)


@settings(max_examples=50, deadline=None)
@given(times=st.lists(st.floats(0.1, 10.0), min_size=5, max_size=8), data=st.data())
def test_every_measured_stage_is_reproduced(times: list[float], data: st.DataObject) -> None:
    """Whatever the true costs, the refit predicts every stage of every measured plan exactly
    when the plans' stages determine the groups (two 2-stage plans: up to 3 groups, 4 equations)."""
    n = len(times)
    problem = _problem(times)
    true = data.draw(st.lists(st.floats(0.2, 5.0), min_size=n, max_size=n))
    c1, c2 = sorted(data.draw(st.lists(st.integers(1, n - 1), min_size=2, max_size=2, unique=True)))
    plans = [[list(range(c1)), list(range(c1, n))], [list(range(c2)), list(range(c2, n))]]
    measured = [_measure(problem, true, p) for p in plans]
    refit = refit_problem(problem, measured, 1, "gpipe")
    for meas in measured:
        for stage, row in zip(meas.stages, meas.times, strict=True):
            assert sum(refit.graph.blocks[b].fwd_s for b in stage) == pytest.approx(row.meas_fwd_s, rel=1e-6)


def test_refit_keeps_the_fixed_share_and_uses_micro_batch_costs() -> None:
    """Measured times are per micro-batch: the refit compares them with the problem's costs at
    that micro-batch count (fixed part whole), and scales the fixed part with the rest."""
    base = Problem(CondensedGraph.chain([4.0, 4.0]), (DeviceSpec("a"), DeviceSpec("b")))
    graph = base.graph
    blocks = tuple(b.__class__(**{**b.__dict__, "fwd_fixed_s": 1.0}) for b in graph.blocks)
    problem = base.with_(graph=CondensedGraph(blocks, graph.edges, graph.name))
    mb = per_microbatch(problem, 4, "gpipe").graph  # 1 + 3/4 per block
    assert mb.blocks[0].fwd_s == pytest.approx(1.75)
    rows = (StageTimes(0, 1.75, 0, 3.5, 0), StageTimes(1, 1.75, 0, 1.75, 0))
    refit = refit_problem(problem, [Measurement(((0,), (1,)), (0, 1), rows)], 4, "gpipe")
    assert refit.graph.blocks[0].fwd_s == pytest.approx(8.0) and refit.graph.blocks[0].fwd_fixed_s == pytest.approx(2.0)
    assert refit.graph.blocks[1].fwd_s == pytest.approx(4.0)


@settings(max_examples=60, deadline=None)
@given(times=st.lists(st.floats(0.1, 10.0), min_size=3, max_size=6), m=st.integers(1, 6),
       latency_s=st.floats(0.0, 2.0), target=st.floats(0.0, 400.0), data=st.data())
def test_the_fitted_link_latency_predicts_the_measured_step(times: list[float], m: int, latency_s: float,
                                                            target: float, data: st.DataObject) -> None:
    """Issue 9 (calibrate across processes): one latency added to every link makes the running
    plan's predicted step the measured one, whenever a latency >= 0 can; else the nearest end."""
    graph = CondensedGraph.chain(times, edge_bytes=1000)
    problem = Problem(graph, (DeviceSpec("a"), DeviceSpec("b"), DeviceSpec("c")), LinkSpec(1e6, latency_s),
                      links=((1, 2, LinkSpec(2e6, latency_s / 2)),))
    cut1 = data.draw(st.integers(1, len(times) - 2))
    cut2 = data.draw(st.integers(cut1 + 1, len(times) - 1))
    stages = [list(range(cut1)), list(range(cut1, cut2)), list(range(cut2, len(times)))]

    def step(pb: Problem) -> float:
        return evaluate(per_microbatch(pb, m, "1f1b"), stages, [0, 1, 2]).makespan_s

    fitted, extra = fit_link_latency(problem, stages, [0, 1, 2], m, "1f1b", target)
    floor = step(fitted.with_(link=LinkSpec(1e6, 0.0), links=((1, 2, LinkSpec(2e6, 0.0)),)))
    if target <= floor:  # even free messages are slower than the step: every latency goes to 0
        assert fitted.link.latency_s == 0.0 and fitted.link_between(1, 2).latency_s == 0.0
    else:
        assert step(fitted) == pytest.approx(target, rel=1e-6)
        assert fitted.link.latency_s == pytest.approx(latency_s + extra)
        assert fitted.link_between(1, 2).latency_s == pytest.approx(max(latency_s / 2 + extra, 0.0))
    assert fitted.graph == problem.graph


def test_refit_refuses_a_partial_plan() -> None:
    problem = _problem([1.0, 2.0, 3.0])
    partial = Measurement(((0,), (1,)), (0, 1), (StageTimes(0, 1, 0, 1, 0), StageTimes(1, 1, 0, 1, 0)))
    with pytest.raises(ConfigError, match="measure a whole plan"):
        refit_problem(problem, [partial], 1, "gpipe")


# -- calibrate on a real pipeline ----------------------------------------------------------------


class _MatrixExp(nn.Module):
    """A layer whose cost the analytic model gets badly wrong: ``matrix_exp`` is priced at one
    FLOP per element, but runs a dozen small matrix products per matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        m = h.unsqueeze(-1) * h.unsqueeze(-2) * 0.01
        e = torch.linalg.matrix_exp(m).sum(-1)
        return torch.cat([h, e, e[:, :16]], -1)


def _imbalance(rows) -> float:
    t = [r.meas_fwd_s + r.meas_bwd_s for r in rows]
    return max(t) / min(t)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_calibrate_balances_a_plan_made_on_wrong_costs(one_thread: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_MatrixExp(), *[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(9)])
    reference = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    pipe = fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, schedule="gpipe", cost_model="analytic",
                           options=CompileOptions(allow_idle_devices=False))
    assert isinstance(pipe, CompiledPipeline)
    report = pipe.calibrate(x, target=y, loss_fn=nn.functional.mse_loss, steps=3, rounds=2)
    text = report.format_table()
    assert report.replanned, text
    assert _imbalance(report.after) < _imbalance(report.before), text
    pred, meas = report.step_after_s
    assert 0.6 < meas / pred < 1.6, text  # before: the analytic model was several times off
    # The rebuilt pipeline still computes what the model computes, and nothing was trained.
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), reference, strict=True))
    assert all(p.grad is None for p in pipe.parameters())
    torch.testing.assert_close(pipe(x), model(x))


def test_calibrate_times_every_step_from_zeroed_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """Training zeroes gradients before each step; calibrate's timed steps did not, so from the
    second one on each step also added its gradients to the last step's (a pass over every
    gradient in the measured wall, 1.2-1.5 ms of a 35-50 ms MLP step on 2 ranks)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, schedule="gpipe", cost_model="analytic")
    held: list[bool] = []
    real_step = type(pipe).train_step

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        held.append(any(p.grad is not None for p in self.parameters()))
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(type(pipe), "train_step", spy)
    pipe.calibrate(x, target=y, loss_fn=nn.functional.mse_loss, steps=3, rounds=1)
    assert len(held) >= 4 and not any(held), held


def test_calibrate_checks_its_arguments() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x = torch.randn(4, 4)
    pipe = fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, cost_model="analytic")
    with pytest.raises(ConfigError, match="use steps >= 1"):
        pipe.calibrate(x, target=x, loss_fn=nn.functional.mse_loss, steps=0)


def test_cli_compile_calibrates_before_training() -> None:
    from typer.testing import CliRunner

    from fxsplit.cli import _register_all, app

    _register_all()
    args = ["compile", "gpt", "--devices", "2", "--steps", "1", "--size", "tiny", "--batch-size", "4", "--calibrate", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "predicted gain per round" in result.output
    assert "before    step" in result.output and "after     step" in result.output


def _calibrate_on_fixed_times(monkeypatch: pytest.MonkeyPatch, stage_ms: list[tuple[float, float]]) -> tuple:
    """Calibrate a 2-stage pipeline whose re-plan is forced to another split "predicted" twice as
    fast, with the stages measured at ``stage_ms`` (per-stage forward = backward ms: before, the
    new plan, and the first plan again when calibrate goes back)."""
    import dataclasses

    import fxsplit.calibrate as cal
    from fxsplit.compiler import evaluate_fixed

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)])
    x = torch.randn(8, 8)
    pipe = fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, schedule="gpipe", cost_model="analytic",
                           options=CompileOptions(allow_idle_devices=False))
    before = tuple(st.blocks for st in pipe.plan.stages)
    n = sum(len(b) for b in before)
    other = [[0], list(range(1, n))] if before[0] != (0,) else [[0, 1], list(range(2, n))]
    real_replan, real_measure = cal._replan, CompiledPipeline._measure

    def forced(p, ctx, refit):  # a different plan, "predicted" twice as fast
        choice, _ = real_replan(p, ctx, refit)
        plan = evaluate_fixed(refit, other, [0, 1], p.microbatches, p.schedule_kind)
        return dataclasses.replace(choice, plan=plan.with_(microbatches=p.microbatches, schedule=p.schedule_kind)), 0.5

    times = iter(stage_ms)

    def measured(self, *args):
        rows, step = real_measure(self, *args)
        ms = next(times)
        return [dataclasses.replace(r, meas_fwd_s=t * 1e-3, meas_bwd_s=t * 1e-3) for r, t in zip(rows, ms, strict=True)], step

    monkeypatch.setattr(cal, "_replan", forced)
    monkeypatch.setattr(CompiledPipeline, "_measure", measured)
    report = pipe.calibrate(x, target=x, loss_fn=nn.functional.mse_loss, steps=1, rounds=1)
    return report, before, pipe, model, x


def test_calibrate_goes_back_when_a_new_plan_measures_slower(monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-plan predicted faster but measured slower (a noisy machine misled the refit; CI saw
    calibrate end on a plan 2.1x imbalanced from one 1.5x) is undone: calibrate ends on the
    fastest plan it measured, and that pipeline still computes what the model computes."""
    report, before, pipe, model, x = _calibrate_on_fixed_times(monkeypatch, [(1.0, 1.0), (10.0, 1.0), (1.0, 1.0)])
    assert report.stages_before == before and report.stages_after == before and not report.replanned
    assert report.predicted_gains == (0.5,)
    torch.testing.assert_close(pipe(x), model(x))


def test_calibrate_keeps_a_balanced_plan_measured_on_a_slower_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (CI, 2 ranks): the first plan's stages measured 5.8:1, the rebuilt plans were
    measured while the machine ran 1.7x slower, and calibrate undid them, judging plans by raw
    times taken minutes apart. Here the new plan is balanced (forward 2:2 ms against 3:1) but
    measured on a machine 1.7x slower: its raw pipelined step is slower (20.4 ms against 14), at
    the first plan's total stage time it is faster (12 ms), and calibrate keeps it."""
    report, before, pipe, model, x = _calibrate_on_fixed_times(monkeypatch, [(3.0, 1.0), (3.4, 3.4)])
    assert report.replanned and report.stages_after != before
    torch.testing.assert_close(pipe(x), model(x))


def test_calibrate_a_zero_bubble_pipeline_fits_its_weight_halves(one_thread: None) -> None:
    """A zero-bubble pipeline's trace times each backward's halves apart: after calibrate, the
    plan's weight share of every stage but the first is the one measured (within the few steps'
    noise), and its predicted step comes within 2x of the measured one (the analytic costs were
    several times off; the bound leaves room for a machine that slows between two measurements)."""
    import fxsplit.models as zoo

    torch.manual_seed(0)
    case = zoo.get("gpt", size="tiny", batch_size=8)
    pipe = fxsplit.compile(case.model, ["cpu", "cpu"], case.example_inputs, schedule="zero-bubble", microbatches=4,
                           cost_model="analytic", options=CompileOptions(allow_idle_devices=False))
    inputs, target = case.make_batch(8, 0)
    report = pipe.calibrate(*inputs, target=target, loss_fn=case.loss_fn, steps=3, rounds=1, min_gain=10.0)
    text = report.format_table()
    assert not report.replanned and report.before[1].pred_bwd_weight_s > 0, text
    measured = report.before[1].meas_bwd_weight_s / report.before[1].meas_bwd_s
    stage = pipe.plan.stages[1]
    assert stage.bwd_weight_s / stage.bwd_s == pytest.approx(measured, rel=1e-6), text
    pred, meas = report.step_after_s
    assert 0.5 < meas / pred < 2.0, text


@pytest.mark.parametrize("speeds", [(1.0, 4.0), None])
def test_plans_on_devices_of_different_speeds_are_compared_by_their_work(speeds) -> None:
    """Regression (review): plans are compared at one machine speed by their total work, a
    stage's measured time times its device's speed. Moving work from a slow device (speed 1)
    to a fast one (speed 4) shortens the pipelined step (0.9 -> 0.8 s at m=2) and lowers the
    plain sum of stage times (0.6 -> 0.45 s), which without the speeds read as a machine that
    slowed down: calibrate went back to the slower plan."""
    from types import SimpleNamespace

    from fxsplit.calibrate import calibration_loop

    graph = CondensedGraph.chain([0.1, 0.2, 1.2])
    problem = Problem(graph, (DeviceSpec("slow", speed=1.0), DeviceSpec("fast", speed=4.0)), microbatches=2)
    first, better = evaluate(problem, [[0, 1], [2]], [0, 1]), evaluate(problem, [[0], [1, 2]], [0, 1])
    pipe = SimpleNamespace(microbatches=2, schedule_kind="1f1b", plan=first)

    def measure():  # each stage takes its blocks' work on its device, nothing else
        rows = [StageTimes(s, st.fwd_s, 0.0, st.fwd_s, 0.0) for s, st in enumerate(pipe.plan.stages)]
        return rows, (0.0, 0.0)

    def recalibrate(measured, step_s):
        pipe.plan = better
        return 0.5, True, None

    def go_back(saved, measured):
        pipe.plan = saved

    report = calibration_loop(pipe, 1, 0.05, measure, recalibrate, go_back, lambda _s: pipe.plan, speeds=speeds)
    kept = report.stages_after == ((0,), (1, 2))
    assert kept == (speeds is not None), report.format_table()


def test_a_refit_to_the_predicted_times_changes_no_formula_costs() -> None:
    """Review finding: the analytic model's micro-batch costs come from the cost formulas
    (``CondensedGraph.microbatch_graphs``); the refit dropped them, so a measurement equal to
    the prediction came back 0.28x of itself (one sample per micro-batch on an A100)."""
    from fxsplit.calibrate import Measurement, StageTimes, refit_problem
    from fxsplit.compiler import per_microbatch
    from fxsplit.frontend import front_end
    from fxsplit.ir import DeviceSpec, Problem, evaluate

    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(4)])
    a100 = DeviceSpec.preset("a100")
    graph = front_end(model, (torch.randn(16, 1024),), {}, reference=a100, cost_model="analytic",
                      options=CompileOptions()).condensed.graph
    assert graph.microbatch_graphs
    problem = Problem(graph, (a100.with_(name="d0"), a100.with_(name="d1"))).check()
    stages = [list(range(len(graph) // 2)), list(range(len(graph) // 2, len(graph)))]
    plan = evaluate(per_microbatch(problem, 16, "1f1b"), stages, [0, 1])
    times = [StageTimes(s, st.fwd_s, st.bwd_s, st.fwd_s, st.bwd_s) for s, st in enumerate(plan.stages)]
    refit = refit_problem(problem, [Measurement.of(plan, times)], 16, "1f1b")
    again = evaluate(per_microbatch(refit, 16, "1f1b"), stages, [0, 1])
    for before, after in zip(plan.stages, again.stages, strict=True):
        assert (after.fwd_s, after.bwd_s) == pytest.approx((before.fwd_s, before.bwd_s), rel=1e-6)


def test_calibrate_puts_back_the_buffers_its_steps_update() -> None:
    """Reliability: the timed steps of calibrate updated BatchNorm's running statistics and its
    counter (parameters were kept, buffers were not); now every state entry is as before."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pipe = fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=1, schedule="gpipe", cost_model="analytic",
                           options=fxsplit.CompileOptions(allow_idle_devices=False))
    pipe.calibrate(x, target=y, loss_fn=torch.nn.functional.mse_loss, steps=2, rounds=1)
    after = pipe.state_dict()
    assert [k for k, v in after.items() if not torch.equal(v, before[k])] == []
