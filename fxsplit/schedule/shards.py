"""Shard parallelism (Hydra): units of many models, a scheduler, a simulator and a bound (torch-free).

A model cut into ``S`` shards trains as a chain of *units* per step: the forward of shards
``0 .. S-2``, then the last shard's forward, loss and backward in one unit, then the backward of
shards ``S-2 .. 0``, each backward followed by the shard's optimizer step. A shard's forward
either keeps its activations (spilled to host memory until its backward) or, with
recomputation, only what it received, and its backward then runs the forward again. The units
of one model run one after another;
units of different models are independent, so a free device can run any model's next unit: that
is shard parallelism. :class:`ShardDispatcher` decides which model's next unit a free device runs
(:data:`POLICIES`); :func:`simulate_shards` drives it with estimated times to predict the makespan,
and the runtime (:mod:`fxsplit.runtime.shards`) drives the same dispatcher with measured ones.

Example:
    >>> a = ShardTask("a", shard_fwd_s=(1.0, 1.0), shard_bwd_s=(2.0, 2.0), steps=1)
    >>> [str(u) for u in a.units]
    ['F0', 'L1', 'B0']
    >>> b = ShardTask("b", shard_fwd_s=(1.0,), shard_bwd_s=(2.0,), steps=1)
    >>> run = simulate_shards([a, b], num_devices=2, policy="lrtf")
    >>> run.makespan_s, makespan_lower_bound([a, b], 2)
    (6.0, 6.0)

References:
    Nagrecha and Kumar, "Model-Parallel Model Selection for Deep Learning Systems" (SIGMOD 2021)
    and "Hydra: A System for Large Multi-Model Deep Learning" (2021): shard parallelism, spilling,
    Sharded-LRTF (longest remaining time first).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from fxsplit.errors import ConfigError, InternalError

__all__ = [
    "POLICIES",
    "ShardDispatcher",
    "ShardEvent",
    "ShardRun",
    "ShardTask",
    "ShardUnit",
    "makespan_lower_bound",
    "simulate_shards",
    "task_units",
]

#: Scheduling policies: ``"lrtf"`` (Hydra's Sharded-LRTF: the model with the longest remaining
#: time first), ``"fifo"`` (the first submitted model that is ready) and ``"round-robin"`` (the
#: ready model after the one last started, in turn).
POLICIES = ("lrtf", "fifo", "round-robin")


@dataclass(frozen=True)
class ShardUnit:
    """One unit of a model's training: ``kind`` ``"F"`` (forward of ``shard``), ``"L"`` (the last
    shard's forward, loss, backward and optimizer step) or ``"B"`` (backward, after the forward
    again when the shard recomputes, and optimizer step of ``shard``) of training step ``step``."""

    step: int
    shard: int
    kind: str
    est_s: float

    def __str__(self) -> str:
        return f"{self.kind}{self.shard}"


def task_units(shard_fwd_s: Sequence[float], shard_bwd_s: Sequence[float], steps: int,
               shard_step_s: Sequence[float] = (), recompute: bool = False) -> tuple[ShardUnit, ...]:
    """The units of ``steps`` training steps of a model with these shard times, in order.

    Args:
        shard_fwd_s: ``[num_shards]`` forward time of each shard on one mini-batch, seconds.
        shard_bwd_s: ``[num_shards]`` backward time, seconds (without the recomputed forward).
        steps: Training steps.
        shard_step_s: ``[num_shards]`` optimizer step time of each shard, seconds (default 0).
        recompute: Whether a shard's backward runs its forward again (all but the last).

    Returns:
        ``steps * (2 * num_shards - 1)`` units: per step ``F0 .. F(S-2)``, ``L(S-1)``,
        ``B(S-2) .. B0``. A ``B`` unit costs its shard's backward (plus its forward with
        ``recompute``) plus its optimizer step; ``L`` its forward, backward and step.

    Raises:
        ConfigError: for no shards, lists of different lengths, negative times or ``steps < 1``.
    """
    if not shard_fwd_s or len(shard_fwd_s) != len(shard_bwd_s):
        raise ConfigError(f"shard times: {len(shard_fwd_s)} forward and {len(shard_bwd_s)} backward values; "
                          "give one of each per shard (at least one shard)")
    if any(t < 0 for t in (*shard_fwd_s, *shard_bwd_s)):
        raise ConfigError(f"shard times must be >= 0 seconds; got forward {list(shard_fwd_s)}, "
                          f"backward {list(shard_bwd_s)}")
    if steps < 1:
        raise ConfigError(f"steps={steps}; a task trains at least 1 step")
    opt = tuple(shard_step_s) or (0.0,) * len(shard_fwd_s)
    if len(opt) != len(shard_fwd_s) or any(t < 0 for t in opt):
        raise ConfigError(f"optimizer step times {list(opt)}: give one value >= 0 per shard ({len(shard_fwd_s)})")
    last = len(shard_fwd_s) - 1
    one: list[tuple[int, str, float]] = [(s, "F", shard_fwd_s[s]) for s in range(last)]
    one.append((last, "L", shard_fwd_s[last] + shard_bwd_s[last] + opt[last]))
    again = shard_fwd_s if recompute else (0.0,) * len(shard_fwd_s)
    one += [(s, "B", again[s] + shard_bwd_s[s] + opt[s]) for s in range(last - 1, -1, -1)]
    return tuple(ShardUnit(t, s, kind, est) for t in range(steps) for s, kind, est in one)


@dataclass(frozen=True)
class ShardTask:
    """One model to train as shards.

    Args:
        name: Shown in reports.
        shard_fwd_s, shard_bwd_s: ``[num_shards]`` estimated forward and backward seconds of each
            shard on one mini-batch (see :func:`task_units`).
        steps: Training steps.
        load_s: ``[num_shards]`` seconds to bring each shard's state (parameters, optimizer
            state) to a device, 0 where it stays (CPU); defaults to zeros.
        shard_step_s: ``[num_shards]`` optimizer step seconds of each shard; defaults to zeros.
        recompute: Whether shard backwards run their forward again (see :func:`task_units`).
    """

    name: str
    shard_fwd_s: tuple[float, ...]
    shard_bwd_s: tuple[float, ...]
    steps: int = 1
    load_s: tuple[float, ...] = ()
    shard_step_s: tuple[float, ...] = ()
    recompute: bool = False
    units: tuple[ShardUnit, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", task_units(self.shard_fwd_s, self.shard_bwd_s, self.steps,
                                                     self.shard_step_s, self.recompute))
        if self.load_s and len(self.load_s) != len(self.shard_fwd_s):
            raise ConfigError(f"task {self.name!r}: {len(self.load_s)} load times for {len(self.shard_fwd_s)} shards")

    @property
    def num_shards(self) -> int:
        return len(self.shard_fwd_s)

    @property
    def total_s(self) -> float:
        """Seconds of all the task's units run back to back (its longest possible chain)."""
        return sum(u.est_s for u in self.units)


def makespan_lower_bound(tasks: Sequence[ShardTask], num_devices: int) -> float:
    """``max(total work / devices, the longest task's serial time)``, seconds: no schedule of
    these units on ``num_devices`` devices ends sooner (Hydra's bound; loads not counted).

    Raises:
        ConfigError: for ``num_devices < 1``.
    """
    if num_devices < 1:
        raise ConfigError(f"num_devices={num_devices}; shard parallelism needs at least 1 device")
    if not tasks:
        return 0.0
    return max(sum(t.total_s for t in tasks) / num_devices, max(t.total_s for t in tasks))


class ShardDispatcher:
    """Which model's next unit a free device runs, under a policy, with online re-estimation.

    The simulator and the runtime both drive it: :meth:`pick` a ready task for a free device,
    :meth:`start` it, :meth:`finish` it with the seconds it took. ``finish`` replaces the
    estimate of every later unit of the same task, shard and kind by what was measured, so
    Sharded-LRTF ranks models by their measured remaining time (Hydra's online re-estimation).

    Args:
        tasks: The models, in submission order (FIFO's order).
        policy: One of :data:`POLICIES`.

    Raises:
        ConfigError: for an unknown policy or no tasks.
    """

    def __init__(self, tasks: Sequence[ShardTask], policy: str = "lrtf") -> None:
        if policy not in POLICIES:
            raise ConfigError(f"scheduler={policy!r} is unknown; choose one of {POLICIES}")
        if not tasks:
            raise ConfigError("no tasks to schedule; give at least one")
        self.tasks = tuple(tasks)
        self.policy = policy
        self.next_unit = [0] * len(tasks)
        self.running = [False] * len(tasks)
        self._estimate: dict[tuple[int, int, str], float] = {}
        self._last_started = -1

    def estimate_s(self, task: int, unit: ShardUnit) -> float:
        """The current estimate of ``unit`` of ``task``, seconds."""
        return self._estimate.get((task, unit.shard, unit.kind), unit.est_s)

    def remaining_s(self, task: int) -> float:
        """Estimated seconds of the task's units not yet started."""
        return sum(self.estimate_s(task, u) for u in self.tasks[task].units[self.next_unit[task]:])

    def ready(self) -> list[int]:
        """Tasks with units left and none running, in submission order."""
        return [j for j, t in enumerate(self.tasks) if not self.running[j] and self.next_unit[j] < len(t.units)]

    @property
    def done(self) -> bool:
        return all(self.next_unit[j] == len(t.units) for j, t in enumerate(self.tasks)) and not any(self.running)

    def pick(self, prefer: int | None = None) -> int | None:
        """The task whose next unit runs on a free device now, or None when none is ready.

        Args:
            prefer: The task the device ran last (its shard may still be there). Under LRTF it
                keeps the device unless another task's remaining time exceeds its own by more
                than its next unit: equal models would otherwise swap after every unit, moving
                their state each time for nothing.
        """
        ready = self.ready()
        if not ready:
            return None
        if self.policy == "fifo":
            return ready[0]
        if self.policy == "round-robin":
            later = [j for j in ready if j > self._last_started]
            return later[0] if later else ready[0]
        def rank(j: int) -> tuple[float, bool, int]:
            left = self.remaining_s(j)
            if j == prefer:
                left += self.estimate_s(j, self.tasks[j].units[self.next_unit[j]])
            return (left, j == prefer, -j)

        return max(ready, key=rank)

    def start(self, task: int) -> ShardUnit:
        """Mark ``task``'s next unit running; return it.

        Raises:
            InternalError: when the task is running or has no unit left (a dispatch bug).
        """
        if self.running[task] or self.next_unit[task] >= len(self.tasks[task].units):
            raise InternalError(f"task {task} started while running or finished: this is a bug in fxsplit")
        self.running[task] = True
        self._last_started = task
        return self.tasks[task].units[self.next_unit[task]]

    def finish(self, task: int, measured_s: float | None = None) -> None:
        """Mark ``task``'s running unit done; with ``measured_s`` its later units of the same
        shard and kind are estimated at that many seconds."""
        unit = self.tasks[task].units[self.next_unit[task]]
        if measured_s is not None:
            self._estimate[(task, unit.shard, unit.kind)] = float(measured_s)
        self.running[task] = False
        self.next_unit[task] += 1


@dataclass(frozen=True)
class ShardEvent:
    """``unit`` of ``task`` ran on ``device`` from ``start_s`` to ``end_s`` (``load_s`` of it
    spent bringing the shard's state in)."""

    device: int
    task: int
    unit: ShardUnit
    start_s: float
    end_s: float
    load_s: float = 0.0


@dataclass(frozen=True)
class ShardRun:
    """A timeline of shard units on devices (simulated or measured)."""

    events: tuple[ShardEvent, ...]
    num_devices: int

    @property
    def makespan_s(self) -> float:
        return max((e.end_s for e in self.events), default=0.0)

    def busy_s(self, device: int) -> float:
        return sum(e.end_s - e.start_s for e in self.events if e.device == device)

    def utilisation(self) -> tuple[float, ...]:
        """``[num_devices]`` busy fraction of each device over the makespan."""
        span = self.makespan_s
        return tuple(self.busy_s(d) / span if span > 0 else 0.0 for d in range(self.num_devices))


def simulate_shards(tasks: Sequence[ShardTask], num_devices: int, policy: str = "lrtf", *,
                    prefetch: bool = True) -> ShardRun:
    """Predict the timeline of training ``tasks`` on ``num_devices`` identical devices.

    Whenever a device is free and a task is ready, the policy picks the task; its next unit
    starts at once (free devices in index order, as the runtime does). A unit of a shard the device does not hold pays the shard's ``load_s``
    first, or with ``prefetch`` only what the device's previous unit did not hide.

    Returns:
        The :class:`ShardRun`; its makespan is at least :func:`makespan_lower_bound`.

    Raises:
        ConfigError: for an unknown policy, no tasks or ``num_devices < 1``.
    """
    if num_devices < 1:
        raise ConfigError(f"num_devices={num_devices}; shard parallelism needs at least 1 device")
    dispatch = ShardDispatcher(tasks, policy)
    free_at = [0.0] * num_devices
    held: list[tuple[int, int] | None] = [None] * num_devices  # (task, shard) a device holds
    last_task: list[int | None] = [None] * num_devices
    last_len = [0.0] * num_devices
    finishing: list[tuple[float, int, int]] = []  # (end time, device, task)
    events: list[ShardEvent] = []
    now = 0.0
    while not dispatch.done:
        for d in range(num_devices):  # free devices in index order, as the runtime takes them
            if free_at[d] > now:
                continue
            task = dispatch.pick(prefer=last_task[d])
            if task is None:
                break
            unit = dispatch.start(task)
            load = _load_s(tasks[task], unit, held[d], (task, unit.shard), prefetch, last_len[d])
            end = now + load + unit.est_s
            events.append(ShardEvent(d, task, unit, now, end, load))
            held = [None if h == (task, unit.shard) else h for h in held]  # a shard is on one device at most
            free_at[d], held[d], last_task[d], last_len[d] = end, (task, unit.shard), task, unit.est_s
            heapq.heappush(finishing, (end, d, task))
        if not finishing:
            raise InternalError("shard simulation stalled with units left: this is a bug in fxsplit")
        now, _, task = heapq.heappop(finishing)
        dispatch.finish(task)
        while finishing and finishing[0][0] <= now:  # every unit ending at this instant
            dispatch.finish(heapq.heappop(finishing)[2])
    return ShardRun(tuple(events), num_devices)


def _load_s(task: ShardTask, unit: ShardUnit, held: tuple[int, int] | None, wanted: tuple[int, int],
            prefetch: bool, previous_s: float) -> float:
    if held == wanted or not task.load_s:
        return 0.0
    load = task.load_s[unit.shard]
    return max(0.0, load - previous_s) if prefetch else load
