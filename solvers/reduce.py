"""Exact problem reduction: free boundary blocks folded away before an exact solve.

Profiled layer graphs carry blocks that cost nothing: PipeDream's ``Input`` nodes and the unused
``__getitem__`` outputs of LSTMs (GNMT has nine such sinks and four such sources). Each one that
may sit in several stages multiplies the downsets (GNMT: 7,874) without changing any plan's
cost. A free block ``f`` (no compute time) at the graph's boundary has a placement that is never
worse than any other, so it can be decided before the search:

* a free **sink** with one producer ``p`` goes into ``p``'s stage (it cannot come earlier; any
  later stage only makes ``p -> f`` cross more boundaries), and a free **source** with one
  consumer ``c`` into ``c``'s stage (symmetrically);
* a free source (sink) whose edges carry no bytes goes into the first (last) stage: it
  constrains nothing.

"Never worse" holds for time (stage compute is unchanged, boundary traffic only shrinks) and for
memory when the block holds none, or when memory cannot bind at all (the whole graph with every
edge sent and received fits the smallest device with the most micro-batches in flight), *provided
a stage of free blocks only is of no use*. It can be of use, so such problems are left alone, when
every device must get a stage (``allow_idle_devices=False``), and when the pipeline's positions
differ (``device_order="fixed"`` with devices of different speed or memory, or per-pair links):
there a stage holding only a free block is a spacer that lets the real stages skip a slow or
small device or a slow link (found by review: a slow first device, [F] | [A] beats [F, A]). The same idea is
``dp.cpp``'s "trivial node optimizations" (Tarnawski et al., NeurIPS 2020) and PipeDream's
optimizer, which drops ``Input`` sources and unused ``__getitem__`` sinks before building its
antichain DAG (Narayanan et al., SOSP 2019).

The optimum of the reduced problem equals the original's, so its lower bound is one for the
original; the plan is re-costed on the original problem (:func:`fxsplit.ir.plan.evaluate`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from fxsplit.errors import InfeasibleError
from fxsplit.ir.graph import Block, CondensedGraph, Edge
from fxsplit.ir.plan import Plan, evaluate
from fxsplit.ir.problem import Problem

__all__ = ["Reduction", "fold_free_blocks", "solve_reduced"]

logger = logging.getLogger(__name__)

FIRST, LAST = -1, -2
"""Placement of a removed block: the first or the last stage of the plan."""


@dataclass(frozen=True)
class Reduction:
    """A problem with free boundary blocks folded away.

    Attributes:
        problem: The reduced problem (blocks renumbered topologically).
        place: ``[n]`` for each original block, its reduced block id, or ``FIRST`` / ``LAST``
            (``-1`` / ``-2``) for a removed block that goes to the plan's first / last stage.
    """

    problem: Problem
    place: tuple[int, ...]

    @property
    def folded(self) -> int:
        """How many original blocks were folded into others or removed."""
        return len(self.place) - len(self.problem.graph)

    def lift(self, original: Problem, plan: Plan) -> Plan:
        """``plan`` of the reduced problem as a plan of ``original``, re-costed there.

        The status and lower bound carry over (the two optima are equal); a plan whose cost on
        ``original`` is not within ``1e-9`` of a claimed optimum is marked ``feasible``.
        """
        stage_of = {b: s for s, st in enumerate(plan.stages) for b in st.blocks}
        last = len(plan.stages) - 1
        stages: list[list[int]] = [[] for _ in plan.stages]
        for b, r in enumerate(self.place):
            stages[0 if r == FIRST else last if r == LAST else stage_of[r]].append(b)
        lifted = evaluate(original, stages, [st.device for st in plan.stages], solver=plan.solver,
                          status=plan.status, lower_bound_s=plan.lower_bound_s, solve_time_s=plan.solve_time_s,
                          stats={**plan.stats, "folded_blocks": self.folded})
        if plan.status == "optimal":
            if abs(lifted.objective_s - plan.objective_s) <= 1e-9 * max(1.0, abs(plan.objective_s)):
                lifted = lifted.with_(lower_bound_s=lifted.objective_s)
            else:
                logger.warning("reduce: the reduced optimum %.9g costs %.9g on the original problem; not "
                               "calling it optimal", plan.objective_s, lifted.objective_s)
                lifted = lifted.with_(status="feasible")
        return lifted


def _is_free_time(b: Block) -> bool:
    return b.fwd_s == 0 and b.bwd_s == 0 and b.fwd_fixed_s == 0 and b.bwd_fixed_s == 0 and b.bwd_weight_s == 0


def _holds_memory(problem: Problem, b: Block) -> bool:
    return problem.static_bytes(b) > 0 or b.activation_bytes > 0


def _positions_alike(problem: Problem) -> bool:
    """Whether no pipeline position is better than another for a stage: the solver picks the
    devices (free order), or every device has the same speed, memory and transfer terms
    (``comm_free``) and every link is the default one (fixed order)."""
    if problem.device_order == "free":
        return True
    return not problem.links and len({(d.speed, d.memory_bytes, d.comm_free) for d in problem.devices}) == 1


def _memory_cannot_bind(problem: Problem) -> bool:
    """The whole graph on one stage, every edge received and sent, the most micro-batches in
    flight, recomputing nothing, fits the smallest device."""
    g = problem.graph
    static = sum(problem.static_bytes(b) for b in g.blocks)
    act = sum(b.activation_bytes for b in g.blocks)
    edges = sum(e.size_bytes for e in g.edges)
    worst = problem.stage_memory_bytes(static, act, edges, edges, problem.in_flight(0, problem.num_devices), False,
                                       transfers=problem.transfer_memory)
    return bool(worst <= min(d.memory_bytes for d in problem.devices))


def fold_free_blocks(problem: Problem) -> Reduction | None:
    """Fold the free boundary blocks of ``problem`` away (module docstring), to a fixed point.

    Args:
        problem: A checked problem.

    Returns:
        The :class:`Reduction`, or ``None`` when nothing folds (or the problem must use every
        device, or every block would go).
    """
    g = problem.graph
    n = len(g)
    if not problem.allow_idle_devices or n < 2 or not _positions_alike(problem) or g.direct:
        return None  # direct transfers tie blocks to stages the folding does not see
    loose_memory = _memory_cannot_bind(problem)
    owner = list(range(n))  # union-find: a folded block points at the block it joined

    def find(b: int) -> int:
        while owner[b] != b:
            owner[b] = owner[owner[b]]
            b = owner[b]
        return b

    removed: dict[int, int] = {}
    members: dict[int, list[int]] = {b: [b] for b in range(n)}  # live groups by representative

    def group_free(r: int) -> bool:
        return all(_is_free_time(g.blocks[m]) for m in members[r]) and (
            loose_memory or not any(_holds_memory(problem, g.blocks[m]) for m in members[r]))

    def outside(r: int, ends: Callable[[int], tuple[int, ...]]) -> set[int]:
        return {find(x) for m in members[r] for x in ends(m) if x not in removed} - {r}

    def edge_bytes(r: int) -> int:
        return sum(e.size_bytes + (e.grad_bytes or 0) for e in g.edges
                   if find(e.src) != find(e.dst) and r in (find(e.src), find(e.dst)))

    changed = True
    while changed:
        changed = False
        for r in sorted({find(b) for b in range(n) if b not in removed}):
            if r in removed or find(r) != r or not group_free(r):
                continue
            ins, outs = outside(r, g.predecessors), outside(r, g.successors)
            if len(members) <= 1:
                break
            if not ins and not outs:
                continue  # an isolated free block: leave it to the solver
            target = next(iter(ins)) if not outs and len(ins) == 1 else (
                next(iter(outs)) if not ins and len(outs) == 1 else None)
            if target is not None:
                owner[r] = target
                members[target].extend(members.pop(r))
                changed = True
            elif (not ins or not outs) and edge_bytes(r) == 0:
                for m in members.pop(r):
                    removed[m] = FIRST if not ins else LAST
                changed = True
    reps = sorted({find(b) for b in range(n) if b not in removed})
    if len(reps) == n:
        return None
    index = {r: i for i, r in enumerate(reps)}  # reps ascending: a topological order of the groups
    blocks = tuple(_merged(i, [g.blocks[m] for m in sorted(members[r])]) for i, r in enumerate(reps))
    edges = tuple(Edge(index[find(e.src)], index[find(e.dst)], e.size_bytes, e.grad_bytes) for e in g.edges
                  if e.src not in removed and e.dst not in removed and find(e.src) != find(e.dst))
    reduced = problem.with_(graph=CondensedGraph(blocks, edges, name=g.name))
    place = tuple(removed[b] if b in removed else index[find(b)] for b in range(n))
    logger.info("reduce: %d of %d blocks folded (free boundary blocks)", n - len(reps), n)
    return Reduction(reduced, place)


def _merged(i: int, parts: list[Block]) -> Block:
    """One block of ``parts`` (one non-free block and free ones folded into it): sums of costs."""
    head = max(parts, key=lambda b: (b.time_s, b.param_bytes + b.buffer_bytes + b.activation_bytes))
    if len(parts) == 1:
        return replace(head, id=i)
    total = {k: sum(getattr(b, k) for b in parts) for k in (
        "flops", "fwd_s", "bwd_s", "param_bytes", "buffer_bytes", "replica_param_bytes", "fwd_fixed_s",
        "bwd_fixed_s", "bwd_weight_s", "activation_bytes", "output_bytes")}
    return Block(id=i, name=head.name, nodes=tuple(x for b in parts for x in b.nodes), **total)


def solve_reduced(problem: Problem, solve: Callable[[Problem], Plan]) -> Plan | None:
    """``solve`` on the reduced problem, lifted back; ``None`` when nothing folds, or when the
    reduced problem is infeasible (so that the caller's own search diagnoses ``problem``, naming
    its blocks rather than the merged ones)."""
    reduction = fold_free_blocks(problem)
    if reduction is None:
        return None
    try:
        return reduction.lift(problem, solve(reduction.problem))
    except InfeasibleError:
        logger.info("reduce: the reduced problem is infeasible; diagnosing the original")
        return None
