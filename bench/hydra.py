"""Hydra's workload: many models trained at once on CPU workers whose memory budget is smaller than
one model. Makespan of shard parallelism under Sharded-LRTF, FIFO and round-robin, against one
model at a time through an fxsplit pipeline over the same workers (when a pipeline fits the
budget) and one whole model per worker (ignoring the budget), with the simulator's prediction and
the lower bounds. Variants alternate round by round; the machine's load is printed.

Each shard-parallel run's makespan is timed from its first unit to its last (capture and sharding
excluded); a pipeline baseline's from its first training step to the last of its last model
(compile excluded). Every run trains fresh copies of the same models on the same batches.

One untimed warm-up round runs first.

Run: ``python bench/hydra.py [--devices 2 --memory-mib 8 --steps 3 --rounds 3 --threads 1 --recompute]
[--markdown]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Any

import torch
from common import console, show
from rich.table import Table

import fxsplit
import fxsplit.models as zoo
from fxsplit.api import CompileOptions
from fxsplit.errors import InfeasibleError
from fxsplit.multi import Task, train_many

POLICIES = ("lrtf", "fifo", "round-robin")

#: (zoo name, size, overrides, batch size, learning rate): models of different sizes, a small grid
WORKLOAD = [
    ("gpt", "small", {}, 4, 1e-3), ("gpt", "small", {}, 4, 3e-4), ("gpt", "small", {}, 8, 1e-3),
    ("mlp", "small", {"width": 512, "layers": 6}, 32, 1e-3), ("mlp", "small", {"width": 256, "layers": 4}, 32, 1e-3),
    ("gpt", "tiny", {}, 16, 1e-3),
]


def _cases(steps: int) -> list[tuple[str, Any, list[Any], float]]:
    out = []
    for name, size, overrides, bs, lr in WORKLOAD:
        case = zoo.get(name, size=size, batch_size=bs, **overrides)
        data = [case.make_batch(bs, 100 + s) for s in range(steps)]
        label = f"{name}-{size}{'-w' + str(overrides['width']) if overrides else ''} bs={bs} lr={lr:g}"
        out.append((label, case, data, lr))
    return out


def _tasks(cases: list[Any], steps: int) -> list[Task]:
    return [Task(copy.deepcopy(case.model), lambda p, lr=lr: torch.optim.AdamW(p, lr=lr), case.loss_fn, data,
                 steps=steps, name=label) for label, case, data, lr in cases]


def run_shards(cases: list[Any], args: argparse.Namespace, policy: str, budget: int | None) -> Any:
    return train_many(_tasks(cases, args.steps), args.devices, memory_per_device_bytes=budget, scheduler=policy,
                      cost_model=args.cost_model, recompute=args.recompute).report


def run_pipelines(cases: list[Any], args: argparse.Namespace, budget: int | None) -> float | None:
    """One model after another, each through an fxsplit pipeline over the workers (threads
    executor); seconds of training, or None when a model's pipeline does not fit the budget."""
    pipes = []
    for _, case, data, lr in cases:
        model = copy.deepcopy(case.model)
        try:
            pipe = fxsplit.compile(model, ["cpu"] * args.devices, case.example_inputs, memory_limit_bytes=budget,
                                   cost_model="analytic", options=CompileOptions(executor="threads"))
        except InfeasibleError:
            return None
        pipes.append((pipe, torch.optim.AdamW(list(pipe.parameters()), lr=lr), case, data))
    start = time.perf_counter()
    for pipe, opt, case, data in pipes:
        for inputs, target in data:
            opt.zero_grad(set_to_none=True)
            pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
            opt.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--memory-mib", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (each worker runs ops on them)")
    parser.add_argument("--cost-model", default="profiled")
    parser.add_argument("--recompute", action="store_true", help="shards recompute their forward in backward")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    budget = int(args.memory_mib * 2**20)
    out = console()
    load0 = os.getloadavg()[0]
    cases = _cases(args.steps)
    runs: dict[str, list[Any]] = {p: [] for p in (*POLICIES, "whole")}
    pipeline_s: list[float | None] = []
    unbounded_s: list[float] = []
    fits = run_pipelines(cases, args, budget) is not None  # also the warm-up round, not counted
    for policy in (*POLICIES, "lrtf"):
        run_shards(cases, args, policy, budget if policy != "lrtf" else None)
    for _ in range(args.rounds):
        for policy in POLICIES:
            runs[policy].append(run_shards(cases, args, policy, budget))
        runs["whole"].append(run_shards(cases, args, "lrtf", None))
        pipeline_s.append(run_pipelines(cases, args, budget) if fits else None)
        if not fits:
            unbounded_s.append(run_pipelines(cases, args, None) or 0.0)
    load1 = os.getloadavg()[0]

    first = runs["lrtf"][0]
    models = Table(title=f"workload: {len(cases)} models, AdamW, {args.steps} steps each, "
                         f"budget {args.memory_mib:g} MiB per worker")
    for col in ("model", "state + 1 batch (MiB)", "shards", "final loss"):
        models.add_column(col, justify="left" if col == "model" else "right")
    whole = runs["whole"][0]
    for j, name in enumerate(first.names):
        models.add_row(name, f"{whole.plans[j].stages[0].memory_bytes / 2**20:.1f}", str(first.shards[j]),
                       f"{first.losses[j][-1]:.4f}")
    show(models, out, args.markdown)

    table = Table(title=f"makespan on {args.devices} CPU workers, {args.threads} torch thread(s), median of "
                        f"{args.rounds} alternating rounds",
                  caption=f"load average {load0:.2f} before, {load1:.2f} after, on {os.cpu_count()} cores; "
                          f"predictions from the {args.cost_model} cost model; shards "
                          f"{'recompute' if args.recompute else 'keep their activations'}")
    for col in ("variant", "measured", "simulated", "bound (cost model)", "bound (measured units)",
                "measured / bound", "utilisation", "moved MiB"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for key in (*POLICIES, "whole"):
        reps = runs[key]
        label = {"whole": "one whole model per worker (ignores the budget)"}.get(key, f"shards, {key}")
        mk = statistics.median(r.makespan_s for r in reps)
        bound = statistics.median(r.measured_lower_bound_s for r in reps)
        table.add_row(label, f"{mk:.3f} s", f"{statistics.median(r.predicted.makespan_s for r in reps):.3f} s",
                      f"{statistics.median(r.lower_bound_s for r in reps):.3f} s", f"{bound:.3f} s",
                      f"{mk / bound:.2f}", " ".join(f"{u:.0%}" for u in reps[len(reps) // 2].utilisation),
                      f"{statistics.median(r.moved_bytes for r in reps) / 2**20:.0f}")
    fitted = [s for s in pipeline_s if s is not None]
    table.add_row("one model at a time, fxsplit pipeline", f"{statistics.median(fitted):.3f} s" if fitted
                  else "does not fit", "", "", "", "", "", "")
    if unbounded_s:
        table.add_row("one model at a time, fxsplit pipeline (ignores the budget)",
                      f"{statistics.median(unbounded_s):.3f} s", "", "", "", "", "", "")
    show(table, out, args.markdown)
    if not args.markdown:
        out.print(runs["lrtf"][len(runs["lrtf"]) // 2].gantt(), markup=False, highlight=False)


if __name__ == "__main__":
    main()
