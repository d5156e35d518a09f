"""Hybrid meshes on CPU ranks: the search's predicted step against the measured one, mesh by mesh.

Issue 11's bench (measured part). ``world`` gloo processes on this machine, 1 thread each. Every
rank calls ``fxsplit.distributed.compile(parallel="hybrid")``: rank 0 profiles the model at one
micro-batch, solves the per-layer plans and costs every ``[pp, dp, tp]`` mesh of all the ranks
(:func:`fxsplit.solvers.hybrid.plan_hybrid`), and the ranks build the best. Then every other
feasible mesh of the search is built as well (``replicas=dp``, ``tensor_parallel=tp``,
``tp_strategy`` of its family; its pipeline split planned anew), and all of them train in
alternating rounds, every step timed between barriers after zeroing the gradients. The table
gives each mesh's predicted step (the search's) and the measured median, so one sees both how
true the predictions are and whether the mesh the search picked is the fastest that ran.

With more ranks than cores (4 ranks here on 2) every process gets half a core at best, which
the search does not model: read those rows as the ranking they give, not their speed.

Run: ``python bench/hybrid_ranks.py [--ranks 2,4] [--model gpt --size tiny --batch 8
--microbatches 4] [--rounds 3 --steps 3] [--markdown]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import torch
from common import console, join_gloo, show, spawn_ranks
from rich.table import Table

import fxsplit.models as zoo
from fxsplit.api import CompileOptions


def _compile(args: argparse.Namespace, case: Any, **kwargs: Any) -> Any:
    import fxsplit.distributed as fxd

    return fxd.compile(lambda: zoo.get(args.model, size=args.size, batch_size=args.batch).model, case.example_inputs,
                       schedule="1f1b", state_dict=case.model.state_dict(), timeout_s=300.0,
                       options=CompileOptions(allow_idle_devices=False, time_limit_s=30.0), **kwargs)


def _worker(rank: int, port: int, queue: Any, world: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from fxsplit.runtime.trace import barrier_timed_s

    torch.set_num_threads(1)
    join_gloo(rank, port, world)
    try:
        case = zoo.get(args.model, size=args.size, batch_size=args.batch)
        searched = _compile(args, case, microbatches=args.microbatches, parallel="hybrid")
        hybrid = searched.hybrid
        pipes, layouts = {hybrid.best.label: searched}, {hybrid.best.label: hybrid.best}
        for lay in hybrid.layouts:
            if lay.feasible and lay.label not in pipes:
                layouts[lay.label] = lay
                pipes[lay.label] = _compile(args, case, microbatches=args.microbatches // lay.dp, replicas=lay.dp,
                                            tensor_parallel=lay.tp,
                                            tp_strategy="megatron" if lay.family == "megatron" else "auto")
        x, y = case.make_batch(args.batch, 1)
        times: dict[str, list[float]] = {label: [] for label in pipes}
        load_before = os.getloadavg()
        for rnd in range(args.rounds):
            for label, pipe in pipes.items():
                def step(pipe: Any = pipe) -> None:
                    pipe.zero_grad(set_to_none=True)
                    pipe.train_step(*x, target=y, loss_fn=case.loss_fn)

                for i in range(args.steps + (1 if rnd == 0 else 0)):
                    wall = barrier_timed_s(step)
                    if rnd or i:
                        times[label].append(wall)
        if rank == 0:
            queue.put({"world": world, "costs": hybrid.costs, "best": hybrid.best.label, "load": [load_before, os.getloadavg()],
                       "rows": [{"mesh": label, "predicted_s": layouts[label].step_s,
                                 "measured_s": statistics.median(times[label]), "note": layouts[label].note}
                                for label in pipes]})
        for pipe in pipes.values():
            pipe.close()
    finally:
        dist.destroy_process_group()


def table(result: dict[str, Any], args: argparse.Namespace) -> Table:
    t = Table(title=f"{args.model} ({args.size}), batch {args.batch}, {args.microbatches} micro-batches, 1F1B, "
                    f"{result['world']} gloo ranks x 1 thread on {os.cpu_count()} cores: the hybrid search "
                    f"({result['costs']} costs) vs measured")
    for col in ("mesh", "searched pick", "predicted step ms", "measured step ms (median)", "measured / predicted",
                "measured rank", "note"):
        t.add_column(col, justify="left" if col in ("mesh", "note") else "right")
    rows = sorted(result["rows"], key=lambda r: r["predicted_s"])
    by_measured = sorted(r["measured_s"] for r in rows)
    for r in rows:
        t.add_row(r["mesh"], "yes" if r["mesh"] == result["best"] else "", f"{r['predicted_s'] * 1e3:.2f}",
                  f"{r['measured_s'] * 1e3:.2f}", f"{r['measured_s'] / r['predicted_s']:.2f}",
                  str(by_measured.index(r["measured_s"]) + 1), r["note"])
    (l1, _, _), (l2, _, _) = result["load"]
    t.caption = f"load average (1 min) {l1:.2f} before the timed rounds, {l2:.2f} after"
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    out = console()
    for world in (int(w) for w in args.ranks.split(",")):
        with out.status(f"{world} ranks: the search, every feasible mesh built and timed ..."):
            result = spawn_ranks(world, _worker, world, args)
        show(table(result, args), out, args.markdown)


if __name__ == "__main__":
    main()
