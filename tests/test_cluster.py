"""Clusters as data (issue 13, item 4): a cluster file of device kinds, nodes and links becomes
devices and per-pair links of a planning problem; bad files get errors that name the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from fxsplit.errors import ConfigError
from fxsplit.ir import PRESETS, CondensedGraph, DeviceSpec, GiB, Problem, load_cluster
from fxsplit.ir.cluster import cluster_from_dict
from fxsplit.solvers import solve

FILE = Path(__file__).parent / "data" / "cluster-a100-fpga.json"


def test_a_cluster_file_gives_devices_node_by_node_with_their_links() -> None:
    c = load_cluster(FILE)
    assert c.name == "4 A100 + 4 FPGA"
    assert [d.name for d in c.devices] == ["gpu0/a100:0", "gpu0/a100:1", "gpu0/slow-gpu:0", "gpu0/slow-gpu:1",
                                           "fpga0/fpga:0", "fpga0/fpga:1", "fpga0/fpga:2", "fpga0/fpga:3"]
    assert c.node_of == (0, 0, 0, 0, 1, 1, 1, 1)
    assert c.devices[0].memory_bytes == 80 * GiB and c.devices[4].memory_bytes == 4 * GiB  # preset, overridden
    assert c.devices[4].peak_flops == PRESETS["fpga"].peak_flops and c.devices[2].peak_flops == 78e12
    speeds = [d.speed for d in c.relative_to(c.devices[0])]
    assert speeds[:2] == [1.0, 1.0] and speeds[2] == pytest.approx(78 / 312) and speeds[4] == pytest.approx(2 / 312)
    pb = Problem(CondensedGraph.chain([1.0] * 8), c.relative_to(c.devices[0]), link=c.inter_node,
                 links=c.link_overrides()).check()
    for i in range(8):
        for j in range(8):
            if i != j:
                same = c.node_of[i] == c.node_of[j]
                assert pb.link_between(i, j) == (c.intra_node if same else c.inter_node)


def test_a_plan_on_a_cluster_keeps_the_heavy_work_on_the_fast_devices() -> None:
    c = load_cluster(FILE)
    graph = CondensedGraph.chain([4.0, 4.0, 1.0, 0.01])
    pb = Problem(graph, c.relative_to(c.devices[0]), link=c.inter_node, links=c.link_overrides(),
                 device_order="fixed").check()
    plan = solve(pb, "dp")
    assert plan.status == "optimal" and not plan.validate(pb)
    heavy = plan.stage_of_block()
    assert all(plan.stages[heavy[b]].device < 2 for b in (0, 1))  # the A100s, not the FPGAs


@pytest.mark.parametrize(("change", "match"), [
    ({"nodes": []}, r"nodes must be a non-empty list"),
    ({"nodes": [{"devices": {"tpu": 2}}]}, r"nodes\[0\]\.devices names kind 'tpu'"),
    ({"nodes": [{"devices": {"a100": 0}}]}, r"nodes\[0\]\.devices\.a100 = 0 must be an int >= 1"),
    ({"device_kinds": {"x": {"preset": "b200"}}}, r"device_kinds\.x\.preset = 'b200' is unknown"),
    ({"device_kinds": {"x": {"flops": 1}}}, r"device_kinds\.x has unknown fields \['flops'\]"),
    ({"device_kinds": {"x": {"peak_flops": -1.0}}}, r"device_kinds\.x: .*peak_flops"),
    ({"links": {"intra_node": {"bytes_per_s": 0}}}, r"links\.intra_node: bytes_per_s=0"),
    ({"links": {"rack": {}}}, r"links may only give intra_node and inter_node"),
    ({"gpus": 8}, r"unknown fields \['gpus'\]"),
    ({"device_kinds": {"x": {"memory_bytes": 2.5}}}, r"device_kinds\.x\.memory_bytes = 2.5 must be a whole number"),
])
def test_a_bad_cluster_file_names_the_key_and_the_fix(change: dict, match: str) -> None:
    data = {**json.loads(FILE.read_text()), **change}
    with pytest.raises(ConfigError, match=match):
        cluster_from_dict(data, "c.json")


def test_an_unreadable_cluster_file_says_so(tmp_path: Path) -> None:
    bad = tmp_path / "c.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read cluster file"):
        load_cluster(bad)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["a100", "v100", "fpga"]), st.integers(1, 3), min_size=1),
                min_size=1, max_size=4))
def test_devices_and_intra_node_pairs_follow_the_node_counts(nodes: list[dict[str, int]]) -> None:
    c = cluster_from_dict({"nodes": [{"devices": n} for n in nodes],
                           "links": {"intra_node": {"bytes_per_s": 1e11}, "inter_node": {"bytes_per_s": 1e10}}})
    sizes = [sum(n.values()) for n in nodes]
    assert len(c.devices) == sum(sizes) and all(isinstance(d, DeviceSpec) for d in c.devices)
    assert len(c.link_overrides()) == sum(k * (k - 1) // 2 for k in sizes)
    assert list(c.node_of) == sorted(c.node_of)  # node by node


def test_plan_cli_plans_over_a_cluster_file(tmp_path: Path) -> None:
    import fxsplit.cli as cli

    cli._register_all()
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli.app, ["plan", "gpt", "--size", "tiny", "--cluster", str(FILE), "--batch-size", "8",
                                          "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "cluster '4 A100 + 4 FPGA': 8 devices in 2 nodes" in result.output
    plan = json.loads(out.read_text())
    assert plan["stages"][0]["device_name"] == "gpu0/a100:0"  # the reference kind leads


def test_a_memory_size_written_as_a_float_is_a_whole_number_of_bytes() -> None:
    """Review finding: ``"memory_bytes": 2e9`` reached the memory bound as a float and crashed it."""
    c = cluster_from_dict({"device_kinds": {"x": {"peak_flops": 1e12, "memory_bytes": 2e9}},
                           "nodes": [{"devices": {"x": 2}}]})
    assert c.devices[0].memory_bytes == 2_000_000_000 and isinstance(c.devices[0].memory_bytes, int)
    pb = Problem(CondensedGraph.chain([1.0] * 4), c.relative_to(c.devices[0])).check()
    assert solve(pb, "cpsat", time_limit_s=10).status == "optimal"


def test_a_yaml_cluster_file_is_the_json_one(tmp_path: Path) -> None:
    """Issue 13 (item 4): YAML with the same keys gives the same cluster; a YAML list is refused."""
    import yaml

    data = json.loads(FILE.read_text())
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_cluster(path) == load_cluster(FILE)
    bad = tmp_path / "bad.yml"
    bad.write_text("- a100\n- a100\n")
    with pytest.raises(ConfigError, match="holds a list; it needs a mapping"):
        load_cluster(bad)
    broken = tmp_path / "broken.yaml"
    broken.write_text("nodes: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_cluster(broken)
