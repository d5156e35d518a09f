"""Torch-free pipeline-split solvers (installed as fxsplit.solvers).

``solve(problem, solver="auto")`` returns a validated :class:`fxsplit.ir.Plan`. Solvers:
``dp`` (exact DP over downsets), ``cpsat`` (exact OR-Tools model, imported on first use),
``auto`` (``dp`` where its estimated work is small, ``dp`` racing ``cpsat`` in two threads
where it fits the time limit, else ``cpsat``: :mod:`fxsplit.solvers.auto`), and the baselines ``uniform``, ``params``,
``blockpartition`` and ``greedy``. ``InfeasibleError`` is raised only with a proof (the DP, CP-SAT,
or the memory bound of :mod:`fxsplit.solvers.relax`); a time-out without a plan is a
``SolverError``.
"""

from fxsplit.solvers.baselines import (
    solve_blockpartition,
    solve_greedy,
    solve_params,
    solve_uniform,
)
from fxsplit.solvers.dp import solve_dp
from fxsplit.solvers.registry import (
    REGISTRY,
    FunctionSolver,
    Solver,
    SolverRegistry,
    available_solvers,
    get_solver,
    is_exact,
    register_solver,
    solve,
    solve_auto,
)

__all__ = [
    "FunctionSolver",
    "REGISTRY",
    "Solver",
    "SolverRegistry",
    "available_solvers",
    "get_solver",
    "is_exact",
    "register_solver",
    "solve",
    "solve_auto",
    "solve_blockpartition",
    "solve_dp",
    "solve_greedy",
    "solve_params",
    "solve_uniform",
]
