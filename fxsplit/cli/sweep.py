"""``fxsplit sweep MODEL``: train a learning-rate x batch-size grid of MODEL at once (Hydra).

Every grid point is one task of :func:`fxsplit.multi.train_many`; each model is cut into the
fewest shards that fit ``--memory-per-device`` and the shards of all models share ``--devices``
CPU workers. The summary compares the measured makespan with the simulator's prediction and
the lower bound, and each model with training it alone on the same batches.
"""

from __future__ import annotations

import copy
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from fxsplit.cli import exit_with_error
from fxsplit.cli.helptext import choices
from fxsplit.ir.names import COST_MODELS
from fxsplit.ir.units import format_seconds

__all__ = ["register", "parse_floats", "parse_ints", "alone_difference"]

OPTIMIZERS = ("adamw", "sgd")


def parse_floats(text: str, what: str) -> list[float]:
    """``"1e-3,3e-4"`` -> ``[0.001, 0.0003]``; typer.BadParameter naming ``what`` otherwise."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"{what}={text!r}: give comma-separated numbers, e.g. 1e-3,3e-4") from exc
    if not values:
        raise typer.BadParameter(f"{what} is empty; give at least one value")
    return values


def parse_ints(text: str, what: str) -> list[int]:
    """``"4,8"`` -> ``[4, 8]`` (positive integers)."""
    values = parse_floats(text, what)
    if any(v != int(v) or v < 1 for v in values):
        raise typer.BadParameter(f"{what}={text!r}: give positive integers, e.g. 4,8")
    return [int(v) for v in values]


def _optimizer(name: str, lr: float) -> Any:
    import torch

    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr)
    return lambda params: torch.optim.AdamW(params, lr=lr)


def alone_difference(initial: Any, trained: Any, optimizer: Any, loss_fn: Any, data: list[Any]) -> float:
    """Train ``initial`` (a copy of the model as it was) alone on ``data`` and return the largest
    absolute parameter difference to ``trained``."""
    opt = optimizer(list(initial.parameters()))
    for inputs, target in data:
        opt.zero_grad(set_to_none=True)
        loss_fn(initial(*inputs), target).backward()
        opt.step()
    params = dict(trained.named_parameters())
    return max((float((p.detach() - params[n].detach()).abs().max()) for n, p in initial.named_parameters()),
               default=0.0)


def _summary(report: Any, diffs: list[float], devices: int) -> tuple[Table, Table]:
    tasks = Table(title="models")
    for col in ("task", "shards", "final loss", "largest parameter difference vs alone"):
        tasks.add_column(col, justify="left" if col == "task" else "right")
    for j, name in enumerate(report.names):
        losses = report.losses[j]
        tasks.add_row(name, str(report.shards[j]), f"{losses[-1]:.4f}" if losses else "-", f"{diffs[j]:.3e}")
    run = Table(title=f"makespan ({report.scheduler}, {devices} workers)")
    run.add_column("quantity")
    run.add_column("value", justify="right")
    run.add_row("measured makespan", format_seconds(report.makespan_s))
    run.add_row("simulator's prediction (cost model's unit times)", format_seconds(report.predicted.makespan_s))
    run.add_row("lower bound (cost model's unit times)", format_seconds(report.lower_bound_s))
    run.add_row("lower bound (measured unit times)", format_seconds(report.measured_lower_bound_s))
    run.add_row("worker utilisation", " ".join(f"{u:.0%}" for u in report.utilisation))
    run.add_row("state moved between host and workers", f"{report.moved_bytes / 2**20:.2f} MiB")
    return tasks, run


def register(app: typer.Typer) -> None:
    @app.command("sweep")
    def sweep_cmd(
        model: Annotated[str, typer.Argument(help="zoo name (gpt, mlp, ...), hf:NAME, or module:function")] = "gpt",
        lr: Annotated[str, typer.Option(help="learning rates, comma-separated")] = "1e-3,3e-4",
        batch_size: Annotated[str, typer.Option(help="batch sizes, comma-separated")] = "4,8",
        devices: Annotated[int, typer.Option(min=1, help="CPU workers")] = 2,
        memory_per_device: Annotated[float | None, typer.Option(help="each worker's memory budget, GiB (default: unlimited)")] = None,
        steps: Annotated[int, typer.Option(min=1, help="training steps per model")] = 3,
        size: Annotated[str, typer.Option(help="zoo size preset: tiny, small, base")] = "small",
        scheduler: Annotated[str, typer.Option(help="lrtf (Hydra's Sharded-LRTF), fifo or round-robin")] = "lrtf",
        optimizer: Annotated[str, typer.Option(help="adamw or sgd")] = "adamw",
        cost_model: Annotated[str, typer.Option(help=f"{choices(COST_MODELS)}: unit times the scheduler starts from")] = "analytic",
        recompute: Annotated[bool, typer.Option(help="shards keep only their inputs and recompute in backward (default: activations wait in host memory)")] = False,
        gantt: Annotated[bool, typer.Option(help="draw the measured timeline")] = True,
    ) -> None:
        """Train a grid of MODEL (learning rates x batch sizes) at once by shard parallelism."""
        from fxsplit.api import load_model
        from fxsplit.errors import FxsplitError
        from fxsplit.multi import Task, train_many
        from fxsplit.runtime.host_memory import keep_freed_memory

        console = Console()
        keep_freed_memory()  # one allocator mode for profiles and runs (fxsplit.runtime.host_memory)
        lrs, sizes = parse_floats(lr, "--lr"), parse_ints(batch_size, "--batch-size")
        if optimizer not in OPTIMIZERS:
            raise typer.BadParameter(f"--optimizer {optimizer!r}: choose one of {OPTIMIZERS}")
        if memory_per_device is not None and memory_per_device <= 0:
            raise typer.BadParameter(f"--memory-per-device {memory_per_device}: give a positive number of GiB")
        budget = None if memory_per_device is None else int(memory_per_device * 2**30)
        try:
            tasks, alone = [], []
            for rate in lrs:
                for bs in sizes:
                    case = load_model(model, size=size, batch_size=bs)
                    data = [case.make_batch(bs, 1000 + step) for step in range(steps)]
                    alone.append((copy.deepcopy(case.model), data, case.loss_fn))
                    tasks.append(Task(case.model, _optimizer(optimizer, rate), case.loss_fn, data, steps=steps,
                                      name=f"lr={rate:g} bs={bs}"))
            with Progress(console=console, transient=False) as bar:
                ids = [bar.add_task(t.name, total=None) for t in tasks]

                def progress(j: int, done: int, total: int) -> None:
                    bar.update(ids[j], completed=done, total=total)

                result = train_many(tasks, devices, memory_per_device_bytes=budget, scheduler=scheduler,
                                    cost_model=cost_model, progress=progress, recompute=recompute)
        except FxsplitError as exc:
            exit_with_error(console, exc, 2)
        diffs = [alone_difference(init, trained, tasks[j].optimizer, loss_fn, data)
                 for j, ((init, data, loss_fn), trained) in enumerate(zip(alone, result.models, strict=True))]
        for table in _summary(result.report, diffs, devices):
            console.print(table)
        if gantt:
            console.print(result.report.gantt(), highlight=False, markup=False)
