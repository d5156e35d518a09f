"""The inner loop of the exact DP over downsets × slots, vectorised over the smaller downset.

Recurrence (``⊕`` is ``max`` for the bottleneck, ``+`` for a sum of stage costs)::

    f[slot 0][∅] = 0
    f[dst][I] = min over moves (src -> dst) and downsets J ⊊ I of  f[src][J] ⊕ cost(move, J, I)

where ``cost`` is the stage ``I \\ J``'s time on the move's device (compute / speed +
communication of ``cut(J)`` in and ``cut(I)`` out, paid twice in training), or ``+inf`` when the
stage's memory exceeds the device's. With ``cap_s`` (used for the makespan) stage costs above the
cap are forbidden too, and the smallest forbidden cost is reported as the next breakpoint. With
``kind="excess"`` the cost is the stage's memory minus the device's (infeasibility diagnosis).

Complexity: ``O(P · M)`` array operations, ``P = Σ_I |{J ⊊ I}| ≤ D² / 2`` downset pairs and
``M`` the number of moves (fixed order: ``k``; free order: slots × device classes); memory
``O(S · D)`` for ``S`` slots.

References:
    Tarnawski et al., "Efficient Algorithms for Device Placement of DNN Graph Operators",
    NeurIPS 2020, §4; Narayanan et al., "PipeDream", SOSP 2019, §3.1 (the chain special case).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from fxsplit.errors import SolverError
from fxsplit.ir.problem import Problem
from fxsplit.solvers.layout import Layout, Signature
from fxsplit.solvers.tables import DownsetTables

__all__ = ["DPResult", "DPTimeoutError", "run_dp"]

_DEADLINE_EVERY = 64


class DPTimeoutError(SolverError):
    """The DP ran past its deadline (``auto`` falls back to ``cpsat`` on this one)."""


@dataclass(frozen=True)
class DPResult:
    """The best value over the layout's terminal slots and the plan reaching it.

    Attributes:
        value: Best ``f[terminal][V]`` (``inf`` when no plan is feasible).
        stages: ``[(block mask, unit)]`` per stage in pipeline order (empty when infeasible).
        next_break: Smallest stage cost above ``cap_s`` seen (``inf`` when none or no cap).
    """

    value: float
    stages: tuple[tuple[int, int], ...]
    next_break: float


@dataclass
class _Ctx:
    tb: DownsetTables
    i: int
    js: np.ndarray
    comm_factor: float


def _transfer(size: np.ndarray | float, lat: float, bw: float) -> np.ndarray | float:
    return np.where(np.asarray(size) > 0, lat + np.asarray(size) / bw, 0.0)


def _stage_cost(c: _Ctx, sig: Signature, kind: str) -> np.ndarray:
    """``[len(js)]`` cost of stage ``I \\ J`` for each ``J`` under one signature.

    With recomputation (``tb.recompute``, :meth:`fxsplit.ir.Problem.recomputes`) a stage costs
    its forward once more where it recomputes: always under ``"all"``; under ``"auto"`` where its
    kept activations overflow the device and recomputing saves memory."""
    tb, i, js = c.tb, c.i, c.js
    cut_in: np.ndarray | float = tb.cut_bytes[js]
    cut_out: np.ndarray | float = float(tb.cut_bytes[i])
    if tb.is_flipped:  # the reversed graph's stage I \ J receives cut(I) and sends cut(J)
        cut_in, cut_out = cut_out, cut_in
    need = math.isfinite(sig.cap_bytes) or kind == "excess"
    mode = tb.recompute
    mem, again = None, np.zeros(len(js), dtype=bool)
    if need or mode == "all":
        static, act = tb.static_bytes[i] - tb.static_bytes[js], tb.act_bytes[i] - tb.act_bytes[js]
        keep = Problem.stage_memory_bytes(static, act, cut_in, cut_out, sig.flight, False)
        if mode == "none":
            mem = keep
        else:
            saved = Problem.stage_memory_bytes(static, act, cut_in, cut_out, sig.flight, True)
            again = (np.ones(len(js), dtype=bool) if mode == "all"
                     else (keep > sig.cap_bytes) & (saved < keep))
            mem = np.where(again, saved, keep)
        if kind == "excess":
            return mem - sig.cap_bytes
    comm = _transfer(cut_in, sig.link_in.latency_s, sig.link_in.bytes_per_s) \
        + _transfer(cut_out, sig.link_out.latency_s, sig.link_out.bytes_per_s)
    work = tb.work_s[i] - tb.work_s[js] + np.where(again, tb.fwd_s[i] - tb.fwd_s[js], 0.0)
    cost = work / sig.speed + c.comm_factor * comm
    if need and mem is not None:
        cost = np.where(mem < sig.cap_bytes + 1.0, cost, np.inf)
    return cost


@dataclass(frozen=True)
class _Group:
    """Moves of one signature sorted by the number of stages before them."""

    move: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    src_stage: np.ndarray

    @classmethod
    def of(cls, layout: Layout, group: tuple[int, ...]) -> _Group:
        order = sorted(group, key=lambda m: layout.stages[layout.moves[m].src])
        return cls(
            move=np.array(order, dtype=np.int64),
            src=np.array([layout.moves[m].src for m in order], dtype=np.int64),
            dst=np.array([layout.moves[m].dst for m in order], dtype=np.int64),
            src_stage=np.array([layout.stages[layout.moves[m].src] for m in order]),
        )


def _update(f: np.ndarray, par_move: np.ndarray, par_j: np.ndarray, layout: Layout, i: int,
            cands: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """Store, for each destination slot, the best candidate of downset ``i``."""
    moves = np.concatenate([c[0] for c in cands])
    vals = np.concatenate([c[1] for c in cands])
    js = np.concatenate([c[2] for c in cands])
    dst = np.array([layout.moves[m].dst for m in moves.tolist()], dtype=np.int64)
    order = np.lexsort((vals, dst))
    dst_sorted = dst[order]
    first = order[np.r_[True, dst_sorted[1:] != dst_sorted[:-1]]]
    keep = first[np.isfinite(vals[first]) | (vals[first] < 0)]
    f[dst[keep], i] = vals[keep]
    par_move[dst[keep], i] = moves[keep]
    par_j[dst[keep], i] = js[keep]


def _reconstruct(tb: DownsetTables, layout: Layout, par_move: np.ndarray, par_j: np.ndarray,
                 slot: int) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    i = tb.full
    while i != 0:
        mv, j = int(par_move[slot, i]), int(par_j[slot, i])
        move = layout.moves[mv]
        out.append((tb.masks[i] & ~tb.masks[j], move.unit))
        slot, i = move.src, j
    return tuple(reversed(out))


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

    With a layout built from the pipeline's end (:attr:`Layout.from_end`) the DP runs over the
    reversed graph's tables (:meth:`DownsetTables.flipped`); the stages it returns are in
    pipeline order either way.

    Raises:
        DPTimeoutError: when ``deadline`` passes; the message says how far it got.
    """
    if layout.from_end != tb.is_flipped:
        tb = tb.flipped()
    num = tb.num
    f = np.full((layout.num_slots, num), np.inf)
    f[0, 0] = -np.inf if kind == "excess" else 0.0
    par_move = np.full((layout.num_slots, num), -1, dtype=np.int32)
    par_j = np.zeros((layout.num_slots, num), dtype=np.int32)
    groups = [_Group.of(layout, g) for g in layout.groups]
    next_break = math.inf
    for i in range(1, num):
        if deadline is not None and i % _DEADLINE_EVERY == 0 and time.perf_counter() > deadline:
            raise DPTimeoutError(
                f"dp timed out after {i}/{num} downsets; raise time_limit_s or use solver='cpsat'"
            )
        ctx = _Ctx(tb, i, tb.subsets(i), comm_factor)
        cands = []
        for grp, sig in zip(groups, layout.sigs, strict=True):
            n_active = int(np.searchsorted(grp.src_stage, tb.size[i], side="left"))
            if n_active == 0:
                continue
            cost = _stage_cost(ctx, sig, kind)
            if combine == "sum" and math.isfinite(cap_s):
                over = cost > cap_s
                if want_break and over.any():
                    next_break = min(next_break, float(cost[over].min()))
                cost[over] = np.inf
            prev = f[np.ix_(grp.src[:n_active], ctx.js)]
            val = prev + cost if combine == "sum" else np.maximum(prev, cost)
            best = np.argmin(val, axis=1)
            cands.append((grp.move[:n_active], val[np.arange(n_active), best], ctx.js[best]))
        if cands:
            _update(f, par_move, par_j, layout, i, cands)
    value, slot = math.inf, -1
    for t in layout.terminal:
        if f[t, tb.full] < value:
            value, slot = float(f[t, tb.full]), t
    stages = _reconstruct(tb, layout, par_move, par_j, slot) if slot >= 0 else ()
    if layout.from_end:
        stages = stages[::-1]
    return DPResult(value, stages, next_break)
