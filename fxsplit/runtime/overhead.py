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

Across processes the stages also compute slower inside the pipeline than when timed bare, even
with every rank timing at once as the profile does: gloo's threads move the messages on the same
cores, and the runtime's buffers share the caches (``RuntimeOverhead.compute_factor``, which the
plan applies to every device's speed). And both parts grow when the stages are busy: a message
arriving while its receiver computes waits for a core.

The local probe builds a real pipeline of a tiny model (one layer per stage), times training
steps from the runtime's trace, and takes off the layer's own time, measured bare in this process
(:func:`bare_layer_s`). The distributed one runs two pipelines of busy stages
(:class:`BusyBlock`, light and heavy, 256 KiB messages) and separates a fixed part per action from
a factor on the compute (:func:`busy_overhead`). Their random draws leave the caller's streams
alone (:func:`untouched_rng`).

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
           "PROBE_BATCH", "PROBE_MICROBATCHES", "BusyBlock", "bare_module_s", "busy_overhead", "BUSY_ROWS", "BUSY_WIDTH",
           "BUSY_LAYERS"]

PROBE_WIDTH = 16
"""Features of the probe model's layers (a few microseconds of compute per action)."""

PROBE_BATCH = 16
"""Rows of the probe's batch."""

PROBE_MICROBATCHES = 4
"""Micro-batches of the probe's step (1F1B)."""

BUSY_ROWS = 64
"""Rows per micro-batch of the distributed probe's busy stages (:class:`BusyBlock`)."""

BUSY_WIDTH = 1024
"""Features of the busy stages' boundary tensors: 256 KiB per message at :data:`BUSY_ROWS`."""

BUSY_LAYERS = (1, 4)
"""Linear layers per busy stage in the probe's two pipelines: about 0.4 and 1.2 ms of forward on
one core of this kind of CPU, so the stages compute while the messages move."""


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
        compute_factor: How many times longer the stages' operators take inside the running
            pipeline than timed bare with every rank computing at once (the communication
            threads and the runtime's memory traffic share the cores); ``>= 1``, 1 where not
            measured. The plan divides every device's speed by it.
    """

    action_s: float
    forward_s: float
    backward_s: float
    message_s: float = 0.0
    compute_factor: float = 1.0


def bare_layer_s(device: torch.device, rows: int, repeats: int = 50) -> tuple[float, float]:
    """Median seconds of one probe layer's forward and of its backward, called directly (what a
    stage action of the probe computes, without the runtime around it)."""
    layer = nn.Sequential(nn.Linear(PROBE_WIDTH, PROBE_WIDTH), nn.ReLU()).to(device)
    return bare_module_s(layer, torch.randn(rows, PROBE_WIDTH, device=device), repeats)


def action_overhead(per_step: list[list[dict[str, float]]], device: torch.device) -> RuntimeOverhead:
    """The per-action part a probe pipeline measured: the median over steps and stages of each
    action's time (``per_step``: per step, every stage's ``{"fwd_s", "bwd_s"}`` per micro-batch,
    from the runtime's trace) minus the bare layer's (:func:`bare_layer_s`, timed here at the
    probe's micro-batch size); ``action_s`` their mean; no message part."""
    bare_fwd, bare_bwd = bare_layer_s(device, PROBE_BATCH // PROBE_MICROBATCHES)
    fwd = max(0.0, statistics.median(st["fwd_s"] for step in per_step for st in step) - bare_fwd)
    bwd = max(0.0, statistics.median(st["bwd_s"] for step in per_step for st in step) - bare_bwd)
    return RuntimeOverhead((fwd + bwd) / 2, fwd, bwd)


def untouched_rng(*devices: torch.device) -> Any:
    """A context in which random draws (a probe's weights and batches, a compile's checks and
    timings) leave the caller's random streams as they were: the CPU's and those of the CUDA
    ``devices``."""
    return torch.random.fork_rng(devices=sorted({d for d in devices if d.type == "cuda"}, key=str))


def with_overhead(problem: Problem, overhead: RuntimeOverhead) -> Problem:
    """``problem`` (a :class:`~fxsplit.ir.Problem`) costing ``overhead``: its action overhead set,
    ``overhead.message_s`` added to the latency of its default link and of every pair's, and
    every device's speed divided by ``overhead.compute_factor``."""
    out = problem.with_latency_added(overhead.message_s).with_(action_overhead_s=overhead.action_s)
    if overhead.compute_factor != 1.0:
        out = out.with_(devices=tuple(d.with_(speed=d.speed / overhead.compute_factor) for d in out.devices))
    return out


class BusyBlock(nn.Module):
    """One stage of the distributed probe: ``layers`` linear layers (512 wide, ReLU) on the
    first 512 features of a ``[rows, width]`` input, the rest passed on, so the boundary tensors
    are ``width`` wide whatever the compute."""

    def __init__(self, layers: int, width: int = BUSY_WIDTH) -> None:
        super().__init__()
        self.width = width
        self.body = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(512, 512), nn.ReLU())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.body(x[:, :512]), x[:, 512:]], dim=1)


def bare_module_s(module: nn.Module, x: torch.Tensor, repeats: int = 30) -> tuple[float, float]:
    """Median seconds of ``module``'s forward and of its backward on ``x`` (``[rows, features]``),
    called directly, gradients accumulating as in training."""
    x = x.detach().requires_grad_(True)
    fwd, bwd = [], []
    for _ in range(repeats + 5):
        start = time.perf_counter()
        y = module(x)
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        mid = time.perf_counter()
        y.backward(torch.ones_like(y))
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        end = time.perf_counter()
        fwd.append(mid - start)
        bwd.append(end - mid)
    return statistics.median(fwd[5:]), statistics.median(bwd[5:])


def busy_overhead(traced: list[tuple[float, float]], bare: list[tuple[float, float]], message_s: float) -> RuntimeOverhead:
    """The runtime's work from two pipelines of busy stages (:class:`BusyBlock`, light and heavy):
    per pipeline the median forward and backward per micro-batch from the runtime's trace and the
    bare times of its stage (every rank timing at once). A traced action takes ``a + c x bare``:
    ``c`` (:attr:`RuntimeOverhead.compute_factor`, kept in ``[1, 2]``) from the two pipelines'
    differences (forward and backward together), ``a`` per kind from the light pipeline.

    Args:
        traced, bare: ``[(forward_s, backward_s)]`` of the light and the heavy pipeline.
        message_s: The per-message part the heavy pipeline's step showed.
    """
    (tf0, tb0), (tf1, tb1) = traced
    (bf0, bb0), (bf1, bb1) = bare
    grown = (bf1 + bb1) - (bf0 + bb0)
    factor = ((tf1 + tb1) - (tf0 + tb0)) / grown if grown > 0 else 1.0
    factor = min(max(factor, 1.0), 2.0)
    fwd, bwd = max(0.0, tf0 - factor * bf0), max(0.0, tb0 - factor * bb0)
    return RuntimeOverhead((fwd + bwd) / 2, fwd, bwd, message_s=max(0.0, message_s), compute_factor=factor)
