"""The six shared PipeDream graphs: dp proves the optimum with 2, 4 and 8 identical devices."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fxsplit.ir import DeviceSpec, LinkSpec, Problem, trivial_lower_bound
from fxsplit.ir.formats import load_pipedream
from fxsplit.solvers import solve

PIPEDREAM = Path(__file__).resolve().parent / "data" / "pipedream"  # PipeDream's profiles (MIT, see LICENSE.txt there)

GRAPHS = ["alexnet", "vgg16", "resnet18", "resnet50", "densenet121", "gnmt"]


def _problem(name: str, k: int) -> Problem:
    g = load_pipedream(PIPEDREAM / f"{name}.txt")
    devices = tuple(DeviceSpec(f"gpu{i}", memory_bytes=2**50, kind="gpu") for i in range(k))
    return Problem(g, devices, link=LinkSpec(math.inf, 0.0))  # no communication, no memory limit


@pytest.mark.parametrize("name", GRAPHS)
def test_dp_proves_optimum_and_beats_baselines(name: str) -> None:
    previous = math.inf
    for k in (2, 4, 8):
        pb = _problem(name, k)
        plan = solve(pb, "dp")
        assert plan.status == "optimal" and plan.gap == 0.0
        assert plan.objective_s >= trivial_lower_bound(pb) * (1 - 1e-12)
        assert plan.objective_s <= previous * (1 + 1e-12)  # more devices never hurt
        previous = plan.objective_s
        for baseline in ("uniform", "params", "blockpartition", "greedy"):
            assert solve(pb, baseline).objective_s >= plan.objective_s * (1 - 1e-12), baseline
