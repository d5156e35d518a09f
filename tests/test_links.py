"""Measured links: the latency + bandwidth fit, the device probe, and the ping-pong between ranks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fxsplit.errors import ConfigError
from fxsplit.runtime.links import (
    SAME_DEVICE_LINK,
    fit_link,
    probe_devices,
    probe_pipeline_links,
    probe_ranks,
)


@given(latency_s=st.floats(0.0, 1e-3), gbps=st.floats(0.01, 1000.0),
       sizes=st.lists(st.integers(4, 2**26), min_size=2, max_size=5, unique=True))
def test_fit_link_recovers_latency_and_bandwidth(latency_s: float, gbps: float, sizes: list[int]) -> None:
    bw = gbps * 1e9
    link = fit_link(sizes, [latency_s + s / bw for s in sizes])
    assert link.bytes_per_s == pytest.approx(bw, rel=1e-6)
    assert link.latency_s == pytest.approx(latency_s, rel=1e-6, abs=1e-12)
    assert link.transfer_s(sizes[0]) == pytest.approx(latency_s + sizes[0] / bw, rel=1e-6)


def test_fit_link_refuses_times_that_do_not_grow() -> None:
    with pytest.raises(ConfigError, match="do not grow with sizes"):
        fit_link([1024, 4096], [2e-5, 1e-5])
    with pytest.raises(ConfigError, match="at least two message sizes"):
        fit_link([1024, 1024], [1e-5, 1e-5])


def test_probe_between_cpu_devices_is_a_hand_over() -> None:
    assert probe_devices("cpu", "cpu") == SAME_DEVICE_LINK


def test_probe_checks_its_arguments() -> None:
    with pytest.raises(ConfigError, match="must be ints >= 4 bytes"):
        probe_devices("cpu", "cpu", sizes_bytes=(2,))
    with pytest.raises(ConfigError, match="cannot probe"):
        probe_devices("cpu", "nonsense:0")
    with pytest.raises(ConfigError, match="needs an initialised process group"):
        probe_ranks(1)


def _ping_pong(rank: int, world: int, out_dir: str) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        link = probe_ranks(1 - rank, sizes_bytes=(2**10, 2**16, 2**20), repeats=5)
        links = probe_pipeline_links(sizes_bytes=(2**10, 2**20), repeats=3)
        return {"bytes_per_s": link.bytes_per_s, "latency_s": link.latency_s, "pairs": [(i, j) for i, j, _ in links]}
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_probe_ranks_on_loopback_gives_both_ranks_one_link(tmp_path) -> None:
    from dist_utils import check_ok, launch

    results = launch(_ping_pong, 2, tmp_path, deadline_s=60)
    check_ok(results)
    a, b = results[0]["result"], results[1]["result"]
    assert a == b
    # gloo over loopback: between 10 MB/s and 1 TB/s, a latency under 10 ms.
    assert 1e7 < a["bytes_per_s"] < 1e12 and 0 <= a["latency_s"] < 1e-2
    assert a["pairs"] == [(0, 1)]


def test_compile_on_cpu_devices_plans_hand_overs_not_transfers() -> None:
    """CPU "devices" of one process share memory: the probed links cost nothing, so no stage
    pays communication (the default 25 GB/s link used to charge every boundary)."""
    import torch
    from torch import nn

    import fxsplit

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    # Both devices must be used: on a model this small a busy machine's timings may make one
    # stage cheapest (CI picked one once), and a one-stage plan has no boundary to cost.
    pipe = fxsplit.compile(model, ["cpu", "cpu"], (torch.randn(4, 8),), microbatches=2, cost_model="profiled",
                           options=fxsplit.CompileOptions(allow_idle_devices=False))
    assert pipe.plan.num_ranks == 2  # two stages each when interleaved 1F1B wins
    assert all(st.comm_s == 0.0 for st in pipe.plan.stages)


def test_distributed_planning_takes_a_given_link_without_probing(monkeypatch) -> None:
    """``CompileOptions(link=LinkSpec(...))`` holds for every pair of ranks: nothing is probed
    (a probe would need a process group); an unknown ``link`` is a ConfigError."""
    import torch

    import fxsplit.dist_plan as dp
    from fxsplit.api import CompileOptions
    from fxsplit.ir import LinkSpec

    def no_probe(device: str) -> None:
        raise AssertionError("probed although a LinkSpec was given")

    monkeypatch.setattr(dp, "probe_pipeline_links", no_probe)
    assert dp._links(CompileOptions(link=LinkSpec(bytes_per_s=1e9)), torch.device("cpu"), 4) == ()
    with pytest.raises(ConfigError, match="CompileOptions.link='fast'"):
        dp._links(CompileOptions(link="fast"), torch.device("cpu"), 2)
