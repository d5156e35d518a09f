"""Activation recomputation of a stage: keep its inputs, run its forward again in backward.

A stage the plan marks ``recompute`` (:attr:`fxsplit.ir.StagePlan.recompute`) runs its
``GraphModule`` under :func:`torch.utils.checkpoint.checkpoint` (non-reentrant, random state
preserved, so dropout draws the same masks): the forward keeps only what the stage received, and
the backward runs the forward once more to rebuild the activations it needs. Both runtimes call
:class:`RecomputedForward` where they would call the stage.

The second forward must compute what the first one computed and change nothing it already did.
It reads every buffer at the value the first forward read, also one that the first forward
itself updated (a step counter, a running normaliser, however the graph writes it) or another
stage updated in between (stages on one device share the tensor): each forward keeps a copy of
the stage's buffers (small beside its activations) for its recomputation. Every buffer
the second forward writes (also ``nn.BatchNorm``'s running statistics in a ``symbolic_trace``
graph) is put back as it was before it ran, and a deferred BatchNorm
(:class:`~fxsplit.codegen.batchnorm.DeferredBatchNorm`) does not record the micro-batch's
statistics twice. Updates fxsplit already runs once per step
(:class:`~fxsplit.codegen.buffers.OncePerStep`) need nothing: the step's first call ran them.

References:
    Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016;
    Huang et al., "GPipe", NeurIPS 2019, §2.3 (re-materialisation per stage);
    https://pytorch.org/docs/stable/checkpoint.html
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.utils.checkpoint import checkpoint

from fxsplit.codegen.batchnorm import DeferredBatchNorm
from fxsplit.codegen.buffers import OncePerStep, StepStartValue
from fxsplit.errors import ExecutionError

__all__ = ["RecomputedForward"]


class RecomputedForward:
    """Call a stage's ``GraphModule`` keeping only its inputs for backward.

    Args:
        gm: The stage's code; its parameters stay where they are (no wrapper module, so state
            names do not change).
        run: What runs the stage, when not ``gm`` itself (a stage split over tensor-parallel
            ranks: its :class:`~fxsplit.runtime.tensor_parallel.ParallelGraph`, whose collectives
            run again in backward, on every rank in the same order); ``gm`` still holds the
            buffers replayed.

    Shape:
        ``__call__(*values)`` takes and returns what ``gm`` does. Without autograd (no grad
        mode, or nothing that requires a gradient) it is ``gm(*values)``.
    """

    def __init__(self, gm: torch.fx.GraphModule, run: Callable[..., Any] | None = None) -> None:
        self.gm = gm
        self.run: Callable[..., Any] = run if run is not None else gm
        self._deferred = [m for m in gm.modules() if isinstance(m, DeferredBatchNorm)]
        self._trackers = list({id(m.tracker): m.tracker for m in gm.modules()
                               if isinstance(m, OncePerStep | StepStartValue)}.values())
        # buffers whose updates run once per step (the trackers hold them): the tracker already
        # makes the second forward read what the first read, from the live buffer
        once = [b for t in self._trackers for b in t.tracked.values()]
        self._replayed = [b for b in gm.buffers() if not any(b is o for o in once)]

    def __call__(self, *values: Any) -> Any:
        if not torch.is_grad_enabled() or not self._needs_grad(values):
            return self.run(*values)
        calls = [0]
        with torch.no_grad():  # what the first forward reads
            before = [(b, b.detach().clone()) for b in self._replayed]
        commits = [t.commits for t in self._trackers]

        def run(*inputs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                return self.run(*inputs)
            if [t.commits for t in self._trackers] != commits:
                raise ExecutionError(
                    "a recomputing stage runs its forward again after its step ended (pipe(x) then loss.backward()): "
                    "the buffer updates fxsplit runs once per step can no longer be replayed, so the recomputed "
                    "activations would differ; use pipe.train_step(...), or recompute='none', or microbatches=1")
            return self._again(inputs, before)

        return checkpoint(run, *values, use_reentrant=False, preserve_rng_state=True)

    def _needs_grad(self, values: tuple[Any, ...]) -> bool:
        leaves = [v for v in torch.utils._pytree.tree_leaves(values) if isinstance(v, torch.Tensor)]
        return any(t.requires_grad for t in leaves) or any(p.requires_grad for p in self.gm.parameters())

    def _again(self, inputs: tuple[Any, ...], before: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """The forward run a second time on the buffer values the first run read (``before``),
        with the stage's buffers and deferred statistics left afterwards as they were before it.
        Buffers are compared by value: kernels such as BatchNorm's update their running
        statistics without bumping the tensor's version counter."""
        with torch.no_grad():
            saved = [(b, b.detach().clone()) for b in self.gm.buffers()]
            for b, value in before:
                if not torch.equal(b, value):
                    b.copy_(value)
        for m in self._deferred:
            m.replaying = True
        try:
            return self.run(*inputs)
        finally:
            for m in self._deferred:
                m.replaying = False
            with torch.no_grad():  # only what changed: a copy bumps the version of a buffer
                for b, value in saved:  # another stage may have saved for its backward
                    if not torch.equal(b, value):
                        b.copy_(value)
