"""Symbolic costs (issue 13, item 5): each block's costs as formulas of the batch size (and of
the sequence length), checked against concrete captures and annotations at three sizes."""

from __future__ import annotations

import dataclasses
import math

import pytest
import sympy
import torch
from torch import nn
from typer.testing import CliRunner

import fxsplit.models as zoo
from fxsplit.api import analyze
from fxsplit.errors import ConfigError
from fxsplit.ir import DeviceSpec
from fxsplit.passes.symbolic import (
    BATCH,
    SEQ,
    BlockFormulas,
    block_formulas,
    graph_at,
    symbolic_node_costs,
)

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
    case, ins = _analyze("mlp", 1)
    flat = ins.captured.flatten_inputs(tuple(case.example_inputs), {})
    with pytest.raises(ConfigError, match=r"no cost depends on the batch size.*batch of at least 2"):
        symbolic_node_costs(ins.captured.gm, flat, None, A100)


# -- the sequence length as a second symbol ----------------------------------------------------
def _annotate(case, captured=None):  # type: ignore[no-untyped-def]
    """``case`` annotated at its example's ``[batch, seq]``: on ``captured`` (a graph with a
    symbolic batch and length), else on a fresh capture with both fixed."""
    from fxsplit.frontend import front_end
    from fxsplit.options import CompileOptions

    if captured is None:
        return analyze(case.model, case.example_inputs, case.example_kwargs, device=A100).condensed.graph
    return front_end(case.model, case.example_inputs, dict(case.example_kwargs or {}), reference=A100,
                     cost_model="analytic", options=CompileOptions(dynamic_batch=True), captured=captured)


@pytest.mark.parametrize(("name", "config", "example"), [
    ("gpt", {"layers": 1}, (4, 4)),  # a batch equal to the length: still two symbols
    pytest.param("hf:bert", {"num_hidden_layers": 1}, (4, 8), marks=pytest.mark.hf),  # attention_mask [b, s] too
])
def test_formulas_of_batch_and_length_equal_concrete_annotations(name: str, config: dict[str, int],
                                                                 example: tuple[int, int]) -> None:
    from fxsplit.passes.capture import capture

    if name.startswith("hf:"):
        pytest.importorskip("transformers")
    case = zoo.get(name, batch_size=example[0], seq_len=example[1], **config)
    captured = capture(case.model, case.example_inputs, case.example_kwargs, dynamic_batch=True, seq_dim=1)
    graph = _annotate(case, captured).condensed.graph
    nodes = symbolic_node_costs(captured.gm, None, captured.batched_inputs, A100, seq_dim=1)
    formulas = block_formulas(captured.gm, graph, nodes)
    assert nodes.seq_len == example[1] and all(f.seq_len == example[1] for f in formulas)
    assert any({BATCH, SEQ} <= f.fields["flops"].free_symbols for f in formulas)  # b*s (and b*s**2: attention)
    # no seq: the captured length
    assert graph_at(graph, formulas, example[0]) == graph_at(graph, formulas, example[0], seq=example[1])
    for batch, seq in ((2, 5), (3, 12), (6, 6)):
        other = zoo.get(name, batch_size=batch, seq_len=seq, **config)
        instantiated = graph_at(graph, formulas, batch, seq=seq)
        # block by block: the same graph annotated at [batch, seq] (concrete shapes)
        concrete = _annotate(other, captured).condensed.graph
        assert [b.nodes for b in concrete.blocks] == [b.nodes for b in graph.blocks]
        for got, want in zip(instantiated.blocks, concrete.blocks, strict=True):
            for field in ("flops", "fwd_s", "bwd_s", "bwd_weight_s"):
                assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-9, abs=1e-15), (batch, seq, field)
            for field in ("activation_bytes", "output_bytes", "param_bytes"):
                assert getattr(got, field) == getattr(want, field), (batch, seq, got.name, field)
        assert instantiated.edges == concrete.edges
        # a fresh capture with the batch and length fixed (its own nodes and blocks): the same totals
        static = _annotate(other)
        for field in ("flops", "fwd_s", "bwd_s", "activation_bytes", "param_bytes"):
            want = sum(getattr(b, field) for b in static.blocks)
            assert sum(getattr(b, field) for b in instantiated.blocks) == pytest.approx(want, rel=1e-9), (batch, seq, field)


class _FixedPositions(nn.Module):
    """Adds a whole position table ``[6, 8]``: the model fixes the length to 6."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(10, 8), nn.Parameter(torch.zeros(6, 8))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.emb(tokens) + self.pos


def test_a_model_that_fixes_its_length_is_refused_with_the_line_and_the_fix() -> None:
    from fxsplit.passes.capture import capture

    tokens = torch.zeros(3, 6, dtype=torch.long)
    with pytest.raises(ConfigError, match=r"fixed the sequence length \(dim 1 .* 6 in the example\) at node 'add' "
                                          r"\(File .*test_symbolic.py.*self.emb\(tokens\) \+ self.pos\).*Fix:"):
        capture(_FixedPositions(), (tokens,), dynamic_batch=True, seq_dim=1)
    with pytest.raises(ConfigError, match="needs capture by torch.export with a symbolic batch"):
        capture(_FixedPositions(), (tokens,), seq_dim=1)
    with pytest.raises(ConfigError, match="the first input has no dimension 2"):
        capture(_FixedPositions(), (tokens,), dynamic_batch=True, seq_dim=2)


def test_a_length_baked_into_the_graph_is_refused_naming_the_node() -> None:
    """A graph captured without seq_dim has ``arange(16)``: formulas of s would be wrong at any
    other length, so asking for them names the node that fixes it."""
    case = zoo.get("gpt", batch_size=4, layers=1)
    ins = analyze(case.model, case.example_inputs, device=A100)
    with pytest.raises(ConfigError, match=r"node 'add' \(File .*gpt.py.*\) fixes the sequence length to 16.*seq_dim=1"):
        symbolic_node_costs(ins.captured.gm, None, None, A100, seq_dim=1)
    with pytest.raises(ConfigError, match="seq_dim=0; pass the sequence dimension"):
        symbolic_node_costs(ins.captured.gm, None, None, A100, seq_dim=0)


def test_a_length_asked_of_formulas_of_the_batch_only_is_refused() -> None:
    formulas = BlockFormulas(0, "linear", {"flops": 6 * BATCH}, {})
    assert formulas.at(3) == {"flops": 18.0}
    with pytest.raises(ConfigError, match=r"seq=64 asked of block 0 \(linear\).*seq_dim"):
        formulas.at(3, seq=64)


def tiny_gpt() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A ``module:function`` target for the CLI: a one-layer GPT and tokens ``[2, 8]``."""
    case = zoo.get("gpt", batch_size=2, seq_len=8, layers=1)
    return case.model, tuple(case.example_inputs)


def test_inspect_prints_formulas_of_the_length() -> None:
    import fxsplit.cli as cli

    cli._register_all()
    result = CliRunner().invoke(cli.app, ["inspect", "test_symbolic:tiny_gpt", "--seq-dim", "1", "--limit", "1"],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "sequence length s (captured: 8)" in result.output and "b*s**2" in result.output  # attention scores
    result = CliRunner().invoke(cli.app, ["inspect", "mlp", "--seq-dim", "1"], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "fixed the sequence length" in result.output, result.output


# --- the micro-batch search evaluates the formulas (issue 13, item 5) ---


def test_graphs_at_equals_graph_at() -> None:
    """The compiled (lambdify) evaluation is the substituting one, at whole and odd sizes."""
    from fxsplit.passes.symbolic import graphs_at

    case, ins = _analyze("gpt", 4)
    formulas = block_formulas(ins.captured.gm, ins.condensed.graph,
                              symbolic_node_costs(ins.captured.gm, None, ins.captured.batched_inputs, A100),
                              simplify=False)
    for batch, fast in zip((1, 3, 7), graphs_at(ins.condensed.graph, formulas, (1, 3, 7)), strict=True):
        slow = graph_at(ins.condensed.graph, formulas, batch)
        assert fast.edges == slow.edges
        for a, b in zip(fast.blocks, slow.blocks, strict=True):
            assert (a.activation_bytes, a.output_bytes, a.param_bytes) == (b.activation_bytes, b.output_bytes, b.param_bytes)
            assert (a.flops, a.fwd_s, a.bwd_s) == pytest.approx((b.flops, b.fwd_s, b.bwd_s), rel=1e-12)


def test_micro_batch_costs_are_the_formulas_at_the_micro_batch_not_a_linear_share() -> None:
    """On an A100 a one-sample micro-batch of a wide MLP still reads every weight: its costs are
    what an annotation at that size gives (the formulas), far more than a linear share."""
    from fxsplit.frontend import front_end
    from fxsplit.options import CompileOptions

    dev = A100.with_(op_overhead_s=0.0)
    case = zoo.get("mlp", size="small", batch_size=8)
    whole = front_end(case.model, case.example_inputs, {}, reference=dev, cost_model="analytic",
                      options=CompileOptions()).condensed.graph
    assert {1 / 8, 1 / 4, 1 / 2} <= {round(f, 9) for f, _ in whole.microbatch_graphs}  # each count up to the batch
    case_2 = zoo.get("mlp", size="small", batch_size=2)  # (export fixes a batch of 1 as a constant)
    at_2 = front_end(case_2.model, case_2.example_inputs, {}, reference=dev, cost_model="analytic",
                     options=CompileOptions()).condensed.graph
    got = whole.scaled(2 / 8)
    for a, b in zip(got.blocks, at_2.blocks, strict=True):
        # a micro-batch of 4 also adds its gradients into the step's (3 of 4 do): the batch of 2 alone does not
        assert a.grad_accumulate_s == pytest.approx(b.grad_accumulate_s, rel=1e-12)
        assert (a.fwd_s, a.bwd_s - 0.75 * a.grad_accumulate_s, a.flops) == pytest.approx((b.fwd_s, b.bwd_s, b.flops), rel=1e-9)
        assert (a.activation_bytes, a.output_bytes) == (b.activation_bytes, b.output_bytes)
    plain = dataclasses.replace(whole, microbatch_graphs=())  # linear scaling of the whole batch's costs
    assert sum(b.fwd_s for b in got.blocks) > 1.5 * sum(b.fwd_s for b in plain.scaled(2 / 8).blocks)
    off = front_end(case.model, case.example_inputs, {}, reference=dev, cost_model="analytic",
                    options=CompileOptions(symbolic_costs=False)).condensed.graph
    assert off.microbatch_graphs == () and off.scaled(2 / 8) == plain.scaled(2 / 8)


def test_a_count_that_does_not_divide_the_batch_has_formula_costs_for_solvers_and_search() -> None:
    """Review finding: the table held ``ceil(batch / m)`` (the schedule search's size) only, so
    the solvers' ``1 / m`` share of a batch of 10 in 4 micro-batches scaled linearly."""
    from fxsplit.frontend import front_end
    from fxsplit.options import CompileOptions

    case = zoo.get("mlp", size="small", batch_size=10)
    graph = front_end(case.model, case.example_inputs, {}, reference=A100.with_(op_overhead_s=0.0),
                      cost_model="analytic", options=CompileOptions(), microbatches=4).condensed.graph
    assert sorted(round(f, 9) for f, _ in graph.microbatch_graphs) == [0.25, 0.3]  # 2.5 samples (mean) and 3 (largest)
    plain = dataclasses.replace(graph, microbatch_graphs=())
    for fraction in (0.25, 0.3):
        assert sum(b.fwd_s for b in graph.scaled(fraction).blocks) > 1.5 * sum(b.fwd_s for b in plain.scaled(fraction).blocks)


def test_a_graph_exported_at_a_fixed_batch_skips_the_symbolic_run(monkeypatch) -> None:
    """Re-read finding: ``fxsplit plan`` exported at a fixed batch, and the front end ran the whole
    symbolic propagation only to learn that no cost depends on the batch."""
    import fxsplit.passes.symbolic as symbolic
    from fxsplit.frontend import front_end
    from fxsplit.options import CompileOptions

    monkeypatch.setattr(symbolic, "symbolic_node_costs", lambda *a, **k: pytest.fail("symbolic run on a fixed batch"))
    case = zoo.get("mlp", size="tiny", batch_size=8)
    graph = front_end(case.model, case.example_inputs, {}, reference=A100, cost_model="analytic",
                      options=CompileOptions(dynamic_batch=False, capture_method="export")).condensed.graph
    assert graph.microbatch_graphs == ()


class _Regroup(nn.Module):
    """``x.reshape(-1, k)`` before a linear: the symbolic batch enters through ``FloorDiv``."""

    def __init__(self, width: int, k: int) -> None:
        super().__init__()
        self.k, self.lin = k, nn.Linear(k, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x.reshape(-1, self.k))).reshape(x.shape[0], -1)


def test_formulas_with_torch_integer_functions_evaluate_at_whole_and_fractional_sizes() -> None:
    """Regression: a ``reshape(-1, k)`` put ``FloorDiv`` in the formulas, which neither
    ``lambdify`` nor ``float`` could evaluate, and ``compile`` failed in the front end with a
    TypeError. The compiled evaluation equals the substituting one at whole sizes, and gives the
    Python value at the solvers' fractional mean micro-batch."""
    from fxsplit.frontend import front_end
    from fxsplit.options import CompileOptions
    from fxsplit.passes.symbolic import graphs_at

    model = nn.Sequential(_Regroup(1024, 2048), _Regroup(1024, 256))  # two rows per sample: FloorDiv(b, 2)
    x = torch.randn(16, 1024)
    ins = front_end(model, (x,), {}, reference=A100, cost_model="analytic", options=CompileOptions(), microbatches=3)
    graph = ins.condensed.graph
    assert sorted(round(f, 6) for f, _ in graph.microbatch_graphs) == [round(16 / 3 / 16, 6), round(6 / 16, 6)]
    formulas = block_formulas(ins.captured.gm, graph,
                              symbolic_node_costs(ins.captured.gm, None, ins.captured.batched_inputs, A100),
                              simplify=False)
    from torch.utils._sympy.functions import FloorDiv

    assert any(sympy.sympify(v).has(FloorDiv) for f in formulas for v in f.fields.values())
    for batch, fast in zip((2, 6), graphs_at(graph, formulas, (2, 6)), strict=True):
        slow = graph_at(graph, formulas, batch)
        assert [b.flops for b in fast.blocks] == pytest.approx([b.flops for b in slow.blocks], rel=1e-12)
    at_6 = sum(b.flops for b in graph_at(graph, formulas, 6).blocks)
    assert at_6 == pytest.approx(6 / 16 * sum(b.flops for b in graph.blocks), rel=1e-9)
    fractional, one = graphs_at(graph, formulas, (16 / 3, 1))
    assert fractional is not None and all(math.isfinite(b.flops) and b.flops >= 0 for b in fractional.blocks)
    assert one is None  # one sample is 1024 elements: reshape(-1, 2048) cannot take it, the formula divides by 0
