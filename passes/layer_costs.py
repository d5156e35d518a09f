"""Per-layer plans over a group of devices, as factors on a condensed graph's blocks.

The hybrid search (:func:`fxsplit.solvers.hybrid.plan_hybrid`) splits a model into pipeline
stages over blocks, while per-layer strategies (PaSE) are chosen per FX node. This pass solves the
strategy graph of ``gm`` over ``degree`` devices (:func:`~fxsplit.passes.parallel_strategies.strategy_graph`,
DTensor's strategies and ring-costed redistributions), then attributes every vertex's cost to the
block that holds its node: its option's compute, plus the redistributions into it (edge costs go
to the consumer), a parameter's or input's to the block of its first consumer. Each block's
factor is its cost under the plan over its cost with every node replicated (the node's own
seconds on one device), so the block's annotated times, which are the same node costs, scale
exactly; memory factors compare the chosen options' per-device bytes with the replicated ones.

References:
    Elango, "Automatic Parallelization Strategies for Efficient DNN Training" (PaSE), IPDPS 2021;
    Shoeybi et al., "Megatron-LM", 2019 (the column/row family).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

import torch.fx

from fxsplit.errors import ConfigError, InfeasibleError
from fxsplit.ir import CondensedGraph, LinkSpec
from fxsplit.passes.parallel_strategies import NodeStrategies, megatron_placements, strategy_graph
from fxsplit.solvers.hybrid import LayerParallelCosts
from fxsplit.solvers.pase import solve_strategies

__all__ = ["FAMILIES", "block_factors", "layer_parallel_costs", "per_layer_costs"]

#: Per-layer plan families: each node's best strategy, or Megatron's column/row linear layers.
FAMILIES = ("pase", "megatron")


def _block_of_vertices(found: NodeStrategies, graph: CondensedGraph) -> list[int]:
    """``[num_vertices]`` the block each vertex's cost goes to (-1: none, e.g. an unused input)."""
    where = {name: b.id for b in graph.blocks for name in b.nodes}
    index = {b.id: i for i, b in enumerate(graph.blocks)}
    out = [index.get(where.get(name, -1), -1) for name in found.nodes]
    consumers: list[list[int]] = [[] for _ in found.nodes]
    for e in found.graph.edges:
        consumers[e.src].append(e.dst)
    for v in range(len(out) - 1, -1, -1):  # parameters, inputs: the block of their first consumer
        if out[v] < 0:
            out[v] = min((out[c] for c in consumers[v] if out[c] >= 0), default=-1)
    return out


def block_factors(found: NodeStrategies, choice: Sequence[int], graph: CondensedGraph) -> tuple[
        tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Per block, ``(time, parameter bytes, activation bytes)`` under ``choice`` over the same
    with every vertex replicated (1.0 where the block has none).

    Raises:
        ConfigError: for a choice that does not pick one option per vertex.
    """
    g = found.graph
    if len(choice) != len(g.vertices):
        raise ConfigError(f"choice of {len(choice)} options for {len(g.vertices)} vertices")
    whole = found.choice_of(("R",))
    blocks = _block_of_vertices(found, graph)
    n = len(graph.blocks)
    sums = {key: [0.0] * n for key in ("t", "t0", "p", "p0", "a", "a0")}
    incoming: list[list[tuple[int, Sequence[Sequence[float]]]]] = [[] for _ in g.vertices]
    for e in g.edges:
        incoming[e.dst].append((e.src, e.cost_s))
    params = found.parameters or (False,) * len(g.vertices)
    for v, b in enumerate(blocks):
        if b < 0:
            continue
        opts = g.vertices[v].options
        sums["t"][b] += opts[choice[v]].compute_s + sum(cost[choice[u]][choice[v]] for u, cost in incoming[v])
        sums["t0"][b] += opts[whole[v]].compute_s + sum(cost[whole[u]][whole[v]] for u, cost in incoming[v])
        kind = "p" if params[v] else "a"
        sums[kind][b] += opts[choice[v]].memory_bytes
        sums[kind + "0"][b] += opts[whole[v]].memory_bytes

    def ratio(key: str) -> tuple[float, ...]:
        return tuple(x / y if y > 0 else 1.0 for x, y in zip(sums[key], sums[key + "0"], strict=True))

    return ratio("t"), ratio("p"), ratio("a")


def layer_parallel_costs(gm: torch.fx.GraphModule, graph: CondensedGraph, degree: int, *, family: str = "pase",
                         link: LinkSpec | None = None, time_limit_s: float = 30.0,
                         op_overhead_s: float = 0.0, strategies: NodeStrategies | None = None,
                         memory_limit_bytes: float | None = None) -> LayerParallelCosts:
    """The per-layer plan of ``gm`` over ``degree`` devices, as factors on ``graph``'s blocks.

    Args:
        gm: The captured graph, annotated (``"val"``, ``"fxsplit.cost"``) at the micro-batch
            size the pipeline runs; ``graph`` is its condensation (same costs).
        graph: The condensed graph the hybrid search splits.
        degree: Devices per group (the ``tp`` mesh dimension), ``>= 2``.
        family: ``"pase"`` (every node's best strategy, PaSE's DP or CP-SAT) or ``"megatron"``
            (Megatron's column/row linears, the rest free).
        link: The links inside the group (ring formulas), default :class:`LinkSpec`.
        time_limit_s: CP-SAT's limit when the DP table is too large, seconds.
        op_overhead_s: Dispatch seconds per split op (:func:`strategy_graph`).
        strategies: ``strategy_graph(gm, degree, link=link, op_overhead_s=op_overhead_s)`` when
            the caller has built it (both families read the same one; :func:`per_layer_costs`).
        memory_limit_bytes: Memory of one device: the fastest choice whose per-device memory (the
            whole model over ``degree`` devices) fits it, where one does; else the fastest
            choice (a pipeline stage holds only part of the model). Time-optimal choices often
            tie: on a Llama-7B at degree 8, one of 106 GB and one of 39 GB take the same time.

    Returns:
        The :class:`~fxsplit.solvers.hybrid.LayerParallelCosts`.

    Raises:
        ConfigError: for an unknown family, ``degree < 2`` or a graph without shapes.
        SolverError: when no strategy is found within the time limit.
    """
    _check_family(family)
    start = time.perf_counter()
    found = strategies if strategies is not None else strategy_graph(gm, degree, link=link, op_overhead_s=op_overhead_s)
    g = found.graph if family == "pase" else found.graph.restricted(found.allowing(megatron_placements(gm)))
    try:
        choice = solve_strategies(g, memory_limit_bytes=memory_limit_bytes, time_limit_s=time_limit_s).choice
    except InfeasibleError:  # the whole model does not fit one group; stages of a pipeline may
        choice = solve_strategies(g, time_limit_s=time_limit_s).choice
    times, params, acts = block_factors(found, choice, graph)
    counts = Counter(found.placements[v][c] for v, c in enumerate(choice))
    split = [0] * len(graph.blocks)
    for v, b in enumerate(_block_of_vertices(found, graph)):
        if b >= 0 and found.placements[v][choice[v]].strip("(),R"):
            split[b] += 1
    return LayerParallelCosts(degree, family, times, params, acts, dict(counts), tuple(split), time.perf_counter() - start)


def per_layer_costs(gm: torch.fx.GraphModule, graph: CondensedGraph, degrees: Sequence[int],
                    families: Sequence[str] = ("pase", "megatron"), *, link: LinkSpec | None = None,
                    time_limit_s: float = 30.0, op_overhead_s: float = 0.0,
                    memory_limit_bytes: float | None = None) -> list[LayerParallelCosts]:
    """:func:`layer_parallel_costs` for every degree in ``degrees`` and family in ``families``
    (degree by degree, the families in order), each degree's strategy graph built once (its
    DTensor op strategies are the slow part of a family's plan: 5-11 s of a Llama-7B's 34 s).

    Raises:
        As :func:`layer_parallel_costs`.
    """
    for family in families:  # before any strategy graph is built
        _check_family(family)
    out: list[LayerParallelCosts] = []
    for degree in degrees:
        found = strategy_graph(gm, degree, link=link, op_overhead_s=op_overhead_s)
        out.extend(layer_parallel_costs(gm, graph, degree, family=f, link=link, time_limit_s=time_limit_s,
                                        op_overhead_s=op_overhead_s, strategies=found,
                                        memory_limit_bytes=memory_limit_bytes) for f in families)
    return out


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ConfigError(f"family={family!r}; one of {list(FAMILIES)}")
