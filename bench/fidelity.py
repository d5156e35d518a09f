"""Does the cost model come true? Predicted vs measured forward+backward time of every stage.

For each model: capture, annotate with a cost model on this CPU (1 thread; default the
*profiled* one, which times every node at the micro-batch sizes the schedule search considers and
fits ``t0 + t1 * b``), plan with a fixed stage count, schedule and micro-batch count, build the
local pipeline, train a few steps and read the runtime trace (``pipe.recorder``): the mean
forward and backward time of each stage per micro-batch, against the plan's ``fwd_s`` /
``bwd_s``. Ratios are measured/predicted.

Two step-level errors: (1) the local pipeline runs every action in turn, so its wall step should be
``m x sum of stage compute`` as predicted; (2) the simulated pipelined step with the plan's stage
costs against the same simulation fed with the measured stage costs (what 1 device per stage
would see, communication aside).

Run: ``python bench/fidelity.py [--quick] [--steps 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from common import console, show
from plan_quality import environment, write_json
from rich.table import Table

import fxsplit.models as zoo
from fxsplit.api import CompileOptions
from fxsplit.compiler import assemble, front_end, plan_pipeline
from fxsplit.ir import LinkSpec, Problem
from fxsplit.passes.costs import measure_cpu_spec
from fxsplit.schedule import simulate

# (name, zoo model, size, overrides, stages, micro-batches, batch)
CASES = [
    ("mlp-small", "mlp", "small", {}, 2, 4, 32),
    ("mlp-small", "mlp", "small", {}, 4, 8, 32),
    ("gpt-small", "gpt", "small", {}, 4, 4, 8),
    ("resnet-small", "resnet", "small", {}, 2, 4, 8),
]
QUICK = [("mlp-tiny", "mlp", "tiny", {}, 2, 2, 4)]


def run_case(name: str, model: str, size: str, overrides: dict, p: int, m: int, batch: int,
             steps: int, schedule: str, cost_model: str) -> dict[str, Any]:
    """Plan, build, train ``steps`` steps; per-stage predicted and measured times."""
    case = zoo.get(model, size=size, batch_size=batch, **overrides)
    options = CompileOptions(allow_idle_devices=False, profile_cache_dir=False)
    cpu = measure_cpu_spec()
    specs = tuple(cpu.with_(name=f"cpu#{i}") for i in range(p))
    start = time.perf_counter()
    captured, condensed, _ = front_end(case.model, tuple(case.example_inputs), {}, specs[0], cost_model, options)
    problem = Problem(condensed.graph, specs, LinkSpec(), allow_idle_devices=False).check()
    plan = plan_pipeline(problem, batch, m, schedule, "auto", options).plan
    pipe = assemble(case.model, captured, plan, specs, schedule, m, options)
    plan_s = time.perf_counter() - start
    x, y = case.make_batch(batch, 1)
    per_step, walls = [], []
    for i in range(steps + 1):
        pipe.zero_grad()
        t0 = time.perf_counter()
        pipe.train_step(*x, target=y, loss_fn=case.loss_fn)
        if i:  # the first step warms up
            walls.append(time.perf_counter() - t0)
            per_step.append(pipe.recorder.per_stage_s(p))
    measured = [{k: statistics.mean(s[st][k] for s in per_step) for k in ("fwd_s", "bwd_s")} for st in range(p)]
    stages = [{"stage": s, "blocks": len(st.blocks), "pred_fwd_s": st.fwd_s, "pred_bwd_s": st.bwd_s,
               "meas_fwd_s": measured[s]["fwd_s"], "meas_bwd_s": measured[s]["bwd_s"]}
              for s, st in enumerate(plan.stages)]
    sim_pred = _simulate(pipe, [(r["pred_fwd_s"], r["pred_bwd_s"]) for r in stages])
    sim_meas = _simulate(pipe, [(r["meas_fwd_s"], r["meas_bwd_s"]) for r in stages])
    return {"name": name, "cost_model": cost_model, "stages": p, "microbatches": m, "batch": batch, "schedule": schedule, "plan_s": plan_s,
            "per_stage": stages, "pred_serial_s": m * sum(st.compute_s for st in plan.stages),
            "meas_wall_s": statistics.median(walls), "sim_pred_s": sim_pred, "sim_meas_s": sim_meas}


def _simulate(pipe: Any, costs: list[tuple[float, float]]) -> float:
    return simulate(pipe.schedule, [f for f, _ in costs], [b for _, b in costs]).makespan_s


def stage_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="per stage, per micro-batch: predicted (measured cost model) vs measured (runtime trace), ms")
    for col in ("model", "p x m", "stage", "blocks", "pred F", "meas F", "F ratio", "pred B", "meas B", "B ratio",
                "pred F+B", "meas F+B", "F+B ratio"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        for s in r["per_stage"]:
            pf, pb, mf, mb = s["pred_fwd_s"], s["pred_bwd_s"], s["meas_fwd_s"], s["meas_bwd_s"]
            t.add_row(r["name"], f"{r['stages']} x {r['microbatches']}", str(s["stage"]), str(s["blocks"]),
                      f"{pf * 1e3:.3f}", f"{mf * 1e3:.3f}", _ratio(mf, pf), f"{pb * 1e3:.3f}", f"{mb * 1e3:.3f}",
                      _ratio(mb, pb), f"{(pf + pb) * 1e3:.3f}", f"{(mf + mb) * 1e3:.3f}", _ratio(mf + mb, pf + pb))
    return t


def step_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="step time: predicted vs measured (error = predicted / measured - 1)")
    for col in ("model", "p x m", "pred serial ms", "meas wall ms", "error", "sim (pred costs) ms",
                "sim (meas costs) ms", "error"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        t.add_row(r["name"], f"{r['stages']} x {r['microbatches']}", f"{r['pred_serial_s'] * 1e3:.2f}",
                  f"{r['meas_wall_s'] * 1e3:.2f}", f"{r['pred_serial_s'] / r['meas_wall_s'] - 1:+.1%}",
                  f"{r['sim_pred_s'] * 1e3:.2f}", f"{r['sim_meas_s'] * 1e3:.2f}",
                  f"{r['sim_pred_s'] / r['sim_meas_s'] - 1:+.1%}")
    return t


def _ratio(measured: float, predicted: float) -> str:
    return f"{measured / predicted:.2f}" if predicted > 0 else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one tiny model, 2 steps")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    parser.add_argument("--cost-model", choices=("profiled", "measured", "analytic"), default="profiled")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = console()
    rows = []
    for name, model, size, overrides, p, m, batch in QUICK if args.quick else CASES:
        with out.status(f"{name}: {p} stages, {m} micro-batches ..."):
            rows.append(run_case(name, model, size, overrides, p, m, batch, 2 if args.quick else args.steps, args.schedule,
                                 args.cost_model))
    show(stage_table(rows), out, args.markdown)
    show(step_table(rows), out, args.markdown)
    path = write_json(args.out, "fidelity", {"env": environment(), "threads": 1, "rows": rows})
    out.print(f"wrote {path}")


if __name__ == "__main__":
    main()
