"""Tarnawski et al.'s latency objective (one sample's latency; nodes placed on accelerators and
CPUs): the evaluation against an independent statement of their IP's constraints, CP-SAT against
brute force, the lower bounds and baselines against the optimum, the reader and the CLI."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from fxsplit.cli import _register_all, app
from fxsplit.errors import ConfigError, PlanError
from fxsplit.ir.formats import load_tarnawski_latency
from fxsplit.ir.placement import CPU, PlacementProblem, evaluate_placement, placement_faults
from fxsplit.solvers.latency import (
    chain_lower_bound_s,
    greedy_latency,
    interval_latency,
    path_lower_bound,
    placement_of_stages,
    solve_latency,
)

runner = CliRunner()
_register_all()


@st.composite
def placement_problems(draw: st.DrawFn, max_nodes: int = 6, max_accelerators: int = 3) -> PlacementProblem:
    n = draw(st.integers(1, max_nodes))
    edges = tuple((u, v) for v in range(n) for u in range(v) if draw(st.booleans()) and draw(st.booleans()))
    colour = list(range(n))
    if n >= 3 and draw(st.booleans()):
        a, b = draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True))
        colour[b] = colour[a]
    times = st.sampled_from([0.0, 1.0, 2.0, 3.0, 5.0])
    return PlacementProblem(
        name="drawn", node_ids=tuple(range(100, 100 + n)),
        acc_s=tuple(draw(times) for _ in range(n)),
        cpu_s=tuple(draw(st.sampled_from([1.0, 4.0, 6.0, 10.0])) for _ in range(n)),
        size_bytes=tuple(draw(st.sampled_from([0.0, 1.0, 2.0])) for _ in range(n)),
        out_s=tuple(draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])) for _ in range(n)),
        supported=tuple(draw(st.sampled_from([True, True, True, False])) for _ in range(n)),
        colour=tuple(colour), edges=edges,
        accelerators=draw(st.integers(0, max_accelerators)), memory_bytes=draw(st.sampled_from([2.0, 3.0, 100.0])),
    ).check()


def _valid_placements(problem: PlacementProblem) -> list[tuple[int, ...]]:
    devices = [CPU, *range(problem.accelerators)]
    return [d for d in itertools.product(devices, repeat=len(problem)) if not placement_faults(problem, d)]


def _lip_latency(problem: PlacementProblem, device: tuple[int, ...]) -> float:
    """The least solution of the latency IP's inequalities (Tarnawski et al.'s lip.py) for a
    fixed placement, by iterating them to a fixed point: the smallest ``TotalLatency`` the IP
    allows for this ``x``."""
    n, k = len(problem), problem.accelerators
    lat = [0.0] * n
    start, finish = [0.0] * k, [0.0] * k
    for _ in range(4 * (n + k) + 4):
        old = (list(lat), list(start), list(finish))
        for a in range(k):
            comm_in = {u for u, v in problem.edges if device[v] == a and device[u] != a}
            comm_out = {u for u, v in problem.edges if device[u] == a and device[v] != a}
            start[a] = max([0.0] + [lat[u] for u in comm_in])
            finish[a] = (start[a] + sum(problem.acc_s[v] for v in range(n) if device[v] == a)
                         + sum(problem.out_s[u] for u in comm_in) + sum(problem.out_s[u] for u in comm_out))
        for v in range(n):
            on_cpu = device[v] == CPU
            terms = [problem.cpu_s[v] if on_cpu else 0.0]
            terms += [lat[u] + (problem.cpu_s[v] if on_cpu else 0.0) for u, w in problem.edges if w == v]
            if not on_cpu:
                terms.append(finish[device[v]])
            lat[v] = max(terms)
        if (lat, start, finish) == old:
            return max(lat, default=0.0)
    raise AssertionError("no fixed point: the placement's calls wait on each other")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placement_problems())
def test_evaluation_equals_the_least_solution_of_the_ip_for_every_valid_placement(problem: PlacementProblem) -> None:
    for device in _valid_placements(problem):
        assert evaluate_placement(problem, device).latency_s == pytest.approx(_lip_latency(problem, device), abs=1e-9)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placement_problems())
def test_cpsat_equals_brute_force_and_bounds_and_baselines_bracket_it(problem: PlacementProblem) -> None:
    best = min(evaluate_placement(problem, d).latency_s for d in _valid_placements(problem))
    found = solve_latency(problem, time_limit_s=20)
    assert found.status == "optimal"
    assert found.latency_s == pytest.approx(best, abs=1e-9)
    assert not placement_faults(problem, found.device)
    firsts = [min((v for v, d in enumerate(found.device) if d == a), default=None) for a in range(problem.accelerators)]
    used = [f for f in firsts if f is not None]
    assert firsts[:len(used)] == sorted(used)  # identical accelerators used in order of their first node
    assert found.lower_bound_s <= best + 1e-9
    assert chain_lower_bound_s(problem) <= best + 1e-9
    for heuristic in (greedy_latency, interval_latency):
        placed = heuristic(problem)
        assert not placement_faults(problem, placed.device)
        assert placed.latency_s >= best - 1e-9


def _problem(n: int, edges: list[tuple[int, int]], *, acc: list[float] | None = None, cpu: list[float] | None = None,
             out: list[float] | None = None, size: list[float] | None = None, k: int = 2, cap: float = 100.0,
             colour: list[int] | None = None, supported: list[bool] | None = None) -> PlacementProblem:
    return PlacementProblem("hand", tuple(range(n)), tuple(acc or [1.0] * n), tuple(cpu or [10.0] * n),
                            tuple(size or [0.0] * n), tuple(out or [0.0] * n), tuple(supported or [True] * n),
                            tuple(colour or range(n)), tuple(edges), k, cap).check()


def test_two_contiguous_sets_that_wait_on_each_other_are_not_a_placement() -> None:
    # a1 -> b1 and b2 -> a2: each set is contiguous, but neither call can start first
    pb = _problem(4, [(0, 1), (2, 3)], acc=[0.0] * 4)
    device = (0, 1, 1, 0)
    assert placement_faults(pb, device) and "cycle" in placement_faults(pb, device)[0]
    with pytest.raises(PlanError, match="cycle"):
        evaluate_placement(pb, device)
    # with the classes {a1, a2} and {b1, b2} too big to share an accelerator, zero times let the
    # IP's inequalities hold for that placement; the model's quantum per call rules it out
    tight = _problem(4, [(0, 1), (2, 3)], acc=[0.0] * 4, cpu=[3.0, 5.0, 7.0, 11.0], size=[1.0] * 4, cap=2.0,
                     colour=[0, 1, 1, 0])
    best = solve_latency(tight)
    # b1, b2 on the CPUs: b2 (7), then the call {a1, a2} (7), then b1 (+5)
    assert best.status == "optimal" and best.latency_s == pytest.approx(12.0) and best.device == (0, CPU, CPU, 0)


def test_placement_faults_name_each_broken_rule() -> None:
    pb = _problem(3, [(0, 1), (1, 2)], size=[2.0, 2.0, 2.0], cap=3.0, supported=[True, False, True],
                  colour=[0, 1, 0])
    faults = " ".join(placement_faults(pb, (0, 0, 1)))
    assert "not supported" in faults and "colour class 0" in faults and "holds 4 bytes > 3" in faults
    line = _problem(3, [(0, 1), (1, 2)])
    assert "not contiguous" in placement_faults(line, (0, CPU, 0))[0]
    assert placement_faults(line, (0, 5, CPU)) == ["node 1 on device 5; devices are -1 (CPU) or 0..1"]


def test_a_chain_is_costed_with_transfers_in_and_out_of_each_call() -> None:
    pb = _problem(3, [(0, 1), (1, 2)], acc=[1.0, 2.0, 4.0], cpu=[10.0, 20.0, 40.0], out=[0.5, 0.25, 0.0])
    # cpu(0) = 10; acc0 = {1, 2}: in 0.5 + 2 + 4, nothing leaves
    assert evaluate_placement(pb, (CPU, 0, 0)).latency_s == pytest.approx(16.5)
    # acc0 = {0}, acc1 = {1}, cpu 2: 1 + 0.5 out; 0.5 in + 2 + 0.25 out; 40
    assert evaluate_placement(pb, (0, 1, CPU)).latency_s == pytest.approx(1.5 + 2.75 + 40)
    best = solve_latency(pb)
    assert best.latency_s == pytest.approx(7.0) and best.device == (0, 0, 0)


def test_the_path_bound_is_tight_on_a_chain_and_counts_memory() -> None:
    # a chain whose memory needs two accelerators: one transfer between them is unavoidable
    pb = _problem(4, [(0, 1), (1, 2), (2, 3)], acc=[1.0] * 4, cpu=[100.0] * 4, out=[3.0] * 4,
                  size=[1.0] * 4, cap=2.0)
    best = solve_latency(pb)
    assert best.latency_s == pytest.approx(4 + 3 + 3)
    assert path_lower_bound(pb, [0, 1, 2, 3], pb.acc_s, pb.cpu_s, pb.out_s) == pytest.approx(10.0)
    # one accelerator cannot hold it: the rest on the CPU
    one = pb.with_accelerators(1)
    assert chain_lower_bound_s(one) == pytest.approx(solve_latency(one).latency_s)
    # an unsupported node splits the chain: the bound knows no interval crosses it
    split = _problem(3, [(0, 1), (1, 2)], acc=[1.0] * 3, cpu=[100.0, 5.0, 100.0], out=[1.0] * 3,
                     supported=[True, False, True])
    assert solve_latency(split).latency_s == pytest.approx(2 + 5 + 2)
    assert chain_lower_bound_s(split) == pytest.approx(9.0)


def test_a_hint_is_checked_and_never_beaten_by_the_result() -> None:
    pb = _problem(3, [(0, 1), (1, 2)], acc=[1.0, 2.0, 4.0], out=[0.5, 0.25, 0.0])
    hinted = solve_latency(pb, hint=placement_of_stages(pb, [[0, 1], [2]], [True, True]))
    assert hinted.latency_s == pytest.approx(7.0) and hinted.status == "optimal"
    wrong = placement_of_stages(_problem(2, [(0, 1)]), [[0], [1]], [True, True])
    with pytest.raises(PlanError, match="devices for 3 nodes"):
        solve_latency(pb, hint=wrong)


def test_a_throughput_split_is_costed_as_a_placement() -> None:
    pb = _problem(3, [(0, 1), (1, 2)], acc=[1.0, 2.0, 4.0], out=[0.5, 0.25, 0.0], k=2)
    placed = placement_of_stages(pb, [[0, 1], [2]], [True, True])
    assert placed.device == (0, 0, 1) and placed.latency_s == pytest.approx(3 + 0.25 + 0.25 + 4)
    with pytest.raises(PlanError, match="devices are -1"):
        placement_of_stages(pb, [[0], [1], [2]], [True, True, True])


# --- the reader --------------------------------------------------------------------------------


def _instance(tmp_path: Path, **changes: object) -> Path:
    data = {
        "maxSizePerFPGA": 10.0, "maxFPGAs": 2, "maxCPUs": 1,
        "nodes": [
            {"id": 7, "supportedOnFpga": 1, "cpuLatency": 10.0, "fpgaLatency": 1.0, "isBackwardNode": 0, "size": 4.0},
            {"id": 3, "supportedOnFpga": 0, "cpuLatency": 5.0, "fpgaLatency": 0.5, "isBackwardNode": 0},
            {"id": 9, "supportedOnFpga": 1, "cpuLatency": 20.0, "fpgaLatency": 2.0, "isBackwardNode": 0,
             "colorClass": 1, "size": 8.0},
        ],
        "edges": [{"sourceId": 7, "destId": 3, "cost": 0.5}, {"sourceId": 7, "destId": 9, "cost": 0.5},
                  {"sourceId": 3, "destId": 9, "cost": 0.25}],
    }
    data.update(changes)
    path = tmp_path / "instance.json"
    path.write_text(json.dumps(data))
    return path


def test_the_reader_keeps_every_field_with_the_ips_meaning(tmp_path: Path) -> None:
    pb = load_tarnawski_latency(_instance(tmp_path), time_unit_s=1e-3)
    assert pb.node_ids == (7, 3, 9)  # a topological order
    assert pb.acc_s == pytest.approx((1e-3, 0.5e-3, 2e-3)) and pb.cpu_s == pytest.approx((10e-3, 5e-3, 20e-3))
    assert pb.out_s == pytest.approx((0.5e-3, 0.25e-3, 0.0)) and pb.size_bytes == (4.0, 0.0, 8.0)
    assert pb.supported == (True, False, True) and pb.edges == ((0, 1), (0, 2), (1, 2))
    assert pb.accelerators == 2 and pb.memory_bytes == 10.0
    assert len(set(pb.colour)) == 3  # nodes without a class get classes of their own
    best = solve_latency(pb)
    assert best.status == "optimal" and best.device[1] == CPU


@pytest.mark.parametrize(("changes", "match"), [
    ({"edges": [{"sourceId": 7, "destId": 3, "cost": 0.5}, {"sourceId": 7, "destId": 9, "cost": 0.7}]},
     "out-edges cost 0.5 and 0.7"),
    ({"edges": [{"sourceId": 7, "destId": 3, "cost": 0.5}, {"sourceId": 3, "destId": 7, "cost": 0.5}]}, "cycle"),
    ({"edges": [{"sourceId": 7, "destId": 4, "cost": 0.5}]}, "not in 'nodes'"),
    ({"nodes": [{"id": 1, "supportedOnFpga": 1, "cpuLatency": 1.0, "fpgaLatency": 1.0, "isBackwardNode": 1}],
      "edges": []}, "backward node"),
    ({"nodes": [{"id": 1, "supportedOnFpga": 1, "cpuLatency": 1.0}], "edges": []}, "fpgaLatency"),
])
def test_the_reader_refuses_what_the_model_cannot_mean(tmp_path: Path, changes: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_tarnawski_latency(_instance(tmp_path, **changes))


def test_cli_solves_the_latency_objective_and_prints_their_output_fields(tmp_path: Path) -> None:
    path = _instance(tmp_path)
    res = runner.invoke(app, ["solve", str(path), "--objective", "latency", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["objective"] == "latency" and doc["status"] == "optimal"
    assert doc["totalLatency"] == pytest.approx(doc["latency_s"])
    placed = sorted(i for f in doc["fpgas"] for i in f["nodes"]) + doc["cpus"][0]["nodes"]
    assert sorted(placed) == [3, 7, 9]
    assert doc["baselines"]["all on CPUs"] == pytest.approx(35.0)
    table = runner.invoke(app, ["solve", str(path), "--objective", "latency", "--devices", "1", "--solver", "greedy"])
    assert table.exit_code == 0 and "latency" in table.output
    bad = runner.invoke(app, ["solve", str(path), "--objective", "latency", "--microbatches", "4"])
    assert bad.exit_code == 2 and "--microbatches" in bad.output
