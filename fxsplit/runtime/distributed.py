"""The distributed pipeline: this rank's stages under a ``torch.distributed.pipelining`` schedule.

Global rank ``r`` of ``R`` runs stages ``r, r + R, r + 2R, ...`` (looping placement: one stage per
rank, or several under interleaved 1F1B). Communication is torch's, not ours:

* activations and their gradients travel through ``PipelineStage`` (built from
  :class:`~fxsplit.runtime.dist_stage.StageModule`, which puts lists, scalars and ``None`` crossing
  a boundary into tensors) under the very action lists the local pipeline runs and the explorer
  simulated (:func:`fxsplit.schedule.make`), lowered onto torch's ``_PipelineScheduleRuntime``
  (:mod:`fxsplit.runtime.dist_schedule`); the shapes on the wire
  are given to ``PipelineStage`` up front (:class:`~fxsplit.runtime.dist_shapes.WireShapes`), so
  no stage runs on placeholder buffers;
* the loss is weighted by each micro-batch's share of the batch inside the loss function given
  to the schedule (``scale_grads=False``), so gradients equal those of the unsplit model's
  mean-reduced loss; a schedule needs equal micro-batches (``PipelineStage`` sizes its receive
  buffers by the first one), so a batch that splits unevenly runs as two schedules, one per
  micro-batch size, over the same module (gradients accumulate across them);
* tied tensors (a tied embedding and LM head in the first and last stage) get their gradients
  summed over the copies a rank holds, then with ``torch.distributed.all_reduce`` over a subgroup
  of the ranks holding a copy (plain ``torch.distributed``: the schedules know nothing of tied
  weights);
* the loss is broadcast from the last rank with ``torch.distributed.broadcast`` when asked;
* fp16 loss scaling (``train_step(grad_scaler=pipe.grad_scaler())``): the last rank scales each
  micro-batch's loss before backward, and torch's ``ShardedGradScaler`` all-reduces the overflow
  check over the ranks, so all of them skip or take the optimizer step together
  (:mod:`fxsplit.runtime.dist_scaler`).

References:
    torch.distributed.pipelining, https://pytorch.org/docs/stable/distributed.pipelining.html;
    Huang et al., "GPipe", NeurIPS 2019; Narayanan et al., "Memory-efficient pipeline-parallel
    DNN training" (1F1B), ICML 2021; Narayanan et al., "Efficient large-scale language model
    training on GPU clusters using Megatron-LM" (interleaved 1F1B), SC 2021.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleLoopedBFS

from fxsplit.checkpoint import PLAN_FILE, commit, next_version, shard_name, write_atomic
from fxsplit.errors import ConfigError, ExecutionError
from fxsplit.ir import Plan
from fxsplit.options import autocast_dtype, precision
from fxsplit.passes.capture import BatchLayout, InputGuard, flatten_to_spec, unflatten_to_spec
from fxsplit.runtime.dist_faults import Progress, Watchdog
from fxsplit.runtime.dist_scaler import (
    ShardedGradScaler,
    pipeline_grad_scaler,
    prepare_grad_scaler,
    scale_loss,
)
from fxsplit.runtime.dist_schedule import lowered_schedule
from fxsplit.runtime.dist_shapes import WireShapes
from fxsplit.runtime.dist_stage import SplitBackwardStage, StageModule
from fxsplit.runtime.dist_state import StageState, get_tensor
from fxsplit.runtime.microbatch import (
    LossReductions,
    batch_size_of,
    check_loss_pair,
    check_splittable,
    merge_outputs,
    microbatch_sizes,
    target_batch_dim,
)
from fxsplit.runtime.state import ParameterAPI, check_loadable, check_mode, grad_norm
from fxsplit.runtime.trace import TraceEvent, TraceRecorder, action_end_s
from fxsplit.schedule import make

__all__ = ["DistributedPipeline", "RankStage", "Replicas", "TiedGroup", "from_rank0", "rank_of", "shard_name",
           "PLAN_FILE"]

log = logging.getLogger(__name__)

#: Steps of each loss function on which every two consecutive micro-batches' joint loss is
#: checked (:meth:`DistributedPipeline._check_pair`).
PAIR_CHECK_STEPS = 3

T = TypeVar("T")


def rank_of(stage: int, num_ranks: int) -> int:
    """The rank that runs ``stage``: looping placement, stage ``s`` on rank ``s mod R`` (torch's
    ``generate_stage_to_rank_mapping`` default, the placement fxsplit's looped plans use)."""
    return stage % num_ranks


def from_rank0(make: Callable[[], T]) -> T:
    """``make()`` on rank 0, broadcast to every rank; collective."""
    box: list[Any] = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass(frozen=True)
class TiedGroup:
    """A tensor with a copy in several stages, and the process group that sums its gradient
    across the ranks holding them (None when every copy is on this rank)."""

    name: str
    ranks: tuple[int, ...]
    group: Any


@dataclass(frozen=True)
class Replicas:
    """This rank's place in a ``[pp, dp, tp]`` mesh of pipelines (rank ``(s * dp + d) * tp + t``
    runs stage ``s`` of replica ``d``, tensor-parallel shard ``t``).

    PipeDream's stage replication: ``count`` (``dp``) pipelines run side by side on their own
    ``pipeline_group``, each on its ``1/count`` share of every batch, and the gradients of each
    stage are averaged over its replicas' ``group`` after each step (as DDP does). Tensor
    parallelism inside a stage: the ``tp`` ranks of a stage run one pipeline each on the same
    share, every stage's ops split over them as a per-layer plan says (``tp_mesh``, DTensor);
    values cross stage boundaries whole, so each of the ``tp`` pipelines sends and receives
    whole activations and gradients.

    Attributes:
        count: ``dp``, the replicas of every stage.
        index: This rank's replica, ``0 <= index < count`` (its share of the batch).
        group: The process group of this rank's stage replicas (gradient all-reduce; the ranks
            with this rank's stage and ``t``); None when ``count == 1``.
        pipeline_group: The process group of this rank's pipeline (point-to-point, loss).
        tp: Ranks each stage's ops are split over.
        tp_index: This rank's shard, ``0 <= tp_index < tp``.
        tp_mesh: The 1-D ``DeviceMesh`` of this rank's stage shards (None when ``tp == 1``).
        copies_group: Every rank holding this rank's stage (``dp * tp`` ranks; the stage's
            weights start as its first rank's).
    """

    count: int
    index: int
    group: Any
    pipeline_group: Any
    tp: int = 1
    tp_index: int = 0
    tp_mesh: Any = None
    copies_group: Any = None

    @property
    def first_copy(self) -> int:
        """The global rank of the first rank holding this rank's stage (replica 0, shard 0)."""
        return (dist.get_rank() // (self.count * self.tp)) * self.count * self.tp

    @property
    def writes(self) -> bool:
        """Whether this rank writes its stage's checkpoint shard (replica 0, shard 0 does)."""
        return self.index == 0 and self.tp_index == 0


@dataclass(frozen=True)
class RankStage:
    """One stage a rank runs.

    Attributes:
        module: Its :class:`StageModule` (materialised on the rank's device).
        state: Names of its state (graph and original).
        index: Its global stage index.
        shapes: Its wire shapes at any micro-batch size; None lets ``PipelineStage`` infer them
            (only safe when no Python scalar crosses a boundary).
    """

    module: StageModule
    state: StageState
    index: int
    shapes: WireShapes | None = None


class DistributedPipeline(ParameterAPI):
    """This rank's stages of a pipeline over processes (one stage per rank, or several in looping
    placement under a looped schedule).

    Build it with :func:`fxsplit.distributed.compile` on every rank. ``train_step`` and
    ``__call__`` are collective: every rank calls them with the same batch (only the first rank
    reads the inputs and only the last reads the target).

    Args:
        stages: The :class:`RankStage` s this rank runs (stage ``s`` on rank ``s mod R``).
        num_stages: The pipeline length (a multiple of the world size ``R``).
        device: Where the stages run.
        schedule_kind: A registered schedule (:func:`fxsplit.schedule.available`).
        microbatches: Micro-batches per step.
        in_spec, out_spec: Pytree specs of the model's ``(args, kwargs)`` and outputs.
        tied: Tensors with copies in several stages that this rank holds one of.
        state_order: The original model's ``state_dict`` keys, in order.
        meta: Plan and description written by :meth:`save`.
        timeout_s: Seconds a rank waits for a peer before failing; the watchdog ends the
            process past it plus a grace period.
        watchdog: Start the :class:`~fxsplit.runtime.dist_faults.Watchdog`.
        batched_inputs: Which flat inputs carry the batch on dim 0 (``[num_inputs]``, the same
            on every rank: every rank splits the batch into the same micro-batch sizes); None:
            the first stage's ``module.batched``, or every tensor input.
        batched_outputs: Which flat outputs carry the batch (``Captured.batched_outputs``;
            None, or None for an output: those whose dim 0 is the micro-batch size).
        input_guards: ``Captured.guards``: what the capture fixed of the inputs, checked on
            every call (a ``ConfigError`` for another value).
        size_outputs: ``Captured.size_output_values``: the batch's value of each output that
            is a number of the inputs' sizes.
        training: The mode the model was captured in: :meth:`train` / :meth:`eval` refuse
            another (None: not known).
        layout: ``Captured.layout``: where the batch is in the model's own inputs, outputs and
            target when not on dim 0; the stages run batch-first.
        replicas: This rank's :class:`Replicas` when every stage is replicated (``train_step``
            then trains this replica's share of the batch and averages the gradients over the
            replicas; ``__call__`` runs the whole batch on every replica); None: one pipeline over
            every rank.
    """

    def __init__(
        self,
        stages: Sequence[RankStage],
        *,
        num_stages: int,
        device: torch.device,
        schedule_kind: str,
        microbatches: int,
        in_spec: pytree.TreeSpec,
        out_spec: pytree.TreeSpec,
        tied: Sequence[TiedGroup] = (),
        state_order: Sequence[str] = (),
        plan: Plan | None = None,
        autocast: str | None = None,
        meta: Mapping[str, Any] | None = None,
        timeout_s: float = 60.0,
        watchdog: bool = True,
        batched_inputs: Sequence[bool] | None = None,
        batched_outputs: Sequence[bool | None] | None = None,
        layout: BatchLayout | None = None,
        replicas: Replicas | None = None,
        input_guards: Sequence[InputGuard] | None = None,
        size_outputs: Callable[[Sequence[Any]], Mapping[int, Any]] | None = None,
        training: bool | None = None,
    ) -> None:
        if not stages:
            raise ConfigError("a DistributedPipeline needs at least one stage on this rank")
        self.stages = sorted(stages, key=lambda st: st.index)
        self.replicas = replicas
        self.tp_plan: Any = None  # the per-layer plan tensor-parallel stages run (compile(tensor_parallel=...))
        self.hybrid: Any = None  # the [pp, dp, tp] search that chose this mesh (compile(parallel="hybrid"))
        self.group = replicas.pipeline_group if replicas is not None else None  # None: every rank
        self.num_stages, self.num_ranks, self.device = num_stages, dist.get_world_size(self.group), device
        self.schedule_kind, self.microbatches = schedule_kind, microbatches
        self.in_spec, self.out_spec = in_spec, out_spec
        self.input_guards = None if input_guards is None else tuple(input_guards)  # what the capture fixed
        self.size_outputs = size_outputs  # outputs that are numbers of the inputs' sizes: their batch values
        self.training = training  # the mode the model was captured in (None: not known)
        self._updated_buffers: list[tuple[nn.Module, str]] | None = None  # found at the first replica average
        self.tied, self.state_order = tuple(tied), list(state_order)
        self.plan, self.autocast = plan, autocast
        # what the pipeline is (model, reference device, cost model): saved with checkpoints, drives nothing
        self.meta: Mapping[str, Any] = MappingProxyType(dict(meta or {}))
        self.timeout_s = timeout_s
        self.batched_outputs = batched_outputs
        self.batched_inputs = (list(batched_inputs) if batched_inputs is not None
                               else (self.stages[0].module.batched or None))
        self.layout = layout  # the model's own batch dimensions when not dim 0 (compile(batch_dim=...))
        self._target_dim: int | None = 0  # where the step's target has the batch (moved to dim 0 for torch)
        self.progress = Progress(dist.get_rank(), self.stages[0].index, str(device))
        self.watchdog = Watchdog(self.progress, timeout_s) if watchdog else None
        self._loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
        self._weight = 1.0 / microbatches
        self._loss_reductions = LossReductions()
        self._reduction: str | None = None  # the step's loss_fn: "mean" | "sum" | "unknown"; None: not yet found
        self._scaler: torch.amp.GradScaler | None = None  # the step's loss scaler (fp16)
        self._losses: list[torch.Tensor] = []  # the step's micro-batch losses, weighted, unscaled (last rank)
        self._mb_size = 0
        self._pair_prev: tuple[list[Any], Any, int, float | None] | None = None  # the last micro-batch: outputs, target, size, loss
        self._pair_step = False  # this step checks its pairs
        self._pair_checks: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._runners: dict[tuple[int, int, bool], Any] = {}  # schedules, built at first use
        # runtime trace of this rank's stage in the latest train_step (None: not recorded)
        self.recorder: TraceRecorder | None = TraceRecorder(auto_step=False)
        self._recording = False
        self._mb_offset = 0  # index of the current group's first micro-batch in the batch
        self._wall_t0 = 0.0  # time.time() at the start of the latest recorded step
        # seconds the step's tied-gradient all-reduces take (measure_tied_sync_s; 0: not measured)
        self.tied_sync_s = 0.0
        # seconds the replicas' gradient all-reduce takes (measure_replica_sync_s; 0: not measured or none)
        self.replica_sync_s = 0.0
        # seconds of the loss per micro-batch on the last stage in the latest gathered step
        # (stage_times_s, every rank; 0: not measured)
        self.loss_s = 0.0
        self._forwarded = 0  # the micro-batch of the latest forward (the loss that follows is its)

    # -- structure ---------------------------------------------------------------------------
    @property
    def stage_indices(self) -> tuple[int, ...]:
        """The global indices of the stages this rank runs, ascending."""
        return tuple(st.index for st in self.stages)

    @property
    def stage_index(self) -> int:
        """The stage this rank runs.

        Raises:
            ConfigError: when it runs several (a looped schedule); use :attr:`stages`.
        """
        return self._only().index

    @property
    def module(self) -> StageModule:
        """The :class:`StageModule` this rank runs; ConfigError when it runs several."""
        return self._only().module

    @property
    def state(self) -> StageState:
        """The state names of the stage this rank runs; ConfigError when it runs several."""
        return self._only().state

    def _only(self) -> RankStage:
        if len(self.stages) != 1:
            raise ConfigError(f"rank {dist.get_rank()} runs stages {list(self.stage_indices)} "
                              f"({self.schedule_kind}); use pipe.stages for each one's module, state and index")
        return self.stages[0]

    @property
    def is_first(self) -> bool:
        """Whether this rank runs stage 0 (it reads the inputs)."""
        return self.stages[0].index == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (it reads the target and has the loss)."""
        return self.stages[-1].index == self.num_stages - 1

    def _runner(self, size: int, count: int, train: bool = True) -> Any:
        """The schedule for ``count`` micro-batches of ``size`` samples over this rank's stages.

        ``PipelineStage`` sizes its receive buffers from the first micro-batch it sees, so each
        micro-batch size gets its own stage objects (over the same modules). The schedule is
        fxsplit's own (:func:`fxsplit.schedule.make`, the actions the local pipeline runs and the
        explorer simulated) on torch's runtime. Inference runs GPipe's forward without a loss
        (torch's runtime refuses an action list without backwards): ``ScheduleGPipe`` on one
        stage per rank, ``ScheduleLoopedBFS`` (looping placement, forwards in stage order) on
        several.
        """
        key = (size, count, train)
        if key not in self._runners:
            stages = []
            for st in self.stages:
                ins, outs = st.shapes.example_args(size, train) if st.shapes is not None else (None, None)
                stage = SplitBackwardStage(st.module, st.index, self.num_stages, self.device, input_args=ins,
                                           output_args=outs, group=self.group)
                self._instrument(stage, st.index)
                stages.append(stage)
            schedule: Any
            if train:
                actions = make(self.schedule_kind, self.num_stages, count, num_ranks=self.num_ranks)
                schedule = lowered_schedule(stages, actions, self._loss, scale_grads=False)
            elif len(stages) == 1:
                schedule = ScheduleGPipe(stages[0], count, loss_fn=None, scale_grads=False)
            else:
                schedule = ScheduleLoopedBFS(list[Any](stages), count, loss_fn=None, scale_grads=False)
            self._runners[key] = schedule
        for st in self.stages:  # the modules are shared by every size's stage objects
            st.module.use_packing(*(st.shapes.packings(size, train) if st.shapes is not None else (None, None)))
        return self._runners[key]

    def _groups(self, batch: int) -> list[tuple[int, int, int]]:
        """``(first sample, micro-batch size, count)`` runs of equal micro-batches: a batch of
        ``q * m + r`` samples makes ``r`` micro-batches of ``q + 1`` then ``m - r`` of ``q``
        (``tensor_split``'s sizes, as in the local pipeline)."""
        sizes = microbatch_sizes(batch, self.microbatches)
        groups, start = [], 0
        for size in dict.fromkeys(sizes):
            count = sizes.count(size)
            groups.append((start, size, count))
            start += size * count
        return groups

    def _slice_inputs(self, flat: Sequence[Any], start: int, stop: int) -> list[Any]:
        if not self.is_first:
            return []
        flags = self.stages[0].module.batched
        return [v[start:stop] if b else v for v, b in zip(flat, flags, strict=True)]

    def _instrument(self, stage: PipelineStage, index: int) -> None:
        """Record the action in flight, so a failure names its stage and micro-batch (see
        Progress), and time every forward and backward of a training step into :attr:`recorder`."""
        for attr, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
            compute = getattr(stage, attr)

            def timed(chunk: int, *args: Any, _m: Any = compute, _k: str = kind, **kwargs: Any) -> Any:
                if not self._recording or self.recorder is None:
                    return _m(chunk, *args, **kwargs)
                start = time.perf_counter()
                out = _m(chunk, *args, **kwargs)
                k = "I" if _k == "B" and kwargs.get("full_backward") is False else _k  # a zero-bubble input half
                self.recorder.add(index, k, chunk + self._mb_offset, start, action_end_s(stage.device))
                if _k == "F":
                    self._forwarded = chunk + self._mb_offset
                return out

            setattr(stage, attr, timed)
        for attr, action in (
            ("get_fwd_recv_ops", "receiving activations for"), ("forward_one_chunk", "running the forward of"),
            ("get_fwd_send_ops", "sending activations of"), ("get_bwd_recv_ops", "receiving gradients for"),
            ("backward_one_chunk", "running the backward of"), ("get_bwd_send_ops", "sending gradients of"),
        ):
            method = getattr(stage, attr)

            def traced(chunk: int, *args: Any, _m: Any = method, _a: str = action, **kwargs: Any) -> Any:
                self.progress.at(_a, chunk, index)
                return _m(chunk, *args, **kwargs)

            setattr(stage, attr, traced)

    def _flatten(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        return flatten_to_spec(args, kwargs, self.in_spec, self.layout, self.input_guards)

    def _unflatten(self, outs: Sequence[Any]) -> Any:
        """The graph's flat outputs as the model's output (its structure and batch layout)."""
        return unflatten_to_spec(outs, self.out_spec, self.layout)

    def _user_target(self, target: Any) -> Any:
        """A micro-batch's target back in the user's layout (torch's schedule splits on dim 0)."""
        d = self._target_dim
        return target.movedim(0, d) if d and isinstance(target, torch.Tensor) else target

    def _check_batch_size(self, flat: Sequence[Any]) -> int:
        flags = self.batched_inputs
        sized = [x for x, b in zip(flat, flags, strict=True) if b] if flags is not None else flat
        return batch_size_of(sized)

    def _check_batch(self, flat: Sequence[Any]) -> int:
        batch = self._check_batch_size(flat)
        check_splittable(batch, self.microbatches)
        return batch

    # -- running -----------------------------------------------------------------------------
    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        """The schedule's loss: the user's loss of one micro-batch times its batch share (a mean
        over the batch), or unweighted (a sum; found on the step's first micro-batch)."""
        if self._loss_fn is None:
            raise ConfigError("train_step needs loss_fn")
        outs = list(output) if isinstance(output, tuple | list) else [output]
        target = self._user_target(target)
        if self._reduction is None:
            self._reduction = self._loss_reductions.of(
                self._loss_fn, outs, self.batched_outputs, self._unflatten, target, self._mb_size,
                self._target_dim or 0, [self._target_dim or 0])  # one target tensor, its batch where the user has it
        weight = 1.0 if self._reduction == "sum" else self._weight
        start = time.perf_counter()
        with precision(self.device, autocast_dtype(self.autocast)):  # as the unsplit model runs it
            raw = self._loss_fn(self._unflatten(outs), target)
            loss = raw * weight
        if self._recording and self.recorder is not None:  # the loss of the forward just run, on the last stage
            self.recorder.add(self.num_stages - 1, "L", self._forwarded, start, action_end_s(self.device))
        self._check_pair(outs, target, raw)
        self._losses.append(loss.detach())
        return loss if self._scaler is None else scale_loss(self._scaler, loss)  # what goes backward

    def _check_pair(self, outs: list[Any], target: Any, loss: torch.Tensor) -> None:
        """Every two consecutive micro-batches of the step: their loss together is what the
        weights add up (:func:`~fxsplit.runtime.microbatch.check_loss_pair`; all pairs passing
        means the whole batch does); a loss normalised by a count that varies between
        micro-batches is refused. Inside torch's schedule on the last rank (a failure there stops
        every rank within the timeout), so only on a loss function's first
        :data:`PAIR_CHECK_STEPS` steps: it would add to every measured step after. ``loss``: the
        micro-batch's unweighted loss, reused when float32 without autocast (the value the check
        would compute again: one more ``loss_fn`` call per pair, not three)."""
        if self._reduction not in ("mean", "sum") or self.microbatches < 2 or not self._pair_step:
            return
        same = self.autocast is None and loss.dtype == torch.float32
        now = ([x.detach() if isinstance(x, torch.Tensor) else x for x in outs], target, self._mb_size,
               float(loss.detach()) if same else None)
        prev, self._pair_prev = self._pair_prev, now
        if prev is not None:
            losses = [prev[3], now[3]] if prev[3] is not None and now[3] is not None else None
            check_loss_pair(self._loss_fn, [prev[0], now[0]], [prev[1], now[1]], [prev[2], now[2]],
                            self._reduction, self.batched_outputs, self._unflatten, self._target_dim or 0,
                            first=len(self._losses) - 1, losses=losses, target_dims=[self._target_dim or 0])

    def _run(self, what: str, call: Callable[[], Any]) -> Any:
        self.progress.started_s = time.monotonic()
        try:
            return call()
        except ExecutionError:
            raise
        except Exception as exc:
            err = self.progress.error(exc, what)
            log.error("%s", err)
            raise err from exc
        finally:
            self.progress.started_s = None
            self.progress.at("idle", None)

    def _step_args(self, flat: Sequence[Any]) -> list[Any]:
        return self.stages[0].module.bind_static(flat) if self.is_first else []

    def train_step(
        self,
        *args: Any,
        target: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        broadcast_loss: bool = False,
        grad_scaler: torch.amp.GradScaler | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | None:
        """Forward and backward one batch; collective (every rank calls it with the same batch).

        fp16 (``autocast="fp16"``) trains with loss scaling, on every rank::

            scaler = pipe.grad_scaler()                  # once, the same arguments on every rank
            loss = pipe.train_step(x, target=y, loss_fn=f, grad_scaler=scaler)
            scaler.step(optimizer)                       # collective: skipped on every rank or none
            scaler.update()                              # the same new scale on every rank

        Args:
            args, kwargs: The model's inputs for the whole batch, batch on dim 0 (read on the
                first rank; the others only check the batch size).
            target: The loss target, a tensor with the batch on dim 0, or on the inputs'
                ``batch_dim`` when it has that dimension (read on the last rank).
            loss_fn: ``loss_fn(output, target) -> scalar``, a mean over the batch (the contract)
                or a sum (found on the first micro-batch; then the losses add unweighted).
            broadcast_loss: Return the loss on every rank (one broadcast), not only the last.
            grad_scaler: Loss scaling for fp16: the ``ShardedGradScaler`` of :meth:`grad_scaler`
                (or one over the default process group, of the stages' device type), passed on
                every rank. The last rank multiplies each micro-batch's loss by its scale before
                backward (in float32, as ``torch.amp.GradScaler.scale`` does), so the gradients
                are scaled as ``scaler.scale(loss).backward()`` leaves them in the unsplit model;
                every rank then calls ``scaler.step(optimizer)`` (its ``unscale_`` all-reduces
                the overflow check over the ranks, so a collective: every rank calls it, once per
                optimizer, with an optimizer over an empty parameter group,
                ``torch.optim.SGD([{"params": []}])``, on a rank without parameters) and
                ``scaler.update()``. The returned loss is not scaled. None: no scaling.

        Returns:
            On the last rank (every rank with ``broadcast_loss``): the batch loss, detached,
            equal to ``loss_fn(model(*args), target)``; elsewhere None. Gradients accumulate in
            this rank's parameters as ``loss.backward()`` would in the original model.

        Raises:
            ConfigError: for inputs of the wrong structure or a batch that does not split into
                equal micro-batches (on every rank, before any communication); for a
                ``grad_scaler`` that would not give every rank the same skip decision (a plain
                ``torch.amp.GradScaler`` on several ranks, another device type, another process
                group: :func:`~fxsplit.runtime.dist_scaler.prepare_grad_scaler`), before any
                communication.
            ExecutionError: when this stage fails, or a peer dies or stops answering for
                ``timeout_s`` (names rank, stage, micro-batch and action). This rank's gradients
                are then left as they were before the step.
        """
        if not callable(loss_fn):
            raise ConfigError(f"train_step needs loss_fn=callable(output, target) -> scalar, got {loss_fn!r}")
        if grad_scaler is not None:  # one skip decision over every rank: stages, their replicas and shards
            prepare_grad_scaler(grad_scaler, self.device, dist.get_world_size())
        flat = self._flatten(args, kwargs)
        if self.replicas is not None:
            flat, target = self._replica_share(flat, target)
        batch = self._check_batch(flat)
        if self.is_last and not isinstance(target, torch.Tensor):
            raise ConfigError(f"target must be a tensor with the batch on dim 0, got {type(target).__name__}")
        if self.is_last:
            self._target_dim = target_batch_dim(target, batch, self.layout.target_dim if self.layout else 0)
            if self._target_dim is None:
                raise ConfigError(f"target {list(target.shape)} has no dimension of the batch's {batch} samples; "
                                  "give a target with the batch on dim 0 (or on the inputs' batch_dim)")
            target = target.movedim(self._target_dim, 0) if self._target_dim else target
        self._loss_fn, self._scaler, self._losses = loss_fn, grad_scaler, []
        self._reduction = "mean" if self.microbatches == 1 else None
        self._pair_prev = None
        try:  # a callable that cannot be weakly referenced: checked every step
            done = self._pair_checks.get(loss_fn, 0)
            self._pair_checks[loss_fn] = done + 1
        except TypeError:
            done = 0
        self._pair_step = self.is_last and done < PAIR_CHECK_STEPS
        if self.recorder is not None:
            self._wall_t0 = time.time()
            self.recorder.begin(time.perf_counter())
        self._recording, self._mb_offset = True, 0
        saved = self._stash_grads()
        try:
            for start, size, count in self._groups(batch):  # one run per micro-batch size
                self._train_group(flat, target, start, size, count, batch)
                self._mb_offset += count
            self._run("the tied-weight all-reduce", self._sync_tied)
            if self.replicas is not None:
                self._run("the replicas' gradient all-reduce", self._average_replicas)
        except BaseException:
            self._unstash_grads(saved, ok=False)  # this rank's gradients are as before the step
            raise
        finally:
            self._recording, self._scaler = False, None
        self._unstash_grads(saved, ok=True)
        loss = torch.stack(self._losses).sum() if self.is_last else None
        if loss is not None and self.replicas is not None:  # the batch's loss: the replicas' mean (or sum)
            loss = self._run("the replicas' loss all-reduce", functools.partial(self._replicas_loss, loss))
        if broadcast_loss:
            loss = self._run("the loss broadcast", lambda: self._broadcast(loss))
        return loss

    def _train_group(self, flat: Sequence[Any], target: Any, start: int, size: int, count: int, batch: int) -> None:
        """Run ``count`` micro-batches of ``size`` samples from sample ``start`` (their losses,
        unscaled, go to ``self._losses`` on the last rank)."""
        stop = start + size * count
        schedule = self._runner(size, count)
        self._weight, self._mb_size = size / batch, size  # each micro-batch loss times its share of the batch
        step_args = self._step_args(self._slice_inputs(flat, start, stop))
        extra = {"target": target[start:stop].to(self.device)} if self.is_last else {}
        self._run("train_step", functools.partial(schedule.step, *step_args, return_outputs=False, **extra))

    def grad_scaler(self, *, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                    growth_interval: int = 2000) -> ShardedGradScaler:
        """A loss scaler for ``train_step(grad_scaler=...)`` under ``autocast="fp16"``: torch's
        ``ShardedGradScaler`` over this pipeline's ranks (the default process group) on the
        stages' device type, whose ``step`` and ``update`` skip and rescale on every rank alike.

        Call it on every rank with the same arguments (no communication here). Arguments as
        ``torch.amp.GradScaler``'s: ``init_scale`` the first scale; after an overflow on any rank
        the scale is multiplied by ``backoff_factor``, after ``growth_interval`` steps without
        one by ``growth_factor``.

        Returns:
            A ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``.
        """
        return pipeline_grad_scaler(self.device, init_scale=init_scale, growth_factor=growth_factor,
                                    backoff_factor=backoff_factor, growth_interval=growth_interval)

    # -- runtime trace -----------------------------------------------------------------------
    def stage_times_s(self) -> list[dict[str, float]]:
        """Per-stage mean forward and backward seconds per micro-batch in the latest
        ``train_step``, from every rank's trace; collective (one ``all_gather_object``).

        Returns:
            ``[num_stages]`` dicts ``{"fwd_s", "bwd_s", "bwd_weight_s", "loss_s"}`` on every
            rank, the local pipeline's :meth:`TraceRecorder.per_stage_s` layout (what
            ``calibrate`` and the fidelity bench read). The times are the stage's
            ``forward_one_chunk`` / ``backward_one_chunk`` (sends and receives are separate
            actions); the last stage's forward includes the loss, as the local pipeline's does,
            and its ``loss_s`` says how much (kept in :attr:`loss_s`).

        Raises:
            ConfigError: when ``recorder`` is None.
        """
        times = self._recorder_or_raise().per_stage_s(self.num_stages)
        rows: list[Any] = [None] * self.num_ranks
        dist.all_gather_object(rows, [(s, times[s]) for s in self.stage_indices], group=self.group)
        out = [{"fwd_s": 0.0, "bwd_s": 0.0, "bwd_weight_s": 0.0, "loss_s": 0.0} for _ in range(self.num_stages)]
        for stage, row in (pair for held in rows for pair in held):
            out[stage] = row
        self.loss_s = out[-1]["loss_s"]
        return out

    def gather_trace(self) -> list[TraceEvent]:
        """Every stage's actions of the latest ``train_step``, on one time axis; collective.

        Ranks align on wall-clock time (``time.time()`` at their step start), exact on one host
        and as good as the hosts' clock sync (NTP, ~ms) across hosts. Time 0 is the earliest
        rank's step start.

        Raises:
            ConfigError: when ``recorder`` is None.
        """
        events = self._recorder_or_raise().events
        parts: list[Any] = [None] * self.num_ranks
        dist.all_gather_object(parts, (self._wall_t0, events), group=self.group)
        t0 = min(w for w, _ in parts)
        out = [TraceEvent(e.stage, e.kind, e.microbatch, e.start_s + w - t0, e.duration_s) for w, evs in parts for e in evs]
        return sorted(out, key=lambda e: (e.start_s, e.stage))

    def trace(self, path: str | os.PathLike[str]) -> None:
        """Write the Chrome trace of every stage's latest ``train_step`` to ``path`` on rank 0
        (one row per stage; open in https://ui.perfetto.dev); collective.

        Raises:
            ConfigError: when ``recorder`` is None or no step has been trained.
        """
        events = self.gather_trace()
        if not events:
            raise ConfigError("no training step recorded yet; call pipe.train_step(...) before pipe.trace(path)")
        if dist.get_rank() == 0:
            view = TraceRecorder.from_events(events)
            view.write(os.fspath(path), [f"stage {s} (rank {rank_of(s, self.num_ranks)})" for s in range(self.num_stages)])

    def _recorder_or_raise(self) -> TraceRecorder:
        if self.recorder is None:
            raise ConfigError("this pipeline records no trace (pipe.recorder is None); "
                              "set pipe.recorder = TraceRecorder(auto_step=False) on every rank")
        return self.recorder

    def _broadcast(self, loss: torch.Tensor | None) -> torch.Tensor:
        buf = loss.clone() if loss is not None else torch.zeros((), device=self.device)
        dist.broadcast(buf, src=self._global_rank(rank_of(self.num_stages - 1, self.num_ranks)), group=self.group)
        return buf

    def _replicas_loss(self, loss: torch.Tensor) -> torch.Tensor:
        assert self.replicas is not None  # (internal: only called with replicas)
        if self.replicas.count == 1:
            return loss
        total = loss.clone()
        dist.all_reduce(total, group=self.replicas.group)
        return total if self._reduction == "sum" else total / self.replicas.count

    def _global_rank(self, pipeline_rank: int) -> int:
        """The global rank of this pipeline's rank ``pipeline_rank``."""
        return pipeline_rank if self.group is None else dist.get_global_rank(self.group, pipeline_rank)

    def _replica_share(self, flat: Sequence[Any], target: Any) -> tuple[list[Any], Any]:
        """This replica's ``1/dp`` of the batch: each batched input's and the target's slice."""
        assert self.replicas is not None  # (internal: only called with replicas)
        count, index = self.replicas.count, self.replicas.index
        batch = self._check_batch_size(flat)
        if batch % count:
            raise ConfigError(f"a batch of {batch} samples does not split evenly over {count} replicas of each stage; "
                              f"give a multiple of {count}")
        share = batch // count
        flags = self.batched_inputs if self.batched_inputs is not None else [isinstance(x, torch.Tensor) for x in flat]
        sliced = [x.narrow(0, index * share, share) if b else x for x, b in zip(flat, flags, strict=True)]
        if isinstance(target, torch.Tensor):
            dim = target_batch_dim(target, batch, self.layout.target_dim if self.layout else 0) or 0
            target = target.narrow(dim, index * share, share)
        return sliced, target

    def _average_replicas(self) -> None:
        """Average (a mean loss) or sum (a summed loss) this step's gradients over the stage's
        replicas: one all-reduce of the flattened gradients."""
        assert self.replicas is not None  # (internal: only called with replicas)
        if self.replicas.count == 1:
            return
        summed = torch.tensor(float(self._reduction == "sum"), device=self.device)  # the last stage found it
        dist.broadcast(summed, src=self._global_rank(rank_of(self.num_stages - 1, self.num_ranks)), group=self.group)
        self._reduction = "sum" if summed.item() else "mean"
        grads = [_local(p.grad) for p in dict.fromkeys(self.parameters()) if p.grad is not None]
        _all_reduce_flat(grads, self.replicas.group, 1 if self._reduction == "sum" else self.replicas.count)
        self._average_replica_buffers()

    def _average_replica_buffers(self) -> None:
        """Average over the replicas the floating buffers forward updates (BatchNorm's running
        statistics, a moving average): each replica updated them from its share of the batch, and
        they drifted apart (the checkpoint kept the first replica's). The mean of the replicas'
        running means is the whole batch's update; such a model is not per-sample, and compile
        warns about it. Integer buffers (counters) move alike on every replica."""
        from fxsplit.passes.per_sample import written_buffers

        assert self.replicas is not None  # (internal: only called with replicas)
        if self._updated_buffers is None:
            self._updated_buffers = [(st.module.gm, name) for st in self.stages for name in written_buffers(st.module.gm)]
        buffers = [b for b in (_local(get_tensor(gm, name)) for gm, name in self._updated_buffers) if b.is_floating_point()]
        _all_reduce_flat(buffers, self.replicas.group, self.replicas.count)

    def measure_tied_sync_s(self, repeats: int = 3) -> float:
        """Time the all-reduces :meth:`train_step` ends with for tied tensors (one per tensor this
        rank shares with other ranks, its whole gradient's shape and dtype, in ``_sync_tied``'s
        order), set :attr:`tied_sync_s` to the slowest rank's total and return it; collective
        over the default group (every rank calls it, those without tied copies too).

        The planner's step (:func:`fxsplit.schedule.plan_step_s`) ends with the last backward;
        these all-reduces run after it, on the step's critical path (1.5-3 ms for a GPT's 1 MiB
        embedding over gloo on the CI's CPU, 5-9 % of its step). Median of ``repeats`` after one
        warm-up per tensor.
        """
        total = 0.0
        for tied in self.tied:
            if tied.group is None:
                continue
            model = self._copies(tied.name)[0]  # a split (DTensor) copy's shape is the whole one
            buffer = torch.zeros(model.shape, dtype=model.dtype, device=self.device)
            times = []
            for _ in range(1 + repeats):
                start = time.perf_counter()
                dist.all_reduce(buffer, group=tied.group)
                times.append(time.perf_counter() - start)
            total += statistics.median(times[1:])
        slowest = torch.tensor([total], dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        self.tied_sync_s = float(slowest.item())
        return self.tied_sync_s

    def measure_replica_sync_s(self, repeats: int = 3) -> float:
        """Time the all-reduce :meth:`train_step` ends with over the replicas of this rank's stages
        (one flattened buffer of its gradients, as ``_average_replicas`` sends it), set
        :attr:`replica_sync_s` to the slowest rank's and return it (0 without replicas);
        collective over the default group. Median of ``repeats`` after one warm-up."""
        took = 0.0
        if self.replicas is not None and self.replicas.count > 1:
            params = [_local(p) for p in dict.fromkeys(self.parameters()) if p.requires_grad]
            if params:
                buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=self.device)
                times = []
                for _ in range(1 + repeats):
                    start = time.perf_counter()
                    dist.all_reduce(buffer, group=self.replicas.group)
                    times.append(time.perf_counter() - start)
                took = statistics.median(times[1:])
        slowest = torch.tensor([took], dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        self.replica_sync_s = float(slowest.item())
        return self.replica_sync_s

    def measure_sync_s(self) -> float:
        """:meth:`measure_tied_sync_s` and :meth:`measure_replica_sync_s` (collective); returns
        :attr:`sync_s`."""
        self.measure_tied_sync_s()
        self.measure_replica_sync_s()
        return self.sync_s

    @property
    def sync_s(self) -> float:
        """Seconds of the step's tail after the last backward: the tied-gradient all-reduces and
        the replicas' gradient all-reduce, as measured (:meth:`measure_tied_sync_s`,
        :meth:`measure_replica_sync_s`)."""
        return self.tied_sync_s + self.replica_sync_s

    def _copies(self, name: str) -> list[torch.Tensor]:
        """This rank's copies of graph state ``name``, one per stage holding it."""
        return [t for st in self.stages for g, _n, t in st.state.items(st.module.gm) if g == name]

    def _sync_tied(self) -> None:
        """Give every copy of a tied tensor the sum of all copies' gradients: over this rank's
        copies, then across the ranks holding one."""
        for tied in self.tied:
            copies = self._copies(tied.name)
            # whole gradients (a stage split over tp ranks gathers its shards: copies in two
            # stages may be split differently)
            grads = [_whole(t.grad) if t.grad is not None else torch.zeros(t.shape, dtype=t.dtype, device=self.device)
                     for t in copies]
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
            if tied.group is not None:
                dist.all_reduce(total, group=tied.group)
            for i, t in enumerate(copies):  # each copy its own tensor: optimizers change grads in place
                t.grad = _like(total if i == 0 else total.clone(), t)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on a batch, forward only; collective.

        Returns:
            On the last rank the model's output (same structure as the original's), elsewhere
            None.
        """
        flat = self._flatten(args, kwargs)
        batch = self._check_batch(flat)
        parts: list[list[Any]] = []
        for start, size, count in self._groups(batch):
            schedule = self._runner(size, count, train=False)
            step_args = self._step_args(self._slice_inputs(flat, start, start + size * count))
            with torch.no_grad():
                out = self._run("a forward", functools.partial(schedule.step, *step_args))
            parts.append(list(out) if isinstance(out, tuple | list) else [out])
        if not self.is_last:
            return None
        rows = [size * count for _, size, count in self._groups(batch)]
        given = self.size_outputs(flat) if self.size_outputs is not None else None
        return self._unflatten(merge_outputs(parts, rows, self.batched_outputs, given=given))

    forward = __call__

    # -- parameters and state ----------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(original name, parameter)`` of this rank's stages' parameters (tied: the first
        alias; a tied tensor in two of this rank's stages comes once per copy, as every copy
        is trained)."""
        for st in self.stages:
            for _g, name, tensor in st.state.items(st.module.gm):
                if isinstance(tensor, nn.Parameter):
                    yield name, tensor

    def _grad_norms(self, norm_type: float) -> dict[str, float]:
        """Every rank's gradient norms, gathered: each tensor of the model once, keyed by its
        first original name (a tied weight's copies on other ranks share it), counted on its
        stage's first replica and first shard; a tensor-parallel gradient is gathered whole
        first (collective over the stage's shards, in the same order on each)."""
        from torch.distributed.tensor import DTensor

        first = self.replicas is None or (self.replicas.index == 0 and self.replicas.tp_index == 0)
        mine: dict[str, float] = {}
        for st in self.stages:
            for g, _name, tensor in st.state.items(st.module.gm):
                if not isinstance(tensor, nn.Parameter) or tensor.grad is None:
                    continue
                grad = tensor.grad.full_tensor() if isinstance(tensor.grad, DTensor) else tensor.grad
                key = st.state.originals[g][0]
                if first and key not in mine:
                    mine[key] = grad_norm(grad, norm_type)
        everyone: list[dict[str, float] | None] = [None] * dist.get_world_size()
        self._run("the gradient norms' all-gather", lambda: dist.all_gather_object(everyone, mine))
        merged: dict[str, float] = {}
        for part in everyone:
            for key, value in (part or {}).items():
                merged.setdefault(key, value)
        return merged

    @staticmethod
    def _stage_state_dict(st: RankStage, order: Sequence[str]) -> dict[str, torch.Tensor]:
        values = {o: _whole(t.detach()) for g, _n, t in st.state.items(st.module.gm) for o in st.state.originals[g]}
        return {k: values[k] for k in (order or list(values)) if k in values}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's part of the original ``state_dict``: original keys (every alias of a
        tied tensor), in the original order; non-persistent buffers left out."""
        values: dict[str, torch.Tensor] = {}
        for st in self.stages:
            for key, value in self._stage_state_dict(st, self.state_order).items():
                values.setdefault(key, value)
        order = self.state_order or list(values)
        return {k: values[k] for k in order if k in values}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy this rank's keys from an original-model state dict (other keys are ignored).

        Raises:
            ConfigError: with ``strict``, naming this rank's keys the dict lacks; for any value
                that is not a tensor of its target's shape, before any write (all or nothing).
        """
        where = f"stage(s) {list(self.stage_indices)}"
        missing = [k for k in self.state_dict() if k not in state_dict]
        if strict and missing:
            raise ConfigError(f"state dict lacks {len(missing)} key(s) of {where}: {missing[:8]}")
        writes = [(key, state_dict[key], t) for st in self.stages
                  for _g, _n, t, key in st.state.sources(st.module.gm, state_dict) if key is not None]
        check_loadable(writes, where)
        with torch.no_grad():
            for _key, value, t in writes:
                _local(t).copy_(_local(_like(value.to(t.device, t.dtype), t)))

    def train(self, mode: bool = True) -> DistributedPipeline:
        """Check the mode: the stages run in the mode the model had when it was captured
        (:func:`~fxsplit.runtime.state.check_mode`; before, ``eval()`` left dropout on, silently).

        Raises:
            ConfigError: when ``mode`` differs from that mode (compile again after
                ``model.train()`` / ``model.eval()`` in ``model_fn``).
        """
        check_mode(self.training, mode)
        return self

    def eval(self) -> DistributedPipeline:
        return self.train(False)

    def save(self, directory: str | os.PathLike[str], keep: int = 2) -> None:
        """Write this rank's state dict and, on rank 0, the plan into a new checkpoint folder of
        ``directory``, all or nothing (see :mod:`fxsplit.checkpoint`); collective.

        Each save goes to a fresh ``ckpt-NNNNNN`` folder (``stage{i:03d}.pt`` with original keys,
        one per stage, ``plan.json``), every file written to a temporary name, fsynced and renamed; when every
        rank's shard is on disk, rank 0 marks the folder complete and points ``LATEST`` at it,
        then removes the complete checkpoints older than the newest ``keep``. A save cut short
        (a rank killed, a disk full) leaves the previous checkpoint as it was.

        A checkpoint loads with :func:`fxsplit.distributed.load` on any number of ranks, and
        ``python -m fxsplit.checkpoint DIR OUT.pt`` merges it into one ordinary state dict.

        Raises:
            ExecutionError: when writing or a collective fails on any rank (names rank and stage).
        """
        directory = str(directory)
        rank = dist.get_rank()
        version = self._run("agreeing on the checkpoint folder", lambda: from_rank0(lambda: next_version(directory)))
        folder = os.path.join(directory, version)
        os.makedirs(folder, exist_ok=True)
        writes = self.replicas is None or self.replicas.writes  # one copy of each stage writes it
        # every rank gathers (a split stage's shards meet on each of its ranks); one copy writes
        shards = {shard_name(st.index): {k: v.cpu() for k, v in self._stage_state_dict(st, self.state_order).items()}
                  for st in self.stages}
        shards = shards if writes else {}
        for name, sd in shards.items():
            def write(name: str = name, sd: dict[str, torch.Tensor] = sd) -> None:
                write_atomic(os.path.join(folder, name), lambda f: torch.save(sd, f))

            self._run("writing this stage's shard", write)
        keys: list[Any] = [None] * self.num_ranks
        # every rank joins the gather after its shards are on disk: past it, every shard is
        mine = [(name, list(sd)) for name, sd in shards.items()]
        self._run("gathering the shard index", lambda: dist.all_gather_object(keys, mine, group=self.group))
        if rank == 0:
            index = dict(sorted(pair for held in keys for pair in held))
            doc = {**self.meta, "plan": self.plan.to_dict() if self.plan is not None else None, "autocast": self.autocast,
                   "schedule": self.schedule_kind, "microbatches": self.microbatches, "num_stages": self.num_stages,
                   "state_order": self.state_order, "shards": index}
            write_atomic(os.path.join(folder, PLAN_FILE), lambda f: f.write(json.dumps(doc, indent=1).encode()))
            commit(directory, version, keep)
        self._run("waiting for the checkpoint to be committed", dist.barrier)
        log.info("rank %d saved stage(s) %s (%d tensors) to %s", rank, list(self.stage_indices),
                 sum(len(sd) for sd in shards.values()), folder)

    def close(self) -> None:
        """Stop the watchdog (the process group is the caller's to destroy)."""
        if self.watchdog is not None:
            self.watchdog.stop()

    def __repr__(self) -> str:
        n = sum(p.numel() for p in self.parameters())
        return (
            f"DistributedPipeline(stage(s) {list(self.stage_indices)}/{self.num_stages} on {self.device}, "
            f"{self.schedule_kind} x {self.microbatches} micro-batches, {n:,} parameters, "
            f"tied={[t.name for t in self.tied]})"
        )


def _all_reduce_flat(tensors: Sequence[torch.Tensor], group: Any, divide_by: int) -> None:
    """Sum ``tensors`` (one dtype) over ``group`` in one all-reduce of their flattened copy, then
    divide by ``divide_by`` (the group's size: their mean) and write back in place."""
    if not tensors:
        return
    flat = torch._utils._flatten_dense_tensors([t.detach() for t in tensors])
    dist.all_reduce(flat, group=group)
    if divide_by != 1:
        flat /= divide_by
    with torch.no_grad():
        for t, synced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors), strict=True):
            t.copy_(synced)


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A stage tensor whole: a shard of a tensor-parallel stage gathered (collective over the
    stage's ``tp`` ranks), a plain one as it is."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _local(value: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a stage tensor (a DTensor's local shard, a plain tensor itself)."""
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _like(whole: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """``whole`` laid out as ``model`` is: this rank's shard when ``model`` is a DTensor (no
    communication: every rank holds ``whole``), else ``whole`` itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(model, DTensor):
        return whole
    return distribute_tensor(whole, model.device_mesh, model.placements, src_data_rank=None)
