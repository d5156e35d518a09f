"""Direct transfers (``CondensedGraph.direct``: a value paid by the stage it leaves and by each
stage it enters, none between; Tarnawski et al.'s dp.cpp): the per-pair sums the DP uses against
a set-by-set statement, every solver against brute force, and Tarnawski training files against an
independent statement of dp.cpp's objective."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from strategies import MiB, condensed_graphs, problems
from test_solvers_dp import assert_solvers_equal_brute_force
from typer.testing import CliRunner

from fxsplit.cli import _register_all, app
from fxsplit.errors import ConfigError
from fxsplit.ir import CondensedGraph, DeviceSpec, DirectTransfer, Edge, LinkSpec, Problem, evaluate
from fxsplit.ir.downsets import count_downsets, members
from fxsplit.ir.formats import load_graph_or_problem, load_tarnawski, tarnawski_max_load
from fxsplit.solvers import direct as direct_module
from fxsplit.solvers import solve
from fxsplit.solvers.tables import build_tables

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def transfers(draw: st.DrawFn, n: int, min_size: int = 0) -> tuple[DirectTransfer, ...]:
    """``min_size`` to 8 transfers among ``n`` blocks: any source, 1-4 readers (earlier, later
    or the source itself), sizes in MiB."""
    out = []
    for _ in range(draw(st.integers(min_size, 8))):
        src = draw(st.integers(0, n - 1))
        dsts = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4))
        out.append(DirectTransfer(src, tuple(dsts), float(draw(st.integers(0, 4)) * MiB)))
    return tuple(out)


@st.composite
def direct_problems(draw: st.DrawFn, max_blocks: int = 7, max_devices: int = 4) -> Problem:
    """Random problems (fixed or free order, heterogeneous, a comm-free device sometimes) whose
    graph also has direct transfers, with the settings direct transfers need."""
    pb = draw(problems(max_blocks=max_blocks, max_devices=max_devices, heterogeneous=True, device_order=None,
                       memory_mib=(8, 64)))
    graph = CondensedGraph(pb.graph.blocks, pb.graph.edges, pb.graph.name, direct=draw(transfers(len(pb.graph))))
    devices = list(pb.devices)
    if draw(st.booleans()):
        which = draw(st.integers(0, len(devices) - 1))
        devices[which] = devices[which].with_(comm_free=True)
    return pb.with_(graph=graph, devices=tuple(devices), link=LinkSpec(pb.link.bytes_per_s, 0.0),
                    transfer_memory=False).check()


@SETTINGS
@given(condensed_graphs(max_blocks=8), st.data())
def test_direct_bytes_of_every_pair_equal_the_set_statement(graph: CondensedGraph, data: st.DataObject) -> None:
    assume(count_downsets(graph, limit=60) is not None)
    graph = CondensedGraph(graph.blocks, graph.edges, graph.name, direct=data.draw(transfers(len(graph), 1)))
    pb = Problem(graph, (DeviceSpec("d"),), transfer_memory=False)
    tb = build_tables(pb)
    pairs = [(i, j) for i, j in itertools.product(range(tb.num), repeat=2)
             if tb.masks[j] & tb.masks[i] == tb.masks[j]]
    i, j = (np.array(x) for x in zip(*pairs, strict=True))
    expected = [graph.direct_bytes(set(members(tb.masks[a] & ~tb.masks[b]))) for a, b in pairs]
    assert tb.direct is not None
    assert tb.direct.bytes(i, j) == pytest.approx(expected)
    # the reversed graph's tables: downset k is the complement of downset D - 1 - k
    fl = tb.flipped()
    assert fl.direct is not None
    pairs = [(a, b) for a, b in itertools.product(range(fl.num), repeat=2) if fl.masks[b] & fl.masks[a] == fl.masks[b]]
    fi, fj = (np.array(x) for x in zip(*pairs, strict=True))
    flipped = [graph.direct_bytes(set(members(fl.masks[a] & ~fl.masks[b]))) for a, b in pairs]
    assert fl.direct.bytes(fi, fj) == pytest.approx(flipped)
    # a subfamily of the downsets (the chain DP's rows), then the row-product path for large tables
    rows = np.array(sorted({0, tb.full, *range(0, tb.num, 2)}))
    sub = tb.restricted(rows)
    assert sub.direct is not None
    assert sub.direct.bytes(np.full(len(rows), len(rows) - 1), np.arange(len(rows))) == pytest.approx(
        [graph.direct_bytes(set(members(tb.masks[tb.full] & ~tb.masks[r]))) for r in rows])


def test_direct_bytes_without_the_full_table(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = CondensedGraph.chain([1.0] * 5)
    graph = CondensedGraph(graph.blocks, graph.edges, direct=(DirectTransfer(0, (2, 4), 3.0), DirectTransfer(1, (3,), 5.0),
                                                              DirectTransfer(4, (0,), 7.0)))
    pb = Problem(graph, (DeviceSpec("d"),), transfer_memory=False)
    full = build_tables(pb)
    monkeypatch.setattr(direct_module, "FULL_TABLE_DOWNSETS", 0)
    rows = build_tables(pb)
    assert full.direct is not None and rows.direct is not None
    assert isinstance(rows.direct, direct_module.DirectPairs) and rows.direct.full is None
    i, j = np.triu_indices(full.num)
    i, j = j, i  # j <= i: on a chain every smaller prefix is inside the larger
    assert rows.direct.bytes(i, j) == pytest.approx(full.direct.bytes(i, j))
    assert rows.direct.bytes(np.array([3]), np.array([1])) == pytest.approx([3.0 + 5.0])  # blocks {1, 2}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(direct_problems())
def test_dp_cpsat_and_auto_equal_brute_force_with_direct_transfers(problem: Problem) -> None:
    assert_solvers_equal_brute_force(problem)


def test_a_direct_transfer_is_paid_by_its_ends_not_between() -> None:
    g = CondensedGraph.chain([1.0, 1.0, 1.0])
    g = CondensedGraph(g.blocks, g.edges, direct=(DirectTransfer(0, (2,), 4.0),))
    pb = Problem(g, tuple(DeviceSpec(f"d{i}") for i in range(3)), link=LinkSpec(bytes_per_s=1.0, latency_s=0.0),
                 training=True, transfer_memory=False).check()
    plan = evaluate(pb, [[0], [1], [2]], [0, 1, 2])
    assert [st.comm_s for st in plan.stages] == [4.0, 0.0, 4.0]  # never doubled: gradients are listed too
    assert evaluate(pb, [[0, 1, 2]], [0]).stages[0].comm_s == 0.0
    # relayed, the same value is paid at both boundaries of the middle stage, twice in training
    relayed = Problem(CondensedGraph(g.blocks, (*g.edges, Edge(0, 2, 4))),
                      pb.devices, link=pb.link, training=True, transfer_memory=False)
    assert [st.comm_s for st in evaluate(relayed, [[0], [1], [2]], [0, 1, 2]).stages] == [8.0, 16.0, 8.0]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("objective", "makespan", "objective='bottleneck'"),
    ("transfer_memory", True, "transfer_memory=False"),
    ("link", LinkSpec(bytes_per_s=1.0, latency_s=0.5), "link.latency_s=0"),
    ("links", ((0, 1, LinkSpec(bytes_per_s=2.0, latency_s=0.0)),), "links=()"),
])
def test_direct_transfers_refuse_what_they_cannot_cost(field: str, value: object, message: str) -> None:
    g = CondensedGraph.chain([1.0, 1.0])
    g = CondensedGraph(g.blocks, g.edges, direct=(DirectTransfer(0, (1,), 4.0),))
    pb = Problem(g, (DeviceSpec("a"), DeviceSpec("b")), link=LinkSpec(bytes_per_s=1.0, latency_s=0.0),
                 transfer_memory=False)
    pb.check()
    with pytest.raises(ConfigError, match=re.escape(message)):
        pb.with_(**{field: value}).check()


def test_direct_transfers_survive_json_and_scaling() -> None:
    g = CondensedGraph.chain([1.0, 1.0])
    g = CondensedGraph(g.blocks, g.edges, direct=(DirectTransfer(1, (0,), 8.0),))
    pb = Problem(g, (DeviceSpec("a"),), transfer_memory=False)
    back = Problem.from_json(pb.to_json())
    assert back.graph.direct == g.direct
    assert g.scaled(0.25).direct == (DirectTransfer(1, (0,), 2.0),)
    bad = CondensedGraph(g.blocks, g.edges, direct=(DirectTransfer(0, (5,), -1.0),))
    assert any("outside" in f for f in bad.validate()) and any("size_bytes=-1.0" in f for f in bad.validate())


# --- Tarnawski training files: dp.cpp's objective, stated independently -------------------------------


@st.composite
def training_instances(draw: st.DrawFn) -> dict:
    """A Tarnawski training instance: forward nodes on a random DAG, one backward node per forward
    node in its colour class, a backward edge ``v' -> u'`` for each forward edge ``u -> v``; each
    node's out-edges share one cost (dp.cpp's rule), backward costs independent of forward ones."""
    n = draw(st.integers(2, 6))
    fwd_edges = []
    for v in range(1, n):
        for u in sorted(draw(st.sets(st.integers(max(0, v - 3), v - 1), min_size=1, max_size=2))):
            fwd_edges.append((u, v))
    cost = [float(draw(st.integers(0, 5))) for _ in range(2 * n)]
    nodes = [{"id": i, "name": f"f{i}", "fpgaLatency": float(draw(st.integers(0, 8))), "size": 1.0,
              "isBackwardNode": 0, "colorClass": i} for i in range(n)]
    nodes += [{"id": n + i, "name": f"b{i}", "fpgaLatency": float(draw(st.integers(0, 8))), "size": 1.0,
               "isBackwardNode": 1, "colorClass": i} for i in range(n)]
    edges = [{"sourceId": u, "destId": v, "cost": cost[u]} for u, v in fwd_edges]
    edges += [{"sourceId": n + v, "destId": n + u, "cost": cost[n + v]} for u, v in fwd_edges]
    fpgas = draw(st.integers(1, 3))
    cap = draw(st.integers(2 * -(-n // fpgas), 2 * n))  # from a tight fit to everything on one
    return {"maxSizePerFPGA": float(cap), "maxFPGAs": fpgas, "nodes": nodes, "edges": edges}


def _dp_cpp_objective(data: dict) -> float:
    """dp.cpp's max-load, brute force: every assignment of colour classes to the FPGAs in order
    (a class never before its forward predecessors'), each FPGA paying its nodes' latencies and,
    once each, the cost of every node with an edge leaving or entering its node set; node sizes
    within ``maxSizePerFPGA``."""
    nodes = data["nodes"]
    classes = sorted({nd["colorClass"] for nd in nodes})
    fwd = [(e["sourceId"], e["destId"]) for e in data["edges"] if not nodes[e["sourceId"]]["isBackwardNode"]]
    best = math.inf
    for stage in itertools.product(range(data["maxFPGAs"]), repeat=len(classes)):
        if any(stage[u] > stage[v] for u, v in fwd):
            continue
        worst = 0.0
        for s in set(stage):
            inside = {nd["id"] for nd in nodes if stage[nd["colorClass"]] == s}
            if sum(nodes[i]["size"] for i in inside) > data["maxSizePerFPGA"]:
                worst = math.inf
                break
            crossing = {e["sourceId"]: e["cost"] for e in data["edges"]
                        if (e["sourceId"] in inside) != (e["destId"] in inside)}
            worst = max(worst, sum(nodes[i]["fpgaLatency"] for i in inside) + sum(crossing.values()))
        best = min(best, worst)
    return best


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(training_instances())
def test_direct_transfers_reproduce_dp_cpps_objective_on_training_graphs(
        tmp_path_factory: pytest.TempPathFactory, data: dict) -> None:
    expected = _dp_cpp_objective(data)
    assume(math.isfinite(expected))
    path = tmp_path_factory.mktemp("t") / "train.json"
    path.write_text(json.dumps(data))
    pb = load_tarnawski(path, link=LinkSpec(bytes_per_s=1.0, latency_s=0.0), transfers="direct")
    assert pb.training and (pb.graph.direct or not any(e["cost"] for e in data["edges"]))
    for solver in ("dp", "cpsat"):
        plan = solve(pb, solver)
        assert plan.status == "optimal", solver
        assert plan.objective_s == pytest.approx(expected, rel=1e-9), solver
        # fxsplit's own evaluation of its plan is dp.cpp's costing of it
        assert plan.bottleneck_s == pytest.approx(tarnawski_max_load(path, pb, plan), rel=1e-9)


def test_relayed_and_direct_differ_where_gradients_come_back_from_two_stages(tmp_path: Path) -> None:
    # a -> b, a -> c (a residual's two readers), each gradient its own backward node sending to a's
    nodes = [{"id": i, "name": nm, "fpgaLatency": 1.0, "size": 1.0, "isBackwardNode": int(i >= 3), "colorClass": i % 3}
             for i, nm in enumerate(["a", "b", "c", "a'", "b'", "c'"])]
    edges = [{"sourceId": 0, "destId": 1, "cost": 2.0}, {"sourceId": 0, "destId": 2, "cost": 2.0},
             {"sourceId": 4, "destId": 3, "cost": 2.0}, {"sourceId": 5, "destId": 3, "cost": 2.0}]
    path = tmp_path / "res.json"
    path.write_text(json.dumps({"maxSizePerFPGA": 10.0, "maxFPGAs": 2, "nodes": nodes, "edges": edges}))
    link = LinkSpec(bytes_per_s=1.0, latency_s=0.0)
    direct = load_tarnawski(path, link=link, transfers="direct")
    relayed = load_tarnawski(path, link=link)
    stages = [[0], [1, 2]]  # a | b c
    names = [[b.name for b in pb.graph.blocks] for pb in (direct, relayed)]
    assert names[0] == names[1] == ["a", "b", "c"]
    # dp.cpp: a's stage sends a (2) and receives b' and c' (2 + 2); relayed: a once, its gradient once
    assert evaluate(direct, stages, [0, 1]).stages[0].comm_s == pytest.approx(6.0)
    assert evaluate(relayed, stages, [0, 1]).stages[0].comm_s == pytest.approx(4.0)
    assert tarnawski_max_load(path, direct, evaluate(direct, stages, [0, 1])) == pytest.approx(
        evaluate(direct, stages, [0, 1]).bottleneck_s)


def test_transfers_option_is_for_tarnawski_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="transfers='bogus' is unknown"):
        load_tarnawski(tmp_path / "x.json", transfers="bogus")
    graph = Path(__file__).parent / "data" / "pipedream" / "alexnet.txt"
    with pytest.raises(ConfigError, match="transfers='direct' is for Tarnawski files"):
        load_graph_or_problem(graph, transfers="direct")


def test_cli_solve_with_direct_transfers(tmp_path: Path) -> None:
    nodes = [{"id": i, "name": f"n{i}", "fpgaLatency": t, "size": 1.0, "isBackwardNode": 0}
             for i, t in enumerate([3.0, 1.0, 1.0, 3.0])]
    edges = [{"sourceId": 0, "destId": 1, "cost": 1.0}, {"sourceId": 1, "destId": 2, "cost": 1.0},
             {"sourceId": 2, "destId": 3, "cost": 1.0}, {"sourceId": 0, "destId": 3, "cost": 1.0}]
    path = tmp_path / "skip.json"
    path.write_text(json.dumps({"maxSizePerFPGA": 10.0, "maxFPGAs": 3, "nodes": nodes, "edges": edges}))
    _register_all()
    runner = CliRunner()
    out = runner.invoke(app, ["solve", str(path), "--transfers", "direct", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["transfers"] == "direct"
    # n0 | n1 n2 | n3: the skip n0 -> n3 is paid by its ends only: 3 + 1 (n0 to both), 2 + 1 + 1, 3 + 1 + 1
    assert doc["objective_s"] == pytest.approx(5.0)
    relayed = json.loads(runner.invoke(app, ["solve", str(path), "--json"]).stdout)
    assert "transfers" not in relayed and relayed["objective_s"] >= doc["objective_s"]
    bad = runner.invoke(app, ["solve", str(Path(__file__).parent / "data" / "pipedream" / "alexnet.txt"),
                              "--devices", "2", "--transfers", "direct"])
    assert bad.exit_code == 2 and "is for Tarnawski files" in bad.output


def test_an_acyclic_tarnawski_file_loads_without_networkx(tmp_path: Path) -> None:
    """Start-up: networkx (130 ms to import) is for merging the cycles some training files have;
    an acyclic file is read without it."""
    import subprocess
    import sys

    nodes = [{"id": i, "name": f"n{i}", "fpgaLatency": 1.0, "size": 1.0, "isBackwardNode": 0} for i in range(3)]
    edges = [{"sourceId": 0, "destId": 1, "cost": 1.0}, {"sourceId": 1, "destId": 2, "cost": 1.0}]
    path = tmp_path / "chain.json"
    path.write_text(json.dumps({"maxSizePerFPGA": 10.0, "maxFPGAs": 2, "nodes": nodes, "edges": edges}))
    code = ("import sys; from fxsplit.ir.formats import load_tarnawski\n"
            "pb = load_tarnawski(sys.argv[1], transfers='direct'); print(len(pb.graph), 'networkx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["3", "False"], out.stdout + out.stderr


def test_auto_leaves_direct_transfers_to_cpsat_where_the_dp_table_is_too_large(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxsplit.errors import SolverError

    g = CondensedGraph.chain([1.0, 2.0, 3.0, 1.0])
    g = CondensedGraph(g.blocks, g.edges, direct=(DirectTransfer(0, (3,), 1.0), DirectTransfer(1, (2,), 0.5)))
    pb = Problem(g, (DeviceSpec("a"), DeviceSpec("b")), link=LinkSpec(bytes_per_s=1.0, latency_s=0.0),
                 transfer_memory=False).check()
    expected = solve(pb, "dp").objective_s
    monkeypatch.setattr(direct_module, "MAX_ROW_TABLE", 4)
    monkeypatch.setattr(direct_module, "FULL_TABLE_DOWNSETS", 0)
    with pytest.raises(SolverError, match="too large a table for direct transfers"):
        solve(pb, "dp")
    plan = solve(pb, "auto")
    assert plan.solver == "cpsat" and plan.status == "optimal" and plan.objective_s == pytest.approx(expected)
