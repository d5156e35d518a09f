"""Baseline splits users know, for comparison with the exact solvers (torch-free).

Each baseline cuts the blocks' topological order (block ids) into contiguous runs, so every prefix
is a downset and the stages are contiguous; stage ``s`` runs on device ``s``. They ignore
communication; ``greedy`` alone looks at device speed and memory.

References:
    Bárány & Grinberg, "Block partitions of sequences", Israel J. Math. 206 (2015) — the rule of
    torchgpipe's ``balance_by_time`` (Kim et al., "torchgpipe", 2020);
    DeepSpeed ``PipelineModule(partition_method="parameters")`` (parameter-balanced split);
    Megatron-LM / torchtitan (equal numbers of layers per stage).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from fxsplit.errors import InfeasibleError
from fxsplit.ir.plan import Plan, evaluate
from fxsplit.ir.problem import Problem
from fxsplit.solvers.diagnose import fmt_bytes, stage_count_error

__all__ = [
    "block_partition",
    "min_max_partition",
    "solve_blockpartition",
    "solve_greedy",
    "solve_params",
    "solve_uniform",
]


def _num_stages(problem: Problem) -> int:
    n, k = len(problem.graph), problem.num_devices
    if not problem.allow_idle_devices and n < k:
        raise stage_count_error(problem)
    return min(n, k)


def _runs(sizes: Sequence[int]) -> list[list[int]]:
    """Consecutive block ids for run lengths ``sizes`` (empty runs dropped)."""
    out, start = [], 0
    for size in sizes:
        if size > 0:
            out.append(list(range(start, start + size)))
        start += size
    return out


def _finish(problem: Problem, name: str, stages: list[list[int]], start: float) -> Plan:
    """Cost the split with :func:`evaluate`; raise :class:`InfeasibleError` if memory overflows."""
    plan = evaluate(problem, stages, list(range(len(stages))), solver=name, status="feasible",
                    solve_time_s=time.perf_counter() - start)
    for s, st in enumerate(plan.stages):
        dev = problem.devices[st.device]
        if st.memory_bytes > dev.memory_bytes:
            raise InfeasibleError(
                f"baseline {name!r}: stage {s} (blocks {st.blocks[0]}..{st.blocks[-1]}) needs "
                f"{fmt_bytes(st.memory_bytes)}, device {st.device} {dev.name!r} has "
                f"{fmt_bytes(dev.memory_bytes)} ({fmt_bytes(st.memory_bytes - dev.memory_bytes)} "
                "over); the baseline ignores memory: use solver='dp' or 'cpsat'"
            )
    return plan


def solve_uniform(problem: Problem, **_: object) -> Plan:
    """Equal numbers of blocks per stage (the first ``n mod p`` stages get one more)."""
    start = time.perf_counter()
    n, p = len(problem.graph), _num_stages(problem)
    return _finish(problem, "uniform", _runs([n // p + (1 if s < n % p else 0) for s in range(p)]), start)


def min_max_partition(weights: Sequence[float], parts: int) -> list[int]:
    """Run lengths of the contiguous split of ``weights`` into ``parts`` non-empty runs with the
    least largest sum (binary search on the largest sum with a greedy check, then splitting the
    longest runs until there are ``parts``).

    Example:
        >>> min_max_partition([1, 1, 1, 1, 4], 2)
        [4, 1]
    """
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def greedy(cap: float) -> list[int] | None:
        sizes, start = [], 0
        for i in range(1, len(weights) + 1):
            if prefix[i] - prefix[start] > cap:
                if i - 1 == start:
                    return None
                sizes.append(i - 1 - start)
                start = i - 1
        sizes.append(len(weights) - start)
        return sizes if len(sizes) <= parts else None

    cands = sorted({prefix[j] - prefix[i] for i in range(len(weights)) for j in range(i + 1, len(weights) + 1)}) \
        if len(weights) <= 200 else None
    lo, hi = 0.0, prefix[-1]
    if cands is not None:
        a, b = 0, len(cands) - 1
        while a < b:
            pick = (a + b) // 2
            a, b = (a, pick) if greedy(cands[pick]) is not None else (pick + 1, b)
        sizes = greedy(cands[a]) or [len(weights)]
    else:
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if greedy(mid) is not None else (mid, hi)
        sizes = greedy(hi) or [len(weights)]
    while len(sizes) < parts:
        i = max(range(len(sizes)), key=sizes.__getitem__)
        sizes[i : i + 1] = [sizes[i] - sizes[i] // 2, sizes[i] // 2]
    return sizes


def solve_params(problem: Problem, **_: object) -> Plan:
    """Balance parameter bytes across stages (DeepSpeed's ``partition_method="parameters"``)."""
    start = time.perf_counter()
    weights = [float(b.param_bytes) for b in problem.graph.blocks]
    return _finish(problem, "params", _runs(min_max_partition(weights, _num_stages(problem))), start)


def block_partition(costs: Sequence[float], parts: int) -> list[int]:
    """Run lengths from the Bárány–Grinberg block-partition rule, as torchgpipe applies it.

    Costs are normalised to ``[0, 1]``; starting from equal run lengths, an element moves from the
    neighbour of the smallest run toward it, on the side of a largest run, until the largest run
    exceeds the smallest by at most 1. A heuristic: ``[5, 1, 1, 1, 1, 1, 1, 1, 1]`` into 3 gives a
    largest run of 7 where 5 is optimal.

    Example:
        >>> block_partition([5, 1, 1, 1, 1, 1, 1, 1, 1], 3)
        [3, 3, 3]
    """
    n = len(costs)
    low, span = min(costs), max(costs) - min(costs)
    norm = [0.0 if span == 0 else (c - low) / span for c in costs]
    splits = [n // parts * (i + 1) for i in range(parts - 1)] + [n]

    def size(i: int) -> float:
        return sum(norm[(splits[i - 1] if i > 0 else 0) : splits[i]])

    for _ in range(10 * n * parts + 10):
        big, p = max((size(i), i) for i in range(parts))
        small, q = min((size(i), i) for i in range(parts))
        if big <= small + 1:
            break
        if p < q:
            splits[q - 1] -= 1
        else:
            splits[q] += 1
    return [b - a for a, b in zip([0] + splits[:-1], splits, strict=True)]


def solve_blockpartition(problem: Problem, **_: object) -> Plan:
    """torchgpipe's ``balance_by_time``: Bárány–Grinberg on per-block forward+backward times."""
    start = time.perf_counter()
    costs = [b.time_s if problem.training else b.fwd_s for b in problem.graph.blocks]
    return _finish(problem, "blockpartition", _runs(block_partition(costs, _num_stages(problem))), start)


def _greedy_stages(problem: Problem, fits: Callable[[int, int, int], bool]) -> list[list[int]]:
    g, p = problem.graph, _num_stages(problem)
    times = [b.time_s if problem.training else b.fwd_s for b in g.blocks]
    stages: list[list[int]] = []
    nxt = 0
    for s in range(p):
        left = len(g) - nxt - (p - s - 1)
        if s == p - 1:
            stages.append(list(range(nxt, len(g))))
            break
        speeds = [problem.devices[d].speed for d in range(s, p)]
        target = sum(times[nxt:]) * speeds[0] / sum(speeds)
        end, acc = nxt + 1, times[nxt]
        while end - nxt < left and abs(acc + times[end] - target) <= abs(acc - target) \
                and fits(s, nxt, end + 1):
            acc += times[end]
            end += 1
        stages.append(list(range(nxt, end)))
        nxt = end
    return stages


def solve_greedy(problem: Problem, **_: object) -> Plan:
    """Fill devices in order, each up to its speed's share of the remaining work and its memory.

    Stage ``s`` takes blocks while that brings its work closer to
    ``remaining work × speed_s / Σ remaining speeds`` and its memory (costed as a middle stage)
    fits; the last stage takes the rest. A fast hint for CP-SAT, not a good split.
    """
    start = time.perf_counter()
    n = len(problem.graph)
    roomy = evaluate(problem, [list(range(n))]).stages[0].memory_bytes <= min(
        d.memory_bytes for d in problem.devices)

    def fits(s: int, lo: int, hi: int) -> bool:
        if roomy:
            return True
        stages = [list(range(lo)), list(range(lo, hi)), list(range(hi, len(problem.graph)))]
        stages = [st for st in stages if st]
        idx = 1 if lo > 0 else 0
        plan = evaluate(problem, stages)
        return plan.stages[idx].memory_bytes <= problem.devices[s].memory_bytes

    return _finish(problem, "greedy", _greedy_stages(problem, fits), start)
