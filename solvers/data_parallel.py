"""Data parallelism as a baseline beside the pipeline plans (torch-free).

Every device holds the whole model and trains ``1/N`` of the batch; the gradients are summed
with a ring all-reduce. With ZeRO stage 1 (Rajbhandari et al., SC 2020) each device keeps only
``1/N`` of the optimizer state, and the all-reduce becomes a reduce-scatter plus an all-gather
of the same volume. The estimate is deliberately kind to data parallelism (the strong baseline):
the all-reduce overlaps the whole backward, and the per-sample work divides evenly.

Model, for a problem whose graph holds one micro-batch's costs and ``m`` micro-batches per step
(the batch), on ``N`` devices of the slowest device's speed:

* compute: ``Σ_b fixed_b + (time_b - fixed_b) · m / N`` (forward and backward of ``m / N``
  micro-batches' samples in one pass; the per-operator overhead once);
* all-reduce: ``2 (N - 1) / N · gradient bytes / bandwidth + 2 (N - 1) · latency`` over the
  slowest link of the ring (Patarasuk and Yuan, 2009);
* step: ``forward + max(backward, all-reduce)``;
* memory: ``params · (1 + grad + optimizer)`` (ZeRO-1: ``params · (1 + grad + optimizer / N)``)
  + buffers + activations of ``m / N`` micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxsplit.errors import ConfigError
from fxsplit.ir.problem import Problem

__all__ = ["DataParallelEstimate", "data_parallel"]


@dataclass(frozen=True)
class DataParallelEstimate:
    """Data parallelism on every device of a problem.

    Attributes:
        devices: ``N``.
        zero_stage: 0 (plain) or 1 (optimizer state sharded).
        compute_s: Forward and backward of one device's share of the batch, seconds.
        allreduce_s: The gradient all-reduce (or reduce-scatter + all-gather), seconds.
        step_s: ``forward + max(backward, all-reduce)``, seconds.
        memory_bytes: What each device holds, bytes.
        capacity_bytes: The smallest device's memory, bytes.
    """

    devices: int
    zero_stage: int
    compute_s: float
    allreduce_s: float
    step_s: float
    memory_bytes: float
    capacity_bytes: int

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.capacity_bytes


def data_parallel(problem: Problem, zero_stage: int = 0) -> DataParallelEstimate:
    """Estimate data parallelism (``zero_stage`` 0 or 1) over ``problem``'s devices.

    Raises:
        ConfigError: for a ``zero_stage`` other than 0 or 1.
    """
    if zero_stage not in (0, 1):
        raise ConfigError(f"zero_stage={zero_stage!r}; 0 (plain data parallel) or 1 (ZeRO-1)")
    g, n, m = problem.graph, problem.num_devices, problem.microbatches
    speed = min(d.speed for d in problem.devices)
    share = m / n
    fwd = sum(b.fwd_fixed_s + (b.fwd_s - b.fwd_fixed_s) * share for b in g.blocks) / speed
    bwd = (sum(b.bwd_fixed_s + (b.bwd_s - b.bwd_fixed_s) * share for b in g.blocks) / speed
           if problem.training else 0.0)
    params = sum(b.param_bytes for b in g.blocks)
    grads = params * problem.grad_factor if problem.training else 0.0
    link = problem.link_between(0, 1 % n)
    for i in range(n):  # the ring's slowest hop
        hop = problem.link_between(i, (i + 1) % n)
        if hop.bytes_per_s < link.bytes_per_s or (hop.bytes_per_s == link.bytes_per_s and hop.latency_s > link.latency_s):
            link = hop
    allreduce = (2 * (n - 1) / n * grads / link.bytes_per_s + 2 * (n - 1) * link.latency_s) if n > 1 and grads else 0.0
    optimizer = params * problem.optimizer_state_factor if problem.training else 0.0
    state = params + grads + (optimizer / n if zero_stage == 1 else optimizer)
    memory = state + sum(b.buffer_bytes for b in g.blocks) + sum(b.activation_bytes for b in g.blocks) * share
    return DataParallelEstimate(n, zero_stage, fwd + bwd, allreduce, fwd + max(bwd, allreduce), memory,
                                min(d.memory_bytes for d in problem.devices))
