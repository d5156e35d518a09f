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
