"""Explain why no plan fits: which stage and device, by how much, and what would fix it.

The explanation is itself exact: the DP with stage cost ``memory - device memory`` and ``max``
finds the split whose worst overflow is smallest. Its overflow is the least memory to add to every
device; adding copies of the largest device until that DP reaches ``<= 0`` gives the least number
of devices.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

from fxsplit.errors import ConfigError, InfeasibleError, SolverError
from fxsplit.ir.devices import DeviceSpec
from fxsplit.ir.plan import evaluate
from fxsplit.ir.problem import Problem
from fxsplit.ir.units import format_bytes
from fxsplit.solvers.dpcore import DPResult

__all__ = ["fmt_bytes", "infeasible_error", "require_one_stage_per_device", "stage_count_error"]

logger = logging.getLogger(__name__)

RunExcess = Callable[[Problem, float], DPResult]
"""Runs the min-max-overflow DP for a problem; returns the best result and the layouts used."""


def fmt_bytes(n: float) -> str:
    """Bytes to two decimals: ``fmt_bytes(3 * 2**30) == '3.00 GiB'`` (:func:`fxsplit.ir.units.format_bytes`)."""
    return format_bytes(n, decimals=2, largest="GiB")


def stage_count_error(problem: Problem) -> InfeasibleError:
    """``allow_idle_devices=False`` but the graph has fewer blocks than there are devices."""
    n, k = len(problem.graph), problem.num_devices
    err = InfeasibleError(
        f"graph {problem.graph.name!r} has {n} blocks but allow_idle_devices=False asks for "
        f"{k} non-empty stages; use at most {n} devices, or set allow_idle_devices=True",
        min_devices=None,
    )
    return err


def _least_devices(problem: Problem, run_excess: RunExcess, deadline: float) -> tuple[int | None, str]:
    """Fewest devices (copies of the largest added) with no overflow: doubling, then bisection.

    Returns the count and, when it is ``None``, why: a single block does not fit the largest
    device, the search limit (``min(blocks, 4k + 4, 64)``) was reached, or ``deadline`` passed
    (then the memory bound's lower bound is quoted when it has one).
    """
    big = max(problem.devices, key=lambda d: (d.memory_bytes, d.speed))
    alone = max(problem.static_bytes(b) + b.activation_bytes for b in problem.graph.blocks)
    if alone > big.memory_bytes:
        return None, (f"adding devices alone does not help: a block needs {fmt_bytes(alone)} on its own, "
                      f"more than the largest device {big.name!r}")

    def fits(k: int) -> bool:
        extra = tuple(big.with_(name=f"{big.name}+{i}") for i in range(k - problem.num_devices))
        return run_excess(problem.with_(devices=tuple(problem.devices) + extra), deadline).value <= 0

    lo, limit = problem.num_devices, min(len(problem.graph), 4 * problem.num_devices + 4, 64)
    try:
        step, hi = 1, lo + 1
        while not fits(hi):
            if hi >= limit:
                return None, f"no number of devices up to {limit} (copies of {big.name!r}) fits"
            lo, step = hi, 2 * step
            hi = min(limit, lo + step)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    except SolverError:  # deadline passed inside the DP
        from fxsplit.solvers.relax import memory_bound_error

        bound = memory_bound_error(problem)
        at_least = bound.min_devices_at_least if bound is not None else None
        more = f"; the memory bound needs at least {at_least}" if at_least else ""
        return None, f"the search for the least number of devices ran out of time{more}"
    return hi, ""


def infeasible_error(
    problem: Problem,
    stages: Sequence[Sequence[int]],
    devices: Sequence[int],
    overflow_bytes: float,
    run_excess: RunExcess,
    *,
    budget_s: float = 3.0,
) -> InfeasibleError:
    """Build the :class:`InfeasibleError` for a problem whose best split still overflows.

    Args:
        problem: The infeasible problem.
        stages, devices: The split with the smallest worst overflow (``[num_stages][*]`` block
            ids and ``[num_stages]`` device indices).
        overflow_bytes: That split's worst overflow (``> 0``), bytes.
        run_excess: Re-runs the overflow DP on a problem with more devices.
        budget_s: Seconds to spend looking for the least number of devices.

    Returns:
        The error (not raised), with the fields ``stage``, ``device``, ``need_bytes``,
        ``cap_bytes``, ``over_bytes``, ``min_memory_bytes`` and ``min_devices`` (``None`` when
        no number of devices up to the search limit helps) set.
    """
    plan = evaluate(problem, stages, devices)
    worst = max(range(plan.num_stages),
                key=lambda s: plan.stages[s].memory_bytes - problem.devices[plan.stages[s].device].memory_bytes)
    st = plan.stages[worst]
    dev: DeviceSpec = problem.devices[st.device]
    over = st.memory_bytes - dev.memory_bytes
    min_mem = max(d.memory_bytes for d in problem.devices) + math.ceil(overflow_bytes)
    if len({d.memory_bytes for d in problem.devices}) > 1:
        mem_fix = f"add {fmt_bytes(overflow_bytes)} to every device's memory"
    else:
        mem_fix = f"give every device at least {fmt_bytes(min_mem)} ({min_mem} bytes)"
    min_dev, why_not = _least_devices(problem, run_excess, time.perf_counter() + budget_s)
    dev_fix = f"or use {min_dev} devices" if min_dev is not None else why_not
    err = InfeasibleError(
        f"no split of graph {problem.graph.name!r} ({len(problem.graph)} blocks) over "
        f"{problem.num_devices} devices fits in memory (schedule={problem.schedule}, "
        f"microbatches={problem.microbatches}): the split that overflows least still needs "
        f"{fmt_bytes(st.memory_bytes)} on stage {worst} (blocks {list(st.blocks)[:6]}"
        f"{'…' if len(st.blocks) > 6 else ''}), device {st.device} {dev.name!r} has "
        f"{fmt_bytes(dev.memory_bytes)}: {fmt_bytes(over)} over. Fix: {mem_fix}, {dev_fix}",
        stage=worst, device=st.device, need_bytes=st.memory_bytes, cap_bytes=dev.memory_bytes,
        over_bytes=over, min_memory_bytes=min_mem, min_devices=min_dev,
    )
    logger.info("infeasible: %s", err)
    return err


def require_one_stage_per_device(problem: Problem, name: str) -> None:
    """Refuse a looped problem: the solvers run one stage per device; ``fxsplit.solvers.solve``
    solves ``stages_per_device > 1`` as a pipeline of chunks (:mod:`fxsplit.solvers.looped`)."""
    if problem.stages_per_device > 1:
        raise ConfigError(f"{name} plans one stage per device, and this problem has stages_per_device="
                          f"{problem.stages_per_device}; use fxsplit.solvers.solve(problem, ...), which solves it "
                          "as a pipeline of chunks (fxsplit.solvers.looped)")
