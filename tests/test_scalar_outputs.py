"""0-d outputs a model computes itself (its own loss, a count): how they add up over
micro-batches is found by running two micro-batches together (``merge_outputs`` used to average
every 0-d output by samples, so a token mean over uneven padding or a sum came back silently
different from the model's)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxsplit
from fxsplit.errors import ConfigError
from fxsplit.runtime.microbatch import DrawsAsExpected, check_loss_pair, scalar_reductions


class _OwnLoss(nn.Module):
    """A language model that returns its logits and its own loss: cross_entropy's token mean
    (skipping -100), or with ``kind="sum"`` the token sum, or ``"sample"`` the per-sample mean
    of token sums; ``dropout`` in training mode."""

    def __init__(self, kind: str = "mean", dropout: float = 0.0) -> None:
        super().__init__()
        self.kind = kind
        self.emb, self.mid, self.head = nn.Embedding(32, 16), nn.Linear(16, 16), nn.Linear(16, 32)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.drop(torch.tanh(self.mid(self.emb(ids)))))
        flat_logits, flat_labels = logits.flatten(0, 1), labels.flatten()
        if self.kind == "mean":
            loss = F.cross_entropy(flat_logits, flat_labels)
        elif self.kind == "sum":
            loss = F.cross_entropy(flat_logits, flat_labels, reduction="sum")
        else:
            loss = F.cross_entropy(flat_logits, flat_labels, reduction="sum") / ids.shape[0]
        return logits, loss


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(2))
    uneven = labels.clone()
    uneven[0, 2:] = -100
    return ids, labels, uneven


def _compile(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> fxsplit.CompiledPipeline:
    return fxsplit.compile(model, ["cpu"] * 2, (ids, labels), microbatches=2, cost_model="analytic")


@pytest.mark.parametrize("kind", ["mean", "sum", "sample"])
def test_a_models_own_loss_comes_back_as_the_model_computes_it(kind: str) -> None:
    """A token mean without padding is a per-sample mean, a token sum adds up, a per-sample
    mean of sums is weighted by samples: each comes back as the model's value (the sum was
    averaged before)."""
    torch.manual_seed(0)
    model = _OwnLoss(kind).eval()
    ids, labels, uneven = _batch()
    pipe = _compile(model, ids, labels)
    for lab in (labels, uneven) if kind != "mean" else (labels,):
        logits, loss = pipe(ids, lab)
        ref_logits, ref_loss = model(ids, lab)
        torch.testing.assert_close(logits, ref_logits)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)


def test_a_token_mean_over_uneven_padding_is_refused_in_forward_and_in_training() -> None:
    """The model's own token mean with uneven padding: no weighting of the micro-batches gives
    it. The forward raises instead of returning the samples' mean; ``train_step`` reading it
    raises (with the joint value, not micro-batch 0's) and leaves the gradients alone."""
    torch.manual_seed(0)
    model = _OwnLoss("mean").eval()
    ids, labels, uneven = _batch()
    pipe = _compile(model, ids, labels)
    with pytest.raises(ConfigError, match="output 1 of the model is 0-d and neither the mean nor the sum"):
        pipe(ids, uneven)
    true = float(model(ids, uneven)[1])
    with pytest.raises(ConfigError, match=f"together gives {true:.6g}, but the pipeline would count"):
        pipe.train_step(ids, uneven, loss_fn=lambda out, _: out[1])
    assert all(p.grad is None for p in pipe.parameters())


def test_training_on_the_models_own_loss_matches_the_model_with_dropout_in_the_stages() -> None:
    """Even padding, the model's own loss as loss_fn: the step's loss and every gradient are the
    model's. With dropout in training mode the pair is compared without draws (so no false
    refusal), and the check draws nothing from the generator."""
    torch.manual_seed(0)
    model = _OwnLoss("mean", dropout=0.0)
    ids, labels, _ = _batch()
    pipe = _compile(model, ids, labels)
    ref = copy.deepcopy(model)
    ref_loss = ref(ids, labels)[1]
    ref_loss.backward()
    loss = pipe.train_step(ids, labels, loss_fn=lambda out, _: out[1])
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    grads = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)

    dropped = _compile(_OwnLoss("mean", dropout=0.5).train(), ids, labels)
    for _ in range(3):  # dropout masks differ per micro-batch; the check compares expectations
        dropped.train_step(ids, labels, loss_fn=lambda out, _: out[1])
        dropped(ids, labels)


def test_draws_as_expected_turns_dropout_off_and_refuses_other_draws() -> None:
    x = torch.randn(3, 4, 8)
    state = torch.get_rng_state()
    with DrawsAsExpected():
        torch.testing.assert_close(F.dropout(x, 0.3, training=True), x)
        torch.testing.assert_close(torch.ops.aten.native_dropout.default(x, 0.3, True)[0], x)
        q = x.unsqueeze(0)
        torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q, dropout_p=0.5),
                                   F.scaled_dot_product_attention(q, q, q))
        with pytest.raises(ConfigError, match="draws random numbers"):
            torch.randn(3)
    assert torch.equal(torch.get_rng_state(), state)


@settings(max_examples=200, deadline=None)
@given(a=st.floats(-1e3, 1e3), b=st.floats(-1e3, 1e3), n0=st.integers(1, 9), n1=st.integers(1, 9),
       kind=st.sampled_from(["mean", "sum", "other"]))
def test_scalar_reductions_names_the_rule_the_joint_value_follows(a: float, b: float, n0: int, n1: int,
                                                                  kind: str) -> None:
    """The joint value as the samples' mean gives "mean", as the sum "sum"; a value far from both
    is refused (a value that is both, e.g. 0 and 0, is a mean)."""
    mean, total = (n0 * a + n1 * b) / (n0 + n1), a + b
    got = {"mean": mean, "sum": total, "other": mean + total + 1e3 + 0.01 * (abs(a) + abs(b))}[kind]
    parts = [[torch.tensor(a, dtype=torch.float64)], [torch.tensor(b, dtype=torch.float64)]]
    joint = [torch.tensor(got, dtype=torch.float64)]
    far = abs(got - mean) > 1e-4 * max(abs(got), abs(mean), 1.0) and abs(got - total) > 1e-4 * max(abs(got), abs(total), 1.0)
    if kind == "other" and far:
        with pytest.raises(ConfigError, match="neither the mean nor the sum"):
            scalar_reductions(parts, joint, [n0, n1], [0])
        return
    rule = scalar_reductions(parts, joint, [n0, n1], [0])[0]
    assert rule == "mean" if abs(got - mean) <= 1e-5 * max(abs(got), abs(mean)) + 1e-12 else rule == "sum"


def test_the_loss_pair_check_without_a_joint_run_refuses_a_0d_output_that_differs() -> None:
    """What fxsplit.distributed calls: it cannot run two micro-batches together, so a 0-d
    output that differs between them (which it used to take from micro-batch 0) is refused."""
    outs = [[torch.ones(2, 3), torch.tensor(1.0)], [torch.zeros(2, 3), torch.tensor(2.0)]]
    with pytest.raises(ConfigError, match="output 1 of the model has no batch dimension and differs"):
        check_loss_pair(lambda out, _: out[1], outs, [None, None], [2, 2], "mean", [True, False], lambda f: f)
    same = [[torch.ones(2, 3), torch.tensor(1.0)], [torch.zeros(2, 3), torch.tensor(1.0)]]
    check_loss_pair(lambda out, _: out[0].mean(), same, [None, None], [2, 2], "mean", [True, False], lambda f: f)


def test_padding_in_a_later_micro_batch_is_refused_too() -> None:
    """Regression (a probe of Hugging Face training patterns): only micro-batches 0 and 1 were
    checked, so a token mean whose uneven padding sits in micro-batches 2 and 3 trained on
    another loss, silently. Now every two consecutive micro-batches are checked for a loss_fn's
    token mean, and a model's own 0-d loss against all micro-batches run together."""
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(2))
    late = labels.clone()
    late[6, 1:] = -100  # micro-batch 3 of 4 (samples 6 and 7); 0 and 1 unpadded

    def token_mean(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    logits_only = nn.Sequential(nn.Embedding(32, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 32))
    plain = fxsplit.compile(logits_only, ["cpu"] * 2, (ids,), microbatches=4, cost_model="analytic")
    with pytest.raises(ConfigError, match="loss_fn over micro-batches 2 and 3 together"):
        plain.train_step(ids, target=late, loss_fn=token_mean)
    assert all(p.grad is None for p in plain.parameters())
    plain.train_step(ids, target=labels, loss_fn=token_mean)  # no padding: a per-sample mean

    model = _OwnLoss("mean").eval()
    pipe = fxsplit.compile(model, ["cpu"] * 2, (ids, labels), microbatches=4, cost_model="analytic")
    with pytest.raises(ConfigError, match=r"loss_fn over micro-batches 0\.\.3 together gives "
                                          f"{float(model(ids, late)[1]):.6g}"):
        pipe.train_step(ids, late, loss_fn=lambda out, _: out[1])
    with pytest.raises(ConfigError, match="output 1 of the model is 0-d and neither"):
        pipe(ids, late)
    assert all(p.grad is None for p in pipe.parameters())
    pipe.train_step(ids, labels, loss_fn=lambda out, _: out[1])
