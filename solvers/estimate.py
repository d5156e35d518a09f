"""How long the exact DP would take, estimated without running it (torch-free).

One DP run (:func:`fxsplit.solvers.dpcore.run_dp`) compares each downset ``I`` with the smaller
downsets ``J ⊊ I``, a block of downsets of one size at a time, under every move of the layout
(:mod:`fxsplit.solvers.layout`), so it costs about ``a·L + b·P·W + c·P·M`` seconds for ``L``
sizes (blocks + 1), ``P = Σ_I |{J : |J| < |I|}|`` pairs (an upper bound of the subset pairs),
``W`` 64-bit words per downset and ``M`` moves (``k`` in fixed order, ``k(k+1)/2`` when 1F1B
memory depends on the number of stages and the devices differ, slots × classes in free order).
The constants were fitted on a 2-core CPU (GNMT, DenseNet-121, GPT 96-layer, Llama-7B and 70B
graphs, 4 to 64 moves; within a factor of about 1.4). The bottleneck objective costs 2 runs
(optimum, tie-break; both narrowed by an upper bound, so the estimate is high there); the
makespan sweep about :data:`MAKESPAN_RUNS`. With one chain of slots per stage count, one more
run over ``k`` moves: the overflow DP on the memory relaxation that picks the counts to solve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fxsplit.errors import SolverError
from fxsplit.ir.downsets import DEFAULT_MAX_DOWNSETS, DownsetBudgetError, enumerate_downsets
from fxsplit.ir.problem import Problem
from fxsplit.solvers.direct import dp_table_fits
from fxsplit.solvers.layout import build_layout, stage_counts

__all__ = ["DPEstimate", "MAKESPAN_RUNS", "estimate_dp"]

SECONDS_PER_SIZE = 8e-5
SECONDS_PER_PAIR_WORD = 7.7e-9
SECONDS_PER_PAIR_MOVE = 2.8e-9
MAKESPAN_RUNS = 4
"""DP runs of the exact makespan sweep, typical since its capped runs are narrowed to a work
window and need no uncapped run (Llama and T5 tiny: the bottleneck, then 1-2 capped runs;
chains with many breakpoints take dozens of cheap ones)."""

@dataclass(frozen=True)
class DPEstimate:
    """Estimated work of :func:`fxsplit.solvers.solve_dp` on a problem.

    Attributes:
        downsets: ``D``; ``None`` when more than the budget, or more than direct transfers' tables
            allow (:func:`~fxsplit.solvers.direct.dp_table_fits`): the DP refuses.
        pairs: ``P``, downset pairs compared (upper bound).
        moves, signatures: ``M`` and ``G`` of the layout.
        runs: DP runs for the objective.
        seconds: The estimate, seconds (``inf`` when the DP refuses).
    """

    downsets: int | None
    pairs: int = 0
    moves: int = 0
    signatures: int = 0
    runs: int = 0
    seconds: float = math.inf


def _memory_may_bind(problem: Problem) -> bool:
    """Like the DP's test, with every producer's largest edge as the cut (may say yes wrongly)."""
    g = problem.graph
    largest: dict[int, int] = {}
    for e in g.edges:
        largest[e.src] = max(largest.get(e.src, 0), e.size_bytes)
    cut = sum(largest.values())
    worst = problem.stage_memory_bytes(sum(problem.static_bytes(b) for b in g.blocks),
                                       sum(b.activation_bytes for b in g.blocks), cut, cut,
                                       problem.in_flight(0, problem.num_devices), False,
                                       transfers=problem.transfer_memory)
    return worst >= min(d.memory_bytes for d in problem.devices) + 1


def estimate_dp(problem: Problem, max_downsets: int | None = DEFAULT_MAX_DOWNSETS) -> DPEstimate:
    """Estimate the DP's work from the downsets' sizes and the layout (no DP is run).

    Example:
        >>> from fxsplit.ir import CondensedGraph, DeviceSpec, Problem
        >>> est = estimate_dp(Problem(CondensedGraph.chain([1.0] * 10), (DeviceSpec("a"), DeviceSpec("b"))))
        >>> est.downsets, est.pairs, est.moves
        (11, 55, 2)
    """
    try:
        masks = enumerate_downsets(problem.graph, max_count=max_downsets)
    except DownsetBudgetError:
        return DPEstimate(None)
    if problem.graph.direct and not dp_table_fits(len(masks), len(problem.graph)):
        return DPEstimate(None)  # the DP refuses direct transfers' tables this large (solvers.direct)
    per_size: dict[int, int] = {}
    for mask in masks:
        per_size[mask.bit_count()] = per_size.get(mask.bit_count(), 0) + 1
    smaller, pairs = 0, 0
    for size in sorted(per_size):
        pairs += per_size[size] * smaller
        smaller += per_size[size]
    bind = _memory_may_bind(problem)
    per_p = bind and problem.in_flight_depends_on_stage_count
    counts = stage_counts(problem, min(problem.num_devices, len(problem.graph)), per_p) if per_p else None
    try:  # with one chain of slots per stage count the DP lays out the most stages first, and the
        # others only where its work bound leaves room (rarely with binding memory): count those
        lay = build_layout(problem, len(problem.graph), bind, per_p, counts=counts[-1:] if counts else None)
    except SolverError:
        return DPEstimate(len(masks))
    moves, sigs = len(lay.moves), len(lay.groups)
    runs = 2 if problem.objective == "bottleneck" else MAKESPAN_RUNS
    words = max(1, (len(problem.graph) + 63) // 64)
    # the runs pair only downsets whose work differs by at most about two balanced stages
    window = min(1.0, 4.0 / problem.num_devices)
    per_run = (SECONDS_PER_SIZE * (len(problem.graph) + 1)
               + window * pairs * (SECONDS_PER_PAIR_WORD * words + SECONDS_PER_PAIR_MOVE * moves))
    seconds = runs * per_run
    if counts and len(counts) > 1 and not lay.from_end:  # the overflow run over the memory relaxation
        seconds += SECONDS_PER_SIZE * (len(problem.graph) + 1) + pairs * (
            SECONDS_PER_PAIR_WORD * words + SECONDS_PER_PAIR_MOVE * len(counts))
    return DPEstimate(len(masks), pairs, moves, sigs, runs, seconds)
