"""Tarnawski et al.'s throughput inputs (NeurIPS 2020, msr-fiddle/dnn-partitioning) with their CPUs.

For every ``*.json`` under ``INPUTS/throughput-inputs`` (a checkout of their repository, or the
files copied from it: this repository does not ship them): ``fxsplit.solvers.solve(..., "auto")``
on the bottleneck (dp.cpp's max-load) with the file's ``maxFPGAs`` accelerators and ``maxCPUs``
CPU devices (:func:`fxsplit.ir.formats.load_tarnawski`: speed ``fpgaLatency / cpuLatency``, no
memory limit, ``comm_free``), and again with the CPUs left out, alternating the two per file.
Prints the objective, status, gap, wall seconds and the stages per device kind; the plan is
re-checked on the file's own precedence (:func:`fxsplit.ir.formats.tarnawski_plan_faults`).

Edge costs are read as seconds (``time_unit_s=1`` and a 1 GB/s link: bytes = cost x 1e9, so
costs keep nine decimals), as dp.cpp adds them to a stage's time. (Until the sixth session the
bench used a 1 B/s link, which rounded every cost under half a unit to 0 bytes.)

The column "costed dp.cpp's way" re-costs fxsplit's plan with ``dp.cpp``'s accounting
(:func:`fxsplit.ir.formats.tarnawski_max_load`): where it exceeds fxsplit's max-load the two models differ on that file.
``--dp-exe PATH`` also runs their ``dp.cpp`` (built from their repository, not shipped here) on
the same file, alternating with fxsplit, and prints its max-load and seconds; ``--greedy-exe``
does the same for their latency greedy on the latency inputs.

With ``--objective latency``, every ``*.json`` under ``INPUTS/latency-inputs`` instead: one
sample's latency as their ``latency-ip/lip.py`` states it (:mod:`fxsplit.ir.placement`), solved
by :func:`fxsplit.solvers.latency.solve_latency` (CP-SAT, with its proven bound), beside the
baselines of their Appendix F: everything on CPUs, their greedy, the latency of the max-load
(throughput) split (fxsplit's own bottleneck plan of the same file, CPUs included, each stage's
nodes on its device), and fxsplit's interval DP (the CP-SAT hint's best candidate).

``--transfers direct`` solves dp.cpp's own objective (:func:`fxsplit.ir.formats.load_tarnawski`:
each node whose edge crosses a stage paid by the stages it leaves and enters, no relay, backward
edges as their own messages); then "costed dp.cpp's way" equals fxsplit's max-load on every plan.

Run: ``python bench/tarnawski.py INPUTS [--objective latency] [--transfers direct] [--time-limit 60] [--markdown]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from plan_quality import environment, write_json
from rich.console import Console
from rich.table import Table

from fxsplit.errors import FxsplitError
from fxsplit.ir import LinkSpec
from fxsplit.ir.formats import (
    load_tarnawski,
    load_tarnawski_latency,
    tarnawski_max_load,
    tarnawski_plan_faults,
)
from fxsplit.solvers import solve
from fxsplit.solvers.latency import (
    greedy_latency,
    interval_latency,
    placement_of_stages,
    solve_latency,
)

LINK = LinkSpec(bytes_per_s=1e9, latency_s=0.0)
"""Edge costs (seconds) become bytes at 1 GB/s, then time again: nine decimals kept."""


def run_exe(exe: Path | None, path: Path, timeout_s: float) -> tuple[float | None, float | None]:
    """Run one of their programs on ``path`` (stdin); the ``objective = X`` it prints on stderr
    and its wall seconds, or ``(None, seconds)`` when it failed or timed out."""
    if exe is None:
        return None, None
    import re
    import subprocess

    start = time.perf_counter()
    try:
        with path.open() as stdin:
            done = subprocess.run([str(exe)], stdin=stdin, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, time.perf_counter() - start
    wall = time.perf_counter() - start
    found = re.search(r"objective = ([-+0-9.eE]+)", done.stderr)
    return (float(found.group(1)) if found and done.returncode == 0 else None), wall


def run_one(path: Path, with_cpus: bool, time_limit_s: float, dp_exe: Path | None = None,
            exe_timeout_s: float = 600.0, transfers: str = "relayed") -> dict[str, Any]:
    """Load (CPUs kept or dropped), solve, re-check; the row's numbers."""
    data = json.loads(path.read_text())
    src = path
    if not with_cpus and data.get("maxCPUs", 0):
        data["maxCPUs"] = 0
        src = path.with_name(path.stem + ".nocpu.tmp.json")
        src.write_text(json.dumps(data))
    try:
        start = time.perf_counter()
        pb = load_tarnawski(src, link=LINK, name=path.stem, transfers=transfers).with_(objective="bottleneck")
        load_s = time.perf_counter() - start
        plan = solve(pb, "auto", time_limit_s=time_limit_s)
        wall = time.perf_counter() - start - load_s
        faults = tarnawski_plan_faults(src, pb, plan)
        theirs, theirs_s = run_exe(dp_exe, src, exe_timeout_s)
        costed = tarnawski_max_load(src, pb, plan)
    finally:
        if src != path:
            src.unlink()
    kinds: dict[str, int] = {}
    for st in plan.stages:
        kind = pb.devices[st.device].kind
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"file": str(path.relative_to(path.parents[2])), "cpus": int(data.get("maxCPUs", 0)),
            "fpgas": int(data["maxFPGAs"]), "blocks": len(pb.graph), "objective": plan.objective_s,
            "status": plan.status, "gap": plan.gap, "wall_s": wall, "load_s": load_s, "stages": kinds, "faults": len(faults),
            "cpu_speed": next((d.speed for d in pb.devices if d.comm_free), None),
            "dp_cpp": theirs, "dp_cpp_s": theirs_s, "their_way": costed}


def run_latency(path: Path, time_limit_s: float, greedy_exe: Path | None = None,
                exe_timeout_s: float = 600.0) -> dict[str, Any]:
    """The latency objective on one file: baselines, then CP-SAT; the row's numbers."""
    pb = load_tarnawski_latency(path)
    their_greedy, their_greedy_s = run_exe(greedy_exe, path, exe_timeout_s)
    greedy, interval = greedy_latency(pb), interval_latency(pb)
    try:  # the max-load split (dp.cpp's objective, here fxsplit's bottleneck plan), costed for latency
        tp = load_tarnawski(path, link=LINK).with_(objective="bottleneck")
        plan = solve(tp, "auto", time_limit_s=time_limit_s)
        ids = _node_ids(path)
        stages = [[ids[n] for b in st.blocks for n in tp.graph.blocks[b].nodes] for st in plan.stages]
        max_load: float | str = placement_of_stages(
            pb, stages, [not tp.devices[st.device].comm_free for st in plan.stages]).latency_s
    except FxsplitError as exc:
        max_load = f"- ({type(exc).__name__})"
    start = time.perf_counter()
    best = solve_latency(pb, time_limit_s=time_limit_s)
    wall = time.perf_counter() - start
    used = sorted({d for d in best.device if d >= 0})
    return {"file": str(path.relative_to(path.parents[2])), "nodes": len(pb), "fpgas": pb.accelerators,
            "all_cpu": pb.all_cpu_s(), "greedy": greedy.latency_s, "max_load_split": max_load,
            "interval": interval.latency_s, "latency": best.latency_s, "bound": best.lower_bound_s,
            "gap": best.gap, "status": best.status, "wall_s": wall, "accelerators_used": len(used),
            "on_cpu": sum(1 for d in best.device if d < 0), "cp_status": best.stats.get("cp_status"),
            "their_greedy": their_greedy, "their_greedy_s": their_greedy_s}


def _node_ids(path: Path) -> dict[str, int]:
    """The input's node id of each node name in the blocks of ``load_tarnawski(path)``."""
    return {str(n.get("name", f"n{n['id']}")): int(n["id"]) for n in json.loads(path.read_text())["nodes"]}


def main_latency(args: argparse.Namespace) -> None:
    files = sorted((args.inputs / "latency-inputs").rglob("*.json"))
    if not files:
        raise SystemExit(f"no latency-inputs/**/*.json under {args.inputs}")
    load = os.getloadavg()[0]
    rows = [run_latency(f, args.time_limit, args.greedy_exe, args.exe_timeout) for f in files]
    title = (f"Tarnawski latency inputs: one sample's latency, CP-SAT ({args.time_limit:g} s) beside their "
             f"baselines; load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    cols = ("file", "nodes", "FPGAs", "all on CPUs", "greedy", "their greedy.cpp", "max-load split", "interval DP",
            "fxsplit", "bound", "gap", "status", "wall s", "FPGAs used", "nodes on CPUs")
    lines = []
    for r in rows:
        ml = r["max_load_split"]
        theirs = "-" if r["their_greedy"] is None else f"{r['their_greedy']:.2f}"
        lines.append([r["file"], str(r["nodes"]), str(r["fpgas"]), f"{r['all_cpu']:.2f}", f"{r['greedy']:.2f}", theirs,
                      ml if isinstance(ml, str) else f"{ml:.2f}", f"{r['interval']:.2f}", f"{r['latency']:.2f}",
                      f"{r['bound']:.2f}", f"{r['gap']:.1%}", r["status"], f"{r['wall_s']:.1f}",
                      str(r["accelerators_used"]), str(r["on_cpu"])])
    if args.markdown:
        print(f"**{title}**\n")
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        table = Table(title=title)
        for c in cols:
            table.add_column(c)
        for line in lines:
            table.add_row(*line)
        Console(width=200).print(table)
    write_json(args.out, "tarnawski_latency", {"environment": environment(), "rows": rows})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", type=Path, help="a checkout of msr-fiddle/dnn-partitioning (or a copy of its inputs)")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--objective", choices=("bottleneck", "latency"), default="bottleneck")
    ap.add_argument("--dp-exe", type=Path, help="their dp.cpp, built (g++ -O3), to run beside fxsplit")
    ap.add_argument("--greedy-exe", type=Path, help="their latency greedy.cpp, built, to run beside fxsplit")
    ap.add_argument("--exe-timeout", type=float, default=600.0, help="seconds for each run of their programs")
    ap.add_argument("--transfers", choices=("relayed", "direct"), default="relayed",
                    help="communication model (load_tarnawski): fxsplit's relayed boundaries or dp.cpp's direct transfers")
    args = ap.parse_args()
    if args.objective == "latency":
        main_latency(args)
        return
    files = sorted((args.inputs / "throughput-inputs").rglob("*.json"))
    files = [f for f in files if not f.name.endswith(".tmp.json")]
    if not files:
        raise SystemExit(f"no throughput-inputs/**/*.json under {args.inputs}")
    load = os.getloadavg()[0]
    rows = []
    for i, f in enumerate(files):
        for with_cpus in ((True, False) if i % 2 == 0 else (False, True)):
            rows.append(run_one(f, with_cpus, args.time_limit, args.dp_exe, args.exe_timeout, args.transfers))
    title = (f"Tarnawski throughput inputs: auto, bottleneck (max-load), {args.transfers} transfers, with and without "
             "the files' CPUs; "
             f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    table = Table(title=title)
    for col in ("file", "FPGAs", "CPUs", "blocks", "max-load", "status", "gap", "load s", "solve s", "stages", "faults",
                "the plan costed dp.cpp's way", "dp.cpp max-load", "dp.cpp s"):
        table.add_column(col)
    for r in rows:
        stages = ", ".join(f"{n} {k}" for k, n in sorted(r["stages"].items()))
        table.add_row(r["file"], str(r["fpgas"]), f"{r['cpus']} (speed {r['cpu_speed']:.4g})" if r["cpus"] else "0",
                      str(r["blocks"]), f"{r['objective']:.6g}", r["status"], f"{r['gap']:.1e}", f"{r['load_s']:.2f}", f"{r['wall_s']:.2f}",
                      stages, str(r["faults"]), f"{r['their_way']:.6g}",
                      "-" if r["dp_cpp"] is None else f"{r['dp_cpp']:.6g}",
                      "-" if r["dp_cpp_s"] is None else f"{r['dp_cpp_s']:.2f}")
    console = Console(width=200)
    if args.markdown:
        cols = [c.header for c in table.columns]
        print(f"**{title}**\n")
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in range(table.row_count):
            print("| " + " | ".join(str(c._cells[r]) for c in table.columns) + " |")
    else:
        console.print(table)
    write_json(args.out, "tarnawski", {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
