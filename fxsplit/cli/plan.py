"""``fxsplit plan MODEL``: capture, annotate and plan a model, print the stages, draw the plan.

Nothing runs: the model is captured (on the meta device with ``--meta``, so any size plans in
seconds), its costs are annotated for a reference device, and the split, the schedule and the
micro-batch count are chosen as :func:`fxsplit.compile` would choose them.

Example::

    fxsplit plan gpt --devices 4 --draw out.svg --gantt out.png
    fxsplit plan hf:llama --preset 7b --meta --device a100 --devices 8 --batch-size 8
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any, cast

import typer
from rich.console import Console

from fxsplit.cli import exit_with_error
from fxsplit.cli.helptext import OBJECTIVE_HELP, RECOMPUTE_HELP, SCHEDULE_HELP, SOLVER_HELP
from fxsplit.ir.names import ObjectiveName, RecomputeName
from fxsplit.viz import plan_table

__all__ = ["register", "reference_device"]


def reference_device(name: str) -> Any:
    """``"cpu"`` (this CPU, measured) or a preset (``"a100"``) as a :class:`DeviceSpec`."""
    from fxsplit.ir import DeviceSpec

    if name == "cpu":
        from fxsplit.passes.costs import measure_cpu_spec

        return measure_cpu_spec()
    return DeviceSpec.preset(name)


def _load(model: str, size: str, batch_size: int, preset: str | None, meta: bool) -> Any:
    import contextlib

    import torch

    from fxsplit.api import load_model

    overrides = {"preset": preset} if preset else {}
    with torch.device("meta") if meta else contextlib.nullcontext():
        return load_model(model, size=size, batch_size=batch_size, **overrides)


def plan_command(
    model: Annotated[str, typer.Argument(help="zoo name (gpt, resnet, ...), hf:NAME, or module:function")],
    devices: Annotated[int, typer.Option(help="number of identical devices")] = 4,
    device: Annotated[str, typer.Option(help="device kind: cpu (measured) or a preset: a100, h100, v100, t4")] = "cpu",
    size: Annotated[str, typer.Option(help="zoo size preset: tiny, small, base")] = "small",
    preset: Annotated[str | None, typer.Option(help="hf:llama size: tiny, 7b, 13b, 70b")] = None,
    meta: Annotated[bool, typer.Option(help="build the model on the meta device (no memory)")] = False,
    batch_size: Annotated[int, typer.Option(help="samples per step")] = 8,
    microbatches: Annotated[str, typer.Option(help="micro-batches per step, or auto")] = "auto",
    schedule: Annotated[str, typer.Option(help=SCHEDULE_HELP)] = "auto",
    solver: Annotated[str, typer.Option(help=SOLVER_HELP)] = "auto",
    objective: Annotated[str, typer.Option(help=OBJECTIVE_HELP)] = "makespan",
    time_limit: Annotated[float, typer.Option(help="solver time limit, seconds")] = 30.0,
    draw: Annotated[Path | None, typer.Option(help="draw the graph coloured by stage (.svg, .png)")] = None,
    gantt: Annotated[Path | None, typer.Option(help="draw the predicted timeline (.png, .svg)")] = None,
    as_json: Annotated[Path | None, typer.Option("--json", help="write the plan as JSON here")] = None,
    recompute: Annotated[str, typer.Option(help=RECOMPUTE_HELP)] = "auto",
    explore: Annotated[bool, typer.Option("--explore", help="print every schedule, micro-batch count and recomputation tried, with the step-time / peak-memory front")] = False,
    cluster: Annotated[Path | None, typer.Option(help="a cluster file (JSON, or YAML for .yaml/.yml: device kinds, nodes, links; see fxsplit.ir.cluster); replaces --devices and --device")] = None,
    autocast: Annotated[str | None, typer.Option(help="mixed precision: bf16, fp16, or auto (plan the model's dtypes and bf16, keep the faster); default: the model's dtypes")] = None,
) -> None:
    """Plan MODEL over DEVICES devices; print the stages and optionally draw them."""
    from fxsplit.api import CompileOptions, _check_compile_args
    from fxsplit.compiler import plan_precisions, precision_label
    from fxsplit.errors import FxsplitError
    from fxsplit.frontend import capture_with, front_end
    from fxsplit.ir import LinkSpec, Problem, load_cluster
    from fxsplit.options import autocast_dtype
    from fxsplit.runtime.microbatch import batch_size_of

    console = Console()
    try:
        m: int | str = int(microbatches) if microbatches.isdigit() else microbatches
        _check_compile_args(solver, schedule, m, objective, "analytic")
        machine = load_cluster(cluster) if cluster is not None else None
        ref = machine.devices[0].with_(name=machine.devices[0].kind) if machine else reference_device(device)
        if autocast != "auto":
            autocast_dtype(autocast)  # an unknown name fails before any work
        recompute_name = cast(RecomputeName, recompute)  # Problem.check refuses any other name
        # captured as fxsplit.compile captures (a symbolic batch): the micro-batch costs come from the formulas
        options = CompileOptions(time_limit_s=time_limit, recompute=recompute_name, autocast=autocast)
        with console.status(f"capturing {model} ..."):
            case = _load(model, size, batch_size, preset, meta)
            captured = capture_with(case.model, case.example_inputs, case.example_kwargs, options)
        if machine is not None:  # devices in node order, NVLink-like links inside a node
            specs, link, links = machine.relative_to(ref), machine.inter_node, machine.link_overrides()
            console.print(f"cluster {machine.name!r}: {len(specs)} devices in {len(set(machine.node_of))} nodes")
        else:
            specs, link, links = tuple(ref.with_(name=f"{device}:{i}") for i in range(devices)), LinkSpec(), ()

        def annotate(precision: str | None) -> Problem:
            with console.status(f"annotating {model} ({precision_label(precision)}) and planning over "
                                f"{len(specs)} x {device} ..."):
                ins = front_end(case.model, case.example_inputs, dict(case.example_kwargs or {}), reference=ref,
                                cost_model="analytic", options=dataclasses.replace(options, autocast=precision),
                                captured=captured, name=model, measure_device="cpu")
            return Problem(ins.condensed.graph, specs, link=link, links=links,
                           objective=cast(ObjectiveName, objective), recompute=recompute_name).check()

        problem, choice = plan_precisions(annotate, batch_size_of(list(case.example_inputs)), m, schedule, solver,
                                          options)
        plan_problem = choice.problem.with_(graph=problem.graph.scaled(1.0 / choice.microbatches))
        if autocast is not None:
            console.print(f"precision: {precision_label(choice.autocast)}")
        console.print(plan_table(choice.plan, plan_problem))
        console.print(f"schedule: {choice.reason}")
        if explore and choice.candidates:
            console.print(choice.candidates, markup=False, highlight=False, soft_wrap=True)
        _outputs(console, choice, plan_problem, [s.name for s in specs], draw, gantt, as_json)
    except FxsplitError as exc:
        exit_with_error(console, exc, 2)


def _outputs(console: Console, choice: Any, problem: Any, names: list[str], draw: Path | None,
             gantt: Path | None, as_json: Path | None) -> None:
    from fxsplit import viz
    from fxsplit.schedule import simulate_plan

    if draw is not None:
        console.print(f"wrote {viz.draw_plan(choice.plan, problem.graph, draw, device_names=names)}")
    if gantt is not None:
        timeline = simulate_plan(choice.plan, choice.schedule, choice.microbatches)
        console.print(f"wrote {viz.gantt(timeline, gantt, title=f'{problem.graph.name}: predicted step')}")
    if as_json is not None:
        as_json.write_text(json.dumps(choice.plan.to_dict(problem), indent=1))
        console.print(f"wrote {as_json}")


def register(app: typer.Typer) -> None:
    """Add the ``plan`` subcommand to ``app``."""
    app.command("plan")(plan_command)
