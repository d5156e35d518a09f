"""Direct transfers of every stage ``I \\ J`` from per-downset sums (torch-free).

A :class:`~fxsplit.ir.graph.DirectTransfer` ``(a, N, c)`` costs a stage ``S`` its ``c`` bytes
when ``a ∈ S`` and some reader of ``N`` is not, or ``a ∉ S`` and some reader is (Tarnawski et
al.'s ``dp.cpp``). Unlike a relayed cut, that depends on both downsets of the stage; charged pair
by pair it would cost the DP a pass over every transfer for each of its millions of pairs. Two
facts make it cheap:

* A transfer with one reader block ``b`` costs ``c · (x_a xor x_b)`` with ``x_v = [v ∈ I] - [v ∈ J]``,
  which expands into per-downset sums and one bilinear term:
  ``Σ c (x_a + x_b - 2 x_a x_b) = L(I) - L(J) - 2 Q(I) - 2 Q(J) + 2 m_J^T (C + C^T) m_I``, with
  ``L(D) = Σ c ([a ∈ D] + [b ∈ D])``, ``Q(D) = Σ c [a ∈ D][b ∈ D]``, ``C[a, b] = Σ c`` and ``m`` the
  membership vectors; the bilinear term for all pairs at once is one matrix product.
* Transfers with several reader blocks are few (at most 27 in the operator graphs Tarnawski et al.
  ship, against 100-900 with one): ``|N ∩ S| = |N ∩ I| - |N ∩ J|`` from per-downset counts.

References:
    Tarnawski et al., "Efficient Algorithms for Device Placement of DNN Graph Operators",
    NeurIPS 2020 (``dp.cpp``'s communication: each node with an edge crossing the stage once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fxsplit.errors import SolverError
from fxsplit.ir.graph import CondensedGraph

__all__ = ["DirectPairs", "FlippedDirectPairs", "dp_table_fits"]

#: Downsets up to which the bilinear term is tabulated for all pairs (``D x D`` float64: 134 MB);
#: above, each pair's term is a row product (slower, ``D x n`` floats).
FULL_TABLE_DOWNSETS = 4096
#: ``D x n`` floats above which direct transfers are refused for the DP.
MAX_ROW_TABLE = 40_000_000


def dp_table_fits(downsets: int, blocks: int) -> bool:
    """Whether :meth:`DirectPairs.of` builds its table for ``downsets`` downsets of ``blocks``
    blocks: the whole ``D x D`` table (up to :data:`FULL_TABLE_DOWNSETS`), or ``D x n`` rows up
    to :data:`MAX_ROW_TABLE` floats."""
    return downsets <= FULL_TABLE_DOWNSETS or downsets * blocks <= MAX_ROW_TABLE


@dataclass(frozen=True)
class DirectPairs:
    """The direct-transfer bytes of every stage ``I \\ J`` for downsets ``J ⊂ I`` of one table.

    Attributes:
        linear: ``[D]`` ``L(D) - 2 Q(D)`` of the one-reader transfers.
        quad: ``[D]`` ``2 Q(D)``; a pair costs ``linear[i] - linear[j] - 2 quad[j] + bilinear``.
        full: ``[D, D]`` ``2 m_j^T (C + C^T) m_i`` (row ``j``, column ``i``), or ``None``.
        rows: ``[D, n]`` ``2 m_d^T (C + C^T)`` when ``full`` is ``None`` (else empty).
        member: ``[D, n]`` float membership when ``full`` is ``None`` (else empty).
        key: ``[G, D]`` ``2 x`` the readers of each many-reader transfer inside the downset, ``+ 1``
            when it holds the transfer's source (one contiguous row per transfer).
        paid: ``[G]`` tables ``[K * K]``: the bytes a stage pays for the transfer, indexed by
            ``key[i] * K + key[j]`` (``K = 2 x readers + 2``).
    """

    linear: np.ndarray
    quad: np.ndarray
    full: np.ndarray | None
    rows: np.ndarray
    member: np.ndarray
    key: np.ndarray
    paid: tuple[np.ndarray, ...]

    @classmethod
    def of(cls, graph: CondensedGraph, member: np.ndarray) -> DirectPairs:
        """The sums for the downsets of ``member`` (``[D, n]`` bool) of ``graph``.

        Raises:
            SolverError: when ``D x n`` exceeds :data:`MAX_ROW_TABLE` (use CP-SAT).
        """
        num, n = member.shape
        if not dp_table_fits(num, n):
            raise SolverError(f"dp: {num} downsets x {n} blocks is too large a table for direct transfers; use "
                              "solver='cpsat'")
        pair = np.zeros((n, n))
        pairs, many = graph.direct_groups()
        for (sender, reader), size in pairs.items():
            pair[sender, reader] = size
        mf = member.astype(float)
        sym = pair + pair.T
        quad = 2.0 * np.einsum("dn,nm,dm->d", mf, pair, mf, optimize=True) if num else np.zeros(0)
        linear = mf @ (pair.sum(axis=1) + pair.sum(axis=0)) - quad
        full, rows, kept = None, np.zeros((0, 0)), np.zeros((0, 0))
        if num <= FULL_TABLE_DOWNSETS:
            full = 2.0 * (mf @ sym) @ mf.T
        else:
            rows, kept = 2.0 * (mf @ sym), mf
        src = np.array([a for a, _, _ in many], dtype=np.int64)
        incidence = np.zeros((n, len(many)))
        for g, (_, rs, _) in enumerate(many):
            incidence[list(rs), g] = 1.0
        key = (2 * np.rint(mf @ incidence) + (mf[:, src] if many else 0)).T.astype(np.int64)
        return cls(linear, quad, full, rows, kept, np.ascontiguousarray(key),
                   tuple(_paid_table(len(rs), c) for _, rs, c in many))

    def bytes(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """``[P]`` bytes of the stages ``masks[i[p]] \\ masks[j[p]]`` (``J ⊂ I``; ``i``, ``j`` ``[P]``
        or one scalar)."""
        i, j = np.broadcast_arrays(np.asarray(i), np.asarray(j))
        if self.full is not None:
            bilinear = np.take(self.full, j * self.full.shape[1] + i)
        else:
            bilinear = np.einsum("pn,pn->p", self.rows[j], self.member[i])
        out = self.linear[i] - (self.linear[j] + 2.0 * self.quad[j]) + bilinear
        for key, paid in zip(self.key, self.paid, strict=True):
            out += np.take(paid, key[i] * int(math.isqrt(paid.size)) + key[j])
        return out

    def restricted(self, rows: np.ndarray) -> DirectPairs:
        """The sums of the downsets ``rows`` only (as :meth:`DownsetTables.restricted`)."""
        return DirectPairs(
            self.linear[rows], self.quad[rows], None if self.full is None else self.full[np.ix_(rows, rows)],
            self.rows[rows] if self.rows.size else self.rows, self.member[rows] if self.member.size else self.member,
            self.key[:, rows], self.paid)


def _paid_table(readers: int, size: float) -> np.ndarray:
    """``[K * K]`` bytes a stage ``I \\ J`` pays for a transfer with ``readers`` reader blocks,
    at ``key(I) * K + key(J)`` (``key = 2 x readers inside + holds the source``): ``size`` when
    it holds the source but not every reader, or a reader but not the source."""
    k = 2 * readers + 2
    a, b = np.divmod(np.arange(k * k), k)
    inside, src_in = a // 2 - b // 2, (a % 2) != (b % 2)
    return np.where(np.where(src_in, inside < readers, inside > 0), size, 0.0)


@dataclass(frozen=True)
class FlippedDirectPairs:
    """:class:`DirectPairs` seen from the reversed graph's tables, whose downset ``k`` is the
    complement of downset ``D - 1 - k``: its stage ``U_i \\ U_j`` is the stage
    ``I_{D-1-j} \\ I_{D-1-i}`` (the cost depends on the stage's set alone)."""

    pairs: DirectPairs

    def bytes(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        last = self.pairs.linear.shape[0] - 1
        return self.pairs.bytes(last - np.asarray(j), last - np.asarray(i))
