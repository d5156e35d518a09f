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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxsplit.codegen.split import StagedProgram
from fxsplit.errors import ConfigError, ExecutionError
from fxsplit.passes.capture import flatten_to_spec
from fxsplit.runtime.microbatch import batch_size_of, merge_outputs, split_microbatches
from fxsplit.runtime.state import ParameterAPI, StateMap
from fxsplit.runtime.threads import run_threaded
from fxsplit.runtime.trace import TraceRecorder, span
from fxsplit.schedule import Action, Schedule, make, simulate

__all__ = ["Pipeline", "execution_order"]

log = logging.getLogger(__name__)


def execution_order(schedule: Schedule) -> list[Action]:
    """A global order of the schedule's actions that respects every dependency.

    Simulates the schedule with unit forward and double backward times and sorts the actions by
    start time (ties by rank), which interleaves the per-device lists the way the devices would.
    """
    p = schedule.num_stages
    timeline = simulate(schedule, [1.0] * p, [2.0] * p)
    return [e.action for e in sorted(timeline.events, key=lambda e: (e.start_s, e.rank))]


def _to_stage(value: Any, device: torch.device, leaf: bool) -> Any:
    """Move a received value to ``device``; with ``leaf``, detach it into a new autograd leaf."""
    if isinstance(value, torch.Tensor):
        moved = value.to(device)
        if leaf:
            moved = moved.detach().requires_grad_(value.requires_grad)
        if moved.is_cuda and moved is not value:
            # made on another worker's stream: keep the allocator from reusing it too early
            moved.record_stream(torch.cuda.current_stream(device))
        return moved
    if isinstance(value, list | tuple):
        return type(value)(_to_stage(v, device, leaf) for v in value)
    return value


def _tensor_leaves(values: Sequence[Any]) -> list[torch.Tensor | None]:
    return [v if isinstance(v, torch.Tensor) else None for v in pytree.tree_leaves(list(values))]


@dataclass
class _Slot:
    """What one (stage, micro-batch) keeps between its forward and its backward."""

    inputs: list[Any] = field(default_factory=list)
    outputs: tuple[Any, ...] = ()
    loss: torch.Tensor | None = None


class Pipeline(ParameterAPI):
    """A model split into stages, callable like the model, trainable with :meth:`train_step`.

    Build it with :func:`fxsplit.compile`. Attributes: ``plan`` (the :class:`~fxsplit.ir.Plan`),
    ``stages`` (the :class:`~fxsplit.codegen.Stage` s), ``schedule`` (the
    :class:`~fxsplit.schedule.Schedule`), ``microbatches``, ``program``, ``report`` (why the
    schedule was chosen, predicted times), ``executor`` (``"threads"``: one worker thread, and
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
        plan: Any = None,
        report: Mapping[str, Any] | None = None,
        executor: str = "auto",
        bn_tracker: Any = None,
        batched_inputs: Sequence[bool] | None = None,
        batched_outputs: Sequence[bool] | None = None,
    ) -> None:
        self.program = program
        self.in_spec, self.out_spec = in_spec, out_spec
        self.state = state
        self.plan = plan
        self.report = dict(report or {})
        self.microbatches = microbatches
        self.schedule_kind = schedule_kind
        self._schedules: dict[int, Schedule] = {}
        self._orders: dict[int, list[Action]] = {}
        self.schedule = self._schedule_for(microbatches)
        self.executor = _choose_executor(executor, [st.device for st in program.stages])
        # Deferred BatchNorm (fxsplit.codegen.batchnorm): running statistics updated once per
        # step with the whole batch's statistics, as in the unsplit model.
        self.bn_tracker = bn_tracker
        # Which flat inputs/outputs carry the batch (from export's symbolic batch dimension).
        self.batched_inputs, self.batched_outputs = batched_inputs, batched_outputs
        # Runtime trace (fxsplit.runtime.trace): times every F/B action of train_step for
        # pipe.trace(path); set to None to record nothing.
        self.recorder: TraceRecorder | None = TraceRecorder()

    # -- structure ---------------------------------------------------------------------------
    @property
    def stages(self) -> tuple[Any, ...]:
        return self.program.stages

    @property
    def num_stages(self) -> int:
        return self.program.num_stages

    def _schedule_for(self, m: int) -> Schedule:
        if m not in self._schedules:
            self._schedules[m] = make(self.schedule_kind, self.num_stages, m)
            self._orders[m] = execution_order(self._schedules[m])
        return self._schedules[m]

    def _flatten(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        return flatten_to_spec(args, kwargs, self.in_spec)

    def _unflatten(self, flat: Sequence[Any]) -> Any:
        outs = list(flat)
        for i, const in self.program.output_constants.items():
            outs[i] = const
        return pytree.tree_unflatten(outs, self.out_spec)

    # -- running -----------------------------------------------------------------------------
    def _run_stage(self, s: int, i: int, values: Sequence[Any]) -> tuple[Any, ...]:
        stage = self.program.stages[s]
        try:
            out = stage.gm(*values)
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
            for s, stage in enumerate(self.program.stages):
                values = list(self._run_stage(s, i, _to_stage(values, torch.device(stage.device), leaf=False)))
            outs.append(values)
        self._end_step()
        return self._unflatten(merge_outputs(outs, sizes, self.batched_outputs))

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
        **kwargs: Any,
    ) -> torch.Tensor:
        """Forward and backward one batch through the pipeline; return the batch loss.

        Args:
            args, kwargs: The model's inputs for the whole batch (batch on dim 0).
            target: Passed to ``loss_fn``; tensors with the batch on dim 0 are split with the
                inputs.
            loss_fn: ``loss_fn(output, target) -> scalar``, mean-reduced over the batch.

        Returns:
            The loss of the whole batch (detached, 0-d), as ``loss_fn(model(*args), target)``.
            Gradients accumulate in the stage parameters as ``loss.backward()`` would in the
            original model.

        Raises:
            ConfigError: for inputs of the wrong structure or a batch smaller than the number of
                micro-batches.
            ExecutionError: when a stage fails (names the stage, micro-batch and device).
        """
        flat = self._flatten(args, kwargs)
        m = self.microbatches
        mbs, sizes = split_microbatches(flat, m, batched=self.batched_inputs)
        # Target leaves are split with the inputs' batch size; leaves without it go whole.
        targets: list[list[Any]] = (
            split_microbatches(pytree.tree_leaves(target), m, batch=sum(sizes))[0] if target is not None else [[]] * m
        )
        tspec = pytree.tree_structure(target)
        slots = {(s, i): _Slot() for s in range(self.num_stages) for i in range(m)}
        grads: dict[tuple[int, int], list[Any]] = {}
        total = sum(sizes)

        def run(action: Action) -> None:
            s, i = action.stage, action.microbatch
            if action.kind == "F":
                t = pytree.tree_unflatten(targets[i], tspec) if target is not None else None
                with span(self.recorder, s, "F", i):  # runtime trace
                    self._forward(s, i, mbs[i], slots, t, sizes[i] / total, loss_fn)
            else:
                with span(self.recorder, s, "B", i):  # runtime trace
                    self._backward(s, i, slots, grads)

        schedule = self._schedule_for(m)
        self._begin_step()
        if self.executor == "threads":
            run_threaded(schedule, run, [st.device for st in self.program.stages])
        else:
            for action in self._orders[m]:
                run(action)
        self._sync_tied()
        self._end_step()
        losses = [loss for i in range(m) if (loss := slots[(self.num_stages - 1, i)].loss) is not None]
        return torch.stack([loss.detach().to(losses[0].device) for loss in losses]).sum()

    def _forward(self, s: int, i: int, inputs: list[Any], slots: dict, target: Any, weight: float, loss_fn: Callable) -> None:
        device = torch.device(self.program.stages[s].device)
        received = inputs if s == 0 else list(slots[(s - 1, i)].outputs)
        values = _to_stage(received, device, leaf=s > 0)
        slot = slots[(s, i)]
        slot.inputs = values
        slot.outputs = self._run_stage(s, i, values)
        if s == self.num_stages - 1:
            try:
                loss = loss_fn(self._unflatten(slot.outputs), target)
            except Exception as exc:
                raise ExecutionError(f"loss_fn failed on micro-batch {i}: {type(exc).__name__}: {exc}", stage=s, microbatch=i) from exc
            slot.loss = loss * weight

    def _backward(self, s: int, i: int, slots: dict, grads: dict) -> None:
        slot = slots[(s, i)]
        stage = self.program.stages[s]
        try:
            if s == self.num_stages - 1:
                if slot.loss is not None and slot.loss.requires_grad:
                    slot.loss.backward()
            else:
                pairs = [
                    (o, g) for o, g in zip(_tensor_leaves(slot.outputs), grads.pop((s, i)), strict=True)
                    if o is not None and g is not None and o.requires_grad
                ]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g.to(o.device) for o, g in pairs])
        except Exception as exc:
            raise ExecutionError(
                f"backward of stage {s} failed on micro-batch {i} on {stage.device}: {type(exc).__name__}: {exc}",
                stage=s, microbatch=i, device=stage.device,
            ) from exc
        if s > 0:
            grads[(s - 1, i)] = [t.grad if t is not None and t.requires_grad else None for t in _tensor_leaves(slot.inputs)]
        slot.inputs, slot.outputs, slot.loss = [], (), slot.loss.detach() if slot.loss is not None else None

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
        captured = self.report.get("training")
        if captured is not None and bool(mode) != captured:
            want, have = ("train", "eval") if mode else ("eval", "train")
            raise ConfigError(
                f"the pipeline was compiled from a model in {have} mode, and torch.export records the mode "
                f"in the graph; call model.{want}() and fxsplit.compile it again for {want} mode"
            )
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
        from fxsplit.runtime.describe import describe

        return describe(self)


EXECUTORS = ("auto", "sequential", "threads")


def _choose_executor(executor: str, devices: Sequence[str]) -> str:
    """``"threads"`` (one worker per device, stages overlap) or ``"sequential"`` (one thread,
    actions in a valid global order); ``"auto"`` picks threads when a stage is on CUDA."""
    if executor not in EXECUTORS:
        raise ConfigError(f"executor={executor!r} is unknown; choose one of {EXECUTORS}")
    if executor == "auto":
        return "threads" if any(torch.device(d).type == "cuda" for d in devices) else "sequential"
    return executor
