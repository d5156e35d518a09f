"""Which knobs make a big model fit, and what they cost: plans with each knob off and on.

Issue 13's bench, first knob: activation recomputation. The problem is the Llama-70B-shaped one
of ``tests/data/llama70b-32xa100.problem.json.gz`` (captured on meta by
``bench/planning_memory.py``: 2249 blocks, 32 A100-80GB, 8 micro-batches of 1 x 2048 tokens,
fp32 weights with Adam state, analytic A100 costs). For each schedule and each ``recompute``
mode, ``solve(..., "auto")`` plans it; the table gives the step the plan predicts (the
schedule's simulated makespan), the bottleneck stage per micro-batch, the most memory a device
needs, how many stages recompute, the solver's status and gap, and the seconds it took. Beside
them, data parallelism over the same devices, plain and with ZeRO-1 optimizer sharding
(:mod:`fxsplit.solvers.data_parallel`: an estimate kind to it, all-reduce hidden by backward).

Run: ``python bench/explore.py [--time-limit 60] [--schedules gpipe,1f1b] [--markdown]``.
"""

from __future__ import annotations

import argparse
import gzip
import os
import time
from pathlib import Path

from common import console, show
from rich.table import Table

from fxsplit.errors import InfeasibleError, SolverError
from fxsplit.ir import Problem
from fxsplit.schedule import plan_step_s
from fxsplit.solvers import solve
from fxsplit.solvers.data_parallel import data_parallel

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "llama70b-32xa100.problem.json.gz"
GiB = 2.0**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per plan")
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--modes", default="none,auto,all")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    base = Problem.from_json(gzip.decompress(DATA.read_bytes()).decode())
    load_before = os.getloadavg()
    table = Table(title=f"Llama-70B shape ({len(base.graph)} blocks) over {base.num_devices} x "
                        f"{base.devices[0].name.split(':')[0]}, m={base.microbatches}, fp32 + Adam; "
                        f"load average {load_before[0]:.2f} at the start")
    for col in ("schedule", "recompute", "plan", "step s (predicted)", "bottleneck s/mb", "max memory GiB",
                "stages recomputing", "solver", "gap", "solve s"):
        table.add_column(col, justify="left" if col in ("schedule", "recompute", "plan", "solver") else "right")
    for schedule in args.schedules.split(","):
        for mode in args.modes.split(","):
            problem = base.with_(schedule=schedule, recompute=mode).check()
            start = time.perf_counter()
            try:
                plan = solve(problem, "auto", time_limit_s=args.time_limit)
            except (InfeasibleError, SolverError) as exc:
                proven = isinstance(exc, InfeasibleError)
                table.add_row(schedule, mode, "infeasible (proven)" if proven else "none found", "-", "-", "-", "-",
                              "-", "-", f"{time.perf_counter() - start:.1f}")
                continue
            took = time.perf_counter() - start
            step = plan_step_s(plan)
            table.add_row(schedule, mode, f"{plan.num_stages} stages", f"{step:.3f}", f"{plan.bottleneck_s:.4f}",
                          f"{max(st.memory_bytes for st in plan.stages) / GiB:.1f}",
                          str(sum(st.recompute for st in plan.stages)), f"{plan.solver} ({plan.status})",
                          f"{plan.gap:.1%}", f"{took:.1f}")
    for zero in (0, 1):  # the baselines: the whole model on every device (ZeRO-1: optimizer state sharded)
        dp = data_parallel(base, zero_stage=zero)
        table.add_row("data parallel" + (" + ZeRO-1" if zero else ""), "none",
                      "fits" if dp.fits else "does not fit", f"{dp.step_s:.3f}", "-",
                      f"{dp.memory_bytes / GiB:.1f}", "-", "estimate", "-", "0.0")
    table.caption = f"load average {os.getloadavg()[0]:.2f} at the end"
    show(table, console(), args.markdown)


if __name__ == "__main__":
    main()
