"""The inner loop of the exact DP over downsets × slots, vectorised over all the downsets of one
size at a time (they never depend on each other: ``J ⊊ I`` is smaller) and every signature.

Recurrence (``⊕`` is ``max`` for the bottleneck, ``+`` for a sum of stage costs)::

    f[slot 0][∅] = 0
    f[dst][I] = min over moves (src -> dst) and downsets J ⊊ I of  f[src][J] ⊕ cost(move, J, I)

where ``cost`` is the stage ``I \\ J``'s time on the move's device (compute / speed +
communication of ``cut(J)`` in and ``cut(I)`` out, paid twice in training and not at all on a
``comm_free`` device, + the runtime's
work per micro-batch, ``Problem.stage_overhead_s``), or ``+inf`` when the
stage's memory exceeds the device's. With ``cap_s`` (used for the makespan) stage costs above the
cap are forbidden too, and the smallest forbidden cost is reported as the next breakpoint. With
``kind="excess"`` the cost is the stage's memory minus the device's (infeasibility diagnosis).

Complexity: ``O(P · (W + M))`` element operations in ``O(n)`` vectorised passes (chunked to
:data:`_CHUNK_ELEMENTS`), ``P = Σ_I |{J ⊊ I}| ≤ D² / 2`` downset pairs (fewer under ``bound_s``),
``W`` 64-bit words per downset and ``M`` the number of moves (fixed order: ``k``; free order:
slots × device classes); memory ``O(S · D)`` for ``S`` slots.

References:
    Tarnawski et al., "Efficient Algorithms for Device Placement of DNN Graph Operators",
    NeurIPS 2020, §4; Narayanan et al., "PipeDream", SOSP 2019, §3.1 (the chain special case).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fxsplit.errors import SolverError
from fxsplit.ir.problem import Problem
from fxsplit.solvers.cancel import Cancel
from fxsplit.solvers.dpchain import is_nested, run_nested
from fxsplit.solvers.layout import Layout, Signature
from fxsplit.solvers.tables import DownsetTables

__all__ = ["Bands", "DPCancelledError", "DPResult", "DPTimeoutError", "check_stop", "run_dp"]

CostOf = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""``cost_of(i, js)``: ``[G, P]`` costs of the stages ``I \\ J`` for the pairs ``(i[p], js[p])``."""

_CHUNK_ELEMENTS = 1 << 21
"""Pairs x words (or x moves) per vectorised chunk of one size's downsets."""


class DPTimeoutError(SolverError):
    """The DP ran past its deadline (``auto`` falls back to ``cpsat`` on this one)."""


class DPCancelledError(DPTimeoutError):
    """The DP was stopped by its :class:`~fxsplit.solvers.cancel.Cancel` (another solver won the race)."""


@dataclass(frozen=True)
class DPResult:
    """The best value over the layout's terminal slots and the plan reaching it.

    Attributes:
        value: Best ``f[terminal][V]`` (``inf`` when no plan is feasible).
        stages: ``[(block mask, unit)]`` per stage in pipeline order (empty when infeasible).
        next_break: Smallest stage cost above ``cap_s`` seen (``inf`` when none or no cap), at
            most ``bound_s`` when the run was narrowed by one (a breakpoint no later than the next).
        terminal_values: ``f[slot][V]`` of each of ``layout.terminal`` (the best value of plans
            ending there: one per stage count in a layout with a chain per count).
        max_stage: The largest stage cost of :attr:`stages` as the DP computed it (bitwise: the
            same arithmetic), ``-inf`` when there are none. With ``cap_s``, the sum is the same
            for every cap from it up to ``cap_s`` (the makespan search's breakpoints).
    """

    value: float
    stages: tuple[tuple[int, int], ...]
    next_break: float
    terminal_values: tuple[float, ...] = ()
    max_stage: float = -math.inf


@dataclass(frozen=True)
class _Sigs:
    """The layout's signatures as ``[G]`` arrays, to cost every signature at once."""

    speed: np.ndarray
    cap_bytes: np.ndarray
    flight: np.ndarray
    lat_in: np.ndarray
    bw_in: np.ndarray
    lat_out: np.ndarray
    bw_out: np.ndarray
    fixed: np.ndarray
    comm_scale: np.ndarray

    @classmethod
    def of(cls, layout: Layout) -> _Sigs:
        def col(get: Callable[[Signature], float]) -> np.ndarray:
            return np.array([get(sig) for sig in layout.sigs], dtype=float)[:, None]

        return cls(col(lambda g: g.speed), col(lambda g: g.cap_bytes), col(lambda g: g.flight),
                   col(lambda g: g.link_in.latency_s), col(lambda g: g.link_in.bytes_per_s),
                   col(lambda g: g.link_out.latency_s), col(lambda g: g.link_out.bytes_per_s),
                   col(lambda g: g.fixed_s), col(lambda g: g.comm_scale))


def check_stop(cancel: Cancel | None, deadline: float | None, done: int, num: int) -> None:
    """Raise :class:`DPCancelledError` when ``cancel`` is set, :class:`DPTimeoutError` past
    ``deadline``; ``done`` of ``num`` downsets are filled (for the message)."""
    if cancel is not None and cancel.is_set():
        raise DPCancelledError(f"dp stopped after {done}/{num} downsets: another solver finished first")
    if deadline is not None and time.perf_counter() > deadline:
        raise DPTimeoutError(f"dp timed out after {done}/{num} downsets; raise time_limit_s or use solver='cpsat'")


def _transfer(size: np.ndarray, lat: np.ndarray, bw: np.ndarray) -> np.ndarray:
    """``[G, n]`` seconds to send ``size`` bytes (``[n]`` or ``[1]``) over each signature's link."""
    return np.where(size > 0, lat + size / bw, 0.0)


def _stage_costs(tb: DownsetTables, i: np.ndarray, js: np.ndarray, sigs: _Sigs, comm_factor: float,
                 kind: str) -> np.ndarray:
    """``[G, P]`` cost of the stages ``I \\ J`` for the pairs ``(i[p], js[p])`` under every signature.

    With recomputation (``tb.recompute``, :meth:`fxsplit.ir.Problem.recomputes`) a stage costs
    its forward once more where it recomputes: always under ``"all"``; under ``"auto"`` where its
    kept activations overflow the device and recomputing saves memory."""
    cut_in, cut_out = tb.cut_bytes[js], tb.cut_bytes[i]
    if tb.is_flipped:  # the reversed graph's stage I \ J receives cut(I) and sends cut(J)
        cut_in, cut_out = cut_out, cut_in
    need = kind == "excess" or bool(np.isfinite(sigs.cap_bytes).any())
    mode = tb.recompute
    mem, again = None, np.zeros((1, len(js)), dtype=bool)
    if need or mode == "all":
        static, act = tb.static_bytes[i] - tb.static_bytes[js], tb.act_bytes[i] - tb.act_bytes[js]
        keep = Problem.stage_memory_bytes(static, act, cut_in, cut_out, sigs.flight, False, transfers=tb.transfer_memory)
        if mode == "none":
            mem = keep
        else:
            saved = Problem.stage_memory_bytes(static, act, cut_in, cut_out, sigs.flight, True,
                                               transfers=tb.transfer_memory)
            again = (np.ones(keep.shape, dtype=bool) if mode == "all"
                     else (keep > sigs.cap_bytes) & (saved < keep))
            mem = np.where(again, saved, keep)
        if kind == "excess":
            return mem - sigs.cap_bytes
    comm = _transfer(cut_in, sigs.lat_in, sigs.bw_in) + _transfer(cut_out, sigs.lat_out, sigs.bw_out)
    if tb.grad_cut_bytes is not None:  # gradients smaller than the values: forward once, then them
        grad_in, grad_out = tb.grad_cut_bytes[js], tb.grad_cut_bytes[i]
        if tb.is_flipped:
            grad_in, grad_out = grad_out, grad_in
        comm = comm + (comm_factor - 1.0) * (_transfer(grad_in, sigs.lat_in, sigs.bw_in)
                                             + _transfer(grad_out, sigs.lat_out, sigs.bw_out))
        comm_factor = 1.0
    work = tb.work_s[i] - tb.work_s[js] + np.where(again, tb.fwd_s[i] - tb.fwd_s[js], 0.0)
    if tb.direct is None:
        cost = work / sigs.speed + comm_factor * sigs.comm_scale * comm + sigs.fixed
    else:  # direct transfers list every message of a step: never doubled (one link, no latency)
        direct_s = tb.direct.bytes(i, js) / sigs.bw_in
        cost = work / sigs.speed + sigs.comm_scale * (comm_factor * comm + direct_s) + sigs.fixed
    if need and mem is not None:
        cost = np.where(mem < sigs.cap_bytes + 1.0, cost, np.inf)
    return cost


@dataclass(frozen=True)
class _Moves:
    """All moves sorted by the number of stages before them, as arrays."""

    move: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    sig: np.ndarray
    src_stage: np.ndarray

    @classmethod
    def of(cls, layout: Layout) -> _Moves:
        order = sorted(range(len(layout.moves)), key=lambda m: layout.stages[layout.moves[m].src])
        moves = [layout.moves[m] for m in order]
        return cls(
            move=np.array(order, dtype=np.int64),
            src=np.array([m.src for m in moves], dtype=np.int64),
            dst=np.array([m.dst for m in moves], dtype=np.int64),
            sig=np.array([m.sig for m in moves], dtype=np.int64),
            src_stage=np.array([layout.stages[m.src] for m in moves], dtype=np.int64),
        )


@dataclass(frozen=True)
class Bands:
    """The work ``W(I)`` a downset may hold in each slot of a plan whose every stage costs at
    most ``bound_s`` (the narrowed runs of :func:`run_dp`).

    A stage costs at least its work over its device's speed (communication, the runtime's work
    and recomputation only add), so the stages placed so far hold at most ``bound_s`` times the
    speed of the devices they use (``hi``), and the devices left can take at most ``bound_s``
    times theirs of the rest (``lo = W(all) - bound_s x speed left``). No such plan passes through
    a state outside its slot's band: a bound as in branch and bound, exact whenever the optimum's
    stages cost at most ``bound_s`` (the condition under which the narrowed run is exact anyway).

    Attributes:
        lo, hi: ``[num_slots]`` the band of each slot, rounding tolerance included, seconds.
        admissible: ``[num_downsets]`` the downsets some move may end in.
    """

    lo: np.ndarray
    hi: np.ndarray
    admissible: np.ndarray

    @classmethod
    def of(cls, tb: DownsetTables, layout: Layout, bound_s: float, tol: float) -> Bands:
        used = np.zeros(layout.num_slots)
        speed_of: dict[int, float] = {}
        for m in sorted(layout.moves, key=lambda mv: layout.stages[mv.src]):
            speed = layout.sigs[m.sig].speed
            used[m.dst] = used[m.src] + speed  # every path into a slot uses the same devices
            speed_of[m.unit] = speed
        total = sum(speed * len(layout.units[unit]) for unit, speed in speed_of.items())
        lo = float(tb.work_s[tb.full]) - bound_s * (total - used) - tol
        hi = bound_s * used + tol
        admissible = np.zeros(tb.num, dtype=bool)
        for dst in sorted({m.dst for m in layout.moves}):
            admissible |= (tb.work_s >= lo[dst]) & (tb.work_s <= hi[dst])
        return cls(lo, hi, admissible)

    def outside(self, dst: np.ndarray, work: np.ndarray) -> np.ndarray:
        """``[len(dst), len(work)]``: True where a downset of work ``work[p]`` lies outside the
        band of slot ``dst[m]``."""
        return (work[None, :] < self.lo[dst][:, None]) | (work[None, :] > self.hi[dst][:, None])


def _update(f: np.ndarray, par_move: np.ndarray, par_j: np.ndarray, targets: np.ndarray, moves: np.ndarray,
            dst: np.ndarray, vals: np.ndarray, js: np.ndarray) -> None:
    """Store the best candidate of each downset in ``targets`` (not set before) for each slot.

    ``vals`` and ``js`` are ``[len(moves), len(targets)]``: the best value and its ``J`` per
    move and downset; among moves into one slot the first smallest wins (``lexsort`` is stable)."""
    width = len(targets)
    key = (dst[:, None] * width + np.arange(width)[None, :]).ravel()
    flat = vals.ravel()
    order = np.lexsort((flat, key))
    ordered = key[order]
    first = order[np.r_[True, ordered[1:] != ordered[:-1]]]
    first = first[flat[first] < np.inf]
    m, t = np.divmod(first, width)
    f[dst[m], targets[t]] = flat[first]
    par_move[dst[m], targets[t]] = moves[m]
    par_j[dst[m], targets[t]] = js.ravel()[first]


def _pairs(tb: DownsetTables, cols: list[np.ndarray], rows: np.ndarray, hi: int,
           reach: float) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ``(I, J)``: ``I`` in ``rows`` (downsets of one size), ``J`` a proper subset among the
    first ``hi`` (smaller) downsets with ``W(I) - W(J) <= reach``; grouped by ``I``, ``J`` ascending.

    ``cols`` are the membership words by column (``tb.words[:, w]``). The subset test runs on the
    whole ``[rows, hi]`` block, or, when the work window keeps under a third of it, on the pairs in
    the window only."""
    if math.isfinite(reach):
        near = tb.work_s[None, :hi] >= tb.work_s[rows, None] - reach
        if 3 * int(np.count_nonzero(near)) < near.size:
            ii, jj = np.nonzero(near)
            ri = rows[ii]
            outside = cols[0][jj] & ~cols[0][ri]
            for col in cols[1:]:
                outside |= col[jj] & ~col[ri]
            inside = outside == 0
            return ri[inside], jj[inside]
    block = cols[0][None, :hi] & ~cols[0][rows, None]
    for col in cols[1:]:
        block |= col[None, :hi] & ~col[rows, None]
    inside = block == 0
    if math.isfinite(reach):
        inside &= near
    ii, jj = np.nonzero(inside)
    return rows[ii], jj


def _reconstruct(tb: DownsetTables, layout: Layout, par_move: np.ndarray, par_j: np.ndarray,
                 slot: int, cost_of: CostOf) -> tuple[tuple[tuple[int, int], ...], float]:
    """The stages ending in ``slot`` (from the last back) and their largest cost by ``cost_of``."""
    out: list[tuple[int, int]] = []
    i, worst = tb.full, -math.inf
    while i != 0:
        mv, j = int(par_move[slot, i]), int(par_j[slot, i])
        move = layout.moves[mv]
        out.append((tb.masks[i] & ~tb.masks[j], move.unit))
        worst = max(worst, float(cost_of(np.array([i]), np.array([j]))[move.sig, 0]))
        slot, i = move.src, j
    return tuple(reversed(out)), worst


def run_dp(
    tb: DownsetTables,
    layout: Layout,
    *,
    comm_factor: float,
    combine: str = "max",
    cap_s: float = math.inf,
    kind: str = "time",
    deadline: float | None = None,
    want_break: bool = True,
    bound_s: float = math.inf,
    cancel: Cancel | None = None,
) -> DPResult:
    """Run the DP and return the best plan over ``layout.terminal``.

    Args:
        tb: Downset tables of the problem (or of its reversed graph).
        layout: Slots and moves (see :mod:`solvers.layout`).
        comm_factor: 2 in training (activations forward, gradients backward), else 1.
        combine: ``"max"`` (bottleneck) or ``"sum"`` (sum of stage costs).
        cap_s: Forbid stage costs above this (``combine="sum"`` only), seconds.
        kind: ``"time"`` (stage seconds) or ``"excess"`` (stage memory minus device memory, bytes).
        deadline: ``time.perf_counter()`` value after which to give up.
        want_break: Track :attr:`DPResult.next_break` (costs a little).
        bound_s: Consider only stages whose work alone takes at most this on the fastest device,
            seconds (stage costs only add communication and recomputation to it). The result is
            exact whenever every stage of an optimal plan costs at most ``bound_s`` (for the
            bottleneck: a feasible plan's bottleneck; with ``cap_s``: at least ``cap_s``); it
            prunes the downset pairs to a window. The stages left out cost more
            than ``bound_s``, so :attr:`DPResult.next_break` is then at most ``bound_s`` (a
            breakpoint at or below the true one; the makespan sweep passes ``2 × cap_s``).
        cancel: Stop (:class:`DPCancelledError`) when this flag is set, checked between blocks.

    With a layout built from the pipeline's end (:attr:`Layout.from_end`) the DP runs over the
    reversed graph's tables (:meth:`DownsetTables.flipped`); the stages it returns are in
    pipeline order either way.

    Raises:
        DPTimeoutError: when ``deadline`` passes; the message says how far it got.
        DPCancelledError: when ``cancel`` is set.
    """
    if layout.from_end != tb.is_flipped:
        tb = tb.flipped()
    num = tb.num
    f = np.full((layout.num_slots, num), np.inf)
    f[0, 0] = -np.inf if kind == "excess" else 0.0
    par_move = np.full((layout.num_slots, num), -1, dtype=np.int32)
    par_j = np.zeros((layout.num_slots, num), dtype=np.int32)
    mv, sigs = _Moves.of(layout), _Sigs.of(layout)
    next_break = math.inf
    reach, tol = math.inf, 0.0
    if math.isfinite(bound_s) and kind == "time":
        tol = 1e-9 * max(1.0, float(np.abs(tb.work_s).max()))  # the sums' rounding
        reach = bound_s * float(sigs.speed.max()) + tol

    def cost_of(i: np.ndarray, js: np.ndarray) -> np.ndarray:
        return _stage_costs(tb, i, js, sigs, comm_factor, kind)

    bands = Bands.of(tb, layout, bound_s, tol) if math.isfinite(reach) else None  # states outside stay inf
    if is_nested(tb):  # a chain of downsets: vectorised by stage (dpchain)
        next_break = run_nested(tb, layout, f, par_move, par_j, cost_of=cost_of, combine=combine, cap_s=cap_s,
                                want_break=want_break, reach=reach, deadline=deadline, cancel=cancel, bands=bands)
        return _result(tb, layout, f, par_move, par_j, next_break, want_break, reach, bound_s, cost_of)
    nwords = tb.words.shape[1]
    cols = [np.ascontiguousarray(tb.words[:, w]) for w in range(nwords)]
    for size in range(1, int(tb.size[-1]) + 1):
        n_active = int(np.searchsorted(mv.src_stage, size, side="left"))
        first, last = int(tb.layer_start[size]), int(tb.layer_start[size + 1])
        if n_active == 0 or first == last:
            continue
        rows = np.arange(first, last)
        if bands is not None:  # downsets no move may end in
            rows = rows[bands.admissible[rows]]
        rows_per_chunk = max(1, _CHUNK_ELEMENTS // (first * n_active))
        for lo in range(0, len(rows), rows_per_chunk):
            check_stop(cancel, deadline, int(rows[lo]), num)
            pi, js = _pairs(tb, cols, rows[lo:lo + rows_per_chunk], first, reach)
            if len(js) == 0:
                continue
            cost = _stage_costs(tb, pi, js, sigs, comm_factor, kind)
            if combine == "sum" and math.isfinite(cap_s):
                over = cost > cap_s
                if want_break and over.any():
                    next_break = min(next_break, float(cost[over].min()))
                cost[over] = np.inf
            prev = f[mv.src[:n_active, None], js[None, :]]
            here = cost[mv.sig[:n_active]]
            val = prev + here if combine == "sum" else np.maximum(prev, here)
            if bands is not None:  # each move ends only in its slot's band
                val[bands.outside(mv.dst[:n_active], tb.work_s[pi])] = np.inf
            starts = np.flatnonzero(np.r_[True, pi[1:] != pi[:-1]])
            seg_min = np.minimum.reduceat(val, starts, axis=1)
            counts = np.diff(np.r_[starts, len(pi)])
            pos = np.where(val == np.repeat(seg_min, counts, axis=1), np.arange(len(pi)), len(pi))
            best = np.minimum.reduceat(pos, starts, axis=1)
            _update(f, par_move, par_j, pi[starts], mv.move[:n_active], mv.dst[:n_active], seg_min, js[best])
    return _result(tb, layout, f, par_move, par_j, next_break, want_break, reach, bound_s, cost_of)


def _result(tb: DownsetTables, layout: Layout, f: np.ndarray, par_move: np.ndarray, par_j: np.ndarray,
            next_break: float, want_break: bool, reach: float, bound_s: float, cost_of: CostOf) -> DPResult:
    """The best terminal slot's value and plan, and the breakpoint (at most ``bound_s`` when narrowed)."""
    if want_break and math.isfinite(reach):
        next_break = min(next_break, bound_s)
    value, slot = math.inf, -1
    for t in layout.terminal:
        if f[t, tb.full] < value:
            value, slot = float(f[t, tb.full]), t
    stages, worst = _reconstruct(tb, layout, par_move, par_j, slot, cost_of) if slot >= 0 else ((), -math.inf)
    if layout.from_end:
        stages = stages[::-1]
    return DPResult(value, stages, next_break, tuple(float(f[t, tb.full]) for t in layout.terminal), worst)
