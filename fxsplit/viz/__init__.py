"""Presentation, at the edge of fxsplit: pictures, Gantt charts, tables and text for people.

Nothing below the API imports this package (the runtime, compiler, schedule, solvers and IR hand
out plain values; ``tests/test_architecture.py`` holds the line):

* :mod:`~fxsplit.viz.draw`: :func:`draw_plan`, :func:`gantt`, :func:`draw_pipeline` (matplotlib,
  optional, imported on first use; Graphviz when installed);
* :mod:`~fxsplit.viz.dot`: :func:`to_dot`, :func:`write_dot` (the condensed graph as DOT);
* :mod:`~fxsplit.viz.text`: :func:`render_gantt`, :func:`render_shard_gantt` (ASCII Gantt charts),
  :func:`plan_summary`;
* :mod:`~fxsplit.viz.tables`: :func:`stage_table`, :func:`describe` (rich tables of a pipeline).

Byte and duration formatting is :mod:`fxsplit.ir.units`.
"""

from fxsplit.viz.dot import to_dot, write_dot
from fxsplit.viz.draw import draw_pipeline, draw_plan, gantt, stage_colors
from fxsplit.viz.tables import describe, plan_table, stage_table
from fxsplit.viz.text import plan_summary, render_gantt, render_shard_gantt

__all__ = ["describe", "draw_pipeline", "draw_plan", "gantt", "plan_summary", "plan_table", "render_gantt", "render_shard_gantt",
           "stage_colors", "stage_table", "to_dot", "write_dot"]
