"""``fxsplit inspect`` and ``fxsplit.inspect``: tables, dumps, the DOT file, readable reprs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import fxsplit
from fxsplit.api import Inspection, load_model
from fxsplit.errors import CaptureError, ConfigError
from fxsplit.ir import DeviceSpec

DEVICE = DeviceSpec("ref", peak_flops=1e12, memory_bandwidth_bytes_per_s=1e11)
WIDE = {"COLUMNS": "200"}  # rich wraps tables to the terminal; keep node names whole


@pytest.fixture(scope="module")
def app():  # type: ignore[no-untyped-def]
    import fxsplit.cli as cli

    cli._register_all()
    return cli.app


def test_inspect_gpt_prints_tables_and_dumps_every_pass(app, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    dump = tmp_path / "dump"
    result = CliRunner().invoke(app, ["inspect", "gpt", "--dump", str(dump), "--limit", "500"], env=WIDE)
    assert result.exit_code == 0, result.output
    out = result.output

    assert "annotated graph" in out and "Condensed(" in out
    for column in ("node", "op", "shape", "FLOPs", "fwd", "bwd", "params", "block"):
        assert column in out
    assert "scaled_dot_product_attention" in out or "matmul" in out  # attention nodes listed
    assert re.search(r"Inspection\('gpt': \d+ nodes via export", out)
    assert "propagate_shapes" in out and "annotate_costs" in out and "condense_antichains" in out

    files = sorted(p.name for p in dump.iterdir())
    assert [f for f in files if f.endswith(".txt")] == [
        "000_captured.txt",
        "001_propagate_shapes.txt",
        "002_annotate_costs.txt",
        "003_condense_antichains.txt",
    ]
    assert "condensed.dot" in files
    dot = (dump / "condensed.dot").read_text()
    assert dot.startswith('digraph "gpt" {') and dot.rstrip().endswith("}")
    blocks = re.findall(r"^\s+b(\d+) \[label=", dot, flags=re.M)
    assert len(blocks) > 10 and len(set(re.findall(r'fillcolor="([^"]+)"', dot))) > 1  # coloured by block
    assert re.search(r"^\s+b\d+ -> b\d+ \[label=", dot, flags=re.M)
    assert "fxsplit.block" in (dump / "003_condense_antichains.txt").read_text()


def test_inspect_symbolic_trace_method(app) -> None:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(app, ["inspect", "mlp", "--method", "symbolic_trace"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "via symbolic_trace" in result.output


def test_inspect_unknown_model_exits_nonzero_with_clear_message(app) -> None:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(app, ["inspect", "no_such_model"], env=WIDE)
    assert result.exit_code != 0
    assert "unknown model 'no_such_model'" in result.output
    assert "gpt" in result.output  # names the known ones
    assert "Traceback" not in result.output


def test_inspect_dump_to_a_folder_it_cannot_write_says_so(app, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Issue 10: ``inspect --dump`` into an unwritable place was a raw traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = CliRunner().invoke(app, ["inspect", "mlp", "--dump", str(blocker / "dump")], env=WIDE)
    assert result.exit_code == 2 and "cannot write the dump to" in " ".join(result.output.split())
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_compile_with_zero_steps_is_a_usage_error(app) -> None:  # type: ignore[no-untyped-def]
    """Issue 10: ``fxsplit compile --steps 0`` crashed with an IndexError in the summary."""
    result = CliRunner().invoke(app, ["compile", "mlp", "--devices", "2", "--steps", "0"], env=WIDE)
    assert result.exit_code == 2 and "--steps" in result.output


def test_inspect_bad_method_exits_nonzero(app) -> None:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(app, ["inspect", "mlp", "--method", "jit"], env=WIDE)
    assert result.exit_code != 0
    assert "method='jit' is unknown" in result.output


def test_inspect_limit_caps_the_node_table(app) -> None:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(app, ["inspect", "gpt", "--limit", "5"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert re.search(r"\d+ more nodes not shown", result.output)


# ---------------------------------------------------------------- the Python API


def test_python_inspect_returns_objects_with_readable_repr(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ins = fxsplit.inspect(model, (torch.randn(2, 8),), device=DEVICE, dump_dir=tmp_path)

    assert isinstance(ins, Inspection)
    text = repr(ins)
    assert re.fullmatch(
        r"Inspection\('Sequential': \d+ nodes via export, [\d.]+ MiB params, \d+ blocks, "
        r"\d+ downsets, fwd\+bwd [\d.]+ ms on ref\)",
        text,
    ), text
    assert len(text) < 200 and "\n" not in text
    assert re.fullmatch(r"Condensed\('Sequential': \d+ blocks, \d+ edges, \d+ downsets\)", repr(ins.condensed))
    assert repr(ins.captured).startswith("Captured(method='export', nodes=")
    assert ins.condensed.graph.total_param_bytes == 4 * sum(p.numel() for p in model.parameters())
    assert [r.name for r in ins.records] == ["propagate_shapes", "annotate_costs", "condense_antichains"]
    rows = ins.node_rows()
    assert {r["node"] for r in rows} == set(ins.condensed.node_block)
    assert all(r["block"] is not None for r in rows)
    assert (tmp_path / "condensed.dot").exists()


def test_python_inspect_by_zoo_name() -> None:
    ins = fxsplit.inspect("resnet", device=DEVICE, method="symbolic_trace")
    assert ins.name == "resnet" and ins.captured.method == "symbolic_trace"
    assert "Inspection('resnet'" in repr(ins)


def test_python_inspect_needs_example_inputs_for_a_module() -> None:
    with pytest.raises(ConfigError, match="needs example_inputs"):
        fxsplit.inspect(nn.Linear(2, 2))


def test_python_inspect_propagates_capture_errors() -> None:
    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.max() > 0:
                return x * 2
            return x

    with pytest.raises(CaptureError, match="x.max"):
        fxsplit.inspect(Branchy(), (torch.randn(2),), device=DEVICE)


def make_tiny() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A ``module:function`` target for :func:`load_model`."""
    return nn.Linear(3, 3), (torch.randn(2, 3),)


def test_load_model_from_module_function() -> None:
    case = load_model("test_inspect_cli:make_tiny")
    assert isinstance(case.model, nn.Linear) and case.example_inputs[0].shape == (2, 3)
    # issue 15: make_batch ignored its batch size and seed (always the example itself)
    (x5,), y5 = case.make_batch(5, 0)
    assert x5.shape == (5, 3) and y5.shape == (5, 3)
    assert torch.equal(case.make_batch(5, 0)[0][0], x5)
    assert not torch.equal(case.make_batch(5, 1)[0][0], x5)
    assert all(any(torch.equal(row, ex) for ex in case.example_inputs[0]) for row in x5)  # the example's rows
    with pytest.raises(ConfigError, match="module:function"):
        load_model("no_such_module_xyz:fn")


@pytest.mark.hf
def test_load_model_refuses_a_size_for_hugging_face_models() -> None:
    # Regression: load_model called zoo.hf directly and dropped ``size``, so
    # ``fxsplit inspect hf:llama --size base`` silently inspected the tiny model. It now goes
    # through zoo.get, which refuses sizes for hf: names and points to preset=.
    pytest.importorskip("transformers")
    assert load_model("hf:gpt2").name == "hf:gpt2"
    with pytest.raises(ConfigError, match="size='base' applies to zoo models only"):
        load_model("hf:llama", size="base")
