"""A pipeline plan and the one cost model every solver and report shares (torch-free).

Cost model of stage ``s`` of ``p`` (0-based) holding blocks ``B_s`` on device ``d_s``, with
``I_s = B_0 ∪ … ∪ B_s`` (a downset) and ``cut(I)`` the bytes leaving ``I`` (see
:meth:`CondensedGraph.cut_bytes`):

* compute: ``fwd_s = Σ fwd / speed(d_s)``, ``bwd_s = Σ bwd / speed(d_s)`` (0 for inference);
* communication per micro-batch: ``in = cut(I_{s-1})`` arrives over link ``(d_{s-1}, d_s)`` and
  ``out = cut(I_s)`` leaves over ``(d_s, d_{s+1})``; in training both are paid again for the
  gradients coming back (:meth:`CondensedGraph.grad_cut_bytes`, the same bytes unless edges say
  less: :attr:`Edge.grad_bytes`): ``comm_s = link_in(in) + link_out(out) + [training]
  (link_in(grad in) + link_out(grad out))``;
  0 on a ``comm_free`` device (:attr:`DeviceSpec.comm_free`: its neighbours pay theirs);
  plus the graph's direct transfers (:meth:`CondensedGraph.direct_bytes`) over the default link,
  never doubled (a training graph lists its gradient messages among them);
* stage time ``time_s = fwd_s + bwd_s + comm_s``; bottleneck = ``max_s time_s``;
* makespan of one step with ``m`` micro-batches (fill-drain): ``Σ_s time_s + (m - 1) · bottleneck``;
* memory: ``(params + replicas) · (1 + grad + optimizer) + buffers + (activations + in) · in_flight(s)
  + out`` (replicas: copies of tied parameters a block reads but another owns, see
  :meth:`Problem.static_bytes`),
  ``in_flight`` from :meth:`Problem.in_flight` (GPipe: ``m``; 1F1B: ``min(m, p - s)``);
* recomputation (:attr:`Problem.recompute`): a recomputing stage's memory is ``state + in ·
  in_flight(s) + activations + out`` and its ``bwd_s`` gains ``fwd_s``; under ``"auto"`` a stage
  recomputes exactly when it would not fit otherwise (:meth:`Problem.recomputes`, against its
  device's memory shared by the stages a looped schedule puts there).

References:
    Narayanan et al., "PipeDream", SOSP 2019, §3.1 (stage time with communication);
    Tarnawski et al., "Piper", NeurIPS 2021 (memory as in-flight activations plus static state);
    Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016 (recomputation).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

from fxsplit.errors import PlanError
from fxsplit.ir.graph import CondensedGraph
from fxsplit.ir.names import LOOPED_SCHEDULES, ObjectiveName, ScheduleName
from fxsplit.ir.problem import Problem

__all__ = ["StagePlan", "Plan", "evaluate", "trivial_lower_bound", "STATUSES", "OPTIMAL_GAP"]

OPTIMAL_GAP = 1e-9
"""Largest relative gap (:attr:`Plan.gap`) of a plan any solver calls ``optimal``: the DP's
values and :func:`evaluate` differ only by summation order."""

STATUSES = ("optimal", "feasible")


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: which blocks, on which device, and what it costs per micro-batch
    (``bwd_weight_s``: the part of ``bwd_s`` that computes parameter gradients). A stage that
    ``recompute`` s its activations has its forward once more in ``bwd_s`` and keeps only its
    inputs per in-flight micro-batch; under a zero-bubble schedule its whole backward runs in the
    input half (``bwd_weight_s`` 0): each weight-half autograd run would recompute again."""

    device: int
    blocks: tuple[int, ...]
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    comm_s: float = 0.0
    in_bytes: int = 0
    out_bytes: int = 0
    memory_bytes: int = 0
    bwd_weight_s: float = 0.0
    recompute: bool = False
    #: The gradients' part of ``comm_s`` in training; ``None``: half (they mirror the values).
    bwd_comm_s: float | None = None

    @property
    def backward_comm_s(self) -> float:
        """Seconds of ``comm_s`` spent sending and receiving gradients (half unless the stage's
        boundaries carry values without a gradient)."""
        return self.comm_s / 2 if self.bwd_comm_s is None else self.bwd_comm_s

    @property
    def compute_s(self) -> float:
        return self.fwd_s + self.bwd_s

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_s + self.comm_s


@dataclass(frozen=True)
class Plan:
    """The split of a problem's blocks into pipeline stages, with its predicted costs.

    ``gap`` is ``(objective_s - lower_bound_s) / objective_s``: 0 for a proven optimum.
    ``stats`` are the solver's diagnostics (``cp_status``, ``quantum_s``, ``downsets``, ...), for
    people and reports: read-only (a ``types.MappingProxyType`` over a copy of the mapping given;
    item assignment raises ``TypeError``), not compared, serialised as a plain dict. To change
    them, build a new plan: ``plan.with_(stats={**plan.stats, "key": value})``.
    """

    stages: tuple[StagePlan, ...]
    objective: ObjectiveName = "bottleneck"
    objective_s: float = 0.0
    bottleneck_s: float = 0.0
    makespan_s: float = 0.0
    lower_bound_s: float = 0.0
    solver: str = ""
    status: str = "feasible"
    solve_time_s: float = 0.0
    microbatches: int = 1
    schedule: ScheduleName = "1f1b"
    stats: Mapping[str, Any] = field(default_factory=dict, compare=False)
    graph: CondensedGraph | None = field(default=None, compare=False, repr=False)
    """The condensed graph the plan was solved on, when known (not serialised); pictures use
    it (``fxsplit.viz.draw_plan(plan, plan.graph, path)``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stats", MappingProxyType(dict(self.stats)))

    def __getstate__(self) -> dict[str, Any]:
        """Pickle and deep-copy support: a mapping proxy cannot be pickled, its dict can."""
        return {**self.__dict__, "stats": dict(self.stats)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "stats", MappingProxyType(dict(state.get("stats", {}))))

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_ranks(self) -> int:
        """Devices the stages run on: ``num_stages`` unless a looped schedule puts several
        stages on one device."""
        return len({st.device for st in self.stages})

    @property
    def rank_stages(self) -> tuple[tuple[int, ...], ...]:
        """``[num_ranks]`` the stages each device runs, devices in order of first appearance
        (one stage each unless a looped schedule puts several on one device)."""
        held: dict[int, list[int]] = {}
        for s, st in enumerate(self.stages):
            held.setdefault(st.device, []).append(s)
        return tuple(tuple(h) for h in held.values())

    @property
    def gap(self) -> float:
        if self.objective_s <= 0:
            return 0.0
        return max(0.0, (self.objective_s - self.lower_bound_s) / self.objective_s)

    def stage_of_block(self) -> dict[int, int]:
        """Map block id -> stage index."""
        return {b: s for s, st in enumerate(self.stages) for b in st.blocks}

    def with_(self, **changes: Any) -> Plan:
        return replace(self, **changes)

    # -- validation ------------------------------------------------------------------------
    def validate(self, problem: Problem, *, rtol: float = 1e-6) -> list[str]:
        """Every fault of this plan for ``problem`` (empty when valid).

        Checks: each block in exactly one stage; no empty stage; devices in range, distinct
        (or, under a looped schedule such as ``"interleaved-1f1b"``, a looping placement: stage
        ``s`` on the ``s mod r``-th of ``r`` devices) and (``device_order="fixed"``) increasing;
        every prefix of stages is a downset (contiguous stages); the stages on each device fit
        its memory together; the stored costs equal :func:`evaluate`'s; ``lower_bound_s <=
        objective_s``.
        """
        g, faults = problem.graph, []
        seen: dict[int, int] = {}
        for s, st in enumerate(self.stages):
            if not st.blocks:
                faults.append(f"stage {s} is empty")
            for b in st.blocks:
                if b in seen:
                    faults.append(f"block {b} is in stages {seen[b]} and {s}")
                seen[b] = s
        missing = sorted(set(range(len(g))) - set(seen))
        if missing:
            faults.append(f"blocks {missing[:10]} are in no stage")
        extra = sorted(set(seen) - set(range(len(g))))
        if extra:
            faults.append(f"blocks {extra[:10]} do not exist (graph has {len(g)})")
        devs = [st.device for st in self.stages]
        faults += _placement_faults(devs, self.schedule, problem)
        prefix: set[int] = set()
        for s, st in enumerate(self.stages):
            prefix |= set(st.blocks)
            if not g.is_downset(prefix):
                bad = sorted(p for b in prefix for p in g.predecessors(b) if p not in prefix)
                faults.append(f"stages 0..{s} are not a downset: they need blocks {bad[:10]} from later stages")
        if faults:
            return faults
        for held in self.rank_stages:
            d = devs[held[0]]
            cap, need = problem.devices[d].memory_bytes, sum(self.stages[s].memory_bytes for s in held)
            if need > cap:
                where = f"stage {held[0]}" if len(held) == 1 else f"stages {held}"
                faults.append(f"{where} need(s) {need} bytes, device {d} ({problem.devices[d].name}) has {cap}")
        ref = evaluate(problem, [st.blocks for st in self.stages], devs)
        if abs(ref.objective_s - self.objective_s) > rtol * max(1e-12, ref.objective_s):
            faults.append(f"objective_s={self.objective_s} but the cost model gives {ref.objective_s}")
        if self.lower_bound_s > self.objective_s * (1 + rtol) + 1e-15:
            faults.append(f"lower_bound_s={self.lower_bound_s} exceeds objective_s={self.objective_s}")
        if self.status not in STATUSES:
            faults.append(f"status={self.status!r} not in {STATUSES}")
        return faults

    def check(self, problem: Problem) -> Plan:
        """Raise :class:`PlanError` listing every fault; return ``self`` when valid."""
        faults = self.validate(problem)
        if faults:
            raise PlanError(f"invalid plan from solver {self.solver!r}:\n  " + "\n  ".join(faults))
        return self

    # -- serialisation ---------------------------------------------------------------------
    def to_dict(self, problem: Problem | None = None) -> dict[str, Any]:
        """JSON-ready dict; with ``problem``, each stage also lists its nodes' names."""
        d: dict[str, Any] = {}
        for f in fields(self):  # asdict cannot copy the stats' mapping proxy
            if f.name != "graph":
                value = getattr(self, f.name)
                d[f.name] = ([asdict(st) for st in value] if f.name == "stages"
                             else _plain(value) if f.name == "stats" else value)
        d["gap"] = self.gap
        for st, sd in zip(self.stages, d["stages"], strict=True):
            sd["compute_s"], sd["time_s"] = st.compute_s, st.time_s
            sd["blocks"] = list(st.blocks)
            if problem is not None:
                sd["nodes"] = [n for b in st.blocks for n in problem.graph.blocks[b].nodes]
                sd["device_name"] = problem.devices[st.device].name
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        fields = {f for f in StagePlan.__dataclass_fields__}
        stages = tuple(
            StagePlan(**{**{k: v for k, v in s.items() if k in fields}, "blocks": tuple(s["blocks"])})
            for s in data["stages"]
        )
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "stages"}
        return cls(stages=stages, **known)

    def to_json(self, problem: Problem | None = None) -> str:
        return json.dumps(self.to_dict(problem), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))


def _plain(value: Any) -> Any:
    """A deep copy of ``value`` with every mapping (a read-only ``stats`` too) made a dict."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    return copy.deepcopy(value)


def _placement_faults(devs: list[int], schedule: str, problem: Problem) -> list[str]:
    """Devices in range, one stage each, or a looping placement under a looped schedule."""
    faults = []
    ranks = list(dict.fromkeys(devs))
    if any(not 0 <= d < problem.num_devices for d in devs):
        faults.append(f"device index out of range 0..{problem.num_devices - 1}: {devs}")
    if len(ranks) != len(devs):
        looped = len(devs) % len(ranks) == 0 and all(d == ranks[s % len(ranks)] for s, d in enumerate(devs))
        if schedule not in LOOPED_SCHEDULES:
            faults.append(f"a device runs two stages: {devs}; only {', '.join(LOOPED_SCHEDULES)} runs several "
                          f"stages per device (schedule is {schedule!r})")
        elif not looped:
            faults.append(f"{schedule} needs a looping placement (stage s on the (s mod r)-th of r devices), "
                          f"got devices {devs}")
    if problem.device_order == "fixed" and ranks != sorted(ranks):
        faults.append(f"device_order='fixed' needs increasing devices, got {devs}")
    return faults


def _stage_costs(problem: Problem, stages: Sequence[Sequence[int]], devices: Sequence[int]) -> list[StagePlan]:
    g, p = problem.graph, len(stages)
    k = 2 if problem.training else 1
    sharing = {d: list(devices).count(d) for d in devices}  # looped: a device's memory split over its stages
    out: list[StagePlan] = []
    prefix: set[int] = set()
    in_bytes = grad_in = 0
    mirror = g.gradients_mirror
    for s, (blocks, d) in enumerate(zip(stages, devices, strict=True)):
        prefix |= set(blocks)
        out_bytes = g.cut_bytes(prefix) if s < p - 1 else 0
        grad_out = out_bytes if mirror else g.grad_cut_bytes(prefix) if s < p - 1 else 0
        speed = problem.devices[d].speed
        bl = [g.blocks[b] for b in blocks]
        fixed = problem.action_overhead_s if bl else 0.0  # the runtime's work per action (not scaled)
        fwd = sum(b.fwd_s for b in bl) / speed + fixed
        bwd = sum(b.bwd_s for b in bl) / speed + fixed if problem.training else 0.0
        comm = 0.0
        if s > 0:
            comm += problem.link_between(devices[s - 1], d).transfer_s(in_bytes)
        if s < p - 1:
            comm += problem.link_between(d, devices[s + 1]).transfer_s(out_bytes)
        back = None
        if mirror:
            comm *= k
        elif problem.training:  # the gradients back over the same links
            back = ((problem.link_between(devices[s - 1], d).transfer_s(grad_in) if s > 0 else 0.0)
                    + (problem.link_between(d, devices[s + 1]).transfer_s(grad_out) if s < p - 1 else 0.0))
            comm += back
        if g.direct:  # values sent straight between stages, gradients listed among them
            sent = problem.link.transfer_s(g.direct_bytes(set(blocks)))
            comm += sent
            back = None if back is None else back + sent / 2
        if problem.devices[d].comm_free:  # its neighbours pay the transfers, it does not
            comm, back = 0.0, None
        flight = problem.in_flight(s, p)
        static, act = sum(problem.static_bytes(b) for b in bl), sum(b.activation_bytes for b in bl)
        keep = problem.stage_memory_bytes(static, act, in_bytes, out_bytes, flight, False, transfers=problem.transfer_memory)
        again = problem.stage_memory_bytes(static, act, in_bytes, out_bytes, flight, True, transfers=problem.transfer_memory)
        recompute = problem.recomputes(keep, again, problem.devices[d].memory_bytes // sharing[d])
        # a recomputing stage runs its whole backward in I (one recompute; fxsplit.runtime.split_backward)
        weight = sum(b.bwd_weight_s for b in bl) / speed if problem.training and not recompute else 0.0
        redo = fwd - fixed if recompute else 0.0  # recomputing runs the forward's compute inside the backward action
        out.append(StagePlan(d, tuple(blocks), fwd, bwd + redo, comm, in_bytes,
                             out_bytes, int(again if recompute else keep), weight, recompute, back))
        in_bytes, grad_in = out_bytes, grad_out
    return out


def evaluate(
    problem: Problem,
    stages: Sequence[Sequence[int]],
    devices: Sequence[int] | None = None,
    *,
    solver: str = "",
    status: str = "feasible",
    lower_bound_s: float | None = None,
    solve_time_s: float = 0.0,
    stats: Mapping[str, Any] | None = None,
) -> Plan:
    """Build a :class:`Plan` from block lists, costing every stage with the shared model.

    Args:
        problem: The problem the plan is for.
        stages: Block ids of each stage, ``[num_stages][*]``, in pipeline order.
        devices: Device index of each stage, ``[num_stages]``; default ``0..num_stages-1``.
        solver, status, solve_time_s, stats: Recorded on the plan.
        lower_bound_s: Proven lower bound; default :func:`trivial_lower_bound`.

    Returns:
        The plan (not validated: call :meth:`Plan.check`).

    Example:
        >>> from fxsplit.ir import CondensedGraph, DeviceSpec, Problem
        >>> pb = Problem(CondensedGraph.chain([1.0, 2.0, 3.0]), (DeviceSpec("a"), DeviceSpec("b")))
        >>> evaluate(pb, [[0, 1], [2]]).bottleneck_s
        3.0
    """
    devs = list(devices) if devices is not None else list(range(len(stages)))
    sp = _stage_costs(problem, stages, devs)
    bottleneck = max((s.time_s for s in sp), default=0.0)
    makespan = sum(s.time_s for s in sp) + (problem.microbatches - 1) * bottleneck
    objective_s = bottleneck if problem.objective == "bottleneck" else makespan
    lb = trivial_lower_bound(problem) if lower_bound_s is None else lower_bound_s
    return Plan(
        stages=tuple(sp),
        objective=problem.objective,
        objective_s=objective_s,
        bottleneck_s=bottleneck,
        makespan_s=makespan,
        lower_bound_s=min(lb, objective_s),
        solver=solver,
        status=status,
        solve_time_s=solve_time_s,
        microbatches=problem.microbatches,
        schedule=problem.schedule,
        stats=stats or {},
    )


def trivial_lower_bound(problem: Problem) -> float:
    """A lower bound on the objective that every solver can quote.

    Bottleneck: ``max(largest block / fastest speed, total work / sum of all speeds)``.
    Makespan: ``total work / fastest speed + (m - 1) · bottleneck bound`` (the sum of stage times
    is at least the total work on the fastest device). Communication is ignored (it only adds).
    Under ``recompute="all"`` each block's forward counts twice. Every plan has a stage, and
    every stage pays :meth:`~fxsplit.ir.Problem.stage_overhead_s`: both bounds add it once.
    """
    g = problem.graph
    again = problem.may_recompute() and problem.recompute == "all"  # every stage runs its forward twice
    times = [(b.time_s + (b.fwd_s if again else 0.0)) if problem.training else b.fwd_s for b in g.blocks]
    speeds = [d.speed for d in problem.devices]
    if not times:
        return 0.0
    total, vmax, fixed = sum(times), max(speeds), problem.stage_overhead_s()
    lb_bottleneck = max(max(times) / vmax, total / sum(speeds)) + fixed
    if problem.objective == "bottleneck":
        return lb_bottleneck
    return total / vmax + fixed + (problem.microbatches - 1) * lb_bottleneck
