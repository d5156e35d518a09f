"""The best parallelization strategy per layer: PaSE's exact DP, CP-SAT and brute force (torch-free).

Given a :class:`~fxsplit.ir.strategy.StrategyGraph`, choose one option per vertex to minimise
compute plus redistribution seconds. PaSE's DP orders the vertices so that the *dependent set*
of each position (the vertices already placed that still have an edge to one not yet placed)
stays small, and keeps for every configuration of the dependent set the cheapest cost of what is
placed; a vertex leaves the set once its last neighbour is placed. The table holds
``prod(|options|)`` over the dependent set, small for the chains and cells of real networks.
:func:`solve_pase_elimination` solves the same problem by min-sum variable elimination, whose
tables follow the graph's tree width (vertices that feed every layer, as a transformer's rotary
tables do, stay in every dependent set but in no elimination table for long); it is what
:func:`solve_strategies` tries first. Past ``max_states`` CP-SAT (one Boolean per vertex option,
one per edge option pair, an optional memory limit) proves the same optimum.

Example:
    >>> from fxsplit.ir.strategy import StrategyEdge, StrategyGraph, StrategyOption, StrategyVertex
    >>> opts = (StrategyOption("dp", 4.0), StrategyOption("tp", 3.0))
    >>> g = StrategyGraph((StrategyVertex("a", opts), StrategyVertex("b", opts), StrategyVertex("c", opts)),
    ...                   (StrategyEdge(0, 1, ((0.0, 2.0), (2.0, 0.5))), StrategyEdge(1, 2, ((0.0, 2.0), (2.0, 0.5)))))
    >>> best = solve_pase_dp(g)
    >>> best.choice, best.cost_s, best.cost_s == solve_brute_force(g).cost_s
    ((1, 1, 1), 10.0, True)

References:
    Elango, "Automatic Parallelization Strategies for Efficient DNN Training", IPDPS 2021, §IV
    (vertex ordering, dependent sets, the DP); code: github.com/baidu-research/PaSE.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from fxsplit.errors import InfeasibleError, SolverError
from fxsplit.ir.strategy import StrategyGraph, StrategyOption, StrategyVertex
from fxsplit.solvers.pase_reduce import reduce_graph

__all__ = ["StrategyChoice", "dependent_sets", "elimination_order", "order_vertices", "solve_brute_force",
           "solve_pase_cpsat", "solve_pase_dp", "solve_pase_elimination", "solve_pase_lagrangian", "solve_strategies"]


@dataclass(frozen=True)
class StrategyChoice:
    """The option chosen per vertex, its seconds and per-device bytes, and how it was found
    (``proven``: an exact solver finished; ``lower_bound_s``: a proven bound of the optimum when
    it did not, else 0)."""

    choice: tuple[int, ...]
    cost_s: float
    memory_bytes: float
    solver: str
    proven: bool = True
    max_states: int = 0
    solve_time_s: float = 0.0
    lower_bound_s: float = 0.0

    def names(self, graph: StrategyGraph) -> list[str]:
        """``[num_vertices]`` the chosen option's name per vertex."""
        return [v.options[c].name for v, c in zip(graph.vertices, self.choice, strict=True)]


def dependent_sets(graph: StrategyGraph, order: Sequence[int]) -> list[tuple[int, ...]]:
    """For each position ``i`` of ``order``, the vertices placed at ``0..i`` with an edge to one
    placed later (PaSE's dependent set after placing ``order[i]``)."""
    pos = {v: i for i, v in enumerate(order)}
    last = [max((pos[w] for w in nbrs), default=-1) for nbrs in graph.neighbours()]
    sets: list[tuple[int, ...]] = []
    live: list[int] = []
    for i, v in enumerate(order):
        live = [u for u in (*live, v) if last[u] > i]
        sets.append(tuple(live))
    return sets


def _table_size(graph: StrategyGraph, order: Sequence[int]) -> int:
    sizes = [len(v.options) for v in graph.vertices]
    return max((math.prod(sizes[u] for u in dep) for dep in dependent_sets(graph, order)), default=1)


def order_vertices(graph: StrategyGraph) -> list[int]:
    """A vertex order with small dependent sets: the best of the given (topological) order, a
    breadth-first order from the first vertex over the undirected graph (PaSE's ordering), and
    (up to 2000 vertices) a greedy order that always places the vertex adding the fewest new
    dependents."""
    n = len(graph)
    nbrs = graph.neighbours()
    candidates = [list(range(n)), _breadth_first(nbrs)]
    if n <= 2000:  # the greedy order is quadratic
        candidates.append(_greedy(nbrs))
    return min(candidates, key=lambda order: (_table_size(graph, order), order))


def _breadth_first(nbrs: list[set[int]]) -> list[int]:
    order: list[int] = []
    seen: set[int] = set()
    for start in range(len(nbrs)):
        if start in seen:
            continue
        queue = [start]
        seen.add(start)
        while queue:
            v = queue.pop(0)
            order.append(v)
            for w in sorted(nbrs[v] - seen):
                seen.add(w)
                queue.append(w)
    return order


def _greedy(nbrs: list[set[int]]) -> list[int]:
    placed: list[int] = []
    left = set(range(len(nbrs)))
    while left:  # place the vertex that brings the fewest unplaced neighbours into play
        v = min(left, key=lambda u: (len(nbrs[u] & left - {u}), u))
        placed.append(v)
        left.remove(v)
    return placed


def solve_pase_dp(graph: StrategyGraph, *, max_states: int = 1_000_000, reduce: bool = True) -> StrategyChoice:
    """PaSE's DP over dependent-set configurations; exact, without a memory limit.

    Args:
        graph: The strategy graph.
        max_states: Largest dependent-set table allowed.
        reduce: First remove the vertices with one or two neighbours exactly
            (:func:`fxsplit.solvers.pase_reduce.reduce_graph`), so the DP runs on what is left.

    Returns:
        The cheapest choice (``max_states``: the DP's largest table).

    Raises:
        SolverError: when the best order's table exceeds ``max_states`` (use CP-SAT).
        InfeasibleError: when every choice has a pair of neighbours that cannot follow each other.
    """
    start = time.perf_counter()
    if reduce:
        reduced = reduce_graph(graph)
        sub = _dp(reduced.graph, max_states) if len(reduced.graph) else ((), 1)
        choice = reduced.expand(dict(enumerate(sub[0])))
        size = sub[1]
    else:
        choice, size = _dp(graph, max_states)
    cost = graph.cost_s(choice)
    if math.isinf(cost):
        raise InfeasibleError(f"every strategy of the {len(graph)} vertices has a pair of neighbours that cannot "
                              "follow each other (infinite redistribution cost)")
    return StrategyChoice(tuple(choice), cost, graph.memory_bytes(choice), "pase-dp",
                          max_states=size, solve_time_s=time.perf_counter() - start)


def _dp(graph: StrategyGraph, max_states: int) -> tuple[tuple[int, ...], int]:
    """The DP proper: the cheapest choice and the largest table size."""
    order = order_vertices(graph)
    size = _table_size(graph, order)
    if size > max_states:
        raise SolverError(f"PaSE DP: the smallest dependent-set table of {len(graph)} vertices has {size} states, "
                          f"more than max_states={max_states}; use solve_pase_cpsat (or raise max_states)")
    pos = {v: i for i, v in enumerate(order)}
    incoming: list[list[tuple[int, tuple[tuple[float, ...], ...], bool]]] = [[] for _ in graph.vertices]
    for e in graph.edges:  # each edge costed when its later-placed end is placed
        if pos[e.src] < pos[e.dst]:
            incoming[e.dst].append((e.src, e.cost_s, True))
        else:
            incoming[e.src].append((e.dst, e.cost_s, False))
    deps = dependent_sets(graph, order)
    # table: configuration of the current dependent set (option per vertex in it) -> (cost, back)
    table: dict[tuple[int, ...], tuple[float, tuple[int, ...], int]] = {(): (0.0, (), -1)}
    history: list[dict[tuple[int, ...], tuple[float, tuple[int, ...], int]]] = []
    prev: tuple[int, ...] = ()
    for i, v in enumerate(order):
        scope = (*prev, v)  # vertices the new table's keys are projected from
        keep = [scope.index(u) for u in deps[i]]
        new: dict[tuple[int, ...], tuple[float, tuple[int, ...], int]] = {}
        for key, (cost, _, _) in table.items():
            assigned = dict(zip(prev, key, strict=True))
            for o, opt in enumerate(graph.vertices[v].options):
                c = cost + opt.compute_s
                for u, matrix, u_first in incoming[v]:
                    c += matrix[assigned[u]][o] if u_first else matrix[o][assigned[u]]
                full = (*key, o)
                nkey = tuple(full[k] for k in keep)
                if nkey not in new or c < new[nkey][0]:
                    new[nkey] = (c, key, o)
        history.append(new)
        table, prev = new, deps[i]
    choice = [0] * len(graph)
    at: tuple[int, ...] = ()  # the last dependent set is empty
    for i in range(len(order) - 1, -1, -1):
        _, back, o = history[i][at]
        choice[order[i]] = o
        at = back
    return tuple(choice), size


def elimination_order(graph: StrategyGraph) -> tuple[list[int], int]:
    """A min-size elimination order of ``graph``'s interaction graph and its largest table: each
    step eliminates the vertex whose neighbours (with the edges earlier eliminations added among
    them) have the fewest option combinations; ties by index. Returns the order and the largest
    ``options(v) x prod(options(neighbours))`` met (the size of the biggest table
    :func:`solve_pase_elimination` builds). ``O((n + fill) log n)``."""
    sizes = [len(v.options) for v in graph.vertices]
    nbrs = graph.neighbours()

    def key(u: int) -> int:
        return math.prod(sizes[w] for w in nbrs[u])

    heap = [(key(u), u) for u in range(len(graph))]
    heapq.heapify(heap)
    done = [False] * len(graph)
    order: list[int] = []
    largest = 1
    while heap:
        k, v = heapq.heappop(heap)
        if done[v] or k != key(v):
            continue  # eliminated already, or a stale key
        done[v] = True
        order.append(v)
        largest = max(largest, k * sizes[v])
        for w in nbrs[v]:
            nbrs[w] |= nbrs[v] - {w}
            nbrs[w].discard(v)
        for w in nbrs[v]:
            heapq.heappush(heap, (key(w), w))
        nbrs[v] = set()
    return order, largest


def solve_pase_elimination(graph: StrategyGraph, *, max_states: int = 5_000_000) -> StrategyChoice:
    """Exact min-sum variable elimination (bucket elimination) over the strategy graph: the
    unary costs (compute) and pairwise costs (redistribution) are tables; eliminating a vertex
    adds up the tables that mention it over the union of their vertices, keeps the minimum over
    its options (a new table over its neighbours) and the argmin for back-substitution. In
    :func:`elimination_order`'s min-size order the tables follow the graph's tree width, not its
    path width as PaSE's dependent sets do: on a Llama-7B-shaped strategy graph (2,276
    vertices; rotary tables and the mask feed every layer) the largest table is 0.6 million
    entries where the best dependent-set order needs 45 million. Same optimum as
    :func:`solve_pase_dp`; no memory limit.

    Args:
        graph: The strategy graph.
        max_states: Largest table allowed (entries).

    Returns:
        The cheapest choice (``max_states``: the largest table built, as
        :func:`elimination_order` predicts).

    Raises:
        SolverError: when the order's largest table exceeds ``max_states``.
        InfeasibleError: when every choice has a pair of neighbours that cannot follow each other.

    References:
        Dechter, "Bucket elimination: a unifying framework for reasoning", Artificial
        Intelligence 113, 1999.
    """
    import numpy as np

    start = time.perf_counter()
    order, largest = elimination_order(graph)
    if largest > max_states:
        raise SolverError(f"variable elimination over {len(graph)} vertices needs a table of {largest} entries, more "
                          f"than max_states={max_states}; use solve_pase_cpsat (or raise max_states)")
    sizes = [len(v.options) for v in graph.vertices]
    tables: dict[int, tuple[tuple[int, ...], Any]] = {}  # id -> (vertices, values over their options)
    mentions: list[set[int]] = [set() for _ in graph.vertices]  # vertex -> ids of the tables over it
    records: list[tuple[int, tuple[int, ...], Any]] = []
    table_id = 0
    for v, vert in enumerate(graph.vertices):
        tables[table_id] = ((v,), np.array([o.compute_s for o in vert.options], dtype=float))
        mentions[v].add(table_id)
        table_id += 1
    for e in graph.edges:
        tables[table_id] = ((e.src, e.dst), np.array(e.cost_s, dtype=float))
        mentions[e.src].add(table_id)
        mentions[e.dst].add(table_id)
        table_id += 1
    total, built = 0.0, 1
    for v in order:
        ids = sorted(mentions[v])
        rest = sorted({w for t in ids for w in tables[t][0]} - {v})
        axes = {w: i for i, w in enumerate([*rest, v])}
        joint = np.zeros([sizes[w] for w in rest] + [sizes[v]])
        for t in ids:
            scope, values = tables.pop(t)
            for w in scope:
                mentions[w].discard(t)
            shape = [1] * joint.ndim
            for w in scope:
                shape[axes[w]] = sizes[w]
            joint = joint + np.transpose(values, sorted(range(len(scope)), key=lambda i: axes[scope[i]])).reshape(shape)
        built = max(built, joint.size)
        records.append((v, tuple(rest), joint.argmin(axis=-1)))
        best = joint.min(axis=-1)
        if rest:
            tables[table_id] = (tuple(rest), best)
            for w in rest:
                mentions[w].add(table_id)
            table_id += 1
        else:
            total += float(best)
    if math.isinf(total):
        raise InfeasibleError(f"every strategy of the {len(graph)} vertices has a pair of neighbours that cannot "
                              "follow each other (infinite redistribution cost)")
    choice = [0] * len(graph)
    for v, rest, arg in reversed(records):
        choice[v] = int(arg[tuple(choice[w] for w in rest)])
    return StrategyChoice(tuple(choice), graph.cost_s(choice), graph.memory_bytes(choice), "pase-elimination",
                          max_states=built, solve_time_s=time.perf_counter() - start)


def _priced(graph: StrategyGraph, price: float) -> StrategyGraph:
    """``graph`` with ``price`` seconds per byte of each option's memory added to its compute."""
    return StrategyGraph(tuple(StrategyVertex(v.name, tuple(StrategyOption(o.name, o.compute_s + price * o.memory_bytes,
                                                                           o.memory_bytes) for o in v.options))
                               for v in graph.vertices), graph.edges)


def solve_pase_lagrangian(graph: StrategyGraph, memory_limit_bytes: float, *, max_states: int = 1_000_000,
                          rounds: int = 24, unpriced: StrategyChoice | None = None) -> StrategyChoice:
    """The cheapest choice within ``memory_limit_bytes`` per device, by Lagrangian relaxation of
    the memory row: at a price ``λ`` (seconds per byte) on every option's memory,
    :func:`solve_pase_elimination` gives the exact minimum of ``time + λ · memory``, a choice whose
    memory falls as ``λ`` rises, and ``min(time + λ · memory) - λ · limit``, a lower bound of the
    constrained optimum. ``λ`` is doubled until a choice fits, then bisected for ``rounds``
    steps; the fastest choice that fits is kept with the best bound (``proven`` when they meet).

    ``unpriced``: :func:`solve_pase_elimination`'s result on ``graph`` when the caller has it
    (the price-0 step).

    Raises:
        InfeasibleError: when even each vertex's smallest option exceeds the limit.
        SolverError: as :func:`solve_pase_elimination` (tables past ``max_states``).

    References:
        Fisher, "The Lagrangian relaxation method for solving integer programming problems",
        Management Science 27, 1981.
    """
    from fxsplit.ir.plan import OPTIMAL_GAP

    start = time.perf_counter()
    least = sum(min(o.memory_bytes for o in v.options if math.isfinite(o.compute_s)) for v in graph.vertices
                if any(math.isfinite(o.compute_s) for o in v.options))
    if least > memory_limit_bytes:
        raise InfeasibleError(f"no strategy of the {len(graph)} vertices fits {memory_limit_bytes:.0f} bytes per "
                              f"device: each vertex's smallest option adds up to {least:.0f} bytes")
    best: StrategyChoice | None = None
    bound = 0.0

    def at(price: float) -> bool:
        nonlocal best, bound
        found = (unpriced if price == 0.0 and unpriced is not None
                 else solve_pase_elimination(_priced(graph, price), max_states=max_states))
        cost = graph.cost_s(found.choice)
        bound = max(bound, found.cost_s - price * memory_limit_bytes)
        if found.memory_bytes <= memory_limit_bytes and (best is None or cost < best.cost_s):
            best = StrategyChoice(found.choice, cost, found.memory_bytes, "pase-lagrangian",
                                  max_states=found.max_states)
        return found.memory_bytes <= memory_limit_bytes

    if at(0.0):
        assert best is not None
        return replace(best, solver="pase-elimination", solve_time_s=time.perf_counter() - start)
    scale = max(sum(min(o.compute_s for o in v.options) for v in graph.vertices), 1e-12) / max(memory_limit_bytes, 1.0)
    lo, hi = 0.0, scale
    for _ in range(64):
        if at(hi):
            break
        lo, hi = hi, hi * 4
    for _ in range(rounds):
        mid = (lo + hi) / 2
        if at(mid):
            hi = mid
        else:
            lo = mid
        if best is not None and best.cost_s - bound <= OPTIMAL_GAP * best.cost_s:
            break
    if best is None:  # the smallest options fit, so a high enough price reaches them
        raise SolverError(f"Lagrangian search found no choice within {memory_limit_bytes:.0f} bytes; use CP-SAT")
    return replace(best, proven=best.cost_s - bound <= OPTIMAL_GAP * best.cost_s,
                   lower_bound_s=min(bound, best.cost_s), solve_time_s=time.perf_counter() - start)


def solve_brute_force(graph: StrategyGraph, *, memory_limit_bytes: float | None = None,
                      max_choices: int = 200_000) -> StrategyChoice:
    """Every combination, for tests.

    Raises:
        SolverError: past ``max_choices`` combinations.
        InfeasibleError: when none fits ``memory_limit_bytes``.
    """
    total = math.prod(len(v.options) for v in graph.vertices)
    if total > max_choices:
        raise SolverError(f"brute force over {total} combinations (> {max_choices}); use solve_pase_dp")
    best: tuple[float, tuple[int, ...]] | None = None
    for choice in itertools.product(*(range(len(v.options)) for v in graph.vertices)):
        if memory_limit_bytes is not None and graph.memory_bytes(choice) > memory_limit_bytes:
            continue
        c = graph.cost_s(choice)
        if not math.isinf(c) and (best is None or c < best[0]):
            best = (c, choice)
    if best is None:
        raise InfeasibleError(f"no strategy fits {memory_limit_bytes} bytes per device")
    return StrategyChoice(best[1], best[0], graph.memory_bytes(best[1]), "brute-force")


def solve_pase_cpsat(graph: StrategyGraph, *, memory_limit_bytes: float | None = None,
                     time_limit_s: float | None = 30.0, num_workers: int = 2, seed: int = 0,
                     time_quantum_s: float | None = None, hint: Sequence[int] | None = None) -> StrategyChoice:
    """The same problem as a CP-SAT model, with an optional per-device memory limit.

    Data: costs scaled to integers by ``time_quantum_s`` (default: the largest cost / 2^20).
    Variables: ``pick[v, o]`` (vertex ``v`` takes option ``o``), ``both[e, i, j]`` (edge ``e``'s
    ends take ``i`` and ``j``). Constraints: one option per vertex; ``both`` is the product of
    the two picks (its rows and columns sum to them); memory. Objective: compute plus
    redistribution. ``hint``: a choice to start the search from.

    Raises:
        InfeasibleError: when no choice fits the memory limit (proven).
        SolverError: when the time limit ends the search without a solution.
    """
    from ortools.sat.python import cp_model

    start = time.perf_counter()
    costs = [o.compute_s for v in graph.vertices for o in v.options if not math.isinf(o.compute_s)] + [
        c for e in graph.edges for r in e.cost_s for c in r if not math.isinf(c)]
    # fine enough that the largest cost no plan uses does not round the small ones away
    q = time_quantum_s or max(max(costs, default=0.0), 1e-12) / 2**40
    m = cp_model.CpModel()
    pick = {(v, o): m.new_bool_var(f"pick[{v},{o}]") for v, vert in enumerate(graph.vertices)
            for o in range(len(vert.options))}
    for v, vert in enumerate(graph.vertices):  # one strategy per vertex
        m.add_exactly_one(pick[v, o] for o in range(len(vert.options)))
    objective = []
    for v, vert in enumerate(graph.vertices):
        for o, opt in enumerate(vert.options):
            if math.isinf(opt.compute_s):  # an option that cannot be taken
                m.add(pick[v, o] == 0)
            else:
                objective.append(round(opt.compute_s / q) * pick[v, o])
    for k, e in enumerate(graph.edges):  # both[k, i, j] = pick[src, i] AND pick[dst, j], linearised exactly
        both = {(i, j): m.new_bool_var(f"both[{k},{i},{j}]") for i in range(len(e.cost_s)) for j in range(len(e.cost_s[0]))}
        for i in range(len(e.cost_s)):
            m.add(sum(both[i, j] for j in range(len(e.cost_s[0]))) == pick[e.src, i])
        for j in range(len(e.cost_s[0])):
            m.add(sum(both[i, j] for i in range(len(e.cost_s))) == pick[e.dst, j])
        for (i, j), b in both.items():
            if math.isinf(e.cost_s[i][j]):  # no redistribution gets there
                m.add(b == 0)
            else:
                objective.append(round(e.cost_s[i][j] / q) * b)
    if memory_limit_bytes is not None:  # per-device memory (bytes, integral)
        m.add(sum(math.ceil(opt.memory_bytes) * pick[v, o] for v, vert in enumerate(graph.vertices)
                  for o, opt in enumerate(vert.options)) <= math.floor(memory_limit_bytes))
    m.minimize(sum(objective))
    if hint is not None:
        for (v, o), var in pick.items():
            m.add_hint(var, hint[v] == o)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = num_workers
    solver.parameters.random_seed = seed
    if time_limit_s is not None:
        solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.Solve(m)
    if status == cp_model.INFEASIBLE:
        raise InfeasibleError(f"no strategy of the {len(graph)} vertices fits {memory_limit_bytes} bytes per device "
                              "with every neighbour pair able to follow each other; the smallest per-vertex options "
                              f"add up to {sum(min(o.memory_bytes for o in v.options) for v in graph.vertices):.0f} bytes")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise SolverError(f"CP-SAT found no strategy in {time_limit_s} s (status {solver.StatusName(status)})")
    choice = tuple(next(o for o in range(len(vert.options)) if solver.Value(pick[v, o]))
                   for v, vert in enumerate(graph.vertices))
    return StrategyChoice(choice, graph.cost_s(choice), graph.memory_bytes(choice), "pase-cpsat",
                          proven=status == cp_model.OPTIMAL, solve_time_s=time.perf_counter() - start)


def solve_strategies(graph: StrategyGraph, *, memory_limit_bytes: float | None = None,
                     max_states: int = 1_000_000, time_limit_s: float | None = 30.0) -> StrategyChoice:
    """Variable elimination (:func:`solve_pase_elimination`) when its largest table fits
    ``max_states``, else PaSE's DP when its table does, else CP-SAT. When the exact choice does
    not fit ``memory_limit_bytes``: :func:`solve_pase_lagrangian`, and CP-SAT hinted with its
    choice where the Lagrangian bound does not prove it (the cheaper of the two is returned).

    Raises:
        InfeasibleError: when no choice fits ``memory_limit_bytes``.
        SolverError: when CP-SAT runs out of time without a solution.
    """
    try:
        best = solve_pase_elimination(graph, max_states=max_states)
    except SolverError:
        try:
            best = solve_pase_dp(graph, max_states=max_states)
        except SolverError:
            return solve_pase_cpsat(graph, memory_limit_bytes=memory_limit_bytes, time_limit_s=time_limit_s)
    if memory_limit_bytes is None or best.memory_bytes <= memory_limit_bytes:
        return best
    try:
        relaxed = solve_pase_lagrangian(graph, memory_limit_bytes, max_states=max_states,
                                        unpriced=best if best.solver == "pase-elimination" else None)
    except SolverError:
        return solve_pase_cpsat(graph, memory_limit_bytes=memory_limit_bytes, time_limit_s=time_limit_s)
    if relaxed.proven:
        return relaxed
    exact = solve_pase_cpsat(graph, memory_limit_bytes=memory_limit_bytes, time_limit_s=time_limit_s,
                             hint=relaxed.choice)
    if exact.proven or exact.cost_s < relaxed.cost_s:
        return replace(exact, lower_bound_s=0.0 if exact.proven else relaxed.lower_bound_s)
    return relaxed
