"""What a zero-bubble schedule's split backward costs: the whole backward (B) against its input and
weight halves (I, then W later), per stage, measured from the runtime trace.

Zero-bubble schedules (Qi et al., ICLR 2024) win their bubble back only if ``I + W`` costs about
what ``B`` costs. fxsplit splits a stage's backward with torch's own ``stage_backward_input`` /
``stage_backward_weight``; this bench measures the price on this machine. For each model the same
split runs under 1F1B and under zero-bubble (local pipeline, one thread, sequential executor),
in alternating rounds; each stage's median B, I and W per micro-batch come from the runtime trace.
The first stage has no input gradient to compute, so its W is its whole backward.

Run: ``python bench/split_backward.py [--models gpt,mlp --size small --batch 16 --microbatches 8
--rounds 5 --steps 3] [--markdown]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
from typing import Any

import torch
from common import console, show
from rich.table import Table

import fxsplit
import fxsplit.models as zoo
from fxsplit.api import CompileOptions


def build(case: Any, kind: str, m: int) -> Any:
    return fxsplit.compile(copy.deepcopy(case.model), ["cpu", "cpu"], case.example_inputs, schedule=kind, microbatches=m,
                           cost_model="analytic", options=CompileOptions(executor="sequential"))


def timed(pipe: Any, case: Any, batch: int, steps: int, into: dict[tuple[int, str], list[float]]) -> None:
    """Run ``steps`` training steps after a warm-up; add each action's seconds to ``into[(stage, kind)]``."""
    inputs, target = case.make_batch(batch, 0)
    for i in range(steps + 1):
        pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
        pipe.zero_grad(set_to_none=True)
        if i:
            for e in pipe.recorder.events:
                into.setdefault((e.stage, e.kind), []).append(e.duration_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,mlp,unet")
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rows = []
    for name in args.models.split(","):
        case = zoo.get(name, size=args.size, batch_size=args.batch)
        pipes = {kind: build(case, kind, args.microbatches) for kind in ("1f1b", "zero-bubble")}
        same = [st.blocks for st in pipes["1f1b"].plan.stages] == [st.blocks for st in pipes["zero-bubble"].plan.stages]
        times: dict[str, dict[tuple[int, str], list[float]]] = {k: {} for k in pipes}
        for _ in range(args.rounds):  # alternate the two schedules, round by round
            for kind, pipe in pipes.items():
                timed(pipe, case, args.batch, args.steps, times[kind])
        for s, st in enumerate(pipes["zero-bubble"].plan.stages):
            b = statistics.median(times["1f1b"][(s, "B")])
            i, w = (statistics.median(times["zero-bubble"][(s, k)]) for k in ("I", "W"))
            rows.append((name, s, same, b, i, w, st.bwd_weight_s / st.bwd_s if st.bwd_s else 0.0))
    load_after = os.getloadavg()
    table = Table(title=f"split backward, {args.size} models, batch {args.batch}, m={args.microbatches}, 2 stages, 1 thread; "
                        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    for col in ("model", "stage", "same split", "B ms (1f1b)", "I ms", "W ms", "I+W ms", "(I+W) / B", "W / (I+W)",
                "W share (cost model)"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, s, same, b, i, w, share in rows:
        table.add_row(name, str(s), "yes" if same else "no", f"{b * 1e3:.3f}", f"{i * 1e3:.3f}", f"{w * 1e3:.3f}",
                      f"{(i + w) * 1e3:.3f}", f"{(i + w) / b:.2f}", f"{w / (i + w):.2f}", f"{share:.2f}")
    show(table, console(), args.markdown)


if __name__ == "__main__":
    main()
