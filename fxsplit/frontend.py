"""The front end every entry point shares: capture, then the passes (shapes, costs, condensation).

:func:`front_end` is the one place that assembles them: :func:`fxsplit.inspect`, :func:`fxsplit.compile`,
``fxsplit.distributed`` (on the meta model) and :func:`fxsplit.train_many` all call it, and all get
an :class:`Inspection` back (ARCHITECTURE.md §2: capture -> passes -> solvers).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxsplit.errors import ConfigError, InternalError
from fxsplit.ir import DeviceSpec
from fxsplit.options import CompileOptions, autocast_dtype, precision
from fxsplit.passes.batch_layout import check_batch_dim
from fxsplit.passes.capture import Captured, capture
from fxsplit.passes.condense import Condensed
from fxsplit.passes.frontend import front_end_passes
from fxsplit.passes.manager import PassManager, PassRecord
from fxsplit.passes.measure import grad_accumulate_bytes_per_s
from fxsplit.passes.profile import device_name, fit_affine, open_cache, profile_sizes
from fxsplit.runtime.microbatch import batch_size_of, split_microbatches, split_target
from fxsplit.runtime.trace import action_end_s
from fxsplit.schedule.explore import default_microbatches

__all__ = ["Inspection", "capture_with", "front_end", "load_per_core", "loss_cost_s", "loss_times_s", "profile_options",
           "save_unless_busy", "with_batch_dim"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Inspection:
    """Everything the front end made for one model.

    Attributes:
        captured: The flat graph and its specs (``captured.gm`` is annotated).
        condensed: Blocks, edges and downsets.
        device: The reference device of the cost annotation.
        records: Timing of every pass.
        name: The model's name.
        flat_inputs: The example inputs flattened in the graph's placeholder order.
    """

    captured: Captured
    condensed: Condensed
    device: DeviceSpec
    records: tuple[PassRecord, ...]
    name: str = "model"
    flat_inputs: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    def node_rows(self) -> list[dict[str, Any]]:
        """One dict per graph node: name, op, target, shape, block and costs."""
        rows = []
        for node in self.captured.gm.graph.nodes:
            if node.op == "output":
                continue
            val, cost = node.meta.get("val"), node.meta.get("fxsplit.cost")
            rows.append({
                "node": node.name, "op": node.op, "target": _target_name(node.target),
                "shape": tuple(val.shape) if hasattr(val, "shape") else None,
                "block": node.meta.get("fxsplit.block"),
                "flops": cost.flops if cost else 0.0, "fwd_s": cost.fwd_s if cost else 0.0,
                "bwd_s": cost.bwd_s if cost else 0.0, "param_bytes": cost.param_bytes if cost else 0,
                "output_bytes": cost.output_bytes if cost else 0,
            })
        return rows

    def __repr__(self) -> str:
        g = self.condensed.graph
        return (
            f"Inspection({self.name!r}: {len(self.captured.gm.graph.nodes)} nodes via {self.captured.method}, "
            f"{g.total_param_bytes / 2**20:.1f} MiB params, {len(g)} blocks, "
            f"{self.condensed.num_downsets}{'+' if self.condensed.truncated else ''} downsets, "
            f"fwd+bwd {g.total_time_s * 1e3:.3f} ms on {self.device.name})"
        )


def _target_name(target: Any) -> str:
    return getattr(target, "__name__", None) or str(target)


def front_end(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    reference: DeviceSpec,
    cost_model: str,
    options: CompileOptions,
    microbatches: int | str = "auto",
    captured: Captured | None = None,
    name: str | None = None,
    force_shapes: bool = True,
    measure_device: str | None = None,
    verify: bool = False,
    dump_dir: str | Path | None = None,
) -> Inspection:
    """Capture ``model`` (unless ``captured`` is given) as ``options`` say, annotate its nodes at
    the example batch on ``reference``, and condense them into blocks.

    With the measured cost model and a fixed micro-batch count, nodes are timed on one
    micro-batch and scaled to the batch, so per-micro-batch costs are measured ones. The profiled
    cost model times every node at the micro-batch sizes the schedule search considers (the one
    that runs, when ``microbatches`` is fixed) and keeps the timings in the profile cache, unless
    the machine was busy (load over 1 per core) while it timed.

    Args:
        model, args, kwargs: The module and its example inputs (a batch).
        reference: The device costs are annotated for (and timed on, for measured costs).
        cost_model: ``"analytic"``, ``"measured"`` or ``"profiled"``.
        options: ``capture_method``, ``dynamic_batch``, ``batch_dim``, ``max_downsets``,
            ``autocast`` (costs in the dtypes that run), ``profile_cache_dir``, ``progress``.
        microbatches: The count that will run, or ``"auto"``.
        captured: A capture of ``model`` already made (it is annotated in place).
        name: The condensed graph's name (default: the model's class name).
        force_shapes: Propagate shapes and dtypes again where capture left them (as they run: a
            symbolic batch, autocast's dtypes); :func:`fxsplit.inspect` keeps capture's.
        measure_device: Where measured costs are timed (default ``reference.torch_device``; a
            preset device with no torch device here is timed on ``"cpu"`` by inspect).
        verify, dump_dir: :class:`~fxsplit.passes.manager.PassManager`'s checks and dumps.

    Returns:
        The :class:`Inspection`.

    Raises:
        CaptureError: when the model cannot be captured.
        ConfigError: for a bad option or input.
    """
    kwargs = dict(kwargs or {})
    name = name or type(model).__name__
    captured = captured or capture_with(model, args, kwargs, options)
    flat = captured.flatten_inputs(tuple(args), kwargs)
    timed, scale = tuple(flat), 1.0
    if cost_model == "measured" and isinstance(microbatches, int) and microbatches > 1:
        timed, scale = tuple(split_microbatches(flat, microbatches)[0][0]), float(microbatches)
    batched = None if captured.batched_inputs is None else tuple(captured.batched_inputs)
    profile = profile_options(flat, batched, device_name(reference), microbatches, options,
                              measure_device or reference.torch_device) if cost_model == "profiled" else None
    load = load_per_core()
    pm = PassManager(front_end_passes(
        flat, reference, cost_model=cost_model, max_downsets=options.max_downsets, name=name,
        force_shapes=force_shapes, timed_inputs=timed, measure_device=measure_device or reference.torch_device,
        measure_scale=scale, profile=profile,
    ), verify=verify, dump_dir=dump_dir)
    # dtypes, bytes, timings as they run: timed costs under autocast where they are timed; analytic
    # ones where the example tensors are (a preset's "cuda" is not here; meta runs as a CPU)
    where = measure_device or reference.torch_device if cost_model != "analytic" else _tensor_device_type(flat)
    with precision(where, autocast_dtype(options.autocast)):
        pm.run(captured.gm)
    cache = profile["profile_cache"] if profile is not None else None
    if cache is not None:
        save_unless_busy(cache, load, f"the profile of {name}")
    condensed = pm.artifacts.get("condense_antichains")
    if not isinstance(condensed, Condensed):
        raise InternalError(f"the front end's last pass made {type(condensed).__name__}, not Condensed (a bug in fxsplit)")
    condensed = _with_grad_accumulation(condensed, reference if cost_model == "analytic" else where)
    if options.loss_fn is not None:
        if cost_model == "analytic":
            log.info("%s: the loss is not costed with the analytic cost model (it is timed, on %s, by the profiled "
                     "and measured ones)", name, where)
        else:
            with precision(where, autocast_dtype(options.autocast)):
                condensed = _with_loss_cost(condensed, captured, flat, options, microbatches)
    batch, sizes = _microbatch_sizes(flat, batched, microbatches)
    if sizes and cost_model == "analytic" and options.symbolic_costs:
        with precision(where, autocast_dtype(options.autocast)):
            condensed = _with_microbatch_graphs(condensed, captured, reference, batch, sizes, name)
    return Inspection(captured, condensed, reference, tuple(pm.records), name, tuple(flat))


#: Micro-batch counts whose costs the formulas give beyond the batch's divisors (the planner's
#: first split uses ``min(batch, 2 x devices)`` micro-batches, which need not divide the batch).
_FORMULA_COUNTS = 64


def _microbatch_sizes(flat: Sequence[Any], batched: Sequence[bool] | None,
                      microbatches: int | str) -> tuple[int, list[float]]:
    """The example batch, and the samples per micro-batch for each count ``m`` the planner may
    cost: the largest micro-batch ``ceil(batch / m)`` (the schedule search's) and the mean
    ``batch / m`` (the solvers'), the whole batch left out."""
    batch = _example_batch(flat, batched)
    counts = ({microbatches} if isinstance(microbatches, int)
              else set(default_microbatches(batch)) | set(range(1, min(batch, _FORMULA_COUNTS) + 1)))
    return batch, sorted(({float(-(-batch // m)) for m in counts} | {batch / m for m in counts}) - {float(batch)})


def _example_batch(flat: Sequence[Any], batched: Sequence[bool] | None) -> int:
    """Samples in the example batch: the batch dimension of the batched flat inputs (all of
    them when ``batched`` is None)."""
    return batch_size_of([x for x, b in zip(flat, batched or [True] * len(flat), strict=True) if b] or flat)


def _with_microbatch_graphs(condensed: Condensed, captured: Captured, reference: DeviceSpec, batch: int,
                            sizes: list[float], name: str) -> Condensed:
    """``condensed`` whose graph carries its costs at each of ``sizes`` samples (of the example
    ``batch``), from the analytic cost formulas (:attr:`CondensedGraph.microbatch_graphs`);
    unchanged, with a note in the log, where the graph has no formulas of the batch."""
    from fxsplit.passes.symbolic import block_formulas, graphs_at, symbolic_node_costs

    graph = condensed.graph
    if captured.method == "export" and captured.batched_inputs is None:  # exported at a fixed batch
        log.info("%s: micro-batch costs scale linearly (captured with a fixed batch: no cost formulas)", name)
        return condensed
    try:
        nodes = symbolic_node_costs(captured.gm, None, captured.batched_inputs, reference)
    except ConfigError as exc:  # a batch the capture fixed: no formulas to evaluate
        log.info("%s: micro-batch costs scale linearly (no cost formulas: %s)", name, exc)
        return condensed
    except Exception as exc:  # noqa: BLE001 - an op the symbolic run cannot take: the linear model stays
        log.warning("%s: micro-batch costs scale linearly; the cost formulas failed (%s: %s)", name,
                    type(exc).__name__, exc)
        return condensed
    formulas = block_formulas(captured.gm, graph, nodes, simplify=False)
    graphs = graphs_at(graph, formulas, sizes)
    skipped = [n for n, g in zip(sizes, graphs, strict=True) if g is None]
    if skipped:
        log.info("%s: no cost formulas at %s samples per micro-batch (the model cannot take so few); those scale "
                 "linearly", name, ", ".join(f"{n:g}" for n in skipped))
    table = tuple((n / batch, g) for n, g in zip(sizes, graphs, strict=True) if g is not None)
    return dataclasses.replace(condensed, graph=dataclasses.replace(graph, microbatch_graphs=table))


def _with_grad_accumulation(condensed: Condensed, timed_on: DeviceSpec | str) -> Condensed:
    """``condensed`` whose blocks cost adding a micro-batch's parameter gradients into the
    step's (:attr:`~fxsplit.ir.Block.grad_accumulate_s`, own and tied copies): at the
    reference's memory bandwidth (an add reads two and writes one) for analytic costs, at the
    rate measured on the device that timed the nodes otherwise
    (:func:`~fxsplit.passes.measure.grad_accumulate_bytes_per_s`)."""
    if isinstance(timed_on, DeviceSpec):
        bytes_per_s = timed_on.memory_bandwidth_bytes_per_s / 3
    else:
        try:
            bytes_per_s = grad_accumulate_bytes_per_s(timed_on)
        except ConfigError:  # a label with no torch device here: not modelled
            return condensed
    if not (bytes_per_s > 0 and math.isfinite(bytes_per_s)):
        return condensed
    return dataclasses.replace(condensed, graph=condensed.graph.with_grad_accumulation(bytes_per_s))


def _with_loss_cost(condensed: Condensed, captured: Captured, flat: Sequence[Any], options: CompileOptions,
                    microbatches: int | str) -> Condensed:
    """``condensed`` with ``options.loss_fn`` charged to the block that makes the outputs
    (:meth:`~fxsplit.ir.CondensedGraph.with_loss`), timed by :func:`loss_cost_s`."""
    costs = loss_cost_s(captured, flat, options, microbatches)
    return dataclasses.replace(condensed, graph=condensed.graph.with_loss(*costs))


def loss_cost_s(captured: Captured, flat: Sequence[Any], options: CompileOptions, microbatches: int | str,
                gm: torch.fx.GraphModule | None = None) -> tuple[float, float, float, float]:
    """``(fwd_s, bwd_s, fwd_fixed_s, bwd_fixed_s)`` of ``options.loss_fn`` on
    ``options.loss_target``, as :meth:`~fxsplit.ir.CondensedGraph.with_loss` takes them: its
    forward and backward timed on the model's own outputs (``gm``, default ``captured.gm``, run
    once on the flat inputs ``flat``, its buffers put back) at the example batch and at one
    micro-batch (``microbatches`` of them, or 4), ``t = t0 + t1 x samples`` fitted through the
    two as the profiled cost model fits nodes (:func:`~fxsplit.passes.profile.fit_affine`).

    Raises:
        ConfigError: when the loss fails on the model's outputs or does not give a scalar.
    """
    gm = captured.gm if gm is None else gm
    buffers = [(b, b.clone()) for b in gm.buffers()]
    try:
        with torch.no_grad():  # the model's outputs at the example batch; its buffers (batch statistics) put back
            outputs = [o.detach() if isinstance(o, torch.Tensor) else o for o in gm(*flat)]
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    batch = _example_batch(flat, captured.batched_inputs)
    m = microbatches if isinstance(microbatches, int) and microbatches > 1 else min(batch, 4)
    points = [(batch, outputs, options.loss_target)]
    if m > 1:
        target_dim = captured.layout.target_dim if captured.layout is not None else 0
        outs, sizes = split_microbatches(outputs, m, batch, captured.batched_outputs)
        points.append((sizes[0], outs[0], split_target(options.loss_target, m, batch, target_dim)[0]))
    sizes = [n for n, _, _ in points]
    fwd, bwd = zip(*(loss_times_s(options.loss_fn, captured, outs, target) for _, outs, target in points), strict=True)
    (f0, f1), (b0, b1) = fit_affine(sizes, fwd), fit_affine(sizes, bwd)  # as the profile fits each node
    fwd_s, bwd_s = f0 + f1 * batch, b0 + b1 * batch
    log.info("the loss costs %.3f ms forward, %.3f ms backward at %d samples (%.3f / %.3f ms fixed per micro-batch)",
             fwd_s * 1e3, bwd_s * 1e3, batch, f0 * 1e3, b0 * 1e3)
    return fwd_s, bwd_s, f0, b0


def loss_times_s(loss_fn: Any, captured: Captured, outputs: Sequence[Any], target: Any,
                  repeats: int = 5) -> tuple[float, float]:
    """Median seconds of ``loss_fn``'s forward and of its backward on ``outputs`` (the model's
    flat outputs, made leaves that need a gradient where floating), after one warm-up."""
    fwd, bwd = [], []
    for _ in range(repeats + 1):
        leaves = [o.detach().requires_grad_(o.is_floating_point()) if isinstance(o, torch.Tensor) else o
                  for o in outputs]
        try:
            start = time.perf_counter()
            loss = loss_fn(captured.unflatten_outputs(leaves), target)
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                raise TypeError(f"it returned {type(loss).__name__}"
                                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}, not a scalar tensor")
            mid = action_end_s(loss.device)
            if loss.requires_grad:
                loss.backward()
            end = action_end_s(loss.device)
        except Exception as exc:
            raise ConfigError(f"compile cannot cost loss_fn={getattr(loss_fn, '__name__', loss_fn)!r}: on the model's "
                              f"outputs ({', '.join(_shape(o) for o in outputs)}) and the target given, it failed: "
                              f"{type(exc).__name__}: {exc}. Pass the loss and target train_step will get, or "
                              f"loss_fn=None to plan without the loss") from exc
        fwd.append(mid - start)
        bwd.append(end - mid)
    return statistics.median(fwd[1:]), statistics.median(bwd[1:])


def _shape(value: Any) -> str:
    return f"{list(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__


def _tensor_device_type(flat: Sequence[Any]) -> str:
    """The device type of the first tensor in ``flat`` (``"cpu"`` for meta or none)."""
    kind = next((x.device.type for x in flat if isinstance(x, torch.Tensor)), "cpu")
    return "cpu" if kind == "meta" else kind


def with_batch_dim(options: CompileOptions, batch_dim: int | None) -> CompileOptions:
    """``options`` with ``batch_dim`` checked and set (None keeps ``options.batch_dim``).

    Raises:
        ConfigError: for a ``batch_dim`` that is not an int >= 0.
    """
    value = check_batch_dim(options.batch_dim if batch_dim is None else batch_dim)
    return options if value == options.batch_dim else dataclasses.replace(options, batch_dim=value)


def capture_with(model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any] | None,
                 options: CompileOptions) -> Captured:
    """:func:`~fxsplit.passes.capture.capture` as ``options`` ask (``capture_method``,
    ``dynamic_batch``, ``batch_dim``)."""
    return capture(model, tuple(args), dict(kwargs or {}), method=options.capture_method,
                   dynamic_batch=options.dynamic_batch, batch_dim=options.batch_dim)


def save_unless_busy(cache: Any, load: float, what: str) -> bool:
    """Save the profile ``cache`` (a :class:`~fxsplit.passes.profile.ProfileCache`) unless it
    timed something while the machine was busy (``load``, per core, read before timing, over 1):
    timings taken on an oversubscribed machine would be reused by every later compile. Logs the
    cache's hits and misses; returns whether it saved."""
    busy = bool(cache.misses) and load > 1.0
    if busy:
        log.warning("not caching %s: the machine was busy (load %.1f per core); timings may be high, and the "
                    "next compile times again", what, load)
    else:
        cache.save()
    log.info("profile cache %s: %d hits, %d misses", cache.path, cache.hits, cache.misses)
    return not busy


def load_per_core() -> float:
    """The 1-minute load average per core (0 where the platform has none)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, AttributeError):
        return 0.0


def profile_options(flat: Sequence[Any], batched: Sequence[bool] | None, device: str, microbatches: int | str,
                    options: CompileOptions, torch_device: str | None = None) -> dict[str, Any]:
    """Options of the profiled cost model (:class:`~fxsplit.passes.costs.AnnotateCosts`):
    ``batched`` (which of ``flat``, the flat inputs, carry the batch; None: all), the micro-batch
    sizes to time (from the counts that may run: ``microbatches``, or the schedule search's
    defaults for ``"auto"``), the timing cache of ``device`` (its :func:`device_name`) that
    ``options.profile_cache_dir`` asks for (timings taken at another speed of ``torch_device``,
    where they are timed, dropped: :func:`~fxsplit.passes.profile.open_cache`), and
    ``options.progress``."""
    batched = None if batched is None else tuple(batched)
    batch = _example_batch(flat, batched)
    counts = microbatches if isinstance(microbatches, int) else default_microbatches(batch)
    return {"batched": batched, "profile_sizes": profile_sizes(batch, counts),
            "profile_cache": open_cache(options.profile_cache_dir, device, torch_device), "progress": options.progress}
