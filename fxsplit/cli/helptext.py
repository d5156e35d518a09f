"""Help texts of the options that take a name, built from the vocabularies and the registries.

The closed vocabularies come from :mod:`fxsplit.ir.names`, the solvers from
``fxsplit.solvers.available_solvers()`` and the schedules from ``fxsplit.schedule.available()``,
so ``--help`` lists exactly the names there are.
"""

from __future__ import annotations

from collections.abc import Iterable

from fxsplit.ir.names import COST_MODELS, LOOPED_SCHEDULES, OBJECTIVES, RECOMPUTE, SCHEDULES
from fxsplit.schedule import available as available_schedules
from fxsplit.solvers import available_solvers

__all__ = ["COST_MODEL_HELP", "OBJECTIVE_HELP", "PROBLEM_SCHEDULE_HELP", "RECOMPUTE_HELP", "SCHEDULE_HELP", "SOLVER_HELP",
           "choices"]


def choices(names: Iterable[str]) -> str:
    """The names an option takes, for its help: ``["a", "b", "c"]`` -> ``"a, b or c"``."""
    words = list(names)
    return ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else "".join(words)


#: ``--solver``: every registered solver.
SOLVER_HELP = choices(available_solvers())
#: ``--schedule`` of ``fxsplit compile`` and ``fxsplit plan``: every registered schedule, or auto.
SCHEDULE_HELP = (f"{', '.join(available_schedules())} ({' and '.join(LOOPED_SCHEDULES)}: 2 stages per device), "
                 "or auto")
#: ``--schedule`` of ``fxsplit solve``: the schedules a problem costs (no auto: nothing is explored).
PROBLEM_SCHEDULE_HELP = f"{choices(SCHEDULES)} (default: the problem file's, else 1f1b)"
#: ``--objective``.
OBJECTIVE_HELP = choices(OBJECTIVES)
#: ``--recompute`` (activation recomputation per stage).
RECOMPUTE_HELP = f"activation recomputation per stage: {choices(RECOMPUTE)} (auto: where a stage would not fit otherwise)"
#: ``--cost-model`` where ``auto`` profiles on the devices the model runs on.
COST_MODEL_HELP = f"auto (profiled on these devices), {choices(COST_MODELS)}"
