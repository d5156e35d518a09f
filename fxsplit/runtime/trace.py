"""Runtime traces: when each forward and backward action of a training step really ran.

The local :class:`~fxsplit.runtime.Pipeline` owns a :class:`TraceRecorder` (``pipe.recorder``) and
wraps every forward and backward action of :meth:`~fxsplit.runtime.Pipeline.train_step` in
:func:`span`; the recorder keeps the events of the latest step only (a step starts with ``0F0``,
the first action of every schedule). :meth:`~fxsplit.runtime.Pipeline.trace` writes them as a
Chrome trace (``chrome://tracing``, https://ui.perfetto.dev): one row per stage, one complete
(``"ph": "X"``) event per action named like the schedule's actions (``"1F0"``), with start and
duration in microseconds.

The module is torch-free; timing uses :func:`time.perf_counter`. On CUDA the times are those of
the host (kernel launches), unless the stages synchronise.

References:
    Trace Event Format, https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
    (complete events ``"X"``, metadata events ``"M"``).

Example:
    >>> rec = TraceRecorder()
    >>> with span(rec, 0, "F", 0):
    ...     pass
    >>> [e.name for e in rec.events], rec.to_chrome()["traceEvents"][-1]["ph"]
    (['0F0'], 'X')
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxsplit.errors import ConfigError

__all__ = ["TraceEvent", "TraceRecorder", "span", "write_trace", "load_chrome_trace", "barrier_timed_s"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TraceEvent:
    """One action as it ran: stage ``stage`` ran ``kind`` on micro-batch ``microbatch``.

    Attributes:
        stage: Pipeline stage (the row of the trace).
        kind: ``"F"`` (forward), ``"B"`` (backward), a zero-bubble backward's halves ``"I"`` /
            ``"W"``, or ``"L"``: the loss after the last stage's forward (recorded apart across
            processes, where torch's runtime computes it outside the stage).
        microbatch: Micro-batch index.
        start_s: Seconds from the start of the step (the start of ``0F0``).
        duration_s: Seconds the action took, ``>= 0``.
    """

    stage: int
    kind: str
    microbatch: int
    start_s: float
    duration_s: float

    @property
    def name(self) -> str:
        """The schedule's name of the action, e.g. ``"1B3"``."""
        return f"{self.stage}{self.kind}{self.microbatch}"

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


class TraceRecorder:
    """Collects the :class:`TraceEvent` s of the latest training step.

    A step begins when ``0F0`` starts (every schedule starts with it), which drops the previous
    step's events; so the recorder's memory stays one step's worth of small records. With
    ``auto_step=False`` (one rank of a distributed pipeline, which may never see stage 0) a step
    begins only at :meth:`begin`. Recording keeps two ``perf_counter`` readings per action; the
    :class:`TraceEvent` s are made when :attr:`events` is first read after a step.
    """

    def __init__(self, auto_step: bool = True) -> None:
        self._raw: list[tuple[int, str, int, float, float]] = []
        self._events: list[TraceEvent] | None = []
        self._t0 = 0.0
        self.auto_step = auto_step

    @classmethod
    def from_events(cls, events: Sequence[TraceEvent]) -> TraceRecorder:
        """A recorder holding ``events`` (e.g. gathered from every rank) as its latest step."""
        rec = cls(auto_step=False)
        rec._raw = [(e.stage, e.kind, e.microbatch, e.start_s, e.end_s) for e in events]
        rec._events = None
        return rec

    def begin(self, t0: float) -> None:
        """Start a new step at ``t0`` (``time.perf_counter()``): drop the previous step's events."""
        self._raw, self._t0, self._events = [], t0, None

    def add(self, stage: int, kind: str, microbatch: int, start: float, end: float) -> None:
        """Record an action that ran from ``start`` to ``end`` (``time.perf_counter()`` values)."""
        if self.auto_step and stage == 0 and kind == "F" and microbatch == 0:
            self._raw, self._t0 = [], start
        self._raw.append((stage, kind, microbatch, start, end))
        self._events = None

    @property
    def events(self) -> list[TraceEvent]:
        """The latest step's actions in the order they were recorded."""
        events = self._events
        if events is None:
            t0 = self._t0
            events = [TraceEvent(s, k, i, a - t0, max(0.0, b - a)) for s, k, i, a, b in list(self._raw)]
            self._events = events
        return events

    @property
    def step_s(self) -> float:
        """Seconds from the start of the first to the end of the last recorded action."""
        return max((e.end_s for e in self.events), default=0.0)

    def per_stage_s(self, num_stages: int) -> list[dict[str, float]]:
        """``[num_stages]`` dicts ``{"fwd_s", "bwd_s", "bwd_weight_s", "loss_s"}``: mean seconds
        per micro-batch; a backward split into ``I`` and ``W`` (zero-bubble) counts both halves in
        ``bwd_s`` and its ``W`` in ``bwd_weight_s``; a loss recorded apart (``L``, across
        processes) counts in ``fwd_s`` and alone in ``loss_s``."""
        out = []
        for s in range(num_stages):
            mean = {}
            for kind in ("F", "L", "B", "I", "W"):
                times = [e.duration_s for e in self.events if e.stage == s and e.kind == kind]
                mean[kind] = sum(times) / len(times) if times else 0.0
            out.append({"fwd_s": mean["F"] + mean["L"], "bwd_s": mean["B"] + mean["I"] + mean["W"],
                        "bwd_weight_s": mean["W"], "loss_s": mean["L"]})
        return out

    def to_chrome(self, stage_names: Sequence[str] | None = None, process_name: str = "fxsplit pipeline") -> dict[str, Any]:
        """The events as a Chrome trace document (``{"traceEvents": [...]}``, times in µs).

        Args:
            stage_names: ``[num_stages]`` row labels (default ``"stage s"``).
            process_name: Label of the single process row group.
        """
        stages = sorted({e.stage for e in self.events} | set(range(len(stage_names or ()))))
        meta: list[dict[str, Any]] = [{"ph": "M", "pid": 0, "tid": 0, "name": "process_name", "args": {"name": process_name}}]
        for s in stages:
            label = stage_names[s] if stage_names and s < len(stage_names) else f"stage {s}"
            meta.append({"ph": "M", "pid": 0, "tid": s, "name": "thread_name", "args": {"name": label}})
            meta.append({"ph": "M", "pid": 0, "tid": s, "name": "thread_sort_index", "args": {"sort_index": s}})
        events = [
            {"name": e.name, "cat": {"F": "forward", "L": "loss"}.get(e.kind, "backward"), "ph": "X", "pid": 0, "tid": e.stage,
             "ts": e.start_s * 1e6, "dur": e.duration_s * 1e6,
             "args": {"stage": e.stage, "kind": e.kind, "microbatch": e.microbatch}}
            for e in self.events
        ]
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path, stage_names: Sequence[str] | None = None) -> Path:
        """Write :meth:`to_chrome` as JSON to ``path``; return the path.

        Raises:
            ConfigError: when no step has been recorded yet.
        """
        if not self.events:
            raise ConfigError("no training step recorded yet; call pipe.train_step(...) before pipe.trace(path)")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_chrome(stage_names)))
        log.info("wrote a trace of %d actions to %s", len(self.events), path)
        return path


@contextlib.contextmanager
def span(recorder: TraceRecorder | None, stage: int, kind: str, microbatch: int) -> Iterator[None]:
    """Time the body as action ``<stage><kind><microbatch>`` on ``recorder`` (no-op when None).

    An action that raises is not recorded.
    """
    if recorder is None:
        yield
        return
    start = time.perf_counter()
    yield
    recorder.add(stage, kind, microbatch, start, time.perf_counter())


def action_end_s(device: Any) -> float:
    """``time.perf_counter()`` once an action that ran on ``device`` (a ``torch.device``) is
    done: CUDA kernels run asynchronously, so there the current stream synchronises first."""
    if device.type == "cuda":
        import torch

        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter()


def barrier_timed_s(step: Any) -> float:
    """Seconds of ``step()`` between two barriers of the default process group, so the wall is
    the slowest rank's; collective (every rank calls it)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def write_trace(pipe: Any, path: str | Path) -> Path:
    """Write the Chrome trace of ``pipe``'s latest ``train_step`` (rows named by stage and device).

    Raises:
        ConfigError: when the pipeline has no recorder or has not trained a step yet.
    """
    recorder = getattr(pipe, "recorder", None)
    if recorder is None:
        raise ConfigError("this pipeline records no trace (pipe.recorder is None); set pipe.recorder = TraceRecorder()")
    names = [f"stage {s} ({st.device})" for s, st in enumerate(pipe.stages)]
    return recorder.write(path, names)


def load_chrome_trace(path: str | Path) -> list[TraceEvent]:
    """Read the action events of a Chrome trace written by :meth:`TraceRecorder.write`.

    Raises:
        ConfigError: when the file cannot be read or is not such a trace.
    """
    try:
        doc = json.loads(Path(path).read_text())
        return [
            TraceEvent(int(e["args"]["stage"]), str(e["args"]["kind"]), int(e["args"]["microbatch"]),
                       float(e["ts"]) / 1e6, float(e["dur"]) / 1e6)
            for e in doc["traceEvents"] if e.get("ph") == "X"
        ]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read {str(path)!r} as an fxsplit Chrome trace: {exc}") from exc
