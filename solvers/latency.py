"""Single-sample latency placement (Tarnawski et al.'s latency objective): CP-SAT and baselines.

:func:`solve_latency` states the latency IP of Tarnawski et al. (NeurIPS 2020, §5 and
``latency-ip/lip.py``, one contiguous subgraph per accelerator) as a CP-SAT model, with the
variables per colour class rather than per node and the accelerators' symmetry broken:

* ``x[g, a]`` colour class ``g`` on accelerator ``a``; ``cpu[g] = 1 - Σ_a x[g, a]``; a class with a
  node the accelerators do not support, or larger than one accelerator, is CPU-only;
* contiguity (lip.py's): ``z[v, a]`` is 1 on the ancestors of ``S_a`` and on ``S_a``
  (``z[v, a] >= x[v, a]``, ``z[u, a] >= z[v, a]`` for an edge ``u -> v``), and 0 on any node
  outside ``S_a`` with a predecessor inside (``z[v, a] <= 1 - x[u, a] + x[v, a]``), so no path
  leaves ``S_a`` and returns;
* transfers: ``in[u, a] >= x[v, a] - x[u, a]`` and ``out[u, a] >= x[u, a] - x[v, a]`` for an edge
  ``u -> v``, each paying ``out_s[u]``;
* times: ``start[a] >= L[u]`` for an edge ``u -> v`` with ``v`` on ``a`` and ``u`` not;
  ``finish[a] = start[a] + Σ acc_s x + Σ out_s (in + out) + 1 quantum`` (the quantum rules out
  contiguous sets that need each other's outputs, ``a1 -> b1`` and ``b2 -> a2``, which lip.py
  excludes only where times are positive); ``L[v] >= finish[a]`` for ``v`` on
  ``a``; ``L[v] >= L[u] + cpu_s[v]`` for ``v`` on a CPU; ``L[v] >= L[u]`` always;
* minimise ``max L`` over the sinks; accelerators are used in order of their first class in
  topological order (symmetry breaking: they are identical).

Times are integers in quanta rounded down, so CP-SAT's bound less one quantum per accelerator,
times the quantum, is a proven lower bound of the true optimum; the placement it returns is re-evaluated exactly
(:func:`~fxsplit.ir.placement.evaluate_placement`) and called ``optimal`` only when that exact
latency is within :data:`~fxsplit.ir.plan.OPTIMAL_GAP` of the bound.

Baselines (Tarnawski et al., Appendix F): :func:`greedy_latency` (fill accelerators in
topological order), the all-CPU latency, and the latency of a throughput plan's split
(:func:`placement_of_stages`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fxsplit.errors import InternalError
from fxsplit.ir.placement import (
    CPU,
    Placement,
    PlacementProblem,
    evaluate_placement,
    latency_lower_bound_s,
)

__all__ = ["solve_latency", "greedy_latency", "interval_latency", "placement_of_stages", "chain_lower_bound_s", "path_lower_bound",
           "LATENCY_QUANTA"]

logger = logging.getLogger(__name__)

LATENCY_QUANTA = 2**44
"""Quanta in the sum of every time of a problem (the default quantum is that sum / 2^44): with a
few thousand terms on a path, rounding hides under 1e-9 of the latency (:data:`OPTIMAL_GAP`)."""


def _fits(problem: PlacementProblem, group: Sequence[int]) -> bool:
    return (problem.accelerators > 0 and all(problem.supported[v] for v in group)
            and sum(problem.size_bytes[v] for v in group) <= problem.memory_bytes)


def _inseparable_blocks(problem: PlacementProblem) -> list[list[int]]:
    """Colour classes that reach each other fused into blocks (each a list of nodes in order),
    the blocks in a topological order (ties: first node first); concatenated, a topological
    order of the nodes that keeps each block together."""
    import networkx as nx

    groups = problem.classes()
    group_of = {v: i for i, g in enumerate(groups) for v in g}
    g = nx.DiGraph()
    g.add_nodes_from(range(len(groups)))
    g.add_edges_from((group_of[u], group_of[v]) for u, v in problem.edges if group_of[u] != group_of[v])
    cond = nx.condensation(g)
    return [sorted(v for gi in cond.nodes[c]["members"] for v in groups[gi])
            for c in nx.lexicographical_topological_sort(cond, key=lambda c: min(cond.nodes[c]["members"]))]


def _permuted(problem: PlacementProblem, order: Sequence[int]) -> PlacementProblem:
    """``problem`` with its nodes renumbered in ``order`` (a topological order)."""
    index = {v: i for i, v in enumerate(order)}
    return PlacementProblem(
        name=problem.name, node_ids=tuple(problem.node_ids[v] for v in order),
        acc_s=tuple(problem.acc_s[v] for v in order), cpu_s=tuple(problem.cpu_s[v] for v in order),
        size_bytes=tuple(problem.size_bytes[v] for v in order), out_s=tuple(problem.out_s[v] for v in order),
        supported=tuple(problem.supported[v] for v in order), colour=tuple(problem.colour[v] for v in order),
        edges=tuple(sorted((index[u], index[v]) for u, v in problem.edges)),
        accelerators=problem.accelerators, memory_bytes=problem.memory_bytes)


def greedy_latency(problem: PlacementProblem) -> Placement:
    """Tarnawski et al.'s greedy baseline (Appendix F, ``latency-greedy/greedy.cpp``): colour
    classes that reach each other are fused into inseparable blocks; the blocks, in topological
    order, fill accelerator after accelerator while they fit its memory; a block that fits no
    accelerator (too large, or with a node not supported there; the original has no such
    nodes) goes to the CPUs and closes the current accelerator (so each accelerator keeps an
    interval of the order: contiguous); once the accelerators are used up the rest runs on CPUs.

    Returns:
        The evaluated placement (status ``feasible``, bound :func:`latency_lower_bound_s`).
    """
    blocks = _inseparable_blocks(problem)
    device = [CPU] * len(problem)
    acc, used = -1, 0.0
    for block in blocks:
        if not _fits(problem, block):
            if acc >= 0:
                used = problem.memory_bytes + 1  # close it: the next block opens a new one
            continue
        size = sum(problem.size_bytes[v] for v in block)
        if acc < 0 or used + size > problem.memory_bytes:
            if acc + 1 >= problem.accelerators:
                break
            acc, used = acc + 1, 0.0
        used += size
        for v in block:
            device[v] = acc
    return evaluate_placement(problem, device, solver="greedy", lower_bound_s=latency_lower_bound_s(problem))


def _interval_dp(problem: PlacementProblem, acc: Sequence[float], cpu: Sequence[float],
                 out: Sequence[float]) -> tuple[float, list[tuple[int, int]]]:
    """The cheapest *serial* time of a placement where each accelerator takes one interval
    ``[i, j)`` of the node order (nodes ``i..j-1``) and the other nodes run on CPUs: every call
    (transfers in from the distinct nodes before ``i`` that feed it, its compute, transfers out
    of the nodes whose last successor lies past it) and every CPU node one after another, with
    costs ``acc``, ``cpu``, ``out``. Intervals that split a colour class, hold an unsupported
    node or exceed the memory are skipped. Returns the time and the intervals, in order.
    ``O(n (n + E) + n^2 k)``, intervals cut short by the memory."""
    n, k, cap = len(problem), problem.accelerators, problem.memory_bytes
    preds = problem.predecessors
    last_succ = [max(s, default=-1) for s in problem.successors]
    lo_class: dict[int, int] = {}
    hi_class: dict[int, int] = {}
    for v, c in enumerate(problem.colour):
        lo_class.setdefault(c, v)
        hi_class[c] = v
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    back: list[list[tuple[int, int] | None]] = [[None] * (n + 1) for _ in range(k + 1)]  # (start, c - 1)
    for c in range(k + 1):
        best[c][0] = 0.0
    for i in range(n + 1):
        if i > 0:
            for c in range(k + 1):
                via_cpu = best[c][i - 1] + cpu[i - 1]
                if via_cpu < best[c][i]:
                    best[c][i], back[c][i] = via_cpu, None
                if c > 0 and best[c - 1][i] < best[c][i]:
                    best[c][i], back[c][i] = best[c - 1][i], (-1, c - 1)
        if i == n or k == 0:
            continue
        senders: set[int] = set()
        comm_in = comm_out = work = size = 0.0
        reach = -1
        for j in range(i, n):
            if not problem.supported[j] or lo_class[problem.colour[j]] < i:
                break
            size += problem.size_bytes[j]
            if size > cap:
                break
            work += acc[j]
            reach = max(reach, hi_class[problem.colour[j]])
            for u in preds[j]:
                if u < i and u not in senders:
                    senders.add(u)
                    comm_in += out[u]
                elif u >= i and last_succ[u] == j:
                    comm_out -= out[u]
            if last_succ[j] > j:
                comm_out += out[j]
            if reach > j:
                continue  # a colour class reaches past j
            cost = comm_in + work + comm_out
            for c in range(1, k + 1):
                if best[c - 1][i] + cost < best[c][j + 1]:
                    best[c][j + 1], back[c][j + 1] = best[c - 1][i] + cost, (i, c - 1)
    intervals = []
    c, j = k, n
    while j > 0:
        step = back[c][j]
        if step is None:
            j -= 1
        elif step[0] < 0:
            c = step[1]
        else:
            intervals.append((step[0], j))
            j, c = step
    return best[k][n], sorted(intervals)


def interval_latency(problem: PlacementProblem) -> Placement:
    """A heuristic placement: each accelerator takes an interval of a topological order that
    keeps colour classes which reach each other together (:func:`_inseparable_blocks`; every
    interval of a topological order is contiguous), chosen by :func:`_interval_dp` to
    minimise the placement's *serial* time (an upper bound of its latency, which overlaps
    independent units).

    Returns:
        The evaluated placement (status ``feasible``, bound :func:`latency_lower_bound_s`).
    """
    order = [v for block in _inseparable_blocks(problem) for v in block]
    moved = _permuted(problem, order)
    _, intervals = _interval_dp(moved, moved.acc_s, moved.cpu_s, moved.out_s)
    device = [CPU] * len(problem)
    for a, (i, j) in enumerate(intervals):
        for v in order[i:j]:
            device[v] = a
    return evaluate_placement(problem, device, solver="interval", lower_bound_s=latency_lower_bound_s(problem))


def placement_of_stages(problem: PlacementProblem, stage_nodes: Sequence[Sequence[int]],
                        on_accelerator: Sequence[bool]) -> Placement:
    """The latency of a pipeline split (the paper's "max-load DP" baseline): stage ``i``'s nodes
    (the input's node ids) go to the next accelerator when ``on_accelerator[i]``, else to the CPUs.

    Raises:
        PlanError: when the split is not a valid placement (more accelerator stages than
            accelerators, memory, contiguity).
    """
    index = {nid: v for v, nid in enumerate(problem.node_ids)}
    device = [CPU] * len(problem)
    acc = 0
    for nodes, on_acc in zip(stage_nodes, on_accelerator, strict=True):
        if on_acc and nodes:
            for nid in nodes:
                device[index[nid]] = acc
            acc += 1
    return evaluate_placement(problem, device, solver="stages", lower_bound_s=latency_lower_bound_s(problem))


def _paths(problem: PlacementProblem, weights: Sequence[Sequence[float]]) -> list[list[int]]:
    """For each weight vector, a heaviest source-to-sink path (nodes in order)."""
    preds = problem.predecessors
    out = []
    for w in weights:
        best, came = [0.0] * len(problem), [-1] * len(problem)
        for v in range(len(problem)):
            u = max(preds[v], key=lambda u: best[u], default=-1)
            best[v] = w[v] + (best[u] if u >= 0 else 0.0)
            came[v] = u
        v = max(range(len(problem)), key=lambda v: best[v])
        path = []
        while v >= 0:
            path.append(v)
            v = came[v]
        out.append(path[::-1])
    return out


def path_lower_bound(problem: PlacementProblem, path: Sequence[int], acc: Sequence[float],
                     cpu: Sequence[float], out: Sequence[float]) -> float:
    """A lower bound of every placement's latency from one source-to-sink ``path``, with node
    costs ``acc``, ``cpu``, ``out`` (seconds, or the CP-SAT model's quanta).

    A contiguous accelerator set meets a path in one interval (a path that left it and came
    back would break contiguity), so along ``path`` a placement is a sequence of CPU nodes and at
    most ``k`` intervals, each within one accelerator's memory, free of unsupported nodes and
    holding whole colour classes. Each unit on the path starts after the one before it, and a
    call costs at least the transfers from the path's nodes that feed it, its path nodes'
    accelerator time and that of their colour classes' members off the path (they run in the
    same call), the transfers out of its path nodes that feed later path nodes, and, for each
    other node off the path that feeds it (counted at its first path successor), the cheaper of
    running it in the call and sending its output. The cheapest
    such sequence (:func:`_interval_dp` on the path alone, where serial time is the latency) is a
    lower bound of the latency.
    """
    on_path = {v: t for t, v in enumerate(path)}
    first: dict[int, int] = {}
    for v in path:
        first.setdefault(problem.colour[v], v)
    extra_acc: dict[int, float] = dict.fromkeys(path, 0.0)
    extra_size: dict[int, float] = dict.fromkeys(path, 0.0)
    succ = problem.successors
    for v in range(len(problem)):
        c = problem.colour[v]
        if v in on_path:
            continue
        if c in first:
            extra_acc[first[c]] += acc[v]
            extra_size[first[c]] += problem.size_bytes[v]
        elif any(w in on_path for w in succ[v]):
            # v feeds the call of its first path successor t: it runs there or is sent there
            t = min((w for w in succ[v] if w in on_path), key=on_path.__getitem__)
            fits = problem.supported[v] and problem.size_bytes[v] <= problem.memory_bytes
            extra_acc[t] += min(out[v], acc[v]) if fits else out[v]
    sub = PlacementProblem(
        name=f"{problem.name} path", node_ids=tuple(problem.node_ids[v] for v in path),
        acc_s=tuple(acc[v] + extra_acc[v] for v in path), cpu_s=tuple(cpu[v] for v in path),
        size_bytes=tuple(problem.size_bytes[v] + extra_size[v] for v in path),
        out_s=tuple(out[v] for v in path), supported=tuple(problem.supported[v] for v in path),
        colour=tuple(problem.colour[v] for v in path),
        edges=tuple((on_path[u], on_path[v]) for u, v in problem.edges if u in on_path and v in on_path),
        accelerators=problem.accelerators, memory_bytes=problem.memory_bytes)
    return _interval_dp(sub, sub.acc_s, sub.cpu_s, sub.out_s)[0]


def chain_lower_bound_s(problem: PlacementProblem) -> float:
    """The largest :func:`path_lower_bound` over a few heaviest paths (by the cheaper device's
    time, by accelerator time, by accelerator time plus transfers), and the plain longest path
    (:func:`~fxsplit.ir.placement.latency_lower_bound_s`). Seconds."""
    return max([latency_lower_bound_s(problem)]
               + [path_lower_bound(problem, p, problem.acc_s, problem.cpu_s, problem.out_s)
                  for p in _paths(problem, _path_weights(problem, problem.acc_s, problem.cpu_s, problem.out_s))])


def _path_weights(problem: PlacementProblem, acc: Sequence[float], cpu: Sequence[float],
                  out: Sequence[float]) -> list[list[float]]:
    cheap = [min(c, a) if s else c for c, a, s in zip(cpu, acc, problem.supported, strict=True)]
    on_acc = [a if s else c for c, a, s in zip(cpu, acc, problem.supported, strict=True)]
    return [cheap, on_acc, [t + o for t, o in zip(on_acc, out, strict=True)]]


@dataclass
class _Model:
    """The latency model's integer data and variables (keyed like the module docstring)."""

    problem: PlacementProblem
    quantum_s: float
    groups: list[list[int]]
    group_of: list[int]
    acc_q: list[int]
    cpu_q: list[int]
    out_q: list[int]
    horizon: int
    x: dict[tuple[int, int], Any] = field(default_factory=dict)
    on_cpu: dict[int, Any] = field(default_factory=dict)
    L: list[Any] = field(default_factory=list)
    latency: Any = None

    @classmethod
    def of(cls, problem: PlacementProblem, quantum_s: float | None) -> _Model:
        k = problem.accelerators
        groups = problem.classes()
        group_of = [0] * len(problem)
        for i, g in enumerate(groups):
            for v in g:
                group_of[v] = i
        total = (sum(max(c, a) for c, a in zip(problem.cpu_s, problem.acc_s, strict=True))
                 + (k + 1) * sum(problem.out_s))
        q = quantum_s or max(total, 1e-300) / LATENCY_QUANTA
        acc_q = [int(t / q) for t in problem.acc_s]
        cpu_q = [int(t / q) for t in problem.cpu_s]
        out_q = [int(t / q) for t in problem.out_s]
        # a path passes each node once and each node's transfer at most k + 1 times
        horizon = sum(max(c, a) for c, a in zip(cpu_q, acc_q, strict=True)) + (k + 1) * sum(out_q) + k + 1
        return cls(problem, q, groups, group_of, acc_q, cpu_q, out_q, horizon)

    def on(self, v: int, a: int) -> Any:
        """``x`` of node ``v``'s class on accelerator ``a``, or None where it cannot go there."""
        return self.x.get((self.group_of[v], a))


def _add_assignment(m: Any, d: _Model) -> None:
    """Each colour class on one accelerator or the CPUs; classes with an unsupported node, or
    larger than an accelerator, on the CPUs; each accelerator within its memory."""
    pb, k = d.problem, d.problem.accelerators
    for gi, g in enumerate(d.groups):
        if _fits(pb, g):
            for a in range(k):
                d.x[gi, a] = m.NewBoolVar(f"x[{gi},{a}]")
        d.on_cpu[gi] = m.NewBoolVar(f"cpu[{gi}]")
        m.AddExactlyOne([d.on_cpu[gi], *(d.x[gi, a] for a in range(k) if (gi, a) in d.x)])
    for a in range(k):
        terms = [(int(sum(pb.size_bytes[v] for v in d.groups[gi])), lit) for (gi, b), lit in d.x.items() if b == a]
        if sum(size for size, _ in terms) > pb.memory_bytes:
            m.Add(sum(size * lit for size, lit in terms) <= int(pb.memory_bytes))


def _add_symmetry(m: Any, d: _Model) -> None:
    """Identical accelerators are used in order of their first class (classes by first node):
    accelerator ``a > 0`` holds class ``g`` only when ``a - 1`` holds a class before ``g``.
    ``before[g, a]`` is that prefix OR."""
    order = sorted({gi for gi, _ in d.x})
    before: dict[tuple[int, int], Any] = {}
    for a in range(d.problem.accelerators):
        running = None
        for gi in order:
            before[gi, a] = running
            seen = m.NewBoolVar(f"seen[{gi},{a}]")  # a class up to gi is on a
            m.AddBoolOr([d.x[gi, a]] + ([running] if running is not None else [])).OnlyEnforceIf(seen)
            m.AddImplication(d.x[gi, a], seen)
            if running is not None:
                m.AddImplication(running, seen)
            running = seen
        if a > 0:
            for gi in order:
                if before[gi, a - 1] is None:
                    m.Add(d.x[gi, a] == 0)
                else:
                    m.AddImplication(d.x[gi, a], before[gi, a - 1])


def _add_contiguity(m: Any, d: _Model) -> None:
    """lip.py's contiguity: ``z[v, a]`` covers ``S_a`` and its ancestors and is 0 on a node
    outside ``S_a`` with a predecessor inside, so no path leaves ``S_a`` and returns. (The
    calls' quantum in :func:`_add_times` implies it too; kept as the IP states it.)"""
    pb = d.problem
    for a in range(pb.accelerators):
        z = [m.NewBoolVar(f"z[{v},{a}]") for v in range(len(pb))]
        for v in range(len(pb)):
            if d.on(v, a) is not None:
                m.AddImplication(d.on(v, a), z[v])
        for u, v in pb.edges:
            m.AddImplication(z[v], z[u])
            if d.group_of[u] != d.group_of[v] and d.on(u, a) is not None:
                m.AddBoolOr([d.on(u, a).Not(), z[v].Not()] + ([d.on(v, a)] if d.on(v, a) is not None else []))


def _add_times(m: Any, d: _Model) -> None:
    """Node finish times ``L``, each accelerator's call (start after its senders, transfers in,
    compute, transfers out, plus one quantum so that calls cannot wait on each other in a cycle),
    CPU nodes after their predecessors; the latency is the latest sink, at least the path bound
    (:func:`path_lower_bound` on the model's own integers: valid for the model)."""
    pb, k = d.problem, d.problem.accelerators
    preds, succ, n = pb.predecessors, pb.successors, len(pb)
    floor = [0] * n  # longest path on the cheaper device, transfers free
    for v in range(n):
        own = min(d.cpu_q[v], d.acc_q[v]) if pb.supported[v] else d.cpu_q[v]
        floor[v] = max((floor[u] for u in preds[v]), default=0) + own
    d.L = [m.NewIntVar(min(floor[v], d.horizon), d.horizon, f"L[{v}]") for v in range(n)]
    for a in range(k):
        start = m.NewIntVar(0, d.horizon, f"start[{a}]")
        finish = m.NewIntVar(0, d.horizon, f"finish[{a}]")
        load = [d.acc_q[v] * d.on(v, a) for v in range(n) if d.on(v, a) is not None and d.acc_q[v]]
        for u in range(n):
            outside = [v for v in succ[u] if d.group_of[v] != d.group_of[u]]
            receivers = [v for v in outside if d.on(v, a) is not None]
            if receivers:  # u sends into S_a: the call waits for u and pays its transfer in
                sends = m.NewBoolVar(f"in[{u},{a}]")
                for v in receivers:
                    when = [d.on(v, a)] + ([d.on(u, a).Not()] if d.on(u, a) is not None else [])
                    m.AddBoolOr([lit.Not() for lit in when] + [sends])
                    m.Add(start >= d.L[u]).OnlyEnforceIf(when)
                if d.out_q[u]:
                    load.append(d.out_q[u] * sends)
            if outside and d.on(u, a) is not None and d.out_q[u]:  # u in S_a sends out: transfer out
                leaves = m.NewBoolVar(f"out[{u},{a}]")
                for v in outside:
                    m.AddBoolOr([d.on(u, a).Not(), leaves] + ([d.on(v, a)] if d.on(v, a) is not None else []))
                load.append(d.out_q[u] * leaves)
        m.Add(finish == start + sum(load) + 1)
        for v in range(n):
            if d.on(v, a) is not None:
                m.Add(d.L[v] >= finish).OnlyEnforceIf(d.on(v, a))
    for v in range(n):
        lit = d.on_cpu[d.group_of[v]]
        m.Add(d.L[v] >= d.cpu_q[v]).OnlyEnforceIf(lit)
        for u in preds[v]:
            m.Add(d.L[v] >= d.L[u] + d.cpu_q[v]).OnlyEnforceIf(lit)
            m.Add(d.L[v] >= d.L[u])
    paths = _paths(pb, _path_weights(pb, d.acc_q, d.cpu_q, d.out_q))
    chain_q = max([max(floor, default=0)] + [int(path_lower_bound(pb, p, d.acc_q, d.cpu_q, d.out_q)) for p in paths])
    d.latency = m.NewIntVar(min(chain_q, d.horizon), d.horizon, "latency")
    for v in range(n):
        if not succ[v]:
            m.Add(d.latency >= d.L[v])
    m.Minimize(d.latency)


def _add_hint(m: Any, d: _Model, hint: Placement) -> None:
    for gi, g in enumerate(d.groups):
        where = hint.device[g[0]]
        m.AddHint(d.on_cpu[gi], where == CPU)
        for a in range(d.problem.accelerators):
            if (gi, a) in d.x:
                m.AddHint(d.x[gi, a], where == a)


def solve_latency(
    problem: PlacementProblem,
    *,
    time_limit_s: float = 60.0,
    num_workers: int = 2,
    seed: int = 0,
    hint: Placement | None = None,
    quantum_s: float | None = None,
    log_search: bool = False,
) -> Placement:
    """Minimise one sample's latency with OR-Tools CP-SAT (the model in the module docstring).

    Args:
        problem: The placement problem (e.g. :func:`fxsplit.ir.formats.load_tarnawski_latency`).
        time_limit_s: Wall-clock limit of the search, seconds.
        num_workers, seed: CP-SAT's search workers and random seed.
        hint: A placement to start from besides :func:`greedy_latency`,
            :func:`interval_latency` and everything on CPUs (the search starts from the
            cheapest). The result is never worse than any of them.
        quantum_s: Seconds per integer time unit; default the problem's total time /
            :data:`LATENCY_QUANTA`.
        log_search: Let CP-SAT log its search to this module's logger.

    Returns:
        The best placement found, exactly evaluated: ``optimal`` when CP-SAT proved it and its
        exact latency is within ``OPTIMAL_GAP`` of the proven bound, else ``feasible`` with the
        bound. ``stats``: ``cp_status``, ``quantum_s``, ``cp_wall_s``, ``wall_s``, ``from``
        (``"search"`` or ``"hint"``), ``variables``.

    Never infeasible: every node on a CPU is a placement.

    Raises:
        ConfigError: for a malformed problem (:meth:`PlacementProblem.check`).
        PlanError: for a hint that is not a valid placement of ``problem``.
        InternalError: when CP-SAT calls the model invalid or infeasible, or its bound exceeds
            a valid placement's latency (each a bug in this model; please report it).
    """
    from ortools.sat.python import cp_model

    from fxsplit.solvers.cpsat import SAFE_PARAMETERS

    t0 = time.perf_counter()
    problem.check()
    n, k = len(problem), problem.accelerators
    all_cpu = evaluate_placement(problem, [CPU] * n, solver="all-cpu", lower_bound_s=latency_lower_bound_s(problem))
    given = [] if hint is None else [evaluate_placement(problem, hint.device, solver=hint.solver)]  # checked
    starts = [greedy_latency(problem), interval_latency(problem), all_cpu, *given]
    hint = min(starts, key=lambda p: p.latency_s)
    if k == 0 or n == 0:
        return all_cpu.with_(solver="cpsat", status="optimal", lower_bound_s=all_cpu.latency_s,
                             stats={"cp_status": "TRIVIAL", "wall_s": time.perf_counter() - t0})
    d = _Model.of(problem, quantum_s)
    m: Any = cp_model.CpModel()
    _add_assignment(m, d)
    _add_symmetry(m, d)
    _add_contiguity(m, d)
    _add_times(m, d)
    _add_hint(m, d, hint)

    solver: Any = cp_model.CpSolver()
    for key, value in SAFE_PARAMETERS.items():
        setattr(solver.parameters, key, value)
    solver.parameters.num_workers = num_workers
    solver.parameters.random_seed = seed
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s - (time.perf_counter() - t0))
    if log_search:
        solver.parameters.log_search_progress = True
        solver.log_callback = logger.info
    status = solver.Solve(m)
    name = solver.StatusName(status)
    stats: dict[str, Any] = {"cp_status": name, "quantum_s": d.quantum_s, "cp_wall_s": solver.WallTime(),
                             "variables": len(m.Proto().variables)}
    if status == cp_model.MODEL_INVALID:
        raise InternalError(f"latency CP-SAT model of {problem.name!r} is invalid ({m.Validate()}); a bug in fxsplit")
    if status == cp_model.INFEASIBLE:
        raise InternalError(f"latency CP-SAT proved {problem.name!r} infeasible, but every node on a CPU is a "
                            "placement: a bug in fxsplit's latency model; please report it with the file")
    solved = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    # a path passes at most k calls, each 1 quantum over its rounded-down time
    bound = max(chain_lower_bound_s(problem), (solver.BestObjectiveBound() - k) * d.quantum_s if solved else 0.0)
    best, stats["from"] = hint, "hint"
    if solved:
        device = [CPU] * n
        for (gi, a), lit in d.x.items():
            if solver.BooleanValue(lit):
                for v in d.groups[gi]:
                    device[v] = a
        found = evaluate_placement(problem, device)
        if found.latency_s <= best.latency_s:
            best, stats["from"] = found, "search"
    if best.latency_s < bound * (1 - 1e-9) - 1e-15:
        raise InternalError(f"latency CP-SAT's bound {bound:.9g} s is above a valid placement's latency "
                            f"{best.latency_s:.9g} s on {problem.name!r}: a bug in fxsplit's latency model")
    stats["wall_s"] = time.perf_counter() - t0
    return evaluate_placement(problem, best.device, solver="cpsat", lower_bound_s=bound, stats=stats,
                              status="optimal" if status == cp_model.OPTIMAL else "feasible")
