"""Peak memory and time to capture, annotate and plan Llama-7B- and 70B-shaped models on meta.

Each model is planned in its own subprocess (``--child NAME``), which builds the model under
``torch.device("meta")`` (no weights), captures it with ``torch.export``, runs the passes
(shapes, analytic costs for an A100, antichain condensation) and solves the split (bottleneck
per micro-batch, 8 micro-batches, 1F1B, fp32 weights with Adam state) over A100-80GB devices:
8 for 7B, 32 and 64 for 70B (its 1.1 TB of weights, gradients and Adam state need at least 14).
The child prints one JSON line per finished phase with ``ru_maxrss`` (peak resident memory so
far); the parent keeps the last one, so a child stopped by ``--timeout`` still reports how far it
got.

Run: ``python bench/planning_memory.py [--quick] [--timeout 900]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# name -> (llama preset, overrides, devices, batch, seq)
MODELS: dict[str, tuple[str, dict[str, Any], int, int, int]] = {
    "llama-7b": ("7b", {}, 8, 8, 2048),
    "llama-70b": ("70b", {}, 32, 8, 2048),
    "llama-70b-x64": ("70b", {}, 64, 8, 2048),
}
QUICK: dict[str, tuple[str, dict[str, Any], int, int, int]] = {
    "llama-7b-1layer": ("7b", {"num_hidden_layers": 1}, 2, 2, 256),
}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(name: str, quick: bool, time_limit_s: float) -> None:
    """Plan one model, printing a JSON line after every phase."""
    preset, overrides, k, batch, seq = (QUICK if quick else MODELS)[name]
    doc: dict[str, Any] = {"model": name, "devices": k, "batch": batch, "seq": seq, "phase": "start",
                           "rss_start_mib": _rss_mib()}

    def report(phase: str, **values: Any) -> None:
        doc.update(values, phase=phase, peak_rss_mib=_rss_mib())
        print(json.dumps(doc), flush=True)

    t0 = time.perf_counter()
    import torch

    import fxsplit.models as zoo
    from fxsplit.api import analyze
    from fxsplit.errors import InfeasibleError, SolverError
    from fxsplit.ir import DeviceSpec, LinkSpec, Problem
    from fxsplit.solvers import solve

    report("import", import_s=time.perf_counter() - t0)
    t0 = time.perf_counter()
    with torch.device("meta"):
        case = zoo.hf("llama", preset=preset, batch_size=batch, seq_len=seq, **overrides)
    params = sum(p.numel() for p in case.model.parameters())
    report("build", build_s=time.perf_counter() - t0, params=params)
    t0 = time.perf_counter()
    ref = DeviceSpec.preset("a100")
    ins = analyze(case.model, case.example_inputs, device=ref, name=name)
    total = time.perf_counter() - t0
    passes = {r.name: r.time_s for r in ins.records}
    report("annotate", capture_s=total - sum(passes.values()), passes_s=passes, nodes=len(ins.captured.gm.graph.nodes),
           blocks=ins.condensed.num_blocks, downsets=ins.condensed.num_downsets, truncated=ins.condensed.truncated)
    t0 = time.perf_counter()
    m = 8
    specs = tuple(ref.with_(name=f"a100:{i}") for i in range(k))
    problem = Problem(ins.condensed.graph.scaled(1.0 / m), specs, LinkSpec(), microbatches=m).check()
    try:
        plan = solve(problem, "auto", time_limit_s=time_limit_s)
    except InfeasibleError as exc:  # proven: the model does not fit these devices
        report("plan", plan_s=time.perf_counter() - t0, plan_note=f"infeasible (proven): {str(exc)[:160]}")
        return
    except SolverError as exc:  # nothing proven within the time limit
        report("plan", plan_s=time.perf_counter() - t0, plan_note=f"no plan: {str(exc)[:160]}")
        return
    note = ""
    report("plan", plan_note=note, plan_s=time.perf_counter() - t0, solver=plan.solver, status=plan.status, stages=plan.num_stages,
           bottleneck_s=plan.bottleneck_s, gap=plan.gap, max_stage_gib=max(st.memory_bytes for st in plan.stages) / 2**30)


def run_child(name: str, quick: bool, timeout_s: float, time_limit_s: float) -> dict[str, Any]:
    """Run :func:`child` in a subprocess; its last JSON line, with the wall time."""
    cmd = [sys.executable, __file__, "--child", name, "--time-limit", str(time_limit_s)] + (["--quick"] if quick else [])
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        stdout, note = proc.stdout, "" if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        note = f"stopped after {timeout_s:.0f} s"
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    doc = json.loads(lines[-1]) if lines else {"model": name, "phase": "none"}
    doc.update(wall_s=time.perf_counter() - start, note=note)
    return doc


def table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(title="planning on the meta device: peak RSS (ru_maxrss of the subprocess) and seconds per phase")
    for col in ("model", "params", "nodes", "blocks", "downsets", "build s", "capture s", "passes s", "plan s",
                "solver", "devices", "stages", "peak RSS MiB", "wall s", "note"):
        t.add_column(col, justify="left" if col in ("model", "solver", "note") else "right")
    for r in rows:
        passes = sum(r.get("passes_s", {}).values()) if "passes_s" in r else None
        t.add_row(r["model"], f"{r.get('params', 0) / 1e9:.2f}e9", str(r.get("nodes", "-")),
                  str(r.get("blocks", "-")), f"{r.get('downsets', '-')}{'+' if r.get('truncated') else ''}",
                  _s(r.get("build_s")), _s(r.get("capture_s")), _s(passes), _s(r.get("plan_s")),
                  f"{r.get('solver', '-')} ({r.get('status', '-')})", str(r.get("devices", "-")),
                  str(r.get("stages", "-")), f"{r.get('peak_rss_mib', 0):.0f}", f"{r['wall_s']:.1f}",
                  r["note"] or r.get("plan_note") or f"reached: {r['phase']}")
    return t


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 1-layer 7B shape only")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per model subprocess")
    parser.add_argument("--time-limit", type=float, default=120.0, help="solver seconds")
    parser.add_argument("--models", nargs="*", help="only these models (default: all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.quick, args.time_limit)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from common import console, show
    from plan_quality import environment, write_json

    out = console()
    rows = []
    for name in args.models or (QUICK if args.quick else MODELS):
        with out.status(f"planning {name} in a subprocess ..."):
            rows.append(run_child(name, args.quick, args.timeout, args.time_limit))
    show(table(rows), out, args.markdown)
    path = write_json(args.out, "planning_memory", {"env": environment(), "rows": rows})
    out.print(f"wrote {path}")


if __name__ == "__main__":
    main()
