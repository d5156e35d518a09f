"""Plan quality: the exact solvers (dp, cpsat) against the baselines, on profiles and real models.

Part 1, the six PipeDream graphs: for 2, 4, 8 devices, homogeneous (identical devices) and
heterogeneous (half the devices twice as fast, device order free), with no communication and no
memory limit: the trivial lower bound, the dp optimum, and how far ``uniform``, ``params``,
``blockpartition`` and ``greedy`` are from it (``(baseline - dp) / dp``), plus dp's solve time.

Part 2, real models captured on the meta device (zoo models, BERT, GPT-2 with 12 and 48 layers,
ViT, a Llama-style model; see ``model_graphs.py``): bottleneck per micro-batch (8 micro-batches,
1F1B, training memory, 25 GB/s links) on 2, 4, 8 A100s, or half A100s and half half-speed 16 GiB
devices: dp and cpsat (objective, status, solve time), the best proven lower bound and the gap
of the best exact plan to it, and the baselines' excess over the best exact plan.

Run: ``python bench/plan_quality.py [--quick] [--part pipedream|models|all] [--out bench/results]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import console as wide_console
from common import show
from rich.table import Table

from fxsplit.ir import DeviceSpec, LinkSpec, Problem, trivial_lower_bound
from fxsplit.ir.formats import load_pipedream
from fxsplit.solvers import solve

ROOT = Path(__file__).resolve().parents[1]
PIPEDREAM = ROOT / "tests" / "data" / "pipedream"  # PipeDream's profiled graphs (MIT, see LICENSE.txt there)
GRAPHS = ["alexnet", "vgg16", "resnet18", "resnet50", "densenet121", "gnmt"]
BASELINES = ["uniform", "params", "blockpartition", "greedy"]


def environment() -> dict[str, Any]:
    """Versions (torch, numpy, OR-Tools), machine and commit, recorded with every result."""
    from importlib.metadata import PackageNotFoundError, version

    import numpy
    import ortools

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = ""

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"python": sys.version.split()[0], "torch": torch_version, "numpy": numpy.__version__, "ortools": ortools.__version__,
            "platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "commit": commit, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_json(out_dir: Path, name: str, doc: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


def make_problem(name: str, k: int, hetero: bool) -> Problem:
    g = load_pipedream(PIPEDREAM / f"{name}.txt")
    devices = tuple(
        DeviceSpec(f"{'fast' if hetero and i < k // 2 else 'gpu'}{i}", memory_bytes=2**50,
                   speed=2.0 if hetero and i < k // 2 else 1.0)
        for i in range(k)
    )
    return Problem(g, devices, link=LinkSpec(math.inf, 0.0), device_order="free" if hetero else "fixed")


def row(name: str, k: int, hetero: bool) -> dict[str, Any]:
    pb = make_problem(name, k, hetero)
    start = time.perf_counter()
    dp = solve(pb, "dp")
    out = {"graph": name, "devices": k, "hetero": hetero, "lower_bound_s": trivial_lower_bound(pb),
           "dp_s": dp.objective_s, "dp_status": dp.status, "dp_solve_s": time.perf_counter() - start}
    for b in BASELINES:
        out[f"{b}_s"] = solve(pb, b).objective_s
        out[f"{b}_gap"] = out[f"{b}_s"] / dp.objective_s - 1
    return out


def pipedream_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="bottleneck per mini-batch (ms); baselines: % above the dp optimum")
    for col in ("graph", "k", "devices", "bound", "dp", "status", *BASELINES, "dp s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["graph"], str(r["devices"]), "2x/1x free" if r["hetero"] else "same",
                      f"{r['lower_bound_s'] * 1e3:.2f}", f"{r['dp_s'] * 1e3:.2f}", r["dp_status"],
                      *(f"{r[f'{b}_gap']:+.1%}" for b in BASELINES), f"{r['dp_solve_s']:.3f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two graphs, two tiny models, 2 and 4 devices")
    parser.add_argument("--part", choices=("pipedream", "models", "all"), default="all")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds per dp/cpsat solve (default 20; quick 2)")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    ks = (2, 4) if args.quick else (2, 4, 8)
    doc: dict[str, Any] = {"env": environment(), "quick": args.quick}
    console = wide_console()
    if args.part in ("pipedream", "all"):
        if not PIPEDREAM.is_dir():
            raise SystemExit(f"PipeDream graphs not found at {PIPEDREAM}")
        graphs = GRAPHS[:2] if args.quick else GRAPHS
        doc["rows"] = [row(g, k, h) for h in (False, True) for g in graphs for k in ks]
        show(pipedream_table(doc["rows"]), console, args.markdown)
    if args.part in ("models", "all"):
        from model_quality import model_rows, model_table

        limit = args.time_limit or (2.0 if args.quick else 20.0)
        doc["model_rows"] = model_rows(args.quick, ks, limit, console)
        show(model_table(doc["model_rows"]), console, args.markdown)
    path = write_json(args.out, "plan_quality", doc)
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
