"""Choose the schedule and micro-batch count of a plan by simulation (torch-free).

For each schedule kind and micro-batch count ``m``, the whole-batch costs of the problem are scaled
to one micro-batch, the shared cost model (:func:`fxsplit.ir.evaluate`) gives per-stage times and
memory (which grows with the micro-batches in flight), the schedule is simulated, and the fastest
step whose every stage fits its device's memory wins.

References:
    Zhao et al., "BaPipe: Exploration of Balanced Pipeline Parallelism for DNN Training",
    arXiv:2012.12544, 2020, §3 (explore schedule and micro-batch count by simulation under
    memory constraints).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from fxsplit.errors import ConfigError, InfeasibleError, ScheduleError
from fxsplit.ir.devices import GiB
from fxsplit.ir.names import LOOPED_SCHEDULES, RecomputeName
from fxsplit.ir.plan import Plan, evaluate
from fxsplit.ir.problem import Problem
from fxsplit.ir.units import format_bytes, format_seconds
from fxsplit.schedule.actions import Schedule
from fxsplit.schedule.simulate import Timeline, simulate_plan

__all__ = ["Candidate", "ScheduleChoice", "explore", "default_microbatches", "pareto_front", "MAX_DEFAULT_MICROBATCHES"]

logger = logging.getLogger(__name__)

#: Default candidates are the divisors of the batch size up to this many micro-batches.
MAX_DEFAULT_MICROBATCHES = 256


def _seconds(seconds: float) -> str:
    return format_seconds(seconds, significant=3)


@dataclass(frozen=True)
class Candidate:
    """One simulated (schedule, micro-batch count) pair.

    Attributes:
        schedule: Schedule name.
        microbatches: ``m``.
        step_time_s: Simulated seconds per training step.
        closed_form_s: The cost model's ``Σ time_s + (m - 1) · bottleneck`` (``Plan.makespan_s``).
        bubble_fraction: Idle share of the devices during the step.
        memory_bytes: ``[num_ranks]`` peak memory of each device: its stages' state and their
            activations times the micro-batches each holds at once under this schedule.
        capacity_bytes: ``[num_ranks]`` memory of each device.
        device_names: ``[num_ranks]`` name of each device.
        rank_stages: ``[num_ranks]`` the stages each device runs (one each unless looped).
        recompute: The problem's recomputation mode this candidate was costed with.
        recompute_stages: How many stages recompute their activations.
    """

    schedule: str
    microbatches: int
    step_time_s: float
    closed_form_s: float
    bubble_fraction: float
    memory_bytes: tuple[int, ...]
    capacity_bytes: tuple[int, ...]
    device_names: tuple[str, ...]
    rank_stages: tuple[tuple[int, ...], ...] = ()
    recompute: RecomputeName = "none"
    recompute_stages: int = 0

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.schedule, self.microbatches, self.recompute)

    @property
    def fits(self) -> bool:
        return all(m <= c for m, c in zip(self.memory_bytes, self.capacity_bytes, strict=True))

    @property
    def worst_rank(self) -> int:
        """The device using the largest share of its memory."""
        ratios = [m / c for m, c in zip(self.memory_bytes, self.capacity_bytes, strict=True)]
        return max(range(len(ratios)), key=ratios.__getitem__)

    def memory_note(self) -> str:
        """``"needs 31.0 GiB on stage 0 (cuda:0 has 24.0 GiB)"``, for the worst device."""
        r = self.worst_rank
        held = self.rank_stages[r] if self.rank_stages else (r,)
        where = f"stage {held[0]}" if len(held) == 1 else f"stages {', '.join(map(str, held))}"
        return (f"needs {self.memory_bytes[r] / GiB:.1f} GiB on {where} "
                f"({self.device_names[r]} has {self.capacity_bytes[r] / GiB:.1f} GiB)")

    def label(self) -> str:
        again = f", {self.recompute_stages} stage(s) recomputing" if self.recompute_stages else ""
        return f"{self.schedule} m={self.microbatches}{again}: {_seconds(self.step_time_s)}"


def pareto_front(table: Sequence[Candidate]) -> list[Candidate]:
    """The candidates that fit memory and that no other fitting one beats on both step time and
    peak memory (the largest device's), fastest first."""
    fitting = sorted((c for c in table if c.fits), key=lambda c: (c.step_time_s, max(c.memory_bytes)))
    front: list[Candidate] = []
    for c in fitting:
        if not front or max(c.memory_bytes) < max(front[-1].memory_bytes):
            front.append(c)
    return front


@dataclass(frozen=True)
class ScheduleChoice:
    """The chosen schedule and why.

    Attributes:
        schedule: The chosen, validated :class:`Schedule` (its ``name`` is the kind).
        microbatches: Chosen ``m``.
        step_time_s: Simulated seconds per training step.
        reason: One readable sentence with the numbers behind the choice.
        table_of_candidates: Every simulated candidate, in the order tried.
        plan: The per-micro-batch :class:`Plan` of the choice (from :func:`fxsplit.ir.evaluate`).
        timeline: The simulated step of the choice.
    """

    schedule: Schedule
    microbatches: int
    step_time_s: float
    reason: str
    table_of_candidates: tuple[Candidate, ...]
    plan: Plan
    timeline: Timeline
    recompute: RecomputeName = "none"

    @property
    def kind(self) -> str:
        return self.schedule.name

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.kind, self.microbatches, self.recompute)

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.table_of_candidates if c.key == self.key)

    def pareto(self) -> list[Candidate]:
        """:func:`pareto_front` of the candidates: the step-time / peak-memory trade-offs."""
        return pareto_front(self.table_of_candidates)

    def format_table(self) -> str:
        """The candidates as a text table: the choice marked ``*``, the rest of the Pareto front
        of (step time, peak memory) ``+``; ``recompute`` counts the stages that recompute."""
        head = (f"  {'schedule':<16} {'m':>5} {'recompute':>10} {'step':>10} {'formula':>10} {'bubble':>7} "
                f"{'peak mem':>10}  fits")
        rows = [head]
        front = {c.key for c in self.pareto()}
        for c in self.table_of_candidates:
            mark = "*" if c.key == self.key else "+" if c.key in front else " "
            again = f"{c.recompute_stages} ({c.recompute})" if c.recompute != "none" else "off"
            rows.append(
                f"{mark} {c.schedule:<16} {c.microbatches:>5} {again:>10} {_seconds(c.step_time_s):>10} "
                f"{_seconds(c.closed_form_s):>10} {c.bubble_fraction:>7.1%} "
                f"{format_bytes(max(c.memory_bytes)):>10}  {'yes' if c.fits else 'no: ' + c.memory_note()}"
            )
        return "\n".join(rows) + "\n  (the chosen row is starred; + marks the rest of the step-time / peak-memory front)\n"


def default_microbatches(batch_size: int) -> tuple[int, ...]:
    """Divisors of ``batch_size`` up to :data:`MAX_DEFAULT_MICROBATCHES`.

    Example:
        >>> default_microbatches(12)
        (1, 2, 3, 4, 6, 12)
    """
    return tuple(d for d in range(1, min(batch_size, MAX_DEFAULT_MICROBATCHES) + 1) if batch_size % d == 0)


def explore(
    problem: Problem,
    stages: Sequence[Sequence[int]],
    devices: Sequence[int] | None = None,
    *,
    batch_size: int,
    schedules: Sequence[str] = ("gpipe", "1f1b"),
    microbatch_candidates: Sequence[int] | None = None,
    looped: tuple[Sequence[Sequence[int]], Sequence[int]] | None = None,
) -> ScheduleChoice:
    """Pick the schedule and micro-batch count with the fastest simulated step that fits memory.

    Args:
        problem: The problem; its graph's costs are for the whole batch of ``batch_size`` samples.
        stages: ``[num_stages][*]`` block ids of each stage (as for :func:`fxsplit.ir.evaluate`).
        devices: ``[num_stages]`` device index of each stage; default ``0..num_stages-1``.
        batch_size: Samples per training step; every candidate ``m`` must be ``<= batch_size``.
        schedules: Schedule kinds to try (names the cost model knows: ``"gpipe"``, ``"1f1b"``,
            ``"interleaved-1f1b"``). A (kind, m) pair the kind cannot run is left out.
        microbatch_candidates: Micro-batch counts to try; default :func:`default_microbatches`.
            A count that does not divide the batch is costed at its largest micro-batch,
            ``ceil(batch_size / m)`` samples.
        looped: ``(stages, devices)`` of a looping placement (several stages per device) for the
            looped kinds (:data:`~fxsplit.ir.problem.LOOPED_SCHEDULES`); they are skipped without it.

    Returns:
        The :class:`ScheduleChoice`. Ties go to the smaller peak memory, then the smaller ``m``.

    Raises:
        ConfigError: for ``batch_size < 1``, a candidate outside ``1..batch_size``, or no schedules.
        InfeasibleError: when no candidate fits; names the closest one, its memory and the fix.
    """
    candidates = _check_args(batch_size, schedules, microbatch_candidates)
    devs = list(devices) if devices is not None else list(range(len(stages)))
    # Under recompute="auto" each candidate recomputes exactly the stages that need it (the
    # fastest choice); "all" adds the memory-lean end of the trade-off to the table, never chosen.
    own = problem.recompute if problem.may_recompute() else "none"  # what a candidate records (inference: none)
    modes = [problem.recompute] + (["all"] if own == "auto" else [])
    table, plans = [], {}
    for kind in schedules:
        placement = looped if kind in LOOPED_SCHEDULES else (stages, devs)
        if placement is None:
            logger.debug("explore: no looping placement given, %s skipped", kind)
            continue
        for m in candidates:
            for mode in modes:
                try:
                    cand, plan, timeline = _try(problem.with_(recompute=mode), placement[0], list(placement[1]),
                                                kind, m, batch_size)
                except ScheduleError as exc:  # e.g. interleaving m micro-batches that are no whole rounds
                    logger.debug("explore: %s m=%d cannot run: %s", kind, m, exc)
                    break
                table.append(cand)
                plans[cand.key] = (plan, timeline)
                logger.debug("explore %s", cand.label())
    fitting = [c for c in table if c.fits and c.recompute == own]
    if not table:
        raise ConfigError(f"none of the schedules {list(schedules)} can run micro-batch counts {list(candidates)}")
    if not fitting:
        raise InfeasibleError(_infeasible_message(table, batch_size))
    best = min(fitting, key=lambda c: (round(c.step_time_s, 12), max(c.memory_bytes), c.microbatches))
    plan, timeline = plans[best.key]
    reason = _reason(best, [c for c in table if c.recompute == own])
    logger.info("schedule choice: %s", reason)
    return ScheduleChoice(timeline.schedule, best.microbatches, best.step_time_s, reason, tuple(table),
                          plan, timeline, own)


def _check_args(batch_size: int, schedules: Sequence[str], candidates: Sequence[int] | None) -> tuple[int, ...]:
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} must be >= 1")
    if not schedules:
        raise ConfigError("schedules is empty; pass e.g. ('gpipe', '1f1b')")
    cands = tuple(sorted(set(candidates))) if candidates is not None else default_microbatches(batch_size)
    bad = [m for m in cands if not 1 <= m <= batch_size]
    if bad or not cands:
        raise ConfigError(
            f"micro-batch candidates {list(bad or cands)} must lie in 1..batch_size={batch_size}; "
            "each micro-batch needs at least one sample"
        )
    return cands


def _try(problem: Problem, stages: Sequence[Sequence[int]], devs: list[int], kind: str, m: int,
         batch_size: int) -> tuple[Candidate, Plan, Timeline]:
    """Cost, simulate and size one (kind, m) candidate.

    Raises:
        ScheduleError: when ``kind`` cannot run ``m`` micro-batches on this placement.
    """
    fraction = math.ceil(batch_size / m) / batch_size
    graph = problem.graph.scaled(fraction)
    pb = problem.with_(graph=graph, microbatches=m, schedule=kind)
    plan = evaluate(pb, stages, devs)
    received = [st.in_bytes if problem.transfer_memory else 0 for st in plan.stages]
    acts = [r + (0 if st.recompute else sum(graph.blocks[b].activation_bytes for b in blocks))
            for blocks, st, r in zip(stages, plan.stages, received, strict=True)]  # kept per micro-batch in flight
    timeline = simulate_plan(plan, kind, m, activation_bytes=acts, training=problem.training)
    # the cost model's in-flight count replaced by the schedule's own (exact for looped ones)
    flight = [pb.in_flight(s, len(stages)) for s in range(len(stages))]
    stage_bytes = [st.memory_bytes + a * (n - f) for st, a, n, f in
                   zip(plan.stages, acts, timeline.peak_in_flight, flight, strict=True)]
    held = plan.rank_stages
    ranks = [devs[h[0]] for h in held]
    cand = Candidate(
        schedule=kind,
        microbatches=m,
        step_time_s=timeline.makespan_s,
        closed_form_s=plan.makespan_s,
        bubble_fraction=timeline.bubble_fraction,
        memory_bytes=tuple(int(sum(stage_bytes[s] for s in h)) for h in held),
        capacity_bytes=tuple(problem.devices[d].memory_bytes for d in ranks),
        device_names=tuple(problem.devices[d].name for d in ranks),
        rank_stages=held,
        recompute=problem.recompute if problem.may_recompute() else "none",
        recompute_stages=sum(st.recompute for st in plan.stages),
    )
    return cand, plan, timeline


def _reason(best: Candidate, table: list[Candidate]) -> str:
    n_fit = sum(c.fits for c in table)
    text = (f"{best.label()} per step (bubble {best.bubble_fraction:.0%}), "
            f"the fastest of {n_fit} of {len(table)} candidates that fit memory")
    faster = sorted((c for c in table if not c.fits and c.step_time_s < best.step_time_s),
                    key=lambda c: c.step_time_s)
    if faster:
        text += f"; faster but out of memory: {faster[0].label()} {faster[0].memory_note()}"
    others = sorted((c for c in table if c.fits and c is not best), key=lambda c: c.step_time_s)
    if others:
        text += f"; runner-up: {others[0].label()}"
    return text


def _infeasible_message(table: list[Candidate], batch_size: int) -> str:
    def overflow(c: Candidate) -> float:
        return max(m / cap for m, cap in zip(c.memory_bytes, c.capacity_bytes, strict=True))

    closest = min(table, key=overflow)
    s = closest.worst_rank
    return (
        f"no schedule and micro-batch count fits memory ({len(table)} candidates tried); the closest, "
        f"{closest.schedule} with m={closest.microbatches}, {closest.memory_note()}. Fix: split the "
        f"model over more devices, use devices with at least {closest.memory_bytes[s] / GiB:.1f} GiB, "
        f"try more micro-batches (up to batch_size={batch_size}) with schedule '1f1b', "
        "or reduce activation memory (recompute='auto')"
    )
