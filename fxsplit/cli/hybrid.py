"""``fxsplit hybrid MODEL --devices N``: pipeline stages x stage replicas x per-layer strategies.

Captures the model on one micro-batch, solves its per-layer plans (PaSE's, and Megatron's
column/row family) over every tensor-parallel degree that divides ``N``, costs every ``[pp, dp,
tp]`` mesh (:mod:`fxsplit.solvers.hybrid`) and prints the best plan stage by stage, then the
fastest layouts and the best of each family (data parallel, pipeline, Megatron TP, ...).

Example::

    fxsplit hybrid gpt --devices 8 --microbatches 8
    fxsplit hybrid hf:gpt2 --meta --cluster bench/clusters/a100-2x8.json --json plan.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from fxsplit.cli import exit_with_error
from fxsplit.cli.plan import _load, reference_device
from fxsplit.ir.units import format_bytes, format_seconds

__all__ = ["register", "print_hybrid"]


def print_hybrid(console: Console, found: Any, title: str, top: int = 8) -> None:
    """The best layout's stages (compute per micro-batch; with one stage, the replica's whole
    step), the ``top`` fastest layouts and each family's best."""
    best = found.best
    stages = Table(title=f"{title}: {best.label}, predicted step {format_seconds(best.step_s)}")
    for col in ("stage", "ranks", "replicas", "tp", "split nodes", "compute", "send", "grad all-reduce",
                "memory per device"):
        stages.add_column(col, justify="right")
    for st in best.stage_rows:
        stages.add_row(str(st["stage"]), f"{st['ranks'][0]}-{st['ranks'][1]}", str(st["replicas"]), str(st["tp"]),
                       str(st["split_nodes"]), format_seconds(st["compute_s"]), format_seconds(st["comm_s"]),
                       format_seconds(st["allreduce_s"]), format_bytes(st["memory_bytes"]))
    console.print(stages)
    layouts = Table(title=f"fastest of {len(found.layouts)} meshes (of {found.devices} devices, {found.microbatches} micro-batches)")
    for col in ("mesh", "devices", "step", "pipeline", "exposed all-reduce", "memory", "note"):
        layouts.add_column(col, justify="left" if col in ("mesh", "note") else "right")

    def row(lay: Any, label: str | None = None) -> list[str]:
        return [label or lay.label, str(lay.devices), format_seconds(lay.step_s) if lay.feasible else "-",
                format_seconds(lay.pipeline_s), format_seconds(lay.allreduce_s), format_bytes(lay.memory_bytes),
                lay.note]

    for lay in found.layouts[:top]:
        layouts.add_row(*row(lay))
    console.print(layouts)
    families = Table(title="best of each family")
    for col in ("family", "mesh", "step", "vs hybrid"):
        families.add_column(col, justify="left" if col in ("family", "mesh") else "right")
    for name, lay in found.baselines.items():
        families.add_row(name, lay.label if lay else "none fits", format_seconds(lay.step_s) if lay else "-",
                         f"{lay.step_s / best.step_s:.2f}x" if lay else "-")
    console.print(families)
    if best.placements:
        console.print("placements of the per-layer plan: " + ", ".join(
            f"{k} x{n}" for k, n in sorted(best.placements.items(), key=lambda kv: -kv[1])))
    console.print(f"searched in {found.solve_time_s:.2f} s")


def register(app: typer.Typer) -> None:
    @app.command("hybrid")
    def hybrid_cmd(
        model: Annotated[str, typer.Argument(help="zoo name (gpt, mlp, ...), hf:NAME, or module:function")] = "gpt",
        devices: Annotated[int, typer.Option(min=1, help="number of identical devices")] = 8,
        device: Annotated[str, typer.Option(help="device kind: cpu (measured) or a preset: a100, h100, v100, t4")] = "cpu",
        cluster: Annotated[Path | None, typer.Option(help="a cluster file (see fxsplit.ir.cluster); replaces --devices")] = None,
        size: Annotated[str, typer.Option(help="zoo size preset: tiny, small, base")] = "tiny",
        preset: Annotated[str | None, typer.Option(help="hf:llama size: tiny, 7b, 13b, 70b")] = None,
        meta: Annotated[bool, typer.Option(help="build the model on the meta device (no memory)")] = False,
        batch_size: Annotated[int, typer.Option(help="samples per micro-batch")] = 2,
        microbatches: Annotated[int, typer.Option(min=1, help="micro-batches per step (the global batch)")] = 8,
        schedule: Annotated[str, typer.Option(help="gpipe or 1f1b")] = "1f1b",
        max_tp: Annotated[int | None, typer.Option(help="largest tensor-parallel degree (default: a node)")] = None,
        link_gbps: Annotated[float, typer.Option(help="bandwidth between devices without --cluster, GB/s")] = 25.0,
        latency_us: Annotated[float, typer.Option(help="latency per message without --cluster, microseconds")] = 10.0,
        time_limit: Annotated[float, typer.Option(help="per solve, seconds")] = 10.0,
        top: Annotated[int, typer.Option(help="layouts listed")] = 8,
        as_json: Annotated[Path | None, typer.Option("--json", help="write the plan as JSON here (plan.json)")] = None,
    ) -> None:
        """Choose pipeline depth, stage replicas and per-layer strategies for MODEL together."""
        from fxsplit.api import plan_hybrid
        from fxsplit.errors import FxsplitError
        from fxsplit.ir import LinkSpec

        console = Console()
        try:
            case = _load(model, size, batch_size, preset, meta)
            link = LinkSpec(bytes_per_s=link_gbps * 1e9, latency_s=latency_us * 1e-6).check("--link-gbps/--latency-us")
            found, ins = plan_hybrid(case.model, case.example_inputs, case.example_kwargs or None,
                                     devices=cluster if cluster is not None else devices,
                                     device=None if cluster is not None and device == "cpu" else reference_device(device),
                                     link=link, microbatches=microbatches, schedule=schedule, max_tp=max_tp,
                                     time_limit_s=time_limit, cost_model="analytic", name=model)
        except FxsplitError as exc:
            exit_with_error(console, exc, 2)
        print_hybrid(console, found, f"{model} ({ins.device.name} costs)", top)
        if as_json is not None:
            as_json.write_text(json.dumps(found.to_dict(), indent=1, default=str))
            console.print(f"wrote {as_json}")
