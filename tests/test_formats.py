"""Loaders: PipeDream graph.txt, Tarnawski JSON, fxsplit JSON, format detection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxsplit.errors import ConfigError, InfeasibleError
from fxsplit.ir import CondensedGraph, DeviceSpec, LinkSpec, Problem
from fxsplit.ir.formats import (
    load_graph_or_problem,
    load_pipedream,
    load_tarnawski,
    tarnawski_plan_faults,
)

PIPEDREAM = Path(__file__).resolve().parent / "data" / "pipedream"  # PipeDream's profiles (MIT, see LICENSE.txt there)

SMALL = """node2 -- Conv2d(3, 64) -- forward_compute_time=2.000, backward_compute_time=4.000, activation_size=100.0, parameter_size=50.000
\tnode2 -- node3
node1 -- Input -- forward_compute_time=600.0, backward_compute_time=0.000, activation_size=10.0, parameter_size=0.000
\tnode1 -- node2
node3 -- LSTM -- forward_compute_time=1.0, backward_compute_time=1.0, activation_size=[6.0; 1.0; 1.0], parameter_size=8.000
"""


def test_pipedream_small(tmp_path: Path) -> None:
    path = tmp_path / "graph.txt"
    path.write_text(SMALL)
    g = load_pipedream(path)
    assert [b.name for b in g.blocks] == ["node1", "node2", "node3"]
    assert g.blocks[0].fwd_s == 0.0  # Input counts 0
    assert g.blocks[1].fwd_s == pytest.approx(2e-3) and g.blocks[1].bwd_s == pytest.approx(4e-3)
    assert g.blocks[2].activation_bytes == 8 and g.blocks[1].param_bytes == 50
    assert [(e.src, e.dst, e.size_bytes) for e in g.edges] == [(0, 1, 10), (1, 2, 100)]
    assert load_graph_or_problem(path) == g


def test_pipedream_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_text("this is not a node\n")
    with pytest.raises(ConfigError, match="bad.txt:1"):
        load_pipedream(path)


@pytest.mark.parametrize("name,nodes", [("alexnet", 23), ("vgg16", 41), ("resnet18", 71), ("resnet50", 177),
                                        ("densenet121", 429), ("gnmt", 48)])
def test_pipedream_shared_graphs(name: str, nodes: int) -> None:
    g = load_pipedream(PIPEDREAM / f"{name}.txt")
    assert len(g) == nodes and g.validate() == [] and g.total_time_s > 0


def test_tarnawski_color_classes_and_backward(tmp_path: Path) -> None:
    data = {
        "maxSizePerFPGA": 1000.0, "maxFPGAs": 3, "maxCPUs": 0,
        "nodes": [
            {"id": 0, "fpgaLatency": 1.0, "size": 10, "isBackwardNode": 0, "colorClass": 7},
            {"id": 1, "fpgaLatency": 2.0, "size": 20, "isBackwardNode": 0},
            {"id": 2, "fpgaLatency": 3.0, "size": 0, "isBackwardNode": 1, "colorClass": 7},
            {"id": 3, "fpgaLatency": 0.5, "size": 5, "isBackwardNode": 0, "colorClass": 7},
        ],
        "edges": [{"sourceId": 0, "destId": 1, "cost": 0.25}, {"sourceId": 1, "destId": 2, "cost": 0.5},
                  {"sourceId": 0, "destId": 3, "cost": 0.25}],
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    pb = load_graph_or_problem(path)
    assert isinstance(pb, Problem) and pb.num_devices == 3 and pb.training
    assert {d.memory_bytes for d in pb.devices} == {1000}
    merged = next(b for b in pb.graph.blocks if len(b.nodes) == 3)
    assert merged.fwd_s == pytest.approx(1.5) and merged.bwd_s == pytest.approx(3.0) and merged.buffer_bytes == 15
    assert len(pb.graph) == 2 and len(pb.graph.edges) == 1
    assert load_tarnawski(path) == pb


def _orphan_instance(tmp_path: Path) -> Path:
    """A forward chain A -> B with backward twins, and a backward-only class O (an AccumulateGrad)
    fed by A's backward: dp.cpp orders O before A (the mirror of A' -> O)."""
    data = {
        "maxSizePerFPGA": 1000.0, "maxFPGAs": 2, "maxCPUs": 0,
        "nodes": [
            {"id": 1, "fpgaLatency": 1.5, "isBackwardNode": 0, "colorClass": 1},
            {"id": 2, "fpgaLatency": 0.5, "isBackwardNode": 0, "colorClass": 2},
            {"id": 11, "fpgaLatency": 1.5, "isBackwardNode": 1, "colorClass": 1},
            {"id": 12, "fpgaLatency": 0.5, "isBackwardNode": 1, "colorClass": 2},
            {"id": 20, "fpgaLatency": 2.0, "isBackwardNode": 1},
        ],
        "edges": [{"sourceId": 1, "destId": 2, "cost": 0.0}, {"sourceId": 12, "destId": 11, "cost": 0.0},
                  {"sourceId": 1, "destId": 12, "cost": 0.0}, {"sourceId": 11, "destId": 20, "cost": 0.0}],
    }
    path = tmp_path / "orphan.json"
    path.write_text(json.dumps(data))
    return path


def test_tarnawski_backward_only_classes_keep_dp_cpps_order(tmp_path: Path) -> None:
    """Issue 14 (a): every edge touching a backward node was dropped, so a backward-only class
    floated free and plans came out below the true optimum, called optimal (here 3.0: O after A's
    stage). With the mirrored precedence O precedes A, and the optimum is 4.0 (dp.cpp's: [O] then
    [A, B])."""
    from fxsplit import solvers

    pb = load_tarnawski(_orphan_instance(tmp_path), link=LinkSpec(bytes_per_s=1.0))
    names = {b.id: b.name for b in pb.graph.blocks}
    assert [(names[e.src], names[e.dst]) for e in pb.graph.edges if e.size_bytes == 0 and "n20" in
            (names[e.src], names[e.dst])] == [("n20", "n1")]
    for solver in ("dp", "cpsat"):
        plan = solvers.solve(pb.with_(objective="bottleneck"), solver)
        assert plan.status == "optimal" and plan.bottleneck_s == pytest.approx(4.0), (solver, plan)
        stage_of = {names[b]: s for s, st in enumerate(plan.stages) for b in st.blocks}
        assert stage_of["n20"] <= stage_of["n1"]


def test_tarnawski_plans_are_rechecked_on_the_files_own_nodes_and_edges(tmp_path: Path) -> None:
    """Issue 14 (item 4): a plan is re-validated against the input's node-level precedence, never
    the block graph the solvers saw; the CLI refuses to print one that breaks it."""
    from fxsplit import solvers
    from fxsplit.cli.solve import _recheck_tarnawski
    from fxsplit.errors import InternalError
    from fxsplit.ir import evaluate

    path = _orphan_instance(tmp_path)
    pb = load_tarnawski(path, link=LinkSpec(bytes_per_s=1.0)).with_(objective="bottleneck")
    assert tarnawski_plan_faults(path, pb, solvers.solve(pb, "dp")) == []
    ids = {b.name: b.id for b in pb.graph.blocks}
    backwards = evaluate(pb, [[ids["n2"]], [ids["n1"], ids["n20"]]])  # B before A: node 1 -> 2 broken
    faults = tarnawski_plan_faults(path, pb, backwards)
    assert faults == ["node 1 (stage 1) must not come after node 2 (stage 0)"]
    orphan_late = evaluate(pb, [[ids["n1"], ids["n2"]], [ids["n20"]]])  # O after A: its mirrored edge broken
    assert tarnawski_plan_faults(path, pb, orphan_late) == ["node 20 (stage 1) must not come after node 11 (stage 0)"]
    missing = evaluate(pb, [[ids["n1"], ids["n2"]]])
    assert tarnawski_plan_faults(path, pb, missing) == ["node 20 (block 'n20') is in no stage"]
    with pytest.raises(InternalError, match=r"breaks 1 precedence\(s\) of .*node 1 \(stage 1\)"):
        _recheck_tarnawski(path, pb, backwards)


def test_tarnawski_memory_is_node_sizes_and_edges_are_time(tmp_path: Path) -> None:
    """Issue 14 (b): edge costs became bytes counted as stage memory (1e9 bytes here against
    25), so the instance was declared infeasible where dp.cpp splits it 2 | 2 with load 3 (two
    nodes of latency 1 and the boundary's cost 1 on each side)."""
    from fxsplit import solvers

    data = {
        "maxSizePerFPGA": 25.0, "maxFPGAs": 2, "maxCPUs": 0,
        "nodes": [{"id": i, "fpgaLatency": 1.0, "size": 10, "isBackwardNode": 0} for i in range(4)],
        "edges": [{"sourceId": i, "destId": i + 1, "cost": 1.0} for i in range(3)],
    }
    path = tmp_path / "chain.json"
    path.write_text(json.dumps(data))
    pb = load_tarnawski(path)
    assert not pb.transfer_memory and Problem.from_json(pb.to_json()) == pb
    with pytest.raises(ConfigError, match="transfer_memory='false' must be true or false"):
        pb.with_(transfer_memory="false").check()
    for solver in ("dp", "cpsat"):
        plan = solvers.solve(pb.with_(objective="bottleneck"), solver)
        assert plan.status == "optimal" and plan.bottleneck_s == pytest.approx(3.0), solver
        assert [st.memory_bytes for st in plan.stages] == [20, 20]
    with pytest.raises(InfeasibleError):  # what the reader did: the 1e9 bytes held as memory
        solvers.solve(pb.with_(objective="bottleneck", transfer_memory=True), "dp")


def test_tarnawski_cycles_made_by_mirrored_edges_are_merged(tmp_path: Path) -> None:
    """dp.cpp fuses classes on a cycle; here O -> A (mirror of A' -> O) and A -> O (a forward
    edge into O's class would be impossible, so the cycle comes from O feeding B's backward
    and being fed by A's)."""
    data = json.loads(_orphan_instance(tmp_path).read_text())
    data["edges"].append({"sourceId": 20, "destId": 12, "cost": 0.0})  # O' -> B' mirrors to B -> O
    path = tmp_path / "cycle.json"
    path.write_text(json.dumps(data))
    pb = load_tarnawski(path, link=LinkSpec(bytes_per_s=1.0))
    merged = [b for b in pb.graph.blocks if len(b.nodes) > 2]
    assert len(merged) == 1 and set(merged[0].nodes) >= {"n1", "n2", "n20"}
    assert sum(b.fwd_s + b.bwd_s for b in pb.graph.blocks) == pytest.approx(6.0)


def test_fxsplit_json_graph_and_problem(tmp_path: Path) -> None:
    g = CondensedGraph.chain([1.0, 2.0])
    (tmp_path / "g.json").write_text(g.to_json())
    pb = Problem(g, (DeviceSpec("a"),))
    (tmp_path / "p.json").write_text(pb.to_json())
    assert load_graph_or_problem(tmp_path / "g.json") == g
    assert load_graph_or_problem(tmp_path / "p.json", format="fxsplit") == pb


def test_unknown_format_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="format"):
        load_graph_or_problem(tmp_path / "x", format="onnx")
    with pytest.raises(ConfigError, match="does not exist"):
        load_graph_or_problem(tmp_path / "x")


def test_a_tarnawski_file_is_parsed_once_while_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fxsplit solve`` detects, loads, re-checks and re-costs one file: one parse, not four;
    a file written again (other size or time) is parsed again."""
    import fxsplit.ir.formats as formats
    from fxsplit import solvers
    from fxsplit.ir.formats import detect_format, tarnawski_max_load

    path = _orphan_instance(tmp_path)
    calls = []
    real = json.loads
    monkeypatch.setattr(formats.json, "loads", lambda text: calls.append(1) or real(text))
    assert detect_format(path) == "tarnawski"
    pb = load_tarnawski(path, link=LinkSpec(bytes_per_s=1.0)).with_(objective="bottleneck")
    plan = solvers.solve(pb, "dp")
    assert tarnawski_plan_faults(path, pb, plan) == [] and tarnawski_max_load(path, pb, plan) > 0
    assert len(calls) == 1
    data = real(path.read_text())
    data["maxFPGAs"] = 1
    path.write_text(json.dumps(data, indent=2))
    assert len(load_tarnawski(path).devices) == 1 and len(calls) == 2
