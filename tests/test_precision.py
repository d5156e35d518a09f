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


def test_distributed_refuses_fp16_without_loss_scaling() -> None:
    import fxsplit.distributed as fxd

    case = zoo.get("mlp", batch_size=4)
    with pytest.raises(ConfigError, match=r"autocast='fp16' needs loss scaling.*use autocast='bf16'"):
        fxd.compile(lambda: case.model, case.example_inputs, options=fxsplit.CompileOptions(autocast="fp16"))


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
