"""``fxsplit solve GRAPH``: split a graph file across devices and print the plan.

Example::

    fxsplit solve ../shared/data/pipedream/resnet50.txt --devices 4 --no-comm
    fxsplit solve problem.json --solver cpsat --time-limit 30 --json
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from fxsplit.cli import exit_with_error
from fxsplit.cli.helptext import OBJECTIVE_HELP, PROBLEM_SCHEDULE_HELP, SOLVER_HELP
from fxsplit.errors import ConfigError, FxsplitError, InfeasibleError, InternalError
from fxsplit.ir.devices import DeviceSpec, GiB, LinkSpec
from fxsplit.ir.formats import (
    detect_format,
    load_graph_or_problem,
    tarnawski_max_load,
    tarnawski_plan_faults,
)
from fxsplit.ir.graph import CondensedGraph
from fxsplit.ir.plan import Plan
from fxsplit.ir.problem import Problem

__all__ = ["register", "build_problem", "parse_bytes", "plan_json"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"16GiB"`` -> 17179869184, ``"1e9"`` -> 1000000000.

    Raises:
        ConfigError: for text that is not a number with an optional unit (B, KB, KiB, MB, MiB, GB,
            GiB, TB, TiB).
    """
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read {text!r} as bytes; write e.g. 16GiB, 500MB or 1e9")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _load_devices(path: Path) -> dict[str, Any]:
    """Devices file: a list of devices, or ``{"devices": [...], "link": {...}, "links": [...],
    "device_order": "free"}``; a device is a preset name (``"a100"``) or DeviceSpec fields."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read devices file {str(path)!r}: {exc}") from exc
    if isinstance(data, list):
        data = {"devices": data}
    devices = []
    for i, d in enumerate(data.get("devices", [])):
        spec = DeviceSpec.preset(d) if isinstance(d, str) else DeviceSpec.from_dict(d)
        if isinstance(d, str):
            spec = spec.with_(name=f"{d}:{i}")
        devices.append(spec)
    out: dict[str, Any] = {"devices": tuple(devices)}
    if "link" in data:
        out["link"] = LinkSpec(**data["link"])
    if "links" in data:
        out["links"] = tuple((int(i), int(j), LinkSpec(**s)) for i, j, s in data["links"])
    for key in ("device_order", "allow_idle_devices"):
        if key in data:
            out[key] = data[key]
    return out


def build_problem(loaded: CondensedGraph | Problem, *, devices: int | None = None,
                  devices_file: Path | None = None, **overrides: Any) -> Problem:
    """The problem the CLI solves: the loaded file plus the command-line options.

    Args:
        loaded: A graph or a problem (its devices are kept unless ``devices``/``devices_file``).
        devices: Number of identical devices ``dev0..dev{N-1}`` (16 GiB each by default).
        devices_file: JSON devices file (see :func:`_load_devices`).
        **overrides: ``objective``, ``microbatches``, ``schedule``, ``memory_limit``
            (bytes, every device), ``no_comm`` (bool); ``None`` leaves the file's value.

    Raises:
        ConfigError: when neither the file nor the options give devices, or both options are set.
    """
    if devices is not None and devices_file is not None:
        raise ConfigError("pass either --devices N or --devices-file F, not both")
    fields: dict[str, Any] = {}
    if devices_file is not None:
        fields.update(_load_devices(devices_file))
    elif devices is not None:
        fields["devices"] = tuple(DeviceSpec(f"dev{i}", memory_bytes=16 * GiB, kind="dev") for i in range(devices))
    if isinstance(loaded, Problem):
        problem = loaded.with_(**fields)
    elif "devices" in fields:
        problem = Problem(graph=loaded, **fields)
    else:
        raise ConfigError("the graph file has no devices: pass --devices N or --devices-file F")
    for key in ("objective", "microbatches", "schedule"):
        if overrides.get(key) is not None:
            problem = problem.with_(**{key: overrides[key]})
    if overrides.get("memory_limit") is not None:
        cap = overrides["memory_limit"]
        problem = problem.with_(devices=tuple(d.with_(memory_bytes=cap) for d in problem.devices))
    if overrides.get("no_comm"):
        problem = problem.with_(link=LinkSpec(bytes_per_s=math.inf, latency_s=0.0), links=())
    return problem.check()


def _recheck_tarnawski(path: Path, problem: Problem, plan: Plan) -> None:
    """Re-validate a plan of a Tarnawski instance on the file's own nodes and edges (the solvers
    saw colour classes, merged cycles and folded blocks): a broken precedence is a bug, never a
    plan to print.

    Raises:
        InternalError: naming the first broken precedences.
    """
    faults = tarnawski_plan_faults(path, problem, plan)
    if faults:
        raise InternalError(f"the plan breaks {len(faults)} precedence(s) of {path}: {'; '.join(faults[:5])} "
                            "(a bug in fxsplit's Tarnawski reader or solvers; please report it with the file)")


def _compare_with_their_costing(err: Console, path: Path, problem: Problem, plan: Plan, *,
                                communication: bool) -> None:
    """Say so on stderr when ``plan``'s largest stage load, costed as ``dp.cpp`` costs it
    (:func:`~fxsplit.ir.formats.tarnawski_max_load`), exceeds what fxsplit's model gives it: the
    optimum printed is then fxsplit's, not the paper's (training files whose gradients do not
    mirror their activations)."""
    from rich.markup import escape

    theirs = tarnawski_max_load(path, problem, plan, communication=communication)
    ours = plan.bottleneck_s
    if theirs > ours * (1 + 1e-6) + 1e-12:
        err.print(f"[yellow]warning:[/yellow] {escape(str(path))}: costed as dp.cpp costs it (every node whose edge "
                  f"crosses a stage, forward or backward, once) this plan's largest stage load is {theirs:.6g}, "
                  f"where fxsplit's relayed transfers give {ours:.6g}; "
                  "the plan is optimal for fxsplit's model, not for dp.cpp's (--transfers direct solves dp.cpp's)",
                  highlight=False)


def plan_json(plan: Plan, problem: Problem) -> dict[str, Any]:
    """The ``--json`` document: the plan's fields, each stage with ``nodes`` and ``device_name``."""
    return plan.to_dict(problem)


def solve_command(
    graph: Annotated[Path, typer.Argument(help="Graph or problem file.")],
    format: Annotated[str, typer.Option("--format", help="auto|fxsplit|pipedream|tarnawski")] = "auto",
    devices: Annotated[int | None, typer.Option("--devices", help="N identical devices.")] = None,
    devices_file: Annotated[Path | None, typer.Option("--devices-file", help="JSON devices file.")] = None,
    solver: Annotated[str, typer.Option("--solver", help=SOLVER_HELP)] = "auto",
    objective: Annotated[str | None, typer.Option("--objective", help=f"{OBJECTIVE_HELP} (default: the problem file's, else bottleneck), or latency (Tarnawski files: one sample's latency, nodes placed on accelerators and CPUs)")] = None,
    microbatches: Annotated[int | None, typer.Option("--microbatches", help="Micro-batches per step.")] = None,
    schedule: Annotated[str | None, typer.Option("--schedule", help=PROBLEM_SCHEDULE_HELP)] = None,
    memory_limit: Annotated[str | None, typer.Option("--memory-limit", help="Bytes per device (16GiB, 1e9).")] = None,
    no_comm: Annotated[bool, typer.Option("--no-comm", help="Free communication.")] = False,
    time_limit: Annotated[float | None, typer.Option("--time-limit", help="Seconds.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    transfers: Annotated[str, typer.Option("--transfers", help="Tarnawski files: relayed (fxsplit's runtime: a value crosses every boundary between, twice in training) or direct (dp.cpp's objective: each node whose edge crosses a stage paid once by the stages it leaves and enters)")] = "relayed",
) -> None:
    """Split GRAPH into pipeline stages and print the plan."""
    from fxsplit.solvers import available_solvers, solve

    err = Console(stderr=True)
    if objective == "latency":
        _solve_latency(err, graph, format, devices=devices, devices_file=devices_file, solver=solver,
                       microbatches=microbatches, schedule=schedule, memory_limit=memory_limit, no_comm=no_comm,
                       time_limit=time_limit, as_json=as_json)
        return
    try:
        if solver not in available_solvers():
            raise ConfigError(f"unknown solver {solver!r}; available: {', '.join(available_solvers())}")
        problem = build_problem(
            load_graph_or_problem(graph, format, transfers=transfers), devices=devices, devices_file=devices_file,
            objective=objective, microbatches=microbatches, schedule=schedule, no_comm=no_comm,
            memory_limit=None if memory_limit is None else parse_bytes(memory_limit),
        )
        if err.is_terminal:  # a spinner only where someone watches (rich's status costs ~20 ms to import)
            with err.status(f"solving {problem.graph.name} with {solver}…"):
                plan = solve(problem, solver, time_limit_s=time_limit)
        else:
            plan = solve(problem, solver, time_limit_s=time_limit)
        if (format if format != "auto" else detect_format(graph)) == "tarnawski":
            _recheck_tarnawski(graph, problem, plan)
            _compare_with_their_costing(err, graph, problem, plan, communication=not no_comm)
    except InfeasibleError as exc:
        exit_with_error(err, exc, 2, "infeasible")
    except FxsplitError as exc:  # bad input (ConfigError): exit 2, as for a usage error; else 1
        exit_with_error(err, exc, 2 if isinstance(exc, ConfigError) else 1)
    if as_json:
        doc = plan_json(plan, problem)
        if problem.graph.direct or transfers != "relayed":
            doc["transfers"] = transfers
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    else:
        if problem.graph.direct:
            err.print("communication: direct transfers (dp.cpp's objective: each node whose edge crosses a stage "
                      "paid once by the stage it leaves and once by each stage it enters)", highlight=False)
        # the module, not the package: its drawing modules cost start-up
        from fxsplit.viz.tables import plan_table

        Console().print(plan_table(plan, problem))


LATENCY_SOLVERS = ("auto", "cpsat", "greedy")
"""``--solver`` under ``--objective latency``: auto and cpsat run
:func:`~fxsplit.solvers.latency.solve_latency` (CP-SAT from the best heuristic), greedy their greedy."""


def _solve_latency(err: Console, graph: Path, format: str, *, devices: int | None, devices_file: Path | None,
                   solver: str, microbatches: int | None, schedule: str | None, memory_limit: str | None,
                   no_comm: bool, time_limit: float | None, as_json: bool) -> None:
    """``fxsplit solve FILE --objective latency``: Tarnawski et al.'s latency placement of FILE,
    printed beside their baselines (all on CPUs, the greedy)."""
    from fxsplit.ir.formats import load_tarnawski_latency
    from fxsplit.solvers.latency import greedy_latency, solve_latency

    try:
        if not graph.is_file():
            raise ConfigError(f"graph file {str(graph)!r} does not exist")
        fmt = format if format != "auto" else detect_format(graph)
        if fmt != "tarnawski":
            raise ConfigError(f"--objective latency places the nodes of a Tarnawski et al. JSON file; {str(graph)!r} "
                              f"reads as {fmt}. Use --objective bottleneck or makespan for pipeline plans")
        unused = {"--devices-file": devices_file, "--microbatches": microbatches, "--schedule": schedule,
                  "--no-comm": no_comm or None}
        given = [flag for flag, value in unused.items() if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} do not apply to --objective latency (one sample through "
                              "accelerators and CPUs); use --devices N and --memory-limit for the accelerators")
        if solver not in LATENCY_SOLVERS:
            raise ConfigError(f"--objective latency is solved by {', '.join(LATENCY_SOLVERS)}, not {solver!r}")
        problem = load_tarnawski_latency(graph)
        if devices is not None:
            problem = problem.with_accelerators(devices)
        if memory_limit is not None:
            problem = problem.with_memory(parse_bytes(memory_limit))
        greedy = greedy_latency(problem)
        placement = greedy if solver == "greedy" else solve_latency(
            problem, time_limit_s=60.0 if time_limit is None else time_limit)
    except FxsplitError as exc:
        exit_with_error(err, exc, 2 if isinstance(exc, ConfigError) else 1)
    baselines = {"all on CPUs": problem.all_cpu_s(), "greedy": greedy.latency_s}
    if as_json:
        sys.stdout.write(json.dumps({**placement.to_dict(problem), "baselines": baselines}, indent=1) + "\n")
    else:
        from fxsplit.viz.tables import placement_table

        Console().print(placement_table(placement, problem, baselines))


def register(app: typer.Typer) -> None:
    """Add the ``solve`` subcommand to ``app``."""
    app.command("solve")(solve_command)
