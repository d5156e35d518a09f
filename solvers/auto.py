"""``auto``: the exact DP where it is quick, a race of the DP and CP-SAT where it may not be,
CP-SAT alone where the DP would not finish.

Picking by the number of downsets alone misjudges the DP: its work grows with the downset pairs
× the moves of the layout, so ``auto`` asks :func:`fxsplit.solvers.estimate.estimate_dp`.

Policy of :func:`solve_auto` with a time limit ``T``:

1. ``dp`` alone when its estimate is at most :data:`AUTO_RACE_FROM_S` (a race would cost more
   than it could win), with ``AUTO_DP_TIME_SHARE · T`` to finish;
2. a race when the graph has at most ``max_downsets`` downsets and the estimate is at most
   ``AUTO_DP_SHARE · T``: ``dp`` in the calling thread (``AUTO_DP_TIME_SHARE · T``), ``cpsat`` in
   a second one (``T``, hinted by ``greedy``). The first *proof* (an optimum, or infeasibility)
   wins and stops the other (:class:`fxsplit.solvers.cancel.Cancel`); a plan that is only
   ``feasible`` waits for the other solver, and the better plan is returned. With
   ``race=False``, ``dp`` alone as in 1. instead;
3. otherwise ``cpsat`` alone with all of ``T``;
4. after a ``dp`` time-out in 1., ``cpsat`` with the time left, hinted by ``greedy``; when the
   DP had a plan by then (its makespan sweep cut short: ``feasible`` with a proven bound), CP-SAT
   starts from the cheaper of that plan and the caller's hint, and the cheaper plan comes back
   with the higher of the two bounds (the DP's alone when CP-SAT finds nothing).

Before any of these the memory bound of :mod:`fxsplit.solvers.relax` runs (infeasibility proven
in microseconds is reported at once, with its arithmetic), and one micro-batch's makespan is
checked against the whole graph on a fastest device
(:func:`fxsplit.solvers.dp.one_stage_optimum`, optimal without a search where it fits).
Without a limit, the estimate is compared with :data:`AUTO_DP_MAX_S` instead, ``dp`` gets
``max(AUTO_DP_MAX_S, 4 × estimate)`` and ``cpsat`` its default limit. ``InfeasibleError`` from
either solver is a proof and is raised as is. Both solvers are exact, so the race changes how
fast a proof comes, never the optimal objective; which of several optimal splits comes back may
depend on the winner (only ``dp`` breaks bottleneck ties by the least sum of stage times).
``stats["auto"]["race"]`` says who won and when.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from fxsplit.errors import ConfigError, InfeasibleError, SolverError
from fxsplit.ir.downsets import DEFAULT_MAX_DOWNSETS
from fxsplit.ir.plan import OPTIMAL_GAP, Plan, evaluate
from fxsplit.ir.problem import Problem
from fxsplit.solvers.cancel import Cancel
from fxsplit.solvers.dp import one_stage_optimum, solve_dp
from fxsplit.solvers.dpcore import DPCancelledError, DPTimeoutError
from fxsplit.solvers.estimate import estimate_dp
from fxsplit.solvers.reduce import solve_reduced
from fxsplit.solvers.relax import memory_bound_error

__all__ = ["AUTO_DP_MAX_S", "AUTO_DP_SHARE", "AUTO_DP_TIME_SHARE", "AUTO_RACE_FROM_S", "solve_auto"]

logger = logging.getLogger(__name__)

AUTO_DP_SHARE = 0.75
"""``auto`` runs ``dp`` (alone or in the race) when its estimate is at most this share of the
limit: the share the DP may use (:data:`AUTO_DP_TIME_SHARE`). The estimate runs high (Llama-7B
bf16 on 8 A100s, 1F1B m=64: 17.5 s estimated, 9.3 s alone); at 0.5 of a 30 s limit that
problem went to ``cpsat`` alone, which ended ``feasible`` after 30 s, where the race proves the
optimum in 11 s. A race costs ``cpsat`` nothing but a shared core, so racing on a high estimate
is safe."""
AUTO_DP_TIME_SHARE = 0.75
"""Share of the time limit ``dp`` may use (alone, before ``auto`` falls back to ``cpsat``, or in the race)."""
AUTO_DP_MAX_S = 60.0
"""Without a time limit, ``auto`` runs ``dp`` when its estimate is at most this, seconds."""
AUTO_RACE_FROM_S = 1.0
"""``auto`` races ``dp`` against ``cpsat`` when the DP's estimate is above this, seconds."""


def solve_auto(problem: Problem, *, time_limit_s: float | None = None,
               max_downsets: int = DEFAULT_MAX_DOWNSETS, race: bool = True, **opts: Any) -> Plan:
    """``dp``, a race of ``dp`` and ``cpsat``, or ``cpsat``, by the DP's estimated work.

    See the module docstring for the policy. ``opts`` go to ``cpsat``. ``race=False``: ``dp``
    alone wherever the policy would race (then ``cpsat`` with the time left after a DP
    time-out), for problems where memory binds so hard that CP-SAT, with no hint, is unlikely
    to finish first (the schedule search's, when no split along the block order fits).

    Raises:
        InfeasibleError: when a solver or the memory bound proves that no split fits.
        SolverError: when neither solver finds a plan in time.
    """
    start = time.perf_counter()
    err = memory_bound_error(problem)
    if err is not None:
        raise err
    if (one := one_stage_optimum(problem)) is not None:  # proven without a search
        return one
    # a plan hint names the original blocks: the reduced problem is solved without it
    reduced_opts = {k: v for k, v in opts.items() if not (k == "hint" and isinstance(v, Plan))}
    lifted = solve_reduced(problem, lambda pb: solve_auto(
        pb, time_limit_s=None if time_limit_s is None else max(0.01, time_limit_s - (time.perf_counter() - start)),
        max_downsets=max_downsets, race=race, **reduced_opts))
    if lifted is not None:
        return lifted.with_(solve_time_s=time.perf_counter() - start)
    est = estimate_dp(problem, max_downsets)
    budget = AUTO_DP_MAX_S if time_limit_s is None else AUTO_DP_SHARE * time_limit_s
    dp_limit = (max(AUTO_DP_MAX_S, 4 * est.seconds) if time_limit_s is None
                else AUTO_DP_TIME_SHARE * time_limit_s)
    cp_limit = time_limit_s  # None: cpsat's default (its module is imported only when cpsat runs)
    auto: dict[str, Any] = {"dp_estimate_s": est.seconds, "downsets": est.downsets, "dp_timed_out": False}
    dp_plan: Plan | None = None  # the DP's plan when its time ran out with one
    if est.seconds <= (min(budget, AUTO_RACE_FROM_S) if race else budget):
        logger.info("auto: dp (estimate %.3g s, %s downsets)", est.seconds, est.downsets)
        try:
            dp_plan = solve_dp(problem, time_limit_s=dp_limit, max_downsets=max_downsets)
        except DPTimeoutError as exc:
            logger.info("auto: %s; falling back to cpsat", exc)
            opts.setdefault("hint", "greedy")
            auto["dp_timed_out"] = True
        else:
            if not dp_plan.stats.get("timed_out"):
                return dp_plan
            logger.info("auto: dp ran out of time with a feasible plan (gap %.2g); cpsat takes the rest", dp_plan.gap)
            auto["dp_timed_out"] = True
            opts["hint"] = _better_hint(problem, dp_plan, opts.get("hint"))
    elif est.seconds <= budget:
        logger.info("auto: dp races cpsat (dp estimate %.3g s, %s downsets)", est.seconds, est.downsets)
        return _race(problem, dp_limit, cp_limit, max_downsets, opts, auto)
    else:
        logger.info("auto: cpsat (dp estimate %.3g s > %.3g s, %s downsets)", est.seconds, budget, est.downsets)
    from fxsplit.solvers.cpsat import solve_cpsat

    left = None if time_limit_s is None else max(0.01, time_limit_s - (time.perf_counter() - start))
    try:
        plan = solve_cpsat(problem, time_limit_s=left, **opts)
    except SolverError:
        if dp_plan is None:
            raise
        return dp_plan.with_(stats={**dp_plan.stats, "auto": auto})
    if dp_plan is not None:
        plan, _ = _combined(dp_plan, plan)
    return plan.with_(stats={**plan.stats, "auto": auto})


def _better_hint(problem: Problem, dp_plan: Plan, hint: Any) -> Plan:
    """The plan CP-SAT starts from after the DP ran out of time: the DP's, or the caller's hint
    plan where that one costs less on ``problem``."""
    if isinstance(hint, Plan):
        try:
            theirs = evaluate(problem, [list(st.blocks) for st in hint.stages], [st.device for st in hint.stages])
        except (ConfigError, ValueError, IndexError):  # a hint for another problem: not used
            return dp_plan
        if theirs.objective_s < dp_plan.objective_s:
            return hint
    return dp_plan


def _combined(dp_plan: Plan, other: Plan | None) -> tuple[Plan, bool]:
    """The DP's plan cut short and another solver's: the cheaper (the other's also when it is
    proven optimal at the same cost), with the higher of the two proven bounds, ``optimal`` when
    that closes the gap to :data:`~fxsplit.ir.plan.OPTIMAL_GAP`; and whether the other's
    plan was taken."""
    if other is None:
        return dp_plan, False
    take = other.objective_s < dp_plan.objective_s or (
        other.status == "optimal" and other.objective_s <= dp_plan.objective_s)
    best = other if take else dp_plan
    bound = min(max(other.lower_bound_s, dp_plan.lower_bound_s), best.objective_s)
    best = best.with_(lower_bound_s=bound)
    if best.status != "optimal" and best.gap <= OPTIMAL_GAP:
        best = best.with_(status="optimal", lower_bound_s=best.objective_s)
    return best, take


def _race(problem: Problem, dp_limit_s: float, cp_limit_s: float | None, max_downsets: int, opts: dict[str, Any],
          auto: dict[str, Any]) -> Plan:
    """``dp`` here and ``cpsat`` in a thread; the first proof stops the other (module docstring).

    CP-SAT is hinted by ``greedy`` unless ``opts`` hands it a plan (a ``dp`` hint would run the
    DP twice). Any exception here (Ctrl-C included) stops CP-SAT before it propagates."""
    from fxsplit.solvers.cpsat import solve_cpsat

    start = time.perf_counter()
    stop_dp, stop_cp = Cancel(), Cancel()
    cp_opts = {**opts, "hint": opts["hint"] if isinstance(opts.get("hint"), Plan) else "greedy"}
    box: dict[str, Any] = {}

    def run_cpsat() -> None:
        try:
            plan = solve_cpsat(problem, time_limit_s=cp_limit_s, cancel=stop_cp, **cp_opts)
            box["plan"], box["cpsat_s"] = plan, time.perf_counter() - start
            if plan.status == "optimal":
                stop_dp.set()
        except InfeasibleError as exc:  # a proof too
            box["error"], box["cpsat_s"] = exc, time.perf_counter() - start
            stop_dp.set()
        except Exception as exc:  # noqa: BLE001 - handed to the calling thread
            box["error"], box["cpsat_s"] = exc, time.perf_counter() - start

    thread = threading.Thread(target=run_cpsat, name="fxsplit-auto-cpsat", daemon=True)
    thread.start()
    try:
        try:
            plan = solve_dp(problem, time_limit_s=dp_limit_s, max_downsets=max_downsets, cancel=stop_dp)
        except DPTimeoutError as exc:  # stopped (cpsat proved first) or out of time: cpsat's answer
            thread.join()
            dp = "stopped" if isinstance(exc, DPCancelledError) else "timed out"
            auto = {**auto, "dp_timed_out": dp == "timed out",
                    "race": {"winner": "cpsat", "cpsat_s": box["cpsat_s"], "dp": dp}}
            if "error" in box:
                raise box["error"] from None
            cp: Plan = box["plan"]
            return cp.with_(stats={**cp.stats, "auto": auto})
        dp_s = time.perf_counter() - start
        if plan.status == "optimal":
            stop_cp.set()
        thread.join()
    except BaseException:
        stop_cp.set()
        thread.join()
        raise
    other: Plan | None = box.get("plan")
    race = {"winner": "dp", "dp_s": dp_s, "cpsat": "stopped" if plan.status == "optimal" else "finished"}
    if plan.status != "optimal":  # the DP's sweep was cut short: CP-SAT's plan where better or proven
        plan, took = _combined(plan, other)
        if took:
            race["winner"] = "cpsat"
    return plan.with_(stats={**plan.stats, "auto": {**auto, "race": race}})
