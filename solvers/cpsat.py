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
  memory ``Σ_b (static_b + act_b·flight)·x[b, s] + flight·in[s] + out[s] <= cap_t`` (without
  ``in``/``out`` when ``transfer_memory`` is False);
* objective: ``max_s load[s]`` (bottleneck) or ``Σ_s load[s] + (m - 1)·max_s load[s]`` (makespan).

Times are integers in units of ``time_quantum_s``, rounded down, so ``best_objective_bound ×
quantum`` is a proven lower bound of the true optimum, and CP-SAT's "optimal" is optimal up to the
rounding slack: the plan's exact cost (:func:`evaluate`) exceeds the bound by at most the quanta
that rounding down can hide (``stats["rounding_slack_s"]``: one quantum per block and per
communication term of a stage; the default quantum is ``total time on the slowest device /
2^20``). A plan is reported ``optimal`` only with a relative gap of at most :data:`OPTIMAL_GAP`
(the DP's): the bound of a DP hint closes the slack when the DP proved its plan, else a second
solve on a quantum fine enough for that gap (hinted with the plan) certifies it; failing both, the
status is ``feasible`` with the proven bound. A solution that breaks the slack, or a hint that
beats a claimed optimum, downgrades the status to ``feasible`` with a bound that does not come
from CP-SAT. Bytes are exact.

CP-SAT 9.15's presolve can drop an enforcement literal of a linear constraint whose Boolean
coefficients sum past ``2^31`` (``ActivityBoundHelper::RemoveEnforcementThatMakesConstraintTrivial``
sums them in an ``int``: google/or-tools#5293), turning "stage ``s`` on the small device ⇒ its
bytes fit the small device" into "stage ``s`` fits the small device" and proving a wrong
optimum. Memory rows in bytes hit it on real models, so that presolve step is switched off
(:data:`SAFE_PARAMETERS`).

References:
    Tarnawski et al., "Efficient Algorithms for Device Placement of DNN Graph Operators",
    NeurIPS 2020, §5 (the IP); OR-Tools CP-SAT samples (model layout).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fxsplit.errors import InfeasibleError, SolverError
from fxsplit.ir.plan import OPTIMAL_GAP, Plan, evaluate, trivial_lower_bound
from fxsplit.ir.problem import Problem
from fxsplit.solvers.cancel import Cancel, stop_search_when
from fxsplit.solvers.cpsat_model import CpData, build_model
from fxsplit.solvers.diagnose import require_one_stage_per_device, stage_count_error
from fxsplit.solvers.estimate import estimate_dp
from fxsplit.solvers.relax import memory_bound_error

__all__ = ["DEFAULT_TIME_LIMIT_S", "OPTIMAL_GAP", "SAFE_PARAMETERS", "solve_cpsat"]

logger = logging.getLogger(__name__)

DEFAULT_TIME_LIMIT_S = 60.0


SAFE_PARAMETERS: dict[str, Any] = {"presolve_inclusion_work_limit": 0}
"""CP-SAT parameters set on every solve. ``presolve_inclusion_work_limit=0`` skips
``ProcessAtMostOneAndLinear``, the only caller of the presolve rule "linear + amo: removed
enforcement literal" that overflows on byte-sized coefficients in OR-Tools 9.15
(google/or-tools#5293, #5294); costs little on these models (the rule rarely helps them)."""


def _hint_plan(problem: Problem, hint: str | Plan | None, limit_s: float) -> Plan | None:
    """The plan to hint: a given plan, ``dp`` (``"auto"``: when its estimate fits ``limit_s``;
    else, where the in-flight counts depend on the stage count, the DP's optimum of the problem
    with every micro-batch in flight, see :func:`_all_in_flight_hint`), else ``greedy``;
    ``None`` when none fits memory."""
    if hint is None or hint == "none" or isinstance(hint, Plan):
        return hint if isinstance(hint, Plan) else None
    from fxsplit.solvers.baselines import solve_greedy
    from fxsplit.solvers.dp import solve_dp

    if hint == "dp" or (hint == "auto" and estimate_dp(problem).seconds <= limit_s / 2):
        try:
            return solve_dp(problem, time_limit_s=limit_s)
        except (InfeasibleError, SolverError) as exc:
            logger.info("cpsat: no dp hint (%s)", exc)
    elif hint == "auto" and (plan := _all_in_flight_hint(problem, limit_s)) is not None:
        return plan
    try:
        return solve_greedy(problem)
    except InfeasibleError as exc:
        logger.info("cpsat: no greedy hint (%s)", exc)
        return None


def _all_in_flight_hint(problem: Problem, limit_s: float) -> Plan | None:
    """The DP's optimum of ``problem`` with all ``m`` micro-batches in flight on every stage
    (GPipe's memory), re-costed on ``problem``; ``None`` when that does not apply or fit the time.

    Under 1F1B or zero-bubble a stage holds at most ``m`` micro-batches and stage times do not
    depend on the schedule, so every plan of the relaxation is a plan here, as fast or faster
    (fewer activations kept: a stage may skip recomputing). Its DP lays out one chain of slots,
    not one per stage count, so it often fits the time where the exact DP does not (Llama-70B on
    32 A100s: 8 s against minutes; bench/README.md, *Activation recomputation*)."""
    if not problem.in_flight_depends_on_stage_count:
        return None
    from fxsplit.solvers.dp import solve_dp

    relaxed = problem.with_(schedule="gpipe")
    if estimate_dp(relaxed).seconds > limit_s / 2:
        return None
    try:
        plan = solve_dp(relaxed, time_limit_s=limit_s)
    except (InfeasibleError, SolverError) as exc:
        logger.info("cpsat: no all-in-flight dp hint (%s)", exc)
        return None
    hint = evaluate(problem, [st.blocks for st in plan.stages], [st.device for st in plan.stages], solver="dp")
    return hint if not hint.validate(problem) else None


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


def _infeasible(problem: Problem, limit_s: float, how: str) -> InfeasibleError:
    """The error for a problem proven infeasible (``how``): the DP's exact diagnosis when its
    estimate fits ``limit_s``, else the memory bound's numbers, else the plain facts."""
    if estimate_dp(problem).seconds <= limit_s:
        from fxsplit.solvers.dp import solve_dp

        try:
            solve_dp(problem, time_limit_s=limit_s)
        except InfeasibleError as exc:
            return exc
        except SolverError as exc:
            logger.info("cpsat: no exact diagnosis (%s)", exc)
    bound = memory_bound_error(problem)
    if bound is not None:
        return bound
    caps = sorted({d.memory_bytes for d in problem.devices})
    return InfeasibleError(
        f"{how} that no split of graph {problem.graph.name!r} ({len(problem.graph)} blocks) over "
        f"{problem.num_devices} devices (memory {caps} bytes) fits; give the devices more memory, "
        "add devices, or keep fewer activations in flight (schedule='1f1b', recompute='auto')"
    )


def _rounding_slack_s(problem: Problem, data: CpData, plan: Plan) -> float:
    """Most the floor rounding can hide in ``plan``'s objective: a quantum per block and per
    communication term (latency, each producer crossing, each direct transfer it pays) of a
    stage, twice in training, and one for the runtime's work on the stage (``fixed_q``)."""
    k = 2 if problem.training else 1
    stage_of = plan.stage_of_block()
    crossing = [0] * plan.num_stages
    for u, outs in data.producers.items():
        last = max(stage_of[v] for v, _ in outs)
        for s in range(stage_of[u], last):
            crossing[s] += 1
    direct = [0] * plan.num_stages
    for a, readers, _ in data.direct_q:  # a direct transfer, once on each stage it leaves or enters
        ends = {stage_of[a], *(stage_of[r] for r in readers)}
        for s in ends if len(ends) > 1 else ():
            direct[s] += 1
    fixed = 1 if problem.action_overhead_s > 0 else 0
    terms = [len(st.blocks) * (2 if st.recompute else 1) + k * (2 + (crossing[s - 1] if s else 0) + crossing[s])
             + direct[s] + fixed for s, st in enumerate(plan.stages)]
    if problem.objective == "bottleneck":
        return max(terms) * data.quantum_s
    return (sum(terms) + (problem.microbatches - 1) * max(terms)) * data.quantum_s


def _checked(problem: Problem, plan: Plan, hint: Plan | None, slack_s: float) -> Plan:
    """The better of CP-SAT's plan and the hint, keeping CP-SAT's claims only when they survive
    two cheap checks.

    A hint (a feasible plan) cheaper than the proven lower bound, or an ``optimal`` plan whose
    exact cost exceeds that bound by more than the rounding slack, means the proof is wrong (a
    solver bug, e.g. a presolve reduction): the status drops to ``feasible`` and the bound to
    :func:`trivial_lower_bound`. A hint that is cheaper than the plan but not than the bound only
    won on rounding, and the claim stands.
    """
    best = hint if hint is not None and hint.objective_s < plan.objective_s * (1 - 1e-9) else plan
    stats = {**plan.stats, **({"from": "hint"} if best is hint else {})}
    contradicted = hint is not None and hint.objective_s < plan.lower_bound_s * (1 - 1e-9) - 1e-15
    loose = plan.status == "optimal" and plan.objective_s - plan.lower_bound_s > slack_s * (1 + 1e-9) + 1e-15
    if contradicted or loose:
        logger.warning("cpsat claimed %s %.9g s with bound %.9g s (slack %.3g s) but %s: not trusting "
                       "its bound", plan.status, plan.objective_s, plan.lower_bound_s, slack_s,
                       "a hint is cheaper than the bound" if contradicted else "the plan exceeds the bound")
        return best.with_(solver="cpsat", status="feasible", stats={**stats, "proof_rejected": True},
                          lower_bound_s=min(trivial_lower_bound(problem), best.objective_s))
    bound = min(max(plan.lower_bound_s, hint.lower_bound_s if hint is not None else 0.0), best.objective_s)
    if best is hint:
        return hint.with_(solver="cpsat", status=plan.status, stats=stats, lower_bound_s=bound)
    return plan.with_(lower_bound_s=bound)  # a hint proven optimal (the DP) closes the rounding gap


def _check_cancel(cancel: Cancel | None) -> None:
    if cancel is not None and cancel.is_set():
        raise SolverError("cpsat stopped before its search: another solver finished first")


def _run(cp_model: Any, problem: Problem, data: CpData, hint_plan: Plan | None, limit_s: float,
         params: dict[str, Any], cancel: Cancel | None = None) -> tuple[Any, str, Plan | None, dict[str, Any]]:
    """One CP-SAT solve of ``data``: its status, status name, the evaluated plan (None without a
    solution; ``lower_bound_s`` the proven bound, status ``optimal`` for CP-SAT's OPTIMAL) and
    the stats. Setting ``cancel`` stops the search (its watcher repeats the stop until the solve
    returns); set before the model is built, nothing is built (status UNKNOWN)."""
    if cancel is not None and cancel.is_set():
        return cp_model.UNKNOWN, "UNKNOWN", None, {"cp_status": "UNKNOWN", "cancelled": True}
    model, var = build_model(cp_model, data, hint_plan)
    solver = cp_model.CpSolver()
    for key, value in {**SAFE_PARAMETERS, **params}.items():
        setattr(solver.parameters, key, value)
    solver.parameters.max_time_in_seconds = max(0.01, limit_s)
    if params.get("log_search_progress"):
        solver.log_callback = logger.info
    finished = stop_search_when(cancel, solver.stop_search) if cancel is not None else (lambda: None)
    try:
        status = solver.Solve(model)
    finally:
        finished()
    name = solver.StatusName(status)
    stats: dict[str, Any] = {"cp_status": name, "quantum_s": data.quantum_s,
                             "cp_wall_s": solver.WallTime(), "hinted": hint_plan is not None}
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return status, name, None, stats
    values = {key: (v if isinstance(v, int) else solver.Value(v)) == 1 for key, v in var.x.items()}
    units = {s: t for (s, t), v in var.use.items() if solver.BooleanValue(v)}
    stages, devices = _extract(problem, data, values, units)
    bound = max(trivial_lower_bound(problem), solver.BestObjectiveBound() * data.quantum_s)
    plan = evaluate(problem, stages, devices, solver="cpsat", lower_bound_s=bound, stats=stats,
                    status="optimal" if status == cp_model.OPTIMAL else "feasible")
    return status, name, plan, stats


def _certified(cp_model: Any, problem: Problem, data: CpData, plan: Plan, limit_s: float,
               params: dict[str, Any], cancel: Cancel | None = None) -> Plan:
    """``plan``, optimal up to the rounding of ``data``'s quantum, proven optimal to
    :data:`OPTIMAL_GAP` by a second solve on a quantum fine enough that rounding can hide no more
    than half that gap (objective values up to ``2^44`` quanta) (hinted with ``plan``; a cheaper plan it finds replaces it); else
    ``feasible`` with the best proven bound. A claimed optimum's gap is never above the DP's."""
    slack_quanta = plan.stats["rounding_slack_s"] / data.quantum_s
    fine = OPTIMAL_GAP / 2 * plan.objective_s / max(slack_quanta, 1.0)
    if fine >= data.quantum_s or fine < plan.objective_s / 2**44 or limit_s <= 0.05:
        return plan.with_(status="feasible", stats={**plan.stats, "certified": False})
    status, _, again, stats = _run(cp_model, problem, CpData.of(problem, fine), plan, limit_s, params, cancel)
    if again is None:
        return plan.with_(status="feasible", stats={**plan.stats, "certified": False})
    best = again if again.objective_s < plan.objective_s else plan
    bound = max(plan.lower_bound_s, again.lower_bound_s)
    proven = status == cp_model.OPTIMAL and best.objective_s - bound <= OPTIMAL_GAP * best.objective_s
    return best.with_(lower_bound_s=min(bound, best.objective_s), status="optimal" if proven else "feasible",
                      stats={**plan.stats, "certified": proven, "certify_quantum_s": fine,
                             "certify_wall_s": stats["cp_wall_s"]})


def solve_cpsat(
    problem: Problem,
    *,
    time_limit_s: float | None = None,
    num_workers: int = 2,
    seed: int = 0,
    hint: str | Plan | None = "auto",
    time_quantum_s: float | None = None,
    log_search: bool = False,
    cancel: Cancel | None = None,
) -> Plan:
    """Solve the split with OR-Tools CP-SAT (imported here, not at ``import fxsplit``).

    Args:
        problem: The problem (devices in pipeline order, or ``device_order="free"`` with one link).
        time_limit_s: Wall-clock limit, seconds (default :data:`DEFAULT_TIME_LIMIT_S`).
        num_workers: CP-SAT search workers (threads).
        seed: CP-SAT random seed (results are reproducible for a fixed seed and worker count).
        hint: ``"auto"`` (DP when its estimated time fits a quarter of the limit, else greedy),
            ``"dp"`` (DP within a quarter of the limit, else greedy), ``"greedy"``, a
            :class:`Plan`, or ``None``.
        time_quantum_s: Seconds per integer time unit; default ``total time / 2^20``.
        log_search: Let CP-SAT log its search (to the logger of this module).
        cancel: Stop the search when this flag is set (``auto``'s race): the best plan so far
            comes back ``feasible``, or :class:`SolverError` without one.

    Returns:
        The plan from :func:`evaluate`: status ``optimal`` when CP-SAT proved it to a gap of at
        most :data:`OPTIMAL_GAP` (and the claim passed the checks of the module docstring), else
        ``feasible`` with ``lower_bound_s`` = the proven bound (``stats``: ``cp_status``,
        ``quantum_s``, ``rounding_slack_s``, ``cp_wall_s``, ``hinted``, and ``from: "hint"`` /
        ``proof_rejected`` / ``certified``, ``certify_quantum_s``, ``certify_wall_s`` when they apply).

    Raises:
        InfeasibleError: only when infeasibility is proven: by the memory bound of
            :mod:`fxsplit.solvers.relax` (before any search) or by CP-SAT; diagnosed by the DP
            when its estimate fits the time left, else with the memory bound's numbers.
        SolverError: when the limit passes with no plan and no proof (the message says so and
            what to try), or for free order with per-pair links.
        ConfigError: for ``stages_per_device > 1`` (use :func:`fxsplit.solvers.solve`).
    """
    from ortools.sat.python import cp_model

    start = time.perf_counter()
    problem.check()
    require_one_stage_per_device(problem, "solve_cpsat")
    if not problem.allow_idle_devices and len(problem.graph) < problem.num_devices:
        raise stage_count_error(problem)
    limit_s = DEFAULT_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    if memory_bound_error(problem) is not None:  # proven in microseconds: no model to build
        raise _infeasible(problem, max(0.1, limit_s / 2), "the memory bound proved")
    hint_plan = _hint_plan(problem, hint, max(0.1, limit_s / 4))
    _check_cancel(cancel)
    data = CpData.of(problem, time_quantum_s)
    _check_cancel(cancel)
    params = {"num_workers": num_workers, "random_seed": seed, "log_search_progress": log_search}
    left_s = limit_s - (time.perf_counter() - start)
    status, name, solved, stats = _run(cp_model, problem, data, hint_plan, left_s, params, cancel)
    if status == cp_model.INFEASIBLE and hint_plan is None:
        left = limit_s - (time.perf_counter() - start)
        raise _infeasible(problem, max(0.1, left), "CP-SAT proved")
    if solved is None:
        if hint_plan is not None:  # INFEASIBLE despite a valid hint is a solver bug: keep the hint
            return hint_plan.with_(solver="cpsat", status="feasible", stats={**stats, "from": "hint"},
                                   solve_time_s=time.perf_counter() - start)
        raise SolverError(
            f"cpsat found no plan within {limit_s:.3g} s and did not prove that none exists "
            f"(status {name}): the problem may be infeasible or just hard. Fix: raise time_limit_s, "
            "give a hint plan, add devices or memory, or use a baseline solver (greedy)"
        )
    slack_s = _rounding_slack_s(problem, data, solved)
    plan = _checked(problem, solved.with_(stats={**stats, "rounding_slack_s": slack_s}), hint_plan, slack_s)
    if plan.status == "optimal" and plan.gap > OPTIMAL_GAP:
        plan = _certified(cp_model, problem, data, plan, limit_s - (time.perf_counter() - start), params, cancel)
    return plan.with_(solve_time_s=time.perf_counter() - start)
