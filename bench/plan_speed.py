"""Solve times of the solvers on synthetic GPT-style operator graphs and on densenet121.

Graphs: a GPT-style transformer at operator granularity, as a chain (ops in sequence) or a DAG
(q, k, v in parallel, residual edges), 12..96 layers; PipeDream's densenet121 profile. Devices:
2..64 identical ones with a 25 GB/s link. Targets (issue 3): dp on the 48-layer graph and on
densenet121 with 8 devices well under 1 s; cpsat proves optimality on a 200-block DAG with 8
devices within 30 s on 2 cores.

Run: ``python bench/plan_speed.py [--quick] [--out bench/results]``.
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
            "downsets": count_downsets(problem.graph, limit=10**6)}


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
    cols = ("graph", "blocks", "downsets", "devices", "proved by", "status", "solve s", "CLI wall s", "bottleneck ms")
    cells = [(r["graph"], str(r["blocks"]), str(r["downsets"]), str(r["devices"]), r["proved_by"], r["status"],
              f"{r['seconds']:.2f}", f"{r['cli_wall_s']:.2f}", f"{r['objective_s'] * 1e3:.4f}") for r in rows]
    if markdown:
        print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        for c in cells:
            print("| " + " | ".join(c) + " |")
        return
    table = Table(title="PipeDream graphs: fxsplit solve FILE --devices k (auto)")
    for col in cols:
        table.add_column(col)
    for c in cells:
        table.add_row(*c)
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--part", choices=("gpt", "pipedream", "all"), default="all",
                        help="gpt: synthetic GPT graphs and densenet121 with dp; pipedream: the six "
                             "PipeDream graphs x {2, 4, 8} with auto and the CLI's wall time")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = run(args.quick) if args.part in ("gpt", "all") else []
    pd_rows = run_pipedream(args.quick) if args.part in ("pipedream", "all") else []
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if pd_rows:
        _print_pipedream(pd_rows, args.markdown)
    if not rows:
        path = write_json(args.out, "plan_speed", {"env": environment(), "rows": rows, "pipedream": pd_rows})
        Console().print(f"wrote {path}")
        return
    table = Table(title="plan speed (seconds per solve, 2 CPU cores)")
    for col in ("graph", "blocks", "downsets", "devices", "solver", "status", "seconds"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["graph"], str(r["blocks"]), str(r["downsets"]), str(r["devices"]), r["solver"],
                      r["status"], f"{r['seconds']:.3f}")
    Console().print(table)
    path = write_json(args.out, "plan_speed", {"env": environment(), "rows": rows, "pipedream": pd_rows})
    Console().print(f"wrote {path}")


if __name__ == "__main__":
    main()
