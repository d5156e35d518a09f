"""A stage's backward in two halves, for zero-bubble schedules: ``I`` (input gradients) then ``W``.

``I`` computes the gradients of the stage's inputs, which the previous stage waits for, and
keeps what the weight gradients need; ``W`` computes the weight gradients later, in a bubble.
Both halves are torch's own (``torch.distributed.pipelining._backward``: ``stage_backward_input``
hooks the autograd nodes where the input path meets each weight's path and saves their
gradients; ``stage_backward_weight`` resumes from them), so the local pipeline splits a backward
exactly as torch's pipeline stages do across processes.

Two cases where torch's split would be wrong or cannot help are handled here, never silently:

* the first stage, whose inputs need no gradient: ``I`` has nothing to compute and ``W`` runs
  the whole backward (as torch's stage does);
* a weight whose gradient path never meets an input's (a parameter used only on a branch that
  reads no stage input): torch's parameter groups would leave it out and its gradient would be
  lost, so such a stage runs its whole backward in ``I`` and ``W`` has nothing left to do.

References:
    Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §2 (the B/W split).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    get_param_groups,
    reverse_closure,
    stage_backward_input,
    stage_backward_weight,
)

__all__ = ["PendingWeights", "backward_input", "backward_weight", "detachable"]

log = logging.getLogger(__name__)


class _Alias(torch.autograd.Function):
    """Identity whose output shares the input's storage without being a view of it: torch's
    ``stage_backward_input`` detaches the outputs it is given in place, and a stage output can
    be a tensor that the weight half still reads (saved by a later op of the stage, or by its
    own op); it detaches the alias instead."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def detachable(values: Sequence[Any]) -> list[Any]:
    """``values`` with each tensor that carries a graph behind an alias that torch's backward
    halves may detach in place (:class:`_Alias`); other values as they are."""
    return [_Alias.apply(v) if isinstance(v, torch.Tensor) and v.requires_grad else v for v in values]


@dataclass
class PendingWeights:
    """What ``W`` still has to do for one (stage, micro-batch).

    Attributes:
        weights: The stage's trainable parameters.
        param_groups: torch's saved intermediate gradients (None when nothing is left).
        roots, root_grads: For the whole backward run by ``W`` (the first stage), else empty.
    """

    weights: list[torch.nn.Parameter]
    param_groups: list[dict[str, Any]] | None = None
    roots: Sequence[torch.Tensor] = ()
    root_grads: Sequence[torch.Tensor] = ()


def _roots(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs that carry a graph and their gradients (ones for a loss)."""
    roots, root_grads = [], []
    for k, o in enumerate(outputs):
        g = None if grads is None else grads[k]
        if o is None or not o.requires_grad or (grads is not None and g is None):
            continue
        roots.append(o)
        root_grads.append(torch.ones_like(o) if g is None else (g if g.device == o.device else g.to(o.device)))
    return roots, root_grads


def _splittable(roots: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], weights: Sequence[torch.nn.Parameter]) -> bool:
    """Whether torch's split gives every weight its whole gradient: each weight the outputs'
    graph reaches meets the inputs' path (torch's parameter groups cover it), and no path from a
    weight reaches an output without meeting the inputs' path first (I skips such a path and W
    starts from the meeting points only, so that part of the gradient would be lost)."""
    root_fns = [fn for fn in map(_get_grad_fn_or_grad_acc, roots) if fn is not None]
    reverse = construct_reverse_graph(root_fns)
    input_fns = [fn for fn in map(_get_grad_fn_or_grad_acc, inputs) if fn is not None]
    reached = [fn for fn in map(_get_grad_fn_or_grad_acc, weights) if fn is not None and fn in reverse]
    covered: set[Any] = set()
    for group in get_param_groups(input_fns, reached, reverse):
        covered |= group["params"]
    if not covered >= set(reached):
        return False
    inputs_closure, _ = reverse_closure(input_fns, set(), reverse)
    outputs = set(root_fns) - inputs_closure
    return not any(reverse_closure([w], inputs_closure, reverse)[0] & outputs for w in reached)


def backward_input(
    outputs: Sequence[torch.Tensor | None],
    grads: Sequence[torch.Tensor | None] | None,
    inputs: Sequence[torch.Tensor | None],
    weights: Sequence[torch.nn.Parameter],
    whole: bool = False,
) -> tuple[list[torch.Tensor | None], PendingWeights]:
    """Run ``I``: the gradients of ``inputs`` from ``outputs`` (their gradients ``grads``; None
    for a loss), keeping what :func:`backward_weight` needs.

    Args:
        outputs: ``[num_outputs]`` the stage's output leaves (None for non-tensors), or ``[loss]``.
        grads: ``[num_outputs]`` gradients received for them, or None for a loss.
        inputs: ``[num_inputs]`` the stage's input leaves (autograd leaves of their own).
        weights: The stage's trainable parameters.
        whole: Run the whole backward here and leave ``W`` nothing (a stage that recomputes its
            activations: torch's weight half starts one autograd run per parameter group, and
            each would run the stage's forward again).

    Returns:
        ``([num_inputs] input gradients, None where an input needs none; what W must finish)``.
    """
    roots, root_grads = _roots([o for o in outputs if o is not None], None if grads is None else
                               [g for o, g in zip(outputs, grads, strict=True) if o is not None])
    needing = [t for t in inputs if t is not None and t.requires_grad]
    pending = PendingWeights(list(weights))
    if not roots:
        return [None] * len(inputs), pending
    if not needing:  # the first stage: nothing to hand back, W runs the whole backward
        pending.roots, pending.root_grads = roots, root_grads
        return [None] * len(inputs), pending
    if whole or not _splittable(roots, needing, weights):
        log.debug("whole backward in I (%s)", "recomputing stage" if whole else "a weight's gradient path meets no stage input")
        torch.autograd.backward(roots, root_grads)
        return [t.grad if t is not None and t.requires_grad else None for t in inputs], pending
    _, pending.param_groups = stage_backward_input(detachable(roots), root_grads, needing, iter(weights))
    return [t.grad if t is not None and t.requires_grad else None for t in inputs], pending


def backward_weight(pending: PendingWeights) -> None:
    """Run ``W``: accumulate the weight gradients into ``.grad`` (what :func:`backward_input` left)."""
    if pending.roots:
        torch.autograd.backward(list(pending.roots), list(pending.root_grads))
    elif pending.param_groups:  # a graph node two groups pass through is run by both: keep it
        stage_backward_weight(iter(pending.weights), pending.param_groups, retain_graph=True)
