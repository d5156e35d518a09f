"""Shared hypothesis strategies for fxsplit's torch-free types (graphs, devices, problems).

Import as ``from strategies import condensed_graphs, problems`` (pytest puts ``tests/`` on the
path). Costs are small multiples of round numbers so that ties are exact and failures readable.
"""

from __future__ import annotations

from hypothesis import strategies as st

from fxsplit.ir import Block, CondensedGraph, DeviceSpec, Edge, LinkSpec, Problem

__all__ = ["condensed_graphs", "device_lists", "problems", "MiB"]

MiB = 2**20


@st.composite
def condensed_graphs(
    draw: st.DrawFn,
    min_blocks: int = 1,
    max_blocks: int = 9,
    max_back: int = 3,
    source_prob: float = 0.15,
    with_memory: bool = True,
    byte_unit: int = MiB,
) -> CondensedGraph:
    """Random block DAGs in topological order.

    Each block after the first is a new source with probability ``source_prob``; otherwise it
    reads a non-empty subset of the ``max_back`` blocks before it (so width, and the number of
    downsets, stay moderate). Times are multiples of 0.5 s, bytes multiples of ``byte_unit``
    (1 MiB; real models need ``>= 128 MiB``: their byte coefficients sum past 2^31).
    """
    n = draw(st.integers(min_blocks, max_blocks))
    blocks, edges = [], []
    for i in range(n):
        fwd = draw(st.integers(0, 8)) * 0.5
        bwd = draw(st.integers(0, 8)) * 0.5
        mem = {}
        if with_memory:
            mem = {
                "param_bytes": draw(st.integers(0, 4)) * byte_unit,
                "activation_bytes": draw(st.integers(0, 4)) * byte_unit,
                "output_bytes": draw(st.integers(0, 4)) * byte_unit,
            }
        blocks.append(Block(i, f"b{i}", (f"n{i}",), fwd_s=fwd, bwd_s=bwd, **mem))
        if i == 0 or draw(st.floats(0, 1)) < source_prob:
            continue
        window = list(range(max(0, i - max_back), i))
        preds = draw(st.sets(st.sampled_from(window), min_size=1))
        for p in sorted(preds):
            size = blocks[p].output_bytes if with_memory else 0
            edges.append(Edge(p, i, size))
    return CondensedGraph(tuple(blocks), tuple(edges), name="random")


@st.composite
def device_lists(draw: st.DrawFn, min_devices: int = 1, max_devices: int = 4,
                 heterogeneous: bool = False, memory_mib: tuple[int, int] | None = None,
                 byte_unit: int = MiB, two_classes: bool = False) -> tuple[DeviceSpec, ...]:
    """``k`` devices; heterogeneous ones draw speed from {1, 2} (kinds ``slow``/``fast``) and,
    with ``memory_mib=(lo, hi)``, memory in ``byte_unit`` s from that range.

    ``two_classes`` mixes like real clusters (and ``bench/model_graphs.device_set``): the first
    ``ceil(k / 2)`` devices are fast with more memory, the rest half as fast with less.
    """
    k = draw(st.integers(min_devices, max_devices))
    lo, hi = memory_mib or (2**40 // byte_unit, 2**40 // byte_unit)
    if two_classes:
        big = draw(st.integers(lo, hi))
        small = draw(st.integers(lo, big))
        return tuple(DeviceSpec(f"fast{i}", memory_bytes=big * byte_unit, speed=2.0, kind="fast")
                     if i < (k + 1) // 2 else
                     DeviceSpec(f"slow{i}", memory_bytes=small * byte_unit, speed=1.0, kind="slow")
                     for i in range(k))
    out = []
    for i in range(k):
        speed = draw(st.sampled_from([1.0, 2.0])) if heterogeneous else 1.0
        mem = draw(st.integers(lo, hi)) * byte_unit
        kind = "fast" if speed > 1 else "slow"
        out.append(DeviceSpec(f"d{i}", memory_bytes=mem, speed=speed, kind=kind))
    return tuple(out)


@st.composite
def problems(
    draw: st.DrawFn,
    max_blocks: int = 9,
    max_devices: int = 4,
    heterogeneous: bool = False,
    device_order: str | None = "fixed",
    objective: str | None = "bottleneck",
    memory_mib: tuple[int, int] | None = None,
    comm: bool = True,
    byte_unit: int = MiB,
    two_classes: bool = False,
) -> Problem:
    """Random problems; ``None`` for ``device_order``/``objective`` draws one. Bytes, memory
    and link bandwidth scale with ``byte_unit``; ``two_classes``: see :func:`device_lists`."""
    graph = draw(condensed_graphs(max_blocks=max_blocks, byte_unit=byte_unit))
    devices = draw(device_lists(max_devices=max_devices, heterogeneous=heterogeneous, memory_mib=memory_mib,
                                byte_unit=byte_unit, two_classes=two_classes))
    link = LinkSpec(bytes_per_s=draw(st.sampled_from([1.0, 4.0])) * byte_unit, latency_s=0.25) if comm \
        else LinkSpec(bytes_per_s=float("inf"), latency_s=0.0)
    return Problem(
        graph=graph,
        devices=devices,
        link=link,
        microbatches=draw(st.integers(1, 4)),
        schedule=draw(st.sampled_from(["gpipe", "1f1b", "zero-bubble"])),
        objective=objective or draw(st.sampled_from(["bottleneck", "makespan"])),
        training=draw(st.booleans()),
        device_order=device_order or draw(st.sampled_from(["fixed", "free"])),
        recompute=draw(st.sampled_from(["none", "auto", "all"])),
    )


# --- random nn.Module DAGs (front end) ---------------------------------------------------------
# Owned by the front-end tests (test_condense.py and friends). fxsplit.models imports torch, so
# it is imported inside the strategies: the torch-free strategies above stay torch-free.


@st.composite
def dag_specs(draw: st.DrawFn, max_nodes: int = 10, max_extra_outputs: int = 1) -> object:
    """Random :class:`fxsplit.models.DagSpec` s drawn op by op (so hypothesis shrinks them).

    Follows :func:`fxsplit.models.random_dag_spec`: inputs favour the previous value (chains)
    but may reach back to any earlier value (skips); binary ops merge branches; every value
    nobody reads is an output, plus up to ``max_extra_outputs`` values that are also read.
    """
    from fxsplit.models.dag import OPS, DagNode, DagSpec

    n = draw(st.integers(1, max_nodes))
    nodes = []
    for i in range(n):
        op = draw(st.sampled_from(sorted(OPS)))
        inputs = tuple(draw(st.one_of(st.just(i), st.integers(0, i))) for _ in range(OPS[op]))
        nodes.append(DagNode(op, inputs))
    read = {v for node in nodes for v in node.inputs}
    sinks = [v for v in range(1, n + 1) if v not in read]
    inner = [v for v in range(1, n + 1) if v in read]
    extra = draw(st.lists(st.sampled_from(inner), max_size=max_extra_outputs, unique=True)) if inner else []
    return DagSpec(nodes=tuple(nodes), outputs=tuple(sorted(sinks + extra)))


def seeded_dag_specs(max_nodes: int = 10) -> st.SearchStrategy:
    """Specs from :func:`fxsplit.models.random_dag_spec` itself, with a hypothesis-drawn seed."""
    import random

    from fxsplit.models.dag import random_dag_spec

    return st.integers(0, 2**32 - 1).map(lambda seed: random_dag_spec(random.Random(seed), max_nodes))


def any_dag_specs(max_nodes: int = 10) -> st.SearchStrategy:
    """Either kind of random spec: shrinkable op-by-op draws, or the zoo's own generator."""
    return st.one_of(dag_specs(max_nodes), seeded_dag_specs(max_nodes))


def build_dag(spec: object, width: int = 4, batch: int = 2, seed: int = 0) -> tuple[object, tuple]:
    """``(module, (x,))`` for a spec: weights and input drawn from ``seed``, the global RNG untouched."""
    import torch

    from fxsplit.models.case import seeded
    from fxsplit.models.dag import build_dag_module

    with seeded(seed):
        module = build_dag_module(spec, width)  # type: ignore[arg-type]
        x = torch.randn(batch, width)
    return module, (x,)
