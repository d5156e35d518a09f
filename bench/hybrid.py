"""Hybrid plans against data parallelism, pipelines and Megatron-style tensor parallelism.

Issue 11's bench (analytic part). GPT-2 XL-, Llama-7B- and BERT-large-shaped models are built on
the meta device (no weights), captured once with ``torch.export`` on one micro-batch and
annotated with the analytic A100-80GB cost model (fp32). Per-layer plans are solved once per
tensor-parallel degree 2, 4, 8 and family (:func:`fxsplit.passes.layer_costs.layer_parallel_costs`:
PaSE's free choice over DTensor's strategies, and Megatron's column/row linears) on NVLink
(300 GB/s, 5 us); then for ``N`` A100-80GB, 8 per node, 25 GB/s across nodes, every
``[pp, dp, tp]`` mesh of a divisor of ``N`` is costed (:func:`fxsplit.solvers.hybrid.plan_hybrid`,
``tp`` inside a node, 1F1B, the global batch of 64 micro-batches). Columns: the hybrid's mesh and
predicted step, the best of each family (``data parallel``: ``[1, N, 1]`` and smaller;
``pipeline``: today's plan, ``dp = tp = 1``; ``Megatron TP x DP``: ``pp = 1``, Megatron's
layers; ``PaSE x DP``: ``pp = 1``, free per-layer choice) as predicted step and hybrid's speed-up
over it (``-``: nothing of the family fits in 80 GB), and the search seconds (per-layer solves in
the caption). All figures are predictions of the cost model; nothing here ran on an A100.

Run: ``python bench/hybrid.py [--models gpt2-xl,llama-7b,bert-large] [--devices 8,16,64] [--markdown]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from common import console, show
from explore import cluster
from plan_quality import environment, write_json
from rich.table import Table

#: name -> (builder, kwargs, samples per micro-batch)
MODELS: dict[str, tuple[str, dict[str, Any], int]] = {
    "gpt2-xl": ("gpt2", {"n_layer": 48, "n_embd": 1600, "n_head": 25, "n_positions": 1024, "vocab_size": 50257,
                         "seq_len": 1024}, 1),
    "llama-7b": ("llama", {"preset": "7b", "seq_len": 2048}, 1),
    "bert-large": ("bert", {"vocab_size": 30522, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                            "intermediate_size": 4096, "max_position_embeddings": 512, "seq_len": 512}, 4),
}
QUICK: dict[str, tuple[str, dict[str, Any], int]] = {
    "gpt2-2layer": ("gpt2", {"n_layer": 2, "n_embd": 256, "n_head": 4, "n_positions": 256, "vocab_size": 1000,
                             "seq_len": 128}, 2),
}
FAMILIES = ("data parallel", "pipeline", "Megatron TP (x DP)", "per-layer (PaSE) x DP")


def plan_model(name: str, spec: tuple[str, dict[str, Any], int], device_counts: list[int], microbatches: int,
               time_limit_s: float, table: Table, results: list[dict[str, Any]]) -> str:
    import torch

    import fxsplit.models as zoo
    from fxsplit.errors import InfeasibleError
    from fxsplit.frontend import front_end
    from fxsplit.ir import DeviceSpec, Problem
    from fxsplit.options import CompileOptions
    from fxsplit.passes.layer_costs import per_layer_costs
    from fxsplit.solvers.hybrid import plan_hybrid

    builder, kwargs, batch = spec
    ref = DeviceSpec.preset("a100")
    start = time.perf_counter()
    with torch.device("meta"):
        case = zoo.hf(builder, batch_size=batch, **kwargs)
    ins = front_end(case.model, case.example_inputs, dict(case.example_kwargs or {}), reference=ref,
                    cost_model="analytic", options=CompileOptions(), name=name)
    capture_s = time.perf_counter() - start
    graph = ins.condensed.graph
    nvlink = cluster(8).intra_node
    start = time.perf_counter()
    degrees = sorted({t for k in device_counts for t in (2, 4, 8) if t <= min(k, 8) and k % t == 0})
    costs = per_layer_costs(ins.captured.gm, graph, degrees, link=nvlink, time_limit_s=time_limit_s,
                            memory_limit_bytes=ref.memory_bytes)
    layers_s = time.perf_counter() - start
    params = sum(p.numel() for p in case.model.parameters())
    for k in device_counts:
        machine = cluster(k)
        problem = Problem(graph, machine.relative_to(ref), link=machine.inter_node, links=machine.link_overrides(),
                          microbatches=microbatches, objective="makespan")
        where = f"{name} ({params / 1e9:.1f}B) x {k}"
        start = time.perf_counter()
        try:
            found = plan_hybrid(problem, costs, time_limit_s=time_limit_s, max_tp=8)
        except InfeasibleError as exc:
            table.add_row(where, "nothing fits", "-", *["-"] * len(FAMILIES), f"{time.perf_counter() - start:.1f}")
            results.append({"model": name, "devices": k, "error": str(exc)})
            continue
        best = found.best
        cells = []
        for fam in FAMILIES:
            lay = found.baselines.get(fam)
            cells.append(f"{lay.step_s:.4g} ({best.step_s and lay.step_s / best.step_s:.2f}x) {lay.pp}/{lay.dp}/{lay.tp}"
                         if lay else "-")
        table.add_row(where, f"{best.pp}/{best.dp}/{best.tp} {best.family}", f"{best.step_s:.4g}", *cells,
                      f"{found.solve_time_s:.1f}")
        results.append({"model": name, "devices": k, "plan": found.to_dict()})
        print(f"{where}: {best.label} {best.step_s:.4g} s, searched {found.solve_time_s:.1f} s", file=sys.stderr, flush=True)
    return (f"{name}: capture {capture_s:.1f} s, {len(graph.blocks)} blocks, per-layer plans "
            f"(tp {', '.join(map(str, degrees))} x 2 families) {layers_s:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--devices", default="8,16,64")
    parser.add_argument("--microbatches", type=int, default=64, help="micro-batches per step (the global batch)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per solve")
    parser.add_argument("--quick", action="store_true", help="a 2-layer GPT-2 on 4 devices (smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="write hybrid-<time>.json here")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    models = QUICK if args.quick else {m: MODELS[m] for m in args.models.split(",")}
    counts = [4] if args.quick else [int(k) for k in args.devices.split(",")]
    m = 8 if args.quick else args.microbatches
    table = Table(title=f"hybrid (pp/dp/tp) vs each family, predicted step s, A100-80GB (8 per node, NVLink 300 GB/s, "
                        f"25 GB/s across), {m} micro-batches; load average {os.getloadavg()[0]:.2f} at the start")
    for col in ("model x devices", "hybrid pp/dp/tp", "hybrid step s", *FAMILIES, "search s"):
        table.add_column(col, justify="left" if col.startswith(("model", "hybrid pp")) else "right")
    results: list[dict[str, Any]] = []
    captions = [plan_model(name, spec, counts, m, args.time_limit, table, results) for name, spec in models.items()]
    table.caption = "; ".join(captions) + f"; load average {os.getloadavg()[0]:.2f} at the end"
    show(table, console(), args.markdown)
    if args.out is not None:
        write_json(args.out, "hybrid", {"env": environment(), "quick": args.quick, "microbatches": m, "results": results})


if __name__ == "__main__":
    main()
