"""Train many models at once with shard parallelism and spilling (Hydra): :func:`train_many`.

Orchestration only: each model is captured and costed by the front end, cut into the fewest
shards that fit a device (:func:`fxsplit.solvers.shards.fewest_shards`), split by codegen, and
its units run by :mod:`fxsplit.runtime.shards` as the scheduler of
:mod:`fxsplit.schedule.shards` chooses; the simulator predicts the makespan beforehand.

Example:
    >>> import torch
    >>> from fxsplit.multi import Task, train_many
    >>> def data(seed):
    ...     g = torch.Generator().manual_seed(seed)
    ...     return [((torch.randn(4, 8, generator=g),), torch.randn(4, 2, generator=g)) for _ in range(2)]
    >>> tasks = [Task(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
    ...               lambda p: torch.optim.SGD(p, lr=lr), torch.nn.functional.mse_loss, data(0), steps=2)
    ...          for lr in (0.1, 0.01)]
    >>> result = train_many(tasks, devices=2)
    >>> len(result.models), result.report.shards
    (2, (1, 1))

References:
    Nagrecha and Kumar, "Model-Parallel Model Selection for Deep Learning Systems", SIGMOD 2021;
    "Hydra: A System for Large Multi-Model Deep Learning", 2021.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxsplit.compiler import assemble
from fxsplit.errors import ConfigError, InfeasibleError
from fxsplit.frontend import front_end, loss_times_s
from fxsplit.ir import DeviceSpec, Plan, Problem
from fxsplit.options import CompileOptions
from fxsplit.passes.costs import measure_cpu_spec
from fxsplit.passes.per_sample import is_random
from fxsplit.runtime import Pipeline
from fxsplit.runtime.shards import (
    DevicePool,
    ShardedModel,
    optimizer_coupling,
    optimizer_state_factor,
    optimizer_step_s,
    run_shards,
)
from fxsplit.schedule.shards import (
    ShardRun,
    ShardTask,
    makespan_lower_bound,
    simulate_shards,
)
from fxsplit.solvers.shards import fewest_shards

__all__ = ["Task", "TrainManyReport", "TrainManyResult", "train_many", "optimizer_state_factor", "optimizer_step_s"]

log = logging.getLogger(__name__)


@dataclass
class Task:
    """One model to train.

    Args:
        model: The module, or a factory ``() -> nn.Module`` called once.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer`` (e.g. ``lambda p:
            torch.optim.AdamW(p, lr=3e-4)``); called once per shard with the parameters it owns.
            Per-parameter optimizers (SGD, Adam, AdamW, ...) train exactly as one optimizer over
            the whole model; one that couples parameters (a global gradient norm inside its step)
            would not, and is refused (ConfigError) when the model needs several shards.
        loss_fn: ``loss_fn(output, target) -> scalar``.
        data: An iterable of ``(inputs, target)`` batches; ``inputs`` is the tuple of the model's
            positional inputs (or one tensor), batch on dim 0.
        steps: Training steps; or ``epochs`` passes over ``data`` (which must then have a length).
        epochs: See ``steps``; give exactly one of the two.
        name: Shown in reports (default ``task{i}``).
    """

    model: nn.Module | Callable[[], nn.Module]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    data: Iterable[Any]
    steps: int | None = None
    epochs: int | None = None
    name: str = ""

    def num_steps(self) -> int:
        """Training steps this task runs.

        Raises:
            ConfigError: unless exactly one of ``steps`` and ``epochs`` is a positive count, or
                for ``epochs`` with data that has no length.
        """
        if (self.steps is None) == (self.epochs is None):
            raise ConfigError(f"task {self.name!r}: give steps=N or epochs=N (exactly one); got steps={self.steps}, "
                              f"epochs={self.epochs}")
        count = self.steps if self.steps is not None else self.epochs
        if not isinstance(count, int) or count < 1:
            raise ConfigError(f"task {self.name!r}: steps/epochs={count!r}; give a positive integer")
        if self.epochs is None:
            if isinstance(self.data, Sized) and len(self.data) < count:
                raise ConfigError(f"task {self.name!r}: steps={count} but its data has {len(self.data)} batches; "
                                  "give at least that many (or epochs=N to pass over them again)")
            return count
        if not isinstance(self.data, Sized):
            raise ConfigError(f"task {self.name!r}: epochs={self.epochs} needs data with a length (a list, a "
                              "DataLoader); give steps=N for an iterator")
        return count * len(self.data)

    def batches(self) -> Iterator[Any]:
        """The task's batches, ``epochs`` passes over ``data`` (or ``data`` once for ``steps``)."""
        if self.epochs is None:
            return iter(self.data)
        return itertools.chain.from_iterable(self.data for _ in range(self.epochs))


@dataclass(frozen=True)
class TrainManyReport:
    """What :func:`train_many` did.

    Attributes:
        names: ``[num_tasks]`` task names.
        shards: ``[num_tasks]`` shards of each model.
        plans: ``[num_tasks]`` each model's shard plan (per-shard times and memory).
        scheduler: The policy that ran.
        measured: The run's timeline (seconds from its start).
        predicted: The simulator's timeline from the cost model's shard times.
        lower_bound_s: ``max(total work / devices, longest model)`` from the cost model's times.
        moved_bytes: Bytes of state that moves between host and devices carried.
        losses: ``[num_tasks][steps]`` each step's loss.
        budget_bytes: Each device's memory budget (None: unlimited).
    """

    names: tuple[str, ...]
    shards: tuple[int, ...]
    plans: tuple[Plan, ...]
    scheduler: str
    measured: ShardRun
    predicted: ShardRun
    lower_bound_s: float
    moved_bytes: int
    losses: tuple[tuple[float, ...], ...]
    budget_bytes: int | None = None

    @property
    def makespan_s(self) -> float:
        return self.measured.makespan_s

    @property
    def utilisation(self) -> tuple[float, ...]:
        return self.measured.utilisation()

    @property
    def measured_lower_bound_s(self) -> float:
        """The makespan bound from the measured unit times: ``max(total busy time / devices,
        the longest model's units back to back)``, seconds. The scheduler's own loss against a
        perfect schedule of the same units is ``makespan_s / measured_lower_bound_s``."""
        per_task = [0.0] * len(self.names)
        for e in self.measured.events:
            per_task[e.task] += e.end_s - e.start_s
        return max(sum(per_task) / self.measured.num_devices, max(per_task, default=0.0))

    def gantt(self, width: int = 72) -> str:
        """The measured timeline as text (:func:`fxsplit.viz.render_shard_gantt`)."""
        from fxsplit.viz import render_shard_gantt

        return render_shard_gantt(self.measured, self.names, width)


@dataclass(frozen=True)
class TrainManyResult:
    """The trained models (the tasks' own modules, parameters updated in place, original names),
    each shard's optimizer (None for a shard without parameters), and the report."""

    models: tuple[nn.Module, ...]
    optimizers: tuple[tuple[torch.optim.Optimizer | None, ...], ...]
    report: TrainManyReport
    sharded: tuple[ShardedModel, ...] = ()

    def optimizer_state(self, task: int) -> dict[str, dict[str, Any]]:
        """Task ``task``'s optimizer state per parameter, keyed by the parameter's original name
        (compare with ``optimizer.state[param]`` of training the model alone)."""
        sharded = self.sharded[task]
        names = {id(p): n for n, p in self.models[task].named_parameters()}
        return {names[id(p)]: dict(opt.state[p]) for opt, params in zip(sharded.optimizers, sharded.owned, strict=True)
                if opt is not None for p in params if p in opt.state}


def train_many(
    tasks: Sequence[Task],
    devices: int | Sequence[str],
    *,
    memory_per_device_bytes: int | None = None,
    scheduler: str = "lrtf",
    prefetch: bool = True,
    cost_model: str = "analytic",
    options: CompileOptions | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    recompute: bool = False,
) -> TrainManyResult:
    """Train ``tasks`` concurrently on ``devices`` by shard parallelism (Hydra).

    Each model is cut into the fewest shards whose parameters, gradients, optimizer state and
    one mini-batch of activations fit ``memory_per_device_bytes``; its training becomes a chain
    of units (forward of each shard, the last shard's loss and backward, the backward of each
    other shard, optimizer step per shard), and free devices take the next unit of the model
    ``scheduler`` prefers. Every model ends as training it alone would leave it (same parameters
    and optimizer state).

    Args:
        tasks: The models and how to train each.
        devices: A count of CPU workers or ``["cpu", ...]``.
        memory_per_device_bytes: Each device's memory budget, bytes; None: whole models.
        scheduler: ``"lrtf"`` (Hydra's Sharded-LRTF), ``"fifo"`` or ``"round-robin"``.
        prefetch: Hide the move of a shard's state behind the device's previous unit in the
            prediction (on the CPU the state does not move).
        cost_model: ``"analytic"`` (default), ``"measured"`` or ``"profiled"``: the unit times
            the scheduler starts from (it re-estimates them from measurement as units finish).
        recompute: False (default): a shard's forward keeps its activations, spilled to host
            memory until its backward (Hydra's spilling; on the CPU they stay where they are).
            True: it keeps only its inputs and its backward runs the forward again (one more
            forward per shard and step; host memory holds only the shard boundaries).
        options: :class:`CompileOptions` of the capture (``capture_method``, ``max_downsets``).
        progress: ``progress(task, units_done, units_total)`` after each unit.

    Returns:
        A :class:`TrainManyResult`.

    Raises:
        ConfigError: for no tasks, a bad task, a device that is not a CPU, an unknown scheduler,
            or with ``recompute`` a model that draws random numbers (dropout) trained on several
            workers (its recomputed forward would draw other masks than its first forward).
        InfeasibleError: when a single block of a model does not fit the memory budget.
        ExecutionError: when a unit fails (names the shard and device).
    """
    if not tasks:
        raise ConfigError("train_many needs at least one Task")
    pool_devices = _cpu_devices(devices)
    options = _checked_options(options or CompileOptions())
    tasks = [t if t.name else dataclasses.replace(t, name=f"task{i}") for i, t in enumerate(tasks)]
    if len({t.name for t in tasks}) != len(tasks):
        raise ConfigError(f"task names repeat: {[t.name for t in tasks]}; give each task its own name")
    _check_shared_data(tasks)
    with torch.random.fork_rng(devices=[]):  # setup draws (the CPU probe) leave the tasks' generator alone
        reference = measure_cpu_spec()
        if memory_per_device_bytes is not None:
            reference = reference.with_(memory_bytes=int(memory_per_device_bytes))
        models = [_shard_task(t, reference, cost_model, options, recompute) for t in tasks]
    _check_shared_state(models)
    _check_draws(models, len(pool_devices), recompute)
    shard_tasks = [m.task for m in models]
    predicted = simulate_shards(shard_tasks, len(pool_devices), scheduler, prefetch=prefetch)
    pool = DevicePool(pool_devices, [memory_per_device_bytes] * len(pool_devices))
    measured = run_shards(models, pool, scheduler, progress)
    report = TrainManyReport(
        names=tuple(t.name for t in tasks), shards=tuple(m.num_shards for m in models),
        plans=tuple(m.pipe.plan for m in models), scheduler=scheduler, measured=measured.run, predicted=predicted,
        lower_bound_s=makespan_lower_bound(shard_tasks, len(pool_devices)), moved_bytes=measured.moved_bytes,
        losses=tuple(tuple(m.losses) for m in models), budget_bytes=memory_per_device_bytes,
    )
    return TrainManyResult(tuple(m.model for m in models), tuple(tuple(m.optimizers) for m in models), report,
                           tuple(models))


def _checked_options(options: CompileOptions) -> CompileOptions:
    """The capture options train_many uses: its own executor, no recomputation planning, tied
    weights shared (not copied: each copy would get its own optimizer), no deferred BatchNorm.

    Raises:
        ConfigError: for ``autocast`` (not built for train_many).
    """
    if options.autocast is not None:
        raise ConfigError(f"options.autocast={options.autocast!r}: train_many does not run mixed precision yet; "
                          "leave autocast=None")
    return dataclasses.replace(options, executor="sequential", recompute="none", deferred_batch_norm=False,
                               copy_tied=False)


def _check_shared_data(tasks: Sequence[Task]) -> None:
    """Refuse one iterator given to several tasks: they would split its batches between them."""
    for i, a in enumerate(tasks):
        for b in tasks[i + 1:]:
            if a.data is b.data and iter(a.data) is a.data:
                raise ConfigError(f"tasks {a.name!r} and {b.name!r} share one data iterator, so each would train on "
                                  "part of its batches; give each task its own iterable (a list is fine to share)")


def _check_shared_state(models: Sequence[ShardedModel]) -> None:
    """Refuse tasks whose models share parameters or buffers: each task's optimizer would update
    the other's weights, and neither would end as trained alone."""
    owner: dict[int, str] = {}
    for m in models:
        for name, t in itertools.chain(m.model.named_parameters(), m.model.named_buffers()):
            other = owner.setdefault(id(t), m.name)
            if other != m.name:
                raise ConfigError(f"task {m.name!r} shares {name!r} with task {other!r}: tasks train separate models; "
                                  "give each task its own module (copy.deepcopy, or a factory)")


def _check_draws(models: Sequence[ShardedModel], workers: int, recompute: bool) -> None:
    """Random ops (dropout) draw from the one CPU generator every task shares.

    With ``recompute`` on several workers this is refused: a recomputing shard rewinds the
    generator to replay its masks while other workers draw, so both sides could get wrong masks.
    Otherwise masks are drawn in the order units run, which is not training alone's order when
    several tasks share the workers: logged.

    Raises:
        ConfigError: naming the task, the shard and the ops.
    """
    drawing = [(m, s, [n.name for n in st.gm.graph.nodes if is_random(n)]) for m in models
               for s, st in enumerate(m.pipe.stages)]
    drawing = [(m, s, ops) for m, s, ops in drawing if ops]
    if not drawing:
        return
    m, s, ops = drawing[0]
    if recompute and workers > 1:
        raise ConfigError(
            f"task {m.name!r}: shard {s} draws random numbers ({', '.join(ops[:3])}) while shards recompute on "
            f"{workers} workers: a recomputation rewinds the one CPU generator to replay its masks while other workers "
            "draw, so masks would differ between a forward and its recomputation; use recompute=False, devices=1, "
            "or dropout off (p=0 or model.eval())")
    if len(models) > 1:
        log.warning("task %r draws random numbers (%s) from the one CPU generator that all tasks share, in the order "
                    "units run: its masks differ from training it alone (as another seed's would)", m.name,
                    ", ".join(ops[:3]))


def _cpu_devices(devices: int | Sequence[str]) -> list[torch.device]:
    if isinstance(devices, int):
        if devices < 1:
            raise ConfigError(f"devices={devices}; give at least 1 worker")
        return [torch.device("cpu")] * devices
    found = [torch.device(d) for d in devices]
    if not found or any(d.type != "cpu" for d in found):
        raise ConfigError(f"devices={list(map(str, devices))}: train_many runs on CPU workers for now "
                          "(devices=N or ['cpu'] * N); CUDA spilling is not built yet")
    return found


#: Relative difference above which an optimizer is taken to couple its parameters (rounding of
#: for-loop and foreach implementations stays under 1e-6).
COUPLING_RTOL = 1e-5


def _refuse_coupled_optimizer(task: Task, plan: Plan) -> None:
    """Raise when ``task`` is cut into several shards and its optimizer couples parameters
    (:func:`~fxsplit.runtime.shards.optimizer_coupling`): each shard has its own optimizer, so
    the model would not train as it does alone.

    Raises:
        ConfigError: naming the task, the optimizer and the difference measured, with the fix.
    """
    if plan.num_stages < 2:
        return
    coupling = optimizer_coupling(task.optimizer)
    if coupling is not None and coupling > COUPLING_RTOL:
        raise ConfigError(
            f"task {task.name!r}: its optimizer steps a parameter differently when other parameters are stepped "
            f"with it (relative difference {coupling:.2g} on two probe parameters): it couples them, e.g. through a "
            f"global gradient norm. train_many cuts this model into {plan.num_stages} shards, each with its own "
            "optimizer, so it would not train as it does alone. Use a per-parameter optimizer (SGD, Adam, AdamW, "
            "...), give the devices memory for the whole model (one shard), or train it with fxsplit.compile")


def _shard_task(task: Task, reference: DeviceSpec, cost_model: str, options: CompileOptions,
                recompute: bool) -> ShardedModel:
    """Capture, cost and cut one task's model; its pipeline of shards, optimizers and units."""
    steps = task.num_steps()
    model = task.model if isinstance(task.model, nn.Module) else task.model()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"task {task.name!r}: model is {type(model).__name__}; give an nn.Module or a factory of one")
    batches = task.batches()
    try:
        first = next(batches)
    except StopIteration:
        raise ConfigError(f"task {task.name!r}: its data is empty") from None
    inputs, _ = _batch(task, first)
    ins = front_end(model, inputs, {}, reference=reference, cost_model=cost_model, options=options, microbatches=1)
    captured = ins.captured
    problem = Problem(ins.condensed.graph, (reference,), optimizer_state_factor=optimizer_state_factor(task.optimizer),
                      training=True)
    try:
        plan = fewest_shards(problem, time_limit_s=options.time_limit_s)
    except InfeasibleError as exc:
        raise InfeasibleError(f"task {task.name!r}: no cut into shards fits a device's "
                              f"{reference.memory_bytes / 2**20:.3g} MiB, not even one block per shard (a shard "
                              f"holds its parameters, gradients, optimizer state and one mini-batch's activations); "
                              f"give more memory per device. The solver said: {exc}") from exc
    _refuse_coupled_optimizer(task, plan)
    last = plan.num_stages - 1
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, recompute=recompute and s < last)
                                                  for s, st in enumerate(plan.stages)))
    specs = [reference.with_(torch_device="cpu")] * plan.num_stages
    pipe: Pipeline = assemble(model, captured, plan, specs, "gpipe", 1, options)
    loss_s = _loss_s(captured, task.loss_fn, _batch(task, first)[1])
    sharded = ShardedModel(task.name, pipe, task.optimizer, task.loss_fn,
                           (_batch(task, b) for b in itertools.chain([first], batches)), ShardTask(task.name, (0.0,), (0.0,)),
                           tuple(st.memory_bytes for st in plan.stages), model=model)
    # the plan was costed without recomputation: its bwd_s is the backward alone (task_units adds
    # the forward); the last shard's unit also runs the loss, forward and backward
    fwd_s = [st.fwd_s for st in plan.stages]
    fwd_s[last] += loss_s
    sharded.task = ShardTask(task.name, tuple(fwd_s), tuple(st.bwd_s for st in plan.stages),
                             steps, shard_step_s=tuple(optimizer_step_s(task.optimizer, p) for p in sharded.owned),
                             recompute=recompute)
    return sharded


def _loss_s(captured: Any, loss_fn: Callable[[Any, Any], Any], target: Any) -> float:
    """Seconds of the loss's forward and backward (:func:`fxsplit.frontend.loss_times_s`, as
    ``compile`` times it) on outputs shaped as the model's (zeros, from the capture's output
    values: the model is not run); 0 when the loss cannot take them (the runtime measures it)."""
    out_node = next(n for n in captured.gm.graph.nodes if n.op == "output")
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in out_node.args[0]]
    outputs = [torch.zeros(tuple(int(d) for d in v.shape), dtype=v.dtype) if isinstance(v, torch.Tensor) else v
               for v in vals]
    try:
        return sum(loss_times_s(loss_fn, captured, outputs, target))
    except ConfigError as exc:  # an output the loss cannot take as zeros
        log.info("cannot time the loss on stand-in outputs: %s", exc)
        return 0.0


def _batch(task: Task, batch: Any) -> tuple[tuple[Any, ...], Any]:
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        raise ConfigError(f"task {task.name!r}: each batch must be (inputs, target); got {type(batch).__name__}")
    inputs, target = batch
    return (tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)), target
