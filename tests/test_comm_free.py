"""Devices whose stages pay no communication (``DeviceSpec.comm_free``: dp.cpp's CPU), and
Tarnawski inputs with ``maxCPUs``: every solver against brute force and against an independent
statement of dp.cpp's throughput objective."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from strategies import problems
from test_solvers_dp import brute_force

from fxsplit.errors import ConfigError
from fxsplit.ir import CondensedGraph, DeviceSpec, LinkSpec, Problem, evaluate
from fxsplit.ir.downsets import count_downsets
from fxsplit.ir.formats import load_tarnawski
from fxsplit.solvers import solve


def _with_a_free_device(problem: Problem, which: int) -> Problem:
    devices = list(problem.devices)
    devices[which % len(devices)] = devices[which % len(devices)].with_(comm_free=True)
    return problem.with_(devices=tuple(devices))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_blocks=6, max_devices=3, heterogeneous=True, device_order=None, objective=None,
                memory_mib=(8, 64)), st.integers(0, 3))
def test_dp_and_cpsat_equal_brute_force_with_a_comm_free_device(problem: Problem, which: int) -> None:
    assume(count_downsets(problem.graph, limit=25) is not None)
    pb = _with_a_free_device(problem, which)
    expected = brute_force(pb)  # every chain and assignment, costed by evaluate
    assume(math.isfinite(expected))
    for solver in ("dp", "cpsat"):
        plan = solve(pb, solver)
        assert plan.status == "optimal", solver
        assert plan.objective_s == pytest.approx(expected, rel=1e-6, abs=1e-6), solver


def test_a_comm_free_stage_pays_nothing_and_its_neighbours_pay_theirs() -> None:
    g = CondensedGraph.chain([1.0, 1.0, 1.0], edge_bytes=4)
    devices = (DeviceSpec("acc0"), DeviceSpec("cpu", comm_free=True), DeviceSpec("acc1"))
    pb = Problem(g, devices, link=LinkSpec(bytes_per_s=1.0, latency_s=0.0), training=False)
    plan = evaluate(pb, [[0], [1], [2]], [0, 1, 2])
    assert [st.comm_s for st in plan.stages] == [4.0, 0.0, 4.0]
    # the same plan with an ordinary middle device: it pays both of its boundaries
    plain = evaluate(pb.with_(devices=(devices[0], DeviceSpec("acc"), devices[2])), [[0], [1], [2]], [0, 1, 2])
    assert [st.comm_s for st in plain.stages] == [4.0, 8.0, 4.0]


# --- Tarnawski inputs with CPUs -------------------------------------------------------------------


def _chain_instance(tmp_path: Path, fpga: list[float], costs: list[float], sizes: list[float], *, fpgas: int,
                    cpus: int, cap: float, ratio: float = 10.0) -> Path:
    nodes = [{"id": i, "name": f"n{i}", "supportedOnFpga": 1, "fpgaLatency": t, "cpuLatency": t * ratio,
              "isBackwardNode": 0, "size": s} for i, (t, s) in enumerate(zip(fpga, sizes, strict=True))]
    edges = [{"sourceId": i, "destId": i + 1, "cost": c} for i, c in enumerate(costs)]
    path = tmp_path / "chain.json"
    path.write_text(json.dumps({"maxSizePerFPGA": cap, "maxFPGAs": fpgas, "maxCPUs": cpus, "nodes": nodes,
                                "edges": edges}))
    return path


def _dp_cpp_objective(fpga: list[float], costs: list[float], sizes: list[float], fpgas: int, cpus: int,
                      cap: float, ratio: float) -> float:
    """dp.cpp's throughput objective on a chain, stated independently: contiguous stages, each on
    a CPU (its nodes' cpuLatency, no communication, no memory limit) or an FPGA (fpgaLatency plus
    the cost of every node whose output crosses the stage's boundary, in or out; infeasible over
    the memory cap), at most ``fpgas`` FPGAs and ``cpus`` CPUs, minimise the largest stage."""
    n, best = len(fpga), math.inf
    for cuts in itertools.chain.from_iterable(itertools.combinations(range(1, n), r) for r in range(n)):
        bounds = [0, *cuts, n]
        stages = list(itertools.pairwise(bounds))
        for kinds in itertools.product("CF", repeat=len(stages)):
            if kinds.count("F") > fpgas or kinds.count("C") > cpus:
                continue
            worst = 0.0
            for (a, b), kind in zip(stages, kinds, strict=True):
                if kind == "C":
                    load = sum(fpga[a:b]) * ratio
                else:
                    if sum(sizes[a:b]) > cap:
                        load = math.inf
                    else:
                        crossing = ([a - 1] if a > 0 else []) + ([b - 1] if b < n else [])  # senders
                        load = sum(fpga[a:b]) + sum(costs[u] for u in crossing)
                worst = max(worst, load)
            best = min(best, worst)
    return best


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 6).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 8).map(float), min_size=n, max_size=n),
    st.lists(st.integers(0, 6).map(float), min_size=n - 1, max_size=n - 1),
    st.lists(st.integers(1, 5).map(float), min_size=n, max_size=n))),
    st.integers(1, 3), st.integers(0, 2), st.sampled_from([4.0, 8.0, 100.0]), st.sampled_from([2.0, 10.0]))
def test_tarnawski_cpus_reproduce_dp_cpps_objective(tmp_path_factory: pytest.TempPathFactory,
                                                     chain: tuple[list[float], list[float], list[float]], fpgas: int,
                                                     cpus: int, cap: float, ratio: float) -> None:
    fpga, costs, sizes = chain
    expected = _dp_cpp_objective(fpga, costs, sizes, fpgas, cpus, cap, ratio)
    assume(math.isfinite(expected) and sum(fpga) > 0)
    path = _chain_instance(tmp_path_factory.mktemp("t"), fpga, costs, sizes, fpgas=fpgas, cpus=cpus, cap=cap,
                           ratio=ratio)
    pb = load_tarnawski(path, link=LinkSpec(bytes_per_s=1.0, latency_s=0.0)).with_(objective="bottleneck")
    assert sum(d.comm_free for d in pb.devices) == cpus
    for solver in ("dp", "cpsat"):
        plan = solve(pb, solver)
        assert plan.status == "optimal"
        assert plan.objective_s == pytest.approx(expected, rel=1e-9), solver


def test_tarnawski_cpu_work_goes_to_the_cpu_when_it_pays(tmp_path: Path) -> None:
    # one FPGA, one CPU 2x slower: the FPGA alone takes 12; a CPU stage of the last 4 takes 8
    path = _chain_instance(tmp_path, [4.0, 4.0, 4.0], [1.0, 1.0], [1.0] * 3, fpgas=1, cpus=1, cap=100.0, ratio=2.0)
    pb = load_tarnawski(path, link=LinkSpec(bytes_per_s=1.0, latency_s=0.0)).with_(objective="bottleneck")
    plan = solve(pb, "dp")
    kinds = [pb.devices[st.device].kind for st in plan.stages]
    assert "cpu" in kinds and plan.objective_s == pytest.approx(9.0)  # FPGA 8 + its outgoing 1; CPU 4 x 2


def test_tarnawski_cpu_speed_must_be_one_ratio(tmp_path: Path) -> None:
    path = _chain_instance(tmp_path, [1.0, 2.0], [1.0], [1.0, 1.0], fpgas=1, cpus=1, cap=10.0)
    data = json.loads(path.read_text())
    data["nodes"][1]["cpuLatency"] = 30.0  # 15x where the other is 10x
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="fpgaLatency / cpuLatency is 0.0666667 at node 1 but 0.1 at node 0"):
        load_tarnawski(path)
    data["nodes"][1]["supportedOnFpga"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="node 1 .* supportedOnFpga false"):
        load_tarnawski(path)


def _training_pair(tmp_path: Path, gradient_cost: float) -> Path:
    """Two layers, each a forward and a backward node of one colour class; the activation costs
    1.0 to send and the gradient ``gradient_cost``."""
    node = {"supportedOnFpga": 1, "cpuLatency": 30.0, "fpgaLatency": 3.0, "size": 1.0}
    data = {"maxSizePerFPGA": 100.0, "maxFPGAs": 2, "maxCPUs": 0,
            "nodes": [{**node, "id": 1, "isBackwardNode": 0, "colorClass": 0},
                      {**node, "id": 2, "isBackwardNode": 0, "colorClass": 1},
                      {**node, "id": 3, "isBackwardNode": 1, "colorClass": 1},
                      {**node, "id": 4, "isBackwardNode": 1, "colorClass": 0}],
            "edges": [{"sourceId": 1, "destId": 2, "cost": 1.0}, {"sourceId": 2, "destId": 3, "cost": 0.5},
                      {"sourceId": 3, "destId": 4, "cost": gradient_cost}]}
    path = tmp_path / f"pair_{gradient_cost}.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("gradient_cost", "theirs"), [(1.0, 8.0), (5.0, 12.0)])
def test_their_costing_of_a_plan_counts_each_crossing_node_once(tmp_path: Path, gradient_cost: float,
                                                                theirs: float) -> None:
    from fxsplit.ir.formats import tarnawski_max_load

    path = _training_pair(tmp_path, gradient_cost)
    pb = load_tarnawski(path)
    plan = solve(pb, "dp")
    # fxsplit: each stage 6 of work and its boundary twice (activation and gradient at 1.0)
    assert plan.num_stages == 2 and plan.bottleneck_s == pytest.approx(8.0)
    # dp.cpp: 6 of work, the activation's sender (1.0) and the gradient's (gradient_cost), once each
    assert tarnawski_max_load(path, pb, plan) == pytest.approx(theirs)
    assert tarnawski_max_load(path, pb, plan, communication=False) == pytest.approx(6.0)


def test_solve_says_when_their_costing_of_the_plan_is_higher(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fxsplit.cli import _register_all, app

    _register_all()
    mirrored = CliRunner().invoke(app, ["solve", str(_training_pair(tmp_path, 1.0))])
    assert mirrored.exit_code == 0 and "warning" not in mirrored.output
    skewed = CliRunner().invoke(app, ["solve", str(_training_pair(tmp_path, 5.0))])
    assert skewed.exit_code == 0 and "warning" in skewed.output and "largest stage load is 12" in skewed.output
