"""Calibration in the loop across processes: measure every rank's stage, refit, re-plan, move the state.

The distributed counterpart of :meth:`fxsplit.calibrate.CompiledPipeline.calibrate`. Rank 0
planned on times profiled with one process running; in the pipeline every rank computes at once
and shares the machine (caches, memory bandwidth, the cores gloo's threads poll on), so the
stages run at other speeds than planned. :meth:`CompiledDistributedPipeline.calibrate`

1. runs a few training steps and reads every stage's forward and backward time per micro-batch
   from the ranks' runtime traces (:meth:`DistributedPipeline.stage_times_s`, collective);
2. on rank 0, refits the block costs to the measured stage times
   (:func:`fxsplit.calibrate.refit_problem`) and solves again; the decision and the new plan are
   broadcast;
3. when the new plan is predicted faster by more than ``min_gain``, every rank cuts its new stage
   from its own capture and receives the tensors it did not hold from the rank that held them
   (:func:`exchange_state`: point-to-point sends in one global order, so no rank waits on a
   rank that waits on it), then the stage runtime is rebuilt in place; otherwise the stages stay
   and their predictions take the refitted costs.

The same :class:`~fxsplit.calibrate.CalibrationReport` comes back on every rank.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxsplit.calibrate import (
    CalibrationReport,
    Measured,
    Measurement,
    calibration_loop,
    check_calibrate_args,
    fit_link_latency,
    refit_problem,
    stage_rows,
)
from fxsplit.codegen import split_graph
from fxsplit.dist_build import build_pipeline, rank_stages, tied_groups
from fxsplit.errors import ConfigError, PlanError
from fxsplit.ir import Plan, Problem, evaluate
from fxsplit.options import CompileOptions
from fxsplit.passes.measure import gc_paused
from fxsplit.runtime.dist_state import StageState, get_tensor, materialise
from fxsplit.runtime.distributed import DistributedPipeline, from_rank0
from fxsplit.runtime.trace import barrier_timed_s
from fxsplit.schedule import plan_step_s, with_loss

__all__ = ["CompiledDistributedPipeline", "DistContext", "exchange_state"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    """What :func:`fxsplit.distributed.compile` built this rank's stage from, kept so the
    pipeline can be planned and built again.

    Attributes:
        model_fn: Builds the model (for values no state source gives; unused when every tensor
            is moved between ranks).
        meta_model: The model on the meta device.
        captured: This rank's capture (meta), nodes annotated with their blocks.
        inputs: ``(args, kwargs)`` of the example batch, on the meta device.
        problem: Rank 0's planning problem (whole-batch costs); None on the other ranks.
        batch: Samples in the example batch.
        solver: The solver rank 0 runs.
        options: The ``CompileOptions``.
    """

    model_fn: Callable[[], nn.Module]
    meta_model: nn.Module
    captured: Any
    inputs: tuple[tuple, dict]
    problem: Problem | None
    batch: int
    solver: str
    options: CompileOptions


def exchange_state(modules: Sequence[nn.Module], old: Sequence[Sequence[str]], new: Sequence[Sequence[str]],
                   like: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of this rank's new stages, each taken from this rank's old stages or received
    from the first rank whose old stages held it; collective.

    For every graph state name in sorted order, the first old holder sends it to each new
    holder that did not hold it, with blocking ``send``/``recv``: every rank walks the same global
    order, so each transfer's two ranks meet once both have finished the earlier ones.

    Args:
        modules: This rank's old stage GraphModules (their state, on ``device``).
        old, new: Graph state names of every rank's old and new stages (``[world]`` lists).
        like: A module holding every name on the meta device (the capture), for shapes and dtypes.
        device: This rank's device.

    Returns:
        Graph name -> tensor, for every name of ``new[rank]``.

    Raises:
        PlanError: when a name of a new stage was held by no old stage.
    """
    rank = dist.get_rank()
    out: dict[str, torch.Tensor] = {}

    def held(name: str) -> torch.Tensor:
        return next(get_tensor(m, name) for m in modules if name in _names(m)).detach()

    for name in sorted({g for names in new for g in names}):
        holders = [r for r, names in enumerate(old) if name in names]
        if not holders:
            raise PlanError(f"stage state {name!r} of the new plan is held by no stage of the old one; "
                            "the two plans were not cut from the same capture")
        takers = [r for r, names in enumerate(new) if name in names and name not in old[r]]
        if rank == holders[0]:
            for r in takers:
                dist.send(held(name).contiguous(), dst=r)
        if rank in takers:
            meta = get_tensor(like, name)
            buf = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            dist.recv(buf, src=holders[0])
            out[name] = buf
        elif name in new[rank]:
            out[name] = held(name)
    return out


def _names(module: nn.Module) -> set[str]:
    return {n for n, _ in module.named_parameters(remove_duplicate=False)} | {n for n, _ in module.named_buffers()}


class CompiledDistributedPipeline(DistributedPipeline):
    """The :class:`DistributedPipeline` :func:`fxsplit.distributed.compile` returns: it also keeps
    its :class:`DistContext` so it can :meth:`calibrate` itself."""

    context: DistContext | None = None
    calibrated: bool = False
    """True once :meth:`calibrate` has costed the plan on measured times (every rank)."""
    loss_planned: bool = False
    """True when the plan's costs hold the loss (compile's ``loss_fn``, timed on rank 0)."""

    def running_plan(self) -> Plan:
        """The plan this pipeline runs (rank 0's, as every rank holds it)."""
        if self.plan is None:
            raise ConfigError("this pipeline was built without its plan; build it with fxsplit.distributed.compile")
        return self.plan

    def predicted_step_s(self) -> float:
        """The plan's predicted step (:func:`fxsplit.schedule.plan_step_s`), seconds, with what
        the plan could not know when it was made: the loss on the last stage per micro-batch as
        the latest gathered step measured it (:attr:`loss_s`; until :meth:`calibrate` folds the
        measured loss into the plan's costs, and not when compile costed it:
        :attr:`loss_planned`) and the all-reduces that end the step, of tied gradients and over
        the replicas (:attr:`sync_s`, timed when the pipeline was built)."""
        plan = self.running_plan()
        planned = self.calibrated or self.loss_planned
        return float(plan_step_s(plan if planned else with_loss(plan, self.loss_s))) + self.sync_s

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
        """Measure ``steps`` training steps on every rank, refit the stage costs on rank 0,
        re-plan, and rebuild every rank's stage in place when the new plan is predicted faster
        by more than ``min_gain``; collective (call on every rank with the same batch).

        Call it before creating the optimizer: a rebuild makes new stage tensors (their values
        moved between ranks). Gradients are left cleared (``None``); parameters keep their values.
        It ends on the fastest plan it measured, by the pipelined step of its measured stages (a
        rebuilt plan that measures slower by more than ``min_gain`` is undone; the wall of a few
        steps is noisier).

        Args:
            args, kwargs: A batch of the model's inputs (as for :meth:`train_step`).
            target, loss_fn: As for :meth:`train_step`.
            steps: Measured steps per plan (after one warm-up step), ``>= 1``.
            min_gain: Rebuild only when ``1 - new / old`` predicted step time exceeds this.
            rounds: Measure-refit-replan rounds at most.

        Returns:
            The same :class:`~fxsplit.calibrate.CalibrationReport` on every rank; step times are
            ``train_step`` walls between barriers, per-stage times the ranks' runtime traces.

        Raises:
            ConfigError: for replicated stages, ``steps < 1``, a negative ``min_gain``, ``rounds < 1``, or a pipeline
                without its compile context (built by hand) or without a trace recorder.
            PlanError: on every rank, when rank 0 could not re-plan (its message).
        """
        check_calibrate_args(steps, min_gain, rounds)
        if self.replicas is not None:
            raise ConfigError(f"calibrate re-plans one pipeline over every rank; this one has {self.replicas.count} "
                              f"replica(s) of each stage split over tp={self.replicas.tp} ranks (compile(replicas=..., "
                              "tensor_parallel=...)): calibrating replicated or split stages is not supported yet, "
                              "compile with replicas=1 and tensor_parallel=1 to calibrate")
        if self.context is None:
            raise ConfigError("calibrate needs the pipeline fxsplit.distributed.compile returns (it keeps what it "
                              "planned from)")

        def recalibrate(measured: list[Measurement], step_s: float) -> tuple[float, bool, tuple[float, float]]:
            running = self.running_plan()
            decision = self._from_rank0("re-plan", lambda: self._replan(measured, running, step_s, min_gain))
            new_plan = Plan.from_dict(decision["plan"])
            self.calibrated = decision["calibrated"]
            if decision["rebuild"]:
                self._rebuild(new_plan)
            else:
                self.plan = new_plan
            return decision["gain"], decision["rebuild"], (decision["probed_latency_s"], decision["fitted_latency_s"])

        def go_back(saved: tuple[Plan, float], measured: list[Measurement]) -> tuple[float, float]:
            plan, step_s = saved
            back = self._from_rank0("cost the plan to go back to", lambda: self._replan(measured, plan, step_s, None))
            self.calibrated = back["calibrated"]
            self._rebuild(Plan.from_dict(back["plan"]))
            return back["probed_latency_s"], back["fitted_latency_s"]

        speeds = self._from_rank0("read the devices' speeds", self._speeds)["speeds"]
        report = calibration_loop(self, rounds, min_gain, lambda: self._measure(args, kwargs, target, loss_fn, steps),
                                  recalibrate, go_back, lambda step_s: (self.running_plan(), step_s), speeds=speeds)
        if dist.get_rank() == 0:
            log.info("calibrate:\n%s", report.format_table())
        return report

    def timed_steps(self, *args: Any, target: Any = None, loss_fn: Callable[[Any, Any], torch.Tensor], steps: int,
                    **kwargs: Any) -> tuple[list[float], list[list[dict[str, float]]]]:
        """``steps`` training steps after one warm-up, each from zeroed gradients (as training
        runs them; this rank's gradients are left set to None before each) and timed between
        barriers; collective.

        Returns:
            This rank's step walls (seconds) and, per step, every stage's forward and backward
            seconds per micro-batch (:meth:`stage_times_s`, the same on every rank).
        """
        walls, per_step = [], []
        for i in range(steps + 1):  # the first step warms up (runners, buffers, allocator)
            self.zero_grad(set_to_none=True)
            wall = barrier_timed_s(lambda: self.train_step(*args, target=target, loss_fn=loss_fn, **kwargs))
            if i:
                walls.append(wall)
                per_step.append(self.stage_times_s())
        return walls, per_step

    def _measure(self, args: tuple, kwargs: dict, target: Any, loss_fn: Callable, steps: int) -> Measured:
        """Every stage's mean times over ``steps`` steps (after one warm-up) and rank 0's median
        step wall (barrier to barrier), the same on every rank."""
        self._recorder_or_raise()
        with gc_paused():
            walls, per_step = self.timed_steps(*args, target=target, loss_fn=loss_fn, steps=steps, **kwargs)
        self.zero_grad(set_to_none=True)
        walls = from_rank0(lambda: walls)
        return stage_rows(self.running_plan(), per_step), (self.predicted_step_s(), statistics.median(walls))

    def _speeds(self) -> dict[str, Any]:
        """Rank 0: each device's speed (reference device 1), for comparing measured plans."""
        if self.context is None or self.context.problem is None:
            return {"error": "rank 0 kept no planning problem (its capture or planning failed at compile time)"}
        return {"speeds": [d.speed for d in self.context.problem.devices]}

    def _from_rank0(self, what: str, make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Rank 0's answer, on every rank; a PlanError on every rank when it could not ``what``."""
        answer = from_rank0(make)
        if "error" in answer:
            raise PlanError(f"calibrate: rank 0 could not {what}: {answer['error']}")
        return answer

    def _replan(self, measured: Sequence[Measurement], running: Plan, step_s: float, min_gain: float | None
                ) -> dict[str, Any]:
        """Rank 0: refit the stage times to ``measured`` and the links' latency to ``running``'s
        measured ``step_s``; with ``min_gain``, solve and decide whether to rebuild, else (None)
        only cost ``running`` on the refit; a plain dict for ``broadcast_object_list``, whose
        ``calibrated`` (True: the plan is costed on measured times) every rank records in ``pipe.calibrated``."""
        from fxsplit.compiler import per_microbatch, plan_pipeline

        ctx = self.context
        if ctx is None or ctx.problem is None:
            return {"error": "rank 0 kept no planning problem (its capture or planning failed at compile time)"}
        try:
            m, kind = self.microbatches, self.schedule_kind
            stages, devices = [st.blocks for st in running.stages], [st.device for st in running.stages]
            # the all-reduces after the last backward are timed apart (sync_s), not the links'
            refit, extra = fit_link_latency(refit_problem(ctx.problem, measured, m, kind), stages, devices, m, kind,
                                            max(0.0, step_s - self.sync_s))
            probed = statistics.mean(ctx.problem.link_between(a, b).latency_s
                                     for a, b in zip(devices, devices[1:], strict=False))
            old = evaluate(per_microbatch(refit, m, kind), stages, devices, solver=running.solver, status=running.status)
            choice = plan_pipeline(refit, ctx.batch, m, kind, ctx.solver, ctx.options) if min_gain is not None else None
        except Exception as exc:  # noqa: BLE001 - sent to every rank, raised there as PlanError
            return {"error": f"{type(exc).__name__}: {exc}"}
        old_s = plan_step_s(old)
        gain = 1.0 - plan_step_s(choice.plan) / old_s if choice is not None and old_s > 0 else 0.0
        rebuild = choice is not None and min_gain is not None and gain > min_gain
        chosen = choice.plan if rebuild and choice is not None else old
        return {"gain": gain, "rebuild": rebuild, "probed_latency_s": probed, "fitted_latency_s": probed + extra,
                "plan": chosen.with_(microbatches=m, schedule=kind, stats=running.stats).to_dict(), "calibrated": True}

    def _rebuild(self, plan: Plan) -> None:
        """Become this rank's stages of ``plan``: cut them from the capture, move the state, wrap them."""
        ctx = self.context
        if ctx is None:
            raise ConfigError("calibrate needs the compile context")
        rank, world = dist.get_rank(), self.num_ranks
        program = split_graph(ctx.captured.gm, plan.stage_of_block(), [str(self.device)] * plan.num_stages)
        old: list[Any] = [None] * world
        dist.all_gather_object(old, sorted({g for st in self.stages for g in st.state.names}))
        new_names = [sorted({g for st in rank_stages(program, r, world) for g in st.state}) for r in range(world)]
        values = exchange_state([st.module.gm for st in self.stages], old, new_names, ctx.captured.gm, self.device)
        tied = tied_groups(program, world)
        mine = [(stage, StageState(stage.state, ctx.captured.aliases)) for stage in rank_stages(program, rank, world)]
        for stage, state in mine:
            source: Mapping[str, torch.Tensor] = {state.originals[g][0]: values[g] for g in state.names}
            materialise(stage.gm, state, self.device, state_dict=source, init_fn=None, meta_model=ctx.meta_model,
                        model_fn=None)
        new = build_pipeline(mine, ctx.captured, ctx.inputs, plan.num_stages, self.device, self.schedule_kind,
                             self.microbatches, tied, plan=plan, autocast=self.autocast, meta=dict(self.meta),
                             state_order=self.state_order, timeout_s=self.timeout_s,
                             watchdog=self.watchdog is not None, cls=type(self))
        new.context = ctx
        self.close()
        self.__dict__.update(new.__dict__)
        self.measure_sync_s()  # the new stages' tied copies and replicas may sit on other ranks
        log.info("rank %d: rebuilt stage(s) %s on the calibrated plan (%d tensors)", rank, list(self.stage_indices),
                 len(values))

