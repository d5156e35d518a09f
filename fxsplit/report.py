"""Pictures and tables for people: Graphviz DOT of the condensed graph, coloured by block or stage."""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fxsplit.ir.graph import CondensedGraph
from fxsplit.ir.units import format_bytes, format_seconds

__all__ = ["to_dot", "write_dot", "human_bytes", "human_seconds", "plan_summary"]

log = logging.getLogger(__name__)

_PALETTE = (
    "#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
    "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f",
)


human_bytes = format_bytes
"""``1536 -> '1.5 KiB'`` (:func:`fxsplit.ir.units.format_bytes`)."""
human_seconds = format_seconds
"""``0.0123 -> '12.30 ms'`` (:func:`fxsplit.ir.units.format_seconds`)."""


def plan_summary(plan: Any) -> str:
    """One line under a plan's table: its predicted step, bottleneck and how close the split is
    to the solver's proven bound. A looped schedule's step is simulated and its bound is that of
    the split into chunks (the solvers' objective), so both are named apart.

    Args:
        plan: A :class:`~fxsplit.ir.Plan` (costs per micro-batch).
    """
    from fxsplit.ir.problem import LOOPED_SCHEDULES
    from fxsplit.schedule import plan_step_s

    step = f"step {human_seconds(plan_step_s(plan))}, bottleneck {human_seconds(plan.bottleneck_s)} (predicted)"
    if plan.schedule in LOOPED_SCHEDULES:
        return (f"{step}; {plan.num_stages // plan.num_ranks} stages per device, split {plan.status} for its {plan.objective} "
                f"{human_seconds(plan.objective_s)} (lower bound {human_seconds(plan.lower_bound_s)}, gap {plan.gap:.1%})")
    return f"{step}; lower bound {human_seconds(plan.lower_bound_s)}, gap {plan.gap:.1%}"


def to_dot(graph: CondensedGraph, color_of: Mapping[int, int] | None = None, title: str = "") -> str:
    """Graphviz DOT text of ``graph``; block ``b`` is filled with colour ``color_of[b]``
    (default: its own id), labelled with its name, time and parameter bytes."""
    lines = [f'digraph "{graph.name}" {{', "  rankdir=TB;", '  node [shape=box, style="filled,rounded", fontsize=10];']
    if title:
        lines.append(f'  label="{title}"; labelloc=t;')
    for b in graph.blocks:
        c = _PALETTE[(color_of or {}).get(b.id, b.id) % len(_PALETTE)]
        label = f"{b.id}: {b.name}\\n{human_seconds(b.time_s)}  {human_bytes(b.param_bytes)}"
        if len(b.nodes) > 1:
            label += f"\\n({len(b.nodes)} nodes)"
        lines.append(f'  b{b.id} [label="{label}", fillcolor="{c}"];')
    for e in graph.edges:
        lines.append(f'  b{e.src} -> b{e.dst} [label="{human_bytes(e.size_bytes)}", fontsize=8];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_dot(condensed: object, path: str | Path, color_of: Mapping[int, int] | None = None, title: str = "") -> Path:
    """Write DOT (and SVG beside it when Graphviz's ``dot`` is installed); return the DOT path.

    ``condensed`` is a :class:`CondensedGraph` or anything with a ``.graph`` attribute holding one.
    """
    graph = condensed if isinstance(condensed, CondensedGraph) else condensed.graph  # type: ignore[attr-defined]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_dot(graph, color_of, title))
    dot = shutil.which("dot")
    if dot:
        svg = path.with_suffix(".svg")
        try:
            subprocess.run([dot, "-Tsvg", str(path), "-o", str(svg)], check=True, capture_output=True, timeout=60)
        except (subprocess.SubprocessError, OSError) as exc:
            log.warning("dot could not render %s: %s", path, exc)
    return path
