"""The CUDA paths of the local runtime (threads and streams); skipped without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

import fxsplit
import fxsplit.models as zoo

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_threaded_cuda_pipeline_trains_like_the_original(schedule):
    torch.manual_seed(0)
    case = zoo.get("gpt", batch_size=8)
    model = case.model.cuda()
    reference = copy.deepcopy(model)
    inputs, target = case.make_batch(8, 3)
    devices = ["cuda:0"] * 3 if torch.cuda.device_count() < 3 else ["cuda:0", "cuda:1", "cuda:2"]
    pipe = fxsplit.compile(model, devices, inputs, microbatches=4, schedule=schedule,
                           options=fxsplit.CompileOptions(allow_idle_devices=False, copy_tied=True))
    assert pipe.executor == "threads"
    loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
    ref_loss = case.loss_fn(reference(*inputs), target)
    ref_loss.backward()
    torch.testing.assert_close(loss.to(ref_loss.device), ref_loss.detach(), rtol=1e-4, atol=1e-5)
    ref = dict(reference.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad.to("cuda:0"), ref[name].grad, rtol=1e-3, atol=1e-4,
                                   msg=lambda m, n=name: f"gradient of {n}: {m}")


def _close_to_max(actual: torch.Tensor, expected: torch.Tensor, rel: float, name: str) -> None:
    scale = float(expected.abs().max()) or 1.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0.0, atol=rel * scale,
                               msg=lambda m: f"{name}: {m}")


def _on_cuda(name: str, batch: int, seed: int, autocast: str, microbatches: int, schedule: str = "1f1b"):
    """``(pipe, reference, inputs, target, case)``: ``name``'s model on ``cuda:0``, a copy of it,
    a batch on the GPU and the pipeline compiled on two stages of ``cuda:0`` under ``autocast``."""
    torch.manual_seed(0)
    case = zoo.get(name, batch_size=batch)
    model = case.model.cuda()
    reference = copy.deepcopy(model)
    inputs, target = case.make_batch(batch, seed)
    inputs, target = tuple(x.cuda() for x in inputs), target.cuda()
    pipe = fxsplit.compile(model, ["cuda:0"] * 2, inputs, microbatches=microbatches, schedule=schedule,
                           options=fxsplit.CompileOptions(autocast=autocast, allow_idle_devices=False))
    return pipe, reference, inputs, target, case


@pytest.mark.parametrize(("m", "rel"), [(1, 1e-5), (4, 2e-2)])
def test_bf16_autocast_on_cuda_trains_like_the_model_under_cuda_autocast(m, rel):
    """CUDA's autocast op list (not the CPU's) runs in the stages: the loss, every gradient and the
    forward's dtype match the unsplit model under ``torch.autocast("cuda", bfloat16)``."""
    pipe, reference, inputs, target, case = _on_cuda("gpt", 8, 3, "bf16", m)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_loss = case.loss_fn(reference(*inputs), target)
    ref_loss.backward()
    loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
    _close_to_max(loss.to("cuda:0"), ref_loss.detach(), rel, "loss")
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        assert p.dtype == torch.float32
        _close_to_max(p.grad, ref[name].grad, rel, f"gradient of {name}")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        expected = reference(*inputs)
    assert pipe(*inputs).dtype == expected.dtype == torch.bfloat16


def test_fp16_with_a_cuda_grad_scaler_steps_like_the_model():
    pipe, reference, inputs, target, case = _on_cuda("mlp", 8, 5, "fp16", 1)
    opts = [torch.optim.SGD(mod.parameters(), lr=0.1) for mod in (reference, pipe)]
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**10) for _ in range(2)]
    with torch.autocast("cuda", dtype=torch.float16):
        ref_loss = case.loss_fn(reference(*inputs), target)
    scalers[0].scale(ref_loss).backward()
    loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn, grad_scaler=scalers[1])
    torch.testing.assert_close(loss.to("cuda:0"), ref_loss.detach(), rtol=1e-3, atol=1e-4)
    for opt, scaler in zip(opts, scalers, strict=True):
        scaler.step(opt)
        scaler.update()
    state = reference.state_dict()
    for k, v in pipe.state_dict().items():
        torch.testing.assert_close(v.to("cuda:0"), state[k], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("autocast", [None, pytest.param("bf16", marks=pytest.mark.xfail(
    strict=True, reason="issue 13: under CUDA autocast the saved activations measured 1.5-1.8x the charge on an "
                        "H100 (fp32 and CPU bf16 match); the fake run of the activation-memory pass is the suspect"))])
def test_each_cuda_stage_holds_at_most_what_the_memory_model_charges(autocast):
    """The saved-tensor meter of test_memory_model on CUDA stages (GPipe, 4 micro-batches)."""
    from test_memory_model import _SavedBytes

    from fxsplit.schedule import simulate_plan

    case = zoo.get("gpt", size="small", batch_size=16)
    inputs, target = case.make_batch(16, 1)
    inputs, target = tuple(x.cuda() for x in inputs), target.cuda()
    pipe = fxsplit.compile(copy.deepcopy(case.model).cuda(), ["cuda:0"] * 2, inputs, microbatches=4, schedule="gpipe",
                           cost_model="analytic",
                           options=fxsplit.CompileOptions(executor="sequential", allow_idle_devices=False,
                                                          recompute="none", autocast=autocast))
    meter = _SavedBytes(pipe.num_stages, {p.untyped_storage().data_ptr() for p in pipe.parameters()})
    for s, stage in enumerate(pipe.stages):
        stage.gm.register_forward_pre_hook(lambda *_, s=s: setattr(meter, "stage", s))
        stage.gm.register_forward_hook(lambda *_: setattr(meter, "stage", None))
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda h: h.t):
        pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
    flight = simulate_plan(pipe.plan, "gpipe", pipe.microbatches).peak_in_flight
    for s, st in enumerate(pipe.plan.stages):
        charged = (sum(pipe.plan.graph.blocks[b].activation_bytes for b in st.blocks) + st.in_bytes) * flight[s]
        assert 0 < meter.peak[s] <= 1.02 * charged, f"stage {s}: measured {meter.peak[s]} B, charged {charged} B"
