"""fxsplit's torch-free intermediate representation: graph, devices, problem, plan.

Nothing in this package imports torch, so a solver bug is reproduced from a JSON file.
"""

from fxsplit.ir.cluster import Cluster, load_cluster
from fxsplit.ir.devices import PRESETS, DeviceSpec, GiB, LinkSpec
from fxsplit.ir.graph import Block, CondensedGraph, Edge
from fxsplit.ir.plan import Plan, StagePlan, evaluate, trivial_lower_bound
from fxsplit.ir.problem import OBJECTIVES, SCHEDULES, Problem

__all__ = [
    "Block",
    "Cluster",
    "CondensedGraph",
    "DeviceSpec",
    "Edge",
    "GiB",
    "LinkSpec",
    "OBJECTIVES",
    "PRESETS",
    "Plan",
    "Problem",
    "SCHEDULES",
    "StagePlan",
    "evaluate",
    "load_cluster",
    "trivial_lower_bound",
]
