"""Every number at the IR boundary is validated: NaN, inf and negative values are refused with the
field and the value named (issue 10: they used to give "optimal" plans of 0 ms or -2000 ms)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fxsplit.errors import ConfigError, PlanError
from fxsplit.ir import Block, CondensedGraph, DeviceSpec, LinkSpec, Problem

BAD = st.sampled_from([math.nan, math.inf, -math.inf, -1.0])


@given(attr=st.sampled_from(["peak_flops", "memory_bandwidth_bytes_per_s", "memory_bytes", "speed"]), value=BAD)
def test_device_numbers_must_be_finite_and_positive(attr: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"{attr}={value!r} must be a finite, positive number"):
        DeviceSpec("d", **{attr: value}).check()


@given(value=BAD)
def test_device_overhead_must_be_finite_and_not_negative(value: float) -> None:
    with pytest.raises(ConfigError, match="op_overhead_s"):
        DeviceSpec("d", op_overhead_s=value).check()


@given(latency=BAD)
def test_link_latency_must_be_finite_and_not_negative(latency: float) -> None:
    problem = Problem(CondensedGraph.chain([1.0]), (DeviceSpec("a"),), link=LinkSpec(1e9, latency))
    with pytest.raises(ConfigError, match=f"default link: latency_s={latency!r}"):
        problem.check()


@given(bw=st.sampled_from([math.nan, 0.0, -1e9]))
def test_link_bandwidth_must_be_positive(bw: float) -> None:
    problem = Problem(CondensedGraph.chain([1.0]), (DeviceSpec("a"), DeviceSpec("b")), links=((0, 1, LinkSpec(bw, 0.0)),))
    with pytest.raises(ConfigError, match=r"link \(0, 1\): bytes_per_s"):
        problem.check()


def test_an_infinite_bandwidth_is_a_free_link() -> None:
    link = LinkSpec(math.inf, 0.0).check()
    assert link.transfer_s(1e12) == 0.0


@given(attr=st.sampled_from(["fwd_s", "bwd_s", "flops", "activation_bytes"]), value=st.sampled_from([math.nan, math.inf]))
def test_block_costs_must_be_finite(attr: str, value: float) -> None:
    graph = CondensedGraph((Block(0, "b", **{attr: value}),))
    with pytest.raises(PlanError, match=f"{attr}={value}; costs must be finite"):
        graph.check()


@given(factor=BAD)
def test_memory_factors_must_be_finite_and_not_negative(factor: float) -> None:
    problem = Problem(CondensedGraph.chain([1.0]), (DeviceSpec("a"),), optimizer_state_factor=factor)
    with pytest.raises(ConfigError, match="optimizer_state_factor"):
        problem.check()
