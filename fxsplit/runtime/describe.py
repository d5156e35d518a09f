"""``print(pipe)``: a table of stages, devices, blocks, predicted time and memory."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console
from rich.table import Table

from fxsplit.report import human_bytes, human_seconds, plan_summary

__all__ = ["describe", "stage_table"]


def stage_table(pipe: Any) -> Table:
    """A rich table with one row per stage of ``pipe``."""
    plan = pipe.plan
    title = f"Pipeline: {pipe.num_stages} stages, {pipe.schedule_kind}, {pipe.microbatches} micro-batches"
    if plan is not None:
        title += f", solver {plan.solver} ({plan.status})"
    table = Table(title=title)
    for col in ("stage", "device", "blocks", "nodes", "params", "time/mb", "comm/mb", "memory"):
        table.add_column(col, justify="left" if col in ("device", "blocks") else "right")
    names = pipe.report.get("device_names") or [st.device for st in pipe.stages]
    for st in pipe.stages:
        sp = plan.stages[st.index] if plan is not None and st.index < len(plan.stages) else None
        blocks = _ranges(sp.blocks) if sp is not None else ""
        table.add_row(
            str(st.index), names[st.index] if names[st.index] == st.device else f"{names[st.index]} ({st.device})", blocks, str(len(st.gm.graph.nodes)),
            str(sum(p.numel() for p in st.gm.parameters())),
            human_seconds(sp.compute_s) if sp else "", human_seconds(sp.comm_s) if sp else "",
            human_bytes(sp.memory_bytes) if sp else "",
        )
    if plan is not None:
        table.caption = plan_summary(plan)
    return table


def _ranges(ids: tuple[int, ...]) -> str:
    ids = tuple(sorted(ids))
    if not ids:
        return ""
    if ids == tuple(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return ",".join(map(str, ids[:6])) + ("..." if len(ids) > 6 else "")


def describe(pipe: Any) -> str:
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(stage_table(pipe))
    return console.export_text()
