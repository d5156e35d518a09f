"""Torch-free pipeline-split solvers (installed as fxsplit.solvers).

``solve(problem, solver="auto")`` returns a validated :class:`fxsplit.ir.Plan`. Solvers:
``dp`` (exact DP over downsets), ``cpsat`` (exact OR-Tools model, imported on first use),
``auto``, and the baselines ``uniform``, ``params``, ``blockpartition`` and ``greedy``.
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
    "register_solver",
    "solve",
    "solve_auto",
    "solve_blockpartition",
    "solve_dp",
    "solve_greedy",
    "solve_params",
    "solve_uniform",
]
