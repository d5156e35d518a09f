"""Solvers by name: a Protocol, a registry that refuses duplicates, and :func:`solve`.

Example:
    >>> from fxsplit.ir import CondensedGraph, DeviceSpec, Problem
    >>> pb = Problem(CondensedGraph.chain([3.0, 1.0, 1.0, 1.0]), (DeviceSpec("a"), DeviceSpec("b")))
    >>> solve(pb, "dp").bottleneck_s
    3.0
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from fxsplit.errors import SolverError
from fxsplit.ir.plan import Plan
from fxsplit.ir.problem import Problem
from fxsplit.solvers import baselines
from fxsplit.solvers.auto import solve_auto
from fxsplit.solvers.dp import solve_dp
from fxsplit.solvers.looped import solve_looped

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
]

logger = logging.getLogger(__name__)


@runtime_checkable
class Solver(Protocol):
    """Splits a problem into pipeline stages.

    ``solve`` returns a :class:`Plan` built with :func:`fxsplit.ir.evaluate` (valid for
    ``problem``), with ``status`` ``"optimal"`` only when it proved the optimum.
    """

    @property
    def name(self) -> str:
        """Registry name."""
        ...

    def solve(self, problem: Problem, *, time_limit_s: float | None = None, **opts: Any) -> Plan:
        """Return the plan; raise ``InfeasibleError`` when none fits."""
        ...


@dataclass(frozen=True)
class FunctionSolver:
    """A :class:`Solver` from a function ``fn(problem, *, time_limit_s=None, **opts) -> Plan``.

    Args:
        name: Registry name.
        fn: The solver function.
        exact: True when the solver proves optimality.
        summary: One line for ``fxsplit solve --help`` and tables.
    """

    name: str
    fn: Callable[..., Plan]
    exact: bool = False
    summary: str = ""

    def solve(self, problem: Problem, *, time_limit_s: float | None = None, **opts: Any) -> Plan:
        return self.fn(problem, time_limit_s=time_limit_s, **opts)


class SolverRegistry:
    """Solvers by name; registering a name twice raises :class:`SolverError`."""

    def __init__(self) -> None:
        self._solvers: dict[str, Solver] = {}

    def register(self, solver: Solver) -> Solver:
        """Add ``solver`` under ``solver.name``; return it (usable as a decorator's result).

        Raises:
            SolverError: when the name is taken or the object is not a :class:`Solver`.
        """
        if not isinstance(solver, Solver):
            raise SolverError(f"{solver!r} is not a Solver: it needs a 'name' and a 'solve' method")
        if solver.name in self._solvers:
            raise SolverError(
                f"a solver named {solver.name!r} is already registered "
                f"({self._solvers[solver.name]!r}); pick another name"
            )
        self._solvers[solver.name] = solver
        return solver

    def get(self, name: str) -> Solver:
        """The solver called ``name``.

        Raises:
            SolverError: for an unknown name, listing the known ones.
        """
        if name not in self._solvers:
            raise SolverError(f"unknown solver {name!r}; available: {', '.join(self.names())}")
        return self._solvers[name]

    def names(self) -> list[str]:
        return sorted(self._solvers)

    def __contains__(self, name: object) -> bool:
        return name in self._solvers


def _cpsat(problem: Problem, **opts: Any) -> Plan:
    from fxsplit.solvers.cpsat import solve_cpsat

    return solve_cpsat(problem, **opts)


REGISTRY = SolverRegistry()
for _solver in (
    FunctionSolver("dp", solve_dp, True, "exact DP over downsets x devices (Tarnawski et al. 2020)"),
    FunctionSolver("cpsat", _cpsat, True, "exact OR-Tools CP-SAT model; bound and incumbent on time-out"),
    FunctionSolver("auto", solve_auto, True,
                   "dp where it is quick, dp racing cpsat where it may not be, else cpsat"),
    FunctionSolver("uniform", baselines.solve_uniform, False, "equal numbers of blocks per stage"),
    FunctionSolver("params", baselines.solve_params, False, "balanced parameter bytes (DeepSpeed)"),
    FunctionSolver("blockpartition", baselines.solve_blockpartition, False,
                   "torchgpipe balance_by_time (Barany-Grinberg)"),
    FunctionSolver("greedy", baselines.solve_greedy, False, "speed- and memory-aware greedy fill"),
):
    REGISTRY.register(_solver)


def register_solver(solver: Solver) -> Solver:
    """Add ``solver`` to the default registry (see :meth:`SolverRegistry.register`)."""
    return REGISTRY.register(solver)


def get_solver(name: str) -> Solver:
    """The solver called ``name`` in the default registry."""
    return REGISTRY.get(name)


def is_exact(name: str) -> bool:
    """Whether the solver called ``name`` proves optimality (registered as a
    :class:`FunctionSolver` with ``exact=True``; any other :class:`Solver` counts as a heuristic).

    Raises:
        SolverError: for an unknown name.
    """
    chosen = get_solver(name)
    return isinstance(chosen, FunctionSolver) and chosen.exact


def available_solvers() -> list[str]:
    """Names in the default registry, sorted."""
    return REGISTRY.names()


def solve(problem: Problem, solver: str = "auto", *, time_limit_s: float | None = None,
          registry: SolverRegistry | None = None, **opts: Any) -> Plan:
    """Split ``problem`` with the named solver and return a validated plan.

    Args:
        problem: The problem (checked first). With ``stages_per_device > 1`` the split is
            solved as a pipeline of chunks (:func:`fxsplit.solvers.looped.solve_looped`).
        solver: Registry name: ``auto``, ``dp``, ``cpsat``, ``uniform``, ``params``,
            ``blockpartition``, ``greedy`` or one you registered.
        time_limit_s: Wall-clock limit passed to the solver, seconds.
        registry: Where to look the name up; default :data:`REGISTRY`.
        **opts: Solver options (``dp``: ``max_downsets``, ``tie_break``; ``cpsat``:
            ``num_workers``, ``seed``, ``hint``, ``time_quantum_s``).

    Returns:
        The plan, with ``solve_time_s`` the wall time of this call.

    Raises:
        ConfigError: for an invalid problem.
        SolverError: for an unknown solver name or a solver failure.
        InfeasibleError: when no split fits (stage, device, overflow and fixes in the message).
        PlanError: when the solver returned an invalid plan (a bug in that solver).
    """
    start = time.perf_counter()
    problem.check()
    chosen = (registry or REGISTRY).get(solver)
    if problem.stages_per_device > 1:  # several stages per device: solved as a pipeline of chunks
        plan = solve_looped(problem, chosen.solve, time_limit_s=time_limit_s, **opts)
    else:
        plan = chosen.solve(problem, time_limit_s=time_limit_s, **opts)
    plan = plan.with_(solve_time_s=time.perf_counter() - start)
    return plan.check(problem)
