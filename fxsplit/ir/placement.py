"""Single-sample latency of a placement: Tarnawski et al.'s latency model (torch-free).

The throughput problems of fxsplit cut a graph into pipeline stages; this one places each node
of a DAG on one of ``k`` identical accelerators or on the host CPUs and minimises the time one
sample takes through the whole graph (inference latency), as in Tarnawski et al., "Efficient
Algorithms for Device Placement of DNN Graph Operators", NeurIPS 2020, §3 ("Computational
model", latency) and their ``latency-ip/lip.py`` with ``q = 1`` subgraph per accelerator:

* node ``v`` takes ``acc_s[v]`` on an accelerator, ``cpu_s[v]`` on a CPU; nodes with
  ``supported[v]`` false run on CPUs only; nodes of one colour class share a device;
* each accelerator ``a`` holds one *contiguous* (convex) set ``S_a``: no path leaves ``S_a`` and
  comes back; ``Σ size_bytes[S_a] <= memory_bytes``;
* CPUs are as many as needed (the paper's IP assumes so too): a CPU node starts when its
  predecessors are done, ``L(v) = cpu_s[v] + max L(pred)``;
* an accelerator runs its set as one call, communication not overlapped with compute: it starts
  when every node ``u`` outside ``S_a`` with an edge into ``S_a`` is done, then pays
  ``out_s[u]`` for each such ``u`` (input transfer), ``Σ acc_s[S_a]``, and ``out_s[u]`` for each
  ``u`` in ``S_a`` with an edge leaving ``S_a`` (output transfer); every node of ``S_a`` is done
  at that finish time. ``out_s[u]`` is the time to move ``u``'s output between an accelerator
  and host memory (one value per node, the input format's edge ``cost``);
* latency = the largest ``L(v)``.

References:
    Tarnawski, Phanishayee, Devanur, Mahajan, Nina, "Efficient Algorithms for Device Placement
    of DNN Graph Operators", NeurIPS 2020 (§3, Appendix F: the greedy and max-load baselines).
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any

from fxsplit.errors import ConfigError, PlanError

__all__ = ["PlacementProblem", "Placement", "evaluate_placement", "placement_faults", "latency_lower_bound_s"]

CPU = -1
"""The device index of the host CPUs in :attr:`Placement.device`."""


@dataclass(frozen=True)
class PlacementProblem:
    """A DAG to place for single-sample latency (see the module docstring for the model).

    Attributes:
        name: For reports.
        node_ids: ``[n]`` the input's node ids (reports, output files); nodes are ``0..n-1``
            here, in a topological order.
        acc_s, cpu_s: ``[n]`` seconds on an accelerator, on a CPU.
        size_bytes: ``[n]`` accelerator memory a node takes.
        out_s: ``[n]`` seconds to move a node's output between an accelerator and the host.
        supported: ``[n]`` whether the node may run on an accelerator.
        colour: ``[n]`` colour class; nodes with one class share a device.
        edges: ``(u, v)`` pairs, ``u`` before ``v`` in the node order.
        accelerators: ``k``, identical.
        memory_bytes: Memory of one accelerator.

    Raises (:meth:`check`):
        ConfigError: for lengths that differ, negative times or sizes, an edge that is not
            forward in the node order, or ``accelerators < 0``.
    """

    name: str
    node_ids: tuple[int, ...]
    acc_s: tuple[float, ...]
    cpu_s: tuple[float, ...]
    size_bytes: tuple[float, ...]
    out_s: tuple[float, ...]
    supported: tuple[bool, ...]
    colour: tuple[int, ...]
    edges: tuple[tuple[int, int], ...]
    accelerators: int
    memory_bytes: float

    def __len__(self) -> int:
        return len(self.node_ids)

    def check(self) -> PlacementProblem:
        n = len(self.node_ids)
        for key in ("acc_s", "cpu_s", "size_bytes", "out_s", "supported", "colour"):
            if len(getattr(self, key)) != n:
                raise ConfigError(f"placement problem {self.name!r}: {key} has {len(getattr(self, key))} entries "
                                  f"for {n} nodes; give one per node")
        for key in ("acc_s", "cpu_s", "size_bytes", "out_s"):
            bad = [i for i, x in enumerate(getattr(self, key)) if not x >= 0 or not math.isfinite(x)]
            if bad:
                raise ConfigError(f"placement problem {self.name!r}: {key} of node {self.node_ids[bad[0]]} is "
                                  f"{getattr(self, key)[bad[0]]}; times and sizes are finite and >= 0")
        for u, v in self.edges:
            if not 0 <= u < v < n:
                raise ConfigError(f"placement problem {self.name!r}: edge ({u}, {v}) is not forward in the node "
                                  f"order of {n} nodes; number the nodes in a topological order")
        if self.accelerators < 0:
            raise ConfigError(f"placement problem {self.name!r}: {self.accelerators} accelerators; give 0 or more")
        if not self.memory_bytes >= 0:
            raise ConfigError(f"placement problem {self.name!r}: accelerator memory {self.memory_bytes} bytes; give "
                              "0 or more")
        return self

    def with_accelerators(self, count: int) -> PlacementProblem:
        """A copy with ``count`` accelerators.

        Raises:
            ConfigError: for ``count < 0``.
        """
        return replace(self, accelerators=int(count)).check()

    def with_memory(self, memory_bytes: float) -> PlacementProblem:
        """A copy whose accelerators have ``memory_bytes`` each."""
        return replace(self, memory_bytes=float(memory_bytes)).check()

    @cached_property
    def successors(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in self.node_ids]
        for u, v in self.edges:
            out[u].append(v)
        return tuple(tuple(sorted(set(s))) for s in out)

    @cached_property
    def predecessors(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in self.node_ids]
        for u, v in self.edges:
            out[v].append(u)
        return tuple(tuple(sorted(set(p))) for p in out)

    def classes(self) -> list[list[int]]:
        """Nodes grouped by colour class, each group in node order, groups by their first node."""
        groups: dict[int, list[int]] = {}
        for v, c in enumerate(self.colour):
            groups.setdefault(c, []).append(v)
        return sorted(groups.values(), key=lambda g: g[0])

    def all_cpu_s(self) -> float:
        """The latency with every node on a CPU: the longest path in ``cpu_s``."""
        return max(_longest_path(self, self.cpu_s), default=0.0)


@dataclass(frozen=True)
class Placement:
    """Where every node runs and what one sample costs.

    Attributes:
        device: ``[n]`` accelerator index ``0..k-1`` of each node, or ``-1`` (:data:`CPU`).
        latency_s: The placement's latency (:func:`evaluate_placement`).
        lower_bound_s: A proven lower bound of the optimum (0 when none).
        status: ``"optimal"`` (gap within :data:`fxsplit.ir.plan.OPTIMAL_GAP`) or ``"feasible"``.
        solver: Who made it.
        objective: Always ``"latency"``: what was minimised.
        stats: Solver facts (times, CP-SAT status, the quantum).
    """

    device: tuple[int, ...]
    latency_s: float
    lower_bound_s: float = 0.0
    status: str = "feasible"
    solver: str = ""
    objective: str = "latency"
    stats: Any = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stats", MappingProxyType(dict(self.stats)))

    @property
    def gap(self) -> float:
        """``(latency - bound) / latency``; 0 for a zero latency."""
        return 0.0 if self.latency_s <= 0 else max(self.latency_s - self.lower_bound_s, 0.0) / self.latency_s

    def with_(self, **changes: Any) -> Placement:
        return replace(self, **changes)

    def accelerator_nodes(self, problem: PlacementProblem) -> list[list[int]]:
        """``[k]`` the input's node ids on each accelerator."""
        out: list[list[int]] = [[] for _ in range(problem.accelerators)]
        for v, d in enumerate(self.device):
            if d != CPU:
                out[d].append(problem.node_ids[v])
        return out

    def to_dict(self, problem: PlacementProblem) -> dict[str, Any]:
        """JSON-ready: fxsplit's fields plus the input format's output fields (``totalLatency``,
        ``fpgas``, ``cpus``: lists of ``{"nodes": [ids]}``), which their ``greedy -computeLatency``
        reads."""
        return {
            "objective": self.objective, "latency_s": self.latency_s, "lower_bound_s": self.lower_bound_s,
            "gap": self.gap, "status": self.status, "solver": self.solver, "stats": dict(self.stats),
            "totalLatency": self.latency_s,
            "fpgas": [{"nodes": ids} for ids in self.accelerator_nodes(problem)],
            "cpus": [{"nodes": [problem.node_ids[v] for v, d in enumerate(self.device) if d == CPU]}],
        }


def _longest_path(problem: PlacementProblem, cost: Sequence[float]) -> list[float]:
    """``[n]`` the longest path ending at each node, weighted by ``cost`` (nodes are in
    topological order)."""
    preds = problem.predecessors
    out = [0.0] * len(problem)
    for v in range(len(problem)):
        out[v] = cost[v] + max((out[u] for u in preds[v]), default=0.0)
    return out


def latency_lower_bound_s(problem: PlacementProblem) -> float:
    """A lower bound of any placement's latency: the longest path where each node takes the
    cheaper of its CPU and (where supported) accelerator time, transfers free."""
    cheapest = [min(c, a) if s else c for c, a, s in zip(problem.cpu_s, problem.acc_s, problem.supported, strict=True)]
    return max(_longest_path(problem, cheapest), default=0.0)


def _leaves_and_returns(problem: PlacementProblem, members: set[int]) -> int | None:
    """A node of ``members`` reached by a path that left ``members``, or None (a convex set)."""
    succ = problem.successors
    seen: set[int] = set()
    todo = deque(w for u in members for w in succ[u] if w not in members)
    while todo:
        w = todo.popleft()
        if w in seen:
            continue
        seen.add(w)
        for x in succ[w]:
            if x in members:
                return x
            todo.append(x)
    return None


def _unit_order(problem: PlacementProblem, device: Sequence[int]
                ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Each node's unit (``("cpu", v)``: a CPU node alone; ``("acc", a)``: accelerator ``a``'s whole
    set, one call) and the units in an order where every unit comes after those it needs; the
    order is short of some units when the units depend on each other in a cycle (two contiguous
    sets can: ``a1 -> b1`` and ``b2 -> a2``)."""
    unit_of = [("cpu", v) if d == CPU else ("acc", d) for v, d in enumerate(device)]
    unit_succ: dict[tuple[str, int], set[tuple[str, int]]] = defaultdict(set)
    for u, v in problem.edges:
        if unit_of[u] != unit_of[v]:
            unit_succ[unit_of[u]].add(unit_of[v])
    indegree = dict.fromkeys(unit_of, 0)
    for nxts in unit_succ.values():
        for nxt in nxts:
            indegree[nxt] += 1
    ready = deque(sorted(unit for unit, deg in indegree.items() if deg == 0))
    order = []
    while ready:
        unit = ready.popleft()
        order.append(unit)
        for nxt in sorted(unit_succ[unit]):
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    return unit_of, order


def placement_faults(problem: PlacementProblem, device: Sequence[int]) -> list[str]:
    """Why ``device`` is not a valid placement of ``problem`` (empty when it is): wrong length or
    index, a node on an accelerator that does not support it, a colour class split, an
    accelerator over its memory, an accelerator set that is not contiguous."""
    n, k = len(problem), problem.accelerators
    if len(device) != n:
        return [f"{len(device)} devices for {n} nodes"]
    faults = [f"node {problem.node_ids[v]} on device {d}; devices are -1 (CPU) or 0..{k - 1}"
              for v, d in enumerate(device) if not (d == CPU or 0 <= d < k)]
    if faults:
        return faults
    faults += [f"node {problem.node_ids[v]} is not supported on an accelerator but is on accelerator {d}"
               for v, d in enumerate(device) if d != CPU and not problem.supported[v]]
    for group in problem.classes():
        where = {device[v] for v in group}
        if len(where) > 1:
            faults.append(f"colour class {problem.colour[group[0]]} is split over devices {sorted(where)}")
    members: dict[int, set[int]] = defaultdict(set)
    for v, d in enumerate(device):
        if d != CPU:
            members[d].add(v)
    for d, nodes in sorted(members.items()):
        size = sum(problem.size_bytes[v] for v in nodes)
        if size > problem.memory_bytes:
            faults.append(f"accelerator {d} holds {size:.6g} bytes > {problem.memory_bytes:.6g}")
        back = _leaves_and_returns(problem, nodes)
        if back is not None:
            faults.append(f"accelerator {d}'s nodes are not contiguous: a path leaves them and returns to node "
                          f"{problem.node_ids[back]}")
    if not faults:
        unit_of, order = _unit_order(problem, device)
        if len(order) < len(set(unit_of)):
            stuck = sorted({d for d in device if d != CPU and ("acc", d) not in order})
            faults.append(f"accelerators {stuck} wait on each other's outputs in a cycle; each runs its nodes as "
                          "one call, so no order runs them")
    return faults


def evaluate_placement(problem: PlacementProblem, device: Sequence[int], *, solver: str = "",
                       lower_bound_s: float = 0.0, status: str = "feasible", stats: Any = None) -> Placement:
    """The latency of one sample under ``device`` (the module docstring's model).

    Args:
        problem: The problem.
        device: ``[n]`` accelerator ``0..k-1`` per node or ``-1`` for a CPU.
        solver, lower_bound_s, status, stats: Recorded in the result (``status`` drops to
            ``"feasible"`` when the gap to ``lower_bound_s`` is over ``OPTIMAL_GAP``).

    Raises:
        PlanError: for an invalid placement (:func:`placement_faults`), naming its faults.
    """
    from fxsplit.ir.plan import OPTIMAL_GAP

    faults = placement_faults(problem, device)
    if faults:
        raise PlanError(f"invalid placement of {problem.name!r}: {'; '.join(faults[:5])}"
                        + (f" (+{len(faults) - 5} more)" if len(faults) > 5 else ""))
    preds, succ = problem.predecessors, problem.successors
    members: dict[int, list[int]] = defaultdict(list)
    for v, d in enumerate(device):
        if d != CPU:
            members[d].append(v)
    unit_of, order = _unit_order(problem, device)
    done: dict[tuple[str, int], float] = {}
    for unit in order:
        kind, i = unit
        if kind == "cpu":
            done[unit] = problem.cpu_s[i] + max((done[unit_of[u]] for u in preds[i]), default=0.0)
        else:
            inside = set(members[i])
            senders = {u for v in inside for u in preds[v] if u not in inside}
            leaving = [u for u in inside if any(w not in inside for w in succ[u])]
            start = max((done[unit_of[u]] for u in senders), default=0.0)
            done[unit] = (start + sum(problem.out_s[u] for u in sorted(senders))
                          + sum(problem.acc_s[v] for v in members[i]) + sum(problem.out_s[u] for u in leaving))
    latency = max(done.values(), default=0.0)
    bound = min(lower_bound_s, latency)
    gap = 0.0 if latency <= 0 else (latency - bound) / latency
    return Placement(tuple(int(d) for d in device), latency, bound,
                     status if gap <= OPTIMAL_GAP else "feasible", solver, stats=stats or {})
