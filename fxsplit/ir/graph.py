"""The condensed block graph: the torch-free input of every solver.

A :class:`CondensedGraph` is a DAG of :class:`Block` s in topological order (``blocks[i].id == i``
and every edge goes from a lower to a higher id). Each block carries the costs of the FX nodes it
condenses, measured or modelled on a *reference device* of speed 1.0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fxsplit.errors import PlanError

__all__ = ["Block", "Edge", "CondensedGraph", "DirectTransfer"]


@dataclass(frozen=True)
class Block:
    """A group of graph nodes that always go to the same stage.

    Args:
        id: Position of the block in topological order.
        name: Human-readable name (usually the first node's name).
        nodes: Names of the FX nodes (or input-format layer names) in this block.
        flops: Forward floating-point operations per micro-batch.
        fwd_s: Forward time per micro-batch on the reference device, seconds.
        bwd_s: Backward time per micro-batch on the reference device, seconds.
        fwd_fixed_s, bwd_fixed_s: The part of ``fwd_s`` / ``bwd_s`` that does not shrink with
            the micro-batch (operator launch and dispatch, the intercept ``t0`` of a profiled
            ``t(b) = t0 + t1 * b``), seconds; :meth:`CondensedGraph.scaled` keeps it whole.
        bwd_weight_s: The part of ``bwd_s`` that computes parameter gradients (a zero-bubble
            schedule's ``W``; the rest is ``I``), seconds; it keeps its share when times scale.
        param_bytes: Bytes of trainable parameters the block owns.
        replica_param_bytes: Bytes of trainable parameters the block reads but another block
            owns (tied weights): a stage holding this block keeps its own copy, so its memory
            is charged here too (conservatively, even when the owner shares the stage).
        buffer_bytes: Bytes of non-trainable state (buffers) the block owns.
        activation_bytes: Bytes kept for backward per micro-batch.
        output_bytes: Bytes of the block's outputs per micro-batch.
        grad_accumulate_s: Seconds to add one micro-batch's gradients of the block's parameters
            into those the step's earlier micro-batches left (every micro-batch after a step's
            first does; a profile that starts each step from no gradients does not see it), on
            the reference device; :meth:`CondensedGraph.scaled` charges ``(1 - fraction)`` of it
            to each micro-batch's backward. 0: not modelled.
    """

    id: int
    name: str
    nodes: tuple[str, ...] = ()
    flops: float = 0.0
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    param_bytes: int = 0
    buffer_bytes: int = 0
    replica_param_bytes: int = 0
    fwd_fixed_s: float = 0.0
    bwd_fixed_s: float = 0.0
    bwd_weight_s: float = 0.0
    activation_bytes: int = 0
    output_bytes: int = 0
    grad_accumulate_s: float = 0.0

    @property
    def time_s(self) -> float:
        """Forward plus backward time on the reference device, seconds."""
        return self.fwd_s + self.bwd_s


@dataclass(frozen=True)
class Edge:
    """Data flowing from block ``src`` to block ``dst``: ``size_bytes`` per micro-batch, and in
    training ``grad_bytes`` of gradient flowing back (``None``: the same as ``size_bytes``; less
    where some of the values need no gradient: masks, positions, integer tensors)."""

    src: int
    dst: int
    size_bytes: int = 0
    grad_bytes: int | None = None

    @property
    def backward_bytes(self) -> int:
        """Gradient bytes per micro-batch flowing back over this edge in training."""
        return self.size_bytes if self.grad_bytes is None else self.grad_bytes


@dataclass(frozen=True)
class DirectTransfer:
    """A value that goes straight from block ``src``'s stage to the stage of each block in
    ``dsts`` that is not ``src``'s, with no stage between relaying it: ``size_bytes`` per
    micro-batch, paid once by a stage holding ``src`` when some block of ``dsts`` is elsewhere,
    and once by every other stage holding a block of ``dsts``.

    This is how Tarnawski et al.'s ``dp.cpp`` charges communication (each distinct node with an
    edge crossing a stage's node set, either way, once); fxsplit's own edges are relayed instead.
    ``dsts`` may name earlier blocks (a training graph's gradient messages).
    """

    src: int
    dsts: tuple[int, ...]
    size_bytes: float = 0.0


@dataclass(frozen=True)
class CondensedGraph:
    """A DAG of blocks in topological order with the bytes carried by each edge.

    Communication model: a value made by block ``u`` and consumed by several blocks beyond a stage
    boundary crosses that boundary once, so the traffic across the boundary of a downset ``I`` is
    ``sum over u in I of max(size_bytes of u's edges leaving I)`` (see :meth:`cut_bytes`).
    :attr:`direct` adds values that travel without relay (:class:`DirectTransfer`); their
    stage cost is :meth:`direct_bytes`.

    Raises:
        PlanError: from :meth:`validate` when ids are not ``0..n-1`` in order, an edge points
            backwards or to an unknown block, or a cost is negative.
    """

    blocks: tuple[Block, ...]
    edges: tuple[Edge, ...] = ()
    name: str = "graph"
    #: ``((batch_fraction, graph), ...)``: this graph's costs for micro-batches of those fractions
    #: of the annotated batch, evaluated from the symbolic cost formulas
    #: (:mod:`fxsplit.passes.symbolic`); :meth:`scaled` returns them instead of its linear scaling.
    #: Not serialised; :meth:`with_time_factors` and :meth:`with_weight_shares` refit them too;
    #: other graphs derived from this one (reduced, re-timed by a profile) scale linearly.
    microbatch_graphs: tuple[tuple[float, CondensedGraph], ...] = field(default=(), repr=False, compare=False)
    #: Values sent straight to the stages reading them (:class:`DirectTransfer`), every message of
    #: a step (a training graph lists its gradient messages too, never doubled); empty: none.
    #: Graphs derived by re-timing or reduction do not carry them (the solvers refuse those).
    direct: tuple[DirectTransfer, ...] = ()
    _succ: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _pred: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.blocks)
        succ: list[list[int]] = [[] for _ in range(n)]
        pred: list[list[int]] = [[] for _ in range(n)]
        for e in self.edges:
            if 0 <= e.src < n and 0 <= e.dst < n:
                succ[e.src].append(e.dst)
                pred[e.dst].append(e.src)
        object.__setattr__(self, "_succ", tuple(tuple(sorted(set(s))) for s in succ))
        object.__setattr__(self, "_pred", tuple(tuple(sorted(set(p))) for p in pred))

    # -- structure -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[Block]:
        return iter(self.blocks)

    def successors(self, b: int) -> tuple[int, ...]:
        """Ids of the blocks that consume an output of block ``b``."""
        return self._succ[b]

    def predecessors(self, b: int) -> tuple[int, ...]:
        """Ids of the blocks whose outputs block ``b`` consumes."""
        return self._pred[b]

    def out_edges(self, b: int) -> list[Edge]:
        """Edges leaving block ``b``."""
        return [e for e in self.edges if e.src == b]

    def is_downset(self, ids: set[int] | frozenset[int]) -> bool:
        """True when ``ids`` holds every predecessor of each of its blocks."""
        return all(p in ids for b in ids for p in self._pred[b])

    def cut_bytes(self, downset: set[int] | frozenset[int]) -> int:
        """Bytes per micro-batch crossing from ``downset`` to the rest of the graph.

        Each producing block pays the largest of its edges that leave the downset once (a value
        read by several later blocks is sent once), summed over producers.
        """
        return self._cut(downset, gradients=False)

    def grad_cut_bytes(self, downset: set[int] | frozenset[int]) -> int:
        """Gradient bytes per micro-batch flowing back into ``downset`` in training: as
        :meth:`cut_bytes`, with each edge's :attr:`Edge.backward_bytes`."""
        return self._cut(downset, gradients=True)

    def _cut(self, downset: set[int] | frozenset[int], *, gradients: bool) -> int:
        best: dict[int, int] = {}
        for e in self.edges:
            if e.src in downset and e.dst not in downset:
                best[e.src] = max(best.get(e.src, 0), e.backward_bytes if gradients else e.size_bytes)
        return sum(best.values())

    @property
    def gradients_mirror(self) -> bool:
        """Whether every edge's gradient is as large as its value (no :attr:`Edge.grad_bytes`)."""
        return all(e.grad_bytes is None for e in self.edges)

    def direct_bytes(self, stage: set[int] | frozenset[int]) -> float:
        """Bytes per micro-batch the stage holding the blocks ``stage`` pays for
        :attr:`direct` transfers: each transfer once when its source is in ``stage`` and a reader
        is not, or its source is not and a reader is."""
        total = 0.0
        for t in self.direct:
            readers = [d for d in t.dsts if d != t.src]
            if (t.src in stage and any(d not in stage for d in readers)) or (
                    t.src not in stage and any(d in stage for d in readers)):
                total += t.size_bytes
        return total

    def direct_groups(self) -> tuple[dict[tuple[int, int], float], list[tuple[int, tuple[int, ...], float]]]:
        """:attr:`direct` as the solvers cost it: ``(pairs, many)``, the transfers with one reader
        other than their source summed per ``(source, reader)`` (bytes), and those with several
        as ``(source, readers, bytes)``; transfers read by their source alone, or of 0 bytes,
        cost nothing and are left out."""
        pairs: dict[tuple[int, int], float] = {}
        many: list[tuple[int, tuple[int, ...], float]] = []
        for t in self.direct:
            readers = tuple(sorted(set(t.dsts) - {t.src}))
            if not readers or t.size_bytes == 0:
                continue
            if len(readers) == 1:
                pairs[t.src, readers[0]] = pairs.get((t.src, readers[0]), 0.0) + t.size_bytes
            else:
                many.append((t.src, readers, float(t.size_bytes)))
        return pairs, many

    # -- totals ----------------------------------------------------------------------------
    @property
    def total_time_s(self) -> float:
        """Forward plus backward time of all blocks on the reference device, seconds."""
        return sum(b.time_s for b in self.blocks)

    @property
    def total_param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks)

    def scaled(self, batch_fraction: float) -> CondensedGraph:
        """Costs for a micro-batch that is ``batch_fraction`` of the annotated batch.

        Where :attr:`microbatch_graphs` holds that fraction (the analytic cost model's formulas,
        evaluated at the micro-batch sizes the schedule search tries), that graph. Otherwise:

        Times scale as ``t(f) = fixed + (t - fixed) * f`` (the fixed part, ``fwd_fixed_s`` /
        ``bwd_fixed_s``, is paid by every micro-batch whatever its size); FLOPs, activation, output
        and edge bytes scale linearly; parameter and buffer bytes do not. Used to turn whole-batch
        annotations into per-micro-batch costs (``batch_fraction = 1 / microbatches``), so each
        backward also pays ``1 - batch_fraction`` of its block's :attr:`Block.grad_accumulate_s`
        (the step's micro-batches after the first add their gradients into the first's).

        Example:
            >>> g = CondensedGraph((Block(0, "b", fwd_s=5.0, fwd_fixed_s=1.0),))
            >>> g.scaled(0.25).blocks[0].fwd_s
            2.0
        """
        f = batch_fraction
        for fraction, graph in self.microbatch_graphs:
            if math.isclose(fraction, f, rel_tol=1e-9):
                return graph._accumulating(1.0 - f)
        blocks = tuple(
            replace(b, flops=b.flops * f, fwd_s=b.fwd_fixed_s + (b.fwd_s - b.fwd_fixed_s) * f,
                    bwd_s=(bwd := b.bwd_fixed_s + (b.bwd_s - b.bwd_fixed_s) * f),
                    bwd_weight_s=b.bwd_weight_s * bwd / b.bwd_s if b.bwd_s > 0 else 0.0,
                    activation_bytes=int(b.activation_bytes * f), output_bytes=int(b.output_bytes * f))
            for b in self.blocks
        )
        edges = tuple(replace(e, size_bytes=int(e.size_bytes * f),
                              grad_bytes=None if e.grad_bytes is None else int(e.grad_bytes * f)) for e in self.edges)
        direct = tuple(replace(t, size_bytes=t.size_bytes * f) for t in self.direct)
        return CondensedGraph(blocks=blocks, edges=edges, name=self.name, direct=direct)._accumulating(1.0 - f)

    def _accumulating(self, share: float) -> CondensedGraph:
        """This graph with ``share`` of each block's :attr:`Block.grad_accumulate_s` added to its
        backward, the weight-gradient half keeping its share of it (as when times scale; a
        measured share, :meth:`with_weight_shares`, stays the one measured); itself when nothing
        accumulates."""
        if share <= 0 or not any(b.grad_accumulate_s for b in self.blocks):
            return self
        blocks = tuple(
            replace(b, bwd_s=(bwd := b.bwd_s + share * b.grad_accumulate_s),
                    bwd_weight_s=b.bwd_weight_s * bwd / b.bwd_s if b.bwd_s > 0 else b.bwd_weight_s)
            if b.grad_accumulate_s else b for b in self.blocks)
        return replace(self, blocks=blocks, microbatch_graphs=())

    def with_time_factors(self, fwd_factors: Sequence[float], bwd_factors: Sequence[float]) -> CondensedGraph:
        """Block times multiplied by per-block factors (fixed parts too): costs refitted to
        measurements, e.g. by :func:`fxsplit.calibrate` with each stage's measured / predicted.

        Args:
            fwd_factors, bwd_factors: ``[num_blocks]`` positive finite factors.

        Raises:
            PlanError: for a factor list of the wrong length or a factor that is not positive
                and finite.

        Example:
            >>> CondensedGraph.chain([1.0, 2.0]).with_time_factors([2.0, 1.0], [1.0, 1.0]).total_time_s
            4.0
        """
        for label, factors in (("fwd_factors", fwd_factors), ("bwd_factors", bwd_factors)):
            if len(factors) != len(self.blocks):
                raise PlanError(f"{label} has {len(factors)} entries for {len(self.blocks)} blocks; give one per block")
            bad = [(i, f) for i, f in enumerate(factors) if not (0 < f < float("inf"))]
            if bad:
                raise PlanError(f"{label} must be positive and finite; block {bad[0][0]} has {bad[0][1]!r}")
        blocks = tuple(
            replace(b, fwd_s=b.fwd_s * f, fwd_fixed_s=b.fwd_fixed_s * f, bwd_s=b.bwd_s * g, bwd_fixed_s=b.bwd_fixed_s * g,
                    bwd_weight_s=b.bwd_weight_s * g, grad_accumulate_s=b.grad_accumulate_s * g)
            for b, f, g in zip(self.blocks, fwd_factors, bwd_factors, strict=True)
        )
        # the micro-batch costs from the formulas get the same factors: a factor fitted on one
        # micro-batch's costs must reproduce that measurement at that size
        table = tuple((frac, g.with_time_factors(fwd_factors, bwd_factors)) for frac, g in self.microbatch_graphs)
        return CondensedGraph(blocks=blocks, edges=self.edges, name=self.name, microbatch_graphs=table, direct=self.direct)

    def with_grad_accumulation(self, bytes_per_s: float) -> CondensedGraph:
        """Each block's :attr:`Block.grad_accumulate_s` set to its parameter bytes, own and tied
        copies, at ``bytes_per_s`` of gradient added into the step's (the micro-batch graphs'
        too).

        Example:
            >>> CondensedGraph((Block(0, "b", param_bytes=10),)).with_grad_accumulation(5.0).blocks[0].grad_accumulate_s
            2.0
        """
        blocks = tuple(replace(b, grad_accumulate_s=(b.param_bytes + b.replica_param_bytes) / bytes_per_s)
                       for b in self.blocks)
        table = tuple((frac, g.with_grad_accumulation(bytes_per_s)) for frac, g in self.microbatch_graphs)
        return CondensedGraph(blocks=blocks, edges=self.edges, name=self.name, microbatch_graphs=table, direct=self.direct)

    def with_loss(self, fwd_s: float, bwd_s: float, fwd_fixed_s: float = 0.0, bwd_fixed_s: float = 0.0) -> CondensedGraph:
        """The loss (computed on the last stage after its forward, differentiated first in its
        backward) charged to the last sink block, the one that makes the model's outputs when
        a single block does: ``fwd_s`` / ``bwd_s`` seconds for the whole annotated batch, of
        which ``fwd_fixed_s`` / ``bwd_fixed_s`` are paid by every micro-batch whatever its size
        (as :attr:`Block.fwd_fixed_s`); the micro-batch graphs get it at their fractions. The
        loss has no parameters: its backward is input-gradient work (``bwd_weight_s`` unchanged).
        Where several blocks are sinks, the one last in topological order takes it (the runtime
        computes the loss on the last stage, which need not hold that block).

        Example:
            >>> g = CondensedGraph((Block(0, "a"), Block(1, "head", fwd_s=1.0)), (Edge(0, 1),))
            >>> g.with_loss(0.5, 1.0).blocks[1].fwd_s
            1.5
        """
        if not self.blocks or (fwd_s <= 0 and bwd_s <= 0):
            return self
        sink = max(b.id for b in self.blocks if not self.successors(b.id))
        fwd_fixed_s, bwd_fixed_s = min(fwd_fixed_s, fwd_s), min(bwd_fixed_s, bwd_s)
        blocks = tuple(replace(b, fwd_s=b.fwd_s + fwd_s, fwd_fixed_s=b.fwd_fixed_s + fwd_fixed_s,
                               bwd_s=b.bwd_s + bwd_s, bwd_fixed_s=b.bwd_fixed_s + bwd_fixed_s)
                       if b.id == sink else b for b in self.blocks)
        table = tuple((frac, g.with_loss(fwd_fixed_s + (fwd_s - fwd_fixed_s) * frac,
                                         bwd_fixed_s + (bwd_s - bwd_fixed_s) * frac, fwd_fixed_s, bwd_fixed_s))
                      for frac, g in self.microbatch_graphs)
        return CondensedGraph(blocks=blocks, edges=self.edges, name=self.name, microbatch_graphs=table, direct=self.direct)

    def with_weight_shares(self, shares: Sequence[float | None]) -> CondensedGraph:
        """Each block's ``bwd_weight_s`` set to ``shares[b] x bwd_s`` (None keeps it): the part
        of the backward that computes weight gradients, as measured (zero-bubble's ``W``).

        Raises:
            PlanError: for a list of the wrong length or a share outside ``[0, 1]``.

        Example:
            >>> CondensedGraph((Block(0, "b", bwd_s=2.0),)).with_weight_shares([0.5]).blocks[0].bwd_weight_s
            1.0
        """
        if len(shares) != len(self.blocks) or any(x is not None and not 0.0 <= x <= 1.0 for x in shares):
            raise PlanError(f"weight shares {list(shares)[:8]}... must be one per block ({len(self.blocks)}), "
                            "each in [0, 1] or None")
        blocks = tuple(b if x is None else replace(b, bwd_weight_s=b.bwd_s * x) for b, x in zip(self.blocks, shares, strict=True))
        table = tuple((frac, g.with_weight_shares(shares)) for frac, g in self.microbatch_graphs)
        return CondensedGraph(blocks=blocks, edges=self.edges, name=self.name, microbatch_graphs=table, direct=self.direct)

    # -- checks and serialisation ----------------------------------------------------------
    def validate(self) -> list[str]:
        """Return every structural fault of the graph (empty when valid)."""
        faults: list[str] = []
        for i, b in enumerate(self.blocks):
            if b.id != i:
                faults.append(f"block at position {i} has id {b.id}; ids must be 0..n-1 in order")
            for attr in ("flops", "fwd_s", "bwd_s", "param_bytes", "buffer_bytes", "replica_param_bytes",
                         "activation_bytes", "output_bytes", "fwd_fixed_s", "bwd_fixed_s", "bwd_weight_s",
                         "grad_accumulate_s"):
                value = getattr(b, attr)
                if not math.isfinite(value):
                    faults.append(f"block {i} ({b.name!r}) has {attr}={value}; costs must be finite numbers")
                elif value < 0:
                    faults.append(f"block {i} ({b.name!r}) has negative {attr}={value}")
            for part, whole in (("fwd_fixed_s", "fwd_s"), ("bwd_fixed_s", "bwd_s"), ("bwd_weight_s", "bwd_s")):
                if getattr(b, part) > getattr(b, whole) * (1 + 1e-9):
                    faults.append(f"block {i} ({b.name!r}) has {part}={getattr(b, part)} > {whole}={getattr(b, whole)}; "
                                  f"{part} is a share of {whole}")
        n = len(self.blocks)
        for e in self.edges:
            if not (0 <= e.src < n and 0 <= e.dst < n):
                faults.append(f"edge {e.src}->{e.dst} names a block outside 0..{n - 1}")
            elif e.src >= e.dst:
                faults.append(
                    f"edge {e.src}->{e.dst} does not go forward; blocks must be in topological order"
                )
            if not math.isfinite(e.size_bytes):
                faults.append(f"edge {e.src}->{e.dst} has size_bytes={e.size_bytes}; sizes must be finite numbers")
            elif e.size_bytes < 0:
                faults.append(f"edge {e.src}->{e.dst} has negative size_bytes={e.size_bytes}")
            if e.grad_bytes is not None and not (math.isfinite(e.grad_bytes) and e.grad_bytes >= 0):
                faults.append(f"edge {e.src}->{e.dst} has grad_bytes={e.grad_bytes}; gradient sizes must be finite and "
                              ">= 0 (None: as large as the value)")
        for t in self.direct:
            if not all(0 <= b < n for b in (t.src, *t.dsts)):
                faults.append(f"direct transfer {t.src}->{list(t.dsts)} names a block outside 0..{n - 1}")
            if not math.isfinite(t.size_bytes) or t.size_bytes < 0:
                faults.append(f"direct transfer {t.src}->{list(t.dsts)} has size_bytes={t.size_bytes}; sizes must be "
                              "finite and >= 0")
        return faults

    def check(self) -> CondensedGraph:
        """Raise :class:`PlanError` listing every fault; return ``self`` when valid."""
        faults = self.validate()
        if faults:
            raise PlanError(f"invalid graph {self.name!r}:\n  " + "\n  ".join(faults))
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "blocks": [{**asdict(b), "nodes": list(b.nodes)} for b in self.blocks],
            "edges": [{k: v for k, v in asdict(e).items() if k != "grad_bytes" or v is not None} for e in self.edges],
            **({"direct": [{**asdict(t), "dsts": list(t.dsts)} for t in self.direct]} if self.direct else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CondensedGraph:
        blocks = tuple(Block(**{**b, "nodes": tuple(b.get("nodes", ()))}) for b in data["blocks"])
        edges = tuple(Edge(**e) for e in data.get("edges", ()))
        direct = tuple(DirectTransfer(**{**t, "dsts": tuple(t["dsts"])}) for t in data.get("direct", ()))
        return cls(blocks=blocks, edges=edges, name=data.get("name", "graph"), direct=direct)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CondensedGraph:
        return cls.from_dict(json.loads(text))

    @classmethod
    def chain(cls, times_s: Sequence[float], *, edge_bytes: int = 0, name: str = "chain") -> CondensedGraph:
        """A chain of blocks with forward times ``times_s`` (backward 0), for tests and examples.

        Example:
            >>> CondensedGraph.chain([1.0, 2.0]).total_time_s
            3.0
        """
        blocks = tuple(Block(id=i, name=f"b{i}", nodes=(f"b{i}",), fwd_s=t) for i, t in enumerate(times_s))
        edges = tuple(Edge(i, i + 1, edge_bytes) for i in range(len(blocks) - 1))
        return cls(blocks=blocks, edges=edges, name=name)
