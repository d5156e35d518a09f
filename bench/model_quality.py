"""Part 2 of ``plan_quality.py``: dp and cpsat against the baselines on real models.

Each model (``model_graphs.MODELS``) is captured once on the meta device; for every device set
the problem is the bottleneck per micro-batch with 8 micro-batches, 1F1B, training memory (Adam)
and 25 GB/s links. A solver that finds no plan within the time limit, or a baseline whose split
does not fit memory, shows ``-`` with the reason in the JSON.
"""

from __future__ import annotations

import math
import time
from typing import Any

from model_graphs import MODELS, QUICK_MODELS, capture_graph, device_set
from rich.console import Console
from rich.table import Table

from fxsplit.errors import FxsplitError
from fxsplit.ir import CondensedGraph, LinkSpec, Problem, trivial_lower_bound
from fxsplit.solvers import solve

EXACT = ["dp", "cpsat"]
BASELINES = ["uniform", "params", "blockpartition", "greedy"]
MICROBATCHES = 8


def _solve(problem: Problem, solver: str, time_limit_s: float) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        opts = {"num_workers": 2} if solver == "cpsat" else {}
        plan = solve(problem, solver, time_limit_s=time_limit_s if solver in EXACT else None, **opts)
    except FxsplitError as exc:
        return {"objective_s": None, "status": type(exc).__name__, "error": str(exc)[:300],
                "seconds": time.perf_counter() - start}
    return {"objective_s": plan.objective_s, "status": plan.status, "lower_bound_s": plan.lower_bound_s,
            "stages": plan.num_stages, "seconds": time.perf_counter() - start}


def quality_row(name: str, graph: CondensedGraph, k: int, hetero: bool, time_limit_s: float) -> dict[str, Any]:
    """Every solver on one model and device set; gaps against the best exact plan."""
    problem = Problem(graph.scaled(1.0 / MICROBATCHES), device_set(k, hetero), link=LinkSpec(),
                      microbatches=MICROBATCHES, schedule="1f1b", objective="bottleneck",
                      device_order="free" if hetero else "fixed").check()
    out: dict[str, Any] = {"model": name, "blocks": len(graph), "devices": k, "hetero": hetero,
                           "trivial_bound_s": trivial_lower_bound(problem)}
    for solver in EXACT + BASELINES:
        out[solver] = _solve(problem, solver, time_limit_s)
    exact = [out[s]["objective_s"] for s in EXACT if out[s]["objective_s"] is not None]
    best = min(exact) if exact else None
    bounds = [out["trivial_bound_s"]] + [out[s].get("lower_bound_s", 0.0) for s in EXACT if out[s]["objective_s"] is not None]
    if out["dp"]["status"] == "optimal":  # dp's optimum is its own bound
        bounds.append(out["dp"]["objective_s"])
    out["best_s"], out["bound_s"] = best, min(max(bounds), best) if best else max(bounds)
    out["gap"] = (best - out["bound_s"]) / best if best else None
    for solver in BASELINES:
        value = out[solver]["objective_s"]
        out[solver]["excess"] = value / best - 1 if value is not None and best else None
    # Two "optimal" answers must agree; flag a disagreement (a solver bug) in the table.
    opt = [out[s]["objective_s"] for s in EXACT if out[s]["status"] == "optimal"]
    out["disagree"] = len(opt) == 2 and not math.isclose(opt[0], opt[1], rel_tol=1e-3)
    return out


def model_rows(quick: bool, ks: tuple[int, ...], time_limit_s: float, console: Console) -> list[dict[str, Any]]:
    """Capture every model and solve every device set; progress on ``console``."""
    rows = []
    for name, (build, description) in (QUICK_MODELS if quick else MODELS).items():
        with console.status(f"capturing {name} on meta ..."):
            graph, capture_s = capture_graph(name, build)
        console.print(f"{name}: {description}, {len(graph)} blocks, captured in {capture_s:.1f} s")
        for hetero in (False, True):
            for k in ks:
                with console.status(f"{name}: {k} devices{' (hetero)' if hetero else ''} ..."):
                    row = quality_row(name, graph, k, hetero, time_limit_s)
                row["capture_s"], row["description"] = capture_s, description
                rows.append(row)
    return rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.3f}"


def _exact_cell(r: dict[str, Any]) -> str:
    if r["objective_s"] is None:
        return "-" if r["status"] != "SolverError" else "timeout"
    return f"{r['objective_s'] * 1e3:.3f}{'' if r['status'] == 'optimal' else '*'}"


def model_table(rows: list[dict[str, Any]]) -> Table:
    """The rich table of :func:`model_rows`."""
    table = Table(title=f"bottleneck per micro-batch (ms, {MICROBATCHES} micro-batches, 1F1B); "
                        "* = not proven optimal; baselines: % above the best exact plan")
    for col in ("model", "blocks", "k", "devices", "bound", "dp", "dp s", "cpsat", "cpsat s", "gap", *BASELINES):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["model"], str(r["blocks"]), str(r["devices"]), "het" if r["hetero"] else "same",
            _ms(r["bound_s"]), _exact_cell(r["dp"]), f"{r['dp']['seconds']:.2f}",
            _exact_cell(r["cpsat"]) + (" !" if r["disagree"] else ""), f"{r['cpsat']['seconds']:.2f}",
            "-" if r["gap"] is None else f"{r['gap']:.1%}",
            *("-" if r[b]["excess"] is None else f"{r[b]['excess']:+.1%}" for b in BASELINES),
        )
    table.caption = "'-' for a baseline: its split does not fit memory; '!': cpsat and dp both claim optimal but differ"
    return table
