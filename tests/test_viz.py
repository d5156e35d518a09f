"""Pictures: plans, Gantt charts and pipelines are written as non-empty PNG/SVG files; the plan CLI."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from pipeline_utils import Compiled  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import fxsplit.models as zoo  # noqa: E402
from fxsplit import viz  # noqa: E402
from fxsplit.cli import _register_all, app  # noqa: E402
from fxsplit.errors import ConfigError  # noqa: E402
from fxsplit.ir import CondensedGraph, DeviceSpec, Problem, evaluate  # noqa: E402
from fxsplit.schedule import make, simulate  # noqa: E402


@pytest.fixture(scope="module")
def trained() -> tuple[object, Compiled]:
    compiled = Compiled(zoo.get("gpt", layers=1))
    pipe = compiled.pipeline(2, "gpipe", 2)
    inputs, target = compiled.case.make_batch(2, seed=0)
    pipe.train_step(*inputs, target=target, loss_fn=compiled.case.loss_fn)
    return pipe, compiled


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_draw_plan_writes_a_picture(tmp_path, suffix) -> None:
    pb = Problem(CondensedGraph.chain([1.0, 2.0, 3.0, 1.0]), (DeviceSpec("a"), DeviceSpec("b")))
    out = viz.draw_plan(evaluate(pb, [[0, 1], [2, 3]]), pb.graph, tmp_path / f"plan.{suffix}", device_names=["a", "b"])
    assert out.exists() and out.stat().st_size > 1000


def test_draw_plan_refuses_a_plan_of_another_graph(tmp_path) -> None:
    pb = Problem(CondensedGraph.chain([1.0, 2.0]), (DeviceSpec("a"),))
    with pytest.raises(ConfigError, match="does not cover"):
        viz.draw_plan(evaluate(pb, [[0, 1]]), CondensedGraph.chain([1.0, 2.0, 3.0]), tmp_path / "x.png")


def test_gantt_predicted_only(tmp_path) -> None:
    out = viz.gantt(simulate(make("1f1b", 3, 4), [1.0] * 3, [2.0] * 3), tmp_path / "g.svg")
    assert out.read_text().startswith("<?xml")


def test_gantt_predicted_and_measured(trained, tmp_path) -> None:
    pipe, _ = trained
    timeline = simulate(pipe.schedule, [1e-3] * 2, [2e-3] * 2)
    trace = pipe.trace(tmp_path / "trace.json")
    for measured in (pipe.recorder, trace, pipe):
        out = viz.gantt(timeline, tmp_path / "g.png", measured=measured, title="t")
        assert out.read_bytes()[:4] == b"\x89PNG"


def test_draw_pipeline_with_and_without_graph(trained, tmp_path) -> None:
    pipe, compiled = trained
    assert viz.draw_pipeline(pipe, tmp_path / "p.png").stat().st_size > 1000
    assert viz.draw_pipeline(pipe, tmp_path / "q.png", graph=compiled.condensed.graph).stat().st_size > 1000


def test_missing_matplotlib_raises_config_error_with_the_pip_command(monkeypatch, tmp_path) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ConfigError, match="pip install"):
        viz.gantt(simulate(make("gpipe", 2, 2), [1.0] * 2, [1.0] * 2), tmp_path / "g.png")


# -- fxsplit plan MODEL --devices N --draw out.svg ---------------------------------------------

def test_plan_cli_prints_stages_and_draws(tmp_path) -> None:
    _register_all()
    draw, gantt, plan = tmp_path / "out.svg", tmp_path / "g.png", tmp_path / "plan.json"
    result = CliRunner().invoke(app, [
        "plan", "mlp", "--size", "tiny", "--devices", "2", "--device", "a100", "--batch-size", "4",
        "--draw", str(draw), "--gantt", str(gantt), "--json", str(plan),
    ])
    assert result.exit_code == 0, result.output
    assert "stage" in result.output and "schedule:" in result.output
    assert draw.stat().st_size > 0 and gantt.stat().st_size > 0
    assert len(json.loads(plan.read_text())["stages"]) >= 1


def test_plan_cli_reports_bad_arguments() -> None:
    _register_all()
    result = CliRunner().invoke(app, ["plan", "mlp", "--solver", "nope"])
    assert result.exit_code == 2
    assert "unknown" in result.output
