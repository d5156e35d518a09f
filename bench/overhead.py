"""Runtime overhead of the local pipeline: ``Pipeline.train_step`` against eager forward+backward.

For each zoo model (``mlp``, ``gpt``, ``resnet``, size ``small``) and one batch, four variants do
the same work, forward and backward of the whole batch with the model's own ``loss_fn`` (no
optimizer step):

- ``eager``: ``model.zero_grad(set_to_none=True); loss_fn(model(*x), y).backward()``;
- ``1 stage, m=1``: ``fxsplit.compile(model, ["cpu"], ..., microbatches=1)``, then
  ``pipe.zero_grad(); pipe.train_step(*x, target=y, loss_fn=loss_fn)``;
- ``2 stages, m=1`` and ``2 stages, m=4``: ``["cpu", "cpu"]``, one stage each, the sequential
  executor (one thread, actions one after another);
- ``eager, m=4``: the eager model on the same 4 micro-batches (``torch.tensor_split``), each loss
  weighted by its share of the batch and back-propagated in turn (gradient accumulation): what
  micro-batching itself costs, without any pipeline;
- ``eager, another copy``: eager again on a second copy of the model, the noise floor (two
  identical steps whose tensors lie elsewhere in memory).

Each variant gets its own copy of the model (``compile`` takes the parameters over), all copies of
the same weights. The variants are interleaved round-robin (the order rotated every repetition),
so a change in the machine's load hits every variant alike. Each step is timed twice: wall clock
(``time.perf_counter``) and the thread's CPU time (``time.thread_time``, which leaves out the time
the thread waits for a core another process holds, the main noise on a shared machine). The table
gives the medians, the ratio of the wall medians to eager's, and the median of the per-repetition
CPU-time ratios, to eager on the whole batch and to eager on the same micro-batches. Targets (issue
9, item 6), judged on the CPU-time ratio to eager on the whole batch: 1 stage within 5 %, 2 stages
within 10 %. Every timing runs with ``torch.set_num_threads(1)``; the load average is printed before
and after.

Run: ``python bench/overhead.py [--quick] [--models mlp,gpt,resnet] [--reps 40] [--markdown]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import console, show
from plan_quality import environment, write_json
from rich.table import Table

import fxsplit
import fxsplit.models as zoo
from fxsplit.api import CompileOptions

# (label, devices, micro-batches, target ratio to eager)
VARIANTS: tuple[tuple[str, int, int, float], ...] = (
    ("1 stage, m=1", 1, 1, 1.05),
    ("2 stages, m=1", 2, 1, 1.10),
    ("2 stages, m=4", 2, 4, 1.10),
)
BATCH = {"mlp": 64, "gpt": 8, "resnet": 16}
# A second eager copy of the same model: how far two identical steps differ here (where their
# tensors lie in memory, cache effects), the noise floor of every ratio in the table.
CONTROL = "eager, another copy"


def build_steps(name: str, batch: int, schedule: str, device: str = "cpu") -> dict[str, Callable[[], Any]]:
    """One ``step()`` per variant on model ``name``, each on its own copy of the same weights, every
    stage on ``device`` (on CUDA each step ends with a synchronisation)."""
    case = zoo.get(name, size="small", batch_size=batch, seed=0)
    x, y = case.make_batch(batch, 1)
    x, y = tuple(t.to(device) for t in x), y.to(device)

    def model() -> torch.nn.Module:
        return copy.deepcopy(case.model).to(device)

    steps: dict[str, Callable[[], Any]] = {"eager": _eager_step(model(), x, y, case.loss_fn, 1),
                                           CONTROL: _eager_step(model(), x, y, case.loss_fn, 1)}
    for m in sorted({m for _, _, m, _ in VARIANTS if m > 1}):
        steps[f"eager, m={m}"] = _eager_step(model(), x, y, case.loss_fn, m)
    for label, p, m, _ in VARIANTS:
        options = CompileOptions(executor="sequential", allow_idle_devices=False, profile_cache_dir=False)
        pipe = fxsplit.compile(model(), [device] * p, case.example_inputs, microbatches=m,
                               schedule=schedule, cost_model="analytic", options=options)
        if pipe.num_stages != p:
            raise RuntimeError(f"{name}: asked for {p} stages, the plan has {pipe.num_stages}")
        steps[label] = _pipe_step(pipe, x, y, case.loss_fn)
    if torch.device(device).type == "cuda":
        steps = {label: _synchronized(step, torch.device(device)) for label, step in steps.items()}
    return steps


def _synchronized(step: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    def run() -> None:
        step()
        torch.cuda.synchronize(device)

    return run


def _eager_step(model: torch.nn.Module, x: Any, y: Any, loss_fn: Any, m: int) -> Callable[[], Any]:
    """Eager forward+backward; with ``m > 1`` on ``m`` micro-batches, losses weighted by size."""
    if m == 1:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            loss_fn(model(*x), y).backward()

        return step
    xs = list(zip(*(torch.tensor_split(t, m) for t in x), strict=True))
    ys, total = torch.tensor_split(y, m), y.shape[0]

    def step_mb() -> None:
        model.zero_grad(set_to_none=True)
        for xi, yi in zip(xs, ys, strict=True):
            (loss_fn(model(*xi), yi) * (yi.shape[0] / total)).backward()

    return step_mb


def _pipe_step(pipe: Any, x: Any, y: Any, loss_fn: Any) -> Callable[[], Any]:
    def step() -> None:
        pipe.zero_grad()
        pipe.train_step(*x, target=y, loss_fn=loss_fn)

    return step


def interleaved(steps: dict[str, Callable[[], Any]], reps: int, warmup: int) -> dict[str, dict[str, list[float]]]:
    """Wall and CPU seconds of each variant's step over ``reps`` round-robin repetitions (order
    rotated each repetition): ``{variant: {"wall": [reps], "cpu": [reps]}}``."""
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in names}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            cpu, wall = time.thread_time(), time.perf_counter()
            steps[name]()
            times[name]["wall"].append(time.perf_counter() - wall)
            times[name]["cpu"].append(time.thread_time() - cpu)
    return times


def summarize(model: str, batch: int, times: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    """One row per variant: medians, ratios to eager on the whole batch and on the same
    micro-batches, the target."""
    eager = times["eager"]
    targets = {label: (target, m) for label, _, m, target in VARIANTS}
    rows = []
    for name, ts in times.items():
        target, m = targets.get(name, (None, 1))
        same = times.get(f"eager, m={m}", eager)
        rows.append({
            "model": model, "batch": batch, "variant": name, "target": target,
            "wall_s": statistics.median(ts["wall"]), "cpu_s": statistics.median(ts["cpu"]),
            "wall_ratio": statistics.median(ts["wall"]) / statistics.median(eager["wall"]),
            "cpu_ratio": _paired(ts["cpu"], eager["cpu"]), "cpu_ratio_same_mb": _paired(ts["cpu"], same["cpu"]),
            "times_s": ts,
        })
    return rows


def _paired(times: list[float], base: list[float]) -> float:
    """Median of the per-repetition ratios ``times[k] / base[k]``."""
    return statistics.median(t / b for t, b in zip(times, base, strict=True))


def table(rows: list[dict[str, Any]], reps: int, schedule: str) -> Table:
    t = Table(title=f"local pipeline overhead: train_step vs eager forward+backward ({schedule}, sequential executor, "
                    f"1 thread, {reps} interleaved repetitions; ratios: CPU time, paired)")
    for col in ("model", "batch", "variant", "wall ms", "CPU ms", "wall vs eager", "CPU vs eager",
                "CPU vs eager, same micro-batches", "target", "met"):
        t.add_column(col, justify="left" if col in ("model", "variant") else "right")
    for r in rows:
        target = r["target"]
        met = "-" if target is None else ("yes" if r["cpu_ratio"] <= target else "no")
        t.add_row(r["model"], str(r["batch"]), r["variant"], f"{r['wall_s'] * 1e3:.2f}", f"{r['cpu_s'] * 1e3:.2f}",
                  f"{r['wall_ratio']:.3f}", f"{r['cpu_ratio']:.3f}",
                  f"{r['cpu_ratio_same_mb']:.3f}" if target is not None else "-",
                  "-" if target is None else f"<= {target:.2f}", met)
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the mlp only, 3 repetitions (smoke test)")
    parser.add_argument("--models", default="mlp,gpt,resnet", help="comma-separated zoo names")
    parser.add_argument("--reps", type=int, default=40, help="interleaved repetitions per model")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    parser.add_argument("--device", default="cpu", help="where every stage and the eager model run (cpu, cuda:0)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.quick:
        args.models, args.reps, args.warmup = "mlp", 3, 1
    torch.set_num_threads(1)
    out = console()
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        with out.status(f"{name}: compiling and timing ..."):
            steps = build_steps(name, BATCH[name], args.schedule, args.device)
            rows += summarize(name, BATCH[name], interleaved(steps, args.reps, args.warmup))
    load_after = os.getloadavg()
    show(table(rows, args.reps, args.schedule), out, args.markdown)
    out.print(f"load average (1, 5, 15 min) before {tuple(round(v, 2) for v in load_before)}, "
              f"after {tuple(round(v, 2) for v in load_after)}; {os.cpu_count()} cores; device {args.device}"
              + (f" ({torch.cuda.get_device_name(torch.device(args.device))})" if "cuda" in args.device else ""))
    path = write_json(args.out, "overhead", {"env": environment(), "args": {k: v for k, v in vars(args).items() if k != "out"},
                                              "load": [load_before, load_after], "rows": rows})
    out.print(f"wrote {path}")


if __name__ == "__main__":
    main()
