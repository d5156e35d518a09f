"""``compile(batch_dim=...)``: models whose batch is not dim 0 (issue 10).

A sequence-first model (``nn.TransformerEncoder(batch_first=False)``, ``src [seq, batch, d]``)
was cut along the sequence. With ``batch_dim=1`` the batch dimension of every other input and
output is read from export (the dimension it proves equal), the graph is made batch-first at its
boundary, and the pipeline computes what the model computes: outputs, loss, every gradient.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxsplit
from fxsplit.api import CompileOptions
from fxsplit.errors import ConfigError, NotPerSampleWarning
from fxsplit.ir import LinkSpec
from fxsplit.passes.capture import capture
from fxsplit.passes.per_sample import find_batch_mixing
from fxsplit.runtime.microbatch import split_target, target_batch_dim

OPTIONS = CompileOptions(link=LinkSpec(), profile_cache_dir=False)
SEQ, BATCH, WIDTH = 5, 8, 16


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=False)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    mask = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    mask[::2, -2:] = True  # padding differs between samples: a wrong split shows
    return torch.randn(SEQ, BATCH, WIDTH), mask


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _assert_trains_like(pipe, ref: nn.Module, loss_fn, target, *args, **kwargs) -> None:
    torch.testing.assert_close(pipe(*args, **kwargs), ref(*args, **kwargs), rtol=1e-5, atol=1e-5)
    loss = pipe.train_step(*args, target=target, loss_fn=loss_fn, **kwargs)
    expected = loss_fn(ref(*args, **kwargs), target)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    grads = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert list(pipe.state_dict()) == list(ref.state_dict())


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_sequence_first_encoder_trains_like_the_model_with_batch_dim_1(schedule):
    """``src [seq, batch, d]`` split on dim 1; ``src_key_padding_mask [batch, seq]`` on dim 0,
    found from the graph; the target ``[seq, batch, d]`` on dim 1."""
    model, ref = _encoder(), _encoder()
    src, mask = _batch()
    pipe = fxsplit.compile(model, 2, (src,), {"src_key_padding_mask": mask}, microbatches=4, schedule=schedule,
                           batch_dim=1, cost_model="analytic", options=OPTIONS)
    assert pipe.num_stages == 2 and pipe.microbatches == 4 and pipe.report.not_per_sample == ()
    assert pipe.layout.in_dims == (1, 0) and pipe.layout.out_dims == (1,)
    _assert_trains_like(pipe, ref, _mse, torch.randn(SEQ, BATCH, WIDTH), src, src_key_padding_mask=mask)


def test_a_per_sample_label_next_to_sequence_first_inputs_is_split_on_dim_0():
    """A ``[batch]`` label has no dim 1: it is split on dim 0 (``target_batch_dim``)."""
    model, ref = _encoder(), _encoder()
    src, mask = _batch()
    labels = torch.arange(BATCH) % WIDTH

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output.mean(0), target)

    pipe = fxsplit.compile(model, 2, (src,), {"src_key_padding_mask": mask}, microbatches=2, schedule="1f1b",
                           batch_dim=1, cost_model="analytic", options=OPTIONS)
    _assert_trains_like(pipe, ref, loss_fn, labels, src, src_key_padding_mask=mask)


@pytest.mark.parametrize("cost_model", ["analytic", "profiled"])
def test_without_batch_dim_it_runs_one_micro_batch_and_names_the_dimension(caplog, cost_model):
    """"Refuse to guess": dim 0 of this model cannot be split (the mask's batch is fixed), so
    "auto" runs one micro-batch (correct) and the log names dim 1 as the dimension no op mixes;
    asking for 4 is a ConfigError with the same hint. Regression (profiled): the profiler timed
    micro-batches of dim 0 before the check ran, and compile died in a shape error."""
    src, mask = _batch()
    with caplog.at_level(logging.WARNING, logger="fxsplit.compiler"):
        pipe = fxsplit.compile(_encoder(), 2, (src,), {"src_key_padding_mask": mask}, cost_model=cost_model,
                               options=OPTIONS)
    assert pipe.microbatches == 1
    assert "batch_dim=1" in caplog.text
    torch.testing.assert_close(pipe(src, src_key_padding_mask=mask), _encoder()(src, src_key_padding_mask=mask))
    with pytest.raises(ConfigError, match="cannot run micro-batches.*batch_dim=1"):
        fxsplit.compile(_encoder(), 2, (src,), {"src_key_padding_mask": mask}, microbatches=4, cost_model=cost_model,
                        options=OPTIONS)


def test_a_sequence_first_model_that_runs_on_part_of_dim_0_warns_with_the_hint():
    """Without a mask, attention over dim 0 runs on part of the sequence (wrong, not failing):
    micro-batches asked for are a NotPerSampleWarning naming batch_dim=1."""
    src, _ = _batch()
    with pytest.warns(NotPerSampleWarning, match="batch_dim=1"):
        pipe = fxsplit.compile(_encoder(), 2, (src,), microbatches=4, cost_model="profiled", options=OPTIONS)
    assert pipe.microbatches == 4


class _Transposed(nn.Module):
    """Batch-first input, output with the batch on dim 1 (``[seq, batch, d]``)."""

    def __init__(self, reduce: str = "mean") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reduce = reduce
        self.a, self.b = nn.Linear(WIDTH, 32), nn.Linear(32, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.b(self.a(x).relu())
        return h.transpose(0, 1), h.sum() if self.reduce == "sum" else h.mean()


def test_an_output_with_the_batch_on_dim_1_is_merged_on_dim_1():
    """Regression: an output ``[seq, batch, d]`` of a batch-first model was read as unbatched
    (export's batch symbol was looked for on dim 0 only) and the pipeline returned the first
    micro-batch's rows alone, silently. Its batch dimension now comes from the symbol wherever
    it is."""
    x = torch.randn(BATCH, SEQ, WIDTH)
    pipe = fxsplit.compile(_Transposed(), 2, (x,), microbatches=4, schedule="1f1b", cost_model="analytic",
                           options=OPTIONS)
    assert pipe.layout is not None and pipe.layout.out_dims == (1, None)
    out, total = pipe(x)
    ref_out, ref_total = _Transposed()(x)
    assert out.shape == ref_out.shape
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=1e-6)


def test_an_output_summed_over_the_batch_comes_back_as_the_sum():
    """Regression: a 0-d output that sums over the batch was averaged over the micro-batches
    (1/m of the value), silently; then flagged as not per-sample (one micro-batch). Now the
    pipeline finds that it adds up as a sum (micro-batches 0 and 1 run together) and sums it."""
    x = torch.randn(BATCH, SEQ, WIDTH)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotPerSampleWarning)
        pipe = fxsplit.compile(_Transposed("sum"), 2, (x,), microbatches=4, cost_model="analytic", options=OPTIONS)
    torch.testing.assert_close(pipe(x)[1], _Transposed("sum")(x)[1])


class _Permuted(nn.Module):
    """Per-sample layers on a batch kept at dim ``d_in`` of the input and ``d_out`` of the output."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.d_in, self.d_out = d_in, d_out
        self.a, self.b = nn.Linear(WIDTH, 24), nn.Linear(24, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.movedim(self.d_in, 0)  # [batch, seq, width]
        h = self.b(torch.tanh(self.a(h))) + h
        return h.movedim(0, self.d_out)


@settings(max_examples=6, deadline=None)
@given(d_in=st.integers(0, 1), d_out=st.integers(0, 2), m=st.integers(1, 4), batch=st.integers(4, 7),
       schedule=st.sampled_from(["gpipe", "1f1b"]))
def test_any_batch_layout_trains_like_the_model(d_in, d_out, m, batch, schedule):
    """Property: wherever the batch is on the input (``batch_dim``) and output, every micro-batch
    count and schedule give the model's outputs, loss and gradients (uneven micro-batches too)."""
    shape = [SEQ + 1, WIDTH]
    shape.insert(d_in, batch)
    x = torch.randn(*shape)
    target = torch.randn(_Permuted(d_in, d_out)(x).shape)
    pipe = fxsplit.compile(_Permuted(d_in, d_out), 2, (x,), microbatches=m, schedule=schedule, batch_dim=d_in,
                           cost_model="analytic", options=OPTIONS)
    assert pipe.microbatches == m
    _assert_trains_like(pipe, _Permuted(d_in, d_out), _mse, target, x)


@pytest.mark.parametrize(("batch_dim", "match"), [(-1, "int >= 0"), ("1", "int >= 0"), (True, "int >= 0"),
                                                  (3, "no input tensor has dimension 3"),
                                                  (2, "fixes dim 2")])
def test_a_batch_dim_that_cannot_be_the_batch_is_a_config_error(batch_dim, match):
    src, mask = _batch()
    with pytest.raises(ConfigError, match=match):
        fxsplit.compile(_encoder(), 2, (src,), {"src_key_padding_mask": mask}, batch_dim=batch_dim,
                        cost_model="analytic", options=OPTIONS)


def test_batch_dim_needs_export():
    src, _ = _batch()
    with pytest.raises(ConfigError, match="needs capture by torch.export"):
        capture(_encoder(), (src,), method="symbolic_trace", dynamic_batch=True, batch_dim=1)


def test_an_input_with_an_untied_dimension_of_the_batch_size_is_refused():
    """Refuse to guess: a second input whose dimension has the batch's size but is never tied
    to the first input's batch could be samples or a coincidence."""

    class TwoInputs(nn.Module):
        def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, bias + 1

    with pytest.raises(ConfigError, match="never ties it"):
        capture(TwoInputs(), (torch.randn(3, 8), torch.randn(8)), dynamic_batch=True, batch_dim=1)


def test_the_row_check_reads_a_batch_merged_inside_another_dimension():
    """``[seq, batch, d] -> [seq * batch, d]`` holds the first samples in every ``batch``-th row
    block, not the first rows: it is no mixing (the check compared the wrong rows before)."""

    class Flattens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [seq, batch, d]
            s, b, d = x.shape
            return self.lin(x.reshape(s * b, d)).reshape(s, b, d)

    x = torch.randn(SEQ, BATCH, WIDTH)
    cap = capture(Flattens(), (x,), dynamic_batch=True, batch_dim=1)
    assert find_batch_mixing(cap.gm, cap.flatten_inputs((x,), {}), cap.batched_inputs) == []


def test_target_batch_dim_prefers_the_inputs_batch_dim_then_dim_0():
    assert target_batch_dim(torch.zeros(5, 8), 8, 1) == 1
    assert target_batch_dim(torch.zeros(8), 8, 1) == 0
    assert target_batch_dim(torch.zeros(5, 3), 8, 1) is None
    parts = split_target({"y": torch.arange(10).view(5, 2).repeat(1, 2), "w": torch.ones(3)}, 2, 4, target_dim=1)
    assert [p["y"].shape for p in parts] == [torch.Size([5, 2])] * 2 and parts[1]["w"].shape == (3,)


def test_the_distributed_runtime_checks_batch_dim_before_any_collective():
    from fxsplit import distributed as fxd

    with pytest.raises(ConfigError, match="int >= 0"):
        fxd.compile(_encoder, (torch.randn(SEQ, BATCH, WIDTH),), batch_dim=-1)


def test_the_captured_graph_computes_the_model_in_the_model_layout():
    model = copy.deepcopy(_encoder()).eval()
    src, mask = _batch()
    cap = capture(model, (src,), {"src_key_padding_mask": mask}, dynamic_batch=True, batch_dim=1)
    assert [tuple(x.shape) for x in cap.flatten_inputs((src,), {"src_key_padding_mask": mask})] == [
        (BATCH, SEQ, WIDTH), (BATCH, SEQ)]
    torch.testing.assert_close(cap(src, src_key_padding_mask=mask), model(src, src_key_padding_mask=mask))


class _Pairs(nn.Module):
    """``x @ x.T``: an output with the batch on both dims (sample pairs)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h @ h.T


def test_an_output_pairing_samples_runs_as_one_micro_batch():
    """An output ``[batch, batch]`` has no one batch dimension to merge on: the per-sample check
    flags it (it was neither compared nor merged right), so "auto" runs one micro-batch."""
    x = torch.randn(BATCH, WIDTH)
    pipe = fxsplit.compile(_Pairs(), 2, (x,), cost_model="analytic", options=OPTIONS)
    assert pipe.microbatches == 1 and "pairs samples" in pipe.report.not_per_sample[0]
    torch.testing.assert_close(pipe(x), _Pairs()(x))
    with pytest.warns(NotPerSampleWarning, match="pairs samples"):
        fxsplit.compile(_Pairs(), 2, (x,), microbatches=2, cost_model="analytic", options=OPTIONS)


def test_batch_dim_in_compile_options_is_kept_when_the_argument_is_not_given():
    """``compile(batch_dim=0)`` by default replaced ``CompileOptions(batch_dim=1)`` silently; the
    argument now defaults to None, which keeps the options' value."""
    import dataclasses

    src, mask = _batch()
    pipe = fxsplit.compile(_encoder(), 2, (src,), {"src_key_padding_mask": mask}, microbatches=2,
                           cost_model="analytic", options=dataclasses.replace(OPTIONS, batch_dim=1))
    assert pipe.layout is not None and pipe.layout.in_dims == (1, 0)
