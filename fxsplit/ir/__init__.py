"""fxsplit's torch-free intermediate representation: graph, devices, problem, plan, names.

Nothing in this package imports torch, so a solver bug is reproduced from a JSON file.
"""

from fxsplit.ir.cluster import Cluster, load_cluster
from fxsplit.ir.devices import PRESETS, DeviceSpec, GiB, LinkSpec
from fxsplit.ir.graph import Block, CondensedGraph, DirectTransfer, Edge
from fxsplit.ir.names import (
    COST_MODELS,
    OBJECTIVES,
    RECOMPUTE,
    SCHEDULES,
    CostModelName,
    ObjectiveName,
    RecomputeName,
    ScheduleName,
)
from fxsplit.ir.plan import Plan, StagePlan, evaluate, trivial_lower_bound
from fxsplit.ir.problem import Problem

__all__ = [
    "Block",
    "COST_MODELS",
    "Cluster",
    "CondensedGraph",
    "CostModelName",
    "DeviceSpec",
    "DirectTransfer",
    "Edge",
    "GiB",
    "LinkSpec",
    "OBJECTIVES",
    "ObjectiveName",
    "PRESETS",
    "Plan",
    "Problem",
    "RECOMPUTE",
    "RecomputeName",
    "SCHEDULES",
    "ScheduleName",
    "StagePlan",
    "evaluate",
    "load_cluster",
    "trivial_lower_bound",
]
