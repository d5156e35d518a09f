"""``fxsplit solve``: options, JSON fields, table, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fxsplit.cli import _register_all, app
from fxsplit.cli.solve import parse_bytes
from fxsplit.errors import ConfigError
from fxsplit.ir import OBJECTIVES, SCHEDULES, Block, CondensedGraph, DeviceSpec, Edge, Problem

runner = CliRunner()
_register_all()


@pytest.fixture
def graph_file(tmp_path: Path) -> Path:
    blocks = tuple(Block(i, f"b{i}", (f"n{i}",), fwd_s=1.0 + i, bwd_s=1.0, param_bytes=1000,
                         activation_bytes=100, output_bytes=100) for i in range(6))
    g = CondensedGraph(blocks, tuple(Edge(i, i + 1, 100) for i in range(5)), name="six")
    path = tmp_path / "g.json"
    path.write_text(g.to_json())
    return path


def test_json_output_fields(graph_file: Path) -> None:
    res = runner.invoke(app, ["solve", str(graph_file), "--devices", "3", "--solver", "dp", "--json",
                              "--objective", "makespan", "--microbatches", "4", "--schedule", "gpipe"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    for key in ("solver", "status", "bottleneck_s", "objective_s", "lower_bound_s", "solve_time_s", "stages"):
        assert key in doc
    assert doc["solver"] == "dp" and doc["status"] == "optimal" and doc["objective"] == "makespan"
    for st in doc["stages"]:
        assert {"device", "nodes", "compute_s", "comm_s", "memory_bytes"} <= set(st)
    assert sorted(n for st in doc["stages"] for n in st["nodes"]) == [f"n{i}" for i in range(6)]


def test_table_output_and_no_comm(graph_file: Path) -> None:
    res = runner.invoke(app, ["solve", str(graph_file), "--devices", "2", "--no-comm", "--solver", "uniform"])
    assert res.exit_code == 0, res.output
    assert "uniform" in res.stdout and "stage" in res.stdout


def test_devices_file_and_memory_limit(graph_file: Path, tmp_path: Path) -> None:
    devs = tmp_path / "devs.json"
    devs.write_text(json.dumps({"devices": [{"name": "fast", "speed": 4.0}, {"name": "slow"}],
                                "device_order": "free"}))
    res = runner.invoke(app, ["solve", str(graph_file), "--devices-file", str(devs), "--json",
                              "--memory-limit", "1MiB", "--time-limit", "10"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert {st["device_name"] for st in doc["stages"]} <= {"fast", "slow"}


def test_infeasible_exit_code_and_message(graph_file: Path) -> None:
    res = runner.invoke(app, ["solve", str(graph_file), "--devices", "2", "--memory-limit", "2000"])
    assert res.exit_code == 2
    assert "infeasible" in res.output and "over" in res.output


def test_config_errors(graph_file: Path) -> None:
    res = runner.invoke(app, ["solve", str(graph_file)])
    assert res.exit_code == 2 and "--devices" in res.output
    res = runner.invoke(app, ["solve", str(graph_file), "--devices", "2", "--solver", "magic"])
    assert res.exit_code == 2 and "unknown solver" in res.output


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b'{"blocks": [', "not valid JSON: Expecting value at line 1"),
        (bytes(range(128, 256)), "not a text file"),
        (b"[1, 2]", "an object at the top level, not a list"),
        (b'{"blocks": [{"id": 0, "name": "a", "fwd_s": "x"}]}', "not a valid fxsplit file"),
        (b'{"maxSizePerFPGA": 10, "maxFPGAs": 2, "nodes": [{"fpgaLatency": 1}], "edges": []}',
         "not a valid tarnawski file: KeyError: 'id'"),
        (b'{"maxSizePerFPGA": 10, "maxFPGAs": 2, "nodes": [{"id": 0, "fpgaLatency": 1}], '
         b'"edges": [{"sourceId": 0, "destId": 7, "cost": 1}]}', "not a valid tarnawski file: KeyError: 7"),
    ],
)
def test_a_broken_graph_file_is_an_error_not_a_traceback(tmp_path: Path, content: bytes, match: str) -> None:
    """Issue 10: truncated JSON, binary files, a list at top level, a string number, Tarnawski
    nodes without id or edges to unknown nodes gave raw tracebacks; now exit 2 with the file."""
    path = tmp_path / "broken.json"
    path.write_bytes(content)
    res = runner.invoke(app, ["solve", str(path), "--devices", "2"])
    assert res.exit_code == 2, res.output
    assert "broken.json" in res.output and match in " ".join(res.output.split()), res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


def test_problem_file_keeps_its_devices(tmp_path: Path) -> None:
    pb = Problem(CondensedGraph.chain([1.0, 1.0, 1.0]), (DeviceSpec("x"), DeviceSpec("y")))
    path = tmp_path / "p.json"
    path.write_text(pb.to_json())
    res = runner.invoke(app, ["solve", str(path), "--json", "--format", "fxsplit"])
    assert res.exit_code == 0, res.output
    assert {st["device_name"] for st in json.loads(res.stdout)["stages"]} == {"x", "y"}


def test_parse_bytes() -> None:
    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("1e9") == 10**9 and parse_bytes("500 MB") == 5 * 10**8
    with pytest.raises(ConfigError):
        parse_bytes("lots")


def _names_in(text: str) -> set[str]:
    """Every schedule- or solver-like word of a help text (``interleaved-1f1b`` whole, not ``1f1b``)."""
    return set(re.findall(r"[\w-]+", text))


@pytest.mark.parametrize("command", ["solve", "compile", "plan"])
def test_help_lists_every_registered_solver_and_schedule(command: str) -> None:
    from fxsplit.schedule import available
    from fxsplit.solvers import available_solvers

    res = runner.invoke(app, [command, "--help"], env={"COLUMNS": "300", "NO_COLOR": "1"})
    assert res.exit_code == 0, res.output
    words = _names_in(res.output)
    assert set(available_solvers()) <= words, f"--solver help misses {set(available_solvers()) - words}"
    assert set(available()) <= words, f"--schedule help misses {set(available()) - words}"
    assert set(SCHEDULES) <= words and set(OBJECTIVES) <= words


def test_solve_takes_every_schedule_its_help_lists(graph_file: Path) -> None:
    for schedule in SCHEDULES:
        res = runner.invoke(app, ["solve", str(graph_file), "--devices", "2", "--microbatches", "4", "--json",
                                  "--schedule", schedule])
        assert res.exit_code == 0, (schedule, res.output)
        assert json.loads(res.stdout)["schedule"] == schedule


def test_a_command_loads_only_its_own_module(graph_file: Path) -> None:
    """Start-up (issue 14): ``fxsplit solve`` registers and imports the solve command alone, not
    the torch-side commands (compile, inspect, plan, sweep, strategies), and never torch; on a
    graph the DP solves, nothing heavy it does not use (OR-Tools, the CP-SAT model, pydantic,
    matplotlib, rich's spinner off a terminal)."""
    import subprocess
    import sys

    heavy = ["torch", "ortools", "fxsplit.solvers.cpsat", "pydantic", "matplotlib", "rich.status"]
    code = ("import sys; from fxsplit.cli import main; sys.argv = ['fxsplit', 'solve', sys.argv[1], '--devices', '2']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            f"print([m for m in {heavy!r} if m in sys.modules])\n"
            "print(sorted(m for m in sys.modules if m.startswith('fxsplit.cli.')))")
    out = subprocess.run([sys.executable, "-c", code, str(graph_file)], capture_output=True, text=True, check=True)
    loaded, last = out.stdout.strip().splitlines()[-2:]
    assert loaded == "[]" and "fxsplit.cli.solve" in last, out.stdout[-2000:] + out.stderr[-2000:]
    assert not any(f"fxsplit.cli.{name}'" in last for name in ("compile", "inspect", "plan", "sweep", "strategies")), last
