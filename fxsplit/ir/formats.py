"""Loaders for the graph formats fxsplit reads: its own JSON, PipeDream profiles, Tarnawski JSON.

* ``fxsplit``: :meth:`Problem.to_json` (a whole problem) or :meth:`CondensedGraph.to_json`.
* ``pipedream``: the profiler's ``graph.txt`` (PipeDream, SOSP 2019): one line per node
  ``nodeK -- Description -- forward_compute_time=…, backward_compute_time=…,
  activation_size=…, parameter_size=…`` and one tab-indented ``src -- dst`` line per edge. Times
  are milliseconds; the ``Input`` nodes' forward time is data loading and counts 0.
* ``tarnawski``: the input JSON of Tarnawski et al. (NeurIPS 2020): ``maxSizePerFPGA``,
  ``maxFPGAs``, ``nodes`` (``id``, ``fpgaLatency``, ``size``, ``isBackwardNode``, optional
  ``colorClass``: nodes that must share a device) and ``edges`` (``sourceId``, ``destId``,
  ``cost``: seconds to move the source's output).

References:
    Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training", SOSP 2019;
    Tarnawski et al., "Efficient Algorithms for Device Placement of DNN Graph Operators",
    NeurIPS 2020 (input format of github.com/msr-fiddle/dnn-partitioning).
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxsplit.errors import ConfigError
from fxsplit.ir.devices import DeviceSpec, LinkSpec
from fxsplit.ir.graph import Block, CondensedGraph, DirectTransfer, Edge
from fxsplit.ir.problem import Problem

if TYPE_CHECKING:
    from fxsplit.ir.placement import PlacementProblem
    from fxsplit.ir.plan import Plan

__all__ = ["FORMATS", "TRANSFERS", "detect_format", "load_pipedream", "load_tarnawski", "load_tarnawski_latency",
           "load_graph_or_problem", "tarnawski_max_load", "tarnawski_plan_faults", "topological_graph"]

FORMATS = ("auto", "fxsplit", "pipedream", "tarnawski")
TRANSFERS = ("relayed", "direct")
"""How :func:`load_tarnawski` charges communication: fxsplit's relayed boundaries, or dp.cpp's
direct transfers."""

_ATTR = re.compile(r"(\w+)=(\[[^\]]*\]|[-+0-9.eE]+)")


def topological_graph(
    name: str, blocks: dict[str, dict[str, Any]], edges: list[tuple[str, str, int]]
) -> CondensedGraph:
    """Build a :class:`CondensedGraph` from named blocks and edges in any order.

    Blocks are numbered in a topological order (Kahn's algorithm, ties broken by input order).

    Args:
        name: Graph name.
        blocks: ``{block name: Block keyword arguments except id and name}`` (insertion order).
        edges: ``(src name, dst name, size_bytes)``; parallel edges are merged (largest size).

    Raises:
        ConfigError: when an edge names an unknown block or the edges form a cycle.
    """
    order = list(blocks)
    pos = {b: i for i, b in enumerate(order)}
    merged: dict[tuple[str, str], int] = {}
    for src, dst, size in edges:
        for end in (src, dst):
            if end not in pos:
                raise ConfigError(f"graph {name!r}: edge {src} -> {dst} names unknown node {end!r}")
        if src != dst:
            merged[(src, dst)] = max(merged.get((src, dst), 0), size)
    indeg = dict.fromkeys(order, 0)
    succ: dict[str, list[str]] = defaultdict(list)
    for src, dst in merged:
        indeg[dst] += 1
        succ[src].append(dst)
    ready = sorted((b for b in order if indeg[b] == 0), key=pos.__getitem__)
    topo: list[str] = []
    while ready:
        b = ready.pop(0)
        topo.append(b)
        for s in succ[b]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
        ready.sort(key=pos.__getitem__)
    if len(topo) != len(order):
        stuck = sorted(set(order) - set(topo), key=pos.__getitem__)[:8]
        raise ConfigError(f"graph {name!r} has a cycle through nodes {stuck}; edges must form a DAG")
    ids = {b: i for i, b in enumerate(topo)}
    out_blocks = tuple(Block(id=ids[b], name=b, **blocks[b]) for b in topo)
    out_edges = tuple(
        Edge(ids[s], ids[d], size)
        for (s, d), size in sorted(merged.items(), key=lambda kv: (ids[kv[0][0]], ids[kv[0][1]]))
    )
    return CondensedGraph(blocks=out_blocks, edges=out_edges, name=name).check()


def _pipedream_value(text: str) -> float:
    if text.startswith("["):
        return sum(float(v) for v in text.strip("[]").split(";") if v.strip())
    return float(text)


def load_pipedream(path: str | Path, *, time_unit_s: float = 1e-3, name: str | None = None) -> CondensedGraph:
    """Read a PipeDream profile ``graph.txt`` into a :class:`CondensedGraph`.

    Each node becomes a block: ``fwd_s``/``bwd_s`` = profiled times × ``time_unit_s``,
    ``param_bytes`` = ``parameter_size``, ``activation_bytes`` = ``output_bytes`` =
    ``activation_size`` (a list of sizes is summed); each edge carries the source's
    ``activation_size``. ``Input`` nodes get ``fwd_s = 0`` (their time is data loading).

    Args:
        path: The ``graph.txt`` file.
        time_unit_s: Seconds per unit of the profiled times (PipeDream: milliseconds, 1e-3).
        name: Graph name; default the file's stem.

    Raises:
        ConfigError: for a line that is neither a node nor an edge, an edge to an unknown node, or
            a cycle; the message gives the file and line number.
    """
    path = Path(path)
    blocks: dict[str, dict[str, Any]] = {}
    raw_edges: list[tuple[str, str]] = []
    for lineno, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        if line.startswith("\t"):
            parts = [p.strip() for p in line.strip().split(" -- ")]
            if len(parts) != 2:
                raise ConfigError(f"{path}:{lineno}: expected an edge 'src -- dst', got {line.strip()!r}")
            raw_edges.append((parts[0], parts[1]))
            continue
        head, _, attrs_text = line.rpartition(" -- ")
        node, _, desc = head.partition(" -- ")
        attrs = {k: _pipedream_value(v) for k, v in _ATTR.findall(attrs_text)}
        if not node or "forward_compute_time" not in attrs:
            raise ConfigError(f"{path}:{lineno}: expected 'nodeK -- desc -- forward_compute_time=…', got {line[:80]!r}")
        is_input = desc.strip().startswith("Input")
        act = int(round(attrs.get("activation_size", 0.0)))
        blocks[node.strip()] = {
            "nodes": (node.strip(),),
            "fwd_s": 0.0 if is_input else attrs["forward_compute_time"] * time_unit_s,
            "bwd_s": attrs.get("backward_compute_time", 0.0) * time_unit_s,
            "param_bytes": int(round(attrs.get("parameter_size", 0.0))),
            "activation_bytes": act,
            "output_bytes": act,
        }
    edges = [(s, d, blocks[s]["output_bytes"] if s in blocks else 0) for s, d in raw_edges]
    return topological_graph(name or path.stem, blocks, edges)


def _tarnawski_blocks(nodes: list[dict[str, Any]], time_unit_s: float) -> tuple[dict[str, dict[str, Any]], dict[int, str]]:
    """Group nodes by colour class: one block per class, named after its first forward node."""
    classes: dict[Any, list[dict[str, Any]]] = {}
    for node in nodes:
        key = node.get("colorClass", ("node", node["id"]))
        classes.setdefault(key, []).append(node)
    blocks: dict[str, dict[str, Any]] = {}
    block_of: dict[int, str] = {}
    for members in classes.values():
        fwd = [m for m in members if not m.get("isBackwardNode")]
        head = (fwd or members)[0]
        name = str(head.get("name", f"n{head['id']}"))
        blocks[name] = {
            "nodes": tuple(str(m.get("name", f"n{m['id']}")) for m in members),
            "fwd_s": sum(float(m.get("fpgaLatency", 0.0)) for m in fwd) * time_unit_s,
            "bwd_s": sum(float(m.get("fpgaLatency", 0.0)) for m in members if m.get("isBackwardNode")) * time_unit_s,
            "buffer_bytes": int(round(sum(float(m.get("size", 0.0)) for m in members))),
        }
        for m in members:
            block_of[int(m["id"])] = name
    return blocks, block_of


def _fuse_cycles(blocks: dict[str, dict[str, Any]], edges: list[tuple[str, str, int]]
                 ) -> tuple[dict[str, dict[str, Any]], list[tuple[str, str, int]], dict[str, str]]:
    """Merge the blocks of every cycle into one block (sums of times and sizes), as dp.cpp fuses
    the strongly connected components of its contracted forward graph: the mirrored edges of
    backward-only classes can close cycles with the forward edges. Also returns the renaming
    (merged block -> the block it joined). networkx (130 ms to import) only where Kahn's
    algorithm finds a cycle."""
    if _acyclic(blocks, edges):
        return blocks, edges, {}
    import networkx as nx

    g = nx.DiGraph()
    g.add_nodes_from(blocks)
    g.add_edges_from((u, v) for u, v, _ in edges)
    groups = [c for c in nx.strongly_connected_components(g) if len(c) > 1]
    if not groups:
        return blocks, edges, {}
    order = list(blocks)
    rename: dict[str, str] = {}
    merged = dict(blocks)
    for group in groups:
        members = sorted(group, key=order.index)
        head = members[0]
        merged[head] = {
            "nodes": tuple(n for m in members for n in blocks[m]["nodes"]),
            **{k: sum(blocks[m][k] for m in members) for k in ("fwd_s", "bwd_s", "buffer_bytes")},
        }
        for m in members[1:]:
            del merged[m]
        rename.update(dict.fromkeys(members, head))
    return merged, [(rename.get(u, u), rename.get(v, v), size) for u, v, size in edges], rename


def _acyclic(blocks: dict[str, Any], edges: list[tuple[str, str, int]]) -> bool:
    """Whether the edges (between distinct blocks) leave the blocks acyclic (Kahn's algorithm)."""
    succ: dict[str, set[str]] = defaultdict(set)
    for u, v, _ in edges:
        if u != v:
            succ[u].add(v)
    indeg = dict.fromkeys(blocks, 0)
    for vs in succ.values():
        for v in vs:
            indeg[v] += 1
    ready = [b for b, d in indeg.items() if d == 0]
    seen = 0
    while ready:
        seen += 1
        for v in succ[ready.pop()]:
            indeg[v] -= 1
            if indeg[v] == 0:
                ready.append(v)
    return seen == len(indeg)


def _tarnawski_json(path: Path) -> dict[str, Any]:
    """The instance at ``path`` as a dict with the four fields every Tarnawski file has.

    Raises:
        ConfigError: for a file that is not such a JSON object.
    """
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a Tarnawski instance is a JSON object, not a {type(data).__name__}")
    for key in ("maxSizePerFPGA", "maxFPGAs", "nodes", "edges"):
        if key not in data:
            raise ConfigError(f"{path}: Tarnawski JSON needs field {key!r}; found {sorted(data)}")
    return data


def load_tarnawski(
    path: str | Path, *, time_unit_s: float = 1.0, link: LinkSpec | None = None, name: str | None = None,
    transfers: str = "relayed",
) -> Problem:
    """Read a Tarnawski et al. JSON instance into a :class:`Problem`.

    Mapping: ``maxFPGAs`` identical devices (speed 1, ``memory_bytes = maxSizePerFPGA``); nodes of
    one ``colorClass`` form one block (forward latencies sum to ``fwd_s``, backward ones to
    ``bwd_s``; ``size`` becomes ``buffer_bytes``, static memory counted once); edges between
    forward nodes of different blocks are kept with ``size_bytes = cost × link.bytes_per_s`` (the
    backward edges mirror them and the cost model pays each boundary twice in training). A class
    with backward nodes only (``AccumulateGrad``) is ordered as ``dp.cpp`` orders it: each
    backward edge ``u -> v`` touching it adds the precedence ``block(v) -> block(u)``, and blocks
    on a cycle are merged.
    Memory is counted as ``dp.cpp`` counts it, node sizes only (``transfer_memory=False``): the
    edge costs are time, never bytes held. ``training`` is True when any node is a backward node.

    ``maxCPUs`` adds that many CPU devices, as ``dp.cpp`` treats them: a CPU stage costs the
    ``cpuLatency`` of its nodes, has no memory limit and pays no communication
    (:attr:`DeviceSpec.comm_free`; the accelerator next to it still pays its transfers), and the
    solver chooses where in the pipeline CPU stages go (``device_order="free"``). A CPU is a
    device of speed ``fpgaLatency / cpuLatency``, which must be one ratio for every node that
    has both (the shipped inputs: 10 for the layer graphs, 23 for the operator graphs); nodes
    with ``supportedOnFpga`` false are refused (they would need a per-node placement).

    ``transfers`` chooses the communication model:

    * ``"relayed"`` (default; fxsplit's runtime): a boundary costs what crosses it, once per value,
      and twice in training (the gradient mirrors the activation); a value that skips stages is
      relayed through the stages between, each paying it.
    * ``"direct"`` (``dp.cpp``'s objective, reproduced exactly): a stage pays each node's
      ``cost`` once when the node is in the stage and one of its edges (forward or backward)
      leaves it, and once when the node is outside and one of its edges enters it
      (:class:`DirectTransfer`); stages between pay nothing, and a training graph's backward
      edges are paid as their own messages. Where a value's gradients come back from two
      stages' worth of readers (a residual's two branches), ``dp.cpp``'s graph sums them on the
      producer's side, so it pays both; a runtime that sums them before sending pays one.

    Args:
        path: The JSON file.
        time_unit_s: Seconds per unit of ``fpgaLatency`` and edge ``cost``.
        link: Link of the devices; default 1e9 bytes/s and no latency.
        name: Graph name; default the file's stem.
        transfers: ``"relayed"`` or ``"direct"`` (above).

    Raises:
        ConfigError: for an unknown ``transfers``; when a field is missing, the merged blocks form a cycle, ``maxCPUs > 0``
            with ``cpuLatency / fpgaLatency`` not one ratio, or a node not supported on the
            accelerators.
    """
    if transfers not in TRANSFERS:
        raise ConfigError(f"transfers={transfers!r} is unknown; choose one of {TRANSFERS}")
    path = Path(path)
    data = _tarnawski_json(path)
    link = link or LinkSpec(bytes_per_s=1e9, latency_s=0.0)
    blocks, block_of = _tarnawski_blocks(data["nodes"], time_unit_s)
    relayed = transfers == "relayed"
    edges = [(block_of[u], block_of[v], int(round(cost * time_unit_s * link.bytes_per_s)) if relayed else 0)
             for u, v, cost in _tarnawski_precedence(data, block_of)]
    blocks, edges, rename = _fuse_cycles(blocks, edges)
    graph = topological_graph(name or path.stem, blocks, edges)
    if not relayed:
        graph = _with_direct_transfers(graph, data, {u: rename.get(b, b) for u, b in block_of.items()},
                                       time_unit_s * link.bytes_per_s)
    cap = int(data["maxSizePerFPGA"])
    devices = tuple(
        DeviceSpec(f"acc{i}", memory_bytes=cap, kind="acc") for i in range(int(data["maxFPGAs"]))
    )
    cpus = int(data.get("maxCPUs", 0) or 0)
    if cpus > 0:
        speed = _cpu_speed(path, data["nodes"])
        devices += tuple(DeviceSpec(f"cpu{i}", memory_bytes=CPU_MEMORY_BYTES, speed=speed, kind="cpu", comm_free=True)
                         for i in range(cpus))
    training = any(n.get("isBackwardNode") for n in data["nodes"])
    return Problem(graph=graph, devices=devices, link=link, training=training,
                   optimizer_state_factor=0.0, grad_factor=0.0, transfer_memory=False,
                   device_order="free" if cpus > 0 else "fixed").check()


def _with_direct_transfers(graph: CondensedGraph, data: dict[str, Any], block_of: dict[int, str],
                           bytes_per_unit: float) -> CondensedGraph:
    """``graph`` with one :class:`DirectTransfer` per node of the file that has edges to other
    blocks (forward and backward edges alike), of its ``cost`` (one per node: dp.cpp refuses a
    node whose out-edges differ)."""
    index = {b.name: b.id for b in graph.blocks}
    readers: dict[int, set[int]] = defaultdict(set)
    cost: dict[int, float] = {}
    for e in data["edges"]:
        u, v = int(e["sourceId"]), int(e["destId"])
        if u in cost and abs(cost[u] - float(e["cost"])) > 1e-6:
            raise ConfigError(f"node {u} has out-edges of cost {cost[u]} and {e['cost']}; dp.cpp's model sends a "
                              "node's output once, so its edges must cost the same")
        cost[u] = float(e["cost"])
        if block_of[u] != block_of[v]:
            readers[u].add(index[block_of[v]])
    direct = tuple(DirectTransfer(index[block_of[u]], tuple(sorted(rs)), float(round(cost[u] * bytes_per_unit)))
                   for u, rs in sorted(readers.items()) if cost[u] > 0)
    return CondensedGraph(graph.blocks, graph.edges, graph.name, direct=direct)


def load_tarnawski_latency(path: str | Path, *, time_unit_s: float = 1.0, name: str | None = None) -> PlacementProblem:
    """Read a Tarnawski et al. JSON instance as a single-sample latency problem
    (:class:`~fxsplit.ir.placement.PlacementProblem`), with the meaning their ``latency-ip/lip.py``
    gives every field: ``maxFPGAs`` accelerators of ``maxSizePerFPGA`` bytes, each node's
    ``fpgaLatency``, ``cpuLatency``, ``size`` (0 when absent), ``supportedOnFpga`` and ``colorClass``
    (a class of its own when absent), and one transfer time per node, its outgoing edges' ``cost``
    (0 without out-edges). ``maxCPUs`` is read but not a limit: as in their IP, CPU nodes run as
    soon as their inputs are ready (as many CPUs as the graph is wide).

    Args:
        path: The JSON file (their ``latency-inputs``; a throughput inference file reads the same).
        time_unit_s: Seconds per unit of the file's latencies and costs.
        name: Problem name; default the file's stem.

    Raises:
        ConfigError: for a missing field, a backward node (latency is for inference), two
            different costs on one node's out-edges, an edge to an unknown node, or a cycle.
    """
    path = Path(path)
    data = _tarnawski_json(path)
    try:
        return _latency_problem(path, data, time_unit_s, name)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{path}: not a valid Tarnawski latency instance: {type(exc).__name__}: {exc}") from exc


def _latency_problem(path: Path, data: dict[str, Any], time_unit_s: float, name: str | None) -> PlacementProblem:
    from fxsplit.ir.placement import PlacementProblem

    nodes = {int(n["id"]): n for n in data["nodes"]}
    backward = [i for i, n in nodes.items() if n.get("isBackwardNode")]
    if backward:
        raise ConfigError(f"{path}: node {backward[0]} is a backward node ({len(backward)} in all); the latency "
                          "objective places one inference sample. Use a throughput objective for training graphs")
    out_cost: dict[int, float] = {}
    succ: dict[int, set[int]] = {i: set() for i in nodes}
    for e in data["edges"]:
        u, v, cost = int(e["sourceId"]), int(e["destId"]), float(e["cost"])
        if u not in nodes or v not in nodes:
            raise ConfigError(f"{path}: edge {u} -> {v} names a node that is not in 'nodes'")
        if u in out_cost and abs(out_cost[u] - cost) > 1e-6:
            raise ConfigError(f"{path}: node {u}'s out-edges cost {out_cost[u]} and {cost}; the latency model moves "
                              "a node's output once, so all its out-edges must cost the same")
        out_cost.setdefault(u, cost)
        if u != v:
            succ[u].add(v)
    indegree = {i: 0 for i in nodes}
    for u in nodes:
        for v in succ[u]:
            indegree[v] += 1
    order: list[int] = []
    ready = sorted(i for i, d in indegree.items() if d == 0)
    while ready:
        u = ready.pop(0)
        order.append(u)
        for v in sorted(succ[u]):
            indegree[v] -= 1
            if indegree[v] == 0:
                ready.append(v)
    if len(order) != len(nodes):
        stuck = sorted(i for i, d in indegree.items() if d > 0)
        raise ConfigError(f"{path}: the edges form a cycle through nodes {stuck[:5]}; a placement needs a DAG")
    index = {nid: i for i, nid in enumerate(order)}
    fresh = max((int(n["colorClass"]) for n in nodes.values() if "colorClass" in n), default=0) + 1
    colours = []
    for nid in order:
        if "colorClass" in nodes[nid]:
            colours.append(int(nodes[nid]["colorClass"]))
        else:
            colours.append(fresh)
            fresh += 1
    return PlacementProblem(
        name=name or path.stem, node_ids=tuple(order),
        acc_s=tuple(float(nodes[i]["fpgaLatency"]) * time_unit_s for i in order),
        cpu_s=tuple(float(nodes[i]["cpuLatency"]) * time_unit_s for i in order),
        size_bytes=tuple(float(nodes[i].get("size", 0.0)) for i in order),
        out_s=tuple(out_cost.get(i, 0.0) * time_unit_s for i in order),
        supported=tuple(bool(nodes[i].get("supportedOnFpga", True)) for i in order),
        colour=tuple(colours),
        edges=tuple(sorted({(index[u], index[v]) for u in nodes for v in succ[u]})),
        accelerators=int(data["maxFPGAs"]), memory_bytes=float(data["maxSizePerFPGA"]),
    ).check()


CPU_MEMORY_BYTES = 2**62
"""Memory of a Tarnawski CPU device: unlimited, as in ``dp.cpp``."""


def _cpu_speed(path: Path, nodes: list[dict[str, Any]], rtol: float = 1e-6) -> float:
    """``fpgaLatency / cpuLatency``, one ratio over every node with both latencies positive.

    Raises:
        ConfigError: for a node not supported on the accelerators, a node that takes time on one
            device kind only, or ratios that differ by more than ``rtol``.
    """
    ratios: list[tuple[float, int]] = []
    for n in nodes:
        if not n.get("supportedOnFpga", True):
            raise ConfigError(f"{path}: node {n['id']} ({n.get('name', '?')}) has supportedOnFpga false; fxsplit "
                              "places blocks on any device, so it cannot keep this node on a CPU. Remove maxCPUs "
                              "or make the node supported")
        cpu, fpga = float(n.get("cpuLatency", 0.0)), float(n.get("fpgaLatency", 0.0))
        if (cpu > 0) != (fpga > 0):
            raise ConfigError(f"{path}: node {n['id']} takes {cpu} on a CPU and {fpga} on an accelerator; a CPU "
                              "device is a speed factor, so both must be 0 or both positive")
        if fpga > 0:
            ratios.append((fpga / cpu, int(n["id"])))
    if not ratios:
        return 1.0
    lo, hi = min(ratios), max(ratios)
    if hi[0] > lo[0] * (1 + rtol):
        raise ConfigError(f"{path}: fpgaLatency / cpuLatency is {lo[0]:.6g} at node {lo[1]} but {hi[0]:.6g} at node "
                          f"{hi[1]}; a CPU device runs every node at one speed factor, so the ratio must be one")
    return float(statistics.median(r for r, _ in ratios))


def _tarnawski_precedence(data: dict[str, Any], block_of: dict[int, str]) -> list[tuple[int, int, float]]:
    """The node-level precedence of a Tarnawski instance, as ``dp.cpp`` keeps it: ``(before,
    after, cost)`` for every edge between forward nodes of different classes (``after``'s stage
    is not earlier; ``cost`` the edge's), and, for a class with backward nodes only
    (``AccumulateGrad``), the mirror of each backward edge touching it, ``v``'s forward before
    ``u``'s (cost 0: precedence only)."""
    backward = {int(n["id"]) for n in data["nodes"] if n.get("isBackwardNode")}
    orphans = set(block_of.values()) - {block_of[int(n["id"])] for n in data["nodes"] if not n.get("isBackwardNode")}
    out = []
    for e in data["edges"]:
        u, v = int(e["sourceId"]), int(e["destId"])
        if block_of[u] == block_of[v]:
            continue
        if u in backward and v in backward and (block_of[u] in orphans or block_of[v] in orphans):
            out.append((v, u, 0.0))
        elif u not in backward and v not in backward:
            out.append((u, v, float(e["cost"])))
    return out


def _node_stages(data: dict[str, Any], problem: Problem, plan: Plan
                 ) -> tuple[dict[int, int], list[str], list[tuple[int, int, float]]]:
    """Each node's stage in ``plan`` (by its block's name, through the merges of cycle fusion),
    a fault for every node in no stage, and the file's precedence (:func:`_tarnawski_precedence`)."""
    blocks, block_of = _tarnawski_blocks(data["nodes"], 1.0)
    precedence = _tarnawski_precedence(data, block_of)
    _, _, rename = _fuse_cycles(blocks, [(block_of[u], block_of[v], 0) for u, v, _ in precedence])
    stage_of_block = {problem.graph.blocks[b].name: s for s, st in enumerate(plan.stages) for b in st.blocks}
    faults: list[str] = []
    stage: dict[int, int] = {}
    for node in data["nodes"]:
        nid = int(node["id"])
        name = rename.get(block_of[nid], block_of[nid])
        if name not in stage_of_block:
            faults.append(f"node {nid} (block {name!r}) is in no stage")
        else:
            stage[nid] = stage_of_block[name]
    return stage, faults, precedence


def tarnawski_plan_faults(path: str | Path, problem: Problem, plan: Plan) -> list[str]:
    """Every precedence of the Tarnawski instance at ``path`` that ``plan`` breaks, checked on the
    file's own nodes and edges (never on the block graph the solvers saw), and every node the plan
    does not place. Empty for a valid plan.

    Args:
        path: The instance (``load_tarnawski``'s input).
        problem: The problem ``load_tarnawski(path)`` made (its block names map nodes to stages).
        plan: A plan of ``problem``.

    Raises:
        ConfigError: for a malformed file (as :func:`load_tarnawski`).
    """
    path = Path(path)
    data = _tarnawski_json(path)
    stage, faults, precedence = _node_stages(data, problem, plan)
    for u, v, _ in precedence:
        if u in stage and v in stage and stage[u] > stage[v]:
            faults.append(f"node {u} (stage {stage[u]}) must not come after node {v} (stage {stage[v]})")
    return faults


def tarnawski_max_load(path: str | Path, problem: Problem, plan: Plan, *, communication: bool = True) -> float:
    """``plan``'s largest stage load costed as Tarnawski et al.'s ``dp.cpp`` costs it, on the
    file's own nodes and edges, in the file's units: an accelerator stage pays its nodes'
    ``fpgaLatency`` (forward and backward) and, once each, the ``cost`` of every node with an edge
    crossing the stage's node set either way (forward or backward edge); a CPU stage
    (``comm_free`` device) pays its nodes' ``cpuLatency`` only. fxsplit's own model charges a
    training boundary twice its forward transfers and relays skipping tensors, so the two differ
    where gradients do not mirror activations (more here) or tensors skip stages (less here).

    Args:
        path, problem, plan: As :func:`tarnawski_plan_faults`.
        communication: Count the edges' costs (False: as ``fxsplit solve --no-comm``).

    Raises:
        ConfigError: for a malformed file or a node the plan does not place.
    """
    path = Path(path)
    data = _tarnawski_json(path)
    stage, faults, _ = _node_stages(data, problem, plan)
    if faults:
        raise ConfigError(f"{path}: the plan does not place every node: {'; '.join(faults[:3])}")
    nodes = {int(n["id"]): n for n in data["nodes"]}
    crossing: list[set[int]] = [set() for _ in plan.stages]
    cost: dict[int, float] = {}
    for e in data["edges"]:
        u, v = int(e["sourceId"]), int(e["destId"])
        cost[u] = float(e["cost"])
        if stage[u] != stage[v]:
            crossing[stage[u]].add(u)
            crossing[stage[v]].add(u)
    loads = [0.0] * len(plan.stages)
    for nid, s in stage.items():
        cpu = problem.devices[plan.stages[s].device].comm_free
        loads[s] += float(nodes[nid].get("cpuLatency" if cpu else "fpgaLatency", 0.0))
    for s, members in enumerate(crossing):
        if communication and not problem.devices[plan.stages[s].device].comm_free:
            loads[s] += sum(cost[u] for u in members)
    return max(loads, default=0.0)


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text file ({exc.reason} at byte {exc.start}); fxsplit reads PipeDream "
                          "graph.txt, Tarnawski JSON and fxsplit JSON") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc}") from exc


_PARSED: dict[tuple[str, int, int], Any] = {}
"""The last files :func:`_read_json` parsed, by (path, modification time, size): ``fxsplit
solve`` reads one Tarnawski file to detect its format, load it, re-check the plan's precedences
and cost it as ``dp.cpp`` does, and parsing the largest took ~10 ms each time."""


def _read_json(path: Path) -> Any:
    """The JSON value in ``path``, parsed once while the file is unchanged (the value is shared:
    callers read it, never change it)."""
    try:
        st = path.stat()
        key: tuple[str, int, int] | None = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    except OSError:
        key = None  # _read_text says why
    if key is not None and key in _PARSED:
        return _PARSED[key]
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno} "
                          "(truncated or edited?)") from exc
    if key is not None:
        if len(_PARSED) >= 4:
            _PARSED.clear()
        _PARSED[key] = data
    return data


def detect_format(path: Path) -> str:
    """``"tarnawski"``, ``"fxsplit"`` or ``"pipedream"``: what :func:`load_graph_or_problem` reads ``path`` as."""
    stripped = _read_text(path).lstrip()
    if not stripped.startswith(("{", "[")):
        return "pipedream"
    data = _read_json(path)
    if isinstance(data, dict) and ("maxFPGAs" in data or "maxSizePerFPGA" in data):
        return "tarnawski"
    return "fxsplit"


def load_graph_or_problem(path: str | Path, format: str = "auto", *, transfers: str = "relayed"
                          ) -> CondensedGraph | Problem:
    """Load a graph or a whole problem from ``path``.

    Args:
        path: The file.
        format: ``"auto"`` (JSON with ``maxFPGAs`` → tarnawski, other JSON → fxsplit, text →
            pipedream), ``"fxsplit"``, ``"pipedream"`` or ``"tarnawski"``.
        transfers: For Tarnawski files, :func:`load_tarnawski`'s communication model.

    Returns:
        A :class:`Problem` for Tarnawski files and fxsplit problem JSON (it has ``"devices"``),
        otherwise a :class:`CondensedGraph`.

    Raises:
        ConfigError: for an unknown format, a missing file, a malformed file, or ``transfers``
            other than ``"relayed"`` for a file that is not Tarnawski's.
    """
    path = Path(path)
    if format not in FORMATS:
        raise ConfigError(f"unknown graph format {format!r}; choose one of {FORMATS}")
    if not path.is_file():
        raise ConfigError(f"graph file {str(path)!r} does not exist")
    fmt = detect_format(path) if format == "auto" else format
    if transfers != "relayed" and fmt != "tarnawski":
        raise ConfigError(f"transfers={transfers!r} is for Tarnawski files; {path} is read as {fmt}, whose values are "
                          "relayed stage to stage. Leave transfers at 'relayed'")
    try:
        if fmt == "pipedream":
            return load_pipedream(path)
        if fmt == "tarnawski":
            return load_tarnawski(path, transfers=transfers)
        data = _read_json(path)
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: fxsplit JSON is an object at the top level, not a {type(data).__name__}")
        if "devices" in data:
            return Problem.from_dict(data).check()
        if "blocks" in data:
            return CondensedGraph.from_dict(data).check()
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        # a field missing or of the wrong type, an unknown field, a reference to a missing node
        raise ConfigError(f"{path}: not a valid {fmt} file: {type(exc).__name__}: {exc}") from exc
    raise ConfigError(f"{path}: fxsplit JSON needs 'blocks' (a graph) or 'graph' and 'devices' (a problem)")
