"""Per-node strategies from DTensor (PaSE's strategy space) and the per-layer choice over them."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import fxsplit
import fxsplit.models as zoo
from fxsplit.errors import ConfigError
from fxsplit.passes.parallel_strategies import strategy_graph
from fxsplit.solvers.pase import solve_pase_cpsat, solve_pase_dp


@pytest.fixture(scope="module")
def mlp_gm():  # type: ignore[no-untyped-def]
    case = zoo.get("mlp", size="tiny", batch_size=8)
    return fxsplit.inspect(case.model, case.example_inputs).captured.gm


@pytest.mark.parametrize("mesh", [2, 4])
def test_linear_layers_get_dtensors_column_and_row_strategies(mlp_gm, mesh: int) -> None:  # type: ignore[no-untyped-def]
    found = strategy_graph(mlp_gm, mesh)
    assert not found.fallback  # every op of the MLP has a DTensor strategy
    weight = found.nodes.index("hidden_0_weight")
    assert found.parameters[weight] and {"R", "S(0)", "S(1)"} <= set(found.placements[weight])
    linear = found.nodes.index("linear")
    # batch-split (data parallel), feature-split (column-wise) and partial sums (row-wise)
    assert {"S(0)", "S(1)", "R", "P(sum)"} <= set(found.placements[linear])


@pytest.mark.parametrize("mesh", [2, 4])
def test_the_per_layer_choice_is_never_worse_than_data_parallel_or_replication(mlp_gm, mesh: int) -> None:  # type: ignore[no-untyped-def]
    found = strategy_graph(mlp_gm, mesh)
    best = solve_pase_dp(found.graph)
    assert best.cost_s <= found.graph.cost_s(found.data_parallel_choice()) + 1e-12
    assert best.cost_s <= found.graph.cost_s(found.choice_of(("R",))) + 1e-12
    exact = solve_pase_cpsat(found.graph)
    assert exact.proven and exact.cost_s == pytest.approx(best.cost_s, rel=1e-4)


def test_a_mesh_of_one_is_refused(mlp_gm) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="at least 2"):
        strategy_graph(mlp_gm, 1)


def test_strategies_cli_prints_the_parameters_and_the_baselines() -> None:
    import fxsplit.cli as cli

    cli._register_all()
    result = CliRunner().invoke(cli.app, ["strategies", "mlp", "--mesh", "2"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "hidden_0_weight" in result.output and "data parallel" in result.output
    assert "solved by pase-elimination" in result.output


def test_a_slower_link_never_makes_the_best_step_faster(mlp_gm) -> None:  # type: ignore[no-untyped-def]
    from fxsplit.ir import LinkSpec

    steps = [solve_pase_dp(strategy_graph(mlp_gm, 4, link=LinkSpec(bytes_per_s=bw, latency_s=lat)).graph).cost_s
             for bw, lat in ((1e15, 0.0), (25e9, 1e-5), (1e8, 1e-4))]
    assert steps[0] <= steps[1] <= steps[2]
    # free links: no reason left to replicate work, every node's share is 1/4
    free = strategy_graph(mlp_gm, 4, link=LinkSpec(bytes_per_s=1e15, latency_s=0.0))
    best = solve_pase_dp(free.graph)
    assert best.cost_s == pytest.approx(sum(min(o.compute_s for o in v.options) for v in free.graph.vertices), rel=1e-6)


@pytest.mark.parametrize("src, dst, expected", [
    ("R", "S(0)", 0.0), ("S(0)", "S(0)", 0.0), ("S(0)", "R", 0.75), ("P(sum)", "R", 1.5), ("P(sum)", "S(1)", 0.75),
    ("S(0)", "S(1)", 0.1875), ("S(0)", "P(sum)", float("inf")),
])
def test_ring_collectives(src: str, dst: str, expected: float) -> None:
    from fxsplit.ir import LinkSpec
    from fxsplit.passes.parallel_strategies import redistribute_s

    assert redistribute_s(src, dst, 1e9, 4, LinkSpec(bytes_per_s=1e9, latency_s=0.0)) == pytest.approx(expected)


def test_gpt_chunks_keep_their_strategies_and_outputs_follow_the_op() -> None:
    """Regression: multi-output ops (the qkv ``chunk``) had no vertex and their outputs were free
    sources, hiding the all-gathers around attention."""
    case = zoo.get("gpt", size="tiny", batch_size=8)
    gm = fxsplit.inspect(case.model, case.example_inputs).captured.gm
    found = strategy_graph(gm, 2)
    assert not found.fallback
    chunks = [v for v, name in enumerate(found.nodes) if name.startswith("chunk")]
    assert chunks and all(found.placements[v][0].startswith("(") for v in chunks)
    best = solve_pase_dp(found.graph)
    for v, parent in enumerate(found.item_of):
        if parent >= 0:
            assert found.nodes[parent].startswith("chunk") and best.choice[v] == best.choice[parent]
    for choice in (found.data_parallel_choice(), found.choice_of(("R",))):
        assert best.cost_s <= found.graph.cost_s(choice) < float("inf")


def test_family_baselines_are_restricted_solves_never_better_than_the_free_choice() -> None:
    from fxsplit.passes.parallel_strategies import megatron_placements

    case = zoo.get("gpt", size="tiny", batch_size=8)
    gm = fxsplit.inspect(case.model, case.example_inputs).captured.gm
    megatron = megatron_placements(gm)
    # attention's qkv and the MLP's up projection split by columns, their partners by rows
    assert megatron["blocks_0_attn_qkv_weight"] == {"S(0)"} and megatron["blocks_0_attn_proj_weight"] == {"S(1)"}
    assert megatron["blocks_0_mlp_0_weight"] == {"S(0)"} and megatron["blocks_0_mlp_2_weight"] == {"S(1)"}
    assert megatron["pos_emb_weight"] == {"R"} and megatron["lm_head_weight"] == {"S(0)"}  # vocab-parallel head
    found = strategy_graph(gm, 2)
    best = solve_pase_dp(found.graph)
    for family in (found.replicated_parameters(), megatron):
        allowed = found.allowing(family)
        restricted = solve_pase_dp(found.graph.restricted(allowed))
        assert all(restricted.choice[v] in keep for v, keep in allowed.items())
        assert best.cost_s <= restricted.cost_s < float("inf")
