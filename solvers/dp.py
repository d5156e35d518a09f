"""``dp``: the exact dynamic program over downsets and devices (torch-free).

Bottleneck. With ``f[slot][I]`` the least bottleneck of a pipeline covering the downset ``I`` whose
stages used the devices summarised by ``slot`` (see :mod:`fxsplit.solvers.layout`)::

    f[0][∅] = 0,   f[dst][I] = min over moves (src -> dst), J ⊊ I of max(f[src][J], cost(J, I))

and the optimum is ``min over end slots of f[slot][V]``; ``cost`` is the stage time on the
move's device with communication, ``+inf`` when its memory does not fit (memory prunes states).
Ties are broken by a second pass minimising the sum of stage times under the optimal bottleneck.
Time ``O(P · M)`` for ``P ≤ D²/2`` downset pairs and ``M`` moves (fixed order: ``k`` devices;
free order: ``Π(n_t + 1) · T`` for ``T`` device classes of ``n_t`` devices); memory ``O(S · D)``.

Makespan ``Σ_s t_s + (m - 1) · max_s t_s`` is not a min-max, so it is solved exactly by a
branch and bound over the bottleneck ``τ``: ``S(τ)`` = least sum of stage times with every stage
``≤ τ`` (the same DP with ``+``); the plans with bottleneck in ``(a, b]`` cost at least
``S(b) + (m - 1) · a``, and intervals whose bound reaches the best makespan found are dropped
(:func:`_makespan`). It stops with status ``feasible`` and a proven bound after ``max_rounds``
DP runs, and when its time limit passes once a plan is found (the sweep's unexplored intervals,
and stage counts not laid out yet, keep their lower bounds); before any plan a time-out raises
:class:`~fxsplit.solvers.dpcore.DPTimeoutError`.

1F1B memory depends on the number of stages ``p`` (stage ``s`` holds ``min(m, p - s)``
micro-batches); when memory can bind, the layout has one chain of slots per ``p``, or, when
devices are interchangeable given their counts per class, places the stages from the pipeline's
end over the reversed graph, where that count is ``min(m, d + 1)`` for the ``d``-th stage from the
end whatever ``p`` is (:mod:`fxsplit.solvers.layout`): ``k`` moves instead of ``k(k+1)/2``.

References:
    Tarnawski et al., "Efficient Algorithms for Device Placement of DNN Graph Operators",
    NeurIPS 2020, §4; Narayanan et al., "PipeDream", SOSP 2019, §3.1 (its optimizer is this DP on
    chains).
"""

from __future__ import annotations

import functools
import heapq
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from fxsplit.errors import ConfigError, InfeasibleError, InternalError
from fxsplit.ir.downsets import DEFAULT_MAX_DOWNSETS, members
from fxsplit.ir.plan import OPTIMAL_GAP, Plan, evaluate, trivial_lower_bound
from fxsplit.ir.problem import Problem
from fxsplit.solvers.cancel import Cancel
from fxsplit.solvers.diagnose import (
    infeasible_error,
    require_one_stage_per_device,
    stage_count_error,
)
from fxsplit.solvers.dpcore import DPCancelledError, DPResult, DPTimeoutError, run_dp
from fxsplit.solvers.layout import Layout, build_layout, can_start_from_end, stage_counts
from fxsplit.solvers.reduce import solve_reduced
from fxsplit.solvers.relax import memory_bound_error
from fxsplit.solvers.tables import DownsetTables, build_tables, chain_masks, is_chain_order

__all__ = ["DP_STATES", "DPStates", "one_stage_optimum", "solve_dp"]

DPStates = Literal["downsets", "chain"]
DP_STATES: tuple[DPStates, ...] = ("downsets", "chain")
"""What the DP's states are: every downset (exact), or the prefixes of the block order."""

logger = logging.getLogger(__name__)


def _memory_can_bind(problem: Problem, tb: DownsetTables) -> bool:
    """False when even the whole graph on one stage with the most micro-batches in flight fits."""
    flight = problem.in_flight(0, problem.num_devices)
    cut = float(tb.cut_bytes.max())
    worst = problem.stage_memory_bytes(tb.static_bytes[tb.full], tb.act_bytes[tb.full], cut, cut, flight, False,
                                       transfers=problem.transfer_memory)
    return bool(worst >= min(d.memory_bytes for d in problem.devices) + 1)


def _layout(problem: Problem, tb: DownsetTables, counts: list[int] | None = None) -> Layout:
    """The DP state space; one chain of slots per stage count when 1F1B in-flight counts matter
    (only the stage counts ``counts`` when given)."""
    bind = _memory_can_bind(problem, tb)
    per_p = bind and problem.in_flight_depends_on_stage_count
    return build_layout(problem, len(problem.graph), bind, per_p, counts=counts)


def _chained_counts(problem: Problem, tb: DownsetTables) -> list[int]:
    """The stage counts the layout lays out as separate chains of slots (per-``p`` chains of
    fixed or free order); ``[]`` when it has one set of slots for all."""
    bind = _memory_can_bind(problem, tb)
    per_p = bind and problem.in_flight_depends_on_stage_count
    if not per_p or can_start_from_end(problem, per_p):
        return []
    return [p for p in stage_counts(problem, min(problem.num_devices, len(problem.graph)), per_p) if p is not None]


def _fastest_work_s(problem: Problem, tb: DownsetTables, lay: Layout | None = None) -> float:
    """The graph's work on the fastest device, seconds, plus the runtime's work per micro-batch
    (:meth:`~fxsplit.ir.Problem.stage_overhead_s`) of the fewest stages a plan over ``lay`` has
    (one without ``lay``): a lower bound on any plan's sum of stage times (every stage is
    non-empty and pays that work; stages only add communication and recomputation to their
    compute)."""
    fewest = min((lay.stages[t] for t in lay.terminal), default=1) if lay is not None else 1
    return float(tb.work_s[tb.full]) / max(d.speed for d in problem.devices) + fewest * problem.stage_overhead_s()


def _count_lower_bound(problem: Problem, tb: DownsetTables, p: int) -> float:
    """A lower bound on the objective of any plan with exactly ``p`` stages, seconds: the
    graph's work spread perfectly over the ``p`` fastest devices the order allows (fixed: the
    first ``p``; free: the ``p`` fastest), and for the makespan one micro-batch through all of it
    on the fastest of them plus ``m - 1`` of that bottleneck (stage times only add
    communication and recomputation to their work)."""
    speeds = [d.speed for d in problem.devices]
    usable = speeds[:p] if problem.device_order == "fixed" else sorted(speeds, reverse=True)[:p]
    work = float(tb.work_s[tb.full])
    bottleneck = work / sum(usable)
    if problem.objective == "bottleneck":
        return bottleneck
    return work / max(usable) + (problem.microbatches - 1) * bottleneck


def _to_lists(res: DPResult, layout: Layout) -> tuple[list[list[int]], list[int]]:
    """Block lists and concrete device indices (free order: next unused device of the class)."""
    stages, devices = [], []
    used: dict[int, int] = {}
    for mask, unit in res.stages:
        stages.append(members(mask))
        devices.append(layout.units[unit][used.get(unit, 0)])
        used[unit] = used.get(unit, 0) + 1
    return stages, devices


def _infeasible(problem: Problem, tb: DownsetTables, comm: float, deadline: float | None,
                cancel: Cancel | None = None, excess: tuple[Layout, DPResult] | None = None) -> Exception:
    """The error for a problem the DP proved infeasible: the exact diagnosis (least overflow,
    memory and devices) when it finishes by ``deadline``, else the memory bound's numbers.
    ``excess``: the overflow DP's layout and result on ``problem``, when already run."""
    def run_excess(pb: Problem, until: float) -> DPResult:
        return run_dp(tb, _layout(pb, tb), comm_factor=comm, kind="excess",
                      deadline=until if deadline is None else min(until, deadline), cancel=cancel)

    lay = _layout(problem, tb) if excess is None else excess[0]
    try:
        res = run_dp(tb, lay, comm_factor=comm, kind="excess", deadline=deadline, cancel=cancel) \
            if excess is None else excess[1]
    except DPTimeoutError:
        err = memory_bound_error(problem)
        return err if err is not None else InfeasibleError(
            f"the dp proved that no split of graph {problem.graph.name!r} ({len(problem.graph)} "
            f"blocks) over {problem.num_devices} devices fits in memory; its diagnosis ran out of "
            "time (raise time_limit_s for the least memory and devices that fit)")
    if not res.stages:
        return stage_count_error(problem)
    stages, devices = _to_lists(res, lay)
    return infeasible_error(problem, stages, devices, res.value, run_excess)


def _memory_relaxation(problem: Problem) -> Problem | None:
    """``problem`` for memory alone: every device as large as the largest, of one speed, over one
    link. A stage count no split of which fits here fits nowhere in ``problem`` (a stage's memory
    does not depend on speed or links, and with ``recompute="auto"`` a larger device recomputes
    only where a smaller one would too). Its layout starts from the pipeline's end (1F1B: one set
    of slots for every stage count, :mod:`fxsplit.solvers.layout`); ``None`` where it would not."""
    cap = max(d.memory_bytes for d in problem.devices)
    relaxed = problem.with_(devices=tuple(d.with_(speed=1.0, memory_bytes=cap) for d in problem.devices), links=())
    return relaxed if can_start_from_end(relaxed) else None


def _fitting_counts(problem: Problem, tb: DownsetTables, counts: list[int], comm: float,
                    deadline: float | None, cancel: Cancel | None) -> tuple[list[int], Callable[[], Exception]]:
    """The stage counts among ``counts`` that may fit memory, by one overflow DP over
    :func:`_memory_relaxation` (``k`` moves where the per-count chains have ``k(k+1)/2``), and
    what builds the infeasibility error when none does (diagnosed on the relaxation where no
    count fits it and every device has the same memory, so its numbers are the problem's own; on
    ``problem`` otherwise)."""
    relaxed = _memory_relaxation(problem)
    if relaxed is None:
        return counts, lambda: _infeasible(problem, tb, comm, deadline, cancel)
    lay = _layout(relaxed, tb)
    res = run_dp(tb, lay, comm_factor=comm, kind="excess", deadline=deadline, cancel=cancel)
    fits = {lay.stages[slot] for slot, v in zip(lay.terminal, res.terminal_values, strict=True) if v <= 0}
    if not fits and len({d.memory_bytes for d in problem.devices}) == 1:
        return [], lambda: _infeasible(relaxed, tb, comm, deadline, cancel, excess=(lay, res))
    return [p for p in counts if p in fits], lambda: _infeasible(problem, tb, comm, deadline, cancel)


def _chain_bound(problem: Problem, tb: DownsetTables, lay: Layout, comm: float, deadline: float | None,
                 cancel: Cancel | None) -> float:
    """The best bottleneck over splits along the blocks' topological order (its ``n + 1``
    prefixes are downsets): a feasible plan's value, so an upper bound on the optimum that
    narrows the full DP's downset pairs (``run_dp(bound_s=...)``); ``inf`` when no such split
    fits or the graph is a chain already."""
    n = len(problem.graph)
    if tb.num <= 2 * (n + 1):
        return math.inf
    row = {mask: r for r, mask in enumerate(tb.masks)}
    rows = np.array(sorted(row[mask] for mask in chain_masks(n)), dtype=np.int64)
    return _bottleneck(problem, tb.restricted(rows), lay, comm, deadline, cancel).value


_SWEEP_RTOL = 1e-10
"""The makespan sweep takes a drop of ``S(τ)`` found within this relative width as found."""


class _Sweep:
    """Sum-of-stage-times DPs under a bottleneck cap, counted, with the best makespan seen."""

    def __init__(self, problem: Problem, tb: DownsetTables, lay: Layout, comm: float,
                 deadline: float | None, cancel: Cancel | None) -> None:
        self.problem, self.tb, self.lay, self.comm, self.deadline = problem, tb, lay, comm, deadline
        self.cancel = cancel
        self.runs = 0
        self.best: tuple[float, DPResult] | None = None

    def __call__(self, cap_s: float) -> DPResult:
        self.runs += 1
        res = run_dp(self.tb, self.lay, comm_factor=self.comm, combine="sum", cap_s=cap_s,
                     deadline=self.deadline, bound_s=2 * cap_s, cancel=self.cancel)
        if res.stages:
            obj = evaluate(self.problem, *_to_lists(res, self.lay)).makespan_s
            if self.best is None or obj < self.best[0]:
                self.best = (obj, res)
        return res


def _makespan(problem: Problem, tb: DownsetTables, lay: Layout, comm: float, tau0: float,
              deadline: float | None, max_rounds: int, cancel: Cancel | None,
              first: DPResult | None = None) -> tuple[DPResult, float, int]:
    """Exact makespan by branch and bound over the bottleneck ``τ``.

    ``S(τ)``, the least sum of stage times with every stage ``<= τ`` (the DP with ``+`` under a
    cap), is non-increasing, and the plan it returns costs at most ``S(τ) + (m - 1)·τ``. Every
    plan with bottleneck in ``(a, b]`` costs at least ``S(b) + (m - 1)·a``, so an interval whose
    bound reaches the best makespan found holds no better plan and is dropped; so is one where
    ``S(a) = S(b)`` (its plans are dominated by the plan at ``a``). Plans with bottleneck above
    ``τ_max = (best - L) / (m - 1)`` cannot win, ``L <= S(∞)`` the graph's work on the fastest
    device. The search starts from ``[τ_0, τ_max]``, ``τ_0`` the optimal bottleneck, and splits
    the interval of least bound at its middle (or at the next stage cost above ``a`` when ``S``
    is constant up to there), so drops of ``S`` too small to pay for a larger bottleneck are
    never located. An interval ends at the largest stage of the plan found under its upper cap
    (:attr:`DPResult.max_stage`: ``S`` is constant from there up to the cap), so a drop is
    located at a stage cost, not by halving to the tolerance; and at ``(best - S(b)) / (m - 1)``
    when that is lower (a plan of that bottleneck costs the best makespan or more). Returns the
    best result, a proven lower bound (the least bound of the intervals left, the optimum when
    none is) and the number of DP runs. ``first``: the optimal bottleneck's plan, returned without
    a run when it costs ``L + (m - 1)·τ_0``, the least any plan can (every plan's sum of stage
    times is the same where nothing but the split's work differs: no links to pay, every stage
    paying the runtime's work).
    """
    m1 = problem.microbatches - 1
    if m1 == 0:
        smin = run_dp(tb, lay, comm_factor=comm, combine="sum", deadline=deadline, cancel=cancel)
        return smin, smin.value, 1
    floor = _fastest_work_s(problem, tb, lay)
    if first is not None and first.stages:  # the bottleneck's plan meets the bound floor + (m - 1)·τ_0: optimal
        obj = evaluate(problem, *_to_lists(first, lay)).makespan_s
        if obj <= (floor + m1 * tau0) * (1 + _SWEEP_RTOL):
            return first, obj, 0
    sweep = _Sweep(problem, tb, lay, comm, deadline, cancel)
    least = floor + m1 * tau0  # no plan costs less: a proven bound whenever the sweep stops early
    try:
        low = sweep(tau0)
    except DPCancelledError:
        raise
    except DPTimeoutError:
        if first is None or not first.stages:
            raise
        return first, least, sweep.runs  # the optimal bottleneck's plan, with the bound every plan meets
    if sweep.best is None:
        raise InternalError("dp makespan sweep found no plan under the optimal bottleneck")
    tau_max = (sweep.best[0] - floor) / m1
    if tau_max <= tau0 * (1 + _SWEEP_RTOL):
        return sweep.best[1], sweep.best[0], sweep.runs
    try:
        high = sweep(tau_max)
    except DPCancelledError:
        raise
    except DPTimeoutError:
        return sweep.best[1], least, sweep.runs
    # (bound, tie, a, b, S(a)'s result, S(b)): the plans with bottleneck in (a, b]; b is the
    # largest stage of the plan found under the cap (S is constant from it up to the cap, and a
    # plan with a bottleneck in between is dominated by that plan)
    heap = [(high.value + m1 * tau0, 0, tau0, min(tau_max, high.max_stage), low, high.value)]
    while heap:
        bound, _, a, b, res_a, s_b = heap[0]
        if bound >= sweep.best[0] * (1 - _SWEEP_RTOL) or res_a.value <= s_b or res_a.next_break >= b \
                or b - a <= _SWEEP_RTOL * b:
            heapq.heappop(heap)  # no better plan inside, or S constant up to b (evaluated already)
            continue
        if sweep.runs >= max_rounds:
            break
        popped = heapq.heappop(heap)
        clip = (sweep.best[0] - s_b) / m1  # a larger bottleneck costs the best makespan or more
        try:
            if clip < b:  # S(clip) >= S(b): cost the interval's new end before splitting it
                if clip > a:
                    res_clip = sweep(clip)
                    heapq.heappush(heap, (res_clip.value + m1 * a, sweep.runs, a, min(clip, res_clip.max_stage),
                                          res_a, res_clip.value))
                continue
            mid = max((a + b) / 2, res_a.next_break)  # S stays S(a) up to a's next stage cost
            res_mid = sweep(mid)
        except DPCancelledError:
            raise
        except DPTimeoutError:  # out of time: the interval stays unexplored, its bound stands
            heapq.heappush(heap, popped)
            break
        heapq.heappush(heap, (s_b + m1 * mid, sweep.runs, mid, b, res_mid, s_b))
        if mid > res_a.next_break:  # else every plan in (a, mid) is dominated by a's
            heapq.heappush(heap, (res_mid.value + m1 * a, -sweep.runs, a, min(mid, res_mid.max_stage), res_a,
                                  res_mid.value))
    best_obj, best_res = sweep.best
    bound = min([best_obj] + [h[0] for h in heap])
    return best_res, bound, sweep.runs


def _may_win(problem: Problem, tb: DownsetTables, counts: list[int], comm: float, best_s: float,
             deadline: float | None, cancel: Cancel | None) -> tuple[list[int], float]:
    """The stage counts among ``counts`` whose plans may beat a makespan of ``best_s``, and the
    least optimal bottleneck among them: a ``p``-stage plan costs at least
    ``L + (m - 1) · τ_p``, ``τ_p`` its optimal bottleneck and ``L`` the graph's work on the
    fastest device. One bottleneck run over the chains of ``counts``, narrowed to stages that
    could still win (``τ_p`` is exact below the cut)."""
    m1 = problem.microbatches - 1
    lay = _layout(problem, tb, counts)
    floor = _fastest_work_s(problem, tb, lay)
    cut = (best_s - floor) / m1
    res = run_dp(tb, lay, comm_factor=comm, deadline=deadline, cancel=cancel, bound_s=cut)
    tau: dict[int, float] = {}  # free order: one terminal slot per mix of device classes
    for slot, v in zip(lay.terminal, res.terminal_values, strict=True):
        tau[lay.stages[slot]] = min(v, tau.get(lay.stages[slot], math.inf))
    left = [p for p in counts if floor + m1 * tau.get(p, math.inf) < best_s * (1 - 1e-9)]
    return left, min((tau[p] for p in left), default=math.inf)


def _bottleneck(problem: Problem, tb: DownsetTables, lay: Layout, comm: float, deadline: float | None,
                cancel: Cancel | None, upper_s: float = math.inf) -> DPResult:
    """The optimal bottleneck over ``lay``, by runs narrowed to stages of bounded work
    (``run_dp(bound_s=...)``, exact once its plan stays within the bound): from ``upper_s`` or
    the best split along the block order (:func:`_chain_bound`), else from twice the work's
    perfect spread over the devices, four times wider after each miss, whole at last (a chain of
    2,000 blocks on 64 devices: 1/30 of the pairs for the first try)."""
    guess = upper_s if math.isfinite(upper_s) else _chain_bound(problem, tb, lay, comm, deadline, cancel)
    exact = math.isfinite(guess)
    if not exact:
        guess = 2 * float(tb.work_s[tb.full]) / sum(d.speed for d in problem.devices)
    whole = float(tb.work_s[tb.full]) / min(d.speed for d in problem.devices)
    while guess < whole:
        res = run_dp(tb, lay, comm_factor=comm, deadline=deadline, cancel=cancel, bound_s=guess)
        if exact or res.value <= guess:
            return res
        guess, exact = (res.value, True) if math.isfinite(res.value) else (4 * guess, False)
    return run_dp(tb, lay, comm_factor=comm, deadline=deadline, cancel=cancel)


def _optimize(problem: Problem, tb: DownsetTables, lay: Layout, comm: float, deadline: float | None,
              max_rounds: int, cancel: Cancel | None, tie_break: bool,
              upper_s: float = math.inf) -> tuple[DPResult, float, int] | None:
    """The best plan over ``lay``: ``(result, proven lower bound, DP runs)``, None when none fits.
    ``upper_s``: a bottleneck some plan over ``lay`` reaches (narrows the first run)."""
    res = _bottleneck(problem, tb, lay, comm, deadline, cancel, upper_s)
    if not res.stages:
        return None
    if problem.objective == "makespan":
        return _makespan(problem, tb, lay, comm, res.value, deadline, max_rounds, cancel, first=res)
    bottleneck = res.value
    if tie_break:
        try:
            res = run_dp(tb, lay, comm_factor=comm, combine="sum", cap_s=res.value, deadline=deadline,
                         want_break=False, bound_s=res.value, cancel=cancel)
        except DPCancelledError:
            raise
        except DPTimeoutError:  # out of time: the optimal bottleneck's plan without the tie-break
            pass
    return res, bottleneck, 0


def one_stage_optimum(problem: Problem) -> Plan | None:
    """The whole graph as one stage on a fastest device, when that is proven optimal without a
    search: the makespan of one micro-batch is the sum of the stage times, at least the graph's
    work on the fastest device (:func:`~fxsplit.ir.plan.trivial_lower_bound`), which one stage
    meets (no communication). ``None`` when the objective or ``microbatches`` differ, the device
    order fixes stage 0 on a slower device, or the stage does not fit that device's memory."""
    if problem.objective != "makespan" or problem.microbatches != 1 or not problem.graph.blocks:
        return None
    if problem.stages_per_device > 1 or (not problem.allow_idle_devices and problem.num_devices > 1):
        return None
    fastest = max(d.speed for d in problem.devices)
    candidates = [0] if problem.device_order == "fixed" else range(problem.num_devices)
    bound = trivial_lower_bound(problem)
    for d in candidates:
        if problem.devices[d].speed != fastest:
            continue
        plan = evaluate(problem, [list(range(len(problem.graph)))], [d], solver="dp", lower_bound_s=bound,
                        stats={"one_stage": True})
        if plan.stages[0].memory_bytes <= problem.devices[d].memory_bytes and plan.gap <= 1e-12:
            return plan.with_(status="optimal", lower_bound_s=plan.objective_s)
    return None


def solve_dp(
    problem: Problem,
    *,
    time_limit_s: float | None = None,
    max_downsets: int | None = DEFAULT_MAX_DOWNSETS,
    tie_break: bool = True,
    max_rounds: int = 200,
    cancel: Cancel | None = None,
    states: DPStates = "downsets",
) -> Plan:
    """Optimal contiguous split by dynamic programming over the downsets of the graph.

    Args:
        problem: The problem; devices in pipeline order (``"fixed"``) or chosen (``"free"``).
        time_limit_s: Give up after this many seconds (``None``: no limit); once a plan is
            found (the optimal bottleneck's, for the makespan) the best so far comes back
            ``feasible`` with its proven bound instead.
        max_downsets: Downset budget; above it the DP refuses (use ``cpsat``).
        tie_break: Among bottleneck-optimal splits return one with the least sum of stage times.
        max_rounds: Makespan only: most rounds of the bottleneck sweep before returning the best
            plan found with status ``feasible`` and a proven lower bound.
        cancel: Stop with :class:`~fxsplit.solvers.dpcore.DPCancelledError` when this flag is set
            (``auto``'s race).
        states: ``"downsets"`` (all of them: exact) or ``"chain"``: only the ``n + 1`` prefixes
            of the blocks' topological order (PipeDream's DP on a chain, Narayanan et al. SOSP
            2019 §3.1), in ``O(n² · M)``, no enumeration. A state reduction, so a heuristic: on a
            graph that is not a chain its plan is ``feasible`` with the trivial lower bound
            (``optimal`` only where it meets that bound); on a chain it is the exact DP.

    Free boundary blocks (no compute: PipeDream's ``Input`` sources, unused outputs) are placed
    before the search where their placement provably cannot matter (free device order, or
    identical devices on one link)
    (:func:`fxsplit.solvers.reduce.fold_free_blocks`; GNMT's 7,874 downsets become 48), and the
    plan is re-costed on ``problem``; ``stats["folded_blocks"]`` counts them.

    Returns:
        The plan, built by :func:`evaluate`, status ``optimal`` (or ``feasible`` when the makespan
        sweep was cut short by ``max_rounds`` or the time limit, or the states were reduced),
        ``lower_bound_s`` = the proven optimum or bound.

    Raises:
        InfeasibleError: when no split fits in memory (stage, device, overflow, least memory and
            least number of devices), or too few blocks for ``allow_idle_devices=False``.
        ConfigError: for a bad ``states``, or ``stages_per_device > 1`` (use
            :func:`fxsplit.solvers.solve`).
        DownsetBudgetError: when the graph has more than ``max_downsets`` downsets.
        DPTimeoutError: (a :class:`SolverError`) when ``time_limit_s`` passes before the DP
            has a plan.
        SolverError: for free device order with per-pair links.

    Example:
        >>> from fxsplit.ir import CondensedGraph, DeviceSpec, Problem
        >>> devices = tuple(DeviceSpec(f"d{i}") for i in range(3))
        >>> solve_dp(Problem(CondensedGraph.chain([5, 1, 1, 1, 1, 1, 1, 1, 1]), devices)).bottleneck_s
        5.0
    """
    start = time.perf_counter()
    deadline = None if time_limit_s is None else start + time_limit_s
    problem.check()
    if not problem.allow_idle_devices and len(problem.graph) < problem.num_devices:
        raise stage_count_error(problem)
    require_one_stage_per_device(problem, "solve_dp")
    if states not in DP_STATES:
        raise ConfigError(f"solve_dp(states={states!r}): use one of {', '.join(DP_STATES)}")
    if (one := one_stage_optimum(problem)) is not None:
        return one.with_(stats={**one.stats, "states": states}, solve_time_s=time.perf_counter() - start)
    lifted = solve_reduced(problem, lambda pb: solve_dp(
        pb, time_limit_s=None if deadline is None else max(0.0, deadline - time.perf_counter()),
        max_downsets=max_downsets, tie_break=tie_break, max_rounds=max_rounds, cancel=cancel, states=states))
    if lifted is not None:
        return lifted.with_(solve_time_s=time.perf_counter() - start)
    reduced = states == "chain" and not is_chain_order(problem)
    tb = build_tables(problem, max_downsets, masks=chain_masks(len(problem.graph)) if states == "chain" else None)
    comm = 2.0 if problem.training else 1.0
    counts = _chained_counts(problem, tb)
    found: list[tuple[Plan, float, int]] = []  # (plan, proven bound over its layout, DP runs)
    slots = moves = 0

    def optimize(only: list[int] | None, upper_s: float = math.inf) -> None:
        nonlocal slots, moves
        lay = _layout(problem, tb, only)
        slots, moves = slots + lay.num_slots, moves + len(lay.moves)
        out = _optimize(problem, tb, lay, comm, deadline, max_rounds, cancel, tie_break, upper_s)
        if out is not None:
            found.append((evaluate(problem, *_to_lists(out[0], lay)), out[1], out[2]))

    # One chain of slots per stage count p (1F1B memory): the counts that may fit memory (one
    # overflow DP on a relaxation), the most stages first; then a p is laid out only where a bound
    # leaves it room to win (_count_lower_bound, then its optimal bottleneck from one run over
    # the remaining chains).
    chained = len(counts) > 1
    diagnose: Callable[[], Exception] = functools.partial(_infeasible, problem, tb, comm, deadline, cancel)
    fitting = counts
    if chained:
        fitting, diagnose = _fitting_counts(problem, tb, counts, comm, deadline, cancel)
    if fitting or not chained:
        optimize(fitting[-1:] if chained else None)
    solved = min(1, len(fitting)) if chained else 1
    unexplored = math.inf  # a bound on the stage counts left unsolved when time ran out
    if len(fitting) > 1:
        best = min((f[0].objective_s for f in found), default=math.inf)
        rest = [p for p in fitting[:-1] if _count_lower_bound(problem, tb, p) < best * (1 - 1e-9)]
        upper = math.inf
        try:
            if rest and math.isfinite(best) and problem.objective == "makespan" and problem.microbatches > 1:
                rest, upper = _may_win(problem, tb, rest, comm, best, deadline, cancel)
            if rest:
                optimize(rest, upper)
                solved += len(rest)
        except DPCancelledError:
            raise
        except DPTimeoutError:
            if not found:
                raise
            # out of time with a plan: the counts not solved keep their lower bound (the plan is feasible)
            unexplored = min(_count_lower_bound(problem, tb, p) for p in rest)
    if not found:
        if reduced:
            raise InfeasibleError(
                f"no split of graph {problem.graph.name!r} along its block order fits in memory "
                f"(solve_dp(states='chain') is a heuristic; use states='downsets' or solver='auto' "
                "for the exact answer and its diagnosis)")
        raise diagnose()
    best_plan = min(found, key=lambda f: (f[0].objective_s, sum(st.time_s for st in f[0].stages)))[0]
    bound = min(min(f[1] for f in found), unexplored)  # pruned stage counts are bounded by the best plan
    stats: dict[str, Any] = {"downsets": tb.num, "slots": slots, "moves": moves,
                             "rounds": sum(f[2] for f in found), "states": states}
    if chained:
        stats["stage_counts"] = f"{solved} of {len(counts)} laid out"
    plan = evaluate(problem, [list(st.blocks) for st in best_plan.stages], [st.device for st in best_plan.stages],
                    solver="dp", lower_bound_s=None if reduced else bound, stats=stats)
    status = "optimal" if plan.gap <= OPTIMAL_GAP else "feasible"
    if status == "optimal":  # the DP's value and evaluate() differ only by summation order
        plan = plan.with_(lower_bound_s=plan.objective_s)
    elif not reduced and (math.isfinite(unexplored) or all(f[2] < max_rounds for f in found)):
        # a gap left neither by max_rounds nor by reduced states: the time limit cut the search short
        plan = plan.with_(stats={**plan.stats, "timed_out": True})
    plan = plan.with_(status=status, solve_time_s=time.perf_counter() - start)
    logger.debug("dp: %s %.6g s (bound %.6g, %s) in %.3f s", problem.objective, plan.objective_s,
                 bound, status, plan.solve_time_s)
    return plan
