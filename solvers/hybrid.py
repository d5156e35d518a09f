"""Hybrid parallelism: pipeline stages x stage replicas x per-layer strategies in one plan (torch-free).

``N`` identical devices form a mesh of shape ``[pp, dp, tp]`` (ranks ``r = (s * dp + d) * tp + t``,
``tp`` innermost so its groups sit on neighbouring devices): ``pp`` pipeline stages, each stage
replicated on ``dp`` groups (PipeDream's stage replication, Narayanan et al., SOSP 2019, here
uniform as a ``DeviceMesh`` needs), and inside each group ``tp`` devices run every layer with its
own parallelization strategy (PaSE, Elango, IPDPS 2021: Shard / Replicate / Partial per node,
chosen by :func:`fxsplit.passes.layer_costs.layer_parallel_costs`, or Megatron's column/row
linear layers). Meshes of ``K`` devices for every divisor ``K`` of ``N`` are tried (the rest
idle), so more devices are never predicted slower and the pipeline-only plan (``[N, 1, 1]``,
today's) and pure data parallelism (``[1, N, 1]``) are points of the search.

Model of a step, for a problem whose graph holds one micro-batch's costs and ``m`` micro-batches
per step (the global batch; each replica trains ``m / dp`` of them):

* per-layer strategies over ``tp`` devices turn each block's times, parameter and activation
  bytes into the plan's (:class:`LayerParallelCosts`: compute divided by the shards, the
  collectives each placement change needs and the gradient all-reduce inside the group added);
* ``pp = 1``: data parallelism over the ``dp`` groups, the faster of one pass over the replica's
  samples (:func:`~fxsplit.solvers.data_parallel.data_parallel`: ``forward + max(backward,
  all-reduce)``, where its activations fit) and accumulating its ``m / dp`` micro-batches one by one
  (the formula below with one stage);
* ``pp >= 1``: the exact pipeline split of the transformed graph over ``pp`` devices with
  ``m / dp`` micro-batches (GPipe/1F1B step, ``Σ stage times + (m/dp - 1) · bottleneck``), then
  each stage's gradient all-reduce over its ``dp`` replicas (ring: ``2 (dp-1)/dp · bytes / B +
  2 (dp-1) α``), which starts when the stage's last backward ends: stage ``j`` ends its backward
  ``Σ_{k<j} backward_k`` before stage 0, so the step is ``pipeline + max_j (all-reduce_j -
  Σ_{k<j} backward_k)^+``.

Links come from the problem (``link`` / ``links``, e.g. a cluster file's NVLink inside a node and
the network across): a stage-to-stage hop between devices ``s * dp * tp`` and ``(s + 1) * dp * tp``,
the all-reduce over the ring's slowest hop.

Example:
    >>> from fxsplit.ir import CondensedGraph, DeviceSpec, Problem
    >>> pb = Problem(CondensedGraph.chain([1.0] * 8), (DeviceSpec("d"),) * 4, microbatches=4)
    >>> best = plan_hybrid(pb).best
    >>> (best.pp, best.dp, best.tp) in {(4, 1, 1), (1, 4, 1), (2, 2, 1)}
    True
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fxsplit.errors import ConfigError, InfeasibleError, SolverError
from fxsplit.ir import CondensedGraph, LinkSpec, Plan, Problem
from fxsplit.ir.plan import trivial_lower_bound
from fxsplit.ir.problem import LOOPED_SCHEDULES
from fxsplit.solvers.data_parallel import data_parallel
from fxsplit.solvers.registry import solve

__all__ = ["HybridLayout", "HybridPlan", "LayerParallelCosts", "mesh_shapes", "plan_hybrid"]


@dataclass(frozen=True)
class LayerParallelCosts:
    """A per-layer plan over ``degree`` devices, as factors on a condensed graph's blocks.

    Attributes:
        degree: ``tp``, the devices each layer is split over.
        family: ``"pase"`` (each node's best strategy) or ``"megatron"`` (column/row linears).
        time_factors: ``[num_blocks]`` the block's forward + backward seconds per device under the
            plan (compute of the shard, redistributions into its nodes, in-group gradient
            all-reduces) over its seconds on one device; 1.0 for a block without work.
        param_factors: ``[num_blocks]`` per-device parameter bytes over the whole block's.
        activation_factors: ``[num_blocks]`` per-device activation bytes over the block's.
        placements: Output placement (``"R"``, ``"S(0)"``, ...) -> number of nodes that take it.
        split_nodes: ``[num_blocks]`` nodes of the block whose output is not replicated.
        solve_time_s: Seconds the strategy search took.

    Raises:
        ConfigError: for a degree below 2, or a factor that is negative or not finite.
    """

    degree: int
    family: str
    time_factors: tuple[float, ...]
    param_factors: tuple[float, ...]
    activation_factors: tuple[float, ...]
    placements: Mapping[str, int] = field(default_factory=dict)
    split_nodes: tuple[int, ...] = ()
    solve_time_s: float = 0.0

    def __post_init__(self) -> None:
        if self.degree < 2:
            raise ConfigError(f"a per-layer plan over degree={self.degree} devices: give 2 or more (1 is no split)")
        for label, factors in (("time_factors", self.time_factors), ("param_factors", self.param_factors),
                               ("activation_factors", self.activation_factors)):
            bad = [(i, f) for i, f in enumerate(factors) if not (0.0 <= f < math.inf)]
            if bad:
                raise ConfigError(f"LayerParallelCosts(degree={self.degree}, family={self.family!r}).{label}: "
                                  f"block {bad[0][0]} has {bad[0][1]!r}; factors are finite and >= 0")

    def apply(self, graph: CondensedGraph) -> CondensedGraph:
        """``graph`` with each block's times, parameter and activation bytes as one device of
        the group holds them (boundary values stay whole: every device of the group receives
        and sends them).

        Raises:
            ConfigError: when the factors are not one per block of ``graph``.
        """
        n = len(graph.blocks)
        if not len(self.time_factors) == len(self.param_factors) == len(self.activation_factors) == n:
            raise ConfigError(f"per-layer costs over {len(self.time_factors)} blocks for a graph of {n} blocks "
                              f"({graph.name!r}); compute them on the same condensed graph")
        timed = CondensedGraph(graph.blocks, graph.edges, graph.name).with_time_factors(
            [max(f, 1e-12) for f in self.time_factors], [max(f, 1e-12) for f in self.time_factors])
        blocks = tuple(replace(b, param_bytes=int(b.param_bytes * p), replica_param_bytes=int(b.replica_param_bytes * p),
                               activation_bytes=int(b.activation_bytes * a))
                       for b, p, a in zip(timed.blocks, self.param_factors, self.activation_factors, strict=True))
        return CondensedGraph(blocks, graph.edges, graph.name)


@dataclass(frozen=True)
class HybridLayout:
    """One mesh ``[pp, dp, tp]`` and its predicted step.

    Attributes:
        pp, dp, tp: Pipeline stages (mesh size; ``stages`` may use fewer when idle devices are
            allowed), replicas of each stage, devices per layer group.
        family: The per-layer plan (``"pase"``, ``"megatron"``; ``"none"`` when ``tp == 1``).
        step_s: Predicted seconds of one training step (``inf``: does not fit or no plan).
        pipeline_s: The pipeline (or, ``pp == 1``, the data-parallel compute) part, seconds.
        allreduce_s: The replicas' gradient all-reduce that the backward does not hide, seconds.
        memory_bytes: The most any device holds, bytes.
        stages: Stages the pipeline split uses (``pp == 1``: 1).
        plan: The pipeline plan over one replica's ``pp`` devices (None for ``pp == 1``).
        placements: Output placement -> nodes that take it, under the per-layer plan.
        stage_rows: Per stage: ``{"stage", "ranks", "replicas", "tp", "split_nodes", "compute_s",
            "comm_s", "allreduce_s", "memory_bytes"}`` (times per micro-batch, memory per device).
        note: Why the layout has no step (does not fit, no plan within the time limit), else "".
    """

    pp: int
    dp: int
    tp: int
    family: str
    step_s: float
    pipeline_s: float = 0.0
    allreduce_s: float = 0.0
    memory_bytes: float = 0.0
    stages: int = 0
    plan: Plan | None = field(default=None, compare=False, repr=False)
    placements: Mapping[str, int] = field(default_factory=dict, compare=False)
    stage_rows: tuple[Mapping[str, Any], ...] = field(default=(), compare=False)
    note: str = ""

    @property
    def devices(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.step_s)

    @property
    def label(self) -> str:
        tp = f"{self.tp} ({self.family})" if self.tp > 1 else "1"
        return f"pp {self.pp} x dp {self.dp} x tp {tp}"

    def to_dict(self) -> dict[str, Any]:
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp, "family": self.family, "devices": self.devices,
                "step_s": self.step_s if self.feasible else None, "pipeline_s": self.pipeline_s,
                "allreduce_s": self.allreduce_s, "memory_bytes": self.memory_bytes, "stages": self.stages,
                "placements": dict(self.placements), "note": self.note, "stages_table": [dict(r) for r in self.stage_rows],
                "stage_blocks": [list(st.blocks) for st in self.plan.stages] if self.plan is not None else None}


#: Baseline families printed beside the hybrid plan: name -> which layouts belong to it.
FAMILIES: dict[str, Any] = {
    "data parallel": lambda lay: lay.pp == 1 and lay.tp == 1,
    "pipeline": lambda lay: lay.pp > 1 and lay.dp == 1 and lay.tp == 1,
    "Megatron TP (x DP)": lambda lay: lay.pp == 1 and lay.family == "megatron",
    "per-layer (PaSE) x DP": lambda lay: lay.pp == 1 and lay.family == "pase",
    "pipeline x DP": lambda lay: lay.pp > 1 and lay.dp > 1 and lay.tp == 1,
}


@dataclass(frozen=True)
class HybridPlan:
    """Every mesh tried, the best, and the best of each family.

    Attributes:
        best: The fastest feasible layout.
        layouts: Every layout tried, fastest first.
        baselines: Family name (:data:`FAMILIES`) -> its fastest feasible layout (None: none fits).
        devices: ``N``.
        microbatches: ``m`` per step (global).
        solve_time_s: Wall seconds of the search.
        costs: Where the blocks' times came from (``"analytic"``, ``"profiled"``), as the
            caller says.
    """

    best: HybridLayout
    layouts: tuple[HybridLayout, ...]
    baselines: Mapping[str, HybridLayout | None]
    devices: int
    microbatches: int
    solve_time_s: float = 0.0
    costs: str = "analytic"

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (``plan.json``)."""
        return {"format": "fxsplit-hybrid-plan", "version": 1, "devices": self.devices,
                "microbatches": self.microbatches, "solve_time_s": self.solve_time_s, "costs": self.costs,
                "best": self.best.to_dict(), "baselines": {k: v.to_dict() if v else None for k, v in self.baselines.items()},
                "layouts": [lay.to_dict() for lay in self.layouts]}


def mesh_shapes(num_devices: int, *, max_tp: int | None = None) -> list[tuple[int, int, int]]:
    """Every ``(pp, dp, tp)`` whose product divides ``num_devices`` (``tp <= max_tp``).

    Example:
        >>> mesh_shapes(4)
        [(1, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 1), (1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]
    """
    if num_devices < 1:
        raise ConfigError(f"num_devices={num_devices}; a mesh needs at least one device")
    out = []
    for k in (d for d in range(1, num_devices + 1) if num_devices % d == 0):
        for pp in (d for d in range(1, k + 1) if k % d == 0):
            for dp in (d for d in range(1, k // pp + 1) if (k // pp) % d == 0):
                tp = k // pp // dp
                if max_tp is None or tp <= max_tp:
                    out.append((pp, dp, tp))
    return sorted(out, key=lambda s: (s[0] * s[1] * s[2], s[0], s[1]))


def _ring_link(problem: Problem, ranks: Sequence[int]) -> LinkSpec:
    """The slowest hop of a ring over ``ranks`` (bandwidth first, then latency)."""
    hops = [problem.link_between(a, b) for a, b in zip(ranks, [*ranks[1:], ranks[0]], strict=True) if a != b]
    return min(hops, key=lambda s: (s.bytes_per_s, -s.latency_s)) if hops else problem.link


def _allreduce_s(nbytes: float, n: int, link: LinkSpec) -> float:
    return 2 * (n - 1) / n * nbytes / link.bytes_per_s + 2 * (n - 1) * link.latency_s if n > 1 and nbytes else 0.0


def _check_problem(problem: Problem) -> None:
    problem.check()
    first = problem.devices[0]
    odd = [d for d in problem.devices
           if (d.speed, d.memory_bytes, d.comm_free) != (first.speed, first.memory_bytes, first.comm_free)]
    if odd:
        raise ConfigError(f"device {odd[0].name!r} (speed {odd[0].speed}, {odd[0].memory_bytes} bytes) differs from "
                          f"{first.name!r} (speed {first.speed}, {first.memory_bytes} bytes): a [pp, dp, tp] mesh "
                          "needs identical devices; plan heterogeneous devices as a pipeline (fxsplit.compile)")
    if problem.stages_per_device > 1 or problem.schedule in LOOPED_SCHEDULES:
        raise ConfigError(f"schedule={problem.schedule!r}, stages_per_device={problem.stages_per_device}: the hybrid "
                          "search costs one stage per device under gpipe or 1f1b; pick one of those")


def _layout(problem: Problem, pp: int, dp: int, tp: int, costs: LayerParallelCosts | None, solver: str,
            time_limit_s: float | None, graph: CondensedGraph | None = None) -> HybridLayout:
    """The mesh's best layout; ``graph``: ``problem.graph`` with ``costs`` applied, when the
    caller has it."""
    family, placements = _family(costs)
    if graph is None:
        graph = costs.apply(problem.graph) if costs is not None else problem.graph
    m = problem.microbatches
    device = problem.devices[0]
    if m % dp:
        return HybridLayout(pp, dp, tp, family, math.inf, placements=placements,
                            note=f"{m} micro-batches do not divide over {dp} replicas")
    group = dp * tp  # ranks between one stage's device and the next's
    piped = _replicated_tp(_pipelined(problem, graph, pp, dp, tp, costs, solver, time_limit_s), costs)
    if pp > 1:
        return piped
    # one stage: the replica's samples in one pass (data parallelism), or accumulated micro-batch by micro-batch
    ring = _ring_link(problem, [d * tp for d in range(dp)])
    est = data_parallel(Problem(graph, (device,) * dp, link=ring, microbatches=m, training=problem.training,
                                optimizer_state_factor=problem.optimizer_state_factor,
                                grad_factor=problem.grad_factor))
    if not est.fits or est.step_s > piped.step_s:
        return piped
    row = {"stage": 0, "ranks": [0, group - 1], "replicas": dp, "tp": tp,
           "split_nodes": sum(costs.split_nodes) if costs is not None else 0, "compute_s": est.compute_s,
           "comm_s": 0.0, "allreduce_s": est.allreduce_s, "memory_bytes": est.memory_bytes}
    return _replicated_tp(HybridLayout(pp, dp, tp, family, est.step_s, est.compute_s,
                                       max(0.0, est.step_s - est.compute_s), est.memory_bytes, 1, None, placements,
                                       (row,), "one pass"), costs)


def _replicated_tp(layout: HybridLayout, costs: LayerParallelCosts | None) -> HybridLayout:
    """``layout``, its note saying so when its per-layer plan splits no node (per-block counts
    given, all zero): then every one of a stage's ``tp`` ranks runs the whole stage on the same
    samples (the time of ``tp = 1``, with ``tp - 1`` ranks duplicating it)."""
    if costs is None or not layout.feasible or not costs.split_nodes or any(costs.split_nodes):
        return layout
    return replace(layout, note="; ".join(filter(None, [layout.note, f"tp splits nothing: {layout.tp} copies"])))


def _family(costs: LayerParallelCosts | None) -> tuple[str, dict[str, int]]:
    """The per-layer plan's family and output placements (``"none"`` and none for ``tp = 1``)."""
    return (costs.family, dict(costs.placements)) if costs is not None else ("none", {})


def _replica_problem(problem: Problem, graph: CondensedGraph, pp: int, dp: int, tp: int) -> Problem:
    """One replica's pipeline: ``pp`` of ``problem``'s devices ``dp * tp`` ranks apart, over the
    links between them, ``m / dp`` micro-batches."""
    group = dp * tp
    links = tuple((i, j, problem.link_between(i * group, j * group)) for i in range(pp) for j in range(i + 1, pp))
    return Problem(graph, (problem.devices[0],) * pp, link=problem.link, links=links,
                   microbatches=problem.microbatches // dp, schedule=problem.schedule, objective="makespan",
                   training=problem.training, optimizer_state_factor=problem.optimizer_state_factor,
                   grad_factor=problem.grad_factor, allow_idle_devices=problem.allow_idle_devices,
                   recompute=problem.recompute, transfer_memory=problem.transfer_memory)


def _pipelined(problem: Problem, graph: CondensedGraph, pp: int, dp: int, tp: int, costs: LayerParallelCosts | None,
               solver: str, time_limit_s: float | None) -> HybridLayout:
    """The layout as a pipeline of ``pp`` stages (one: gradient accumulation) of ``m / dp``
    micro-batches per replica, each stage's all-reduce after its last backward."""
    family, placements = _family(costs)
    group = dp * tp
    sub = _replica_problem(problem, graph, pp, dp, tp)
    try:
        plan = solve(sub, solver, time_limit_s=time_limit_s)
    except InfeasibleError:
        return HybridLayout(pp, dp, tp, family, math.inf, placements=placements, note="does not fit")
    except SolverError as exc:
        return HybridLayout(pp, dp, tp, family, math.inf, placements=placements, note=f"no plan: {exc}")
    exposed, drained, rows = 0.0, 0.0, []  # drained: how long before stage 0's last backward ends stage s's does
    index = {b.id: i for i, b in enumerate(graph.blocks)}
    for s, st in enumerate(plan.stages):
        grads = sum(graph.blocks[index[b]].param_bytes for b in st.blocks) * problem.grad_factor
        ring = _ring_link(problem, [(st.device * dp + d) * tp for d in range(dp)])
        allreduce = _allreduce_s(grads, dp, ring) if problem.training else 0.0
        exposed = max(exposed, allreduce - drained)
        drained += st.bwd_s
        rows.append({"stage": s, "ranks": [st.device * group, (st.device + 1) * group - 1], "replicas": dp, "tp": tp,
                     "split_nodes": sum(costs.split_nodes[index[b]] for b in st.blocks) if costs is not None and
                     costs.split_nodes else 0, "compute_s": st.compute_s, "comm_s": st.comm_s,
                     "allreduce_s": allreduce, "memory_bytes": st.memory_bytes})
    memory = max(st.memory_bytes for st in plan.stages)
    return HybridLayout(pp, dp, tp, family, plan.makespan_s + exposed, plan.makespan_s, exposed, memory,
                        plan.num_stages, plan, placements, tuple(rows))


def plan_hybrid(problem: Problem, layer_costs: Sequence[LayerParallelCosts] = (), *, solver: str = "auto",
                time_limit_s: float | None = 10.0, max_tp: int | None = None,
                every_device: bool = False, prune: bool = True) -> HybridPlan:
    """The fastest ``[pp, dp, tp]`` mesh and per-layer plan for ``problem``'s devices.

    Args:
        problem: One micro-batch's costs, ``m`` micro-batches per step, ``N`` identical
            devices and their links (``schedule`` gpipe or 1f1b).
        layer_costs: Per-layer plans per ``tp`` degree and family
            (:func:`fxsplit.passes.layer_costs.layer_parallel_costs`); meshes with ``tp > 1``
            are tried for the degrees given.
        solver: Pipeline solver for ``pp > 1`` (:func:`fxsplit.solvers.solve`).
        time_limit_s: Per pipeline solve, seconds.
        max_tp: Largest ``tp`` tried (e.g. the devices of one node).
        every_device: Only meshes of all ``N`` devices (``pp * dp * tp == N``: a launch whose
            every rank must work); default: any mesh whose size divides ``N``.
        prune: Solve the pipelined meshes (``pp > 1``) in order of their lower bound
            (:func:`~fxsplit.ir.plan.trivial_lower_bound` of one replica's pipeline) and leave
            unsolved (step ``inf``, the bound in its note) one whose bound is no better than the
            best mesh found and the best of each family it belongs to (:data:`FAMILIES`): the
            best and every family's best are those of the full search. False: solve every mesh.

    Returns:
        The :class:`HybridPlan`.

    Raises:
        ConfigError: for devices that differ, a looped schedule, or per-layer costs of
            another graph.
        InfeasibleError: when no layout fits (every layout's reason in the message).
    """
    start = time.perf_counter()
    _check_problem(problem)
    n = problem.num_devices
    by_degree: dict[int, list[LayerParallelCosts]] = {}
    for c in layer_costs:
        by_degree.setdefault(c.degree, []).append(c)
    layouts, pipelines = [], []
    for pp, dp, tp in mesh_shapes(n, max_tp=max_tp):
        if every_device and pp * dp * tp != n:
            continue
        options: list[LayerParallelCosts | None] = [None] if tp == 1 else list(by_degree.get(tp, []))
        for costs in options:
            if prune and pp > 1 and problem.microbatches % dp == 0:  # solved below, fewest-bound first
                graph = costs.apply(problem.graph) if costs is not None else problem.graph
                bound = trivial_lower_bound(_replica_problem(problem, graph, pp, dp, tp))
                pipelines.append((bound, pp, dp, tp, costs, graph))
            else:
                layouts.append(_layout(problem, pp, dp, tp, costs, solver, time_limit_s))
    for bound, pp, dp, tp, costs, graph in sorted(pipelines, key=lambda c: c[0]):
        family, placements = _family(costs)
        stub = HybridLayout(pp, dp, tp, family, math.inf)
        bars = [min((lay.step_s for lay in layouts if member(lay)), default=math.inf)
                for member in FAMILIES.values() if member(stub)]
        best = min((lay.step_s for lay in layouts), default=math.inf)
        if bound >= max([best, *bars]):  # no better than the best found, nor than its families' bests
            layouts.append(HybridLayout(pp, dp, tp, family, math.inf, placements=placements,
                                        note=f"not solved: at least {bound:.4g} s, no better than the best found"))
        else:
            layouts.append(_layout(problem, pp, dp, tp, costs, solver, time_limit_s, graph))
    layouts.sort(key=lambda lay: (lay.step_s, lay.devices, lay.pp, lay.tp))
    if not layouts[0].feasible:
        reasons = "; ".join(f"{lay.label}: {lay.note}" for lay in layouts[:12])
        raise InfeasibleError(f"no [pp, dp, tp] mesh of {n} devices fits ({reasons}); add devices, memory, "
                              "or per-layer costs that shard the parameters")
    baselines = {name: next((lay for lay in layouts if member(lay) and lay.feasible), None)
                 for name, member in FAMILIES.items()}
    return HybridPlan(layouts[0], tuple(layouts), baselines, n, problem.microbatches, time.perf_counter() - start)
