"""Per-layer parallelization strategies as data (PaSE's problem, torch-free).

Each vertex (a layer, or a group of graph nodes whose choices must agree) has a few candidate
strategies: how it is split over the devices of a mesh (data parallel, ``Shard(1)`` of a
``Linear``'s weight, replicated, ...), each with its compute time and per-device memory. Each edge
costs the redistribution between the producer's output placement under its choice and the
placement the consumer expects under its own (all-gather, reduce-scatter, all-reduce,
all-to-all, or nothing when they agree): a ``[options of u] x [options of v]`` matrix of seconds.
A :class:`StrategyGraph` is solved by :mod:`fxsplit.solvers.pase` (exact DP over dependent sets,
CP-SAT with a memory limit, brute force).

Example:
    >>> g = StrategyGraph(
    ...     vertices=(StrategyVertex("fc1", (StrategyOption("dp", 4.0), StrategyOption("tp", 3.0))),
    ...               StrategyVertex("fc2", (StrategyOption("dp", 4.0), StrategyOption("tp", 3.0)))),
    ...     edges=(StrategyEdge(0, 1, ((0.0, 2.0), (2.0, 0.5))),))
    >>> g.cost_s((1, 1)), g.cost_s((0, 0)), g.cost_s((1, 0))
    (6.5, 8.0, 9.0)

References:
    Elango, "Automatic Parallelization Strategies for Efficient DNN Training" (PaSE), IPDPS 2021.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fxsplit.errors import ConfigError

__all__ = ["StrategyEdge", "StrategyGraph", "StrategyOption", "StrategyVertex"]


@dataclass(frozen=True)
class StrategyOption:
    """One way to run a vertex: ``name`` (e.g. ``"S(0)"``, ``"col"``), its compute seconds
    (``math.inf``: not allowed) and its memory per device, bytes (parameters, gradients,
    optimizer state and activations after sharding)."""

    name: str
    compute_s: float
    memory_bytes: float = 0.0


@dataclass(frozen=True)
class StrategyVertex:
    """A layer (or group of nodes that choose together) and its candidate strategies."""

    name: str
    options: tuple[StrategyOption, ...]


@dataclass(frozen=True)
class StrategyEdge:
    """Data from vertex ``src`` to ``dst``: ``cost_s[i][j]`` seconds to redistribute ``src``'s
    output under its option ``i`` into what ``dst`` expects under its option ``j`` (``math.inf``
    where no redistribution gets there, e.g. a shard into a partial sum)."""

    src: int
    dst: int
    cost_s: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class StrategyGraph:
    """Vertices with options and edges with redistribution costs.

    Raises:
        ConfigError: from :meth:`validate` (run on construction) for a vertex without options,
            an edge naming a missing vertex or itself, a cost matrix of the wrong shape, or a
            negative or non-finite number.
    """

    vertices: tuple[StrategyVertex, ...]
    edges: tuple[StrategyEdge, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        n = len(self.vertices)
        for v in self.vertices:
            if not v.options:
                raise ConfigError(f"vertex {v.name!r} has no strategy; give it at least one option")
            for o in v.options:
                if math.isnan(o.compute_s) or o.compute_s < 0 or not math.isfinite(o.memory_bytes) or o.memory_bytes < 0:
                    raise ConfigError(f"vertex {v.name!r} option {o.name!r}: compute_s={o.compute_s}, "
                                      f"memory_bytes={o.memory_bytes}; both must be >= 0 (compute_s math.inf: an "
                                      "option that cannot be taken; memory finite)")
        for e in self.edges:
            if not (0 <= e.src < n and 0 <= e.dst < n) or e.src == e.dst:
                raise ConfigError(f"edge {e.src}->{e.dst}: vertices are 0..{n - 1} and an edge joins two of them")
            rows, cols = len(self.vertices[e.src].options), len(self.vertices[e.dst].options)
            if len(e.cost_s) != rows or any(len(r) != cols for r in e.cost_s):
                raise ConfigError(f"edge {e.src}->{e.dst}: cost matrix must be {rows} x {cols} "
                                  f"(options of {self.vertices[e.src].name!r} x {self.vertices[e.dst].name!r})")
            if any(math.isnan(c) or c < 0 for r in e.cost_s for c in r):
                raise ConfigError(f"edge {e.src}->{e.dst}: costs must be >= 0 seconds (math.inf: a pair that "
                                  "cannot follow each other)")

    def __len__(self) -> int:
        return len(self.vertices)

    def neighbours(self) -> list[set[int]]:
        """``[num_vertices]`` the vertices each vertex shares an edge with."""
        out: list[set[int]] = [set() for _ in self.vertices]
        for e in self.edges:
            out[e.src].add(e.dst)
            out[e.dst].add(e.src)
        return out

    def cost_s(self, choice: Sequence[int]) -> float:
        """Seconds of compute plus redistribution when vertex ``i`` takes option ``choice[i]``.

        Raises:
            ConfigError: for a choice of the wrong length or an option index out of range.
        """
        self._check_choice(choice)
        return (sum(v.options[c].compute_s for v, c in zip(self.vertices, choice, strict=True))
                + sum(e.cost_s[choice[e.src]][choice[e.dst]] for e in self.edges))

    def memory_bytes(self, choice: Sequence[int]) -> float:
        """Per-device bytes of ``choice`` (the vertices' memory added up)."""
        self._check_choice(choice)
        return sum(v.options[c].memory_bytes for v, c in zip(self.vertices, choice, strict=True))

    def _check_choice(self, choice: Sequence[int]) -> None:
        if len(choice) != len(self.vertices) or any(
                not 0 <= c < len(v.options) for v, c in zip(self.vertices, choice, strict=True)):
            raise ConfigError(f"choice {list(choice)} does not pick one option of each of the {len(self)} vertices")

    def restricted(self, allowed: Mapping[int, Collection[int]]) -> StrategyGraph:
        """A copy where vertex ``v`` may only take the options ``allowed[v]`` (the others cost
        ``math.inf``): solving it gives the best plan of a family (every parameter replicated,
        Megatron's column/row split of the linear layers).

        Raises:
            ConfigError: for a vertex left without an option or an index out of range.
        """
        vertices = list(self.vertices)
        for v, keep in allowed.items():
            if not 0 <= v < len(vertices) or not keep or any(not 0 <= k < len(vertices[v].options) for k in keep):
                raise ConfigError(f"restricting vertex {v} to options {sorted(keep)}: give existing vertices and "
                                  "at least one of their options")
            vertices[v] = StrategyVertex(vertices[v].name, tuple(
                o if k in keep else StrategyOption(o.name, math.inf, o.memory_bytes)
                for k, o in enumerate(vertices[v].options)))
        return StrategyGraph(tuple(vertices), self.edges)

    def to_dict(self) -> dict[str, Any]:
        return {"vertices": [{"name": v.name, "options": [[o.name, o.compute_s, o.memory_bytes] for o in v.options]}
                             for v in self.vertices],
                "edges": [[e.src, e.dst, [list(r) for r in e.cost_s]] for e in self.edges]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StrategyGraph:
        """Inverse of :meth:`to_dict`.

        Raises:
            ConfigError: for a malformed dict (missing keys, wrong shapes).
        """
        try:
            vertices = tuple(StrategyVertex(v["name"], tuple(StrategyOption(str(n), float(c), float(m))
                                                             for n, c, m in v["options"]))
                             for v in data["vertices"])
            edges = tuple(StrategyEdge(int(s), int(d), tuple(tuple(float(c) for c in r) for r in m))
                          for s, d, m in data.get("edges", []))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a strategy graph: {type(exc).__name__}: {exc}; expected "
                              "{'vertices': [{'name', 'options': [[name, compute_s, memory_bytes]]}], "
                              "'edges': [[src, dst, matrix]]}") from exc
        return cls(vertices, edges)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> StrategyGraph:
        return cls.from_dict(json.loads(text))
