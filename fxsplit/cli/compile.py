"""``fxsplit compile MODEL``: the main job — plan, split, train K steps, and check against the original."""

from __future__ import annotations

import copy
import time
from typing import Annotated, Any, cast

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from fxsplit.cli import exit_with_error
from fxsplit.cli.helptext import (
    COST_MODEL_HELP,
    OBJECTIVE_HELP,
    RECOMPUTE_HELP,
    SCHEDULE_HELP,
    SOLVER_HELP,
)
from fxsplit.ir.names import RecomputeName
from fxsplit.ir.units import format_seconds
from fxsplit.options import precision
from fxsplit.viz import stage_table

__all__ = ["register", "parse_devices", "train_and_compare"]


def parse_devices(devices: str) -> list[str]:
    """``"4"`` -> four ``"cpu"`` devices; ``"cuda:0,cuda:1"`` -> that list."""
    if devices.isdigit():
        return ["cpu"] * int(devices)
    return [d.strip() for d in devices.split(",") if d.strip()]


def train_and_compare(pipe: Any, case: Any, reference: Any, steps: int, lr: float, batch_size: int, progress: Progress | None = None) -> dict[str, Any]:
    """Train ``pipe`` and ``reference`` (the unsplit model) side by side with SGD.

    Returns:
        ``loss_diff`` and ``grad_diff`` (largest absolute differences over all steps and
        parameters), ``worst_param`` (its name), ``step_s`` (measured pipeline step times) and
        ``losses``.
    """
    import torch

    opt_pipe = torch.optim.SGD(list(pipe.parameters()), lr=lr)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=lr)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    out: dict[str, Any] = {"loss_diff": 0.0, "grad_diff": 0.0, "worst_param": "", "step_s": [], "losses": []}
    task = progress.add_task("training", total=steps) if progress else None
    for step in range(steps):
        inputs, target = case.make_batch(batch_size, 1000 + step)
        opt_pipe.zero_grad(set_to_none=True)
        opt_ref.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
        out["step_s"].append(time.perf_counter() - start)
        with precision("cpu", getattr(pipe, "autocast", None)):  # mixed precision: the unsplit model under it too
            ref_loss = case.loss_fn(reference(*inputs), target)
        ref_loss.backward()
        out["losses"].append(float(loss))
        out["loss_diff"] = max(out["loss_diff"], abs(loss.item() - ref_loss.item()))
        for name, p in pipe.named_parameters():
            g, rg = p.grad, ref_params[name].grad
            if g is None or rg is None:
                continue
            d = float((g.detach().cpu() - rg.detach().cpu()).abs().max())
            if d > out["grad_diff"]:
                out["grad_diff"], out["worst_param"] = d, name
        opt_pipe.step()
        opt_ref.step()
        if progress and task is not None:
            progress.update(task, advance=1, description=f"step {step + 1}/{steps} loss {float(loss):.4f}")
    return out


def _summary(pipe: Any, result: dict[str, Any]) -> Table:
    from fxsplit.schedule import plan_step_s

    table = Table(title="predicted vs measured")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    measured = result["step_s"][1:] or result["step_s"]
    table.add_row("predicted step time (cost model, devices in parallel)", format_seconds(plan_step_s(pipe.plan)))
    if pipe.executor == "sequential":  # one process, one thread: stages cannot overlap
        serial_s = pipe.microbatches * sum(st.time_s for st in pipe.plan.stages)
        table.add_row("predicted step time (stages one after another, as run here)", format_seconds(serial_s))
    table.add_row("measured step time (median)", format_seconds(sorted(measured)[len(measured) // 2]))
    table.add_row("largest loss difference vs original", f"{result['loss_diff']:.3e}")
    table.add_row(f"largest gradient difference vs original ({result['worst_param'] or '-'})", f"{result['grad_diff']:.3e}")
    table.add_row("final loss", f"{result['losses'][-1]:.4f}" if result["losses"] else "-")
    return table


def register(app: typer.Typer) -> None:
    @app.command("compile")
    def compile_cmd(
        model: Annotated[str, typer.Argument(help="zoo name (gpt, resnet, ...), hf:NAME, or module:function")] = "gpt",
        devices: Annotated[str, typer.Option(help="a count of CPU devices (4) or a list (cuda:0,cuda:1)")] = "4",
        steps: Annotated[int, typer.Option(min=1, help="training steps on synthetic data")] = 5,
        microbatches: Annotated[str, typer.Option(help="micro-batches per step, or auto")] = "auto",
        schedule: Annotated[str, typer.Option(help=SCHEDULE_HELP)] = "auto",
        solver: Annotated[str, typer.Option(help=SOLVER_HELP)] = "auto",
        size: Annotated[str, typer.Option(help="zoo size preset: tiny, small, base")] = "small",
        batch_size: Annotated[int, typer.Option(help="samples per step")] = 8,
        lr: Annotated[float, typer.Option(help="SGD learning rate")] = 1e-2,
        objective: Annotated[str, typer.Option(help=OBJECTIVE_HELP)] = "makespan",
        cost_model: Annotated[str, typer.Option(help=COST_MODEL_HELP)] = "auto",
        calibrate: Annotated[int, typer.Option(help="measure this many steps, refit the costs and re-plan first (0: off)")] = 0,
        distributed: Annotated[bool, typer.Option(help="one stage per process, under torchrun (see compile_dist)")] = False,
        backend: Annotated[str, typer.Option(help="--distributed: gloo, nccl or auto")] = "auto",
        timeout_s: Annotated[float, typer.Option(help="--distributed: seconds before a silent peer is an error")] = 60.0,
        parallel: Annotated[str, typer.Option(help="--distributed: pipeline (one stage per process, or the mesh "
                                              "--replicas and --tensor-parallel give), hybrid (rank 0 chooses pipeline "
                                              "stages x replicas x tensor parallelism), or split every "
                                              "layer over all processes (DTensor, gloo): layers (PaSE's best plan), "
                                              "data-parallel, megatron, replicate")] = "pipeline",
        recompute: Annotated[str, typer.Option(help=RECOMPUTE_HELP)] = "auto",
        autocast: Annotated[str | None, typer.Option(help="mixed precision: bf16, fp16, or auto (plan the model's dtypes and bf16, run the faster; local only); default: the model's dtypes")] = None,
        replicas: Annotated[int, typer.Option(min=1, help="--distributed pipeline: copies of every stage (a [pp, dp] mesh; each trains 1/replicas of the batch)")] = 1,
        tensor_parallel: Annotated[int, typer.Option(min=1, help="--distributed pipeline: processes each stage's layers are split over (a [pp, dp, tp] mesh; PaSE's per-layer plan, gloo)")] = 1,
    ) -> None:
        """Plan MODEL over DEVICES, train STEPS steps, and compare with the unsplit model."""
        import fxsplit
        from fxsplit.api import CompileOptions, load_model
        from fxsplit.errors import FxsplitError
        from fxsplit.runtime.host_memory import keep_freed_memory

        console = Console()
        # one allocator mode for the profile and the run (and the unsplit model it is compared with):
        # glibc otherwise maps multi-MiB gradients afresh or not, by chance (fxsplit.runtime.host_memory)
        keep_freed_memory()
        recompute_name = cast(RecomputeName, recompute)  # Problem.check refuses any other name
        # -- distributed path (issue 5): everything lives in fxsplit/cli/compile_dist.py -------
        if parallel != "pipeline" and not distributed:
            from fxsplit.errors import ConfigError

            exit_with_error(console, ConfigError(f"--parallel {parallel} splits layers over processes: add --distributed "
                                                 "and launch with torchrun"), 2)
        if distributed:
            from fxsplit.cli.compile_dist import run_distributed, run_layers

            try:
                if parallel not in ("pipeline", "hybrid"):
                    run_layers(model, steps=steps, strategy=parallel, size=size, batch_size=batch_size, lr=lr,
                               timeout_s=timeout_s)
                    return
                run_distributed(model, steps=steps, microbatches=microbatches, schedule=schedule, size=size,
                                batch_size=batch_size, lr=lr, backend=backend, timeout_s=timeout_s,
                                calibrate=calibrate, recompute=recompute_name, autocast=autocast, replicas=replicas,
                                tensor_parallel=tensor_parallel, parallel=parallel)
            except FxsplitError as exc:
                exit_with_error(console, exc, 2)
            return
        try:
            case = load_model(model, size=size, batch_size=batch_size)
            reference = copy.deepcopy(case.model)
            m: int | str = int(microbatches) if microbatches.isdigit() else microbatches
            with Progress(console=console, transient=True) as bar:
                task = bar.add_task(f"capturing, profiling and planning {model} over {devices} devices", total=None)

                def profiled(done: int, total: int) -> None:
                    bar.update(task, completed=done, total=total,
                               description=f"profiling {model}: micro-batch size {done} of {total}")

                _, example_target = case.make_batch(batch_size, 0)  # the loss is planned on the last stage
                pipe = fxsplit.compile(
                    case.model, parse_devices(devices), case.example_inputs,
                    microbatches=m, schedule=schedule, solver=solver, objective=objective, cost_model=cost_model,
                    options=CompileOptions(progress=profiled, recompute=recompute_name, autocast=autocast,
                                           phase=lambda text: bar.update(task, description=text)),
                    loss_fn=case.loss_fn, target=example_target,
                )
            if calibrate > 0:
                inputs, target = case.make_batch(batch_size, 999)
                with console.status(f"calibrating: {calibrate} measured steps per plan ..."):
                    report = pipe.calibrate(*inputs, target=target, loss_fn=case.loss_fn, steps=calibrate)
                console.print(report.format_table())
            console.print(stage_table(pipe))
            if pipe.report is not None:
                console.print(f"schedule: {pipe.report.reason}")
            with Progress(console=console, transient=False) as progress:
                result = train_and_compare(pipe, case, reference, steps, lr, batch_size, progress)
        except FxsplitError as exc:
            exit_with_error(console, exc, 2)
        console.print(_summary(pipe, result))
        if pipe.bn_tracker is not None and pipe.bn_tracker.batch_norms:
            console.print(
                "note: the model has BatchNorm in training mode, which normalises each micro-batch on its own "
                "(as in GPipe), so its loss and gradients differ from the unsplit model's; run with "
                "--microbatches 1 for an exact match (running statistics are deferred to the whole batch)."
            )
