"""Per-downset prefix sums that make every stage cost an array subtraction (torch-free).

For downsets ``J ⊂ I`` the stage ``I \\ J`` has work ``W(I) - W(J)``, static memory
``S(I) - S(J)``, activations ``A(I) - A(J)``, receives ``cut(J)`` bytes and sends ``cut(I)``
bytes (see :meth:`CondensedGraph.cut_bytes`). :class:`DownsetTables` holds these per downset as
NumPy vectors, plus the downsets as packed 64-bit words to find all ``J ⊂ I`` at once.

References:
    Tarnawski et al., "Efficient Algorithms for Device Placement of DNN Graph Operators",
    NeurIPS 2020, §4 (the DP over downsets with prefix sums).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxsplit.ir.downsets import DEFAULT_MAX_DOWNSETS, enumerate_downsets
from fxsplit.ir.problem import Problem
from fxsplit.solvers.direct import DirectPairs, FlippedDirectPairs

__all__ = ["DownsetTables", "build_tables", "chain_masks", "is_chain_order"]

_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class DownsetTables:
    """Downsets of a problem's graph and their prefix sums.

    Attributes:
        masks: ``[D]`` downset bitmasks sorted by size; ``masks[0] == 0``, ``masks[-1]`` = all.
        size: ``[D]`` number of blocks in each downset.
        words: ``[D, W]`` uint64 packed membership (bit ``b`` of word ``b // 64``).
        layer_start: ``[n + 2]``: downsets of size ``t`` are ``layer_start[t]:layer_start[t+1]``.
        work_s: ``[D]`` forward (+ backward when training) seconds on the reference device.
        fwd_s: ``[D]`` forward seconds on the reference device (what recomputation adds).
        recompute: The problem's :attr:`~fxsplit.ir.Problem.recompute`, ``"none"`` in inference.
        static_bytes: ``[D]`` params × (1 + grad + optimizer) + buffers, bytes.
        act_bytes: ``[D]`` activation bytes kept for backward per micro-batch.
        cut_bytes: ``[D]`` bytes per micro-batch leaving the downset.
        flipped_from: For the tables of the reversed graph (:meth:`flipped`), the tables they
            came from; ``None`` for the graph itself.
        transfer_memory: The problem's :attr:`~fxsplit.ir.Problem.transfer_memory` (whether
            ``cut_bytes`` count in stage memory, or as time only).
        grad_cut_bytes: ``[D]`` gradient bytes per micro-batch coming back into the downset in
            training (:meth:`CondensedGraph.grad_cut_bytes`); ``None`` when they mirror
            ``cut_bytes`` (inference, or no edge says otherwise).
        direct: The bytes of the graph's direct transfers per stage
            (:class:`~fxsplit.solvers.direct.DirectPairs`); ``None`` when it has none.
    """

    masks: list[int]
    size: np.ndarray
    words: np.ndarray
    layer_start: np.ndarray
    work_s: np.ndarray
    fwd_s: np.ndarray
    recompute: str
    static_bytes: np.ndarray
    act_bytes: np.ndarray
    cut_bytes: np.ndarray
    flipped_from: DownsetTables | None = None
    transfer_memory: bool = True
    direct: DirectPairs | FlippedDirectPairs | None = None
    grad_cut_bytes: np.ndarray | None = None

    @property
    def num(self) -> int:
        return len(self.masks)

    @property
    def full(self) -> int:
        """Index of the downset holding every block."""
        return len(self.masks) - 1

    def subsets(self, i: int) -> np.ndarray:
        """Indices ``j`` of the downsets ``J ⊊ I = masks[i]``, ascending, ``[num_subsets]``."""
        hi = int(self.layer_start[int(self.size[i])])
        if hi == 0:
            return np.zeros(0, dtype=np.int64)
        outside = ~self.words[i]
        inside = ~np.any(self.words[:hi] & outside, axis=1)
        return np.flatnonzero(inside)

    def restricted(self, rows: np.ndarray) -> DownsetTables:
        """The tables of a subfamily of the downsets: ``rows`` ascending, with ``0`` (the empty
        downset) first and :attr:`full` last; of the graph itself (flip after restricting).

        Raises:
            ValueError: for flipped tables.
        """
        if self.flipped_from is not None:
            raise ValueError("restrict the tables of the graph, then flip them")
        n = self.layer_start.shape[0] - 2
        size = self.size[rows]
        return DownsetTables(
            masks=[self.masks[r] for r in rows.tolist()], size=size, words=self.words[rows],
            layer_start=np.searchsorted(size, np.arange(n + 2), side="left"),
            work_s=self.work_s[rows], fwd_s=self.fwd_s[rows], recompute=self.recompute,
            static_bytes=self.static_bytes[rows], act_bytes=self.act_bytes[rows],
            cut_bytes=self.cut_bytes[rows], transfer_memory=self.transfer_memory,
            direct=self.direct.restricted(rows) if isinstance(self.direct, DirectPairs) else None,
            grad_cut_bytes=None if self.grad_cut_bytes is None else self.grad_cut_bytes[rows],
        )

    @property
    def is_flipped(self) -> bool:
        """Whether these are the tables of the reversed graph (a stage ``I \\ J`` then receives
        ``cut(I)`` and sends ``cut(J)``)."""
        return self.flipped_from is not None

    def flipped(self) -> DownsetTables:
        """The tables of the reversed graph: its downsets are the upsets ``V \\ I``.

        ``U = V \\ I`` has the sums ``W(V) - W(I)`` and the cut of ``I`` (the bytes entering
        ``U``), so a stage ``U' \\ U`` of the reversed graph is the stage ``I \\ I'`` of the graph;
        ordered by size as :meth:`subsets` needs. The flip of a flip is the original.
        """
        if self.flipped_from is not None:
            return self.flipped_from
        n = self.layer_start.shape[0] - 2
        full = self.masks[-1]
        size = n - self.size[::-1]
        return DownsetTables(
            masks=[full ^ m for m in reversed(self.masks)],
            size=size,
            words=~self.words[::-1] & self.words[-1],  # the last downset holds every block
            layer_start=np.searchsorted(size, np.arange(n + 2), side="left"),
            work_s=self.work_s[-1] - self.work_s[::-1],
            fwd_s=self.fwd_s[-1] - self.fwd_s[::-1],
            recompute=self.recompute,
            static_bytes=self.static_bytes[-1] - self.static_bytes[::-1],
            act_bytes=self.act_bytes[-1] - self.act_bytes[::-1],
            cut_bytes=self.cut_bytes[::-1].copy(),
            flipped_from=self,
            transfer_memory=self.transfer_memory,
            direct=FlippedDirectPairs(self.direct) if isinstance(self.direct, DirectPairs) else None,
            grad_cut_bytes=None if self.grad_cut_bytes is None else self.grad_cut_bytes[::-1].copy(),
        )


def _membership(masks: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """``[D, n]`` bool membership and ``[D, W]`` uint64 words of the masks."""
    nwords = max(1, (n + 63) // 64)
    raw = b"".join(m.to_bytes(nwords * 8, "little") for m in masks)
    words = np.frombuffer(raw, dtype="<u8").reshape(len(masks), nwords).copy()
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :n].astype(bool)
    return bits, words


def _cut_bytes(problem: Problem, member: np.ndarray, gradients: bool = False) -> np.ndarray:
    """``[D]`` bytes leaving each downset: per producer, its largest edge leaving, summed (of the
    edges' gradient bytes with ``gradients``)."""
    g = problem.graph
    num = member.shape[0]
    if not g.edges:
        return np.zeros(num)
    edges = sorted(g.edges, key=lambda e: e.src)
    src = np.array([e.src for e in edges])
    dst = np.array([e.dst for e in edges])
    size = np.array([float(e.backward_bytes if gradients else e.size_bytes) for e in edges])
    starts = np.flatnonzero(np.r_[True, src[1:] != src[:-1]])
    out = np.zeros(num)
    for lo in range(0, num, _CHUNK_ROWS):
        m = member[lo : lo + _CHUNK_ROWS]
        leaving = m[:, src] & ~m[:, dst]
        out[lo : lo + _CHUNK_ROWS] = np.maximum.reduceat(leaving * size, starts, axis=1).sum(axis=1)
    return out


def chain_masks(n: int) -> list[int]:
    """The ``n + 1`` prefixes of the blocks' topological order, as downset bitmasks (size order)."""
    return [(1 << t) - 1 for t in range(n + 1)]


def is_chain_order(problem: Problem) -> bool:
    """Whether the prefixes of the block order are *all* the downsets: block ``i - 1`` feeds
    block ``i`` for every ``i`` (a path between them could only pass blocks ordered between)."""
    linked = {(e.src, e.dst) for e in problem.graph.edges}
    return all((i - 1, i) in linked for i in range(1, len(problem.graph)))


def build_tables(problem: Problem, max_downsets: int | None = DEFAULT_MAX_DOWNSETS,
                 masks: list[int] | None = None) -> DownsetTables:
    """Enumerate the downsets of ``problem.graph`` and their prefix sums.

    Args:
        problem: The problem (its ``training`` flag and memory factors shape the sums).
        max_downsets: Budget passed to :func:`enumerate_downsets`.
        masks: Tables of these downsets only (sorted by size, ``0`` first and the full set last,
            e.g. :func:`chain_masks`) instead of all of them.

    Raises:
        DownsetBudgetError: when the graph has more than ``max_downsets`` downsets.
    """
    g = problem.graph
    n = len(g)
    if masks is None:
        masks = enumerate_downsets(g, max_count=max_downsets)
    member, words = _membership(masks, n)
    size = member.sum(axis=1)
    layer_start = np.searchsorted(size, np.arange(n + 2), side="left")
    fwd = np.array([b.fwd_s for b in g.blocks])
    bwd = np.array([b.bwd_s for b in g.blocks]) if problem.training else np.zeros(n)
    static = np.array([problem.static_bytes(b) for b in g.blocks], dtype=float)
    act = np.array([float(b.activation_bytes) for b in g.blocks])
    mf = member.astype(float)
    return DownsetTables(
        masks=masks,
        size=size,
        words=words,
        layer_start=layer_start,
        work_s=mf @ (fwd + bwd),
        fwd_s=mf @ fwd,
        recompute=problem.recompute if problem.may_recompute() else "none",
        static_bytes=mf @ static,
        act_bytes=mf @ act,
        cut_bytes=_cut_bytes(problem, member),
        transfer_memory=problem.transfer_memory,
        direct=DirectPairs.of(g, member) if g.direct else None,
        grad_cut_bytes=None if not problem.training or g.gradients_mirror else _cut_bytes(problem, member, True),
    )
