"""Buffers updated in forward, once per step: the unsplit model's update, exactly.

A buffer a model updates in forward (a step counter: ``self.steps += 1``) would be updated once
per micro-batch, ``m`` times a step. Where the update reads no input
(:func:`fxsplit.passes.per_sample.once_per_step_buffers`) it is the same for every micro-batch,
so running it on the first micro-batch alone gives the unsplit model's buffer. Reads must agree
too: a read placed before the update sees the value the step began with (every micro-batch, so
``m - 1`` micro-batches do not see the already-updated buffer), a read after it sees the updated
buffer (already updated by the first micro-batch, which every later one follows on that stage).

The rewrite, per stage graph: each in-place op on such a buffer becomes :class:`OncePerStep`
(runs on the step's first call, then returns its destination unchanged), and each use of the
buffer by a node placed before the first update reads :class:`StepStartValue` (a copy taken
when the step begins, :meth:`~fxsplit.codegen.batchnorm.BatchNormTracker.reset`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx
from torch import nn

from fxsplit.codegen.batchnorm import BatchNormTracker
from fxsplit.codegen.split import StagedProgram
from fxsplit.passes.per_sample import buffer_writes, once_per_step_buffers

__all__ = ["OncePerStep", "StepStartValue", "defer_buffer_updates"]

log = logging.getLogger(__name__)


class OncePerStep(nn.Module):
    """An in-place update of a buffer that runs on the step's first call only."""

    def __init__(self, tracker: BatchNormTracker, key: str, op: Any) -> None:
        super().__init__()
        self.tracker, self.key, self.op = tracker, key, op

    def forward(self, dest: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.tracker.first_call(self.key):
            return self.op(dest, *args, **kwargs)
        return dest


class StepStartValue(nn.Module):
    """A buffer's value when the step began."""

    def __init__(self, tracker: BatchNormTracker, key: str) -> None:
        super().__init__()
        self.tracker, self.key = tracker, key

    def forward(self, buffer: torch.Tensor) -> torch.Tensor:
        return self.tracker.step_start(self.key, buffer)


def _buffer_reads(gm: torch.fx.GraphModule, buf: str) -> list[torch.fx.Node]:
    return [n for n in gm.graph.find_nodes(op="get_attr") if str(n.target) == buf]


def _rewrite(gm: torch.fx.GraphModule, tracker: BatchNormTracker, stage: int, buf: str, writes: list[torch.fx.Node],
             first_write: tuple[int, int]) -> None:
    """Rewrite one stage's updates of ``buf`` (``writes``) and its reads placed before the first
    update (``(stage, node position)`` of that update in the pipeline)."""
    order = {n: (stage, i) for i, n in enumerate(gm.graph.nodes)}
    for read in _buffer_reads(gm, buf):
        early = [u for u in read.users if order[u] < first_write]
        if not early:
            continue
        name = f"fxsplit_step_start_{buf.replace('.', '_')}"
        if not hasattr(gm, name):
            gm.add_submodule(name, StepStartValue(tracker, buf))
        with gm.graph.inserting_after(read):
            start = gm.graph.call_module(name, (read,))
        start.meta = dict(read.meta)
        for user in early:
            user.replace_input_with(read, start)
    for node in writes:
        name = f"fxsplit_once_{node.name}"
        gm.add_submodule(name, OncePerStep(tracker, f"{stage}:{node.name}", node.target))
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, node.args, node.kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.recompile()


def defer_buffer_updates(program: StagedProgram, full: torch.fx.GraphModule, tracker: BatchNormTracker) -> list[str]:
    """Make the buffer updates of ``full`` (the unsplit graph) that read no input run once per
    step in ``program``'s stages.

    A buffer several stages read or update is handled when they hold the same tensor (stages on
    one device): reads in earlier stages, and before the first update in its stage, see the
    step's starting value.

    Returns:
        The buffers left per-micro-batch although their update reads no input (stages on
        different devices each hold a copy): the caller warns about them.
    """
    wanted = once_per_step_buffers(full)
    left, done = [], []
    for buf in sorted(wanted):
        holders = [st for st in program.stages if _buffer_reads(st.gm, buf)]
        tensors = {id(st.gm.get_buffer(buf)) for st in holders}
        writes = {st.index: buffer_writes(st.gm).get(buf, []) for st in holders}
        positions = [(st.index, i) for st in holders for i, n in enumerate(st.gm.graph.nodes) if n in writes[st.index]]
        if len(tensors) != 1 or not positions:
            left.append(buf)
            continue
        tracker.track_step_start(buf, holders[0].gm.get_buffer(buf))
        for st in holders:
            _rewrite(st.gm, tracker, st.index, buf, writes[st.index], min(positions))
        done.append(buf)
    if done:
        log.info("buffers updated once per step (their update reads no input): %s", done)
    return left
