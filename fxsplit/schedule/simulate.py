"""Discrete-event simulation of a schedule: timeline, makespan, bubble and memory (torch-free).

Model: each rank runs its action list in order, one action at a time. An action starts when its
rank is free and its inputs have arrived: the forward of stage ``s`` needs the forward of ``s - 1``,
the backward of ``s`` its own forward and the backward of ``s + 1``. Communication is either a
*link delay* per boundary (``comm_s``: the message is in flight while both ranks compute) or
*busy time* per stage (``stage_comm_s``: the rank sends/receives itself, as :func:`fxsplit.ir.evaluate`
assumes; half is charged to each forward and half to each backward).

For balanced stages (``f + b`` equal everywhere) and no link delay, the makespan of both GPipe and
1F1B is ``Σ_s (f_s + b_s) + (m - 1) · max_s (f_s + b_s)`` and the bubble fraction
``(p - 1) / (m + p - 1)``.

References:
    Huang et al., GPipe, NeurIPS 2019, §2.3 (bubble ``O((K - 1) / (M + K - 1))``).
    Narayanan et al., PipeDream-2BW / Flush, ICML 2021, §3.1 (1F1B memory: ``p - s`` in flight).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from fxsplit.errors import ScheduleError
from fxsplit.ir.plan import Plan
from fxsplit.ir.problem import SIMULATED_SCHEDULES
from fxsplit.schedule.actions import Action, B, F, I, Schedule, W
from fxsplit.schedule.engine import execute
from fxsplit.schedule.generators import make
from fxsplit.schedule.validate import validate

__all__ = ["Event", "Timeline", "simulate", "simulate_plan", "plan_step_s", "with_loss"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    """Rank ``rank`` ran ``action`` from ``start_s`` to ``end_s`` (seconds from step start)."""

    rank: int
    action: Action
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Timeline:
    """The simulated training step.

    Attributes:
        schedule: The simulated schedule.
        events: Every action with its times, sorted by ``(rank, start_s)``.
        makespan_s: End of the last action, seconds.
        busy_s: ``[num_ranks]`` seconds each rank computes (or is busy communicating).
        peak_in_flight: ``[num_stages]`` most micro-batches whose forward has run and backward
            has not, i.e. whose activations the stage holds at once.
        peak_activation_bytes: ``[num_stages]`` ``peak_in_flight * activation_bytes`` per stage
            (0 when no activation sizes were given).
    """

    schedule: Schedule
    events: tuple[Event, ...]
    makespan_s: float
    busy_s: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    peak_activation_bytes: tuple[int, ...]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ranks over the step: ``1 - Σ busy / (ranks · makespan)``."""
        if self.makespan_s <= 0:
            return 0.0
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.makespan_s)


def simulate(
    schedule: Schedule,
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    comm_s: float | Sequence[float] = 0.0,
    activation_bytes: Sequence[int] | None = None,
    *,
    stage_comm_s: Sequence[float] | None = None,
    bwd_weight_s: Sequence[float] | None = None,
    stage_bwd_comm_s: Sequence[float] | None = None,
) -> Timeline:
    """Simulate one training step of ``schedule``.

    Args:
        schedule: The schedule; validated first.
        fwd_s: ``[num_stages]`` forward seconds of one micro-batch per stage.
        bwd_s: ``[num_stages]`` backward seconds of one micro-batch per stage.
        comm_s: Link delay per boundary, ``[num_stages - 1]`` (boundary ``s`` joins stages ``s``
            and ``s + 1``) or one float for all; paid once by each activation going forward and
            once by each gradient going back, between different ranks only. Default 0.
        activation_bytes: ``[num_stages]`` bytes one micro-batch keeps alive on a stage from its
            forward to its backward; default None (peak bytes reported as 0).
        stage_comm_s: ``[num_stages]`` communication a stage's rank is busy with per micro-batch
            (a :class:`~fxsplit.ir.StagePlan`'s ``comm_s``), half added to each F and half to each B
            unless ``stage_bwd_comm_s`` says how much of it the gradients take (the B's part).
        bwd_weight_s: ``[num_stages]`` the part of ``bwd_s`` that computes weight gradients: a
            zero-bubble schedule's ``W`` takes it and its ``I`` the rest (default 0: ``I`` is the
            whole backward). Ignored by ``B`` actions.
        stage_bwd_comm_s: ``[num_stages]`` the gradients' part of ``stage_comm_s`` (a
            :class:`~fxsplit.ir.StagePlan`'s :attr:`~fxsplit.ir.StagePlan.backward_comm_s`);
            default half.

    Returns:
        The :class:`Timeline`.

    Raises:
        ScheduleError: when the schedule is invalid or a cost list has the wrong length or a
            negative entry.

    Example:
        >>> from fxsplit.schedule.generators import gpipe
        >>> tl = simulate(gpipe(2, 4), fwd_s=[1.0, 1.0], bwd_s=[2.0, 2.0])
        >>> tl.makespan_s, round(tl.bubble_fraction, 3), tl.peak_in_flight
        (15.0, 0.2, (4, 4))
    """
    validate(schedule)
    p = schedule.num_stages
    fwd, bwd = _per_stage("fwd_s", fwd_s, p), _per_stage("bwd_s", bwd_s, p)
    busy = _per_stage("stage_comm_s", stage_comm_s if stage_comm_s is not None else [0.0] * p, p)
    back = _per_stage("stage_bwd_comm_s", stage_bwd_comm_s, p) if stage_bwd_comm_s is not None else [c / 2 for c in busy]
    send = {F: [c - min(b, c) for c, b in zip(busy, back, strict=True)], B: [min(b, c) for c, b in zip(busy, back, strict=True)]}
    send[I], send[W] = send[B], [0.0] * p
    link = _per_stage("comm_s", [comm_s] * (p - 1) if isinstance(comm_s, (int, float)) else comm_s, p - 1)
    acts = _per_stage("activation_bytes", activation_bytes if activation_bytes is not None else [0] * p, p)
    weight = _per_stage("bwd_weight_s", bwd_weight_s if bwd_weight_s is not None else [0.0] * p, p)
    part = {F: fwd, B: bwd, I: [b - min(w, b) for b, w in zip(bwd, weight, strict=True)],
            W: [min(w, b) for b, w in zip(bwd, weight, strict=True)]}

    def duration(a: Action) -> float:  # communication: values on the forward, gradients on the backward's first part
        return part[a.kind][a.stage] + send[a.kind][a.stage]

    def delay(dep: Action, a: Action) -> float:
        if dep.stage == a.stage or schedule.stage_to_rank[dep.stage] == schedule.stage_to_rank[a.stage]:
            return 0.0
        return link[min(dep.stage, a.stage)]

    run = execute(schedule, duration, delay)
    events = tuple(sorted((Event(r, a, s, e) for r, _, a, s, e in run.events), key=lambda ev: (ev.rank, ev.start_s)))
    busy_s = [0.0] * schedule.num_ranks
    for ev in events:
        busy_s[ev.rank] += ev.duration_s
    flight = peak_in_flight(schedule)
    timeline = Timeline(
        schedule=schedule,
        events=events,
        makespan_s=max((ev.end_s for ev in events), default=0.0),
        busy_s=tuple(busy_s),
        peak_in_flight=flight,
        peak_activation_bytes=tuple(int(n * b) for n, b in zip(flight, acts, strict=True)),
    )
    logger.debug("simulated %s: makespan %.6g s, bubble %.3f", schedule.name, timeline.makespan_s,
                 timeline.bubble_fraction)
    return timeline


def peak_in_flight(schedule: Schedule) -> tuple[int, ...]:
    """``[num_stages]`` most micro-batches each stage holds between forward and backward (its
    ``W`` in a zero-bubble schedule: the weight gradients read the saved inputs).

    Depends on the order alone, not on timing: a rank runs its list in order.

    Example:
        >>> from fxsplit.schedule.generators import one_f_one_b
        >>> peak_in_flight(one_f_one_b(4, 8))
        (4, 3, 2, 1)
    """
    now = [0] * schedule.num_stages
    peak = [0] * schedule.num_stages
    for _, _, a in schedule:  # a zero-bubble schedule frees a micro-batch's activations at its W
        now[a.stage] += 1 if a.kind == F else -1 if a.kind in (B, W) else 0
        peak[a.stage] = max(peak[a.stage], now[a.stage])
    return tuple(peak)


def simulate_plan(
    plan: Plan,
    schedule_kind: str | None = None,
    microbatches: int | None = None,
    *,
    activation_bytes: Sequence[int] | None = None,
    training: bool = True,
) -> Timeline:
    """Simulate a :class:`~fxsplit.ir.Plan` whose stage costs are per micro-batch.

    Each stage's ``comm_s`` (both directions, as :func:`fxsplit.ir.evaluate` charges it) is busy
    time: the values' part on each forward and the gradients' part
    (:attr:`~fxsplit.ir.StagePlan.backward_comm_s`) on each backward in training, all on the forward
    otherwise.
    With balanced stages the makespan equals ``plan.makespan_s``.

    Args:
        plan: The plan; its stages run on :attr:`~fxsplit.ir.Plan.rank_stages` (stage ``s`` on
            rank ``s`` unless a looped schedule puts several stages on one device).
        schedule_kind: A registered schedule name; default ``plan.schedule``.
        microbatches: Micro-batches per step; default ``plan.microbatches``.
        activation_bytes: ``[num_stages]`` bytes kept per micro-batch, for peak-memory reporting.
        training: False for an inference plan (no backward cost; communication on the forward).

    Returns:
        The :class:`Timeline`.

    Raises:
        ScheduleError: for an unknown schedule kind or a plan without stages.
    """
    if not plan.stages:
        raise ScheduleError("plan has no stages; solve the problem first")
    schedule = make(schedule_kind or plan.schedule, plan.num_stages, microbatches or plan.microbatches,
                    num_ranks=plan.num_ranks)
    comm = [st.comm_s for st in plan.stages]
    fwd = [st.fwd_s + (0.0 if training else c) for st, c in zip(plan.stages, comm, strict=True)]
    bwd = [st.bwd_s if training else 0.0 for st in plan.stages]
    # the first stage has no input gradient to compute: its W is its whole backward (torch's too)
    weight = [b if s == 0 else min(st.bwd_weight_s, b) for s, (st, b) in enumerate(zip(plan.stages, bwd, strict=True))]
    return simulate(schedule, fwd, bwd, activation_bytes=activation_bytes,
                    stage_comm_s=comm if training else None, bwd_weight_s=weight,
                    stage_bwd_comm_s=[st.backward_comm_s for st in plan.stages] if training else None)


def plan_step_s(plan: Plan) -> float:
    """Predicted seconds of one training step of ``plan`` (per-micro-batch stage costs).

    One stage per device (GPipe, 1F1B): the cost model's ``makespan_s``, ``Σ time_s + (m - 1) ·
    bottleneck``, what the solvers minimise (exact for balanced stages). A looped schedule
    (interleaved 1F1B) and a zero-bubble one have no such closed form: their step is simulated
    (:func:`simulate_plan`).

    Args:
        plan: The plan, costs per micro-batch, run with ``plan.microbatches`` under ``plan.schedule``.

    Example:
        >>> from fxsplit.ir import CondensedGraph, DeviceSpec, Problem, evaluate
        >>> pb = Problem(CondensedGraph.chain([1.0] * 4), (DeviceSpec("a"), DeviceSpec("b")), microbatches=4,
        ...              schedule="interleaved-1f1b")
        >>> plan = evaluate(pb, [[0], [1], [2], [3]], [0, 1, 0, 1])
        >>> plan.makespan_s, plan_step_s(plan)
        (7.0, 9.0)
    """
    if plan.schedule not in SIMULATED_SCHEDULES:
        return plan.makespan_s
    return simulate_plan(plan).makespan_s


def with_loss(plan: Plan, loss_s: float) -> Plan:
    """``plan`` with ``loss_s`` seconds per micro-batch added to its last stage's forward (the
    loss computed after it, which the plan's costs leave out when the loss was not known at
    planning) and its bottleneck and makespan recomputed; ``plan`` itself for ``loss_s <= 0``.

    Example:
        >>> from fxsplit.ir import CondensedGraph, DeviceSpec, Problem, evaluate
        >>> pb = Problem(CondensedGraph.chain([1.0, 1.0]), (DeviceSpec("a"), DeviceSpec("b")), microbatches=4)
        >>> plan = evaluate(pb, [[0], [1]])
        >>> plan_step_s(plan), plan_step_s(with_loss(plan, 0.5))
        (5.0, 7.0)
    """
    if not plan.stages or loss_s <= 0:
        return plan
    last = plan.stages[-1]
    stages = (*plan.stages[:-1], replace(last, fwd_s=last.fwd_s + loss_s))
    bottleneck = max(st.time_s for st in stages)
    makespan = sum(st.time_s for st in stages) + (plan.microbatches - 1) * bottleneck
    objective = bottleneck if plan.objective == "bottleneck" else makespan
    return replace(plan, stages=stages, bottleneck_s=bottleneck, makespan_s=makespan, objective_s=objective)


def _per_stage(name: str, values: Sequence[float] | Sequence[int], n: int) -> list[float]:
    out = [float(v) for v in values]
    if len(out) != n:
        raise ScheduleError(f"{name} has {len(out)} entries; expected {n}")
    if any(not v >= 0 for v in out):
        raise ScheduleError(f"{name}={out} has a negative or NaN entry; costs must be >= 0")
    return out
