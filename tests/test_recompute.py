"""Activation recomputation (issue 13, item 1): the cost model, the solvers, both runtimes.

A recomputed stage keeps only its inputs per in-flight micro-batch and runs its forward again in
backward. The model must cost it (memory and time), every solver must choose it where it pays
(``recompute="auto"``: exactly where a stage would not fit otherwise), and the runtimes must run
it with the unsplit model's loss, gradients and buffers.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from pipeline_utils import Compiled, StatefulBuffers, assert_same_training, devices
from strategies import problems
from torch import nn

import fxsplit
import fxsplit.models as zoo
from fxsplit.calibrate import Measurement, StageTimes, refit_problem
from fxsplit.compiler import plan_pipeline
from fxsplit.errors import ConfigError, ExecutionError, InfeasibleError
from fxsplit.ir import Block, CondensedGraph, DeviceSpec, Edge, LinkSpec, Problem, evaluate
from fxsplit.solvers import solve

MB = 2**20


def _chain(act_bytes: int = 100 * MB) -> CondensedGraph:
    blocks = tuple(Block(i, f"b{i}", fwd_s=1.0, bwd_s=2.0, param_bytes=MB, activation_bytes=act_bytes)
                   for i in range(4))
    return CondensedGraph(blocks, tuple(Edge(i, i + 1, MB) for i in range(3)), name="chain")


def _problem(recompute: str, memory_mib: int, m: int = 4, schedule: str = "gpipe") -> Problem:
    devs = tuple(DeviceSpec(f"d{i}", memory_bytes=memory_mib * MB) for i in range(2))
    return Problem(_chain(), devs, LinkSpec(bytes_per_s=math.inf, latency_s=0.0), microbatches=m,
                   schedule=schedule, recompute=recompute, optimizer_state_factor=0.0, grad_factor=0.0).check()


# --- the cost model ------------------------------------------------------------------------------
def test_a_stage_recomputes_only_when_it_would_not_fit_otherwise() -> None:
    # two blocks per stage: state 2 MiB, activations 200 MiB per micro-batch, 4 in flight (GPipe)
    roomy, tight = _problem("auto", 1000), _problem("auto", 500)
    plan = evaluate(roomy, [[0, 1], [2, 3]])
    assert not any(st.recompute for st in plan.stages)
    assert plan.stages[0].bwd_s == 4.0 and plan.stages[0].memory_bytes == 2 * MB + 200 * MB * 4 + MB
    plan = evaluate(tight, [[0, 1], [2, 3]])
    assert all(st.recompute for st in plan.stages)
    # one more forward in backward; the inputs per micro-batch in flight and the activations once
    assert plan.stages[0].bwd_s == 4.0 + 2.0 and plan.stages[0].fwd_s == 2.0
    assert plan.stages[0].memory_bytes == 2 * MB + 0 * 4 + 200 * MB + MB
    assert plan.stages[1].memory_bytes == 2 * MB + MB * 4 + 200 * MB
    assert evaluate(_problem("none", 500), [[0, 1], [2, 3]]).stages[0].recompute is False
    assert all(st.recompute for st in evaluate(_problem("all", 1000), [[0, 1], [2, 3]]).stages)


def test_recomputation_needs_training_and_a_known_mode() -> None:
    pb = _problem("all", 500).with_(training=False)
    assert not any(st.recompute for st in evaluate(pb, [[0, 1], [2, 3]]).stages)
    with pytest.raises(ConfigError, match="recompute='sometimes'"):
        _problem("sometimes", 500)


def test_one_in_flight_micro_batch_never_recomputes_under_auto() -> None:
    # nothing to save: keeping one micro-batch's activations is what recomputing holds anyway
    plan = evaluate(_problem("auto", 150, m=1), [[0], [1, 2, 3]])
    assert not any(st.recompute for st in plan.stages)


def test_the_solvers_find_the_plan_only_recomputation_makes_fit() -> None:
    with pytest.raises(InfeasibleError):
        solve(_problem("none", 500), "dp")
    for solver in ("dp", "cpsat"):
        plan = solve(_problem("auto", 500), solver, time_limit_s=20)
        assert plan.status == "optimal" and all(st.recompute for st in plan.stages)
        assert plan.bottleneck_s == pytest.approx(2.0 + 4.0 + 2.0)  # forward, backward, forward again


def test_calibrate_does_not_count_the_second_forward_as_backward() -> None:
    # the runtime's trace times a recomputing stage's backward with its forward run again inside
    pb = _problem("auto", 500, m=1).with_(schedule="gpipe")
    plan = evaluate(pb.with_(recompute="all"), [[0, 1], [2, 3]])
    rows = [StageTimes(s, st.fwd_s, st.bwd_s, 2.0, 4.0 + 2.0) for s, st in enumerate(plan.stages)]
    refit = refit_problem(pb, [Measurement.of(plan, rows)], 1, "gpipe")
    assert [b.bwd_s for b in refit.graph.blocks] == pytest.approx([2.0] * 4)  # as predicted: nothing to fix
    assert [b.fwd_s for b in refit.graph.blocks] == pytest.approx([1.0] * 4)


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(problems(max_blocks=7, max_devices=3, objective=None, memory_mib=(8, 48)))
def test_auto_is_never_slower_than_all_or_none_and_fits_exactly_when_all_does(problem: Problem) -> None:
    def best(mode: str) -> float:
        try:
            return solve(problem.with_(recompute=mode), "dp").objective_s
        except InfeasibleError:
            return math.inf

    auto, none, every = best("auto"), best("none"), best("all")
    assert auto <= min(none, every) * (1 + 1e-9) + 1e-12
    assert math.isinf(auto) == math.isinf(every)  # recomputing everywhere fits iff some choice fits


# --- the runtimes --------------------------------------------------------------------------------
def _pipeline(compiled: Compiled, num_stages: int, schedule: str, m: int, recompute: str) -> fxsplit.Pipeline:
    problem = Problem(compiled.condensed.graph, tuple(devices(num_stages)), LinkSpec(), allow_idle_devices=False,
                      recompute=recompute)
    choice = plan_pipeline(problem, compiled.batch, m, schedule, "auto", compiled.options)
    return compiled.assemble(choice.plan, schedule, m)


@pytest.mark.parametrize("name", ["mlp", "gpt", "unet", "dag"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_recomputed_stages_train_like_the_original(name: str, schedule: str) -> None:
    case = zoo.get(name, batch_size=4)
    compiled = Compiled(case, copy_tied=name == "gpt")
    pipe = _pipeline(compiled, 3, schedule, 4, "all")
    assert all(st.recompute for st in pipe.plan.stages)
    inputs, target = case.make_batch(4, 7)
    assert_same_training(pipe, compiled, inputs, target)


def test_a_recomputed_stage_keeps_only_what_it_received() -> None:
    case = zoo.get("mlp", batch_size=8)
    compiled = Compiled(case)
    inputs, _ = case.make_batch(8, 3)
    kept = {}
    for mode in ("none", "all"):
        pipe = _pipeline(compiled, 2, "gpipe", 2, mode)
        saved: list[int] = []

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            pipe(*inputs)
        kept[mode] = sum(saved)
    received = sum(x.numel() * x.element_size() for x in inputs)  # stage 0's inputs, whole batch
    boundary = pipe.plan.stages[1].in_bytes * 2  # stage 1's inputs, per micro-batch (of 4 rows) x 2
    assert kept["all"] <= received + boundary * 2, kept
    assert kept["none"] > 4 * kept["all"], kept


class _Noisy(nn.Module):
    """Dropout and a train-mode BatchNorm: what a second forward must not change."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3))
        self.b = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.3), nn.BatchNorm1d(32), nn.Tanh())
        self.c = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


@pytest.mark.filterwarnings("ignore::fxsplit.errors.NotPerSampleWarning")  # train-mode BatchNorm, on purpose
@pytest.mark.parametrize("method", ["export", "symbolic_trace"])
@pytest.mark.parametrize("m", [1, 2])
def test_recomputation_draws_the_same_dropout_and_updates_batch_norm_once(method: str, m: int) -> None:
    torch.manual_seed(0)
    model = _Noisy().train()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    results = {}
    for mode in ("none", "all"):
        copy_ = copy.deepcopy(model)
        options = fxsplit.CompileOptions(recompute=mode, allow_idle_devices=False, capture_method=method,
                                         executor="sequential")
        pipe = fxsplit.compile(copy_, devices(2), (x,), microbatches=m, schedule="1f1b", cost_model="analytic",
                               options=options)
        assert all(st.recompute for st in pipe.plan.stages) == (mode == "all")
        torch.manual_seed(1)
        loss = pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss)
        results[mode] = (loss, {n: p.grad.clone() for n, p in pipe.named_parameters()},
                         {k: v.clone() for k, v in pipe.state_dict().items()})
    (l0, g0, s0), (l1, g1, s1) = results["none"], results["all"]
    torch.testing.assert_close(l1, l0)
    assert g0.keys() == g1.keys() and s0.keys() == s1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], msg=lambda msg, n=name: f"gradient of {n}: {msg}")
    for name in s0:  # running statistics and batch counts: updated once, as without recomputation
        torch.testing.assert_close(s1[name], s0[name], msg=lambda msg, n=name: f"{n}: {msg}")


def test_compile_recomputes_where_the_memory_limit_demands_and_trains_like_the_original() -> None:
    case = zoo.get("gpt", batch_size=8)
    inputs, target = case.make_batch(8, 5)
    kept = fxsplit.compile(copy.deepcopy(case.model), devices(2), case.example_inputs, microbatches=4,
                           schedule="gpipe", cost_model="analytic",
                           options=fxsplit.CompileOptions(recompute="none", executor="sequential"))
    need = max(st.memory_bytes for st in kept.plan.stages)
    limit = int(need * 0.8)
    with pytest.raises(InfeasibleError):
        fxsplit.compile(copy.deepcopy(case.model), devices(2), case.example_inputs, microbatches=4, schedule="gpipe",
                        cost_model="analytic", memory_limit_bytes=limit,
                        options=fxsplit.CompileOptions(recompute="none", executor="sequential"))
    model = copy.deepcopy(case.model)
    pipe = fxsplit.compile(model, devices(2), case.example_inputs, microbatches=4, schedule="gpipe",
                           cost_model="analytic", memory_limit_bytes=limit,
                           options=fxsplit.CompileOptions(executor="sequential"))  # recompute="auto"
    assert any(st.recompute for st in pipe.plan.stages)
    assert max(st.memory_bytes for st in pipe.plan.stages) <= limit
    reference = copy.deepcopy(case.model)
    ref_loss = case.loss_fn(reference(*inputs), target)
    ref_loss.backward()
    loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=1e-5)
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-4, atol=1e-5)


def test_inference_compiles_with_the_default_recompute_setting() -> None:
    """Review finding: explore compared candidates' "none" (inference never recomputes) with the
    options' default "auto" and found no candidate, so every inference compile failed."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]).eval()
    x = torch.randn(8, 8)
    pipe = fxsplit.compile(model, devices(2), (x,), cost_model="analytic",
                           options=fxsplit.CompileOptions(training=False, executor="sequential"))
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))


def test_zero_bubble_runs_a_recomputing_stage_forward_once_more_only() -> None:
    """Review finding: torch's weight half starts one autograd run per parameter group, and each
    recomputed the stage; a recomputing stage now runs its whole backward in I (W: nothing)."""
    case = zoo.get("mlp", batch_size=8)
    compiled = Compiled(case)
    pipe = _pipeline(compiled, 2, "zero-bubble", 2, "all")
    assert all(st.recompute and st.bwd_weight_s == 0.0 for st in pipe.plan.stages)
    calls = [0]
    gm = pipe.program.stages[1].gm
    hook = gm.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    inputs, target = case.make_batch(8, 7)
    try:
        assert_same_training(pipe, compiled, inputs, target)
    finally:
        hook.remove()
    # pipe(*inputs) under no_grad: 2 forwards; train_step: 2 forwards + 2 recomputes
    assert calls[0] == 2 + 2 * 2, calls


@pytest.mark.parametrize("method", ["export", "symbolic_trace"])
def test_threads_refuse_a_recomputing_cpu_stage_with_dropout_beside_another_cpu_stage(method: str) -> None:
    """Review finding: the recomputation replays the global CPU generator from where the forward
    began; under the threads executor another CPU stage's worker may draw in between, so the
    masks (and the gradients) would silently differ. Refused, with the fix; sequential runs."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    x = torch.randn(8, 8)
    kwargs = dict(microbatches=2, schedule="1f1b", cost_model="analytic")
    with pytest.raises(ConfigError, match=r"recomputes its activations and draws random numbers.*executor='sequential'"):
        fxsplit.compile(copy.deepcopy(model), devices(2), (x,), **kwargs,
                        options=fxsplit.CompileOptions(recompute="all", executor="threads", allow_idle_devices=False,
                                                       capture_method=method))
    pipe = fxsplit.compile(copy.deepcopy(model), devices(2), (x,), **kwargs,
                           options=fxsplit.CompileOptions(recompute="all", executor="sequential", allow_idle_devices=False))
    assert all(st.recompute for st in pipe.plan.stages)


@pytest.mark.filterwarnings("ignore::fxsplit.errors.NotPerSampleWarning")  # the normaliser mixes samples, on purpose
@pytest.mark.parametrize("method, m", [("export", 1), ("export", 2)])  # symbolic_trace refuses the model
def test_recomputation_reads_buffers_as_the_first_forward_read_them(method: str, m: int) -> None:
    """Regression: the second forward ran on the buffer values the first forward had left (the
    counter one step ahead, the mean already updated), so it rebuilt other activations and the
    gradients were wrong without an error. It now runs on the values the first forward read.
    With 2 micro-batches the counter's update runs once per step (OncePerStep): its buffer is
    left live, as the tracker replays it (the first fix restored it too and broke that case)."""
    torch.manual_seed(0)
    model = StatefulBuffers()
    x, y = torch.randn(8, 8), torch.randn(8, 3)
    results = {}
    for mode in ("none", "all"):
        options = fxsplit.CompileOptions(recompute=mode, allow_idle_devices=False, capture_method=method,
                                         executor="sequential")
        pipe = fxsplit.compile(copy.deepcopy(model), devices(2), (x,), microbatches=m, schedule="gpipe",
                               cost_model="analytic", options=options)
        for _ in range(2):
            pipe.zero_grad()
            loss = pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss)
        results[mode] = (loss, {n: p.grad.clone() for n, p in pipe.named_parameters()},
                         {k: v.clone() for k, v in pipe.state_dict().items()})
    (l0, g0, s0), (l1, g1, s1) = results["none"], results["all"]
    torch.testing.assert_close(l1, l0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], msg=lambda msg, n=name: f"gradient of {n}: {msg}")
    for name in s0:
        torch.testing.assert_close(s1[name], s0[name], msg=lambda msg, n=name: f"{n}: {msg}")


def test_a_buffer_shared_with_a_stage_that_keeps_its_activations_survives_recomputation() -> None:
    """Regression: after recomputing, every buffer was copied back, bumping the version of a
    buffer another stage on the device had saved for its backward, whose backward then failed."""
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 3)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x) * self.scale  # mul saves the shared buffer for backward
            return self.c(torch.tanh(self.b(h)) * self.scale)

    torch.manual_seed(0)
    model, x, y = Scaled(), torch.randn(8, 8), torch.randn(8, 3)
    options = fxsplit.CompileOptions(recompute="all", allow_idle_devices=False, executor="sequential")
    pipe = fxsplit.compile(copy.deepcopy(model), devices(2), (x,), microbatches=2, schedule="gpipe",
                           cost_model="analytic", options=options)
    assert pipe.program.stages[0].gm.get_buffer("scale") is pipe.program.stages[1].gm.get_buffer("scale")
    first = pipe.plan.stages[0]
    pipe.plan = dataclasses.replace(pipe.plan, stages=(dataclasses.replace(first, recompute=False), *pipe.plan.stages[1:]))
    loss = pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss)
    ref = nn.functional.mse_loss(model(x), y)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, dict(model.named_parameters())[name].grad, msg=name)


class _CountedSteps(nn.Module):
    """A step counter read before and after its update (made once per step with micro-batches)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 3)
        self.register_buffer("t", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * (self.t / 10)
        self.t += 1
        return self.b(torch.tanh(h * (self.t / 10)))


def test_backward_after_a_forward_only_call_refuses_to_replay_once_per_step_updates() -> None:
    """Regression: ``loss_fn(pipe(x), y).backward()`` recomputed after the step had been
    committed, so once-per-step updates ran again in the recomputation and the gradients were
    wrong without an error. It is refused now; train_step stays exact."""
    torch.manual_seed(0)
    model, x, y = _CountedSteps(), torch.randn(8, 8), torch.randn(8, 3)
    options = fxsplit.CompileOptions(recompute="all", allow_idle_devices=False, executor="sequential")
    pipe = fxsplit.compile(copy.deepcopy(model), devices(2), (x,), microbatches=2, schedule="gpipe",
                           cost_model="analytic", options=options)
    assert pipe.bn_tracker is not None and pipe.bn_tracker.tracked  # the counter runs once per step
    with pytest.raises(ExecutionError, match="after its step ended"):
        nn.functional.mse_loss(pipe(x), y).backward()
    pipe.zero_grad()
    loss = pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss)
    ref = copy.deepcopy(model)
    ref(x)  # the failed call above ran one step's forward: the counter moved once
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[name].grad, msg=name)
