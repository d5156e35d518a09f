"""The local pipeline: run the stages of a :class:`StagedProgram` over a schedule in one process.

Training runs the schedule's actions (``"1F0"``, ``"2B3"``) in a valid global order. A forward
action receives its stage's inputs from the previous stage, moved to the stage's device and
detached into fresh leaves (so each stage has its own autograd graph, as in
``torch.distributed.pipelining``); a backward action back-propagates the gradients received from
the next stage (the last stage: its micro-batch loss) and hands the gradients of its inputs to the
previous stage. Micro-batch losses are weighted by their share of the batch, so the gradients equal
those of ``loss_fn(model(batch), target).backward()`` for a mean-reduced loss.

References:
    Huang et al., "GPipe", NeurIPS 2019; Narayanan et al., "Memory-efficient pipeline-parallel
    DNN training" (PipeDream-flush / 1F1B), ICML 2021; Kim et al., "torchgpipe", 2020.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxsplit.codegen.batchnorm import BatchNormTracker
from fxsplit.codegen.split import StagedProgram
from fxsplit.errors import ConfigError, ExecutionError, InternalError
from fxsplit.ir import Plan
from fxsplit.ir.units import format_bytes, format_ids, format_seconds
from fxsplit.options import precision
from fxsplit.passes.capture import BatchLayout, InputGuard, flatten_to_spec, unflatten_to_spec
from fxsplit.passes.per_sample import is_random
from fxsplit.runtime.microbatch import (
    DrawsAsExpected,
    LossReductions,
    batch_size_of,
    check_loss_pair,
    loss_weights,
    merge_outputs,
    scalar_outputs,
    scalar_reductions,
    split_microbatches,
    split_target,
    target_leaf_dims,
)
from fxsplit.runtime.recompute import RecomputedForward
from fxsplit.runtime.split_backward import PendingWeights, backward_input, backward_weight
from fxsplit.runtime.state import ParameterAPI, StateMap, check_mode
from fxsplit.runtime.threads import run_threaded
from fxsplit.runtime.trace import TraceRecorder, action_end_s
from fxsplit.schedule import Action, Schedule, make, simulate

__all__ = ["Pipeline", "execution_order"]

log = logging.getLogger(__name__)


def execution_order(schedule: Schedule) -> list[Action]:
    """A global order of the schedule's actions that respects every dependency.

    Simulates the schedule with unit forward and double backward times and sorts the actions by
    start time (ties by rank), which interleaves the per-device lists the way the devices would.
    """
    p = schedule.num_stages
    timeline = simulate(schedule, [1.0] * p, [2.0] * p, bwd_weight_s=[1.0] * p)
    return [e.action for e in sorted(timeline.events, key=lambda e: (e.start_s, e.rank))]


def _to_stage(value: Any, device: torch.device, leaf: bool) -> Any:
    """Move a received value to ``device`` (no call when it is there); with ``leaf``, detach it
    into a new autograd leaf."""
    if isinstance(value, torch.Tensor):
        moved = value if value.device == device else value.to(device)
        if leaf:
            moved = moved.detach().requires_grad_(value.requires_grad)
        if moved is not value and moved.is_cuda:
            # made on another worker's stream: keep the allocator from reusing it too early
            moved.record_stream(torch.cuda.current_stream(device))
        return moved
    if isinstance(value, list | tuple):
        return type(value)(_to_stage(v, device, leaf) for v in value)
    return value


def _tensor_leaves(values: Sequence[Any]) -> list[torch.Tensor | None]:
    """The leaves of ``values``, ``None`` for each leaf that is not a tensor."""
    if all(isinstance(v, torch.Tensor) for v in values):  # the common case: no pytree walk
        return list(values)
    return [v if isinstance(v, torch.Tensor) else None for v in pytree.tree_leaves(list(values))]


@dataclass(slots=True)
class _Slot:
    """What one (stage, micro-batch) keeps between its forward and its backward."""

    inputs: Sequence[Any]
    outputs: tuple[Any, ...]
    pending: PendingWeights | None = None  # between a zero-bubble schedule's I and W


@dataclass(slots=True)
class _Step:
    """One training step: the micro-batches, their targets and loss weights, and what the
    actions hand each other (slots from forward to backward, input gradients, losses)."""

    inputs: list[list[Any]]
    targets: list[Any]
    weights: list[float]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    slots: dict[tuple[int, int], _Slot] = field(default_factory=dict)
    grads: dict[tuple[int, int], list[Any]] = field(default_factory=dict)
    losses: list[torch.Tensor | None] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    reduction_checked: bool = False
    reduction: str = "unknown"
    # the loss checks (check_loss_pair): the last micro-batch's outputs, detached, and the pairs
    # of consecutive micro-batches to check between actions; whether the model has 0-d outputs
    kept: tuple[int, list[Any], torch.Tensor] | None = None
    pending: list[tuple[int, tuple[list[Any], list[Any]], tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=list)
    scalars: bool = False
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None  # a GradScaler's scale(): fp16 loss scaling
    target_dims: list[int | None] | None = None  # each target leaf's batch dimension in the whole batch

    def total_loss(self) -> torch.Tensor:
        """The batch loss (detached): the sum of the weighted micro-batch losses."""
        losses = [loss for loss in self.losses if loss is not None]
        if len(losses) == 1:
            return losses[0].detach()
        return torch.stack([loss.detach().to(losses[0].device) for loss in losses]).sum()


class Pipeline(ParameterAPI):
    """A model split into stages, callable like the model, trainable with :meth:`train_step`.

    Build it with :func:`fxsplit.compile`. Attributes: ``plan`` (the :class:`~fxsplit.ir.Plan`),
    ``stages`` (the :class:`~fxsplit.codegen.Stage` s), ``schedule`` (the
    :class:`~fxsplit.schedule.Schedule`), ``microbatches``, ``program``, ``device_names`` (the
    name of each stage's device), ``training`` (the mode the model was captured in), ``executor`` (``"threads"``: one worker thread, and
    on CUDA one stream, per device so stages overlap; ``"sequential"``: one thread).

    Parameters live in the stages under their original names; stages on the same device share
    tied tensors, copies on other devices have their gradients summed after each step.
    """

    def __init__(
        self,
        program: StagedProgram,
        *,
        in_spec: pytree.TreeSpec,
        out_spec: pytree.TreeSpec,
        state: StateMap,
        schedule_kind: str = "1f1b",
        microbatches: int = 1,
        plan: Plan,
        device_names: Sequence[str] | None = None,
        training: bool | None = None,
        executor: str = "auto",
        bn_tracker: BatchNormTracker | None = None,
        batched_inputs: Sequence[bool] | None = None,
        batched_outputs: Sequence[bool | None] | None = None,
        layout: BatchLayout | None = None,
        autocast: torch.dtype | None = None,
        input_guards: Sequence[InputGuard] | None = None,
        size_outputs: Callable[[Sequence[Any]], Mapping[int, Any]] | None = None,
    ) -> None:
        self.program = program
        self.in_spec, self.out_spec = in_spec, out_spec
        self.input_guards = None if input_guards is None else tuple(input_guards)  # what the capture fixed
        self.size_outputs = size_outputs  # outputs that are numbers of the inputs' sizes: their batch values
        self.state = state
        self.plan = plan
        self.device_names = tuple(device_names) if device_names is not None else tuple(st.device for st in program.stages)
        self.training = training
        self.microbatches = microbatches
        self.schedule_kind = schedule_kind
        # Schedules and their global action orders, per (kind, micro-batches): made once.
        self._schedules: dict[tuple[str, int], tuple[Schedule, list[Action]]] = {}
        self.schedule = self._schedule_for(microbatches)
        self.executor = choose_executor(executor, [st.device for st in program.stages])
        _check_recompute_draws(self.executor, program, plan)
        self._devices = [torch.device(st.device) for st in program.stages]
        # Deferred BatchNorm (fxsplit.codegen.batchnorm): running statistics updated once per
        # step with the whole batch's statistics, as in the unsplit model.
        self.bn_tracker = bn_tracker
        # Which flat inputs/outputs carry the batch (from export's symbolic batch dimension).
        self.batched_inputs, self.batched_outputs = batched_inputs, batched_outputs
        # Where the batch is in the model's own inputs/outputs when not on dim 0 (batch_dim=):
        # the stages take and give batch-first values; the user sees the model's layout.
        self.layout = layout
        # Runtime trace (fxsplit.runtime.trace): times every F/B action of train_step for
        # pipe.trace(path); set to None to record nothing.
        self.recorder: TraceRecorder | None = TraceRecorder()
        self._recomputed: dict[int, RecomputedForward] = {}  # stages the plan recomputes
        # Mixed precision: every stage's forward (and the loss) under torch.autocast to this dtype.
        self.autocast = autocast
        self._loss_reductions = LossReductions()

    # -- structure ---------------------------------------------------------------------------
    @property
    def stages(self) -> tuple[Any, ...]:
        return self.program.stages

    @property
    def num_stages(self) -> int:
        return self.program.num_stages

    def _schedule_for(self, m: int) -> Schedule:
        return self._schedule_and_order(m)[0]

    def _schedule_and_order(self, m: int) -> tuple[Schedule, list[Action]]:
        """The schedule of ``m`` micro-batches and a valid global order of its actions (cached)."""
        key = (self.schedule_kind, m)
        if key not in self._schedules:
            ranks = self.plan.num_ranks  # several stages per rank when looped
            schedule = make(self.schedule_kind, self.num_stages, m, num_ranks=ranks)
            self._schedules[key] = (schedule, execution_order(schedule))
        return self._schedules[key]

    def _flatten(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        return flatten_to_spec(args, kwargs, self.in_spec, self.layout, self.input_guards)

    def _unflatten(self, flat: Sequence[Any]) -> Any:
        outs = list(flat)
        for i, const in self.program.output_constants.items():
            outs[i] = const
        return unflatten_to_spec(outs, self.out_spec, self.layout)

    @property
    def _target_dim(self) -> int:
        return self.layout.target_dim if self.layout is not None else 0

    # -- running -----------------------------------------------------------------------------
    def _stage_call(self, s: int) -> Callable[..., Any]:
        """Stage ``s``'s code, under recomputation when the plan says so."""
        stage = self.program.stages[s]
        if not self.plan.stages[s].recompute:
            return stage.gm
        if s not in self._recomputed:
            self._recomputed[s] = RecomputedForward(stage.gm)
        return self._recomputed[s]

    def _precision(self, s: int) -> Any:
        """``torch.autocast`` on stage ``s``'s device when the pipeline runs in mixed precision."""
        return precision(self._devices[s], self.autocast)

    def _run_stage(self, s: int, i: int, values: Sequence[Any]) -> tuple[Any, ...]:
        stage = self.program.stages[s]
        try:
            with self._precision(s):
                out = self._stage_call(s)(*values)
        except Exception as exc:
            raise ExecutionError(
                f"stage {s} failed on micro-batch {i} on {stage.device}: {type(exc).__name__}: {exc}",
                stage=s, microbatch=i, device=stage.device,
            ) from exc
        return tuple(out)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on a batch (forward only), split into ``microbatches``; same output
        structure as the original model. Autograd flows through, as in the original."""
        flat = self._flatten(args, kwargs)
        mbs, sizes = split_microbatches(flat, min(self.microbatches, batch_size_of(flat)), batched=self.batched_inputs)
        outs = []
        self._begin_step()
        for i, values in enumerate(mbs):
            for s in range(self.num_stages):
                values = list(self._run_stage(s, i, _to_stage(values, self._devices[s], leaf=False)))
            outs.append(values)
        self._end_step()
        reductions = None
        if len(outs) > 1 and (scalars := scalar_outputs(outs[0])):  # e.g. the model's own loss
            parts, joint = self._run_together(mbs, outs)
            reductions = scalar_reductions(parts, joint, sizes, scalars)
        given = self.size_outputs(flat) if self.size_outputs is not None else None
        return self._unflatten(merge_outputs(outs, sizes, self.batched_outputs, reductions, given))

    def _run_together(self, inputs: Sequence[Sequence[Any]],
                      outputs: Sequence[Sequence[Any]] | None) -> tuple[Sequence[Sequence[Any]], list[Any]]:
        """The micro-batches run together as one through every stage, without gradients, for
        :func:`~fxsplit.runtime.microbatch.scalar_reductions` (how a 0-d output adds up) and the
        loss check of a model that computes its loss itself: each call or step of a model with
        0-d outputs pays this forward of its whole batch. Draws give their expectation and autocast
        is off (:class:`~fxsplit.runtime.microbatch.DrawsAsExpected`), so when the stages draw
        random numbers or run in mixed precision, or no ``outputs`` are given, the micro-batches
        are run apart again the same way (a second forward of the batch): the parts compared with
        the joint run are computed as it is. Buffers the stages write are put back.

        Args:
            inputs: ``[k][flat inputs]`` the micro-batches' inputs (a value not split is the same
                object in all and is given once).
            outputs: ``[k][flat outputs]`` their outputs from the step, or None.

        Returns:
            ``(parts, joint)``: ``[k][flat outputs]`` and ``[flat outputs]``.

        Raises:
            ConfigError: when the stages update buffers once per step (deferred BatchNorm: an
                extra forward would count in the step's statistics), or draw random numbers other
                than dropout's.
        """
        if self.bn_tracker is not None:
            raise ConfigError(
                "the model returns a 0-d output (its own loss?) that must be checked by running its micro-batches "
                "together, and it updates buffers once per step (BatchNorm statistics), which that run would change. "
                "Return per-sample outputs and reduce them in loss_fn, or run with microbatches=1")
        joined = [column[0] if all(x is column[0] for x in column) else torch.cat([x.to(column[0].device) for x in column])
                  for column in zip(*inputs, strict=True)]
        again = outputs is None or self.autocast is not None or any(
            is_random(n) for st in self.program.stages for n in st.gm.graph.nodes)
        buffers = {id(b): (b, b.detach().clone()) for st in self.program.stages for b in st.gm.buffers()}

        def run(values: Sequence[Any]) -> list[Any]:
            for s in range(self.num_stages):
                values = list(self.program.stages[s].gm(*_to_stage(list(values), self._devices[s], leaf=False)))
            return list(values)

        try:
            with torch.no_grad(), DrawsAsExpected():
                joint = run(joined)
                parts = [run(values) for values in inputs] if again or outputs is None else outputs
        finally:
            for b, before in buffers.values():
                if not torch.equal(b, before):  # only those written: a copy bumps a saved tensor's version
                    b.copy_(before)
        return parts, joint

    def _begin_step(self) -> None:
        if self.bn_tracker is not None:
            self.bn_tracker.reset()

    def _end_step(self) -> None:
        if self.bn_tracker is not None:
            self.bn_tracker.commit()

    forward = __call__

    def train_step(
        self,
        *args: Any,
        target: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        grad_scaler: torch.amp.GradScaler | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Forward and backward one batch through the pipeline; return the batch loss.

        Args:
            args, kwargs: The model's inputs for the whole batch (batch on dim 0, or where
                ``compile(batch_dim=...)`` said).
            target: Passed to ``loss_fn``; tensors with the batch are split with the inputs
                (on the first input's batch dimension when they have it, else on dim 0:
                :func:`~fxsplit.runtime.microbatch.target_batch_dim`).
            loss_fn: ``loss_fn(output, target) -> scalar``, a mean over the batch (the contract)
                or a sum (``reduction="sum"``: found on the first micro-batch, then the
                micro-batch losses are added unweighted).
            grad_scaler: fp16 loss scaling (``torch.amp.GradScaler``): every micro-batch's loss
                goes backward as ``grad_scaler.scale(loss)``, as ``scaler.scale(loss).backward()``
                does in the unsplit model; then call ``grad_scaler.step(optimizer)`` and
                ``grad_scaler.update()`` as usual. The returned loss is not scaled.

        Returns:
            The loss of the whole batch (detached, 0-d), as ``loss_fn(model(*args), target)``.
            Gradients accumulate in the stage parameters as ``loss.backward()`` would in the
            original model.

        Raises:
            ConfigError: for inputs of the wrong structure, a batch smaller than the number of
                micro-batches, or a ``loss_fn`` that is neither a mean nor a sum over the batch
                (it mixes samples, so micro-batching would change it; raised before any backward).
            ExecutionError: when a stage fails (names the stage, micro-batch and device).
                Whatever fails, every gradient is left as it was before the step.
        """
        step = self.new_step(args, kwargs, target=target, loss_fn=loss_fn, grad_scaler=grad_scaler)
        schedule, order = self._schedule_and_order(self.microbatches)
        self._begin_step()
        saved = self._stash_grads()
        try:
            if self.executor == "threads":
                run_threaded(schedule, lambda action: self.run_action(action, step),
                             [self.program.stages[schedule.stages_of(r)[0]].device for r in range(schedule.num_ranks)])
            else:
                for action in order:
                    self.run_action(action, step)
            self._sync_tied()
            self._check_pairs(step)
            if step.scalars:
                self._check_together(step)
        except BaseException:
            self._unstash_grads(saved, ok=False)  # the gradients are as before the step
            raise
        self._unstash_grads(saved, ok=True)
        self._end_step()
        return step.total_loss()

    def new_step(self, args: Sequence[Any], kwargs: Mapping[str, Any], *, target: Any,
                 loss_fn: Callable[[Any, Any], torch.Tensor], grad_scaler: torch.amp.GradScaler | None = None) -> _Step:
        """The state of one training step on a batch, for :meth:`run_action` (``train_step`` runs
        its schedule's actions on it; the shard runtime, :mod:`fxsplit.runtime.shards`, runs them
        one unit at a time). Arguments as :meth:`train_step`'s.

        Raises:
            ConfigError: for a ``loss_fn`` that is not callable or inputs of the wrong structure.
        """
        if not callable(loss_fn):
            raise ConfigError(f"train_step needs loss_fn=callable(output, target) -> scalar, got {loss_fn!r}")
        flat = self._flatten(args, kwargs)
        m = self.microbatches
        mbs, sizes = split_microbatches(flat, m, batched=self.batched_inputs)
        # Target leaves are split with the inputs' batch size; leaves without it go whole.
        return _Step(mbs, split_target(target, m, sum(sizes), self._target_dim), loss_weights(sizes), loss_fn,
                     losses=[None] * m, sizes=sizes, reduction_checked=m == 1,
                     target_dims=target_leaf_dims(target, sum(sizes), self._target_dim),
                     scale=grad_scaler.scale if grad_scaler is not None else None)

    def run_action(self, action: Action, step: _Step) -> None:
        """Run one F, B, I or W action of ``step`` (:meth:`new_step`); the recorder (runtime
        trace) gets its start and end times. Actions must come in an order the schedule
        validator accepts (a stage's forward before its backward, stage by stage)."""
        s, kind, i = action.stage, action.kind, action.microbatch
        if step.pending and s == self.num_stages - 1:  # the last stage's loss checks, between its actions
            self._check_pairs(step)
        start = time.perf_counter()
        if kind == "F":
            self._forward(s, i, step)
        elif kind == "W":
            self._guarded(s, i, "weight-gradient backward", lambda: backward_weight(self._pending(s, i, step)))
        else:
            self._backward(s, i, step, split=kind == "I")
        if self.recorder is not None:
            self.recorder.add(s, kind, i, start, action_end_s(self._devices[s]))

    def _forward(self, s: int, i: int, step: _Step) -> None:
        received = step.inputs[i] if s == 0 else step.slots[(s - 1, i)].outputs
        values = _to_stage(received, self._devices[s], leaf=s > 0)
        outputs = self._run_stage(s, i, values)
        step.slots[(s, i)] = _Slot(values, outputs)
        if s == self.num_stages - 1:
            try:
                if not step.reduction_checked:  # the first micro-batch of a step that has several
                    step.reduction_checked = True
                    kind = self._loss_reductions.of(step.loss_fn, outputs, self.batched_outputs, self._unflatten,
                                                    step.targets[i], step.sizes[i], self._target_dim,
                                                    step.target_dims)
                    if kind == "sum":  # a sum over the batch is the plain sum of the micro-batches' sums
                        step.weights = [1.0] * len(step.weights)
                    step.reduction = kind
                with self._precision(s):  # as the unsplit model under autocast computes its loss
                    loss = step.loss_fn(self._unflatten(outputs), step.targets[i])
                if len(step.inputs) > 1 and step.reduction != "unknown":  # for the loss checks, between actions
                    if scalar_outputs(outputs):  # the model computes a 0-d value itself: checked together
                        step.scalars = True
                    else:
                        now = [x.detach() if isinstance(x, torch.Tensor) else x for x in outputs]
                        if step.kept is not None and step.kept[0] == i - 1:
                            step.pending.append((i - 1, (step.kept[1], now), (step.kept[2], loss.detach())))
                        step.kept = (i, now, loss.detach())
            except ConfigError:
                raise
            except Exception as exc:
                hint = "; train_step was given no target (pass target=...)" if step.targets[i] is None else ""
                raise ExecutionError(f"loss_fn failed on micro-batch {i}: {type(exc).__name__}: {exc}{hint}",
                                     stage=s, microbatch=i) from exc
            weight = step.weights[i]
            step.losses[i] = loss if weight == 1.0 else loss * weight  # x * 1.0 == x: skip the op

    def _check_pairs(self, step: _Step) -> None:
        """Between actions (outside the traced ones) and after the step's: every two consecutive
        micro-batches together give the loss their weights add up
        (:func:`~fxsplit.runtime.microbatch.check_loss_pair`; all pairs passing means the whole
        batch does); at most two micro-batches' outputs are kept for it."""
        while step.pending:
            i, outputs, losses = step.pending.pop(0)
            same = self.autocast is None and all(x.dtype == torch.float32 for x in losses)  # as the check computes
            check_loss_pair(step.loss_fn, outputs, step.targets[i:i + 2], step.sizes[i:i + 2], step.reduction,
                            self.batched_outputs, self._unflatten, self._target_dim, first=i,
                            losses=[float(x) for x in losses] if same else None, target_dims=step.target_dims)

    def _check_together(self, step: _Step) -> None:
        """After the step of a model with 0-d outputs (its own loss): all its micro-batches run
        together give the loss the weights add up (:meth:`_run_together`)."""
        parts, joint = self._run_together(step.inputs, None)
        check_loss_pair(step.loss_fn, parts, step.targets, step.sizes, step.reduction, self.batched_outputs,
                        self._unflatten, self._target_dim, joint=joint, target_dims=step.target_dims)

    @staticmethod
    def _pending(s: int, i: int, step: _Step) -> PendingWeights:
        """What the input half of stage ``s``, micro-batch ``i`` left for its weight half."""
        pending = step.slots.pop((s, i)).pending
        if pending is None:  # the validator orders every W after its I: a bug if it is missing
            raise InternalError(f"{s}W{i} ran before {s}I{i}: this is a bug in fxsplit's schedule validation")
        return pending

    def _backward(self, s: int, i: int, step: _Step, split: bool = False) -> None:
        """A full backward (B), or with ``split`` its input half (I), whose weight half W runs later."""
        last = s == self.num_stages - 1
        slot = step.slots[(s, i)] if split else step.slots.pop((s, i))
        loss = step.losses[i]
        if last and loss is not None and step.scale is not None:
            loss = step.scale(loss)  # fp16: the scaled loss goes backward, the step returns the true one
        outputs, grads = ([loss], None) if last else (_tensor_leaves(slot.outputs), step.grads.pop((s, i)))
        if split:
            weights = [p for p in self.program.stages[s].gm.parameters() if p.requires_grad]
            in_grads, slot.pending = self._guarded(
                s, i, "input-gradient backward",
                lambda: backward_input(outputs, grads, _tensor_leaves(slot.inputs), weights,
                                       whole=self.plan.stages[s].recompute))
        else:
            self._guarded(s, i, "backward", lambda: self._backward_from(outputs, grads) if grads is not None
                          else loss.backward() if loss is not None and loss.requires_grad else None)
            # (stage 0's inputs are the user's, views of them when they need a gradient: it flows there)
            in_grads = [t.grad if t is not None and t.requires_grad else None
                        for t in _tensor_leaves(slot.inputs)] if s > 0 else []
        if s > 0:
            step.grads[(s - 1, i)] = in_grads
        if last and (loss := step.losses[i]) is not None:
            step.losses[i] = loss.detach()  # frees the graph's reference to the loss

    def _guarded(self, s: int, i: int, what: str, run: Callable[[], Any]) -> Any:
        """``run()``, its failure raised as an :class:`ExecutionError` naming the stage and micro-batch."""
        try:
            return run()
        except Exception as exc:
            device = self.program.stages[s].device
            raise ExecutionError(
                f"{what} of stage {s} failed on micro-batch {i} on {device}: {type(exc).__name__}: {exc}",
                stage=s, microbatch=i, device=device,
            ) from exc

    @staticmethod
    def _backward_from(outputs: Sequence[Any], grads: Sequence[Any]) -> None:
        """One ``torch.autograd.backward`` over every output leaf that has a gradient."""
        roots, root_grads = [], []
        for o, g in zip(outputs, grads, strict=True):
            if o is not None and g is not None and o.requires_grad:
                roots.append(o)
                root_grads.append(g if g.device == o.device else g.to(o.device))
        if roots:
            torch.autograd.backward(roots, root_grads)

    def _sync_tied(self) -> None:
        for name, holders in self.program.tied.items():
            copies = [self.state.tensor(s, name) for s in holders]
            present = [c.grad for c in copies if c.grad is not None]
            if not present:
                continue
            total = torch.stack([g.to(present[0].device) for g in present]).sum(dim=0)
            for c in copies:
                c.grad = total.to(c.device).clone()

    # -- parameters and state ----------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(original name, parameter)`` of every parameter (tied copies on other devices too)."""
        return self.state.named_parameters()

    def _tensor_key(self, name: str) -> str:
        return self.state.to_graph.get(name, name)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's ``state_dict`` keys, in its order, with the stages' values."""
        return self.state.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load an original-model state dict into every stage (and every tied copy)."""
        self.state.load_state_dict(state_dict, strict=strict)

    def train(self, mode: bool = True) -> Pipeline:
        """Check the mode: ``torch.export`` records training or eval behaviour (dropout,
        BatchNorm) in the captured graph, so the pipeline runs in the mode the model had when it
        was compiled.

        Raises:
            ConfigError: when ``mode`` differs from that mode (compile the model again after
                ``model.train()`` / ``model.eval()``).
        """
        check_mode(self.training, mode)
        return self

    def eval(self) -> Pipeline:
        return self.train(False)

    def sync_tied_grads(self) -> None:
        """Sum the gradients of tied copies on different devices and give each copy the sum.

        :meth:`train_step` does this itself; call it after your own ``loss.backward()`` on
        ``pipe(...)``'s output so the copies get the same update.
        """
        self._sync_tied()

    def trace(self, path: Any) -> Any:
        """Write a Chrome trace (chrome://tracing, Perfetto) of the latest :meth:`train_step`
        to ``path``: one row per stage, one event per F/B action; see :mod:`fxsplit.runtime.trace`."""
        from fxsplit.runtime.trace import write_trace

        return write_trace(self, path)

    def __repr__(self) -> str:
        """Plain text, one line per stage (``fxsplit.viz.stage_table`` draws the full table)."""
        head = (f"{type(self).__name__}({self.num_stages} stages, {self.schedule_kind}, {self.microbatches} micro-batches, "
                f"solver {self.plan.solver} ({self.plan.status})")
        rows = []
        for st in self.stages:
            sp = self.plan.stages[st.index]
            name = self.device_names[st.index]
            where = name if name == st.device else f"{name} ({st.device})"
            rows.append(f"  stage {st.index} on {where}: blocks {format_ids(sp.blocks) or 'none'}, "
                        f"{format_seconds(sp.compute_s)}/micro-batch, {format_bytes(sp.memory_bytes)}")
        return "\n".join([head + ":", *rows]) + ")"


EXECUTORS = ("auto", "sequential", "threads")


def _check_recompute_draws(executor: str, program: StagedProgram, plan: Plan) -> None:
    """Refuse what would give silently wrong gradients: a recomputing CPU stage that draws random
    numbers (dropout), run by the threads executor beside another CPU stage. Its recomputation
    replays the global CPU generator from where its forward began, and the other stage's worker
    may have drawn from that generator in between, so the masks would differ.

    Raises:
        ConfigError: naming the stage and the fix (``executor="sequential"``).
    """
    if executor != "threads":
        return
    # one worker thread per rank; the stages of one rank (a looped schedule) run in turn on it
    cpu_ranks = [held for held in plan.rank_stages if torch.device(program.stages[held[0]].device).type == "cpu"]
    if len(cpu_ranks) < 2:
        return
    for s in (s for held in cpu_ranks for s in held):
        if plan.stages[s].recompute and any(is_random(n) for n in program.stages[s].gm.graph.nodes):
            raise ConfigError(
                f"stage {s} recomputes its activations and draws random numbers (dropout) on the CPU, which "
                f"{len(cpu_ranks) - 1} other worker(s) share under executor='threads': its recomputation would "
                "draw other masks than its forward. Use executor='sequential', or recompute='none'")


def choose_executor(executor: str, devices: Sequence[str]) -> str:
    """``"threads"`` (one worker per device, stages overlap) or ``"sequential"`` (one thread,
    actions in a valid global order); ``"auto"`` picks threads when a stage is on CUDA."""
    if executor not in EXECUTORS:
        raise ConfigError(f"executor={executor!r} is unknown; choose one of {EXECUTORS}")
    if executor == "auto":
        return "threads" if any(torch.device(d).type == "cuda" for d in devices) else "sequential"
    return executor
