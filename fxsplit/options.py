"""Options of :func:`fxsplit.compile` beyond its arguments, importable by every layer.

The compiler, calibration and the distributed path all read them; keeping the one definition
here (and not in :mod:`fxsplit.api`) lets them be typed without importing the front door.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fxsplit.errors import ConfigError
from fxsplit.ir.devices import DeviceSpec, LinkSpec
from fxsplit.ir.names import RecomputeName

__all__ = ["AUTOCAST_DTYPES", "CompileOptions", "autocast_dtype", "precision", "with_loss_options"]

#: ``CompileOptions.autocast`` names and the ``torch.dtype`` names they stand for.
AUTOCAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def autocast_dtype(name: str | None) -> Any:
    """The ``torch.dtype`` of an ``autocast`` name (``None`` without mixed precision).

    Raises:
        ConfigError: for a name other than ``"bf16"``, ``"fp16"`` or ``None``.
    """
    if name is None:
        return None
    if name == "auto":
        raise ConfigError("autocast='auto' (plan each precision, keep the fastest) is decided by fxsplit.compile's "
                          "planning; a stage runs one precision: pass 'bf16', 'fp16' or None here")
    if name not in AUTOCAST_DTYPES:
        raise ConfigError(f"autocast={name!r} is unknown; choose one of {sorted(AUTOCAST_DTYPES)} "
                          "or None (the model's own dtypes)")
    import torch

    return getattr(torch, AUTOCAST_DTYPES[name])


def precision(device: Any, dtype: Any) -> Any:
    """``torch.autocast`` on ``device``'s type (a ``torch.device`` or its string) to ``dtype``,
    or a null context when ``dtype`` is None: every place that runs a stage, a loss or a shape
    computation in mixed precision enters this one."""
    import contextlib

    import torch

    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


@dataclass(frozen=True)
class CompileOptions:
    """Knobs of :func:`compile` beyond its arguments.

    Attributes:
        capture_method: ``"auto"``, ``"export"`` or ``"symbolic_trace"``.
        dynamic_batch: Export with a symbolic batch dimension so any micro-batch size runs.
        time_limit_s: Solver time limit.
        max_downsets: Budget of the downset enumeration (``auto`` switches to CP-SAT past it).
        copy_tied: Give every stage its own copy of tied tensors even on one device (tests).
        reference: The reference device of the cost annotation (default: first device).
        link: Links between the devices: a ``LinkSpec`` for every pair, ``"probe"`` to measure
            every pair (:func:`fxsplit.runtime.links.pipeline_links`), or ``"auto"`` (probe when
            the cost model times the devices, else the ``LinkSpec`` default).
        training: Plan for training (True) or inference.
        allow_idle_devices: Let the plan use fewer stages than devices (False: one stage each).
        executor: ``"auto"`` (threads when a stage is on CUDA), ``"threads"`` (one worker thread
            per device, stages overlap) or ``"sequential"``.
        deferred_batch_norm: With several micro-batches, update BatchNorm running statistics
            once per step with the whole batch's statistics, as the unsplit model does; and run
            buffer updates that read no input (a step counter) once per step
            (:mod:`fxsplit.codegen.buffers`).
        profile_cache_dir: Folder of the profiled cost model's timing cache (default
            ``~/.cache/fxsplit/profiles``); ``False`` times every node afresh and keeps nothing.
        profile_all_ranks: Under ``fxsplit.distributed`` with CPU ranks, every rank profiles the
            graph at the same time as rank 0 and rank 0 plans on the mean of their timings, so
            the stages are timed beside the processes they run beside
            (:func:`fxsplit.dist_profile.profile_together`; the pipeline's planning, not
            ``parallel="hybrid"``'s mesh search, which rank 0 profiles alone), when ``world``
            copies of the model fit the machine's free memory. On by default: on 2 ranks of a
            2-core machine, with the runtime's own work costed and freed memory kept, it
            brought the median stage error closer in 8 of 10 runs of five models (MLP 12-19 %
            against 20-29 % alone, ResNet 3-9 % against 4-16 %, BERT 6-9 % against 7-16 %;
            ``bench/fidelity.py --ranks 2 --compare-profiling 3 --keep-freed-memory``,
            bench/README.md). False: rank 0 profiles alone.
        progress: ``progress(done, total)`` called after each micro-batch size the profiled
            cost model times (the CLI draws a progress bar with it).
        phase: ``phase(text)`` called as compile moves on (capturing, annotating costs, the
            schedule search, the exact split of the winner, building the stages), so a long
            compile can say what it waits on (the CLI shows it beside its spinner).
        batch_dim: The batch dimension of the first input (``compile(batch_dim=...)``).
        stages_per_device: Stages each device runs under a looped schedule
            (``schedule="interleaved-1f1b"``, which ``"auto"`` also tries): ``v >= 2`` model
            chunks per device in looping placement (Megatron-LM's interleaved 1F1B).
        recompute: Activation recomputation per stage (:data:`fxsplit.ir.RECOMPUTE`):
            ``"auto"`` (a stage recomputes when its activations would not fit its device
            otherwise), ``"all"`` or ``"none"``.
        autocast: Mixed precision: ``"bf16"`` or ``"fp16"`` runs every stage's forward and the
            loss under ``torch.autocast`` to that dtype (parameters, gradients and optimizer
            state stay fp32), and annotates the costs under it (activation and boundary bytes
            in the dtypes autocast gives; measured and profiled times of the autocast kernels);
            ``None`` (default) runs in the model's own dtypes. With ``"fp16"`` pass a
            ``torch.amp.GradScaler`` to ``train_step(grad_scaler=...)``; across processes
            (``fxsplit.distributed``) pass ``pipe.grad_scaler()``, a ``ShardedGradScaler`` whose
            overflow check is reduced over the ranks. ``"auto"`` (:func:`fxsplit.compile` only)
            plans both the model's own dtypes and ``"bf16"`` and runs the faster
            (``pipe.report.reason`` says which, with both predicted steps).
        symbolic_costs: With the analytic cost model and a symbolic batch, cost each
            micro-batch size the schedule search tries by evaluating the cost formulas of the
            batch size at it (:mod:`fxsplit.passes.symbolic`: the roofline per size, where a
            small micro-batch still reads every weight) instead of scaling the whole batch's
            costs linearly; about a second more of annotation. False: linear scaling.
        action_overhead_s: The runtime's own seconds per stage action (and, across processes,
            per boundary message) that the plan charges (:attr:`fxsplit.ir.Problem.action_overhead_s`):
            a number of seconds per action; ``"probe"`` to measure them on a pipeline of
            trivial stages (:mod:`fxsplit.runtime.overhead`, memoised per process); ``"auto"``
            (default) probes when the cost model times the devices (profiled or measured; under
            ``fxsplit.distributed`` unless ``cost_model="analytic"``), else 0.
        loss_fn, loss_target: The loss ``train_step`` will compute on the last stage
            (``loss_fn(output, target) -> scalar``) and a target for the example batch: with a
            timed cost model (profiled, measured) the loss's forward and backward are timed on
            the model's outputs and charged to the block that makes them, so the plan balances
            the last stage with its loss (``fxsplit.compile(loss_fn=..., target=...)`` sets
            them). None: the plan leaves the loss out.
    """

    capture_method: str = "auto"
    dynamic_batch: bool = True
    time_limit_s: float | None = 30.0
    max_downsets: int = 20_000
    copy_tied: bool = False
    reference: DeviceSpec | None = None
    link: LinkSpec | str = "auto"
    training: bool = True
    allow_idle_devices: bool = True
    executor: str = "auto"
    deferred_batch_norm: bool = True
    profile_cache_dir: str | Path | bool | None = None
    profile_all_ranks: bool = True
    progress: Callable[[int, int], None] | None = None
    phase: Callable[[str], None] | None = None
    batch_dim: int = 0
    stages_per_device: int = 2
    recompute: RecomputeName = "auto"
    autocast: str | None = None
    symbolic_costs: bool = True
    action_overhead_s: float | str = "auto"
    loss_fn: Callable[[Any, Any], Any] | None = None
    loss_target: Any = None


def with_loss_options(options: CompileOptions, loss_fn: Any, target: Any) -> CompileOptions:
    """``options`` with the loss ``compile`` was given (``loss_fn``, ``target``: the
    :attr:`CompileOptions.loss_fn` / ``loss_target`` the plan times); ``options`` itself for
    ``loss_fn=None``.

    Raises:
        ConfigError: for a ``loss_fn`` that is not callable.
    """
    if loss_fn is None:
        return options
    if not callable(loss_fn):
        raise ConfigError(f"compile(loss_fn={loss_fn!r}) needs a callable loss_fn(output, target) -> scalar, or None")
    return replace(options, loss_fn=loss_fn, loss_target=target)
