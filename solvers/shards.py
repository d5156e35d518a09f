"""The fewest shards that fit a device: how Hydra cuts a model for shard parallelism (torch-free).

Shard parallelism (:mod:`fxsplit.schedule.shards`) runs a model's shards one after another on
whatever device is free, each shard alone on its device with its state (parameters, gradients,
optimizer state) and one mini-batch of activations. Fewer shards mean fewer units to schedule
and fewer state moves, so the cut wanted is the one with the fewest shards that each fit the
memory budget, balanced among those (the slowest shard as small as possible, so that no unit
holds a device long). Feasibility only grows with the shard count, so the count is found by
doubling then bisection, each probe an exact solve.

References:
    Nagrecha and Kumar, "Model-Parallel Model Selection for Deep Learning Systems", SIGMOD 2021
    (shards sized to device memory).
"""

from __future__ import annotations

from fxsplit.errors import ConfigError, InfeasibleError
from fxsplit.ir import Plan, Problem
from fxsplit.solvers.registry import solve

__all__ = ["fewest_shards"]


def _shard_problem(problem: Problem, k: int) -> Problem:
    return problem.with_(devices=(problem.devices[0],) * k, microbatches=1, schedule="gpipe",
                         objective="bottleneck", allow_idle_devices=True, device_order="fixed",
                         stages_per_device=1)


def fewest_shards(problem: Problem, *, solver: str = "dp", time_limit_s: float | None = None) -> Plan:
    """Split ``problem.graph`` into the fewest shards that each fit ``problem.devices[0]``.

    Args:
        problem: The graph (whole mini-batch costs) and the device whose memory every shard must
            fit (``devices[0]``; the others are ignored). Each shard is costed alone with one
            mini-batch in flight and the problem's optimizer state, gradient and recompute
            settings.
        solver: The exact solver of each probe (``"dp"``, ``"cpsat"`` or ``"auto"``).
        time_limit_s: Limit of each probe, seconds.

    Returns:
        The plan of ``k`` shards (``k`` stages, all on device index 0..k-1 of ``k`` copies of
        ``devices[0]``) with ``k`` the smallest count that fits, balanced for ``k``.

    Raises:
        ConfigError: for a problem without devices.
        InfeasibleError: when even one block per shard does not fit (the message names the block
            and the bytes, from the solver).

    Example:
        >>> from fxsplit.ir import Block, CondensedGraph, DeviceSpec, Edge, Problem
        >>> g = CondensedGraph([Block(i, f"b{i}", fwd_s=1.0, bwd_s=2.0, param_bytes=100) for i in range(4)],
        ...                    [Edge(i, i + 1, 8) for i in range(3)])
        >>> dev = DeviceSpec("d", peak_flops=1e12, memory_bytes=900)
        >>> fewest_shards(Problem(g, (dev,))).num_stages  # 400 bytes of state per block (Adam)
        2
    """
    if not problem.devices:
        raise ConfigError("fewest_shards needs a device whose memory the shards must fit")
    n = len(problem.graph)
    plans: dict[int, Plan] = {}

    def fits(k: int) -> bool:
        try:
            plans[k] = solve(_shard_problem(problem, k), solver, time_limit_s=time_limit_s)
            return True
        except InfeasibleError:
            if k >= n:
                raise
            return False

    lo, hi = 0, 1  # lo: a count known not to fit (0: none tried)
    while not fits(hi):
        lo, hi = hi, min(2 * hi, n)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return plans[hi]
