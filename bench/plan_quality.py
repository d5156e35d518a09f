"""Plan quality on the six PipeDream graphs: dp (proven optimum) against the baselines.

For each graph and 2, 4, 8 devices, homogeneous (identical devices) and heterogeneous (half the
devices twice as fast, device order free), with no communication and no memory limit: the trivial
lower bound, the dp optimum, and how far ``uniform``, ``params``, ``blockpartition`` and
``greedy`` are from it (``(baseline - dp) / dp``), plus dp's solve time.

Run: ``python bench/plan_quality.py [--out bench/results]``.
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

from fxsplit.solvers import solve
from rich.console import Console
from rich.table import Table

from fxsplit.ir import DeviceSpec, LinkSpec, Problem, trivial_lower_bound
from fxsplit.ir.formats import load_pipedream

ROOT = Path(__file__).resolve().parents[1]
PIPEDREAM = ROOT / ".." / "shared" / "data" / "pipedream"
GRAPHS = ["alexnet", "vgg16", "resnet18", "resnet50", "densenet121", "gnmt"]
BASELINES = ["uniform", "params", "blockpartition", "greedy"]


def environment() -> dict[str, Any]:
    """Versions, machine and commit, recorded with every result."""
    import numpy
    import ortools

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"python": sys.version.split()[0], "numpy": numpy.__version__, "ortools": ortools.__version__,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if not PIPEDREAM.is_dir():
        raise SystemExit(f"PipeDream graphs not found at {PIPEDREAM}")
    rows = [row(g, k, h) for h in (False, True) for g in GRAPHS for k in (2, 4, 8)]
    table = Table(title="bottleneck per mini-batch (ms); baselines: % above the dp optimum")
    for col in ("graph", "k", "devices", "bound", "dp", "status", *BASELINES, "dp s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["graph"], str(r["devices"]), "2x/1x free" if r["hetero"] else "same",
                      f"{r['lower_bound_s'] * 1e3:.2f}", f"{r['dp_s'] * 1e3:.2f}", r["dp_status"],
                      *(f"{r[f'{b}_gap']:+.1%}" for b in BASELINES), f"{r['dp_solve_s']:.3f}")
    Console().print(table)
    path = write_json(args.out, "plan_quality", {"env": environment(), "rows": rows})
    Console().print(f"wrote {path}")


if __name__ == "__main__":
    main()
