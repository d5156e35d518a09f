"""Mixed precision (issue 13, item 2): stages and loss under ``torch.autocast``, costed in the
dtypes autocast gives, fp16 with loss scaling; compared with the unsplit model under the same
autocast."""

from __future__ import annotations

import copy

import pytest
import torch
from pipeline_utils import devices

import fxsplit
import fxsplit.models as zoo
from fxsplit.errors import ConfigError


def _compile(case, m: int, autocast: str | None, schedule: str = "1f1b", **options):
    return fxsplit.compile(copy.deepcopy(case.model), devices(2), case.example_inputs, microbatches=m, schedule=schedule,
                           cost_model="analytic",
                           options=fxsplit.CompileOptions(autocast=autocast, executor="sequential",
                                                          allow_idle_devices=False, **options))


def _reference(case, inputs, target, dtype):
    model = copy.deepcopy(case.model)
    with torch.autocast("cpu", dtype=dtype):
        loss = case.loss_fn(model(*inputs), target)
    loss.backward()
    return model, loss.detach()


def _close_to_max(actual: torch.Tensor, expected: torch.Tensor, rel: float, name: str) -> None:
    """Equal up to ``rel`` of the largest magnitude (bf16 rounds to 2^-8 of a value)."""
    scale = float(expected.abs().max()) or 1.0
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=rel * scale, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", ["gpt", "mlp", "unet"])
@pytest.mark.parametrize(("m", "rel"), [(1, 1e-6), (4, 2e-2)])
def test_bf16_autocast_trains_like_the_unsplit_model_under_autocast(name: str, m: int, rel: float) -> None:
    """One micro-batch runs the very same kernels as the unsplit model: equal to float rounding;
    four micro-batches change the matmul shapes, so bf16 rounding differs within its precision."""
    case = zoo.get(name, batch_size=8)
    inputs, target = case.make_batch(8, 3)
    reference, ref_loss = _reference(case, inputs, target, torch.bfloat16)
    pipe = _compile(case, m, "bf16")
    assert pipe.num_stages == 2 and pipe.autocast is torch.bfloat16
    loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
    _close_to_max(loss, ref_loss, rel, "loss")
    ref = dict(reference.named_parameters())
    for n, p in pipe.named_parameters():
        assert p.dtype == torch.float32  # master weights stay fp32, as under autocast
        _close_to_max(p.grad, ref[n].grad, rel, f"gradient of {n}")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(*inputs)
    assert pipe(*inputs).dtype == expected.dtype == torch.bfloat16  # the forward runs under autocast too


def test_bf16_costs_read_the_dtypes_autocast_gives() -> None:
    case = zoo.get("gpt", batch_size=8)
    full, mixed = _compile(case, 2, None), _compile(case, 2, "bf16")
    act = {mode: sum(b.activation_bytes for b in pipe.plan.graph.blocks) for mode, pipe in
           (("fp32", full), ("bf16", mixed))}
    params = {mode: sum(b.param_bytes for b in pipe.plan.graph.blocks) for mode, pipe in
              (("fp32", full), ("bf16", mixed))}
    assert act["bf16"] < 0.8 * act["fp32"], act  # the matmul outputs are bf16
    assert params["bf16"] == params["fp32"]  # fp32 master weights, gradients and optimizer state


def test_fp16_with_loss_scaling_steps_like_the_unsplit_model() -> None:
    case = zoo.get("mlp", batch_size=8)
    inputs, target = case.make_batch(8, 5)
    reference = copy.deepcopy(case.model)
    pipe = _compile(case, 1, "fp16")
    opts = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (reference, pipe)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    with torch.autocast("cpu", dtype=torch.float16):
        ref_loss = case.loss_fn(reference(*inputs), target)
    scalers[0].scale(ref_loss).backward()
    loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn, grad_scaler=scalers[1])
    torch.testing.assert_close(loss, ref_loss.detach())  # the loss returned is not scaled
    ref = dict(reference.named_parameters())
    for n, p in pipe.named_parameters():  # scaled gradients, as scaler.scale(loss).backward() leaves them
        torch.testing.assert_close(p.grad, ref[n].grad, rtol=1e-3, atol=1e-3 * float(ref[n].grad.abs().max()))
    for opt, scaler in zip(opts, scalers, strict=True):
        scaler.step(opt)
        scaler.update()
    state = reference.state_dict()
    for k, v in pipe.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=1e-4, atol=1e-5)


def test_an_unknown_autocast_dtype_is_refused_before_any_work() -> None:
    case = zoo.get("mlp", batch_size=4)
    with pytest.raises(ConfigError, match=r"autocast='int8' is unknown.*bf16.*fp16"):
        _compile(case, 1, "int8")


def test_distributed_refuses_an_unknown_autocast_before_any_work() -> None:
    import fxsplit.distributed as fxd

    case = zoo.get("mlp", batch_size=4)
    with pytest.raises(ConfigError, match=r"autocast='int8' is unknown"):
        fxd.compile(lambda: case.model, case.example_inputs, options=fxsplit.CompileOptions(autocast="int8"))


def test_the_profile_cache_keeps_mixed_precision_timings_apart() -> None:
    from fxsplit.passes.capture import capture
    from fxsplit.passes.profile import graph_digest

    case = zoo.get("mlp", batch_size=4)
    gm = capture(case.model, tuple(case.example_inputs), {}).gm
    plain = graph_digest(gm, case.example_inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = graph_digest(gm, case.example_inputs)
    assert plain != mixed and plain == graph_digest(gm, case.example_inputs)


def test_bf16_costs_read_autocast_dtypes_without_a_symbolic_batch_too() -> None:
    """Regression (found by review): with ``dynamic_batch=False`` the front end kept the dtypes
    export recorded outside autocast (fp32), so output bytes came out twice the bf16 size."""
    from fxsplit.frontend import front_end
    from fxsplit.ir import DeviceSpec

    case = zoo.get("mlp", batch_size=8)
    spec = DeviceSpec("cpu", torch_device="cpu")
    out = {}
    for mode in (None, "bf16"):
        ins = front_end(case.model, tuple(case.example_inputs), {}, reference=spec, cost_model="analytic",
                        options=fxsplit.CompileOptions(dynamic_batch=False, autocast=mode))
        out[mode] = sum(b.output_bytes for b in ins.condensed.graph.blocks)
    assert out["bf16"] < 0.8 * out[None], out


# --- precision as a searched knob (issue 13, item 3): a compute roof per dtype, autocast="auto" ---


def _roof_device(name: str, bf16_flops: float, fp32_flops: float):
    from fxsplit.ir import DeviceSpec

    return DeviceSpec(name, peak_flops=bf16_flops, fp32_peak_flops=fp32_flops, memory_bandwidth_bytes_per_s=1e18,
                      memory_bytes=8 * 2**30, torch_device="cpu")


def test_a_node_is_costed_at_the_roof_of_the_dtype_it_computes_in() -> None:
    """A compute-bound matmul: fp32 at ``fp32_peak_flops``, under bf16 autocast at ``peak_flops``."""
    from fxsplit.frontend import front_end

    model, x = torch.nn.Linear(256, 256, bias=False), torch.randn(64, 256)
    dev = _roof_device("d", bf16_flops=16e9, fp32_flops=1e9)
    fwd = {}
    for mode in (None, "bf16"):
        ins = front_end(model, (x,), {}, reference=dev, cost_model="analytic",
                        options=fxsplit.CompileOptions(dynamic_batch=False, autocast=mode))
        fwd[mode] = sum(b.fwd_s for b in ins.condensed.graph.blocks)
    mm_flops = 2 * 64 * 256 * 256
    assert fwd[None] == pytest.approx(mm_flops / 1e9, rel=1e-6)
    assert fwd["bf16"] == pytest.approx(mm_flops / 16e9, rel=0.05)  # plus the casts' one FLOP per element
    assert _roof_device("e", 2e9, 0.0).peak_flops_for("float32") == 2e9  # 0: one roof for every dtype


@pytest.mark.parametrize(("bf16_flops", "fp32_flops", "expected"), [(1e12, 1e9, torch.bfloat16), (1e9, 1e12, None)])
def test_autocast_auto_runs_the_precision_that_plans_faster(bf16_flops: float, fp32_flops: float,
                                                            expected: torch.dtype | None) -> None:
    """Both precisions are planned; the faster one runs, and trains like the unsplit model under it."""
    case = zoo.get("gpt", batch_size=8)
    specs = [_roof_device(f"cpu#{i}", bf16_flops, fp32_flops) for i in range(2)]
    pipe = fxsplit.compile(copy.deepcopy(case.model), specs, case.example_inputs, microbatches=1, schedule="1f1b",
                           cost_model="analytic",
                           options=fxsplit.CompileOptions(autocast="auto", executor="sequential",
                                                          allow_idle_devices=False))
    assert pipe.autocast is expected
    winner = "autocast bf16" if expected is not None else "own dtypes"
    assert pipe.report.reason.startswith(f"{winner}, the fastest precision per step (own dtypes "), pipe.report.reason
    inputs, target = case.make_batch(8, 3)
    reference = copy.deepcopy(case.model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=expected is not None):
        ref_loss = case.loss_fn(reference(*inputs), target)
    ref_loss.backward()
    loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
    _close_to_max(loss, ref_loss.detach(), 1e-6, "loss")
    ref = dict(reference.named_parameters())
    for n, p in pipe.named_parameters():
        _close_to_max(p.grad, ref[n].grad, 1e-6, f"gradient of {n}")


def test_autocast_auto_is_planning_s_choice_not_a_runtime_dtype() -> None:
    from fxsplit.options import autocast_dtype

    with pytest.raises(ConfigError, match=r"autocast='auto'.*decided by fxsplit.compile.*'bf16', 'fp16' or None"):
        autocast_dtype("auto")


def test_plan_cli_chooses_the_precision() -> None:
    from typer.testing import CliRunner

    import fxsplit.cli as cli

    cli._register_all()
    result = CliRunner().invoke(cli.app, ["plan", "mlp", "--size", "small", "--device", "a100", "--devices", "2",
                                          "--batch-size", "64", "--autocast", "auto", "--explore"])
    assert result.exit_code == 0, result.output
    assert "precision: autocast bf16" in result.output  # A100: 312 TFLOP/s in bf16, 19.5 in fp32
    assert "own dtypes:" in result.output and "autocast bf16:" in result.output  # both tables


@pytest.mark.parametrize("name", ["gpt", "hf:llama"])
def test_a_meta_model_is_costed_under_autocast_as_on_a_cpu(name: str) -> None:
    """Autocast does not act on meta tensors: big models planned on meta kept fp32 activations
    and boundaries under ``autocast="bf16"``. They now run as on a CPU for the fake passes."""
    from fxsplit.frontend import front_end
    from fxsplit.ir import DeviceSpec

    costs = {}
    for where in ("cpu", "meta"):
        with torch.device(where):
            case = zoo.get(name, batch_size=4)
        for mode in (None, "bf16"):
            ins = front_end(case.model, case.example_inputs, dict(case.example_kwargs or {}),
                            reference=DeviceSpec.preset("a100"), cost_model="analytic",
                            options=fxsplit.CompileOptions(autocast=mode, dynamic_batch=False))
            blocks = ins.condensed.graph.blocks
            costs[where, mode] = (sum(b.activation_bytes for b in blocks), sum(b.output_bytes for b in blocks))
    assert costs["meta", "bf16"] == costs["cpu", "bf16"], costs
    assert costs["meta", None] == costs["cpu", None], costs
    assert costs["meta", "bf16"][0] < costs["meta", None][0] and costs["meta", "bf16"][1] < costs["meta", None][1]


def test_autocast_auto_puts_the_winners_annotation_back_without_annotating_again(monkeypatch) -> None:
    """Review finding: when the model's own dtypes won, compile annotated them a second time;
    timed costs differ between runs, so the blocks could differ from the ones planned (stages
    not contiguous, or other stages than the plan's). The winner's node metadata are restored."""
    import fxsplit.compiler as compiler

    calls: list[str | None] = []
    real = compiler.front_end
    monkeypatch.setattr(compiler, "front_end", lambda *a, **k: calls.append(k["options"].autocast) or real(*a, **k))
    case = zoo.get("gpt", batch_size=8)
    specs = [_roof_device(f"cpu#{i}", 1e9, 1e12) for i in range(2)]  # fp32 math 1000x faster: own dtypes win
    pipe = fxsplit.compile(copy.deepcopy(case.model), specs, case.example_inputs, microbatches=2, schedule="1f1b",
                           cost_model="analytic", options=fxsplit.CompileOptions(autocast="auto", executor="sequential"))
    assert calls == [None, "bf16"] and pipe.autocast is None
    gm = pipe.context.captured.gm
    mm = [n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    assert mm and all(n.meta["val"].dtype == torch.float32 for n in mm)  # the own dtypes' values, not bf16's
    blocks = {n.meta["fxsplit.block"] for n in gm.graph.nodes if "fxsplit.block" in n.meta}
    assert blocks == set(pipe.plan.stage_of_block())


@pytest.mark.parametrize("method", ["export", "symbolic_trace"])
def test_an_fp32_convolution_is_costed_at_the_tf32_rate_cudnn_runs_it_at(method: str) -> None:
    """Review finding: cuDNN runs fp32 convolutions in TF32 by default (matmuls: no TF32), so an
    A100 preset's fp32 convolution runs at 156 TFLOP/s, not 19.5."""
    from fxsplit.frontend import front_end
    from fxsplit.ir import DeviceSpec

    a100 = DeviceSpec.preset("a100", op_overhead_s=0.0, memory_bandwidth_bytes_per_s=1e18)
    rates = {}
    for name, model, x in (("conv", torch.nn.Conv2d(16, 16, 3, padding=1), torch.randn(4, 16, 8, 8)),
                           ("linear", torch.nn.Linear(64, 64, bias=False), torch.randn(8, 64))):
        graph = front_end(model, (x,), {}, reference=a100, cost_model="analytic",
                          options=fxsplit.CompileOptions(capture_method=method, symbolic_costs=False)).condensed.graph
        rates[name] = sum(b.flops for b in graph.blocks) / sum(b.fwd_s for b in graph.blocks)
    assert rates["conv"] == pytest.approx(156e12, rel=0.02) and rates["linear"] == pytest.approx(19.5e12, rel=0.02)


def test_a_solver_time_out_in_one_precision_leaves_the_other(monkeypatch) -> None:
    """bench/explore.py: a time-out planning the model's own dtypes ended the whole search."""
    import fxsplit.compiler as compiler
    from fxsplit.errors import SolverError

    real = compiler.plan_pipeline

    def flaky(problem, batch, microbatches, schedule, solver, options, schedules=compiler.AUTO_SCHEDULES):
        if options.autocast is None:
            raise SolverError("no plan within the time limit")
        return real(problem, batch, microbatches, schedule, solver, options, schedules)

    monkeypatch.setattr(compiler, "plan_pipeline", flaky)
    case = zoo.get("mlp", batch_size=8)
    pipe = _compile(case, 2, "auto")
    assert pipe.autocast is torch.bfloat16 and "own dtypes: no plan within the time limit" in pipe.report.reason
    monkeypatch.setattr(compiler, "plan_pipeline", lambda *a, **k: (_ for _ in ()).throw(SolverError("gave up")))
    with pytest.raises(SolverError, match="no precision has a plan; own dtypes: gave up | autocast bf16: gave up"):
        compiler.plan_precisions(lambda p: None, 8, 2, "1f1b", "auto",  # type: ignore[arg-type,return-value]
                                 fxsplit.CompileOptions(autocast="auto"))


class _FloatLogits(torch.nn.Module):
    """``logits.float()`` before a loss, as Hugging Face models do: export records the fp32 dtype
    it saw, in an ``_assert_tensor_metadata`` check."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).float()


def test_a_float_cast_export_checked_in_fp32_runs_under_bf16_autocast() -> None:
    """Regression (a probe of Hugging Face models: Llama with labels under autocast="bf16"
    failed to compile, "Tensor dtype mismatch! Expected: torch.float32, Got: torch.bfloat16"):
    the pipeline runs such a graph under autocast as the unsplit model does."""
    torch.manual_seed(0)
    model, x = _FloatLogits(), torch.randn(8, 8)
    pipe = fxsplit.compile(copy.deepcopy(model), devices(2), (x,), microbatches=2, cost_model="analytic",
                           options=fxsplit.CompileOptions(autocast="bf16", allow_idle_devices=False))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x)
    got = pipe(x)
    assert got.dtype == want.dtype == torch.float32
    _close_to_max(got, want, 2e-2, "output")
