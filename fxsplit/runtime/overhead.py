"""What the pipeline runtime adds to a plan's compute and transfers (data and helpers; the
probes that measure it are :func:`fxsplit.overhead.probe_action_overhead` for the local runtime
and :func:`fxsplit.distributed.probe_distributed_overhead` across processes).

A stage's forward or backward action does more than the stage's operators: the runtime takes its
inputs (detached, ``requires_grad`` set), keeps its outputs for the backward, runs autograd from
the received gradients, and across processes posts the sends and receives around it. The
profiled cost model times the operators only, so a split plan was predicted faster than it runs
by that work times the number of actions (``Problem.action_overhead_s``). Across processes each
boundary message also costs more than the send/recv ping-pong that measures the link (the
runtime's posting, waiting and bookkeeping): charged as extra link latency, as ``calibrate``
does after the fact (:func:`fxsplit.calibrate.fit_link_latency`).

Both probes build a real pipeline of a tiny model (one layer per stage), time training steps
from the runtime's trace, and take off the layer's own time, measured bare in this process
(:func:`bare_layer_s`); their random draws leave the caller's streams alone (:func:`untouched_rng`).

References:
    Narayanan et al., "PipeDream", SOSP 2019, §3.1 (the profiled per-layer costs the planner
    uses, whose runtime overheads are left out); Hockney 1994 (latency + bytes / bandwidth).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxsplit.ir.problem import Problem

__all__ = ["RuntimeOverhead", "with_overhead", "bare_layer_s", "action_overhead", "untouched_rng", "PROBE_WIDTH",
           "PROBE_BATCH", "PROBE_MICROBATCHES"]

PROBE_WIDTH = 16
"""Features of the probe model's layers (a few microseconds of compute per action)."""

PROBE_BATCH = 16
"""Rows of the probe's batch."""

PROBE_MICROBATCHES = 4
"""Micro-batches of the probe's step (1F1B)."""


@dataclass(frozen=True)
class RuntimeOverhead:
    """What the runtime adds to a plan's compute and its probed transfers.

    Attributes:
        action_s: Seconds per stage action (forward or backward of one micro-batch) beyond the
            stage's operators: ``Problem.action_overhead_s``.
        forward_s, backward_s: The two kinds apart (``action_s`` is their mean, so a stage's
            forward + backward per micro-batch is predicted exactly).
        message_s: Seconds per boundary message beyond the link probe's latency (across
            processes; 0 in one process, where stages hand tensors over).
    """

    action_s: float
    forward_s: float
    backward_s: float
    message_s: float = 0.0


def bare_layer_s(device: torch.device, rows: int, repeats: int = 50) -> tuple[float, float]:
    """Median seconds of one probe layer's forward and of its backward, called directly (what a
    stage action of the probe computes, without the runtime around it)."""
    layer = nn.Linear(PROBE_WIDTH, PROBE_WIDTH).to(device)
    x = torch.randn(rows, PROBE_WIDTH, device=device, requires_grad=True)
    fwd, bwd = [], []
    for _ in range(repeats + 5):
        start = time.perf_counter()
        y = torch.relu(layer(x))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        mid = time.perf_counter()
        y.backward(torch.ones_like(y))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = time.perf_counter()
        fwd.append(mid - start)
        bwd.append(end - mid)
    return statistics.median(fwd[5:]), statistics.median(bwd[5:])


def action_overhead(per_step: list[list[dict[str, float]]], device: torch.device) -> RuntimeOverhead:
    """The per-action part a probe pipeline measured: the median over steps and stages of each
    action's time (``per_step``: per step, every stage's ``{"fwd_s", "bwd_s"}`` per micro-batch,
    from the runtime's trace) minus the bare layer's (:func:`bare_layer_s`, timed here at the
    probe's micro-batch size); ``action_s`` their mean; no message part."""
    bare_fwd, bare_bwd = bare_layer_s(device, PROBE_BATCH // PROBE_MICROBATCHES)
    fwd = max(0.0, statistics.median(st["fwd_s"] for step in per_step for st in step) - bare_fwd)
    bwd = max(0.0, statistics.median(st["bwd_s"] for step in per_step for st in step) - bare_bwd)
    return RuntimeOverhead((fwd + bwd) / 2, fwd, bwd)


def untouched_rng(dev: torch.device) -> Any:
    """A context in which a probe's random draws (weights, batches, the compile's checks) leave
    the caller's random streams as they were."""
    return torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else [])


def with_overhead(problem: Problem, overhead: RuntimeOverhead) -> Problem:
    """``problem`` (a :class:`~fxsplit.ir.Problem`) costing ``overhead``: its action overhead set
    and ``overhead.message_s`` added to the latency of its default link and of every pair's."""
    return problem.with_latency_added(overhead.message_s).with_(action_overhead_s=overhead.action_s)
