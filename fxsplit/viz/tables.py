"""Tables for people: a pipeline's stages, devices, blocks, predicted time and memory (rich)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from fxsplit.ir.units import format_bytes, format_ids, format_seconds
from fxsplit.viz.text import plan_summary

if TYPE_CHECKING:
    from fxsplit.ir import Plan, Problem
    from fxsplit.ir.placement import Placement, PlacementProblem
    from fxsplit.runtime import Pipeline

__all__ = ["describe", "placement_table", "plan_table", "stage_table"]


def stage_table(pipe: Pipeline) -> Table:
    """A rich table with one row per stage of ``pipe``."""
    plan = pipe.plan
    table = Table(title=f"Pipeline: {pipe.num_stages} stages, {pipe.schedule_kind}, {pipe.microbatches} micro-batches, "
                        f"solver {plan.solver} ({plan.status})", caption=plan_summary(plan))
    for col in ("stage", "device", "blocks", "nodes", "params", "time/mb", "comm/mb", "memory"):
        table.add_column(col, justify="left" if col in ("device", "blocks") else "right")
    for st in pipe.stages:
        sp, name = plan.stages[st.index], pipe.device_names[st.index]
        table.add_row(
            str(st.index), name if name == st.device else f"{name} ({st.device})", format_ids(sp.blocks),
            str(len(st.gm.graph.nodes)), str(sum(p.numel() for p in st.gm.parameters())),
            format_seconds(sp.compute_s), format_seconds(sp.comm_s), format_bytes(sp.memory_bytes),
        )
    return table


def describe(pipe: Pipeline) -> str:
    """:func:`stage_table` as text (120 columns)."""
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(stage_table(pipe))
    return console.export_text()


def plan_table(plan: Plan, problem: Problem) -> Table:
    """A rich table with one row per stage of ``plan`` (costs per micro-batch) for ``problem``:
    device, blocks, the nodes it runs, forward, backward (``+fwd`` where the stage recomputes its
    activations), communication and memory; the caption gives the predicted step, the bound and
    the gap (:func:`~fxsplit.viz.text.plan_summary`) and the solve time."""
    table = Table(title=f"{problem.graph.name}: {plan.num_stages} stages, {plan.schedule}, "
                        f"{plan.microbatches} micro-batches, solver {plan.solver} ({plan.status})",
                  caption=f"{plan_summary(plan)}; solved in {plan.solve_time_s:.2f} s")
    for col in ("stage", "device", "blocks", "nodes", "fwd/mb", "bwd/mb", "comm/mb", "memory"):
        table.add_column(col, justify="left" if col in ("device", "nodes") else "right")
    for s, st in enumerate(plan.stages):
        nodes = [n for b in st.blocks for n in problem.graph.blocks[b].nodes]
        shown = nodes[0] if len(nodes) == 1 else f"{nodes[0]} … {nodes[-1]} ({len(nodes)})" if nodes else ""
        table.add_row(str(s), problem.devices[st.device].name, str(len(st.blocks)), shown, format_seconds(st.fwd_s),
                      format_seconds(st.bwd_s) + (" (+fwd)" if st.recompute else ""), format_seconds(st.comm_s),
                      format_bytes(st.memory_bytes))
    return table


def placement_table(placement: Placement, problem: PlacementProblem,
                    baselines: dict[str, float] | None = None) -> Table:
    """A rich table of a latency placement (:mod:`fxsplit.ir.placement`): one row per
    accelerator that holds nodes (nodes, accelerator time, memory) and one for the CPUs; the
    caption gives the latency, the proven bound and gap, and ``baselines`` (name -> latency)."""
    from fxsplit.ir.placement import CPU

    table = Table(title=f"{problem.name}: one sample's latency, {problem.accelerators} accelerators + CPUs, "
                        f"solver {placement.solver} ({placement.status})",
                  caption=f"latency {format_seconds(placement.latency_s)}, bound "
                          f"{format_seconds(placement.lower_bound_s)}, gap {placement.gap:.2%}"
                          + "".join(f"; {name} {format_seconds(t)}" for name, t in (baselines or {}).items()))
    for col in ("device", "nodes", "time", "memory"):
        table.add_column(col, justify="left" if col == "device" else "right")
    for a in range(problem.accelerators):
        nodes = [v for v, d in enumerate(placement.device) if d == a]
        if nodes:
            table.add_row(f"acc{a}", str(len(nodes)), format_seconds(sum(problem.acc_s[v] for v in nodes)),
                          format_bytes(int(sum(problem.size_bytes[v] for v in nodes))))
    cpu = [v for v, d in enumerate(placement.device) if d == CPU]
    table.add_row("cpu", str(len(cpu)), format_seconds(sum(problem.cpu_s[v] for v in cpu)), "")
    return table
