"""Several stages per device (interleaved schedules): the split as a pipeline of ``v * p`` chunks.

A looped schedule (interleaved 1F1B, Megatron-LM) puts ``v`` stages ("model chunks") on each of
``p`` devices in looping placement: stage ``s`` on device ``s mod p``. The split is solved as a
pipeline of ``v * p`` *virtual* devices, device ``d`` copied ``v`` times in pipeline order, each
copy with ``1/v`` of its memory (so the ``v`` stages a device holds fit it together), the links
between copies those of the devices; any solver then works unchanged, and the plan it returns is
mapped back to the real devices and costed on the real problem.

``optimal`` therefore means optimal among looping placements whose stages each fit ``1/v`` of
their device; a split whose stages share a device's memory unevenly is not considered. The
step time of the schedule comes from the simulator (:func:`fxsplit.schedule.simulate_plan`).

References:
    Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM", SC 2021, §2.2.2 (interleaved schedule, ``v`` model chunks per device).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fxsplit.errors import InfeasibleError
from fxsplit.ir.plan import Plan, evaluate
from fxsplit.ir.problem import Problem

__all__ = ["chunk_problem", "solve_looped"]


def chunk_problem(problem: Problem) -> Problem:
    """The one-stage-per-device problem of ``problem``'s ``v * p`` chunks.

    Args:
        problem: A problem with ``stages_per_device = v``.

    Returns:
        ``v * p`` virtual devices (virtual device ``k`` is device ``k mod p`` with ``1/v`` of its
        memory), the link overrides copied to every pair of copies, fixed device order, no idle
        device, schedule ``"gpipe"`` (every chunk costed with ``m`` micro-batches in flight, the
        bound the looped schedule's problem uses), ``stages_per_device = 1``.

    Example:
        >>> from fxsplit.ir import CondensedGraph, DeviceSpec
        >>> pb = Problem(CondensedGraph.chain([1.0] * 4), (DeviceSpec("a"), DeviceSpec("b")),
        ...              schedule="interleaved-1f1b", stages_per_device=2)
        >>> [d.name for d in chunk_problem(pb).devices]
        ['a', 'b', 'a', 'b']
    """
    p, v = problem.num_devices, problem.stages_per_device
    devices = tuple(replace(d, memory_bytes=d.memory_bytes // v) for _ in range(v) for d in problem.devices)
    links = tuple((a + k * p, b + j * p, spec) for a, b, spec in problem.links for k in range(v) for j in range(v))
    return problem.with_(devices=devices, links=links, device_order="fixed", allow_idle_devices=False,
                         schedule="gpipe", stages_per_device=1)


def solve_looped(problem: Problem, solve: Any, **opts: Any) -> Plan:
    """Split ``problem`` (``stages_per_device = v > 1``) into ``v * p`` stages in looping placement.

    Args:
        problem: The problem, a looped schedule and ``v > 1``.
        solve: ``solve(chunk_problem, **opts) -> Plan`` (a registry solver's ``solve``).
        opts: Passed to ``solve``.

    Returns:
        The plan on ``problem``'s devices (stage ``s`` on device ``s mod p``), costed by
        :func:`fxsplit.ir.evaluate`; status and lower bound those of the chunk problem.

    Raises:
        InfeasibleError: when the graph has fewer than ``v * p`` blocks, or no split of the chunk
            problem fits.
    """
    p, v = problem.num_devices, problem.stages_per_device
    if len(problem.graph) < v * p:
        raise InfeasibleError(f"{v} stages on each of {p} devices need {v * p} blocks; the graph has "
                              f"{len(problem.graph)}: use fewer stages per device (or fewer devices)")
    chunks = solve(chunk_problem(problem), **opts)
    stages = [st.blocks for st in chunks.stages]
    return evaluate(problem, stages, [st.device % p for st in chunks.stages], solver=chunks.solver,
                    status=chunks.status, lower_bound_s=chunks.lower_bound_s, stats=dict(chunks.stats))
