"""Run shard units of many models on a pool of devices with memory budgets (Hydra's executor).

A :class:`ShardedModel` is one model split into shards (a :class:`~fxsplit.runtime.Pipeline`
with one micro-batch whose stages are the shards) with one optimizer per shard over the
parameters it owns. It runs the units of :mod:`fxsplit.schedule.shards`: ``F`` runs a shard's
forward, keeping its autograd graph (its activations, in host memory on the CPU) or, when the
plan marks the shard ``recompute``, under activation recomputation
(:class:`~fxsplit.runtime.recompute.RecomputedForward`: only what the shard received); ``L``
the last shard's forward, loss and backward; ``B`` a shard's backward; each backward is followed
by the shard's optimizer step. A tied parameter belongs to the first shard that reads it, whose
backward runs last in a step, so its gradient is complete when it steps.

:func:`run_shards` runs the units with one worker thread per device; a
:class:`~fxsplit.schedule.shards.ShardDispatcher` chooses what a free device runs next and is
told each unit's measured time. :class:`DevicePool` holds each device's memory budget: a shard
runs on a device only when its predicted peak memory fits the budget, else the run stops with
an :class:`ExecutionError` (so a budget is a limit, not a label). On the CPU the shard's state
stays where it is (host and device are one memory); the pool counts the bytes a move between
host and device would carry.

References:
    Nagrecha and Kumar, "Hydra: A System for Large Multi-Model Deep Learning", 2021.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fxsplit.errors import ConfigError, ExecutionError
from fxsplit.passes.costs import value_bytes
from fxsplit.runtime.local import Pipeline
from fxsplit.schedule import Action
from fxsplit.schedule.shards import ShardDispatcher, ShardEvent, ShardRun, ShardTask, ShardUnit

__all__ = ["DevicePool", "ShardedModel", "optimizer_coupling", "optimizer_state_factor", "optimizer_step_s",
           "owned_parameters", "run_shards"]

log = logging.getLogger(__name__)

Batch = tuple[tuple[Any, ...], Any]  # (model inputs, target)


def owned_parameters(pipe: Pipeline) -> list[list[nn.Parameter]]:
    """``[num_stages]`` the parameters each stage owns: every distinct parameter once, in the
    first stage that reads it (a tied weight read by stages 0 and 3 belongs to stage 0, whose
    backward ends the step)."""
    seen: set[int] = set()
    owned: list[list[nn.Parameter]] = []
    for stage in pipe.stages:
        mine = [p for p in stage.gm.parameters() if id(p) not in seen]
        seen.update(id(p) for p in mine)
        owned.append(mine)
    return owned


@dataclass
class ShardedModel:
    """One model split into shards, trained one unit at a time.

    Args:
        name: Shown in reports.
        pipe: The shards as a pipeline of one micro-batch (stages the plan marks ``recompute``
            keep only their inputs between forward and backward).
        optimizer: ``optimizer(params) -> torch.optim.Optimizer``, called once per shard with the
            parameters the shard owns (:func:`owned_parameters`).
        loss_fn: ``loss_fn(output, target) -> scalar``.
        batches: Yields ``(inputs, target)`` per step; ``inputs`` a tuple of the model's
            positional inputs.
        task: The units and their estimated times.
        memory_bytes: ``[num_shards]`` predicted peak memory of each shard's units, bytes.
        model: The original module (its parameters are the shards' parameters).
    """

    name: str
    pipe: Pipeline
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    batches: Iterator[Batch]
    task: ShardTask
    memory_bytes: tuple[int, ...]
    model: nn.Module
    losses: list[float] = field(default_factory=list)
    owned: list[list[nn.Parameter]] = field(init=False)
    optimizers: list[torch.optim.Optimizer | None] = field(init=False)
    steps_done: int = field(init=False, default=0)
    _step: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.owned = owned_parameters(self.pipe)
        self.optimizers = [self.optimizer(params) if params else None for params in self.owned]

    @property
    def num_shards(self) -> int:
        return self.pipe.num_stages

    def state_bytes(self, shard: int) -> int:
        """Bytes of the shard's parameters, gradients, optimizer state and buffers now: what a
        move between host and device carries."""
        params = self.owned[shard]
        opt = self.optimizers[shard]
        states = opt.state.values() if opt is not None else []
        return value_bytes([list(params), [p.grad for p in params], [v for st in states for v in st.values()],
                            list(self.pipe.stages[shard].gm.buffers())])

    def run(self, unit: ShardUnit) -> None:
        """Run one unit (in the order of ``task.units``).

        Raises:
            ConfigError: when the data runs out before the last step.
            ExecutionError: when a shard fails (from the pipeline, naming the stage).
        """
        if self._step is None:
            self._begin(unit.step)
        s = unit.shard
        if unit.kind in ("F", "L"):
            self.pipe.run_action(Action(s, "F", 0), self._step)
        if unit.kind in ("L", "B"):
            self.pipe.run_action(Action(s, "B", 0), self._step)
            opt = self.optimizers[s]
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
        if unit.kind == "L":
            self.losses.append(float(self._step.total_loss()))
        if s == 0 and unit.kind != "F":
            self._step = None  # the step's last unit
            self.steps_done += 1

    def _begin(self, step: int) -> None:
        if step == 0:  # as the usual loop's zero_grad: gradients left from before do not count
            for p in itertools.chain.from_iterable(self.owned):
                p.grad = None
        try:
            inputs, target = next(self.batches)
        except StopIteration:
            raise ConfigError(f"task {self.name!r}: its data ran out at step {step} of {self.task.steps}; "
                              "give a data iterable with at least that many batches (or fewer steps)") from None
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        self._step = self.pipe.new_step(inputs, {}, target=target, loss_fn=self.loss_fn)


def optimizer_state_factor(optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> float:
    """Bytes of optimizer state per parameter byte, measured: one step on a probe parameter
    (SGD 0, SGD with momentum 1, Adam/AdamW 2). Falls back to 2.0 (Adam) when the factory
    cannot build an optimizer for a lone parameter."""
    probe = nn.Parameter(torch.zeros(4096))
    probe.grad = torch.full_like(probe, 1e-3)
    try:
        opt = optimizer([probe])
        opt.step()
    except Exception as exc:  # a factory written for the model's own parameters (groups by name)
        log.warning("cannot measure the optimizer's state on a probe parameter (%s: %s); assuming Adam's "
                    "2 bytes per parameter byte", type(exc).__name__, exc)
        return 2.0
    size = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.numel() == probe.numel())
    return size / (probe.numel() * probe.element_size())


def optimizer_coupling(optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], steps: int = 3
                       ) -> float | None:
    """How much stepping two probe parameters with one optimizer differs from stepping each with
    its own: the largest relative difference after ``steps`` steps on the same gradients (0 for
    per-parameter optimizers such as SGD, Adam and AdamW, up to rounding; large for one that
    couples parameters, e.g. a global gradient norm inside its step). The probes differ in scale
    by 100x so that a coupling shows. ``None`` when the factory cannot build an optimizer for lone
    probe parameters."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(64, generator=gen), 100.0 * torch.randn(32, generator=gen)]
    grads = [[torch.randn(t.shape, generator=gen) * (1.0 if i == 0 else 100.0) for i, t in enumerate(start)]
             for _ in range(steps)]
    together = [nn.Parameter(t.clone()) for t in start]
    alone = [nn.Parameter(t.clone()) for t in start]
    try:
        opts = [optimizer(together), optimizer([alone[0]]), optimizer([alone[1]])]
        for step in grads:
            for params in (together, alone):
                for p, g in zip(params, step, strict=True):
                    p.grad = g.clone()
            for opt in opts:
                opt.step()
    except Exception as exc:  # e.g. a factory that groups the model's own parameters by name
        log.warning("cannot probe whether the optimizer couples parameters (%s: %s)", type(exc).__name__, exc)
        return None
    with torch.no_grad():
        return max(float(((a - b).abs() / (b.abs() + 1e-12)).max()) for a, b in zip(together, alone, strict=True))


def optimizer_step_s(optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                     params: Sequence[nn.Parameter], repeats: int = 3) -> float:
    """Seconds of one optimizer step over ``params``, measured on copies (the median of
    ``repeats`` steps after one that creates the state); the parameters are left untouched."""
    if not params:
        return 0.0
    copies = [nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in params]
    for c in copies:
        c.grad = torch.zeros_like(c)
    try:
        opt = optimizer(copies)
        opt.step()
    except Exception as exc:  # a factory written for the model's own parameters
        log.warning("cannot time the optimizer step on copies (%s: %s); counting it as 0 s", type(exc).__name__, exc)
        return 0.0
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


class DevicePool:
    """Devices with memory budgets and the shards they hold.

    Args:
        devices: ``[num_devices]`` torch devices (CPU here).
        budget_bytes: ``[num_devices]`` memory of each device, bytes (None: unlimited).

    Each device holds the shard it ran last until another shard needs it; a shard is on at most
    one device. ``moved_bytes`` counts what moves between host and device would carry.
    """

    def __init__(self, devices: Sequence[torch.device], budget_bytes: Sequence[int | None]) -> None:
        if len(devices) != len(budget_bytes):
            raise ConfigError(f"{len(devices)} devices but {len(budget_bytes)} memory budgets")
        self.devices = list(devices)
        self.budget_bytes = list(budget_bytes)
        self.held: list[tuple[int, int] | None] = [None] * len(devices)
        self.moved_bytes = 0
        self._lock = threading.Lock()

    def bring(self, device: int, key: tuple[int, int], models: Sequence[ShardedModel]) -> int:
        """Make shard ``key = (task, shard)`` resident on ``device``; return the bytes moved: the
        state of the shard the device held, written back to host, and of the one brought in
        (also from another device, through host).

        Raises:
            ExecutionError: when the shard's peak memory (predicted, or its state now if larger)
                exceeds the device's budget.
        """
        model = models[key[0]]
        state = model.state_bytes(key[1])
        need = max(model.memory_bytes[key[1]], state)
        budget = self.budget_bytes[device]
        if budget is not None and need > budget:
            raise ExecutionError(
                f"shard {key[1]} of task {model.name!r} needs {need / 2**20:.2f} MiB at its peak, more than "
                f"device {device} ({self.devices[device]}) has ({budget / 2**20:.2f} MiB); split it into more "
                "shards (a smaller memory_per_device_bytes when planning) or give the device more memory",
                device=str(self.devices[device]))
        with self._lock:
            if self.held[device] == key:
                return 0
            moved = state
            evicted = self.held[device]
            if evicted is not None:  # written back to host
                moved += models[evicted[0]].state_bytes(evicted[1])
            for other, held in enumerate(self.held):
                if held == key:  # it was left on another device: back to host first
                    self.held[other] = None
                    moved += state
            self.held[device] = key
            self.moved_bytes += moved
            return moved


@dataclass(frozen=True)
class ShardRunResult:
    """What :func:`run_shards` measured: the timeline (seconds from the start) and bytes moved."""

    run: ShardRun
    moved_bytes: int


def run_shards(models: Sequence[ShardedModel], pool: DevicePool, policy: str = "lrtf",
               progress: Callable[[int, int, int], None] | None = None) -> ShardRunResult:
    """Train every model to its last step, units on the pool's devices as ``policy`` chooses.

    Args:
        models: The sharded models (their ``task`` gives the units).
        pool: The devices and their budgets.
        policy: A :data:`~fxsplit.schedule.shards.POLICIES` name.
        progress: ``progress(task, units_done, units_total)`` after each unit (in the caller's
            thread; the CLI draws a bar per task with it).

    Returns:
        The measured timeline and the bytes moved.

    Raises:
        ConfigError: for an unknown policy, or data that runs out.
        ExecutionError: when a unit fails or a shard exceeds its device's budget; the other
            workers finish their unit and nothing more starts.
    """
    dispatch = ShardDispatcher([m.task for m in models], policy)
    workers = [cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fxsplit-shard{d}")
               for d in range(len(pool.devices))]
    t0 = time.perf_counter()
    events: list[ShardEvent] = []
    last_task: list[int | None] = [None] * len(workers)
    running: dict[cf.Future[tuple[float, float, float]], tuple[int, int, ShardUnit]] = {}

    def work(d: int, j: int, unit: ShardUnit) -> tuple[float, float, float]:
        start = time.perf_counter()
        pool.bring(d, (j, unit.shard), models)
        loaded = time.perf_counter()
        models[j].run(unit)
        return start - t0, loaded - start, time.perf_counter() - t0

    try:
        while not dispatch.done:
            busy = {d for d, _, _ in running.values()}
            for d in (d for d in range(len(workers)) if d not in busy):
                j = dispatch.pick(prefer=last_task[d])
                if j is None:
                    break
                unit = dispatch.start(j)
                running[workers[d].submit(work, d, j, unit)] = (d, j, unit)
            finished, _ = cf.wait(list(running), return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                d, j, unit = running.pop(fut)
                if fut.exception() is not None:
                    cf.wait(list(running))  # the other workers end their unit; nothing more starts
                    exc = fut.exception()
                    error = _failed(models, j, unit, d, exc)
                    raise error from (None if error is exc else exc)
                start_s, load_s, end_s = fut.result()
                dispatch.finish(j, end_s - start_s - load_s)
                events.append(ShardEvent(d, j, unit, start_s, end_s, load_s))
                last_task[d] = j
                if progress is not None:
                    progress(j, dispatch.next_unit[j], len(models[j].task.units))
    finally:
        for w in workers:
            w.shutdown(wait=True, cancel_futures=True)
    return ShardRunResult(ShardRun(tuple(events), len(workers)), pool.moved_bytes)


def _failed(models: Sequence[ShardedModel], j: int, unit: ShardUnit, device: int, exc: BaseException | None) -> BaseException:
    """The error of a failed unit, saying where every model stopped (a model stopped mid-step has
    some shards stepped and others not: it matches no number of training steps)."""
    if isinstance(exc, ConfigError) or exc is None:
        return exc or ExecutionError("a unit failed without an exception")
    where = "; ".join(f"{m.name!r} after {m.steps_done} whole step(s)" + (" and part of the next" if m._step else "")
                      for m in models)
    return ExecutionError(f"unit {unit} (step {unit.step}) of task {models[j].name!r} failed on worker {device}: "
                          f"{type(exc).__name__}: {exc}. The models stopped where they were: {where}",
                          device=f"worker {device}")
