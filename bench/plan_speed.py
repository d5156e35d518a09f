"""Solve times of the solvers on synthetic GPT-style operator graphs and on densenet121.

Graphs: a GPT-style transformer at operator granularity, as a chain (ops in sequence) or a DAG
(q, k, v in parallel, residual edges), 12..96 layers; PipeDream's densenet121 profile. Devices:
2..64 identical ones with a 25 GB/s link. Targets (issue 3): dp on the 48-layer graph and on
densenet121 with 8 devices well under 1 s; cpsat proves optimality on a 200-block DAG with 8
devices within 30 s on 2 cores.

Parts (``--part``): ``gpt`` (the graphs above), ``pipedream`` (PipeDream's six graphs x {2, 4, 8}
with ``auto`` and the CLI's wall time), ``compile`` (``fxsplit.compile``'s planning of Hugging Face
tiny models, the schedule search on exact vs block-order splits, alternated), ``all``.

Run: ``python bench/plan_speed.py [--quick] [--part PART] [--markdown] [--out bench/results]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from plan_quality import PIPEDREAM, environment, write_json
from rich.console import Console
from rich.table import Table

from fxsplit.ir import Block, CondensedGraph, DeviceSpec, Edge, LinkSpec, Problem
from fxsplit.ir.downsets import count_downsets
from fxsplit.ir.formats import load_pipedream
from fxsplit.schedule import plan_step_s
from fxsplit.solvers import solve

# (name, relative forward time, parallel group) of one transformer layer's operators
_LAYER = [("ln1", 1, None), ("q", 4, "qkv"), ("k", 4, "qkv"), ("v", 4, "qkv"), ("attn", 6, None),
          ("proj", 4, None), ("add1", 1, None), ("ln2", 1, None), ("fc1", 16, None), ("gelu", 2, None),
          ("fc2", 16, None), ("add2", 1, None)]


def gpt_graph(layers: int, *, dag: bool, hidden: int = 1024, seq_batch: int = 4096) -> CondensedGraph:
    """A GPT-style operator graph: embedding, ``layers`` transformer layers, head.

    Times: ``rel × 1e-5 s`` forward, twice that backward; activations ``seq_batch × hidden × 2``
    bytes; parameters ``hidden² × 2`` bytes per matmul unit of time. ``dag=False`` keeps the ops in
    one chain (q, k, v in sequence, no residual edges).
    """
    act = seq_batch * hidden * 2
    blocks: list[Block] = []
    edges: list[Edge] = []

    def add(name: str, rel: float, preds: list[int]) -> int:
        i = len(blocks)
        blocks.append(Block(i, name, (name,), fwd_s=rel * 1e-5, bwd_s=2 * rel * 1e-5,
                            param_bytes=int(rel * hidden * hidden // 2), activation_bytes=act, output_bytes=act))
        edges.extend(Edge(p, i, act) for p in preds)
        return i

    x = add("embed", 2, [])
    for layer in range(layers):
        prev, qkv = x, []
        for name, rel, group in _LAYER:
            full = f"l{layer}.{name}"
            if dag and group == "qkv":
                qkv.append(add(full, rel, [prev]))
                continue
            if dag and name == "attn":
                prev = add(full, rel, qkv)
            elif dag and name in ("add1", "add2"):
                prev = add(full, rel, [prev, x])
                x = prev
            else:
                prev = add(full, rel, [prev])
        x = prev
    add("head", 8, [x])
    return CondensedGraph(tuple(blocks), tuple(edges), name=f"gpt{layers}-{'dag' if dag else 'chain'}")


def _problem(graph: CondensedGraph, k: int) -> Problem:
    devices = tuple(DeviceSpec(f"gpu{i}", memory_bytes=80 * 2**30, kind="gpu") for i in range(k))
    return Problem(graph, devices, link=LinkSpec(25e9, 10e-6), microbatches=8)


def _time(problem: Problem, solver: str, **opts: Any) -> dict[str, Any]:
    start = time.perf_counter()
    plan = solve(problem, solver, **opts)
    return {"graph": problem.graph.name, "blocks": len(problem.graph), "devices": problem.num_devices,
            "solver": solver, "solved_by": plan.solver, "race": plan.stats.get("auto", {}).get("race"),
            "status": plan.status, "objective_s": plan.objective_s,
            "lower_bound_s": plan.lower_bound_s, "seconds": time.perf_counter() - start,
            "downsets": count_downsets(problem.graph, limit=10**6), "folded": plan.stats.get("folded_blocks", 0)}


def run(quick: bool) -> list[dict[str, Any]]:
    rows = []
    layers = [12, 48] if quick else [12, 24, 48, 96]
    ks = [2, 8] if quick else [2, 8, 16, 64]
    for dag in (False, True):
        for n_layers in layers:
            g = gpt_graph(n_layers, dag=dag)
            for k in ks:
                rows.append(_time(_problem(g, k), "dp"))
    if (PIPEDREAM / "densenet121.txt").is_file():
        dn = load_pipedream(PIPEDREAM / "densenet121.txt")
        for k in ks:
            rows.append(_time(_problem(dn, k), "dp"))
    dag200 = gpt_graph(17, dag=True)  # 1 + 17 * 12 + 1 = 206 blocks
    rows.append(_time(_problem(dag200, 8), "cpsat", time_limit_s=30, num_workers=2, hint="greedy"))
    rows.append(_time(_problem(dag200, 8), "dp"))
    return rows


PIPEDREAM_GRAPHS = ("alexnet", "vgg16", "resnet18", "resnet50", "gnmt", "densenet121")


def run_pipedream(quick: bool) -> list[dict[str, Any]]:
    """PipeDream's profiled graphs × k devices as ``fxsplit solve FILE --devices k`` states them
    (identical 16 GiB devices, default link, bottleneck): ``auto``'s solve seconds in this process,
    who proved it (``dp``, ``cpsat``, or the race's winner) and the CLI's wall time in a fresh
    process (start-up included), the figure to put beside PipeDream's own planner script."""
    from fxsplit.cli.solve import build_problem

    names = ("vgg16", "gnmt") if quick else PIPEDREAM_GRAPHS
    ks = (4,) if quick else (2, 4, 8)
    cli = Path(sys.executable).with_name("fxsplit")
    rows = []
    for name in names:
        path = PIPEDREAM / f"{name}.txt"
        graph = load_pipedream(path)
        for k in ks:
            row = _time(build_problem(graph, devices=k), "auto")
            race = row["race"]
            row["proved_by"] = f"{row['solved_by']} (won the race)" if race else row["solved_by"]
            start = time.perf_counter()
            subprocess.run([str(cli), "solve", str(path), "--devices", str(k)], capture_output=True, check=True)
            row["cli_wall_s"] = time.perf_counter() - start
            rows.append(row)
    return rows


def _print_pipedream(rows: list[dict[str, Any]], markdown: bool) -> None:
    cols = ("graph", "blocks", "downsets", "folded blocks", "devices", "proved by", "status", "solve s", "CLI wall s",
            "bottleneck ms")
    cells = [(r["graph"], str(r["blocks"]), str(r["downsets"]), str(r["folded"]), str(r["devices"]), r["proved_by"],
              r["status"],
              f"{r['seconds']:.2f}", f"{r['cli_wall_s']:.2f}", f"{r['objective_s'] * 1e3:.4f}") for r in rows]
    _print_rows("PipeDream graphs: fxsplit solve FILE --devices k (auto)", cols, cells, markdown)


HF_TINY = ("bert", "gpt2", "llama", "t5", "vit")


def run_compile(quick: bool, repeats: int = 3) -> list[dict[str, Any]]:
    """The planning step of ``fxsplit.compile`` (:func:`fxsplit.compiler.plan_pipeline`: schedule,
    micro-batch count and split; ``solver="auto"``, makespan) for Hugging Face tiny models on 4
    CPU devices, batch 8, the problem ``fxsplit.compile`` builds (profiled costs). Two variants
    alternated in one run: the schedule search on every placement's exact optimum (``exact``, as
    before issue 14's item 5) and on splits along the block order (``chain``,
    ``solve_dp(states="chain")``, the default); both then solve the winner exactly. Seconds: the
    median of ``repeats`` alternated runs."""
    import statistics

    from fxsplit import compiler
    from fxsplit.models.hf import hf
    from fxsplit.options import CompileOptions

    variants = {"exact": compiler._solve, "chain": compiler._explore_plan}
    rows = []
    for name in ("bert",) if quick else HF_TINY:
        problem = _compile_problem(hf(name, batch_size=8))
        graph = problem.graph
        seconds: dict[str, list[float]] = {v: [] for v in variants}
        picked: dict[str, Any] = {}
        for _ in range(1 if quick else repeats):
            for variant, first_plan in variants.items():
                compiler._explore_plan = first_plan  # type: ignore[assignment]
                try:
                    start = time.perf_counter()
                    choice = compiler.plan_pipeline(problem, 8, "auto", "auto", "auto", CompileOptions())
                    seconds[variant].append(time.perf_counter() - start)
                finally:
                    compiler._explore_plan = variants["chain"]  # type: ignore[assignment]
                picked[variant] = choice
        row = {"model": name, "blocks": len(graph), "downsets": count_downsets(graph, limit=10**6)}
        for variant in variants:
            c = picked[variant]
            row[variant] = {"seconds": statistics.median(seconds[variant]), "schedule": f"{c.schedule} m={c.microbatches}",
                            "status": c.plan.status, "objective_s": c.plan.objective_s, "step_s": plan_step_s(c.plan)}
        rows.append(row)
    return rows


def _compile_problem(case: Any) -> Problem:
    """The problem ``fxsplit.compile(model, 4, ...)`` plans (its profiled costs), caught on its way
    to :func:`fxsplit.compiler.plan_pipeline`."""
    import fxsplit
    from fxsplit import compiler

    box: dict[str, Problem] = {}
    real = compiler.plan_pipeline

    def spy(problem: Problem, *args: Any, **kwargs: Any) -> Any:
        box["problem"] = problem
        return real(problem, *args, **kwargs)

    compiler.plan_pipeline = spy  # type: ignore[assignment]
    try:
        fxsplit.compile(case.model, 4, case.example_inputs, case.example_kwargs)
    finally:
        compiler.plan_pipeline = real  # type: ignore[assignment]
    return box["problem"]


def _print_compile(rows: list[dict[str, Any]], markdown: bool) -> None:
    cols = ("model", "blocks", "downsets", "exact-split search s", "chain-split search s", "picked (exact / chain)",
            "status", "predicted step ms (exact / chain)")
    cells = [(r["model"], str(r["blocks"]), str(r["downsets"]), f"{r['exact']['seconds']:.2f}",
              f"{r['chain']['seconds']:.2f}", f"{r['exact']['schedule']} / {r['chain']['schedule']}",
              f"{r['exact']['status']} / {r['chain']['status']}",
              f"{r['exact']['step_s'] * 1e3:.3f} / {r['chain']['step_s'] * 1e3:.3f}") for r in rows]
    _print_rows("compile planning, HF tiny models, 4 CPU devices (auto)", cols, cells, markdown)


def _print_rows(title: str, cols: tuple[str, ...], cells: list[tuple[str, ...]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        for c in cells:
            print("| " + " | ".join(c) + " |")
        return
    table = Table(title=title)
    for col in cols:
        table.add_column(col)
    for c in cells:
        table.add_row(*c)
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--part", choices=("gpt", "pipedream", "compile", "all"), default="all",
                        help="gpt: synthetic GPT graphs and densenet121 with dp; pipedream: the six "
                             "PipeDream graphs x {2, 4, 8} with auto and the CLI's wall time; compile: "
                             "compile's planning of Hugging Face tiny models")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = run(args.quick) if args.part in ("gpt", "all") else []
    pd_rows = run_pipedream(args.quick) if args.part in ("pipedream", "all") else []
    compile_rows = run_compile(args.quick) if args.part in ("compile", "all") else []
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if pd_rows:
        _print_pipedream(pd_rows, args.markdown)
    if compile_rows:
        _print_compile(compile_rows, args.markdown)
    if not rows:
        path = write_json(args.out, "plan_speed", {"env": environment(), "rows": rows, "pipedream": pd_rows,
                                                   "compile": compile_rows})
        Console().print(f"wrote {path}")
        return
    table = Table(title="plan speed (seconds per solve, 2 CPU cores)")
    for col in ("graph", "blocks", "downsets", "devices", "solver", "status", "seconds"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["graph"], str(r["blocks"]), str(r["downsets"]), str(r["devices"]), r["solver"],
                      r["status"], f"{r['seconds']:.3f}")
    Console().print(table)
    path = write_json(args.out, "plan_speed", {"env": environment(), "rows": rows, "pipedream": pd_rows,
                                               "compile": compile_rows})
    Console().print(f"wrote {path}")


if __name__ == "__main__":
    main()
