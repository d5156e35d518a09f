"""Deferred BatchNorm: running statistics tracked over the whole batch, not per micro-batch.

In training mode a BatchNorm normalises with the statistics of the batch it sees and updates its
running mean and variance with them. Split into ``m`` micro-batches, the original graph would
update the running statistics ``m`` times with micro-batch statistics (and count ``m`` batches).
This rewrite keeps each micro-batch normalised by its own statistics (what every pipeline does,
GPipe included) but *defers* the running-statistics update: every micro-batch adds its
per-channel sums to a :class:`BatchNormTracker`, and :meth:`BatchNormTracker.commit` applies one
update with the statistics of the whole batch after the step, so the buffers end the step as in
the unsplit model.

Rewritten (export graphs): ``aten.batch_norm.default(x, w, b, running_mean, running_var,
training=True, momentum, eps, cudnn)`` and the ``aten.add_(num_batches_tracked, 1)`` beside it.
BatchNorms with ``momentum=None`` (cumulative average) and ``symbolic_trace`` graphs are left
as they are.

References:
    Kim et al., "torchgpipe", 2020, §3.4 (deferred batch normalization).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from fxsplit.codegen.split import StagedProgram

__all__ = ["BatchNormTracker", "DeferredBatchNorm", "DeferredCount", "defer_batch_norm"]

log = logging.getLogger(__name__)

_BATCH_NORM = torch.ops.aten.batch_norm.default
_ADD_ = torch.ops.aten.add_.Tensor


@dataclass
class _Sums:
    """One BatchNorm's statistics during a step: ``(count, mean, unbiased var)`` per micro-batch."""

    running_mean: torch.Tensor
    running_var: torch.Tensor
    momentum: float
    parts: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass
class BatchNormTracker:
    """Per-channel statistics of every deferred BatchNorm during one step; :meth:`commit`
    pools them and applies them.

    References:
        Chan, Golub and LeVeque, "Updating formulae and a pairwise algorithm for computing sample
        variances", 1979 (pooling the variances of parts).
    """

    sums: dict[str, _Sums] = field(default_factory=dict)
    counters: dict[str, torch.Tensor] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    batch_norms: int = 0  # BatchNorms deferred (the rest of the tracker serves fxsplit.codegen.buffers)
    # fxsplit.codegen.buffers: buffers updated once per step; their values when the step began,
    # and the updates already run this step
    tracked: dict[str, torch.Tensor] = field(default_factory=dict)
    starts: dict[str, torch.Tensor] = field(default_factory=dict)
    ran: set[str] = field(default_factory=set)
    commits: int = 0  # steps committed (a recomputation after its step's commit cannot replay it)

    def track_step_start(self, key: str, buffer: torch.Tensor) -> None:
        """Keep ``buffer``'s value at the start of every step (:meth:`reset`)."""
        self.tracked[key] = buffer

    def step_start(self, key: str, buffer: torch.Tensor) -> torch.Tensor:
        """The tracked buffer's value when the step began (``buffer`` itself before any step)."""
        with self.lock:
            return self.starts.get(key, buffer)

    def first_call(self, key: str) -> bool:
        """True the first time ``key`` asks in a step, then False until the next step."""
        with self.lock:
            if key in self.ran:
                return False
            self.ran.add(key)
            return True

    def add(self, key: str, count: int, mean: torch.Tensor, var: torch.Tensor, running_mean: torch.Tensor,
            running_var: torch.Tensor, momentum: float) -> None:
        """Record a micro-batch's per-channel ``mean`` and unbiased ``var`` over ``count`` values
        per channel (``[channels]`` each)."""
        with self.lock:
            s = self.sums.setdefault(key, _Sums(running_mean, running_var, momentum))
            s.parts.append((count, mean, var))

    def count_batch(self, key: str, counter: torch.Tensor) -> None:
        with self.lock:
            self.counters[key] = counter

    def reset(self) -> None:
        """Begin a step: forget the statistics of a step that did not finish, and copy the
        tracked buffers' values."""
        with self.lock, torch.no_grad():
            self.sums.clear()
            self.counters.clear()
            self.ran.clear()
            self.starts = {k: b.detach().clone() for k, b in self.tracked.items()}

    def commit(self) -> None:
        """Update every running mean/variance once with the whole batch's statistics (the
        unbiased variance, as ``nn.BatchNorm`` does) and count one batch; then reset.
        ``commits`` counts the calls."""
        self.commits += 1
        with torch.no_grad(), self.lock:
            for s in self.sums.values():
                if not s.parts:
                    continue
                mean, unbiased = _pooled(s.parts)
                s.running_mean.mul_(1 - s.momentum).add_(mean.to(s.running_mean.dtype), alpha=s.momentum)
                s.running_var.mul_(1 - s.momentum).add_(unbiased.to(s.running_var.dtype), alpha=s.momentum)
            for counter in self.counters.values():
                counter.add_(1)
            self.sums.clear()
            self.counters.clear()
            self.ran.clear()
            self.starts.clear()


def _pooled(parts: list[tuple[int, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance of the union of parts ``(n_i, mean_i, unbiased var_i)``:
    ``M = sum n_i m_i / N``, ``var = sum((n_i - 1) v_i + n_i (m_i - M)^2) / (N - 1)``."""
    n = sum(c for c, _, _ in parts)
    means = torch.stack([m for _, m, _ in parts]).float()  # [parts, channels]
    counts = torch.tensor([c for c, _, _ in parts], dtype=means.dtype, device=means.device).unsqueeze(1)
    variances = torch.stack([v for _, _, v in parts]).float()
    mean = (counts * means).sum(0) / n
    scatter = ((counts - 1) * variances + counts * (means - mean).square()).sum(0)
    return mean, scatter / max(n - 1, 1)


class DeferredBatchNorm(nn.Module):
    """``batch_norm`` with micro-batch statistics whose running-statistics update is deferred.
    While ``replaying`` (a recomputed forward, :mod:`fxsplit.runtime.recompute`) it records
    nothing: the first run recorded this micro-batch."""

    def __init__(self, tracker: BatchNormTracker, key: str, momentum: float, eps: float) -> None:
        super().__init__()
        self.tracker, self.key, self.momentum, self.eps = tracker, key, momentum, eps
        self.replaying = False

    def forward(self, x: torch.Tensor, weight: Any, bias: Any, running_mean: torch.Tensor, running_var: torch.Tensor) -> torch.Tensor:
        # With momentum 1 the kernel writes this micro-batch's mean and unbiased variance, which it
        # computes anyway to normalise, into zeroed scratch buffers: no second pass over x.
        mean, var = torch.zeros_like(running_mean), torch.zeros_like(running_var)
        out = torch.nn.functional.batch_norm(x, mean, var, weight, bias, True, 1.0, self.eps)
        if not self.replaying:
            self.tracker.add(self.key, x.numel() // x.shape[1], mean, var, running_mean, running_var, self.momentum)
        return out


class DeferredCount(nn.Module):
    """``num_batches_tracked += 1``, counted once per step by :meth:`BatchNormTracker.commit`."""

    def __init__(self, tracker: BatchNormTracker, key: str) -> None:
        super().__init__()
        self.tracker, self.key = tracker, key

    def forward(self, counter: torch.Tensor, one: Any) -> torch.Tensor:
        self.tracker.count_batch(self.key, counter)
        return counter


def _rewrite(gm: torch.fx.GraphModule, tracker: BatchNormTracker, stage: int) -> int:
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _BATCH_NORM and node.args[5] is True and node.args[3] is not None and node.args[6] is not None:
            name = f"fxsplit_deferred_bn_{node.name}"
            gm.add_submodule(name, DeferredBatchNorm(tracker, f"{stage}:{node.name}", float(node.args[6]), float(node.args[7])))
            args = node.args[:5]
        elif node.target is _ADD_ and _is_counter(node):
            name = f"fxsplit_deferred_count_{node.name}"
            gm.add_submodule(name, DeferredCount(tracker, f"{stage}:{node.name}"))
            args = node.args[:2]
        else:
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, args)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _is_counter(node: torch.fx.Node) -> bool:
    target = node.args[0]
    return isinstance(target, torch.fx.Node) and target.op == "get_attr" and str(target.target).endswith("num_batches_tracked")


def defer_batch_norm(program: StagedProgram) -> BatchNormTracker | None:
    """Rewrite every stage's training-mode BatchNorms to defer their running-statistics update.

    Returns:
        The tracker to :meth:`~BatchNormTracker.commit` after each step, or ``None`` when no
        stage has a BatchNorm to defer.
    """
    tracker = BatchNormTracker()
    count = sum(_rewrite(st.gm, tracker, st.index) for st in program.stages)
    tracker.batch_norms = count
    for st in program.stages:
        for node in st.gm.graph.nodes:
            if _left_alone(st.gm, node):
                log.warning(
                    "stage %d: BatchNorm %s keeps per-micro-batch running statistics (momentum=None or a "
                    "symbolic_trace module); capture with torch.export and a numeric momentum to defer it",
                    st.index, node.name,
                )
    return tracker if count else None


def _left_alone(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """A training-mode BatchNorm this rewrite does not handle."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training and mod.track_running_stats
    return node.op == "call_function" and node.target is _BATCH_NORM and node.args[5] is True and node.args[6] is None
