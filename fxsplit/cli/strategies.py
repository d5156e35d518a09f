"""``fxsplit strategies MODEL --mesh N``: the best parallelization of every layer over N devices (PaSE).

Captures and costs the model, builds each node's candidate strategies from DTensor
(:mod:`fxsplit.passes.parallel_strategies`), solves with PaSE's DP (or CP-SAT past its table
limit, :mod:`fxsplit.solvers.pase`), and prints each parameter's placement and the predicted
step time beside data parallelism and every device doing everything.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from fxsplit.cli import exit_with_error
from fxsplit.ir.units import format_bytes, format_seconds

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    @app.command("strategies")
    def strategies_cmd(
        model: Annotated[str, typer.Argument(help="zoo name (gpt, mlp, ...), hf:NAME, or module:function")] = "mlp",
        mesh: Annotated[int, typer.Option(min=2, help="devices of the (1-D) mesh")] = 2,
        size: Annotated[str, typer.Option(help="zoo size preset: tiny, small, base")] = "tiny",
        batch_size: Annotated[int, typer.Option(help="samples per step")] = 8,
        time_limit: Annotated[float, typer.Option(help="CP-SAT time limit, seconds (when the exact solvers' tables are too large)")] = 30.0,
        link_gbps: Annotated[float, typer.Option(help="bandwidth between the mesh's devices, GB/s")] = 25.0,
        latency_us: Annotated[float, typer.Option(help="latency per collective step, microseconds")] = 10.0,
    ) -> None:
        """Choose each layer's parallelization (Shard / Replicate / Partial over MESH devices)."""
        import fxsplit
        from fxsplit.api import load_model
        from fxsplit.errors import FxsplitError
        from fxsplit.ir import LinkSpec
        from fxsplit.passes.parallel_strategies import megatron_placements, strategy_graph
        from fxsplit.solvers.pase import solve_strategies

        console = Console()
        try:
            case = load_model(model, size=size, batch_size=batch_size)
            ins = fxsplit.inspect(case.model, case.example_inputs)
            start = time.perf_counter()
            link = LinkSpec(bytes_per_s=link_gbps * 1e9, latency_s=latency_us * 1e-6).check("--link-gbps/--latency-us")
            found = strategy_graph(ins.captured.gm, mesh, link=link)
            built = time.perf_counter()
            best = solve_strategies(found.graph, time_limit_s=time_limit)
        except FxsplitError as exc:
            exit_with_error(console, exc, 2)
        g = found.graph
        table = Table(title=f"{model}: parameters over a mesh of {mesh} ({ins.device.name} costs)")
        for col in ("parameter", "placement", "per-device state"):
            table.add_column(col, justify="left" if col != "per-device state" else "right")
        for v, c in enumerate(best.choice):
            if found.parameters and found.parameters[v]:
                opt = g.vertices[v].options[c]
                table.add_row(found.nodes[v], found.placements[v][c], format_bytes(opt.memory_bytes))
        console.print(table)
        counts = Counter(found.placements[v][c] for v, c in enumerate(best.choice))
        summary = Table(title="predicted step (compute + redistribution, per device)")
        summary.add_column("plan")
        summary.add_column("time", justify="right")
        summary.add_column("memory per device", justify="right")
        rows = [("chosen per layer", best.choice), ("data parallel", found.data_parallel_choice()),
                ("every device does everything", found.choice_of(("R",)))]
        for name, family in (("best with every parameter replicated", found.replicated_parameters()),
                             ("best with Megatron's column/row linear layers", megatron_placements(ins.captured.gm))):
            try:
                rows.append((name, solve_strategies(g.restricted(found.allowing(family)), time_limit_s=time_limit).choice))
            except FxsplitError:
                rows.append((name, ()))
        for name, choice in rows:
            cost = g.cost_s(choice) if choice else float("inf")
            summary.add_row(name, format_seconds(cost) if cost != float("inf") else "not expressible",
                            format_bytes(g.memory_bytes(choice)) if choice else "-")
        console.print(summary)
        console.print(f"{len(g)} values, {len(g.edges)} edges; placements chosen: "
                      f"{', '.join(f'{k} x{n}' for k, n in counts.most_common())}; strategies from DTensor in "
                      f"{built - start:.2f} s, solved by {best.solver} in {best.solve_time_s:.2f} s"
                      f"{'' if best.proven else ' (time limit: not proven optimal)'}"
                      f"{f'; largest table {best.max_states} states' if best.max_states else ''}"
                      f"{f'; no DTensor strategy (replicated): {list(found.fallback)}' if found.fallback else ''}")
