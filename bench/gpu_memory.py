"""The memory model against ``torch.cuda.max_memory_allocated`` (issue 13, item 3; needs a GPU).

For each zoo model at its real-world size (``base``: GPT-2 small's shape, ResNet-18, a wide MLP)
and each schedule, ``fxsplit.compile`` puts ``p`` stages on one GPU (``executor="sequential"``:
the actions run in turn, so under GPipe every stage holds its in-flight micro-batches at the same
moment and the sum of the stages' peaks is the pipeline's peak; under 1F1B the sum is an upper
bound). One training step and an Adam step allocate the optimizer state first; then the peak of
a second ``train_step`` is read with ``torch.cuda.max_memory_allocated`` and
compared with the plan (the peak of ``train_step``; the optimizer step's own peak, where foreach
Adam's temporaries come on top of the gradients, is shown apart: the model does not charge it):

- predicted total: the sum of the plan's ``memory_bytes`` over the stages (parameters, gradients
  and Adam's two moments, buffers, activations and received inputs per in-flight micro-batch,
  output buffers);
- predicted activations: that total less the state the model charges (4 x parameter bytes plus
  buffers);
- measured activations: the peak less what was allocated before the step (parameters, Adam state,
  buffers, the example batch) and less the gradients (one copy of the parameter bytes).

Ratio = predicted / measured. Run: ``python bench/gpu_memory.py [--device cuda:0] [--markdown]``.
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path
from typing import Any

import torch
from common import console, show
from plan_quality import environment, write_json
from rich.table import Table

import fxsplit
import fxsplit.models as zoo
from fxsplit.api import CompileOptions

# (name, zoo model, size, stages, micro-batches, batch, autocast)
CASES = [
    ("gpt-base", "gpt", "base", 2, 4, 16, None),
    ("gpt-base", "gpt", "base", 2, 4, 16, "bf16"),
    ("resnet-base", "resnet", "base", 2, 4, 64, None),
    ("resnet-base", "resnet", "base", 2, 4, 64, "bf16"),
    ("mlp-base", "mlp", "base", 2, 4, 256, None),
]


def run_case(name: str, model: str, size: str, p: int, m: int, batch: int, autocast: str | None, schedule: str,
             device: str) -> dict[str, Any]:
    """Compile on ``p`` stages of ``device``; the predicted and measured peak of one step."""
    gc.collect()
    torch.cuda.empty_cache()
    case = zoo.get(model, size=size, batch_size=batch)
    pipe = fxsplit.compile(case.model.to(device), [device] * p, case.example_inputs, case.example_kwargs or None,
                           microbatches=m, schedule=schedule, cost_model="analytic",
                           options=CompileOptions(allow_idle_devices=False, executor="sequential",
                                                  profile_cache_dir=False, autocast=autocast))
    x, y = case.make_batch(batch, 1)
    x = tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in x)
    y = y.to(device) if isinstance(y, torch.Tensor) else y
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-4)

    def step() -> None:
        pipe.train_step(*x, target=y, loss_fn=case.loss_fn)
        optimizer.step()
        pipe.zero_grad(set_to_none=True)

    step()  # allocates Adam's state
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    pipe.train_step(*x, target=y, loss_fn=case.loss_fn)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    optimizer.step()  # foreach Adam's temporaries come on top of the gradients
    torch.cuda.synchronize(device)
    peak_optimizer = torch.cuda.max_memory_allocated(device)
    pipe.zero_grad(set_to_none=True)
    param_bytes = sum(q.numel() * q.element_size() for q in pipe.parameters())
    params = {q.data_ptr() for q in pipe.parameters()}
    buffer_bytes = sum(b.numel() * b.element_size() for b in pipe.state_dict().values()
                       if isinstance(b, torch.Tensor) and b.data_ptr() not in params)
    predicted = sum(st.memory_bytes for st in pipe.plan.stages)
    predicted_act = predicted - 4 * param_bytes - buffer_bytes
    measured_act = peak - before - param_bytes
    return {"name": name if autocast is None else f"{name}, {autocast}", "schedule": schedule, "stages": p, "microbatches": m, "batch": batch,
            "param_bytes": param_bytes, "predicted_bytes": predicted, "peak_bytes": peak, "before_bytes": before,
            "peak_optimizer_bytes": peak_optimizer,
            "predicted_act_bytes": predicted_act, "measured_act_bytes": measured_act}


def table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="peak memory of one training step on one GPU: the plan vs torch.cuda.max_memory_allocated, MiB")
    for col in ("model", "schedule", "p x m", "batch", "params", "pred total", "meas peak", "ratio",
                "pred act", "meas act", "ratio", "peak in Adam's step"):
        t.add_column(col, justify="left" if col in ("model", "schedule") else "right")
    mib = 2**20
    for r in rows:
        t.add_row(r["name"], r["schedule"], f"{r['stages']} x {r['microbatches']}", str(r["batch"]),
                  f"{r['param_bytes'] / mib:.1f}", f"{r['predicted_bytes'] / mib:.1f}", f"{r['peak_bytes'] / mib:.1f}",
                  f"{r['predicted_bytes'] / r['peak_bytes']:.2f}", f"{r['predicted_act_bytes'] / mib:.1f}",
                  f"{r['measured_act_bytes'] / mib:.1f}",
                  f"{r['predicted_act_bytes'] / max(r['measured_act_bytes'], 1):.2f}",
                  f"{r['peak_optimizer_bytes'] / mib:.1f}")
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    out = console()
    if not torch.cuda.is_available():
        out.print("no CUDA device: nothing to measure")
        return
    rows = [run_case(*case, schedule, args.device) for case in CASES for schedule in ("gpipe", "1f1b")]
    show(table(rows), out, args.markdown)
    out.print(f"on {torch.cuda.get_device_name(torch.device(args.device))}, {os.cpu_count()} cores")
    out.print(f"wrote {write_json(args.out, 'gpu-memory', {'env': environment(), 'rows': rows})}")


if __name__ == "__main__":
    main()
