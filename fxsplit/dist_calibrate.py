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
from fxsplit.dist_build import build_pipeline, rank_chunks, rank_stages, tied_groups, tied_holders
from fxsplit.errors import ConfigError, PlanError
from fxsplit.ir import Plan, Problem, evaluate
from fxsplit.options import CompileOptions
from fxsplit.passes.measure import gc_paused
from fxsplit.runtime.dist_state import StageState, get_tensor, materialise
from fxsplit.runtime.distributed import DistributedPipeline, _local, from_rank0
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
        split_layout: ``(layout, fallback)``, the per-layer plan every tensor-parallel stage runs
            (:func:`~fxsplit.runtime.dist_build.build_pipeline`); None without tensor parallelism.
    """

    model_fn: Callable[[], nn.Module]
    meta_model: nn.Module
    captured: Any
    inputs: tuple[tuple, dict]
    problem: Problem | None
    batch: int
    solver: str
    options: CompileOptions
    split_layout: tuple[Mapping[str, Any], Sequence[str]] | None = None


@dataclass(frozen=True)
class Held:
    """What one rank holds of one stage tensor: its local ``shape`` and, for a tensor-parallel
    shard, ``chunk = (dim, index, count)`` (:func:`~fxsplit.runtime.dist_state.chunk_bounds`);
    ``chunk`` None: the whole tensor."""

    shape: tuple[int, ...]
    chunk: tuple[int, int, int] | None = None

    def covers(self, need: tuple[int, int, int] | None) -> bool:
        """True when this piece alone gives what a stage needs (``need``: a chunk, or None for
        the whole tensor): the whole tensor covers any chunk of it."""
        return self.chunk is None or self.chunk == need


Pieces = list[tuple[int, Held]]
"""Where a rank's new tensor comes from: ``(rank, piece)`` pairs, the rank itself for what it
holds; one piece, or every chunk of the tensor in chunk order (joined on the chunks' dim)."""


def transfer_plan(old: Sequence[Mapping[str, Held]], new: Sequence[Mapping[str, tuple[int, int, int] | None]],
                  pipeline_of: Callable[[int], int]) -> list[tuple[str, int, Pieces]]:
    """For every tensor and every rank whose new stages hold it (name, then rank order): the
    pieces it takes, and from which rank; the same list on every rank (no communication).

    A rank keeps what it holds when that covers what it needs (:meth:`Held.covers`); else it
    takes one covering piece from a rank of its own pipeline (the ``[pp, dp, tp]`` mesh's
    pipeline ``pipeline_of(rank)``: the same replica and shard, so a replica keeps its own
    buffers), else from the lowest such rank; else (a whole tensor wanted where only shards are
    held) every chunk, each from the lowest rank holding it.

    Args:
        old: ``[world]``: graph name -> what each rank's old stages hold.
        new: ``[world]``: graph name -> the chunk each rank's new stages hold (None: whole).
        pipeline_of: Rank -> the index of the pipeline it belongs to.

    Raises:
        PlanError: when a tensor of the new plan is held by no rank, or not all its chunks are.
    """
    world = len(old)
    out: list[tuple[str, int, Pieces]] = []
    for name in sorted({g for names in new for g in names}):
        holders = [r for r in range(world) if name in old[r]]
        if not holders:
            raise PlanError(f"stage state {name!r} of the new plan is held by no stage of the old one; "
                            "the two plans were not cut from the same capture")
        for rank in (r for r in range(world) if name in new[r]):
            need = new[rank][name]
            if name in old[rank] and old[rank][name].covers(need):
                out.append((name, rank, [(rank, old[rank][name])]))
                continue
            home = pipeline_of(rank)
            covering = sorted((r for r in holders if old[r][name].covers(need)),
                              key=lambda r: (pipeline_of(r) != home, r))
            if covering:
                out.append((name, rank, [(covering[0], old[covering[0]][name])]))
                continue
            chunks: dict[Any, int] = {old[r][name].chunk: r for r in reversed(holders)}  # the lowest holder of each chunk
            first = old[holders[0]][name].chunk
            assert first is not None  # (internal: nothing whole is held, or it would cover)
            dim, _, count = first
            wanted = [(dim, i, count) for i in range(count)]
            if any(c not in chunks for c in wanted):
                raise PlanError(f"stage state {name!r}: ranks {holders} hold chunks {sorted(c[1] for c in chunks)} of it, not all "
                                f"{count}; the old stages cannot give it whole")
            out.append((name, rank, [(chunks[c], old[chunks[c]][name]) for c in wanted]))
    return out


def exchange_state(modules: Sequence[nn.Module], old: Sequence[Mapping[str, Held]],
                   new: Sequence[Mapping[str, tuple[int, int, int] | None]], like: nn.Module, device: torch.device,
                   pipeline_of: Callable[[int], int] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of this rank's new stages, each kept from this rank's old stages or received
    from the ranks :func:`transfer_plan` names; collective.

    Every rank walks the plan's transfers in one global order with blocking ``send``/``recv``,
    so each transfer's two ranks meet once both have finished the earlier ones. A tensor-
    parallel shard travels as the rank's local chunk; chunks joined make a whole tensor.

    Args:
        modules: This rank's old stage GraphModules (their state, on ``device``).
        old, new, pipeline_of: As :func:`transfer_plan` takes them.
        like: A module holding every name on the meta device (the capture), for dtypes.
        device: This rank's device.

    Returns:
        Graph name -> tensor, for every name of ``new[rank]``: whole, or this rank's chunk
        where it held that chunk or received it (what
        :func:`~fxsplit.runtime.dist_state.materialise` takes as a source).

    Raises:
        PlanError: as :func:`transfer_plan`.
    """
    rank = dist.get_rank()
    out: dict[str, torch.Tensor] = {}

    def held(name: str) -> torch.Tensor:
        return _local(next(get_tensor(m, name) for m in modules if name in _names(m)).detach())

    for name, taker, pieces in transfer_plan(old, new, pipeline_of or (lambda r: 0)):
        got = []
        for source, piece in pieces:
            if source == taker:
                if rank == taker:
                    got.append(held(name))
                continue
            if rank == source:
                dist.send(held(name).contiguous(), dst=taker)
            elif rank == taker:
                buf = torch.empty(piece.shape, dtype=get_tensor(like, name).dtype, device=device)
                dist.recv(buf, src=source)
                got.append(buf)
        if rank == taker:
            chunk = pieces[0][1].chunk
            out[name] = got[0] if len(got) == 1 else torch.cat(got, dim=chunk[0] if chunk is not None else 0)
    return out


def held_state(modules: Sequence[nn.Module]) -> dict[str, Held]:
    """Graph name -> what ``modules`` (one rank's stages) hold of it: a DTensor shard's local
    shape and chunk (``Shard(dim)`` over its tensor-parallel mesh), a plain tensor whole."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Held] = {}
    for module in modules:
        for name in sorted(_names(module)):
            tensor = get_tensor(module, name)
            chunk = None
            if isinstance(tensor, DTensor) and tensor.placements[0].is_shard():
                mesh = tensor.device_mesh
                chunk = (tensor.placements[0].dim, mesh.get_local_rank(), mesh.size())  # type: ignore[attr-defined]
            out[name] = Held(tuple(_local(tensor).shape), chunk)
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

        On a ``[pp, dp, tp]`` mesh (``compile(replicas=..., tensor_parallel=...)``) the mesh
        stays: rank 0's pipeline is measured (its stage times; the step wall holds the replicas'
        gradient all-reduce, timed apart as :attr:`sync_s`), the split is solved again for one
        replica's share of the batch, and every replica's pipeline is rebuilt on it, each
        tensor-parallel rank holding only its chunks (:func:`exchange_state`).

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
            ConfigError: for ``steps < 1``, a negative ``min_gain``, ``rounds < 1``, or a pipeline
                without its compile context (built by hand) or without a trace recorder.
            PlanError: on every rank, when rank 0 could not re-plan (its message).
        """
        check_calibrate_args(steps, min_gain, rounds)
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
        """Every stage's mean times over ``steps`` steps (after one warm-up) as rank 0's pipeline
        measured them, and rank 0's median step wall (barrier to barrier), the same on every rank."""
        self._recorder_or_raise()
        kept = self.buffer_values()  # the timed steps update buffers (BatchNorm, counters): put back
        with gc_paused():
            walls, per_step = self.timed_steps(*args, target=target, loss_fn=loss_fn, steps=steps, **kwargs)
        self.zero_grad(set_to_none=True)
        self.load_state_dict(kept, strict=False)
        # rank 0's pipeline's: every rank must take the same decisions (a replica measured its own)
        walls, per_step, predicted_s = from_rank0(lambda: (walls, per_step, self.predicted_step_s()))
        return stage_rows(self.running_plan(), per_step), (predicted_s, statistics.median(walls))

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
            pairs = list(zip(devices, devices[1:], strict=False))  # none for a one-stage pipeline
            probed = statistics.mean(ctx.problem.link_between(a, b).latency_s for a, b in pairs) if pairs else 0.0
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
        """Become this rank's stages of ``plan``: cut them from the capture, move the state, wrap them.

        On a ``[pp, dp, tp]`` mesh (:func:`~fxsplit.dist_build.replica_groups`) every replica's
        pipeline is cut alike; a tensor moves inside its own pipeline where it can (each replica
        keeps its own values), and a tensor-parallel rank keeps or takes only its chunk of what
        the per-layer plan splits (whole tensors are joined from chunks only where a stage needs
        one whole, a weight tied across stages)."""
        ctx = self.context
        if ctx is None:
            raise ConfigError("calibrate needs the compile context")
        mesh = self.replicas
        copies = 1 if mesh is None else mesh.count * mesh.tp  # ranks per pipeline position
        rank, world = dist.get_rank(), dist.get_world_size()
        pp = world // copies
        program = split_graph(ctx.captured.gm, plan.stage_of_block(), [str(self.device)] * plan.num_stages)
        old: list[Any] = [None] * world
        dist.all_gather_object(old, held_state([st.module.gm for st in self.stages]))
        tied_names = set(tied_holders(program))
        new: list[dict[str, tuple[int, int, int] | None]] = []
        for r in range(world):
            stages = rank_stages(program, r // copies, pp)
            wanted: dict[str, tuple[int, int, int] | None] = {g: None for st in stages for g in st.state}
            if ctx.split_layout is not None and mesh is not None and mesh.tp > 1:
                for chunks in rank_chunks(stages, ctx.split_layout[0], r % mesh.tp, mesh.tp, tied_names).values():
                    wanted.update(chunks)
            new.append(wanted)
        values = exchange_state([st.module.gm for st in self.stages], old, new, ctx.captured.gm, self.device,
                                pipeline_of=lambda r: r % copies)
        tied = tied_groups(program, world, 1 if mesh is None else mesh.count, 1 if mesh is None else mesh.tp)
        mine = [(stage, StageState(stage.state, ctx.captured.aliases)) for stage in rank_stages(program, rank // copies, pp)]
        local_shards: dict[int, dict[str, tuple[int, ...]]] = {}
        for stage, state in mine:
            shards = {g: c for g, c in new[rank].items() if c is not None and g in state.names}
            local_shards[stage.index] = {g: tuple(get_tensor(stage.gm, g).shape) for g in shards}
            source: Mapping[str, torch.Tensor] = {state.originals[g][0]: values[g] for g in state.names}
            given = {g for g in shards if tuple(values[g].shape) != tuple(get_tensor(ctx.captured.gm, g).shape)}
            materialise(stage.gm, state, self.device, state_dict=source, init_fn=None, meta_model=ctx.meta_model,
                        model_fn=None, shards=shards, chunks_given=given)
        new_pipe = build_pipeline(mine, ctx.captured, ctx.inputs, plan.num_stages, self.device, self.schedule_kind,
                                  self.microbatches, tied, plan=plan, autocast=self.autocast, meta=dict(self.meta),
                                  state_order=self.state_order, timeout_s=self.timeout_s,
                                  watchdog=self.watchdog is not None, cls=type(self), replicas=mesh,
                                  split_layout=ctx.split_layout, local_shards=local_shards,
                                  training=ctx.meta_model.training)
        new_pipe.context = ctx
        self.close()
        self.__dict__.update(new_pipe.__dict__)
        self.measure_sync_s()  # the new stages' tied copies and replicas may sit on other ranks
        log.info("rank %d: rebuilt stage(s) %s on the calibrated plan (%d tensors, %d received)", rank,
                 list(self.stage_indices), len(values), sum(1 for g in values if g not in old[rank]))

