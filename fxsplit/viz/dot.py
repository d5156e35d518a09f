"""Graphviz DOT of the condensed graph, coloured by block or stage."""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from fxsplit.ir.graph import CondensedGraph
from fxsplit.ir.units import format_bytes, format_seconds

__all__ = ["to_dot", "write_dot"]

log = logging.getLogger(__name__)

_PALETTE = (
    "#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
    "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f",
)


def to_dot(graph: CondensedGraph, color_of: Mapping[int, int] | None = None, title: str = "") -> str:
    """Graphviz DOT text of ``graph``; block ``b`` is filled with colour ``color_of[b]``
    (default: its own id), labelled with its name, time and parameter bytes."""
    lines = [f'digraph "{graph.name}" {{', "  rankdir=TB;", '  node [shape=box, style="filled,rounded", fontsize=10];']
    if title:
        lines.append(f'  label="{title}"; labelloc=t;')
    for b in graph.blocks:
        c = _PALETTE[(color_of or {}).get(b.id, b.id) % len(_PALETTE)]
        label = f"{b.id}: {b.name}\\n{format_seconds(b.time_s)}  {format_bytes(b.param_bytes)}"
        if len(b.nodes) > 1:
            label += f"\\n({len(b.nodes)} nodes)"
        lines.append(f'  b{b.id} [label="{label}", fillcolor="{c}"];')
    for e in graph.edges:
        lines.append(f'  b{e.src} -> b{e.dst} [label="{format_bytes(e.size_bytes)}", fontsize=8];')
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
