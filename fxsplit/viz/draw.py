"""Pictures of plans and timelines: the graph coloured by stage, and Gantt charts (matplotlib).

* :func:`draw_plan` draws a condensed graph coloured by pipeline stage, with each stage's time and
  memory: Graphviz DOT (via :func:`fxsplit.viz.dot.to_dot`) rendered to SVG when ``dot`` is
  installed and the path ends in ``.svg`` or ``.dot``, else a matplotlib picture.
* :func:`gantt` draws a simulated :class:`~fxsplit.schedule.Timeline` and, beside it, a measured
  runtime trace (:mod:`fxsplit.runtime.trace`) on the same time axis.
* :func:`draw_pipeline` draws a compiled pipeline: its stages and their predicted timeline.

matplotlib is optional (``pip install 'fxsplit[viz]'``) and imported on first use; figures are
drawn on ``matplotlib.figure.Figure`` objects with no pyplot state, so any backend works headless.

Example:
    >>> from fxsplit.ir import CondensedGraph, DeviceSpec, Problem, evaluate
    >>> pb = Problem(CondensedGraph.chain([1.0, 2.0, 3.0]), (DeviceSpec("a"), DeviceSpec("b")))
    >>> import tempfile, pathlib
    >>> out = draw_plan(evaluate(pb, [[0, 1], [2]]), pb.graph, pathlib.Path(tempfile.mkdtemp()) / "plan.png")
    >>> out.stat().st_size > 0
    True
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fxsplit.errors import ConfigError
from fxsplit.ir.graph import CondensedGraph
from fxsplit.ir.plan import Plan
from fxsplit.ir.units import bytes_unit, format_bytes, format_seconds
from fxsplit.viz.dot import to_dot

__all__ = ["draw_plan", "gantt", "draw_pipeline", "stage_colors"]

log = logging.getLogger(__name__)

_INSTALL = "pip install 'fxsplit[viz]'  (or: pip install matplotlib)"


def _figure(width_in: float, height_in: float) -> Any:
    """A pyplot-free matplotlib ``Figure``; :class:`ConfigError` saying how to install it."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError(f"pictures need matplotlib: {_INSTALL}") from exc
    return Figure(figsize=(width_in, height_in), layout="constrained")


def stage_colors(n: int) -> list[Any]:
    """``n`` distinct RGBA colours (matplotlib's ``tab10``/``tab20``), one per stage."""
    try:
        from matplotlib import colormaps
    except ImportError as exc:
        raise ConfigError(f"pictures need matplotlib: {_INSTALL}") from exc
    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    log.info("wrote %s", path)
    return path


def _stage_label(plan: Plan, s: int, device_names: Sequence[str] | None) -> str:
    st = plan.stages[s]
    dev = device_names[st.device] if device_names and st.device < len(device_names) else f"device {st.device}"
    return (f"stage {s} on {dev}: {format_seconds(st.time_s)}/mb "
            f"(F {format_seconds(st.fwd_s)}, B {format_seconds(st.bwd_s)}, comm {format_seconds(st.comm_s)}), "
            f"{format_bytes(st.memory_bytes)}")


# -- the plan ---------------------------------------------------------------------------------
def draw_plan(
    plan: Plan,
    graph: CondensedGraph,
    path: str | Path,
    *,
    device_names: Sequence[str] | None = None,
    title: str = "",
) -> Path:
    """Draw ``graph`` with every block coloured by its stage in ``plan``.

    Args:
        plan: The split; ``plan.stages[s].blocks`` index ``graph.blocks``.
        graph: The condensed graph the plan was solved on.
        path: Output file. ``.svg`` or ``.dot`` with Graphviz's ``dot`` on PATH: a DOT file (and
            SVG) of the graph with one label line per stage; otherwise (``.png``, ``.pdf``, or no
            ``dot``) a matplotlib picture: blocks by depth, edges, and bars of each stage's time
            (forward / backward / communication per micro-batch) and memory.
        device_names: ``[num_devices]`` names for the labels (default ``"device i"``).
        title: Title of the picture.

    Returns:
        The path written (for DOT, the ``.svg`` when it was rendered, else the ``.dot``).

    Raises:
        ConfigError: when matplotlib is needed and missing, or the plan does not fit the graph.
    """
    path = Path(path)
    stage_of = plan.stage_of_block()
    missing = [b.id for b in graph.blocks if b.id not in stage_of]
    if missing:
        raise ConfigError(f"plan does not cover blocks {missing[:10]} of graph {graph.name!r}; pass the graph it was solved on")
    title = title or f"{graph.name}: {plan.num_stages} stages, bottleneck {format_seconds(plan.bottleneck_s)}"
    if path.suffix in (".svg", ".dot") and shutil.which("dot"):
        return _draw_plan_dot(plan, graph, path, stage_of, device_names, title)
    if path.suffix == ".dot":
        raise ConfigError("a .dot picture needs Graphviz's dot (apt-get install graphviz); use .svg or .png")
    return _draw_plan_mpl(plan, graph, path, stage_of, device_names, title)


def _draw_plan_dot(plan: Plan, graph: CondensedGraph, path: Path, stage_of: dict[int, int],
                   device_names: Sequence[str] | None, title: str) -> Path:
    lines = [title] + [_stage_label(plan, s, device_names) for s in range(plan.num_stages)]
    dot_path = path.with_suffix(".dot")
    dot_path.parent.mkdir(parents=True, exist_ok=True)
    dot_path.write_text(to_dot(graph, stage_of, "\\l".join(x.replace('"', "'") for x in lines) + "\\l"))
    if path.suffix == ".dot":
        return dot_path
    try:
        subprocess.run([str(shutil.which("dot")), "-Tsvg", str(dot_path), "-o", str(path)],
                       check=True, capture_output=True, timeout=120)
    except (subprocess.SubprocessError, OSError) as exc:
        log.warning("dot could not render %s (%s); drawing with matplotlib", dot_path, exc)
        return _draw_plan_mpl(plan, graph, path, stage_of, device_names, title)
    return path


def _layout(graph: CondensedGraph) -> tuple[list[int], list[int]]:
    """``(depth, slot)`` of every block: longest-path depth from a source, slot within the depth."""
    depth = [0] * len(graph)
    for b in graph.blocks:
        for p in graph.predecessors(b.id):
            depth[b.id] = max(depth[b.id], depth[p] + 1)
    slot, used = [0] * len(graph), dict[int, int]()
    for b in graph.blocks:
        slot[b.id] = used.get(depth[b.id], 0)
        used[depth[b.id]] = slot[b.id] + 1
    return depth, slot


def _draw_plan_mpl(plan: Plan, graph: CondensedGraph, path: Path, stage_of: dict[int, int],
                   device_names: Sequence[str] | None, title: str) -> Path:
    depth, slot = _layout(graph)
    width = max(depth, default=0) + 1
    fig = _figure(min(16.0, 4.0 + 0.25 * width), 7.5)
    top, bottom = fig.subfigures(2, 1, height_ratios=(3, 2))
    ax = top.subplots()
    colors = stage_colors(plan.num_stages)
    for e in graph.edges:
        ax.plot([depth[e.src], depth[e.dst]], [-slot[e.src], -slot[e.dst]], color="0.75", lw=0.6, zorder=1)
    big = len(graph) > 60
    for b in graph.blocks:
        s = stage_of[b.id]
        ax.scatter(depth[b.id], -slot[b.id], s=18 if big else 140, color=colors[s], edgecolors="0.2",
                   linewidths=0.3, zorder=2)
        if not big:
            ax.annotate(f"{b.id}", (depth[b.id], -slot[b.id]), ha="center", va="center", fontsize=6, zorder=3)
    for s in range(plan.num_stages):
        ax.scatter([], [], color=colors[s], label=_stage_label(plan, s, device_names))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02), fontsize=7, frameon=False, ncol=1 if plan.num_stages <= 4 else 2)
    ax.set_title(f"{title}\n(blocks by depth from the inputs; colour: stage)", fontsize=10)
    ax.set_yticks([])
    ax.tick_params(labelsize=7)
    _stage_bars(bottom, plan, colors)
    return _save(fig, path)


def _stage_bars(fig: Any, plan: Plan, colors: Sequence[Any]) -> None:
    """Bars of each stage's forward/backward/communication time and memory."""
    ax_t, ax_m = fig.subplots(1, 2)
    xs = list(range(plan.num_stages))
    fwd = [st.fwd_s * 1e3 for st in plan.stages]
    bwd = [st.bwd_s * 1e3 for st in plan.stages]
    comm = [st.comm_s * 1e3 for st in plan.stages]
    ax_t.bar(xs, fwd, color=colors, label="forward")
    ax_t.bar(xs, bwd, bottom=fwd, color=colors, alpha=0.55, hatch="//", label="backward")
    ax_t.bar(xs, comm, bottom=[f + b for f, b in zip(fwd, bwd, strict=True)], color="0.6", label="communication")
    ax_t.axhline(plan.bottleneck_s * 1e3, color="k", lw=0.8, ls="--", label="bottleneck")
    ax_t.set_title("time per micro-batch (ms)", fontsize=9)
    ax_t.legend(fontsize=7)
    peak = max((st.memory_bytes for st in plan.stages), default=0)
    unit, scale = bytes_unit(peak, largest="GiB")
    ax_m.bar(xs, [st.memory_bytes / scale for st in plan.stages], color=colors)
    ax_m.set_title(f"memory ({unit})", fontsize=9)
    for ax in (ax_t, ax_m):
        ax.set_xticks(xs, [f"stage {s}" for s in xs], fontsize=7)
        ax.tick_params(labelsize=7)


# -- timelines --------------------------------------------------------------------------------
def _rows(source: Any) -> list[tuple[int, str, int, float, float]]:
    """``(row, kind, microbatch, start_s, duration_s)`` of a Timeline, a trace or a trace file."""
    from fxsplit.runtime.trace import TraceEvent, TraceRecorder, load_chrome_trace

    if isinstance(source, str | Path):
        source = load_chrome_trace(source)
    if getattr(source, "recorder", None) is not None:  # a Pipeline
        source = source.recorder
    if isinstance(source, TraceRecorder):
        source = source.events
    events = getattr(source, "events", source)
    rows = []
    for e in events:
        if isinstance(e, TraceEvent):
            rows.append((e.stage, e.kind, e.microbatch, e.start_s, e.duration_s))
        elif hasattr(e, "action"):
            rows.append((e.rank, e.action.kind, e.action.microbatch, e.start_s, e.end_s - e.start_s))
        else:
            raise ConfigError(f"cannot draw {type(e).__name__} as a timeline event; pass a Timeline, TraceRecorder or trace path")
    return rows


def _draw_rows(ax: Any, rows: Sequence[tuple[int, str, int, float, float]], title: str) -> None:
    try:
        from matplotlib import colormaps
    except ImportError as exc:  # pragma: no cover - _figure raised first
        raise ConfigError(f"pictures need matplotlib: {_INSTALL}") from exc
    cmap = colormaps["tab20"]
    span = max((s + d for _, _, _, s, d in rows), default=0.0)
    for r, kind, mb, start, dur in rows:
        color = cmap((2 * mb + (kind != "F")) % cmap.N)
        ax.barh(r, dur * 1e3, left=start * 1e3, height=0.8, color=color, edgecolor="0.2", linewidth=0.3,
                hatch="//" if kind != "F" else None)
        if span > 0 and dur / span > 0.025:
            ax.text((start + dur / 2) * 1e3, r, f"{kind}{mb}", ha="center", va="center", fontsize=6)
    n = max((r for r, *_ in rows), default=0) + 1
    ax.set_yticks(range(n), [f"stage {r}" for r in range(n)], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms from step start", fontsize=8)
    ax.set_title(f"{title}: {span * 1e3:.2f} ms", fontsize=9)
    ax.tick_params(labelsize=7)


def gantt(timeline: Any, path: str | Path, measured: Any = None, *, title: str = "") -> Path:
    """Draw a Gantt chart: the predicted timeline and, beside it, the measured one.

    Args:
        timeline: The prediction, a :class:`~fxsplit.schedule.Timeline` (``simulate`` /
            ``simulate_plan``) — or any source ``measured`` accepts.
        path: Output file, ``.png``, ``.svg`` or ``.pdf``.
        measured: Optional measured run: a :class:`~fxsplit.runtime.trace.TraceRecorder`, a
            pipeline (its recorder), a list of trace events, or a Chrome trace file written by
            ``pipe.trace(path)``. Drawn on the right on the same time axis.
        title: Figure title.

    Returns:
        ``path``.

    Raises:
        ConfigError: when matplotlib is missing or a source is not a timeline.
    """
    predicted = _rows(timeline)
    actual = _rows(measured) if measured is not None else None
    ranks = max((r for r, *_ in predicted + (actual or [])), default=0) + 1
    fig = _figure(12.0 if actual is not None else 7.0, 1.2 + 0.45 * ranks)
    axes = fig.subplots(1, 2 if actual is not None else 1, sharey=True, squeeze=False)[0]
    _draw_rows(axes[0], predicted, "predicted (simulator)")
    if actual is not None:
        _draw_rows(axes[1], actual, "measured (runtime trace)")
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def draw_pipeline(pipe: Any, path: str | Path, *, graph: CondensedGraph | None = None) -> Path:
    """Draw a compiled pipeline: its plan and predicted timeline, and the last measured step.

    With ``graph`` (the condensed graph from :func:`fxsplit.inspect` or the compiler's front
    end) the picture is :func:`draw_plan`'s; without, a Gantt chart of the plan's simulated
    step, with the measured one beside it once ``pipe.train_step`` has run, titled with every
    stage's device, time and memory.

    Raises:
        ConfigError: for a pipeline without a plan, or when matplotlib is missing.
    """
    plan = getattr(pipe, "plan", None)
    if plan is None:
        raise ConfigError("this pipeline has no plan to draw; build it with fxsplit.compile")
    names = [st.device for st in pipe.stages]
    if graph is not None:
        return draw_plan(plan, graph, path, device_names=names)
    from fxsplit.schedule import simulate_plan

    timeline = simulate_plan(plan, pipe.schedule_kind, pipe.microbatches)
    recorder = getattr(pipe, "recorder", None)
    measured = recorder if recorder is not None and recorder.events else None
    by_device = {st.device: names[s] for s, st in enumerate(plan.stages)}
    device_names = [by_device.get(d, f"device {d}") for d in range(max(by_device) + 1)]
    lines = "\n".join(_stage_label(plan, s, device_names) for s in range(plan.num_stages))
    return gantt(timeline, path, measured, title=f"{pipe.schedule_kind}, {pipe.microbatches} micro-batches\n{lines}")
