"""Tables for people: a pipeline's stages, devices, blocks, predicted time and memory (rich)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from fxsplit.ir.units import format_bytes, format_seconds
from fxsplit.viz.text import plan_summary

if TYPE_CHECKING:
    from fxsplit.runtime import Pipeline

__all__ = ["describe", "stage_table"]


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
            str(st.index), name if name == st.device else f"{name} ({st.device})", _ranges(sp.blocks),
            str(len(st.gm.graph.nodes)), str(sum(p.numel() for p in st.gm.parameters())),
            format_seconds(sp.compute_s), format_seconds(sp.comm_s), format_bytes(sp.memory_bytes),
        )
    return table


def _ranges(ids: tuple[int, ...]) -> str:
    ids = tuple(sorted(ids))
    if not ids:
        return ""
    if ids == tuple(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return ",".join(map(str, ids[:6])) + ("..." if len(ids) > 6 else "")


def describe(pipe: Pipeline) -> str:
    """:func:`stage_table` as text (120 columns)."""
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(stage_table(pipe))
    return console.export_text()
