"""What activation recomputation costs and saves, measured: time from the runtime trace, memory
from the tensors autograd keeps.

The cost model (``Problem.recompute``, ALGORITHMS.md) says a stage that recomputes pays its
forward once more in backward and keeps only its inputs per micro-batch in flight. For each model
the same two-stage GPipe pipeline is compiled with ``recompute="none"`` and ``"all"`` (analytic
costs, one thread, sequential executor), trained in alternating rounds, and per stage:

* time: the median backward per micro-batch (trace ``B``) with and without recomputation, their
  difference against the stage's own forward (the model predicts the difference *is* the forward);
* memory: the bytes of the distinct non-parameter tensors autograd saves during a forward of the
  whole batch (``torch.autograd.graph.saved_tensors_hooks``), per micro-batch, against the cost
  model's activations + inputs (none) and inputs (all).

Run: ``python bench/recompute.py [--models gpt,mlp,unet --size small --batch 16 --microbatches 4
--rounds 5 --steps 3] [--markdown]``.
"""

from __future__ import annotations

import copy
import os
import statistics
from typing import Any

import torch
from common import alternate, console, same_split, show, variant_parser
from rich.table import Table

import fxsplit
import fxsplit.models as zoo
from fxsplit.api import CompileOptions

MODES = ("none", "all")


def build(case: Any, mode: str, m: int) -> Any:
    return fxsplit.compile(copy.deepcopy(case.model), ["cpu", "cpu"], case.example_inputs, schedule="gpipe",
                           microbatches=m, cost_model="analytic",
                           options=CompileOptions(executor="sequential", recompute=mode, allow_idle_devices=False))


def saved_bytes(pipe: Any, case: Any, batch: int) -> list[float]:
    """``[num_stages]`` bytes of distinct non-parameter tensors autograd keeps during a forward of
    the whole batch, per micro-batch."""
    inputs, _ = case.make_batch(batch, 0)
    params = {p.untyped_storage().data_ptr() for p in pipe.parameters()}
    per_stage: list[dict[int, int]] = [{} for _ in range(pipe.num_stages)]
    current = [0]
    run_stage = pipe._run_stage

    def tracked(s: int, i: int, values: Any) -> Any:
        current[0] = s
        return run_stage(s, i, values)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            per_stage[current[0]][storage.data_ptr()] = storage.nbytes()
        return t

    pipe._run_stage = tracked
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = pipe(*inputs)
    finally:
        del pipe._run_stage
    del out
    return [sum(kept.values()) / pipe.microbatches for kept in per_stage]


def predicted_bytes(pipe: Any, mode: str) -> list[float]:
    """The cost model's bytes kept per micro-batch in flight of each stage."""
    graph = pipe.plan.graph
    return [st.in_bytes + (0 if mode == "all" else sum(graph.blocks[b].activation_bytes for b in st.blocks))
            for st in pipe.plan.stages]


def main() -> None:
    args = variant_parser(__doc__.splitlines()[0], microbatches=4).parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rows = []
    for name in args.models.split(","):
        case = zoo.get(name, size=args.size, batch_size=args.batch)
        pipes = {mode: build(case, mode, args.microbatches) for mode in MODES}
        same = same_split(pipes["none"], pipes["all"])
        times = alternate(pipes, case, args.batch, args.rounds, args.steps)
        kept = {mode: saved_bytes(pipe, case, args.batch) for mode, pipe in pipes.items()}
        model = {mode: predicted_bytes(pipe, mode) for mode, pipe in pipes.items()}
        for s in range(pipes["none"].num_stages):
            f, b0, b1 = (statistics.median(times[mode][(s, kind)]) for mode, kind in
                         (("none", "F"), ("none", "B"), ("all", "B")))
            rows.append((name, s, same, f, b0, b1, kept["none"][s], kept["all"][s], model["none"][s], model["all"][s]))
    load_after = os.getloadavg()
    table = Table(title=f"activation recomputation, {args.size} models, batch {args.batch}, GPipe m={args.microbatches}, "
                        f"2 stages, 1 thread; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    for col in ("model", "stage", "same split", "F ms", "B ms (none)", "B ms (all)", "(B all - B none) / F",
                "kept MiB/mb (none)", "model", "kept MiB/mb (all)", "model"):
        table.add_column(col, justify="left" if col == "model" and not table.columns else "right")
    mib = 2.0 ** 20
    for name, s, same, f, b0, b1, k0, k1, p0, p1 in rows:
        table.add_row(name, str(s), "yes" if same else "no", f"{f * 1e3:.3f}", f"{b0 * 1e3:.3f}", f"{b1 * 1e3:.3f}",
                      f"{(b1 - b0) / f:.2f}" if f > 0 else "-", f"{k0 / mib:.2f}", f"{p0 / mib:.2f}",
                      f"{k1 / mib:.2f}", f"{p1 / mib:.2f}")
    show(table, console(), args.markdown)


if __name__ == "__main__":
    main()
