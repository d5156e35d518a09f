"""Interleaved 1F1B and zero-bubble against 1F1B and GPipe: predicted and measured, on 2 CPU "devices" that overlap.

The local pipeline's ``executor="threads"`` runs one worker thread per device; with one intra-op
thread each (``torch.set_num_threads(1)``) the two devices of this 2-core machine compute at the
same time, so a schedule's bubble shows in the wall time. For each schedule the split is planned
by fxsplit (profiled cost model, same micro-batch count), and the variants are measured in
alternating rounds in one process, with the unsplit model (one thread) as the baseline: median step wall, the plan's predicted step
(:func:`fxsplit.schedule.plan_step_s`), and the step simulated on the stage times measured from
the runtime trace (:func:`fxsplit.calibrate.pipelined_step_s`), which separates a wrong cost model
from a runtime that does not overlap as the schedule says.

With ``--ranks 2`` the same comparison runs across 2 processes (``fxsplit.distributed``, gloo over
loopback, 1 thread per rank): rank 0 plans each schedule on its profiled device, both ranks run
the variants in alternating rounds, and the unsplit model runs on rank 0 alone between barriers.

Run: ``python bench/interleaved.py [--model gpt --size small --batch 16 --microbatches 8 --rounds 5]
[--ranks 2]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Any

import torch
from common import console, join_gloo, show, spawn_two
from rich.table import Table

import fxsplit
import fxsplit.models as zoo
from fxsplit.api import CompileOptions
from fxsplit.calibrate import pipelined_step_s, stage_rows
from fxsplit.schedule import plan_step_s

SCHEDULES = ("gpipe", "1f1b", "zero-bubble", "interleaved-1f1b", "interleaved-zero-bubble")


def build(case: Any, kind: str, m: int) -> Any:
    return fxsplit.compile(copy.deepcopy(case.model), ["cpu", "cpu"], case.example_inputs, schedule=kind,
                           microbatches=m, options=CompileOptions(executor="threads"))


def one_round(pipe: Any, case: Any, batch: int, steps: int) -> tuple[list[float], list[Any]]:
    inputs, target = case.make_batch(batch, 0)
    walls, per_step = [], []
    for i in range(steps + 1):
        start = time.perf_counter()
        pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
        if i:
            walls.append(time.perf_counter() - start)
            per_step.append(pipe.recorder.per_stage_s(pipe.num_stages))
    pipe.zero_grad(set_to_none=True)
    return walls, per_step


def eager_round(model: Any, case: Any, batch: int, steps: int) -> list[float]:
    """The unsplit model's forward+backward on the whole batch, one thread."""
    inputs, target = case.make_batch(batch, 0)
    walls = []
    for i in range(steps + 1):
        start = time.perf_counter()
        case.loss_fn(model(*inputs), target).backward()
        if i:
            walls.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return walls


def _dist_worker(rank: int, port: int, queue: Any, args: argparse.Namespace) -> None:
    """Rank ``rank`` of 2: build every schedule's pipeline, alternate their timed rounds with the
    unsplit model's (rank 0), and put rank 0's rows on ``queue``."""
    import torch.distributed as dist

    import fxsplit.distributed as fxd

    join_gloo(rank, port)
    torch.set_num_threads(1)
    case = zoo.get(args.model, size=args.size, batch_size=args.batch)
    pipes = {kind: fxd.compile(lambda: zoo.get(args.model, size=args.size, batch_size=args.batch).model,
                               case.example_inputs, schedule=kind, microbatches=args.microbatches,
                               state_dict=case.model.state_dict())
             for kind in SCHEDULES}
    inputs, target = case.make_batch(args.batch, 0)
    load_before = os.getloadavg()
    walls: dict[str, list[float]] = {k: [] for k in ("eager", *SCHEDULES)}
    traces: dict[str, list[Any]] = {k: [] for k in SCHEDULES}
    for _ in range(args.rounds):
        dist.barrier()
        if rank == 0:
            walls["eager"] += eager_round(case.model, case, args.batch, args.steps)
        dist.barrier()
        for kind, pipe in pipes.items():
            w, t = pipe.timed_steps(*inputs, target=target, loss_fn=case.loss_fn, steps=args.steps)
            pipe.zero_grad(set_to_none=True)
            walls[kind] += w
            traces[kind] += t
    rows = []
    for kind, pipe in pipes.items():
        st = stage_rows(pipe.plan, traces[kind])
        rows.append((kind, pipe.num_stages, pipe.plan.num_ranks, plan_step_s(pipe.plan),
                     pipelined_step_s(st, pipe.microbatches, kind, pipe.plan.num_ranks), statistics.median(walls[kind])))
        pipe.close()
    if rank == 0:
        queue.put({"eager": statistics.median(walls["eager"]), "rows": rows, "load": (load_before[0], os.getloadavg()[0])})
    dist.destroy_process_group()


def main_distributed(args: argparse.Namespace) -> None:
    out = spawn_two(_dist_worker, args)
    table = Table(title=f"{args.model} ({args.size}), batch {args.batch}, m={args.microbatches}, 2 ranks (gloo, loopback) "
                        f"x 1 thread, fxsplit.distributed; load average {out['load'][0]:.2f} before, "
                        f"{out['load'][1]:.2f} after")
    _columns(table)
    base = next(r[5] for r in out["rows"] if r[0] == "1f1b")
    table.add_row("eager (unsplit, 1 thread)", "1 on 1", "", "", f"{out['eager'] * 1e3:.2f}", "",
                  f"{base / out['eager']:.2f}x")
    for kind, stages, ranks, pred, sim, meas in out["rows"]:
        table.add_row(kind, f"{stages} on {ranks}", f"{pred * 1e3:.2f}", f"{sim * 1e3:.2f}", f"{meas * 1e3:.2f}",
                      f"{meas / pred:.2f}", f"{base / meas:.2f}x")
    show(table, console(), args.markdown)


def _columns(table: Table) -> None:
    for col in ("schedule", "stages", "predicted step ms", "simulated on measured stages ms", "measured step ms (median)",
                "measured / predicted", "vs 1f1b (measured)"):
        table.add_column(col, justify="left" if col == "schedule" else "right")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=1,
                        help="1: the local pipeline (threads executor); 2: fxsplit.distributed on 2 gloo ranks")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if args.ranks == 2:
        main_distributed(args)
        return
    torch.set_num_threads(1)
    case = zoo.get(args.model, size=args.size, batch_size=args.batch)
    pipes = {kind: build(case, kind, args.microbatches) for kind in SCHEDULES}
    load_before = os.getloadavg()
    walls: dict[str, list[float]] = {k: [] for k in ("eager", *SCHEDULES)}
    traces: dict[str, list[Any]] = {k: [] for k in SCHEDULES}
    model = copy.deepcopy(case.model)
    for _ in range(args.rounds):  # alternate the variants, round by round
        walls["eager"] += eager_round(model, case, args.batch, args.steps)
        for kind, pipe in pipes.items():
            w, t = one_round(pipe, case, args.batch, args.steps)
            walls[kind] += w
            traces[kind] += t
    load_after = os.getloadavg()
    table = Table(title=f"{args.model} ({args.size}), batch {args.batch}, m={args.microbatches}, 2 CPU devices x 1 thread, "
                        f"threads executor; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    _columns(table)
    base = statistics.median(walls["1f1b"])
    eager = statistics.median(walls["eager"])
    table.add_row("eager (unsplit, 1 thread)", "1 on 1", "", "", f"{eager * 1e3:.2f}", "", f"{base / eager:.2f}x")
    for kind, pipe in pipes.items():
        rows = stage_rows(pipe.plan, traces[kind])
        sim = pipelined_step_s(rows, pipe.microbatches, pipe.schedule_kind, pipe.plan.num_ranks)
        meas = statistics.median(walls[kind])
        pred = plan_step_s(pipe.plan)
        table.add_row(kind, f"{pipe.num_stages} on {pipe.plan.num_ranks}", f"{pred * 1e3:.2f}", f"{sim * 1e3:.2f}",
                      f"{meas * 1e3:.2f}", f"{meas / pred:.2f}", f"{base / meas:.2f}x")
    show(table, console(), args.markdown)


if __name__ == "__main__":
    main()
