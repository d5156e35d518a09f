"""Which knobs make big models fit and fast: fxsplit's one search against each knob alone.

Issue 13's bench. GPT-2 XL-, Llama-7B- and Llama-70B-shaped models are built on the meta
device (no weights), captured once with ``torch.export`` (symbolic batch) and annotated with the
analytic A100-80GB cost model (312 TFLOP/s for bf16 math, 19.5 for fp32, 2.0 TB/s; Adam state
with fp32 master weights), once in the model's own fp32 and once under bf16 autocast. The
cluster: ``N`` A100-80GB, 8 per node, NVLink (300 GB/s) inside a node, 25 GB/s across
(:mod:`fxsplit.ir.cluster`). For each model and device count the table gives the best plan of
``plan_precisions`` (:mod:`fxsplit.compiler`, as ``fxsplit.compile`` and ``fxsplit plan``
plan: schedule GPipe / 1F1B / interleaved 1F1B, micro-batch count from the divisors of the
batch, the exact split of the winner) with the knobs off and on:

* ``pipeline only``: fp32, no recomputation (fxsplit's search before issue 13);
* ``+ recompute``: per-stage activation recomputation where a stage would not fit;
* ``+ bf16``: bf16 autocast;
* ``one search``: ``autocast="auto"`` and ``recompute="auto"`` together (what ``fxsplit.compile``
  now does with ``CompileOptions(autocast="auto")``);

and, beside them, data parallelism over the same devices (fp32 and bf16, plain and with ZeRO-1
optimizer sharding; :mod:`fxsplit.solvers.data_parallel`: an estimate, all-reduce hidden by the
backward where it fits). Columns: the plan, the predicted step (simulated), the most memory a
device needs under the chosen schedule, and the seconds the search took (annotation excluded;
``capture s`` and ``annotate s`` per model in the caption).

Run: ``python bench/explore.py [--models gpt2-xl,llama-7b,llama-70b] [--time-limit 30] [--markdown]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any

from common import console, show
from rich.table import Table

GiB = 2.0**30

#: name -> (builder, kwargs, global batch, device counts)
MODELS: dict[str, tuple[str, dict[str, Any], int, tuple[int, ...]]] = {
    "gpt2-xl": ("gpt2", {"n_layer": 48, "n_embd": 1600, "n_head": 25, "n_positions": 1024, "vocab_size": 50257,
                         "seq_len": 1024, "attn_implementation": "sdpa"}, 64, (8,)),
    "llama-7b": ("llama", {"preset": "7b", "seq_len": 2048, "attn_implementation": "sdpa"}, 64, (8, 16)),
    "llama-70b": ("llama", {"preset": "70b", "seq_len": 2048, "attn_implementation": "sdpa"}, 64, (32, 64)),
}
QUICK: dict[str, tuple[str, dict[str, Any], int, tuple[int, ...]]] = {
    "llama-2layer": ("llama", {"preset": "7b", "num_hidden_layers": 2, "seq_len": 256}, 8, (2,)),
}

VARIANTS: tuple[tuple[str, str | None, str], ...] = (  # label, autocast, recompute
    ("pipeline only", None, "none"),
    ("+ recompute", None, "auto"),
    ("+ bf16", "bf16", "none"),
    ("one search", "auto", "auto"),
)


def cluster(k: int) -> Any:
    from fxsplit.ir.cluster import cluster_from_dict

    nodes = [{"name": f"n{i}", "devices": {"a100": min(8, k - 8 * i)}} for i in range((k + 7) // 8)]
    return cluster_from_dict({"name": f"{k} x A100-80GB", "device_kinds": {"a100": {"preset": "a100"}},
                              "nodes": nodes,
                              "links": {"intra_node": {"bytes_per_s": 300e9, "latency_s": 5e-6},
                                        "inter_node": {"bytes_per_s": 25e9, "latency_s": 1e-5}}})


def plan_model(name: str, spec: tuple[str, dict[str, Any], int, tuple[int, ...]], time_limit_s: float,
               table: Table) -> str:
    """Capture ``name`` once, annotate it in fp32 and bf16, and add a row per device count and
    variant; returns the caption line (capture and annotation seconds)."""
    import torch

    import fxsplit.models as zoo
    from fxsplit.compiler import plan_precisions, precision_label
    from fxsplit.errors import InfeasibleError, SolverError
    from fxsplit.frontend import capture_with, front_end
    from fxsplit.ir import DeviceSpec, Problem
    from fxsplit.options import CompileOptions
    from fxsplit.schedule import plan_step_s
    from fxsplit.solvers.data_parallel import data_parallel

    builder, kwargs, batch, device_counts = spec
    ref = DeviceSpec.preset("a100")
    options = CompileOptions(time_limit_s=time_limit_s)
    start = time.perf_counter()
    with torch.device("meta"):
        case = zoo.hf(builder, batch_size=batch, **kwargs)
    captured = capture_with(case.model, case.example_inputs, case.example_kwargs, options)
    capture_s = time.perf_counter() - start
    graphs: dict[str | None, Any] = {}
    annotate_s = 0.0
    for precision in (None, "bf16"):
        start = time.perf_counter()
        graphs[precision] = front_end(case.model, case.example_inputs, dict(case.example_kwargs or {}), reference=ref,
                                      cost_model="analytic", options=dataclasses.replace(options, autocast=precision),
                                      captured=captured, name=name).condensed.graph
        annotate_s += time.perf_counter() - start
    params = sum(p.numel() for p in case.model.parameters())
    for k in device_counts:
        machine = cluster(k)
        specs, link, links = machine.relative_to(ref), machine.inter_node, machine.link_overrides()

        def annotate(precision: str | None, recompute: str, specs: Any = specs, link: Any = link,
                     links: Any = links) -> Problem:
            return Problem(graphs[precision], specs, link=link, links=links, objective="makespan",
                           recompute=recompute).check()  # type: ignore[arg-type]

        where = f"{name} ({params / 1e9:.1f}B) x {k}"
        for label, autocast, recompute in VARIANTS:
            opts = dataclasses.replace(options, autocast=autocast, recompute=recompute)  # type: ignore[arg-type]
            start = time.perf_counter()
            try:
                _, choice = plan_precisions(lambda p, r=recompute: annotate(p, r), batch, "auto", "auto", "auto", opts)
            except (InfeasibleError, SolverError) as exc:
                kind = "infeasible (proven)" if isinstance(exc, InfeasibleError) else "no plan found"
                table.add_row(where, label, kind, "-", "-", "-", f"{time.perf_counter() - start:.1f}")
                continue
            took = time.perf_counter() - start
            plan = choice.plan
            again = sum(st.recompute for st in plan.stages)
            desc = (f"{plan.num_stages} stages, {choice.schedule} m={choice.microbatches}, "
                    f"{precision_label(choice.autocast)}" + (f", {again} recomputing" if again else ""))
            memory = max(sum(plan.stages[s].memory_bytes for s in held) for held in plan.rank_stages)
            table.add_row(where, label, desc, f"{plan_step_s(plan):.3f}", f"{memory / GiB:.1f}",
                          f"{plan.solver} ({plan.status})", f"{took:.1f}")
        for precision in (None, "bf16"):
            for zero in (0, 1):
                dp = data_parallel(annotate(precision, "none"), zero_stage=zero)
                table.add_row(where, f"data parallel{' + ZeRO-1' if zero else ''}, {precision_label(precision)}",
                              "fits" if dp.fits else "does not fit", f"{dp.step_s:.3f}", f"{dp.memory_bytes / GiB:.1f}",
                              "estimate", "0.0")
    return f"{name}: capture {capture_s:.1f} s, annotate (fp32 + bf16, with the micro-batch formulas) {annotate_s:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--time-limit", type=float, default=30.0, help="solver seconds per exact split")
    parser.add_argument("--quick", action="store_true", help="a 2-layer Llama on 2 devices (smoke test)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    models = QUICK if args.quick else {m: MODELS[m] for m in args.models.split(",")}
    load = os.getloadavg()[0]
    table = Table(title=f"one search vs each knob alone, A100-80GB clusters (8 per node, NVLink 300 GB/s, "
                        f"25 GB/s across); load average {load:.2f} at the start")
    for col in ("model x devices", "variant", "plan", "step s (predicted)", "max memory GiB per device", "solver",
                "search s"):
        table.add_column(col, justify="right" if col.endswith("s") or "GiB" in col else "left")
    captions = [plan_model(name, spec, args.time_limit, table) for name, spec in models.items()]
    table.caption = "; ".join(captions) + f"; load average {os.getloadavg()[0]:.2f} at the end"
    show(table, console(), args.markdown)


if __name__ == "__main__":
    main()
