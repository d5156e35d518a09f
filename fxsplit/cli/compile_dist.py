"""``fxsplit compile MODEL --distributed`` under torchrun: one stage per process, compared with the
unsplit model.

Every rank builds the (small, built-in) model once on CPU as the reference, compiles its own
stage with :func:`fxsplit.distributed.compile` from the reference's state dict, and trains both
side by side with SGD (under ``--autocast fp16`` with loss scaling: the pipeline's
``ShardedGradScaler``, the reference's ``torch.amp.GradScaler``); the largest loss and gradient differences are reduced over the ranks and
rank 0 prints the summary.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table

from fxsplit.ir.names import RecomputeName
from fxsplit.ir.units import format_seconds
from fxsplit.options import autocast_dtype, precision

__all__ = ["run_distributed"]


def _grad_diff(pipe: Any, ref_params: dict[str, Any]) -> float:
    """The largest gradient difference of this rank's parameters against the unsplit model's."""
    from torch.distributed.tensor import DTensor

    diff = 0.0
    for name, p in pipe.named_parameters():
        if p.grad is not None and ref_params[name].grad is not None:
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad  # a split stage's shard, gathered
            diff = max(diff, float((grad.cpu() - ref_params[name].grad).abs().max()))
    return diff


def _step(opt: Any, scaler: Any) -> bool:
    """``opt.step()``, through ``scaler`` under fp16; whether the step was skipped (an overflow:
    the scaler then lowers its scale)."""
    if scaler is None:
        opt.step()
        return False
    before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    return bool(scaler.get_scale() < before)


def _train(pipe: Any, case: Any, reference: Any, steps: int, lr: float, batch_size: int, console: Console, rank: int) -> dict[str, Any]:
    """Train ``pipe`` and the unsplit ``reference`` side by side with SGD; under fp16 with loss
    scaling (``pipe.grad_scaler()``, the reference a ``torch.amp.GradScaler`` of the same scale),
    gradients compared unscaled and only on steps neither skipped."""
    import torch

    # a stage may own no parameter (a 3-rank split of a small model): SGD refuses an empty list, and under fp16
    # the rank must still join the scaler's step (a collective), so it steps an empty parameter group
    opt_pipe = torch.optim.SGD(list(pipe.parameters()) or [{"params": []}], lr=lr)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=lr)
    fp16 = pipe.autocast == "fp16"
    scaler = pipe.grad_scaler() if fp16 else None
    ref_scaler = torch.amp.GradScaler("cpu") if fp16 else None
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    out: dict[str, Any] = {"loss_diff": 0.0, "grad_diff": 0.0, "step_s": [], "losses": [], "skipped": [0, 0]}
    for step in range(steps):
        inputs, target = case.make_batch(batch_size, 1000 + step)
        pipe.zero_grad(set_to_none=True)
        opt_ref.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn, broadcast_loss=True, grad_scaler=scaler)
        out["step_s"].append(time.perf_counter() - start)
        with precision("cpu", autocast_dtype(pipe.autocast)):  # the unsplit model under it too
            ref_loss = case.loss_fn(reference(*inputs), target)
        (ref_scaler.scale(ref_loss) if ref_scaler is not None else ref_loss).backward()
        ref_loss = ref_loss.detach()
        out["losses"].append(float(loss))
        out["loss_diff"] = max(out["loss_diff"], abs(float(loss) - float(ref_loss)))
        if scaler is not None and ref_scaler is not None:
            scaler.unscale_(opt_pipe)  # collective: the overflow check reduced over the ranks
            ref_scaler.unscale_(opt_ref)
        grad_diff = _grad_diff(pipe, ref_params)
        skipped = (_step(opt_pipe, scaler), _step(opt_ref, ref_scaler))
        out["skipped"] = [n + s for n, s in zip(out["skipped"], skipped, strict=True)]
        if not any(skipped):  # an overflow leaves inf gradients: nothing to compare
            out["grad_diff"] = max(out["grad_diff"], grad_diff)
        if rank == 0:
            note = f" (skipped: pipeline {skipped[0]}, original {skipped[1]})" if any(skipped) else ""
            console.print(f"step {step + 1}/{steps} loss {float(loss):.4f} ({format_seconds(out['step_s'][-1])}){note}")
    return out


def _predicted_step_s(pipe: Any) -> float | None:
    """The step the planner predicted: the hybrid search's for its mesh, else the plan's
    simulated step; None when there is no plan."""
    if pipe.hybrid is not None:
        return float(pipe.hybrid.best.step_s)
    return float(pipe.predicted_step_s()) if pipe.plan is not None else None


def _summary(pipe: Any, result: dict[str, Any], world: int) -> Table:
    mesh = pipe.replicas
    shape = "" if mesh is None else f" (pp {world // (mesh.count * mesh.tp)} x dp {mesh.count} x tp {mesh.tp})"
    table = Table(title=f"distributed pipeline: {pipe.num_stages} stages on {world} processes{shape}, "
                        f"{pipe.schedule_kind} x {pipe.microbatches}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    measured = result["step_s"][1:] or result["step_s"]
    median = sorted(measured)[len(measured) // 2]
    predicted = _predicted_step_s(pipe)
    if predicted:
        table.add_row(f"predicted step time ({pipe.meta.get('cost_model') or 'given'} costs)", format_seconds(predicted))
    table.add_row("measured step time (median, rank 0)", format_seconds(median))
    if predicted:
        off = median / predicted
        table.add_row("measured / predicted", f"{off:.2f}")
        if not 0.9 <= off <= 1.1:
            table.caption = "--calibrate N refits the plan to measured steps"
    table.add_row("largest loss difference vs original", f"{result['loss_diff']:.3e}")
    table.add_row("largest gradient difference vs original (all ranks)", f"{result['grad_diff']:.3e}")
    table.add_row("final loss", f"{result['losses'][-1]:.4f}" if result["losses"] else "-")
    if pipe.autocast == "fp16":
        skipped = result["skipped"]
        table.add_row("fp16 steps skipped on overflow (pipeline, original)", f"{skipped[0]}, {skipped[1]}")
    ref = pipe.meta.get("reference") or {}
    if ref:
        table.add_row("plan costed on (rank 0's device)", f"{ref['kind']}, {ref['peak_flops'] / 1e9:,.0f} GFLOP/s")
    return table


def run_distributed(
    model: str, *, steps: int, microbatches: str, schedule: str, size: str, batch_size: int, lr: float,
    backend: str, timeout_s: float, save: str | None = None, calibrate: int = 0, recompute: RecomputeName = "auto",
    autocast: str | None = None, replicas: int = 1, tensor_parallel: int = 1, parallel: str = "pipeline",
) -> None:
    """Train ``model`` across the processes torchrun launched; rank 0 prints. ``calibrate > 0``:
    measure that many steps per plan, refit and re-plan across the ranks first. ``replicas``,
    ``tensor_parallel``: copies of every stage, ranks each stage is split over; ``parallel="hybrid"``:
    rank 0 chooses them (:func:`fxsplit.distributed.compile`).

    Raises:
        FxsplitError: as :func:`fxsplit.distributed.compile` (the caller prints it).
    """
    import torch
    import torch.distributed as dist

    import fxsplit.distributed as fxd
    from fxsplit.api import CompileOptions, load_model

    torch.manual_seed(0)
    rank, world, _ = fxd.init_process_group(None if backend == "auto" else backend, timeout_s)
    console = Console(quiet=rank != 0)
    case = load_model(model, size=size, batch_size=batch_size)
    reference = case.model
    m: int | str | None = int(microbatches) if microbatches.isdigit() else "auto"
    if parallel == "hybrid" and m == "auto":
        m = None  # the world size
    with console.status(f"capturing {model} on the meta device and planning it over {world} processes ..."):
        pipe = fxd.compile(
            lambda: load_model(model, size=size, batch_size=batch_size).model, case.example_inputs,
            schedule=schedule, microbatches=m, state_dict=reference.state_dict(), timeout_s=timeout_s,
            options=CompileOptions(allow_idle_devices=False, time_limit_s=30.0, recompute=recompute, autocast=autocast),
            replicas=replicas, tensor_parallel=tensor_parallel, parallel=parallel,
        )
    if pipe.hybrid is not None:
        from fxsplit.cli.hybrid import print_hybrid

        print_hybrid(console, pipe.hybrid, f"{model} over {world} processes (rank 0's {pipe.hybrid.costs} costs)", top=5)
    if calibrate > 0:
        inputs, target = case.make_batch(batch_size, 999)
        with console.status(f"calibrating: {calibrate} measured steps per plan on every rank ..."):
            report = pipe.calibrate(*inputs, target=target, loss_fn=case.loss_fn, steps=calibrate)
        console.print(report.format_table(), markup=False)
    console.print(repr(pipe), markup=False)
    result = _train(pipe, case, reference, steps, lr, batch_size, console, rank)
    diffs = torch.tensor([result["loss_diff"], result["grad_diff"]], dtype=torch.float64, device=pipe.device)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    result["loss_diff"], result["grad_diff"] = (float(x) for x in diffs)
    if save:
        pipe.save(save)
        console.print(f"saved per-stage checkpoint to {save}")
    console.print(_summary(pipe, result, world))
    pipe.close()
    dist.destroy_process_group()


def run_layers(model: str, *, steps: int, strategy: str, size: str, batch_size: int, lr: float, timeout_s: float) -> None:
    """Split every layer of ``model`` over the processes torchrun launched (``strategy``:
    ``layers`` for PaSE's best plan, or ``data-parallel``, ``megatron``, ``replicate``), train it
    beside the unsplit model with SGD, and print the plan, the measured step and the largest loss
    and gradient differences (rank 0).

    Raises:
        FxsplitError: as :func:`fxsplit.distributed.parallelize` (the caller prints it).
    """
    import copy
    from collections import Counter

    import torch
    import torch.distributed as dist

    import fxsplit.distributed as fxd
    from fxsplit.api import load_model
    from fxsplit.errors import ConfigError

    names = {"layers": "auto", "data-parallel": "data-parallel", "megatron": "megatron", "replicate": "replicate"}
    if strategy not in names:
        raise ConfigError(f"--parallel {strategy}: choose pipeline, {', '.join(names)}")
    torch.manual_seed(0)
    rank, world, _ = fxd.init_process_group("gloo", timeout_s)
    console = Console(quiet=rank != 0)
    case = load_model(model, size=size, batch_size=batch_size)
    reference = case.model
    with console.status(f"capturing {model}, choosing each layer's placement over {world} processes ..."):
        pg = fxd.parallelize(lambda: copy.deepcopy(reference), case.example_inputs, strategy=names[strategy],
                             timeout_s=timeout_s)
    opt, opt_ref = torch.optim.SGD(pg.parameters(), lr=lr), torch.optim.SGD(reference.parameters(), lr=lr)
    loss_diff = grad_diff = 0.0
    step_s = []
    for step in range(steps):
        inputs, target = case.make_batch(batch_size, 1000 + step)
        opt.zero_grad(set_to_none=True)
        opt_ref.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = pg.train_step(*inputs, target=target, loss_fn=case.loss_fn)
        step_s.append(time.perf_counter() - start)
        ref_loss = case.loss_fn(reference(*inputs), target)
        ref_loss.backward()
        grads = pg.grads()
        for name, p in reference.named_parameters(remove_duplicate=False):
            if p.grad is not None and grads.get(name) is not None:
                grad_diff = max(grad_diff, float((grads[name] - p.grad).abs().max()))
        loss_diff = max(loss_diff, abs(float(loss) - float(ref_loss.detach())))
        opt.step()
        opt_ref.step()
        console.print(f"step {step + 1}/{steps} loss {float(loss):.4f} ({format_seconds(step_s[-1])})")
    plan = pg.plan
    assert plan is not None  # parallelize sets it
    table = Table(title=f"{model}: every layer split over {world} processes ({plan.strategy}, solved by {plan.solver})")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("parameter placements", ", ".join(f"{k} x{n}" for k, n in Counter(pg.placements().values()).most_common()))
    table.add_row("predicted step (compute + collectives)", format_seconds(plan.predicted_step_s))
    for name, seconds in plan.baselines.items():
        table.add_row(f"predicted step, {name}", format_seconds(seconds))
    measured = step_s[1:] or step_s
    table.add_row("measured step time (median, rank 0)", format_seconds(sorted(measured)[len(measured) // 2]))
    table.add_row("largest loss difference vs original", f"{loss_diff:.3e}")
    table.add_row("largest gradient difference vs original", f"{grad_diff:.3e}")
    if pg.run_whole or pg.fallback:
        table.add_row("ops run on whole tensors", str(len(pg.run_whole | set(pg.fallback))))
    console.print(table)
    dist.destroy_process_group()
