"""Per-layer plans (PaSE) run with DTensor: predicted against measured step time on CPU ranks.

Every rank (gloo on 127.0.0.1, one thread each) builds the same model and four
:func:`fxsplit.distributed.parallelize` plans of it over all ranks: every rank doing everything
(``replicate``), data parallelism, Megatron's column/row linear layers, and PaSE's pick
(``auto``), and PaSE's pick after ``calibrate`` (the DTensor dispatch per op fitted from 3
measured steps of it and of the replicated plan, re-planned); then times one training step (forward, loss, backward, SGD step) of each in
alternating rounds (a barrier before each), and the unsplit model in one process with one thread
on rank 0 while the others wait. Reported per plan: the planner's predicted step (compute plus
collectives, the strategy graph's cost model on rank 0's measured CPU and the measured gloo
link), the measured median, their ratio, the ops DTensor ran whole, and the largest gradient
difference against the unsplit model (on the first step). "Implied overhead per DTensor op" is
(measured - the replicated plan's measured) / (3 x the ops run on DTensors): what each such op
costs beyond the replicated run, forward once and backward twice (compute included, so an upper
bound of the dispatch).

Run: ``python bench/layers.py [--model gpt --size small --ranks 4 --batch 16 --rounds 5] [--markdown]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Any

import torch
from common import console, free_port, show
from rich.table import Table

PLANS = ("replicate", "data-parallel", "megatron", "auto")


def _rank(rank: int, world: int, port: int, queue: Any, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import fxsplit.distributed as fxd
    from fxsplit.api import load_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    fxd.init_process_group("gloo", 300.0)
    case = load_model(args.model, size=args.size, batch_size=args.batch)
    reference = case.model
    plans = {name: fxd.parallelize(lambda: copy.deepcopy(reference), case.example_inputs, strategy=name)
             for name in PLANS}
    inputs, target = case.make_batch(args.batch, 7)
    calibrated, report = plans["auto"].calibrate(*inputs, target=target, loss_fn=case.loss_fn, steps=3)
    plans["auto, calibrated"] = calibrated
    grad_diff: dict[str, float] = {}
    ref_loss = case.loss_fn(reference(*inputs), target)
    ref_loss.backward()
    ref_grads = dict(reference.named_parameters(remove_duplicate=False))
    for name, pg in plans.items():
        pg.train_step(*inputs, target=target, loss_fn=case.loss_fn)
        grads = pg.grads()
        grad_diff[name] = max(float((grads[n] - p.grad).abs().max()) for n, p in ref_grads.items())
    optimizers = {name: torch.optim.SGD(pg.parameters(), lr=1e-3) for name, pg in plans.items()}
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-3)
    times: dict[str, list[float]] = {name: [] for name in (*plans, "unsplit")}
    for _ in range(args.rounds):
        for name, pg in plans.items():
            dist.barrier()
            start = time.perf_counter()
            optimizers[name].zero_grad(set_to_none=True)
            pg.train_step(*inputs, target=target, loss_fn=case.loss_fn)
            optimizers[name].step()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            ref_opt.zero_grad(set_to_none=True)
            case.loss_fn(reference(*inputs), target).backward()
            ref_opt.step()
            times["unsplit"].append(time.perf_counter() - start)
        dist.barrier()
    if rank == 0:
        queue.put({"times": times, "grad_diff": grad_diff, "calibration": report.__dict__,
                   "plans": {n: (pg.plan.predicted_step_s, dict(pg.plan.baselines), sorted(pg.run_whole | set(pg.fallback)),
                                 dict(sorted(_counts(pg.placements().values()).items())), pg.split_ops)
                             for n, pg in plans.items()}})
    dist.destroy_process_group()


def _counts(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _spawn(args: argparse.Namespace) -> dict[str, Any]:
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(args.ranks, free_port(), queue, args), nprocs=args.ranks, join=True)
    return queue.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--size", default="small")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    result = _spawn(args)
    times = result["times"]
    unsplit = statistics.median(times["unsplit"])
    table = Table(title=f"{args.model} ({args.size}), batch {args.batch}: every layer split over {args.ranks} gloo "
                        f"ranks (1 thread each) on {os.cpu_count()} cores; load {load:.2f} before the run; "
                        f"{args.rounds} alternating rounds")
    for col in ("plan", "parameter placements", "predicted step", "measured step (median)", "measured / predicted",
                "vs unsplit (1 process)", "ops on DTensors", "implied overhead per DTensor op", "ops run whole",
                "grad diff vs unsplit"):
        table.add_column(col, justify="left" if col in ("plan", "parameter placements") else "right")
    for name in result["plans"]:
        predicted, _, whole, counts, split_ops = result["plans"][name]
        measured = statistics.median(times[name])
        extra = (measured - statistics.median(times["replicate"])) / (3 * split_ops) if split_ops else 0.0
        table.add_row(name, ", ".join(f"{k} x{n}" for k, n in counts.items()), f"{predicted * 1e3:.2f} ms",
                      f"{measured * 1e3:.1f} ms", f"{measured / predicted:.1f}x", f"{measured / unsplit:.2f}x",
                      str(split_ops), f"{extra * 1e6:.0f} us" if split_ops else "-", str(len(whole)), f"{result['grad_diff'][name]:.1e}")
    table.add_row("unsplit (rank 0 alone)", "-", "-", f"{unsplit * 1e3:.1f} ms", "-", "1.00x", "-", "-", "-", "-")
    show(table, console(), args.markdown)
    cal = result["calibration"]
    console().print(f"calibrate (auto, 3 steps): fitted {cal['op_overhead_s'] * 1e6:.0f} us per DTensor op; before "
                    f"{cal['before_predicted_s'] * 1e3:.1f} ms predicted / {cal['before_measured_s'] * 1e3:.1f} ms measured, "
                    f"replicated {cal['replicated_predicted_s'] * 1e3:.1f} / {cal['replicated_measured_s'] * 1e3:.1f} ms, "
                    f"after {cal['after_predicted_s'] * 1e3:.1f} / {cal['after_measured_s'] * 1e3:.1f} ms"
                    f"{' (re-planned)' if cal['changed'] else ' (plan kept)'}", markup=False, highlight=False)


if __name__ == "__main__":
    main()
