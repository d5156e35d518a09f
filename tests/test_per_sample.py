"""Models that are not per-sample: found at compile, one micro-batch under "auto", a warning otherwise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.errors import NotPerSampleWarning
from fxsplit.passes.capture import capture
from fxsplit.passes.per_sample import find_batch_mixing


class _Net(nn.Module):
    """Linear layers with dropout; ``mode`` adds one way of not being per-sample."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.a, self.b, self.c = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 8)
        self.drop = nn.Dropout(0.3)
        self.bn = nn.BatchNorm1d(32)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.a(x).relu())
        if self.mode == "center":
            h = h - h.mean(0)  # mixes the samples of the batch
        elif self.mode == "batchnorm":
            h = self.bn(h)
        elif self.mode == "counter":
            self.steps += 1
        elif self.mode == "ema":  # a moving average of the activations: reads the data
            self.steps.mul_(0.9).add_(0.1 * h.detach().mean())
        elif self.mode == "rows":  # sample positions differ between a batch and its half; the rows do not
            h = h[torch.arange(h.shape[0])]
        return self.c(self.b(h).relu())


def test_indexing_the_samples_by_position_is_per_sample():
    """Regression: ``arange(batch)`` differs between a batch and its half, but ``h[arange(batch)]``
    does not; only a node that a differing output depends on is reported."""
    assert _found(_Net("rows").eval(), torch.randn(8, 8)) == []


def _found(model: nn.Module, x: torch.Tensor) -> list:
    cap = capture(model, (x,), dynamic_batch=True)
    return find_batch_mixing(cap.gm, cap.flatten_inputs((x,), {}), cap.batched_inputs or [True])


@pytest.mark.parametrize(("mode", "kind", "node"), [("center", "mixes samples", "sub"),
                                                    ("batchnorm", "mixes samples", "batch_norm"),
                                                    ("counter", "updates a buffer", "add_")])
def test_what_is_not_per_sample_is_found_with_its_node_and_line(mode, kind, node):
    found = _found(_Net(mode), torch.randn(8, 8))
    assert [(f.kind, f.node) for f in found] == [(kind, node)]
    if mode != "batchnorm":  # the model's own line (BatchNorm's is in torch)
        assert "test_per_sample.py" in found[0].where, found[0]


def test_per_sample_models_with_dropout_are_not_flagged():
    assert _found(_Net("plain"), torch.randn(8, 8)) == []


def test_a_sequence_first_transformer_is_found_mixing_its_dim_0():
    """Issue 10: ``TransformerEncoder(batch_first=False)`` takes ``[seq, batch, d]``; cutting dim 0
    cut the sequence, so attention saw part of it and outputs were silently wrong."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=False)
    found = _found(nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval(), torch.randn(6, 4, 16))
    assert found and found[0].kind == "mixes samples", found


def test_compile_runs_a_model_that_mixes_samples_as_one_micro_batch():
    """Issue 10: ``microbatches="auto"`` picked m > 1 for such a model without a word."""
    model, x = _Net("center").train(), torch.randn(8, 8)
    ref = _Net("center")
    ref.load_state_dict(model.state_dict())
    pipe = fxsplit.compile(model, ["cpu", "cpu"], (x,), options=fxsplit.CompileOptions(allow_idle_devices=False))
    assert pipe.microbatches == 1
    assert pipe.report.not_per_sample and "'sub'" in pipe.report.not_per_sample[0]
    torch.manual_seed(0)
    loss = pipe.train_step(x, target=torch.zeros(8, 8), loss_fn=nn.functional.mse_loss)
    torch.manual_seed(0)
    torch.testing.assert_close(loss, nn.functional.mse_loss(ref(x), torch.zeros(8, 8)))


def test_asking_for_micro_batches_of_such_a_model_warns_naming_the_node():
    with pytest.warns(NotPerSampleWarning, match=r"microbatches=2.*node 'mul_'.*buffer 'steps'"):
        pipe = fxsplit.compile(_Net("ema"), ["cpu", "cpu"], (torch.randn(8, 8),), microbatches=2)
    assert pipe.microbatches == 2


class _Counted(nn.Module):
    """A step counter read before and after its update, on both sides of a stage boundary."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 8)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * (1 + self.steps)  # before the update: the value the step began with
        self.steps += 1
        return self.c(self.b(h).relu() * self.steps)  # after: the updated value


@pytest.mark.parametrize(("m", "schedule"), [(1, "1f1b"), (2, "gpipe"), (4, "1f1b"), (3, "gpipe")])
def test_a_counter_updated_in_forward_counts_once_per_step_exactly(m, schedule):
    """Issue 10: a buffer update that reads no input ran once per micro-batch (the counter
    advanced m times a step); it now runs on the first micro-batch only, and reads before it see
    the step's starting value in every micro-batch: outputs, gradients and the buffer equal the
    unsplit model's over several steps, with no warning. (m = 1, regression: export's no-op
    write-back ``copy_(steps, add_)`` bumped the buffer's version after ``mul`` saved it, and
    every backward failed; capture now drops it.)"""
    import warnings

    model, ref = _Counted(), _Counted()
    x = torch.randn(8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotPerSampleWarning)
        pipe = fxsplit.compile(model, ["cpu", "cpu", "cpu"], (x,), microbatches=m, schedule=schedule,
                               cost_model="analytic", options=fxsplit.CompileOptions(allow_idle_devices=False))
    assert pipe.microbatches == m and pipe.report.not_per_sample == ()
    for step in range(3):
        torch.testing.assert_close(pipe(x), ref(x))
        loss = pipe.train_step(x, target=torch.zeros(8, 8), loss_fn=nn.functional.mse_loss)
        expected = nn.functional.mse_loss(ref(x), torch.zeros(8, 8))
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        assert float(pipe.state_dict()["steps"]) == float(ref.steps) == 2 * (step + 1)
    grads = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=lambda msg, n=name: f"{n}: {msg}")


def test_a_per_sample_model_keeps_its_micro_batches():
    pipe = fxsplit.compile(_Net("plain"), ["cpu", "cpu"], (torch.randn(8, 8),), microbatches=4)
    assert pipe.report.not_per_sample == () and pipe.microbatches == 4


def test_the_distributed_compile_warns_about_buffers_a_meta_capture_shows():
    """Without rank 0's full check (meta inputs, or a model too big for rank 0), only the buffer
    part runs on the meta capture; rank 0 warns when more than one micro-batch is asked for."""
    import warnings

    from fxsplit.distributed import _warn_if_not_per_sample

    with torch.device("meta"):
        model = _Net("counter")
    gm = capture(model, (torch.empty(8, 8, device="meta"),), dynamic_batch=True).gm
    with pytest.warns(NotPerSampleWarning, match=r"microbatches=4.*buffer 'steps'.*were not checked"):
        _warn_if_not_per_sample(gm, 4, 0, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_if_not_per_sample(gm, 1, 0, None)  # one micro-batch: nothing to warn about
        _warn_if_not_per_sample(gm, 4, 1, None)  # rank 0 alone speaks
        _warn_if_not_per_sample(gm, 4, 0, [])  # rank 0 checked and found nothing


@pytest.mark.parametrize(("mode", "expected"), [("center", "node 'sub'"), ("counter", "buffer 'steps'"),
                                                ("plain", None)])
def test_rank_0_checks_the_meta_capture_materialised_with_stand_in_weights(mode, expected):
    """Issue 10: the distributed path found only buffers; rank 0 now materialises the meta
    capture with stand-in weights and runs the full check on the real example batch."""
    from fxsplit.dist_plan import per_sample_on_rank0

    with torch.device("meta"):
        model = _Net(mode)
    x = torch.randn(8, 8)
    captured = capture(model, (x.to("meta"),), dynamic_batch=True)
    found = per_sample_on_rank0(captured, ((x,), {}), torch.device("cpu"))
    assert found is not None
    assert (found == []) if expected is None else (expected in found[0]), found
    assert per_sample_on_rank0(captured, ((x.to("meta"),), {}), torch.device("cpu")) is None  # nothing real to run


@pytest.mark.parametrize("method", ["export", "symbolic_trace"])
def test_random_ops_are_found_by_whole_name_module_and_attention_dropout(method: str) -> None:
    """Review finding: a symbolic_trace ``nn.Dropout`` (a module call) and attention with
    ``dropout_p`` were not seen as random; ``F.normalize`` was ("normal")."""
    import torch.nn.functional as F
    from torch import nn

    from fxsplit.passes.capture import capture
    from fxsplit.passes.per_sample import is_random

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop, self.fc = nn.Dropout(0.5), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.normalize(self.fc(x), dim=-1)
            q = y.view(2, 1, 4, 8)
            a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.3)
            return self.drop(y) + a.view(8, 8) + torch.rand_like(y)

    gm = capture(M().train(), (torch.randn(8, 8),), method=method).gm
    random = [n.name for n in gm.graph.nodes if is_random(n)]
    assert len(random) == 3 and not any("normalize" in r for r in random), random
