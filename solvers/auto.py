"""``auto``: the exact DP when its estimated work fits the time, CP-SAT otherwise or after it.

Picking by the number of downsets alone misjudges the DP: its work grows with the downset pairs
× the moves of the layout (a 70B Llama with 6485 downsets but 32 devices and 1F1B memory needs
528 moves and minutes), so ``auto`` asks :func:`fxsplit.solvers.estimate.estimate_dp`.

Policy of :func:`solve_auto` with a time limit ``T``:

1. ``dp`` when the graph has at most ``max_downsets`` downsets and the estimate is at most
   ``AUTO_DP_SHARE · T``, with ``AUTO_DP_TIME_SHARE · T`` to finish;
2. if ``dp`` times out (:class:`~fxsplit.solvers.dpcore.DPTimeoutError`), ``cpsat`` with the
   remaining time, hinted by ``greedy`` (not by the DP that just timed out);
3. otherwise ``cpsat`` with all of ``T``.

Before either, the memory bound of :mod:`fxsplit.solvers.relax` runs (infeasibility proven in
microseconds is reported at once, with its arithmetic).

Without a limit, ``dp`` runs when the estimate is at most :data:`AUTO_DP_MAX_S`, with
``max(AUTO_DP_MAX_S, 4 × estimate)`` to finish, then ``cpsat`` with its default limit.
``InfeasibleError`` from either solver is a proof and is raised as is.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fxsplit.ir.downsets import DEFAULT_MAX_DOWNSETS
from fxsplit.ir.plan import Plan
from fxsplit.ir.problem import Problem
from fxsplit.solvers.dp import solve_dp
from fxsplit.solvers.dpcore import DPTimeoutError
from fxsplit.solvers.estimate import estimate_dp
from fxsplit.solvers.relax import memory_bound_error

__all__ = ["AUTO_DP_MAX_S", "AUTO_DP_SHARE", "AUTO_DP_TIME_SHARE", "solve_auto"]

logger = logging.getLogger(__name__)

AUTO_DP_SHARE = 0.5
"""``auto`` picks ``dp`` when its estimate is at most this share of the time limit."""
AUTO_DP_TIME_SHARE = 0.75
"""Share of the time limit ``dp`` may use before ``auto`` falls back to ``cpsat``."""
AUTO_DP_MAX_S = 60.0
"""Without a time limit, ``auto`` picks ``dp`` when its estimate is at most this, seconds."""


def solve_auto(problem: Problem, *, time_limit_s: float | None = None,
               max_downsets: int = DEFAULT_MAX_DOWNSETS, **opts: Any) -> Plan:
    """``dp`` when its estimated work fits the time, else (or when it times out) ``cpsat``.

    See the module docstring for the policy. ``opts`` go to ``cpsat``.

    Raises:
        InfeasibleError: when a solver or the memory bound proves that no split fits.
        SolverError: when neither solver finds a plan in time.
    """
    from fxsplit.solvers.cpsat import DEFAULT_TIME_LIMIT_S, solve_cpsat

    start = time.perf_counter()
    err = memory_bound_error(problem)
    if err is not None:
        raise err
    est = estimate_dp(problem, max_downsets)
    budget = AUTO_DP_MAX_S if time_limit_s is None else AUTO_DP_SHARE * time_limit_s
    tried_dp = est.seconds <= budget
    if tried_dp:
        dp_limit = (max(AUTO_DP_MAX_S, 4 * est.seconds) if time_limit_s is None
                    else AUTO_DP_TIME_SHARE * time_limit_s)
        logger.info("auto: dp (estimate %.3g s <= %.3g s, %s downsets)", est.seconds, budget, est.downsets)
        try:
            return solve_dp(problem, time_limit_s=dp_limit, max_downsets=max_downsets)
        except DPTimeoutError as exc:
            logger.info("auto: %s; falling back to cpsat", exc)
            opts.setdefault("hint", "greedy")
    else:
        logger.info("auto: cpsat (dp estimate %.3g s > %.3g s, %s downsets)", est.seconds, budget, est.downsets)
    left = DEFAULT_TIME_LIMIT_S if time_limit_s is None else time_limit_s - (time.perf_counter() - start)
    plan = solve_cpsat(problem, time_limit_s=max(0.01, left), **opts)
    auto = {"dp_estimate_s": est.seconds, "downsets": est.downsets, "dp_timed_out": tried_dp}
    return plan.with_(stats={**plan.stats, "auto": auto})
