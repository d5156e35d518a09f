"""The backward in two halves (zero-bubble's I and W) against the whole backward."""

from __future__ import annotations

import torch

from fxsplit.runtime.split_backward import backward_input, backward_weight


def _reference(make):
    x, weights, outputs, grads = make()
    torch.autograd.backward(outputs, grads)
    return x.grad, [w.grad for w in weights]


def _assert_halves_equal_the_whole(make) -> None:
    """``make()`` -> (input, weights, outputs, output gradients or None): I then W give the
    input's and every weight's gradient of the whole backward."""
    ref_x, ref_w = _reference(make)
    x, weights, outputs, grads = make()
    in_grads, pending = backward_input(outputs, grads, [x], weights)
    backward_weight(pending)
    torch.testing.assert_close(in_grads[0], ref_x)
    for w, r in zip(weights, ref_w, strict=True):
        torch.testing.assert_close(w.grad, r)


def _stage():
    torch.manual_seed(0)
    x = torch.randn(4, 3, requires_grad=True)
    w1, w2 = torch.randn(3, 5, requires_grad=True), torch.randn(5, requires_grad=True)
    h = (x @ w1).tanh()  # tanh saves its output: the weight half reads a tensor the stage sends
    out = h * w2
    return x, [w1, w2], [out, h], [torch.randn(4, 5), torch.randn(4, 5)]


def test_input_half_gives_the_input_gradient_and_the_weight_half_the_rest():
    ref_x, ref_w = _reference(_stage)
    x, weights, outputs, grads = _stage()
    in_grads, pending = backward_input(outputs, grads, [x], weights)
    torch.testing.assert_close(in_grads[0], ref_x)
    assert all(w.grad is None for w in weights), "I computed weight gradients"
    backward_weight(pending)
    for w, r in zip(weights, ref_w, strict=True):
        torch.testing.assert_close(w.grad, r)


def test_a_weight_whose_path_meets_no_input_is_not_lost():
    """torch's parameter groups leave out a weight that reaches the outputs without meeting an
    input (here an output of its own); the stage then runs its whole backward in I."""
    def stage():
        torch.manual_seed(1)
        x = torch.randn(4, 3, requires_grad=True)
        w1, w2 = torch.randn(3, 5, requires_grad=True), torch.randn(5, requires_grad=True)
        return x, [w1, w2], [x @ w1, w2 * 2], [torch.randn(4, 5), torch.randn(5)]

    _assert_halves_equal_the_whole(stage)


def test_a_first_stage_runs_its_whole_backward_in_the_weight_half():
    torch.manual_seed(2)
    ids = torch.tensor([0, 2, 1])
    emb = torch.randn(4, 3, requires_grad=True)
    loss = emb[ids].pow(2).sum()
    in_grads, pending = backward_input([loss], None, [ids], [emb])
    assert in_grads == [None] and emb.grad is None
    backward_weight(pending)
    expected = torch.zeros(4, 3)
    expected[ids] = 2 * emb.detach()[ids]
    torch.testing.assert_close(emb.grad, expected)


def test_a_weight_that_reaches_an_output_past_the_inputs_keeps_that_part_of_its_gradient():
    """Regression (review): ``W`` meets the input path (``x @ W``) and also reaches an output on
    its own (``W * 2``); torch's groups cover ``W`` through the first use only, so a split lost
    the second part of its gradient. Such a stage now runs its whole backward in I."""
    def stage():
        torch.manual_seed(3)
        x = torch.randn(2, 3, requires_grad=True)
        w = torch.randn(3, 3, requires_grad=True)
        return x, [w], [x @ w, w * 2], [torch.randn(2, 3), torch.randn(3, 3)]

    _assert_halves_equal_the_whole(stage)


def test_a_weight_used_at_two_depths_splits_without_freeing_what_the_other_group_needs():
    """Regression (review): a weight-made tensor added to the activations and multiplied into a
    later layer's output (a shared position table) puts graph nodes on two groups' paths; W
    freed them after the first group and the second raised "backward through the graph a
    second time"."""
    def stage():
        torch.manual_seed(4)
        x = torch.randn(3, 4, requires_grad=True)
        pe = torch.randn(4, requires_grad=True)
        lin = torch.nn.Linear(4, 4)
        p = pe.tanh() * 2
        out = lin(torch.relu(x) + p) * p
        return x, [pe, *lin.parameters()], [out.pow(2).mean()], None

    _assert_halves_equal_the_whole(stage)
