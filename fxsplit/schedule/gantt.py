"""ASCII Gantt chart of a simulated timeline (torch-free).

One row per rank, time running left to right; an action is drawn as its kind and micro-batch
followed by dashes over its duration (``F0--B0----``; only the kind when the number does not fit),
idle time as ``.``::

    rank0 |F0F1F2F3......B0--B1--B2--B3--|
    rank1 |..F0F1F2F3B0--B1--B2--B3--....|
           0                         15 s

(GPipe, 2 stages, 4 micro-batches, forward 1 s, backward 2 s, ``width=30``.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fxsplit.ir import units

if TYPE_CHECKING:
    from fxsplit.schedule.simulate import Timeline

__all__ = ["render_gantt", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """A duration to three significant digits (:func:`fxsplit.ir.units.format_seconds`).

    Example:
        >>> format_seconds(0.0123), format_seconds(2.5), format_seconds(4.2e-5)
        ('12.3 ms', '2.5 s', '42 us')
    """
    return units.format_seconds(seconds, significant=3)


def render_gantt(timeline: Timeline, width: int = 80) -> str:
    """Draw ``timeline`` with ``width`` columns of time.

    Args:
        timeline: A simulated step.
        width: Columns for the whole makespan (each is ``makespan / width`` seconds).

    Returns:
        The chart, one line per rank plus a time axis, ending with a newline. Actions shorter than
        a column may be hidden by their neighbours; widen the chart to see them.
    """
    width = max(1, int(width))
    span = timeline.makespan_s
    scale = width / span if span > 0 else 0.0
    names = [f"rank{r}" for r in range(timeline.schedule.num_ranks)]
    pad = max(len(n) for n in names) if names else 4
    lines = []
    for rank, name in enumerate(names):
        row = ["."] * width
        for ev in timeline.events:
            if ev.rank != rank or ev.duration_s <= 0:
                continue
            c0 = min(width - 1, int(round(ev.start_s * scale)))
            c1 = max(c0 + 1, min(width, int(round(ev.end_s * scale))))
            label = f"{ev.action.kind}{ev.action.microbatch}"
            if len(timeline.schedule.stages_of(rank)) > 1:
                label = str(ev.action)
            if len(label) > c1 - c0:  # too short to name: show the kind only, never a cut number
                label = ev.action.kind
            for k, col in enumerate(range(c0, c1)):
                row[col] = label[k] if k < len(label) else "-"
        lines.append(f"{name.ljust(pad)} |{''.join(row)}|")
    end = format_seconds(span)
    lines.append(" " * (pad + 2) + "0" + end.rjust(width - 1))
    return "\n".join(lines) + "\n"
