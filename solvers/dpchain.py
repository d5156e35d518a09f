"""The DP of :mod:`fxsplit.solvers.dpcore` on a nested family of downsets (a chain), vectorised
by stage instead of by downset size.

When the downsets are nested (``D_0 ⊂ D_1 ⊂ … ⊂ D_n``, one per size: the prefixes of the block
order, ``solve_dp(states="chain")``, or every downset of a graph that is a path) every ``J`` of
smaller size is a subset of ``I``, so no membership test is needed, and the pairs within the
work window ``W(I) - W(J) <= reach`` form a band ``[n + 1, w]``. The general loop visits the
``n`` sizes one at a time (one downset each: ``n`` rounds of NumPy calls, most of a run's time
on graphs of a thousand blocks); here a chunk of rows is costed once for every signature and the
stages are then filled in order (``f`` at stage ``t + 1`` reads stage ``t`` at rows up to the
chunk's own, already filled): ``chunks × stages`` rounds. Same recurrence, costs, caps,
breakpoints and tie-breaking (the smallest ``J``; among moves into one slot the first) as
:func:`fxsplit.solvers.dpcore.run_dp`, which calls this.

References:
    Narayanan et al., "PipeDream", SOSP 2019, §3.1 (the DP over the prefixes of a chain).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from fxsplit.solvers.cancel import Cancel
from fxsplit.solvers.layout import Layout
from fxsplit.solvers.tables import DownsetTables

if TYPE_CHECKING:
    from fxsplit.solvers.dpcore import Bands

__all__ = ["is_nested", "run_nested"]

_CHUNK_ELEMENTS = 1 << 21
"""Signatures x rows x band width per chunk of rows."""


def is_nested(tb: DownsetTables) -> bool:
    """Whether the downsets are one per size, each inside the next."""
    n = tb.layer_start.shape[0] - 2
    return tb.num == n + 1 and not np.any(tb.words[:-1] & ~tb.words[1:])


def run_nested(tb: DownsetTables, layout: Layout, f: np.ndarray, par_move: np.ndarray, par_j: np.ndarray, *,
               cost_of: Callable[[np.ndarray, np.ndarray], np.ndarray], combine: str, cap_s: float,
               want_break: bool, reach: float, deadline: float | None, cancel: Cancel | None,
               bands: Bands | None = None) -> float:
    """Fill ``f``, ``par_move``, ``par_j`` (``[slots, n + 1]``) for nested tables; returns the
    smallest stage cost above ``cap_s`` seen (``inf`` when none).

    ``cost_of(i, js) -> [G, P]`` costs the stages ``I \\ J`` of the pairs under every signature
    (:func:`fxsplit.solvers.dpcore._stage_costs` bound to the run's arguments). ``bands``: the
    narrowed run's work bands (:class:`fxsplit.solvers.dpcore.Bands`), as the general loop
    applies them (downsets outside every band are not costed; a move ends only in its slot's).

    Raises:
        DPTimeoutError, DPCancelledError: as :func:`fxsplit.solvers.dpcore.run_dp`.
    """
    from fxsplit.solvers.dpcore import _Moves, check_stop

    mv = _Moves.of(layout)
    n = tb.num - 1
    work = tb.work_s
    lo = np.searchsorted(work, work - reach, side="left") if math.isfinite(reach) else np.zeros(n + 1, dtype=np.int64)
    rows_all = np.arange(n + 1)
    width = max(1, int((rows_all - lo).max()))
    per_stage = [np.flatnonzero(mv.src_stage == t) for t in range(int(mv.src_stage.max()) + 1)] if len(mv.move) else []
    sigs_n = len(layout.sigs)
    chunk = max(1, _CHUNK_ELEMENTS // (width * max(1, sigs_n)))
    next_break = math.inf
    offsets = np.arange(-width, 0)  # ascending J: the first smallest value wins, as in run_dp
    for start in range(1, n + 1, chunk):
        check_stop(cancel, deadline, start, tb.num)
        rows = np.arange(start, min(start + chunk, n + 1))
        js = rows[:, None] + offsets[None, :]
        valid = (js >= lo[rows, None]) & (js >= 0)
        if bands is not None:
            valid &= bands.admissible[rows, None]
        ii, cc = np.nonzero(valid)
        if len(ii) == 0:
            continue
        pi, pj = rows[ii], js[ii, cc]
        cost = cost_of(pi, pj)
        if combine == "sum" and math.isfinite(cap_s):
            over = cost > cap_s
            if want_break and over.any():
                next_break = min(next_break, float(cost[over].min()))
            cost[over] = np.inf
        band = np.full((sigs_n, len(rows), width), np.inf)
        band[:, ii, cc] = cost
        jband = np.where(valid, js, 0)
        at = np.arange(len(rows))
        for moves in per_stage:  # stage by stage: stage t + 1 reads stage t's rows of this chunk
            for m in moves.tolist():  # in move order: among moves into one slot the first smallest wins
                src, dst, sig = int(mv.src[m]), int(mv.dst[m]), int(mv.sig[m])
                prev = np.where(valid, f[src][jband], np.inf)
                val = prev + band[sig] if combine == "sum" else np.maximum(prev, band[sig])
                arg = np.argmin(val, axis=1)
                best = val[at, arg]
                if bands is not None:
                    best = np.where(bands.outside(np.array([dst]), work[rows])[0], np.inf, best)
                better = best < f[dst, rows]
                if better.any():
                    f[dst, rows[better]] = best[better]
                    par_move[dst, rows[better]] = int(mv.move[m])
                    par_j[dst, rows[better]] = jband[at, arg][better]
    return next_break
