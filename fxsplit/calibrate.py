"""Calibration in the loop: measure a compiled pipeline, refit its stage costs, re-plan, rebuild.

A plan is only as balanced as the costs it was solved on. :meth:`CompiledPipeline.calibrate`
runs a few training steps, reads each stage's forward and backward time per micro-batch from the
runtime trace, refits the block costs to the measured stage times (:func:`refit_problem`: at
first every block of stage ``s`` scaled by ``measured_s / predicted_s``, refined by least squares
as more plans are measured), solves again on the refitted costs, and rebuilds the pipeline in
place when the new plan is predicted to be faster by more than ``min_gain``. It reports
predicted against measured, per stage and per step, before and after.

Orchestration only: the refit is :meth:`CondensedGraph.with_time_factors`, the planning
:func:`fxsplit.compiler.plan_pipeline`, the rebuild :func:`fxsplit.compiler.assemble`.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from fxsplit.compiler import (
    CompileContext,
    CompileReport,
    PlanChoice,
    assemble_choice,
    per_microbatch,
    plan_pipeline,
)
from fxsplit.errors import ConfigError
from fxsplit.ir import Problem, evaluate
from fxsplit.ir.problem import SIMULATED_SCHEDULES
from fxsplit.passes.measure import gc_paused
from fxsplit.runtime import Pipeline
from fxsplit.schedule import make, plan_step_s, simulate

__all__ = ["CompileContext", "CompiledPipeline", "CalibrationReport", "StageTimes", "Measurement", "refit_problem",
           "check_calibrate_args", "fit_link_latency", "pipelined_step_s", "calibration_loop", "stage_rows"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageTimes:
    """One stage per micro-batch: predicted and measured forward / backward seconds (and the
    backward's weight-gradient part, which a zero-bubble schedule runs apart)."""

    stage: int
    pred_fwd_s: float
    pred_bwd_s: float
    meas_fwd_s: float
    meas_bwd_s: float
    pred_bwd_weight_s: float = 0.0
    meas_bwd_weight_s: float = 0.0

    @property
    def ratio(self) -> float:
        """Measured over predicted forward + backward time."""
        pred = self.pred_fwd_s + self.pred_bwd_s
        return (self.meas_fwd_s + self.meas_bwd_s) / pred if pred > 0 else float("nan")


@dataclass(frozen=True)
class CalibrationReport:
    """What :meth:`CompiledPipeline.calibrate` measured and did.

    Attributes:
        before, after: Per-stage predicted vs measured times of the plan before and after
            (``after`` equals ``before`` when the pipeline was not rebuilt).
        step_before_s, step_after_s: ``(predicted, measured)`` median step seconds.
        predicted_gains: Per round, ``1 - new / old`` predicted step time, both on the refitted
            costs; the pipeline was rebuilt in every round whose gain exceeded ``min_gain``.
        stages_before, stages_after: Block ids of every stage.
        link_latency_s: Across processes, ``(probed, fitted)`` seconds per message of the links:
            the ping-pong probe's latency, and the one that makes the running plan's predicted
            step equal its measured step (the runtime's per-message work, waits and the loss,
            which no stage time holds; :func:`fit_link_latency`); None for the local pipeline.
    """

    before: tuple[StageTimes, ...]
    after: tuple[StageTimes, ...]
    step_before_s: tuple[float, float]
    step_after_s: tuple[float, float]
    predicted_gains: tuple[float, ...]
    stages_before: tuple[tuple[int, ...], ...]
    stages_after: tuple[tuple[int, ...], ...]
    link_latency_s: tuple[float, float] | None = None

    def format_table(self) -> str:
        """Plain-text table: per stage and per step, predicted vs measured, before and after."""
        lines = [f"{'':8}{'stage':>6}{'pred F+B ms':>13}{'meas F+B ms':>13}{'meas/pred':>11}"]
        for label, rows, step in (("before", self.before, self.step_before_s), ("after", self.after, self.step_after_s)):
            for r in rows:
                lines.append(f"{label:8}{r.stage:>6}{(r.pred_fwd_s + r.pred_bwd_s) * 1e3:>13.3f}"
                             f"{(r.meas_fwd_s + r.meas_bwd_s) * 1e3:>13.3f}{r.ratio:>11.2f}")
            lines.append(f"{label:8}{'step':>6}{step[0] * 1e3:>13.3f}{step[1] * 1e3:>13.3f}{step[1] / step[0]:>11.2f}")
        gains = ", ".join(f"{g:+.1%}" for g in self.predicted_gains)
        lines.append(f"predicted gain per round {gains}: {'rebuilt' if self.replanned else 'kept the plan'}")
        if self.link_latency_s is not None:
            probed, fitted = self.link_latency_s
            lines.append(f"link latency per message: probed {probed * 1e6:.0f} us, fitted to the step {fitted * 1e6:.0f} us")
        return "\n".join(lines)

    @property
    def replanned(self) -> bool:
        """Whether the pipeline now runs another plan than before."""
        return self.stages_after != self.stages_before


@dataclass(frozen=True)
class Measurement:
    """One measured plan: the blocks and device of every stage, what each stage took, and which
    stages recomputed their activations (their measured backward holds a second forward)."""

    stages: tuple[tuple[int, ...], ...]
    devices: tuple[int, ...]
    times: tuple[StageTimes, ...]
    recompute: tuple[bool, ...] = ()

    @classmethod
    def of(cls, plan: Any, times: Sequence[StageTimes]) -> Measurement:
        """The measurement of ``plan`` (a :class:`~fxsplit.ir.Plan`) whose stages took ``times``."""
        return cls(tuple(tuple(st.blocks) for st in plan.stages), tuple(st.device for st in plan.stages), tuple(times),
                   tuple(st.recompute for st in plan.stages))

    def backward_s(self, s: int) -> float:
        """Stage ``s``'s measured backward without the forward a recomputing stage runs again."""
        t = self.times[s]
        again = self.recompute[s] if self.recompute else False
        return max(0.0, t.meas_bwd_s - t.meas_fwd_s) if again else t.meas_bwd_s


def stage_rows(plan: Any, per_step: Sequence[Sequence[dict[str, float]]]) -> list[StageTimes]:
    """Each stage of ``plan``: its predicted times against the median of ``per_step`` (one
    ``[num_stages]`` list of ``{"fwd_s", "bwd_s"}`` per measured step; the median, so one step
    the machine slowed does not move a stage)."""
    return [StageTimes(s, st.fwd_s, st.bwd_s, statistics.median(p[s]["fwd_s"] for p in per_step),
                       statistics.median(p[s]["bwd_s"] for p in per_step), st.bwd_weight_s,
                       statistics.median(p[s].get("bwd_weight_s", 0.0) for p in per_step))
            for s, st in enumerate(plan.stages)]


def refit_problem(problem: Problem, measurements: Sequence[Measurement], microbatches: int, kind: str) -> Problem:
    """``problem`` with block times refitted to measured stage times.

    Blocks that were in the same stage in every measured plan form a group with one unknown
    factor ``x_g`` on its times (forward and backward separately). Each measured stage ``S``
    gives one equation ``sum_g P_g,S * x_g = M_S`` (``P`` the per-micro-batch prediction of
    ``problem`` at ``microbatches``, ``M`` the measurement); the least-squares solution nearest to
    ``x = 1`` (NumPy's minimum-norm ``lstsq`` on ``x - 1``) is taken, clipped to ``>= 1e-3``. The
    runtime's work per action (:attr:`~fxsplit.ir.Problem.action_overhead_s`, which the plan adds
    to every stage) is taken off each measurement first. With
    one measured plan this is each stage's measured / predicted ratio for all its blocks; each
    further plan splits groups and refines them.

    Args:
        problem: Whole-batch costs (the compile-time problem).
        measurements: Measured plans, per micro-batch at ``microbatches`` under ``kind``.
        microbatches, kind: How the measured pipelines ran.

    Raises:
        ConfigError: when a measurement does not cover every block once.
    """
    import numpy as np

    graph = per_microbatch(problem, microbatches, kind).graph
    n = len(graph)
    for meas in measurements:
        covered = sorted(b for st in meas.stages for b in st)
        if covered != list(range(n)) or len(meas.times) != len(meas.stages):
            raise ConfigError(f"a measured plan covers blocks {covered[:8]}... of {n} with {len(meas.times)} timings "
                              f"for {len(meas.stages)} stages; measure a whole plan")
    signature = [tuple(i for meas in measurements for i, st in enumerate(meas.stages) if b in st) for b in range(n)]
    groups = sorted(set(signature))
    group_of = [groups.index(sig) for sig in signature]
    factors = []
    for attr in ("fwd_s", "bwd_s"):
        rows, rhs = [], []
        for meas in measurements:
            for s, (st, dev, t) in enumerate(zip(meas.stages, meas.devices, meas.times, strict=True)):
                row = np.zeros(len(groups))
                for b in st:
                    row[group_of[b]] += getattr(graph.blocks[b], attr) / problem.devices[dev].speed
                rows.append(row)
                # the runtime's own work per action (problem.action_overhead_s) is not the blocks'; a
                # recomputing stage's backward_s has it taken off with the forward it subtracts
                again = bool(meas.recompute[s]) if meas.recompute else False
                fixed = 0.0 if attr == "bwd_s" and again else problem.action_overhead_s
                rhs.append((t.meas_fwd_s if attr == "fwd_s" else meas.backward_s(s)) - fixed - row.sum())
        a = np.array(rows)
        y = np.linalg.lstsq(a, np.array(rhs), rcond=None)[0] if a.any() else np.zeros(len(groups))
        x = np.maximum(1.0 + y, 1e-3)
        factors.append([float(x[group_of[b]]) for b in range(n)])
    graph = problem.graph.with_time_factors(factors[0], factors[1])
    return problem.with_(graph=graph.with_weight_shares(_measured_weight_shares(measurements[-1], n)))


def _measured_weight_shares(meas: Measurement, num_blocks: int) -> list[float | None]:
    """``[num_blocks]`` the weight-gradient share of the backward each block's stage measured
    (a zero-bubble run times ``W`` apart), None where nothing says: no ``W`` was timed, or the
    first stage, whose ``W`` runs its whole backward since it has no input gradient to compute."""
    shares: list[float | None] = [None] * num_blocks
    for s, (blocks, t) in enumerate(zip(meas.stages, meas.times, strict=True)):
        if s > 0 and t.meas_bwd_weight_s > 0 and meas.backward_s(s) > 0:
            for b in blocks:
                shares[b] = min(1.0, t.meas_bwd_weight_s / meas.backward_s(s))
    return shares


def fit_link_latency(problem: Problem, stages: Sequence[Sequence[int]], devices: Sequence[int], microbatches: int,
                     kind: str, step_s: float) -> tuple[Problem, float]:
    """``problem`` with one latency added to every link so that the plan ``stages`` on
    ``devices`` is predicted (``makespan_s`` at ``microbatches`` under ``kind``) to take the
    measured ``step_s``.

    Across processes a step holds more than the stages' compute and the probed transfers: the
    runtime posts and waits on every tensor crossing a boundary, computes the loss, and
    all-reduces tied gradients. With the stage times refitted first (:func:`refit_problem`), what
    is left is charged to the links per message, which is how the planner can weigh it. The
    predicted step (:func:`fxsplit.schedule.plan_step_s`) is non-decreasing in the added latency; it is found by bisection, between
    taking every link's latency to 0 and adding a whole step.

    Returns:
        ``(problem, added seconds)``; the added seconds are negative when the probe's latency
        was more than the step shows, and 0 for a one-stage plan (no message to charge).
    """
    if len(stages) < 2:
        return problem, 0.0
    def predicted(extra: float) -> float:
        pb = per_microbatch(problem.with_latency_added(extra), microbatches, kind)
        return plan_step_s(evaluate(pb, stages, devices))  # simulated for looped and zero-bubble schedules

    lo = -max([problem.link.latency_s, *(lk.latency_s for _, _, lk in problem.links)])  # every latency 0
    hi = max(step_s, 0.0)
    if predicted(lo) >= step_s:
        extra = lo
    elif predicted(hi) <= step_s:
        extra = hi
    else:
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if predicted(mid) < step_s else (lo, mid)
        extra = 0.5 * (lo + hi)
    return problem.with_latency_added(extra), extra


def pipelined_step_s(rows: Sequence[StageTimes], microbatches: int, kind: str = "1f1b",
                     num_ranks: int | None = None) -> float:
    """The pipelined step of measured stages: what a plan is judged by here, since the local
    pipeline runs its stages in turn, in one thread, and its wall is the same for every split.

    One stage per rank: ``sum + (m - 1) x max`` of their forward+backward per micro-batch (the
    plan's makespan). A looped schedule (``kind`` with ``num_ranks`` < stages) or a zero-bubble
    one: its simulated step on the measured forward, backward and weight-gradient times
    (:func:`fxsplit.schedule.simulate`)."""
    t = [r.meas_fwd_s + r.meas_bwd_s for r in rows]
    if (num_ranks is None or num_ranks == len(rows)) and kind not in SIMULATED_SCHEDULES:
        return sum(t) + (microbatches - 1) * max(t)
    schedule = make(kind, len(rows), microbatches, num_ranks=num_ranks)
    return simulate(schedule, [r.meas_fwd_s for r in rows], [r.meas_bwd_s for r in rows],
                    bwd_weight_s=[min(r.meas_bwd_weight_s, r.meas_bwd_s) for r in rows]).makespan_s


Measured = tuple[list[StageTimes], tuple[float, float]]
"""Per-stage times of the running plan and ``(predicted, measured)`` step seconds."""


def calibration_loop(
    pipe: Any,
    rounds: int,
    min_gain: float,
    measure: Callable[[], Measured],
    recalibrate: Callable[[list[Measurement], float], tuple[float, bool, tuple[float, float] | None]],
    go_back: Callable[[Any, list[Measurement]], tuple[float, float] | None],
    snapshot: Callable[[float], Any],
    speeds: Sequence[float] | None = None,
) -> CalibrationReport:
    """The measure-refit-replan rounds of ``calibrate``, for the local and the distributed pipeline.

    Each round appends the running plan's :class:`Measurement` and calls ``recalibrate(measured,
    measured step s)``, which refits, re-plans and either rebuilds ``pipe`` or has it adopt the
    refitted costs, returning ``(predicted gain, rebuilt, link latency (probed, fitted) or None)``;
    the plan is measured again, and the rounds stop at the first one that kept the plan. It ends
    on the fastest plan measured (by :func:`pipelined_step_s`): when the last rebuilt one is
    slower by more than ``min_gain`` (the margin a rebuild had to promise, so a few noisy steps
    do not undo a rebuild), ``go_back(snapshot, measured)`` restores the ``snapshot(step s)``
    taken when the fastest ran and returns the latency.

    Plans measured minutes apart are compared at one machine speed: each pipelined step is
    scaled by the first plan's total work over its own, a stage's work being its measured time
    times its device's speed (``speeds``, by device index; equal when None). Every split runs the
    same operators, so its total work is nearly the same; what moves it between measurements
    is the machine (in CI the first plan of a 2-rank test, stages 5.8:1, measured 1.7x slower
    after two rebuilds than before them, and the rebuilds were undone). A split is judged by its
    balance, not by the moment it ran.
    """
    def work_s(rows: Sequence[StageTimes]) -> float:  # of the plan running now, in reference-device seconds
        own = Measurement.of(pipe.plan, rows)  # a second forward of a recomputing stage is not the model's work
        return sum((r.meas_fwd_s + own.backward_s(s)) * (speeds[st.device] if speeds else 1.0)
                   for s, (r, st) in enumerate(zip(rows, pipe.plan.stages, strict=True)))

    before, step_before = measure()
    reference_work_s = work_s(before)

    def judged(rows: Sequence[StageTimes]) -> float:  # under the plan running now, at the first plan's total
        step_s = pipelined_step_s(rows, pipe.microbatches, pipe.schedule_kind, pipe.plan.num_ranks)
        work = work_s(rows)
        return step_s * reference_work_s / work if work > 0 and reference_work_s > 0 else step_s

    stages_before = tuple(st.blocks for st in pipe.plan.stages)
    rows, step, gains, measured = before, step_before, [], []
    latency: tuple[float, float] | None = None
    best = (judged(before), stages_before, snapshot(step_before[1]))
    for _ in range(rounds):
        measured.append(Measurement.of(pipe.plan, rows))
        gain, rebuilt, latency = recalibrate(measured, step[1])
        gains.append(gain)
        rows, step = measure()
        log.info("calibrate: round %d: gain %+.1f%% predicted, %s; pipelined step of the measured stages %.3g s "
                 "(best so far %.3g s)", len(gains), 100 * gain, "rebuilt" if rebuilt else "kept", judged(rows), best[0])
        if rebuilt and judged(rows) < best[0]:
            best = (judged(rows), tuple(st.blocks for st in pipe.plan.stages), snapshot(step[1]))
        if not rebuilt:
            break
    if judged(rows) > best[0] * (1 + min_gain) and best[1] != tuple(st.blocks for st in pipe.plan.stages):
        log.info("calibrate: the re-planned stages measured %.3g s per pipelined step, slower than %.3g s: "
                 "going back", judged(rows), best[0])
        measured.append(Measurement.of(pipe.plan, rows))
        latency = go_back(best[2], measured)
        rows, step = measure()
    return CalibrationReport(
        before=tuple(before), after=tuple(rows), step_before_s=step_before, step_after_s=step,
        predicted_gains=tuple(gains), stages_before=stages_before,
        stages_after=tuple(st.blocks for st in pipe.plan.stages), link_latency_s=latency,
    )


def check_calibrate_args(steps: int, min_gain: float, rounds: int) -> None:
    """Raise ConfigError unless ``steps >= 1``, ``min_gain >= 0`` and ``rounds >= 1``."""
    if not isinstance(steps, int) or steps < 1 or not min_gain >= 0 or not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"calibrate(steps={steps!r}, min_gain={min_gain!r}, rounds={rounds!r}); "
                          "use steps >= 1, min_gain >= 0 and rounds >= 1")


def _replan(pipe: CompiledPipeline, ctx: CompileContext, refit: Problem) -> tuple[Any, float]:
    """The best plan on the refitted costs, and its predicted gain over the running plan's."""
    old = evaluate(per_microbatch(refit, pipe.microbatches, pipe.schedule_kind),
                   [st.blocks for st in pipe.plan.stages], [st.device for st in pipe.plan.stages])
    choice = plan_pipeline(refit, ctx.batch, ctx.microbatches, ctx.schedule, ctx.solver, ctx.options)
    old_s = plan_step_s(old)
    return choice, (1.0 - plan_step_s(choice.plan) / old_s if old_s > 0 else 0.0)


class CompiledPipeline(Pipeline):
    """The :class:`~fxsplit.runtime.Pipeline` that :func:`fxsplit.compile` returns: it also
    keeps its :class:`CompileContext` so it can :meth:`calibrate` itself, and its
    :class:`CompileReport`."""

    context: CompileContext | None = None
    report: CompileReport | None = None

    @classmethod
    def build(cls, context: CompileContext, choice: PlanChoice, report: CompileReport | None = None) -> CompiledPipeline:
        """The pipeline of ``choice``'s plan (codegen and runtime), keeping ``context`` to plan
        again from and ``report`` (its ``codegen_s`` set to the time this took)."""
        t0 = time.perf_counter()
        pipe = assemble_choice(context, choice, cls)
        pipe.context = context
        pipe.report = None if report is None else replace(report, codegen_s=time.perf_counter() - t0)
        return pipe

    def predicted_step_s(self) -> float:
        """The step time this pipeline should take here: the plan's makespan, or, when the stages
        run one after another in one thread, ``microbatches x`` the sum of the stage times."""
        if self.executor == "sequential":
            return self.microbatches * sum(st.time_s for st in self.plan.stages)
        return float(plan_step_s(self.plan))

    def calibrate(
        self,
        *args: Any,
        target: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        steps: int = 3,
        min_gain: float = 0.05,
        rounds: int = 2,
        **kwargs: Any,
    ) -> CalibrationReport:
        """Measure ``steps`` training steps, refit the stage costs, re-plan, and rebuild the
        pipeline in place when the new plan is predicted faster by more than ``min_gain``.
        It ends on the fastest plan it measured (by the pipelined step of its measured stages,
        :func:`pipelined_step_s`): a rebuilt plan that measures slower than an earlier one by more
        than ``min_gain`` is undone (on a noisy machine a refit can mislead).

        Call it before creating the optimizer: a rebuild makes new stages (tied copies are new
        tensors). Gradients are left cleared (``None``); parameters are not changed.

        Args:
            args, kwargs: A batch of the model's inputs (as for :meth:`train_step`).
            target, loss_fn: As for :meth:`train_step`.
            steps: Measured steps per plan (after one warm-up step), ``>= 1``.
            min_gain: Rebuild only when ``1 - new / old`` predicted step time exceeds this; otherwise
                the stages stay and their predictions take the refitted costs.
            rounds: Measure-refit-replan rounds at most (a rebuilt plan is measured again and
                its costs refined, since blocks that changed stage took their old stage's factor).

        Returns:
            A :class:`CalibrationReport` (``print(report.format_table())``).

        Raises:
            ConfigError: for ``steps < 1``, a negative ``min_gain``, or a pipeline not made by
                :func:`fxsplit.compile`.
        """
        base = self._context().problem
        check_calibrate_args(steps, min_gain, rounds)

        def recalibrate(measured: list[Measurement], _step_s: float) -> tuple[float, bool, None]:
            ctx = self._context()
            refit = refit_problem(base, measured, self.microbatches, self.schedule_kind)
            choice, gain = _replan(self, ctx, refit)
            if gain > min_gain:
                self._rebuild(ctx, refit, choice)
            else:
                self._adopt_costs(ctx, refit)
            return gain, gain > min_gain, None

        def go_back(saved: dict[str, Any], measured: list[Measurement]) -> None:
            self.__dict__.update(saved)
            self._adopt_costs(self._context(), refit_problem(base, measured, self.microbatches, self.schedule_kind))

        report = calibration_loop(self, rounds, min_gain, lambda: self._measure(args, kwargs, target, loss_fn, steps),
                                  recalibrate, go_back, lambda _step_s: dict(self.__dict__),
                                  speeds=[d.speed for d in self._context().problem.devices])
        log.info("calibrate:\n%s", report.format_table())
        return report

    def _context(self) -> CompileContext:
        """The context this pipeline was compiled (or last rebuilt) from."""
        if self.context is None:
            raise ConfigError("calibrate needs the pipeline fxsplit.compile returns (it keeps what it planned from)")
        return self.context

    def _measure(self, args: tuple, kwargs: dict, target: Any, loss_fn: Callable, steps: int) -> Measured:
        """Per-stage mean times over ``steps`` steps (after one warm-up) and the median step, each
        step from zeroed gradients as training runs it (accumulating onto the last step's would add
        a pass over every gradient to the step's wall)."""
        per_step, walls = [], []
        recorder = self.recorder
        if recorder is None:
            raise ConfigError("calibrate reads the runtime trace; set pipe.recorder to a TraceRecorder")
        kept = self.buffer_values()  # the timed steps update buffers (BatchNorm, counters): put back
        with gc_paused():
            for i in range(steps + 1):
                self.zero_grad(set_to_none=True)
                start = time.perf_counter()
                self.train_step(*args, target=target, loss_fn=loss_fn, **kwargs)
                if i:
                    walls.append(time.perf_counter() - start)
                    per_step.append(recorder.per_stage_s(self.num_stages))
        self.zero_grad(set_to_none=True)
        self.load_state_dict(kept, strict=False)
        return stage_rows(self.plan, per_step), (self.predicted_step_s(), statistics.median(walls))

    def _adopt_costs(self, ctx: CompileContext, refit: Problem) -> None:
        """Keep the stages, predict them with the refitted costs (the plan's times, the context)."""
        pb = per_microbatch(refit, self.microbatches, self.schedule_kind)
        plan = evaluate(pb, [st.blocks for st in self.plan.stages], [st.device for st in self.plan.stages],
                        solver=self.plan.solver, status=self.plan.status)
        self.plan = plan.with_(microbatches=self.microbatches, schedule=self.schedule_kind, graph=pb.graph)
        self.context = replace(ctx, problem=refit)

    def _rebuild(self, ctx: CompileContext, refit: Problem, choice: Any) -> None:
        """Become the pipeline of ``choice``'s plan (same model, same captured graph)."""
        new = self.build(replace(ctx, problem=refit), choice)
        new.report = None if self.report is None else replace(  # the compile's timings, the new plan's choice
            self.report, reason=choice.reason, candidates=choice.candidates, predicted_step_s=plan_step_s(choice.plan))
        self.__dict__.update(new.__dict__)
