"""The CP-SAT model of :mod:`fxsplit.solvers.cpsat`: data, variables, constraint families, hint.

Reads like the OR-Tools samples: integer data first (:class:`CpData`), variables in tuple-keyed
dicts (:class:`CpVars`), one function per constraint family saying why it exists, the objective,
the hint. ``cp_model`` is passed in so that OR-Tools is imported only by the solver function.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from fxsplit.errors import SolverError
from fxsplit.ir.plan import Plan
from fxsplit.ir.problem import Problem
from fxsplit.solvers.layout import device_classes

__all__ = ["CpData", "CpVars", "build_model"]


@dataclass(frozen=True)
class CpData:
    """The problem as integers: times in quanta (rounded down), bytes exact.

    Attributes:
        num_stages: ``S``, the most stages a plan may use.
        unit_devices: ``[T]`` device indices of each unit (fixed: one device; free: a class).
        allowed: ``[S]`` units stage ``s`` may run on (fixed: ``[s]``; free: all).
        time_q: ``[T][n]`` block time on unit ``t`` in quanta.
        static_bytes, act_bytes: ``[n]`` per block.
        producers: ``{u: [(v, size_bytes), ...]}`` out-edges with bytes > 0.
        comm_q: ``[S - 1]`` ``(latency quanta, quanta per byte)`` of the link after stage ``s``.
        flights: ``{q: [S] in-flight per stage}`` for each possible number of stages ``q``
            (one entry ``{0: ...}`` when in-flight counts do not depend on it).
        check_memory: Whether memory can bind at all.
        fwd_q: ``[T][n]`` block forward time on unit ``t`` in quanta (what recomputing adds).
        recompute: The problem's recompute mode, ``"none"`` in inference.
        fixed_q: The runtime's work per micro-batch on every non-empty stage
            (:meth:`~fxsplit.ir.Problem.stage_overhead_s`) in quanta.
        grad_producers: As ``producers`` with each edge's gradient bytes, in training where they
            differ from the values' (``None``: gradients mirror the values).
        direct_q: ``[(source, readers, quanta), ...]`` the graph's direct transfers
            (:attr:`~fxsplit.ir.CondensedGraph.direct`; one-reader ones summed per pair), each
            paid by every stage it crosses.
    """

    problem: Problem
    quantum_s: float
    num_stages: int
    unit_devices: tuple[tuple[int, ...], ...]
    allowed: tuple[tuple[int, ...], ...]
    time_q: tuple[tuple[int, ...], ...]
    static_bytes: tuple[int, ...]
    act_bytes: tuple[int, ...]
    producers: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    comm_q: tuple[tuple[int, float], ...] = ()
    flights: dict[int, tuple[int, ...]] = field(default_factory=dict)
    check_memory: bool = True
    fwd_q: tuple[tuple[int, ...], ...] = ()
    recompute: str = "none"
    fixed_q: int = 0
    direct_q: tuple[tuple[int, tuple[int, ...], int], ...] = ()
    grad_producers: dict[int, list[tuple[int, int]]] | None = None

    @classmethod
    def of(cls, problem: Problem, quantum_s: float | None = None) -> CpData:
        g, k = problem.graph, problem.num_devices
        S = min(k, len(g))
        if problem.device_order == "free":
            if problem.links:
                raise SolverError("cpsat: device_order='free' with per-pair link overrides is not "
                                  "supported; use device_order='fixed' or one link for all pairs")
            units = tuple(device_classes(problem))
            allowed = tuple(tuple(range(len(units))) for _ in range(S))
        else:
            units, allowed = tuple((d,) for d in range(k)), tuple((s,) for s in range(S))
        times = [b.time_s if problem.training else b.fwd_s for b in g.blocks]
        slowest = min(d.speed for d in problem.devices)
        q = quantum_s or max(sum(times) / slowest, 1e-12) / 2**20
        time_q = tuple(tuple(int(t / problem.devices[u[0]].speed / q) for t in times) for u in units)
        fwd_q = tuple(tuple(int(b.fwd_s / problem.devices[u[0]].speed / q) for b in g.blocks) for u in units)
        static = tuple(int(problem.static_bytes(b)) for b in g.blocks)
        act = tuple(b.activation_bytes for b in g.blocks)
        producers: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for e in g.edges:
            if e.size_bytes > 0:
                producers[e.src].append((e.dst, e.size_bytes))
        comm = []
        for s in range(S - 1):
            link = problem.link_between(s, s + 1) if problem.device_order == "fixed" else problem.link
            comm.append((int(link.latency_s / q), 1.0 / (link.bytes_per_s * q)))
        worst_flight = problem.in_flight(0, k)
        sent = sum(sz for es in producers.values() for _, sz in es)  # every edge in and out of one stage
        whole = problem.stage_memory_bytes(sum(static), sum(act), 2 * sent, 0, worst_flight, False,
                                           transfers=problem.transfer_memory)
        check = whole > min(d.memory_bytes for d in problem.devices)
        per_q = check and problem.in_flight_depends_on_stage_count
        counts = ([k] if not problem.allow_idle_devices else list(range(1, S + 1))) if per_q else [0]
        flights = {p: tuple(problem.in_flight(s, p if p else k) for s in range(S)) for p in counts}
        grads = None
        if problem.training and not g.gradients_mirror:
            grads = defaultdict(list)
            for e in g.edges:
                if e.backward_bytes > 0:
                    grads[e.src].append((e.dst, e.backward_bytes))
        return cls(problem, q, S, units, allowed, time_q, static, act, dict(producers), tuple(comm),
                   flights, check, fwd_q, problem.recompute if problem.may_recompute() else "none",
                   int(problem.stage_overhead_s() / q), _direct_quanta(problem, q),
                   None if grads is None else dict(grads))


def _direct_quanta(problem: Problem, q: float) -> tuple[tuple[int, tuple[int, ...], int], ...]:
    """The graph's direct transfers in quanta over the one link (readers other than the source;
    transfers with one reader summed per (source, reader))."""
    per_byte = 1.0 / (problem.link.bytes_per_s * q)
    pairs, many = problem.graph.direct_groups()
    out: list[tuple[int, tuple[int, ...], int]] = [(a, (b,), int(size * per_byte)) for (a, b), size in pairs.items()]
    out += [(a, readers, int(size * per_byte)) for a, readers, size in many]
    return tuple(x for x in out if x[2] > 0)


@dataclass
class CpVars:
    """Model variables, keyed like the data."""

    pre: dict[tuple[int, int], Any] = field(default_factory=dict)        # block b in stages 0..s (s < S - 1)
    x: dict[tuple[int, int], Any] = field(default_factory=dict)          # block b in stage s: pre[b,s] - pre[b,s-1]
    nonempty: dict[int, Any] = field(default_factory=dict)               # stage s has blocks
    use: dict[tuple[int, int], Any] = field(default_factory=dict)        # stage s runs on unit t
    pipe: dict[int, Any] = field(default_factory=dict)                   # exactly q stages (1F1B)
    out_bytes: dict[int, Any] = field(default_factory=dict)              # bytes over boundary s
    comm_q: dict[int, Any] = field(default_factory=dict)                 # quanta over boundary s
    grad_q: dict[int, Any] = field(default_factory=dict)                 # gradient quanta back over boundary s
    direct_q: dict[int, Any] = field(default_factory=dict)               # direct transfers of stage s, quanta
    load: dict[int, Any] = field(default_factory=dict)                   # stage s time, quanta
    again: dict[int, Any] = field(default_factory=dict)                  # stage s recomputes
    bottleneck: Any = None


def _prefix(v: CpVars, b: int, s: int) -> Any:
    """``pre[b, s]``: 1 when block ``b`` is in stages ``0..s`` (the last prefix holds every block)."""
    return v.pre.get((b, s), 1)


def add_assignment(m: Any, d: CpData, v: CpVars) -> None:
    """Stages as a chain of downsets (ALGORITHMS.md, "CP-SAT on wide graphs"): ``pre[b, s]`` says
    block ``b`` lies in the first ``s + 1`` stages, monotone in ``s``, the last prefix holding
    every block; block ``b`` is in stage ``s`` exactly when ``pre[b, s] - pre[b, s - 1] = 1``.
    Only implications between Booleans, which CP-SAT propagates well, where a one-hot stage per
    block with stage-index sums on every edge propagated weakly on wide graphs. Stages are used in
    order (empty ones last)."""
    n, S = len(d.static_bytes), d.num_stages
    for b in range(n):
        for s in range(S - 1):
            v.pre[b, s] = m.NewBoolVar(f"pre[{b},{s}]")
            if s > 0:
                m.AddImplication(v.pre[b, s - 1], v.pre[b, s])
        for s in range(S):
            v.x[b, s] = _prefix(v, b, s) - (_prefix(v, b, s - 1) if s > 0 else 0)
    for s in range(S):
        v.nonempty[s] = m.NewBoolVar(f"nonempty[{s}]")
        for b in range(n):
            m.Add(v.nonempty[s] >= v.x[b, s])
        m.Add(v.nonempty[s] <= sum(v.x[b, s] for b in range(n)))
        if s > 0:
            m.Add(v.nonempty[s] <= v.nonempty[s - 1])
    if not d.problem.allow_idle_devices:
        for s in range(S):
            m.Add(v.nonempty[s] == 1)


def add_precedence(m: Any, d: CpData, v: CpVars) -> None:
    """Every stage prefix is a downset: a block in the first ``s + 1`` stages has its producers there too."""
    for e in d.problem.graph.edges:
        for s in range(d.num_stages - 1):
            m.AddImplication(v.pre[e.dst, s], v.pre[e.src, s])


def add_units(m: Any, d: CpData, v: CpVars) -> None:
    """A non-empty stage runs on one allowed unit; a unit runs at most as many stages as it has.

    Symmetry breaking for identical devices: with free device order a unit is a class of
    interchangeable devices (same speed and memory, :func:`~fxsplit.solvers.layout.device_classes`)
    and the model picks a class per stage and counts, never a device, so the ``k!`` relabellings of
    identical devices are one solution; stages are used in order (:func:`add_assignment`). With
    fixed order stage ``s`` is device ``s``: nothing to permute."""
    for s, units in enumerate(d.allowed):
        for t in units:
            v.use[s, t] = m.NewBoolVar(f"use[{s},{t}]")
        m.Add(sum(v.use[s, t] for t in units) == v.nonempty[s])
    for t, devs in enumerate(d.unit_devices):
        m.Add(sum(v.use[s, t] for s in range(d.num_stages) if (s, t) in v.use) <= len(devs))


def _max_comm_q(d: CpData, s: int) -> int:
    """Most quanta over boundary ``s`` one way (the values', or their gradients')."""
    lat_q, q_per_byte = d.comm_q[s]
    return lat_q + max(sum(int(max(sz for _, sz in outs) * q_per_byte) for outs in producers.values())
                       for producers in (d.producers, d.grad_producers or {}))


def _crossing(m: Any, v: CpVars, producers: dict[int, list[tuple[int, int]]], s: int, q_per_byte: float,
              tag: str) -> tuple[list[Any], list[Any], Any]:
    """Bytes and quanta each producer sends over boundary ``s`` (its largest crossing edge of
    ``producers``), and a Boolean that some edge crosses."""
    any_cross = m.NewBoolVar(f"any_{tag}[{s}]")
    sent_bytes, sent_q = [], []
    for u, outs in producers.items():
        by_size: dict[int, list[int]] = defaultdict(list)
        for dst, sz in outs:
            by_size[sz].append(dst)
        cross = {}
        for sz, dsts in by_size.items():
            cross[sz] = m.NewBoolVar(f"{tag}[{u},{sz},{s}]")
            for dst in dsts:
                m.Add(cross[sz] >= _prefix(v, u, s) - _prefix(v, dst, s))
            m.AddImplication(cross[sz], any_cross)
        big = max(by_size)
        if len(cross) == 1:
            sent_bytes.append(big * cross[big])
            sent_q.append(int(big * q_per_byte) * cross[big])
            continue
        b_var = m.NewIntVar(0, big, f"{tag}_bytes[{u},{s}]")
        q_var = m.NewIntVar(0, int(big * q_per_byte), f"{tag}_q[{u},{s}]")
        for sz, c in cross.items():
            m.Add(b_var >= sz * c)
            m.Add(q_var >= int(sz * q_per_byte) * c)
        sent_bytes.append(b_var)
        sent_q.append(q_var)
    return sent_bytes, sent_q, any_cross


def add_boundaries(m: Any, d: CpData, v: CpVars) -> None:
    """Bytes and time over each boundary: a producer sends its largest crossing edge once (and,
    where gradients are smaller than the values, its largest crossing gradient back).

    ``cross[u, size, s]`` is forced to 1 when an edge of that size from ``u`` crosses boundary
    ``s`` (``a[u, s] - a[v, s] = 1``); the minimisation keeps it 0 otherwise.
    """
    for s in range(d.num_stages - 1):
        lat_q, q_per_byte = d.comm_q[s]
        sent_bytes, sent_q, any_cross = _crossing(m, v, d.producers, s, q_per_byte, "cross")
        v.out_bytes[s] = sum(sent_bytes)
        v.comm_q[s] = lat_q * any_cross + sum(sent_q)
        if d.grad_producers is not None:
            _, grad_q, any_grad = _crossing(m, v, d.grad_producers, s, q_per_byte, "grad")
            v.grad_q[s] = lat_q * any_grad + sum(grad_q)


def add_direct(m: Any, d: CpData, v: CpVars) -> None:
    """Direct transfers (:class:`~fxsplit.ir.graph.DirectTransfer`): ``pays[t, s]`` is forced to 1
    when stage ``s`` holds the source of transfer ``t`` but not one of its readers, or a reader
    but not the source (``|x[a, s] - x[r, s]| = 1``); the minimisation keeps it 0 otherwise."""
    for s in range(d.num_stages):
        terms = []
        for t, (a, readers, quanta) in enumerate(d.direct_q):
            pays = m.NewBoolVar(f"pays[{t},{s}]")
            for r in readers:
                m.Add(pays >= v.x[a, s] - v.x[r, s])
                m.Add(pays >= v.x[r, s] - v.x[a, s])
            terms.append(quanta * pays)
        v.direct_q[s] = sum(terms)


def _recomputes(m: Any, d: CpData, v: CpVars, s: int) -> Any:
    """``again[s]``: stage ``s`` recomputes its activations (1 under ``"all"``; a choice under
    ``"auto"`` where memory can bind; 0 otherwise, as :meth:`~fxsplit.ir.Problem.recomputes`)."""
    if s not in v.again:
        choose = d.recompute == "auto" and d.check_memory
        v.again[s] = m.NewBoolVar(f"again[{s}]") if choose else int(d.recompute == "all")
    return v.again[s]


def add_loads(m: Any, d: CpData, v: CpVars) -> None:
    """Stage time on its unit: compute (its forward once more when it recomputes) plus
    communication in and out (twice in training; none on a ``comm_free`` unit) plus the runtime's work on a non-empty stage
    (``fixed_q``: ``use[s, t]`` holds only for one). The bottleneck is at least the slowest block
    and the mean stage, each block on its fastest unit, plus that work."""
    n, k, S = len(d.static_bytes), 2 if d.problem.training else 1, d.num_stages
    comm_max = max((_max_comm_q(d, s) for s in range(S - 1)), default=0)
    again_max = max((sum(fq) for fq in d.fwd_q), default=0) if d.recompute != "none" else 0
    horizon = max(sum(tq) for tq in d.time_q) + again_max + 2 * k * comm_max + d.fixed_q + sum(x[2] for x in d.direct_q)
    twice = d.recompute == "all"  # every stage runs its forward again
    cheapest = [min(tq[b] + (fq[b] if twice else 0) for tq, fq in zip(d.time_q, d.fwd_q, strict=True))
                for b in range(n)]  # each block on its fastest unit
    floor = max(max(cheapest, default=0), -(-sum(cheapest) // S)) + d.fixed_q  # the slowest block; the mean stage
    v.bottleneck = m.NewIntVar(min(floor, horizon), horizon, "bottleneck")
    for s in range(S):
        v.load[s] = m.NewIntVar(0, horizon, f"load[{s}]")
        comm = (v.comm_q[s - 1] if s > 0 else 0) + (v.comm_q[s] if s < S - 1 else 0)
        factor = k
        if d.grad_producers is not None:  # values forward once, their (smaller) gradients back once
            comm = comm + (v.grad_q[s - 1] if s > 0 else 0) + (v.grad_q[s] if s < S - 1 else 0)
            factor = 1
        again = _recomputes(m, d, v, s)
        for t in d.allowed[s]:
            work = sum(d.time_q[t][b] * v.x[b, s] for b in range(n))
            paid = 0 if d.problem.devices[d.unit_devices[t][0]].comm_free else factor * comm + v.direct_q.get(s, 0)
            m.Add(v.load[s] >= work + paid + d.fixed_q).OnlyEnforceIf(v.use[s, t])
            if isinstance(again, int) and not again:
                continue
            redo = sum(d.fwd_q[t][b] * v.x[b, s] for b in range(n))
            lits = [v.use[s, t]] + ([] if isinstance(again, int) else [again])
            m.Add(v.load[s] >= work + redo + paid + d.fixed_q).OnlyEnforceIf(lits)
        m.Add(v.bottleneck >= v.load[s])


def add_memory(m: Any, d: CpData, v: CpVars) -> None:
    """Stage memory fits its device: state + (activations + inputs) × in-flight + outputs, or
    when it recomputes, state + inputs × in-flight + activations + outputs (inputs and outputs
    only with :attr:`~fxsplit.ir.Problem.transfer_memory`)."""
    if not d.check_memory:
        return
    n, S = len(d.static_bytes), d.num_stages
    if len(d.flights) > 1:
        for q in d.flights:
            v.pipe[q] = m.NewBoolVar(f"pipe[{q}]")
        m.AddExactlyOne(v.pipe.values())
        for s in range(S):
            m.Add(v.nonempty[s] == sum(v.pipe[q] for q in d.flights if q > s))
    for s in range(S):
        in_b = v.out_bytes[s - 1] if s > 0 else 0
        out_b = v.out_bytes[s] if s < S - 1 else 0
        for q, flight in d.flights.items():
            if q and q <= s:
                continue
            f, again = flight[s], _recomputes(m, d, v, s)
            static = sum(d.static_bytes[b] * v.x[b, s] for b in range(n))
            act = sum(d.act_bytes[b] * v.x[b, s] for b in range(n))
            transfers = d.problem.transfer_memory
            keep = Problem.stage_memory_bytes(static, act, in_b, out_b, f, False, transfers=transfers)
            saved = Problem.stage_memory_bytes(static, act, in_b, out_b, f, True, transfers=transfers)
            for t in d.allowed[s]:
                cap = d.problem.devices[d.unit_devices[t][0]].memory_bytes
                lits = [v.use[s, t]] + ([v.pipe[q]] if q in v.pipe else [])
                if isinstance(again, int):
                    m.Add((saved if again else keep) <= cap).OnlyEnforceIf(lits)
                else:
                    m.Add(keep <= cap).OnlyEnforceIf([*lits, again.Not()])
                    m.Add(saved <= cap).OnlyEnforceIf([*lits, again])


def add_objective(m: Any, d: CpData, v: CpVars) -> None:
    """Bottleneck, or the fill-drain makespan ``Σ load + (m - 1) · bottleneck``."""
    if d.problem.objective == "bottleneck":
        m.Minimize(v.bottleneck)
    else:
        m.Minimize(sum(v.load.values()) + (d.problem.microbatches - 1) * v.bottleneck)


def add_hint(m: Any, d: CpData, v: CpVars, plan: Plan) -> None:
    """Start from ``plan`` (its stage of each block and unit of each stage)."""
    stage_of = plan.stage_of_block()
    for (b, s), var in v.pre.items():
        m.AddHint(var, int(stage_of.get(b, d.num_stages) <= s))
    unit_of_device = {dev: t for t, devs in enumerate(d.unit_devices) for dev in devs}
    for (s, t), var in v.use.items():
        m.AddHint(var, int(s < plan.num_stages and unit_of_device.get(plan.stages[s].device, -1) == t))
    for q, var in v.pipe.items():
        m.AddHint(var, int(q == plan.num_stages))
    for s, var in v.again.items():
        if not isinstance(var, int):
            m.AddHint(var, int(s < plan.num_stages and plan.stages[s].recompute))


def build_model(cp_model: Any, d: CpData, hint: Plan | None) -> tuple[Any, CpVars]:
    """The full model and its variables; ``hint`` seeds the search when given."""
    m, v = cp_model.CpModel(), CpVars()
    add_assignment(m, d, v)
    add_precedence(m, d, v)
    add_units(m, d, v)
    add_boundaries(m, d, v)
    if d.direct_q:
        add_direct(m, d, v)
    add_loads(m, d, v)
    add_memory(m, d, v)
    add_objective(m, d, v)
    if hint is not None and math.isfinite(hint.objective_s):
        add_hint(m, d, v, hint)
        free_comm = all(lat == 0 and per_byte == 0 for lat, per_byte in d.comm_q) and not d.direct_q
        if d.problem.objective == "bottleneck" and free_comm and not hint.validate(d.problem):
            # loads are block times rounded down, so a valid hint's bottleneck bounds the optimum's
            m.Add(v.bottleneck <= math.ceil(hint.bottleneck_s / d.quantum_s))
    return m, v
