"""Symbolic costs (issue 13, item 5): each block's costs as formulas of the batch size, checked
against concrete captures and annotations at three sizes."""

from __future__ import annotations

import pytest
import sympy
from typer.testing import CliRunner

import fxsplit.models as zoo
from fxsplit.api import analyze
from fxsplit.ir import DeviceSpec
from fxsplit.passes.symbolic import BATCH, block_formulas, graph_at, symbolic_node_costs

A100 = DeviceSpec.preset("a100")


def _analyze(name: str, batch: int):
    case = zoo.get(name, size="tiny", batch_size=batch)
    return case, analyze(case.model, case.example_inputs, device=A100, name=name)


@pytest.mark.parametrize("name", ["gpt", "mlp", "unet"])
def test_formulas_equal_concrete_annotations_at_three_batch_sizes(name: str) -> None:
    case, ins = _analyze(name, 4)
    flat = ins.captured.flatten_inputs(tuple(case.example_inputs), {})
    formulas = block_formulas(ins.captured.gm, ins.condensed.graph,
                              symbolic_node_costs(ins.captured.gm, flat, None, A100))
    assert any(BATCH in f.fields["flops"].free_symbols for f in formulas)  # the work grows with the batch
    for batch in (2, 5, 8):
        concrete = _analyze(name, batch)[1].condensed.graph
        assert [b.nodes for b in concrete.blocks] == [b.nodes for b in ins.condensed.graph.blocks]
        instantiated = graph_at(ins.condensed.graph, formulas, batch)
        for got, want in zip(instantiated.blocks, concrete.blocks, strict=True):
            for field in ("flops", "fwd_s", "bwd_s", "bwd_weight_s"):
                assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-9, abs=1e-15), (batch, field)
            for field in ("activation_bytes", "output_bytes", "param_bytes"):
                assert getattr(got, field) == getattr(want, field), (batch, got.name, field)
        assert instantiated.edges == concrete.edges


def test_the_annotated_graph_keeps_its_own_shapes() -> None:
    case, ins = _analyze("mlp", 4)
    before = {n.name: n.meta.get("val") for n in ins.captured.gm.graph.nodes}
    symbolic_node_costs(ins.captured.gm, ins.captured.flatten_inputs(tuple(case.example_inputs), {}), None, A100)
    assert {n.name: n.meta.get("val") for n in ins.captured.gm.graph.nodes} == before


def test_a_linear_layer_reads_as_the_textbook_formula() -> None:
    case, ins = _analyze("mlp", 4)
    nodes = symbolic_node_costs(ins.captured.gm, ins.captured.flatten_inputs(tuple(case.example_inputs), {}), None, A100)
    linear = next(n for n in ins.captured.gm.graph.nodes if n.name.startswith("linear"))
    w = linear.args[1].meta["val"]  # [out, in]
    assert sympy.simplify(nodes[linear.name]["flops"] - 2 * w.shape[0] * w.shape[1] * BATCH) == 0


def test_inspect_prints_the_formulas() -> None:
    import fxsplit.cli as cli

    cli._register_all()
    result = CliRunner().invoke(cli.app, ["inspect", "mlp", "--size", "tiny", "--symbolic"])
    assert result.exit_code == 0, result.output
    assert "b" in result.output and "flops" in result.output


def test_a_graph_whose_costs_do_not_depend_on_the_batch_is_refused_with_the_fix() -> None:
    """Review finding: at an example batch of 1 every formula came out a constant (export fixes a
    batch of 1) and graph_at silently returned batch-1 costs at any size."""
    from fxsplit.errors import ConfigError

    case, ins = _analyze("mlp", 1)
    flat = ins.captured.flatten_inputs(tuple(case.example_inputs), {})
    with pytest.raises(ConfigError, match=r"no cost depends on the batch size.*batch of at least 2"):
        symbolic_node_costs(ins.captured.gm, flat, None, A100)
