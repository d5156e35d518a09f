"""``cpsat``: an exact OR-Tools CP-SAT model of the split, for graphs whose downsets explode.

Model (``S = min(devices, blocks)`` stages, ``s`` 0-based; units are devices in ``"fixed"`` order,
device classes of equal speed and memory in ``"free"`` order):

* ``x[b, s]`` block ``b`` in stage ``s``, exactly one stage per block; **precedence**
  ``Σ_s s·x[u, s] <= Σ_s s·x[v, s]`` for every edge makes every stage prefix a downset;
* ``nonempty[s]`` with empty stages last; ``use[s, t]`` stage ``s`` runs on unit ``t`` (at most
  ``count_t`` stages per unit); with 1F1B and binding memory, ``pipe[q]`` "``q`` stages";
* ``cross[u, s]`` producer ``u``'s output crosses boundary ``s`` (``>= a[u, s] - a[v, s]`` with
  ``a[b, s] = Σ_{s' <= s} x[b, s']``);
* ``load[s] >= Σ_b time(b, t)·x[b, s] + k·(comm[s - 1] + comm[s])`` if ``use[s, t]``;
  memory ``Σ_b (static_b + act_b·flight)·x[b, s] + flight·in[s] + out[s] <= cap_t``;
* objective: ``max_s load[s]`` (bottleneck) or ``Σ_s load[s] + (m - 1)·max_s load[s]`` (makespan).

Times are integers in units of ``time_quantum_s``, rounded down, so ``best_objective_bound ×
quantum`` is a proven lower bound of the true optimum; "optimal" is optimal up to the quantum
(default ``total time / 2^20``). Bytes are exact.

References:
    Tarnawski et al., "Efficient Algorithms for Device Placement of DNN Graph Operators",
    NeurIPS 2020, §5 (the IP); OR-Tools CP-SAT samples (model layout).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fxsplit.solvers.cpsat_model import CpData, build_model
from fxsplit.solvers.diagnose import stage_count_error

from fxsplit.errors import InfeasibleError, SolverError
from fxsplit.ir.downsets import DEFAULT_MAX_DOWNSETS, count_downsets
from fxsplit.ir.plan import Plan, evaluate, trivial_lower_bound
from fxsplit.ir.problem import Problem

__all__ = ["DEFAULT_TIME_LIMIT_S", "solve_cpsat"]

logger = logging.getLogger(__name__)

DEFAULT_TIME_LIMIT_S = 60.0


def _hint_plan(problem: Problem, hint: str | Plan | None, deadline_s: float) -> Plan | None:
    """The plan to hint: a given plan, ``dp`` (when downsets are few), or ``greedy``."""
    if hint is None or hint == "none" or isinstance(hint, Plan):
        return hint if isinstance(hint, Plan) else None
    from fxsplit.solvers.baselines import solve_greedy
    from fxsplit.solvers.dp import solve_dp

    try:
        if hint in ("auto", "dp") and count_downsets(problem.graph, limit=DEFAULT_MAX_DOWNSETS // 4):
            return solve_dp(problem, time_limit_s=deadline_s)
        return solve_greedy(problem)
    except (InfeasibleError, SolverError) as exc:
        logger.info("cpsat: no hint (%s)", exc)
        return None


def _extract(problem: Problem, data: CpData, values: dict[tuple[int, int], bool],
             units: dict[int, int]) -> tuple[list[list[int]], list[int]]:
    """Non-empty stages in order and their devices (free order: next device of the class)."""
    stages: list[list[int]] = [[] for _ in range(data.num_stages)]
    for (b, s), on in values.items():
        if on:
            stages[s].append(b)
    used: dict[int, int] = {}
    out_st, out_dev = [], []
    for s, blocks in enumerate(stages):
        if not blocks:
            continue
        t = units[s]
        out_st.append(sorted(blocks))
        out_dev.append(data.unit_devices[t][used.get(t, 0)])
        used[t] = used.get(t, 0) + 1
    return out_st, out_dev


def _infeasible(problem: Problem) -> InfeasibleError:
    """Exact diagnosis through the DP when it is affordable, else the plain facts."""
    if count_downsets(problem.graph, limit=DEFAULT_MAX_DOWNSETS) is not None:
        from fxsplit.solvers.dp import solve_dp

        try:
            solve_dp(problem)
        except InfeasibleError as exc:
            return exc
    caps = sorted({d.memory_bytes for d in problem.devices})
    return InfeasibleError(
        f"CP-SAT proved that no split of graph {problem.graph.name!r} ({len(problem.graph)} "
        f"blocks) over {problem.num_devices} devices (memory {caps} bytes) fits; give the devices "
        "more memory, add devices, or lower microbatches / use schedule='1f1b'"
    )


def solve_cpsat(
    problem: Problem,
    *,
    time_limit_s: float | None = None,
    num_workers: int = 2,
    seed: int = 0,
    hint: str | Plan | None = "auto",
    time_quantum_s: float | None = None,
    log_search: bool = False,
) -> Plan:
    """Solve the split with OR-Tools CP-SAT (imported here, not at ``import fxsplit``).

    Args:
        problem: The problem (devices in pipeline order, or ``device_order="free"`` with one link).
        time_limit_s: Wall-clock limit, seconds (default :data:`DEFAULT_TIME_LIMIT_S`).
        num_workers: CP-SAT search workers (threads).
        seed: CP-SAT random seed (results are reproducible for a fixed seed and worker count).
        hint: ``"auto"`` (DP when the graph's downsets are few, else greedy), ``"dp"``,
            ``"greedy"``, a :class:`Plan`, or ``None``.
        time_quantum_s: Seconds per integer time unit; default ``total time / 2^20``.
        log_search: Let CP-SAT log its search (to the logger of this module).

    Returns:
        The plan from :func:`evaluate`: status ``optimal`` when CP-SAT proved it, else
        ``feasible`` with ``lower_bound_s`` = the proven bound (``stats["cp_status"]``, bound,
        wall time and quantum are recorded).

    Raises:
        InfeasibleError: when CP-SAT proves no split fits (diagnosed by the DP when affordable).
        SolverError: when the limit passes with no plan at all, or for free order with per-pair
            links.
    """
    from ortools.sat.python import cp_model

    start = time.perf_counter()
    problem.check()
    if not problem.allow_idle_devices and len(problem.graph) < problem.num_devices:
        raise stage_count_error(problem)
    limit_s = DEFAULT_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    hint_plan = _hint_plan(problem, hint, max(0.1, limit_s / 4))
    data = CpData.of(problem, time_quantum_s)
    model, var = build_model(cp_model, data, hint_plan)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, limit_s - (time.perf_counter() - start))
    solver.parameters.num_workers = num_workers
    solver.parameters.random_seed = seed
    solver.parameters.log_search_progress = log_search
    if log_search:
        solver.log_callback = logger.info
    status = solver.Solve(model)
    name = solver.StatusName(status)
    stats: dict[str, Any] = {"cp_status": name, "quantum_s": data.quantum_s,
                             "cp_wall_s": solver.WallTime(), "hinted": hint_plan is not None}
    if status == cp_model.INFEASIBLE:
        raise _infeasible(problem)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if hint_plan is not None:
            return hint_plan.with_(solver="cpsat", status="feasible", stats={**stats, "from": "hint"})
        raise SolverError(f"cpsat found no plan within {limit_s:.3g} s (status {name}); raise "
                          "time_limit_s or use a baseline solver")
    values = {key: bool(solver.BooleanValue(v)) for key, v in var.x.items()}
    units = {s: t for (s, t), v in var.use.items() if solver.BooleanValue(v)}
    stages, devices = _extract(problem, data, values, units)
    bound = max(trivial_lower_bound(problem), solver.BestObjectiveBound() * data.quantum_s)
    plan = evaluate(problem, stages, devices, solver="cpsat", lower_bound_s=bound, stats=stats,
                    status="optimal" if status == cp_model.OPTIMAL else "feasible")
    if hint_plan is not None and hint_plan.objective_s < plan.objective_s * (1 - 1e-9):
        plan = hint_plan.with_(solver="cpsat", lower_bound_s=min(bound, hint_plan.objective_s),
                               status=plan.status, stats={**stats, "from": "hint"})
    return plan.with_(solve_time_s=time.perf_counter() - start)
