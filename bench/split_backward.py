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


def build(case: Any, kind: str, m: int) -> Any:
    return fxsplit.compile(copy.deepcopy(case.model), ["cpu", "cpu"], case.example_inputs, schedule=kind, microbatches=m,
                           cost_model="analytic", options=CompileOptions(executor="sequential"))


def main() -> None:
    args = variant_parser(__doc__.splitlines()[0], microbatches=8).parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rows = []
    for name in args.models.split(","):
        case = zoo.get(name, size=args.size, batch_size=args.batch)
        pipes = {kind: build(case, kind, args.microbatches) for kind in ("1f1b", "zero-bubble")}
        same = same_split(pipes["1f1b"], pipes["zero-bubble"])
        times = alternate(pipes, case, args.batch, args.rounds, args.steps)
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
