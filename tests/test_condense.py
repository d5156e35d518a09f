"""Antichain condensation: partition, topological order, cost conservation, determinism, downsets.

Property tests draw random DAG-shaped ``nn.Module`` s (``tests/strategies.py``, front-end
section), capture them with both methods, annotate them on a fixed device and condense them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from itertools import combinations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import any_dag_specs, build_dag
from torch import nn

import fxsplit.models as zoo
from fxsplit.ir import Block, CondensedGraph, DeviceSpec, Edge
from fxsplit.ir.downsets import mask_of, members
from fxsplit.passes.capture import capture
from fxsplit.passes.condense import (
    CondenseAntichains,
    Condensed,
    condense_antichains,
    fold_free_nodes,
)
from fxsplit.passes.costs import AnnotateCosts, NodeCost
from fxsplit.passes.manager import PassManager
from fxsplit.passes.shapes import PropagateShapes

DEVICE = DeviceSpec("ref", peak_flops=1e12, memory_bandwidth_bytes_per_s=1e11)
METHODS = st.sampled_from(["export", "symbolic_trace"])
PROPERTY = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def _front_end(
    model: nn.Module, inputs: tuple, method: str, max_downsets: int = 200_000, coarsen: bool = False
) -> tuple[torch.fx.GraphModule, Condensed]:
    cap = capture(model, inputs, method=method)
    flat = tuple(cap.flatten_inputs(inputs))
    pm = PassManager(
        [PropagateShapes(flat), AnnotateCosts(DEVICE), CondenseAntichains(max_downsets=max_downsets, coarsen=coarsen)],
        verify=True,
    )
    pm.run(cap.gm)
    return cap.gm, pm.artifacts["condense_antichains"]


def _dag_front_end(
    spec: object, method: str, max_downsets: int = 200_000, coarsen: bool = False
) -> tuple[torch.fx.GraphModule, Condensed]:
    model, inputs = build_dag(spec)
    return _front_end(model, inputs, method, max_downsets, coarsen)


def _brute_force_downsets(graph: CondensedGraph) -> set[int]:
    n = len(graph)
    found = set()
    for r in range(n + 1):
        for ids in combinations(range(n), r):
            if graph.is_downset(set(ids)):
                found.add(mask_of(ids))
    return found


def _closure(graph: CondensedGraph, ids: list[int]) -> set[int]:
    """The smallest downset holding ``ids``."""
    out, todo = set(), list(ids)
    while todo:
        b = todo.pop()
        if b not in out:
            out.add(b)
            todo.extend(graph.predecessors(b))
    return out


# ---------------------------------------------------------------- properties


@PROPERTY
@given(spec=any_dag_specs(), method=METHODS)
def test_blocks_partition_the_nodes(spec: object, method: str) -> None:
    gm, result = _dag_front_end(spec, method)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    listed = [name for b in result.graph.blocks for name in b.nodes]

    assert sorted(listed) == sorted(n.name for n in nodes)  # every node exactly once
    assert set(result.node_block) == {n.name for n in nodes}
    for block in result.graph.blocks:
        for name in block.nodes:
            assert result.node_block[name] == block.id
    for node in nodes:
        assert node.meta["fxsplit.block"] == result.node_block[node.name]
    assert all(b.nodes for b in result.graph.blocks)  # no empty block


@PROPERTY
@given(spec=any_dag_specs(), method=METHODS)
def test_block_graph_is_acyclic_and_in_topological_order(spec: object, method: str) -> None:
    gm, result = _dag_front_end(spec, method)
    graph = result.graph
    assert graph.validate() == []
    assert [b.id for b in graph.blocks] == list(range(len(graph)))
    assert all(e.src < e.dst for e in graph.edges)  # forward edges: acyclic, ids are a topo order
    # Every data dependency between nodes of different blocks is an edge, and nothing else is.
    deps = set()
    for node in gm.graph.nodes:
        for user in node.users:
            if user.op != "output" and result.node_block[user.name] != result.node_block[node.name]:
                deps.add((result.node_block[node.name], result.node_block[user.name]))
    assert deps == {(e.src, e.dst) for e in graph.edges}


@PROPERTY
@given(spec=any_dag_specs(), method=METHODS)
def test_costs_are_conserved(spec: object, method: str) -> None:
    gm, result = _dag_front_end(spec, method)
    costs: list[NodeCost] = [n.meta["fxsplit.cost"] for n in gm.graph.nodes if n.op != "output"]
    blocks = result.graph.blocks

    assert math.fsum(b.flops for b in blocks) == pytest.approx(math.fsum(c.flops for c in costs), rel=1e-12)
    assert math.fsum(b.fwd_s for b in blocks) == pytest.approx(math.fsum(c.fwd_s for c in costs), rel=1e-12)
    assert math.fsum(b.bwd_s for b in blocks) == pytest.approx(math.fsum(c.bwd_s for c in costs), rel=1e-12)
    assert sum(b.param_bytes for b in blocks) == sum(c.param_bytes for c in costs)
    assert sum(b.buffer_bytes for b in blocks) == sum(c.buffer_bytes for c in costs)
    assert sum(b.activation_bytes for b in blocks) == sum(c.saved_bytes for c in costs)
    model, _ = build_dag(spec)
    assert result.graph.total_param_bytes == 4 * sum(p.numel() for p in model.parameters())
    # No block holds only free nodes unless it must (a value read by several blocks, e.g. x).
    for b in blocks:
        if b.time_s == 0:
            assert len(result.graph.successors(b.id)) > 1 or not result.graph.predecessors(b.id), b


@PROPERTY
@given(spec=any_dag_specs(), method=METHODS)
def test_condensation_is_deterministic(spec: object, method: str) -> None:
    _, first = _dag_front_end(spec, method)
    _, second = _dag_front_end(spec, method)  # a fresh module and a fresh capture
    assert first.graph == second.graph
    assert first.graph.to_json() == second.graph.to_json()
    assert first.node_block == second.node_block
    assert first.downsets == second.downsets


@PROPERTY
@given(spec=any_dag_specs(max_nodes=8), method=METHODS)
def test_enumerated_downsets_are_exactly_the_downsets(spec: object, method: str) -> None:
    _, result = _dag_front_end(spec, method)
    graph = result.graph
    assert not result.truncated and result.downsets is not None
    downsets = list(result.downsets)

    assert len(set(downsets)) == len(downsets) == result.num_downsets
    assert downsets[0] == 0 and downsets[-1] == (1 << len(graph)) - 1
    sizes = [len(members(i)) for i in downsets]
    assert sizes == sorted(sizes)
    for downset in downsets:
        ids = set(members(downset))
        assert graph.is_downset(ids)
        assert _closure(graph, result.frontier(downset)) == ids  # the frontier generates the downset
    if len(graph) <= 14:
        assert set(downsets) == _brute_force_downsets(graph)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(spec=any_dag_specs(), method=METHODS, budget=st.integers(1, 6))
def test_truncation_changes_only_the_downsets(spec: object, method: str, budget: int) -> None:
    gm, full = _dag_front_end(spec, method)
    small = condense_antichains(gm, max_downsets=budget, coarsen=False)
    assert small.graph == full.graph and small.node_block == full.node_block
    if full.num_downsets > budget:
        assert small.truncated and small.downsets is None and small.num_downsets > budget
        assert "+ downsets" in repr(small)
    else:
        assert not small.truncated and small.downsets == full.downsets
    assert dataclasses.replace(small, downsets=full.downsets, num_downsets=full.num_downsets, truncated=False) == full


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(spec=any_dag_specs(max_nodes=12), method=METHODS, budget=st.integers(2, 12))
def test_coarsening_merges_whole_blocks_and_keeps_the_invariants(spec: object, method: str, budget: int) -> None:
    gm, fine = _dag_front_end(spec, method, coarsen=False)
    coarse = condense_antichains(gm, max_downsets=budget, coarsen=True)
    graph = coarse.graph

    assert graph.validate() == [] and coarse.fine_blocks == fine.num_blocks
    assert sorted(n for b in graph.blocks for n in b.nodes) == sorted(fine.node_block)
    for block in fine.graph.blocks:  # a fine block is never split
        assert len({coarse.node_block[n] for n in block.nodes}) == 1
    for node in gm.graph.nodes:
        if node.op != "output":
            assert node.meta["fxsplit.block"] == coarse.node_block[node.name]
    assert math.fsum(b.fwd_s for b in graph.blocks) == pytest.approx(math.fsum(b.fwd_s for b in fine.graph.blocks))
    assert graph.total_param_bytes == fine.graph.total_param_bytes
    if fine.num_downsets <= budget:
        assert coarse.graph == fine.graph  # nothing to do
    elif not coarse.truncated:
        assert coarse.num_blocks < fine.num_blocks and coarse.num_downsets <= budget
        assert coarse.downsets is not None and all(graph.is_downset(set(members(i))) for i in coarse.downsets)


# ---------------------------------------------------------------- zoo models and wide graphs


@pytest.mark.parametrize("method", ["export", "symbolic_trace"])
@pytest.mark.parametrize("name", list(zoo.list_models()))
def test_zoo_models_condense_to_valid_graphs(name: str, method: str) -> None:
    case = zoo.get(name)
    gm, result = _front_end(case.model, case.example_inputs, method)
    assert result.graph.validate() == []
    assert 1 < result.num_blocks < len(gm.graph.nodes)  # folding merged something
    assert result.graph.total_param_bytes == 4 * case.num_parameters()


def test_inception_condenses_fast_and_reports_truncation() -> None:
    case = zoo.get("inception", size="small")
    cap = capture(case.model, case.example_inputs, method="export")
    PropagateShapes(tuple(cap.flatten_inputs(case.example_inputs)))(cap.gm)
    AnnotateCosts(DEVICE)(cap.gm)

    start = time.perf_counter()
    result = condense_antichains(cap.gm, max_downsets=50, coarsen=False)
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, f"condensing {len(cap.gm.graph.nodes)} nodes took {elapsed:.1f} s"
    assert result.truncated and result.downsets is None and result.num_downsets > 50
    assert "+ downsets" in repr(result) and result.graph.validate() == []

    start = time.perf_counter()
    coarse = condense_antichains(cap.gm, max_downsets=50)  # coarsening on (the default)
    assert time.perf_counter() - start < 5.0
    assert coarse.graph.validate() == [] and coarse.fine_blocks == result.num_blocks
    assert coarse.truncated or (coarse.num_downsets <= 50 and coarse.num_blocks < result.num_blocks)
    assert coarse.graph.total_time_s == pytest.approx(result.graph.total_time_s)


def test_batchnorm_counter_updates_join_a_neighbour() -> None:
    # Export in training mode writes ``num_batches_tracked.add_(1)`` nodes nobody reads; they
    # must not float as blocks of their own (each would double the number of downsets).
    case = zoo.get("resnet")
    gm, result = _front_end(case.model, case.example_inputs, "export")
    counters = [n for n in gm.graph.nodes if n.op == "call_function" and "add_" in str(n.target)]
    assert counters
    for node in counters:
        block = result.graph.blocks[result.node_block[node.name]]
        assert len(block.nodes) > 1, block


class _InPlaceChain(nn.Module):
    """An EMA of activations, ``ema.mul_(0.9).add_(...)``: a chain of two in-place ops."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return self.c(torch.tanh(self.b(h)))


def test_an_in_place_chain_stays_in_one_block() -> None:
    """Reliability (a probe: ``mul_`` in stage 0, ``add_`` in stage 1 on what stage 0 sent; with
    recompute the ``add_`` ran twice on it and autograd refused the step, on another device the
    update would land on a copy): the ops of an in-place chain condense into one block, and two
    stages with recomputation train as the model does."""
    import copy

    import fxsplit

    model = _InPlaceChain()
    gm, result = _front_end(model, (torch.randn(4, 8),), "export")
    chain = [n.name for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("aten.")
             and str(n.target).split(".")[1].endswith("_")]
    assert len(chain) == 2, chain
    assert len({result.node_block[name] for name in chain}) == 1
    torch.manual_seed(0)
    model, x, y = _InPlaceChain(), torch.randn(8, 8), torch.randn(8, 8)
    ref = copy.deepcopy(model)
    pipe = fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=1, schedule="gpipe", cost_model="analytic",
                           options=fxsplit.CompileOptions(allow_idle_devices=False, recompute="all"))
    loss = pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss)
    want = nn.functional.mse_loss(ref(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    torch.testing.assert_close(pipe.state_dict()["ema"], ref.ema)
    grads = dict(pipe.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad)


# ---------------------------------------------------------------- fold_free_nodes by hand


class ViewChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x).view(2, 2, 4).flatten(1)  # two views between the linears
        return self.b(y.view(4, 4))


def test_views_fold_into_a_neighbour() -> None:
    gm, result = _front_end(ViewChain(), (torch.randn(4, 4),), "symbolic_trace")
    assert result.num_blocks == 2
    block_a, block_b = result.graph.blocks
    assert {"x", "a"} <= set(block_a.nodes) and "b" in block_b.nodes
    assert result.graph.edges == (Edge(0, 1, 4 * 16),)
    costs = [n.meta["fxsplit.cost"] for n in gm.graph.nodes if n.op != "output"]
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    groups = fold_free_nodes(nodes, costs)
    assert len(set(groups)) == 2


def test_frontier_of_a_diamond() -> None:
    blocks = tuple(Block(i, f"b{i}", (f"b{i}",)) for i in range(4))
    graph = CondensedGraph(blocks, (Edge(0, 1), Edge(0, 2), Edge(1, 3), Edge(2, 3)))
    result = Condensed(graph, {}, None, 0, False)
    assert sorted(result.frontier(0b0111)) == [1, 2]
    assert result.frontier(0b0011) == [1]
    assert result.frontier(0b1111) == [3]


@pytest.mark.parametrize("method", ["export", "symbolic_trace"])
def test_tied_weight_is_owned_by_its_first_reader_and_charged_to_the_others(method, ref_device):
    """Regression: the tied embedding / LM head was charged once, so a plan putting the head on
    another stage under-counted that stage's memory (codegen gives it a copy)."""
    import fxsplit.models as zoo
    from fxsplit.api import analyze
    from fxsplit.ir import Problem, evaluate

    case = zoo.get("gpt", batch_size=2)
    ins = analyze(case.model, case.example_inputs, device=ref_device, method=method)
    g = ins.condensed.graph
    weight = case.model.tok_emb.weight
    nbytes = weight.numel() * weight.element_size()
    assert g.total_param_bytes == 4 * case.num_parameters()  # owned once: cost is conserved
    charged = [b for b in g.blocks if b.replica_param_bytes]
    assert [b.replica_param_bytes for b in charged] == [nbytes]
    head = charged[0].id
    problem = Problem(g, (ref_device, ref_device))
    split = [[b for b in range(len(g)) if b < head], [b for b in range(len(g)) if b >= head]]
    plan = evaluate(problem, split)
    state = problem.state_bytes_per_param_byte()
    last_params = sum(g.blocks[b].param_bytes for b in split[1])
    assert plan.stages[1].memory_bytes >= (last_params + nbytes) * state
