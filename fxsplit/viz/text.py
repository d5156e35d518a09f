"""Plans and timelines as text: ASCII Gantt charts and the one-line plan summary.

A Gantt chart has one row per rank (or device), time running left to right; an action is drawn as
its label followed by dashes over its duration (``F0--B0----``; only the kind when the number does
not fit), idle time as ``.``::

    rank0 |F0F1F2F3......B0--B1--B2--B3--|
    rank1 |..F0F1F2F3B0--B1--B2--B3--....|
           0                         15 s

(GPipe, 2 stages, 4 micro-batches, forward 1 s, backward 2 s, ``width=30``.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fxsplit.ir import units

if TYPE_CHECKING:
    from fxsplit.ir.plan import Plan
    from fxsplit.schedule.shards import ShardRun
    from fxsplit.schedule.simulate import Timeline

__all__ = ["render_gantt", "render_shard_gantt", "plan_summary"]

Span = tuple[float, float, str]
"""``(start_s, end_s, label)`` of one bar; ``label`` is written over the bar, dashes fill the rest."""


def _chart(rows: Sequence[tuple[str, Sequence[Span]]], span_s: float, width: int, fill_label: bool) -> list[str]:
    """One text line per ``(name, bars)`` row over ``width`` columns of ``span_s`` seconds, and the
    time axis. ``fill_label``: repeat the label over the whole bar (one letter per unit) instead of
    writing it once and filling with dashes."""
    width = max(1, int(width))
    pad = max((len(name) for name, _ in rows), default=4)
    lines = []
    for name, bars in rows:
        row = ["."] * width
        for start_s, end_s, label in bars:
            c0, c1 = _columns(start_s, end_s, span_s, width)
            for k, col in enumerate(range(c0, c1)):
                row[col] = label if fill_label else label[k] if k < len(label) else "-"
        lines.append(f"{name.ljust(pad)} |{''.join(row)}|")
    lines.append(" " * (pad + 2) + "0" + units.format_seconds(span_s, significant=3).rjust(width - 1))
    return lines


def _columns(start_s: float, end_s: float, span_s: float, width: int) -> tuple[int, int]:
    """The columns ``[c0, c1)`` a bar covers: at least one, inside the chart."""
    scale = width / span_s if span_s > 0 else 0.0
    c0 = min(width - 1, int(round(start_s * scale)))
    return c0, max(c0 + 1, min(width, int(round(end_s * scale))))


def render_gantt(timeline: Timeline, width: int = 80) -> str:
    """Draw a simulated step (:func:`fxsplit.schedule.simulate`) with ``width`` columns of time.

    Args:
        timeline: A simulated step.
        width: Columns for the whole makespan (each is ``makespan / width`` seconds).

    Returns:
        The chart, one line per rank plus a time axis, ending with a newline. Actions shorter than
        a column may be hidden by their neighbours; widen the chart to see them.
    """
    width = max(1, int(width))
    rows = []
    for rank in range(timeline.schedule.num_ranks):
        bars = []
        for ev in (e for e in timeline.events if e.rank == rank and e.duration_s > 0):
            label = str(ev.action) if len(timeline.schedule.stages_of(rank)) > 1 else f"{ev.action.kind}{ev.action.microbatch}"
            c0, c1 = _columns(ev.start_s, ev.end_s, timeline.makespan_s, width)
            if len(label) > c1 - c0:  # too short to name: show the kind only, never a cut number
                label = ev.action.kind
            bars.append((ev.start_s, ev.end_s, label))
        rows.append((f"rank{rank}", bars))
    return "\n".join(_chart(rows, timeline.makespan_s, width, fill_label=False)) + "\n"


def render_shard_gantt(run: ShardRun, names: Sequence[str], width: int = 80) -> str:
    """Draw a shard-parallel run (:func:`fxsplit.schedule.shards.simulate_shards`, or a measured
    one) as text: one row per device, each unit as its task's letter (``a``, ``b``, ...; upper case
    for backward units) over its duration, idle time as ``.``; a legend of the tasks follows.

    Args:
        run: The run; ``names[j]`` names task ``j``.
        width: Columns for the whole makespan.
    """
    letters = [chr(ord("a") + j % 26) for j in range(len(names))]
    rows = [(f"dev{d}", [(ev.start_s, ev.end_s, letters[ev.task].upper() if ev.unit.kind != "F" else letters[ev.task])
                         for ev in run.events if ev.device == d])
            for d in range(run.num_devices)]
    lines = _chart(rows, run.makespan_s, width, fill_label=True)
    pad = max((len(name) for name, _ in rows), default=4)
    lines.append(" " * (pad + 2) + "  ".join(f"{letters[j]}={n}" for j, n in enumerate(names)))
    return "\n".join(lines) + "\n"


def plan_summary(plan: Plan) -> str:
    """One line under a plan's table: its predicted step, bottleneck and how close the split is
    to the solver's proven bound. A looped schedule's step is simulated and its bound is that of
    the split into chunks (the solvers' objective), so both are named apart.

    Args:
        plan: A :class:`~fxsplit.ir.Plan` (costs per micro-batch).
    """
    from fxsplit.ir.problem import LOOPED_SCHEDULES
    from fxsplit.schedule import plan_step_s

    fmt = units.format_seconds
    step = f"step {fmt(plan_step_s(plan))}, bottleneck {fmt(plan.bottleneck_s)} (predicted)"
    if plan.schedule in LOOPED_SCHEDULES:
        return (f"{step}; {plan.num_stages // plan.num_ranks} stages per device, split {plan.status} for its {plan.objective} "
                f"{fmt(plan.objective_s)} (lower bound {fmt(plan.lower_bound_s)}, gap {plan.gap:.1%})")
    return f"{step}; lower bound {fmt(plan.lower_bound_s)}, gap {plan.gap:.1%}"
