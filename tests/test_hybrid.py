"""Hybrid plans: [pp, dp, tp] meshes with per-layer strategies (PaSE) and stage replication (PipeDream)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import condensed_graphs
from typer.testing import CliRunner

import fxsplit
import fxsplit.models as zoo
from fxsplit.api import Inspection, analyze
from fxsplit.errors import ConfigError, InfeasibleError
from fxsplit.ir import Block, CondensedGraph, DeviceSpec, LinkSpec, Problem
from fxsplit.solvers import solve
from fxsplit.solvers.data_parallel import data_parallel
from fxsplit.solvers.hybrid import LayerParallelCosts, mesh_shapes, plan_hybrid

GiB = 2**30
LINK = LinkSpec(bytes_per_s=2.0**20, latency_s=0.25)


def _problem(graph: CondensedGraph, n: int, m: int, memory: int = 2**40, schedule: str = "1f1b") -> Problem:
    return Problem(graph, tuple(DeviceSpec(f"d{i}", memory_bytes=memory) for i in range(n)), link=LINK,
                   microbatches=m, schedule=schedule, objective="makespan")  # type: ignore[arg-type]


@given(st.integers(1, 64), st.one_of(st.none(), st.integers(1, 8)))
def test_mesh_shapes_are_every_factorisation_of_every_divisor(n: int, max_tp: int | None) -> None:
    shapes = mesh_shapes(n, max_tp=max_tp)
    assert len(set(shapes)) == len(shapes)
    assert all(n % (pp * dp * tp) == 0 and (max_tp is None or tp <= max_tp) for pp, dp, tp in shapes)
    brute = {(a, b, c) for a in range(1, n + 1) for b in range(1, n + 1) for c in range(1, (max_tp or n) + 1)
             if n % (a * b * c) == 0}
    assert set(shapes) == brute
    assert (n, 1, 1) in shapes and (1, n, 1) in shapes


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(condensed_graphs(max_blocks=7), st.sampled_from([2, 4]), st.sampled_from([1, 2, 4]),
       st.sampled_from(["gpipe", "1f1b"]))
def test_the_pipeline_only_plan_and_data_parallelism_are_points_of_the_search(
        graph: CondensedGraph, n: int, m: int, schedule: str) -> None:
    problem = _problem(graph, n, m, schedule=schedule)
    found = plan_hybrid(problem, solver="dp", time_limit_s=None, prune=False)
    pipeline = solve(problem, "dp").makespan_s  # today's plan: N devices, idle ones allowed
    pp_only = next(lay for lay in found.layouts if (lay.pp, lay.dp, lay.tp) == (n, 1, 1))
    assert pp_only.step_s == pytest.approx(pipeline)
    assert found.best.step_s <= pipeline + 1e-9
    if m % n == 0:
        assert found.best.step_s <= data_parallel(problem).step_s + 1e-9
    assert found.layouts == tuple(sorted(found.layouts, key=lambda lay: lay.step_s))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(condensed_graphs(max_blocks=6), st.sampled_from([2, 4, 8]), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from(["gpipe", "1f1b"]), st.booleans())
def test_pruned_search_finds_the_best_and_every_familys_best(graph: CondensedGraph, n: int, m: int, schedule: str,
                                                            with_tp: bool) -> None:
    """Property: leaving unsolved the pipelined meshes whose lower bound is no better than the
    best found (and their families' bests) changes neither the best nor any family's best; what
    it left is no better than those, and says so."""
    problem = _problem(graph, n, m, schedule=schedule)
    half = LayerParallelCosts(2, "pase", (0.5,) * len(graph), (0.5,) * len(graph), (0.5,) * len(graph),
                              {"S(1)": len(graph)}, (1,) * len(graph))
    costs = [half] if with_tp else []
    full = plan_hybrid(problem, costs, solver="dp", time_limit_s=None, prune=False)
    pruned = plan_hybrid(problem, costs, solver="dp", time_limit_s=None)
    assert pruned.best.step_s == pytest.approx(full.best.step_s, rel=1e-12)
    for name, lay in full.baselines.items():
        got = pruned.baselines[name]
        assert (got is None) == (lay is None), name
        if lay is not None:
            assert got.step_s == pytest.approx(lay.step_s, rel=1e-12), name
    exact = {(lay.pp, lay.dp, lay.tp, lay.family): lay for lay in full.layouts}
    for lay in pruned.layouts:
        twin = exact[(lay.pp, lay.dp, lay.tp, lay.family)]
        if lay.note.startswith("not solved"):
            assert lay.pp > 1 and twin.step_s >= pruned.best.step_s * (1 - 1e-12)
            assert float(lay.note.split("at least ")[1].split(" s")[0]) <= twin.step_s * (1 + 1e-3)
        else:
            assert lay.step_s == pytest.approx(twin.step_s, rel=1e-12)


def test_pruning_leaves_the_meshes_of_fewer_devices_unsolved() -> None:
    """Eight equal blocks on 8 devices: a pipeline over 2 of them cannot beat one over 8, so the
    pruned search solves fewer meshes and ends where the full one does."""
    graph = CondensedGraph.chain([1.0] * 8)
    problem = _problem(graph, 8, 8)
    full = plan_hybrid(problem, solver="dp", time_limit_s=None, prune=False)
    pruned = plan_hybrid(problem, solver="dp", time_limit_s=None)
    skipped = [lay for lay in pruned.layouts if lay.note.startswith("not solved")]
    assert skipped and all(not lay.feasible for lay in skipped)
    assert pruned.best.step_s == full.best.step_s
    assert pruned.baselines["pipeline"].step_s == full.baselines["pipeline"].step_s


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(condensed_graphs(max_blocks=6), st.sampled_from([1, 2, 4]), st.integers(0, 3))
def test_more_devices_are_never_predicted_slower(graph: CondensedGraph, n: int, m_exp: int) -> None:
    m = 2**m_exp
    fewer = plan_hybrid(_problem(graph, n, m), solver="dp", time_limit_s=None).best.step_s
    more = plan_hybrid(_problem(graph, 2 * n, m), solver="dp", time_limit_s=None).best.step_s
    assert more <= fewer + 1e-9


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(condensed_graphs(max_blocks=6), st.sampled_from([2, 4]), st.sampled_from([2, 4]))
def test_every_device_meshes_use_all_devices_and_are_a_subset_of_the_search(graph: CondensedGraph, n: int,
                                                                            m: int) -> None:
    """What a torchrun launch of N ranks can build (compile(parallel="hybrid")): pp x dp x tp == N."""
    every = plan_hybrid(_problem(graph, n, m), solver="dp", time_limit_s=None, every_device=True)
    anything = plan_hybrid(_problem(graph, n, m), solver="dp", time_limit_s=None)
    assert every.layouts and all(lay.pp * lay.dp * lay.tp == n for lay in every.layouts)
    shapes = {(lay.pp, lay.dp, lay.tp) for lay in every.layouts}
    assert shapes == {s for s in mesh_shapes(n, max_tp=1) if s[0] * s[1] == n}  # no per-layer costs: tp = 1
    assert every.best.step_s >= anything.best.step_s - 1e-9


def test_replicas_all_reduce_each_stage_after_its_last_backward() -> None:
    # two blocks of 1 s forward, 2 s backward, 1 and 3 MiB of parameters; 4 micro-batches
    graph = CondensedGraph(tuple(Block(i, f"b{i}", (f"n{i}",), fwd_s=1.0, bwd_s=2.0, param_bytes=(1 + 2 * i) * 2**20)
                                 for i in range(2)))
    problem = Problem(graph, tuple(DeviceSpec(f"d{i}") for i in range(4)), link=LinkSpec(2.0**20, 0.25),
                      microbatches=4, objective="makespan")
    lay = next(lay for lay in plan_hybrid(problem, solver="dp", prune=False).layouts
               if (lay.pp, lay.dp, lay.tp) == (2, 2, 1))
    # each replica: 2 micro-batches through 2 stages of 3 s: 2 * 3 + (2 - 1) * 3 = 9 s
    assert lay.pipeline_s == pytest.approx(9.0)
    # all-reduce of 1 MiB over 2: 2 * 1/2 * 1 s + 2 * 0.25 s = 1.5 s, of 3 MiB 3.5 s; stage 1's
    # starts 2 s earlier (before stage 0's last backward), so 1.5 s of each is exposed
    assert [row["allreduce_s"] for row in lay.stage_rows] == pytest.approx([1.5, 3.5])
    assert lay.allreduce_s == pytest.approx(1.5)
    assert lay.step_s == pytest.approx(10.5)
    assert [row["ranks"] for row in lay.stage_rows] == [[0, 1], [2, 3]]


def test_per_layer_costs_scale_the_blocks_and_win_when_they_split_the_work() -> None:
    graph = CondensedGraph(tuple(Block(i, f"b{i}", (f"n{i}",), fwd_s=1.0, bwd_s=2.0, param_bytes=GiB,
                                       activation_bytes=GiB) for i in range(2)))
    half = LayerParallelCosts(2, "pase", (0.5, 0.5), (0.5, 0.5), (0.5, 0.5), {"S(1)": 2}, (1, 1))
    scaled = half.apply(graph)
    assert [b.time_s for b in scaled.blocks] == [1.5, 1.5]
    assert [b.param_bytes for b in scaled.blocks] == [GiB // 2] * 2
    problem = Problem(graph, tuple(DeviceSpec(f"d{i}", memory_bytes=5 * GiB) for i in range(2)), link=LINK,
                      microbatches=1, objective="makespan")
    found = plan_hybrid(problem, [half], solver="dp")
    # 2 GiB of parameters x 4 (weights, gradients, Adam) do not fit one device; halved they do
    assert (found.best.pp, found.best.dp, found.best.tp, found.best.family) == (1, 1, 2, "pase")
    assert found.best.step_s == pytest.approx(3.0)
    assert found.best.stage_rows[0]["split_nodes"] == 2
    assert found.baselines["data parallel"] is None
    assert json.loads(json.dumps(found.to_dict()))["best"]["tp"] == 2


def test_a_per_layer_plan_that_splits_nothing_says_so_and_costs_what_one_device_does() -> None:
    """A tp mesh whose per-layer plan replicates every node (PaSE's pick when collectives cost
    more than they save) runs the whole stage on each of its tp ranks: the search chose such a
    mesh on 4 CPU ranks with no word of it (the table showed "split nodes 0" only)."""
    graph = CondensedGraph(tuple(Block(i, f"b{i}", (f"n{i}",), fwd_s=1.0, bwd_s=2.0) for i in range(2)))
    replicated = LayerParallelCosts(2, "pase", (1.0, 1.0), (1.0, 1.0), (1.0, 1.0), {"R": 2}, (0, 0))
    half = LayerParallelCosts(2, "megatron", (0.5, 0.5), (0.5, 0.5), (0.5, 0.5), {"S(1)": 2}, (1, 1))
    problem = Problem(graph, tuple(DeviceSpec(f"d{i}") for i in range(2)), link=LINK, microbatches=1,
                      objective="makespan")
    found = plan_hybrid(problem, [replicated, half], solver="dp", every_device=True)
    lays = {(lay.tp, lay.family): lay for lay in found.layouts}
    copies = lays[(2, "pase")]
    assert "tp splits nothing: 2 copies" in copies.note
    assert copies.step_s == pytest.approx(6.0), "the time of one device: every copy runs it all"
    assert "splits nothing" not in lays[(2, "megatron")].note
    assert not any("splits nothing" in lay.note for lay in found.layouts if lay.tp == 1)
    unknown = LayerParallelCosts(2, "pase", (1.0, 1.0), (1.0, 1.0), (1.0, 1.0))  # no per-block counts given
    assert "splits nothing" not in plan_hybrid(problem, [unknown], solver="dp", every_device=True).best.note


def test_nothing_that_fits_is_an_error_with_every_reason() -> None:
    graph = CondensedGraph((Block(0, "b", ("n",), fwd_s=1.0, bwd_s=1.0, param_bytes=GiB),))
    with pytest.raises(InfeasibleError, match="does not fit"):
        plan_hybrid(_problem(graph, 2, 2, memory=GiB), solver="dp")


def test_a_mesh_needs_identical_devices_and_one_stage_per_device() -> None:
    graph = CondensedGraph.chain([1.0, 1.0])
    mixed = Problem(graph, (DeviceSpec("a"), DeviceSpec("b", speed=2.0)), microbatches=2)
    with pytest.raises(ConfigError, match="identical devices"):
        plan_hybrid(mixed)
    with pytest.raises(ConfigError, match="gpipe or 1f1b"):
        plan_hybrid(_problem(graph, 2, 2, schedule="interleaved-1f1b"))
    with pytest.raises(ConfigError, match="factors are finite"):
        LayerParallelCosts(2, "pase", (math.inf,), (1.0,), (1.0,))
    with pytest.raises(ConfigError, match="same condensed graph"):
        LayerParallelCosts(2, "pase", (1.0,), (1.0,), (1.0,)).apply(graph)
    with pytest.raises(ConfigError, match="degree=1"):
        LayerParallelCosts(1, "pase", (1.0,), (1.0,), (1.0,))


# --- per-layer plans from DTensor, attributed to blocks ----------------------------------------------
@pytest.fixture(scope="module")
def gpt() -> Inspection:
    case = zoo.get("gpt", size="tiny", batch_size=4)
    return analyze(case.model, case.example_inputs, device=DeviceSpec.preset("a100"))


def test_block_costs_add_up_to_the_strategy_graphs_cost(gpt) -> None:  # type: ignore[no-untyped-def]
    from fxsplit.passes.layer_costs import _block_of_vertices, block_factors
    from fxsplit.passes.parallel_strategies import strategy_graph
    from fxsplit.solvers.pase import solve_strategies

    graph = gpt.condensed.graph
    found = strategy_graph(gpt.captured.gm, 2, link=LinkSpec(25e9, 1e-5))
    assert all(b >= 0 for b in _block_of_vertices(found, graph))  # every vertex's cost lands in a block
    whole = found.choice_of(("R",))
    assert block_factors(found, whole, graph) == ((1.0,) * len(graph.blocks),) * 3
    choice = solve_strategies(found.graph).choice
    times, _, _ = block_factors(found, choice, graph)
    # the block times are the nodes' own costs: scaled by the factors they add up to the plan's cost
    assert sum(b.time_s * f for b, f in zip(graph.blocks, times, strict=True)) == pytest.approx(
        found.graph.cost_s(choice), rel=1e-6)
    assert graph.total_time_s == pytest.approx(found.graph.cost_s(whole), rel=1e-6)


def test_megatrons_family_shards_the_linear_weights(gpt) -> None:  # type: ignore[no-untyped-def]
    from fxsplit.passes.layer_costs import layer_parallel_costs

    graph = gpt.condensed.graph
    costs = layer_parallel_costs(gpt.captured.gm, graph, 2, family="megatron", link=LinkSpec(25e9, 1e-5))
    with_params = [i for i, b in enumerate(graph.blocks) if b.param_bytes]
    assert any(costs.param_factors[i] < 0.75 for i in with_params)
    assert sum(costs.split_nodes) > 0
    with pytest.raises(ConfigError, match="family="):
        layer_parallel_costs(gpt.captured.gm, graph, 2, family="zero")


def test_per_layer_costs_build_each_degrees_strategy_graph_once(gpt, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Both families of a degree read one strategy graph, and give what each computed alone does."""
    import fxsplit.passes.layer_costs as layer_costs

    graph, link = gpt.condensed.graph, LinkSpec(25e9, 1e-5)
    alone = [layer_costs.layer_parallel_costs(gpt.captured.gm, graph, 2, family=f, link=link)
             for f in ("pase", "megatron")]
    built = []
    real = layer_costs.strategy_graph
    monkeypatch.setattr(layer_costs, "strategy_graph", lambda *a, **k: built.append(a[1]) or real(*a, **k))
    together = layer_costs.per_layer_costs(gpt.captured.gm, graph, [2], link=link)
    assert built == [2]
    assert [(c.degree, c.family) for c in together] == [(2, "pase"), (2, "megatron")]
    for a, b in zip(alone, together, strict=True):
        for field in ("time_factors", "param_factors", "activation_factors"):
            assert getattr(a, field) == pytest.approx(getattr(b, field)), field
    with pytest.raises(ConfigError, match="family="):
        layer_costs.per_layer_costs(gpt.captured.gm, graph, [2], ("pase", "zero"))


def test_plan_hybrid_on_a_cluster_file_and_the_cli(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import fxsplit.cli as cli

    cluster = {"name": "2 x 2", "device_kinds": {"a100": {"preset": "a100"}},
               "nodes": [{"name": "n0", "devices": {"a100": 2}}, {"name": "n1", "devices": {"a100": 2}}],
               "links": {"intra_node": {"bytes_per_s": 300e9, "latency_s": 5e-6},
                         "inter_node": {"bytes_per_s": 25e9, "latency_s": 1e-5}}}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster))
    case = zoo.get("mlp", size="tiny", batch_size=4)
    found, _ = fxsplit.plan_hybrid(case.model, case.example_inputs, devices=path, microbatches=4)
    assert found.devices == 4 and max(lay.tp for lay in found.layouts) == 2  # tp stays inside a node
    cli._register_all()
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli.app, ["hybrid", "mlp", "--devices", "4", "--microbatches", "4", "--json", str(out)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "best of each family" in result.output and "data parallel" in result.output
    data = json.loads(out.read_text())
    assert data["format"] == "fxsplit-hybrid-plan" and data["devices"] == 4
    assert data["best"]["step_s"] == min(lay["step_s"] for lay in data["layouts"] if lay["step_s"] is not None)
