"""Downsets (ideals) of a condensed graph, as int bitmasks (torch-free).

A *downset* ``I`` of the block DAG holds every predecessor of each of its blocks. A pipeline of
``p`` contiguous stages is a chain of downsets ``∅ = I_0 ⊂ I_1 ⊂ … ⊂ I_p = V`` (stage ``s`` is
``I_{s+1} \\ I_s``), so the exact solvers walk the downsets. Block ``b`` is bit ``1 << b``.

The enumeration grows downsets one block at a time, layer by layer (all downsets of size ``t``,
then ``t + 1``), carrying for each downset the mask of blocks that may be added next (all their
predecessors are inside). Each downset is produced once, in order of size, in
``O(D · (width + out-degree))`` big-int operations for ``D`` downsets.

References:
    Tarnawski et al., "Efficient Algorithms for Device Placement of DNN Graph Operators",
    NeurIPS 2020, §4 (downsets, and their number for real DNN graphs);
    Narayanan et al., "PipeDream", SOSP 2019, §3.1 (the same objects as "antichains").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from fxsplit.errors import SolverError
from fxsplit.ir.graph import CondensedGraph

__all__ = [
    "DEFAULT_MAX_DOWNSETS",
    "DownsetBudgetError",
    "count_downsets",
    "enumerate_downsets",
    "mask_of",
    "members",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_DOWNSETS = 20_000
"""Budget above which enumerating downsets (and the DP over them) is considered too slow."""


class DownsetBudgetError(SolverError):
    """The graph has more downsets than the budget allows.

    Attributes:
        max_count: The budget that was exceeded.
        seen: How many downsets had been found when enumeration stopped (``> max_count``).
    """

    def __init__(self, message: str, *, max_count: int, seen: int) -> None:
        super().__init__(message)
        self.max_count = max_count
        self.seen = seen


def mask_of(ids: Iterable[int]) -> int:
    """The bitmask of a set of block ids.

    Example:
        >>> bin(mask_of([0, 2]))
        '0b101'
    """
    mask = 0
    for b in ids:
        mask |= 1 << b
    return mask


def members(mask: int) -> list[int]:
    """Block ids in ``mask``, ascending.

    Example:
        >>> members(0b1011)
        [0, 1, 3]
    """
    out: list[int] = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _pred_masks(graph: CondensedGraph) -> list[int]:
    return [mask_of(graph.predecessors(b)) for b in range(len(graph))]


def enumerate_downsets(graph: CondensedGraph, max_count: int | None = DEFAULT_MAX_DOWNSETS) -> list[int]:
    """All downsets of ``graph`` as bitmasks, in order of size (``0`` first, the full set last).

    Args:
        graph: The block DAG (blocks in topological order).
        max_count: Stop and raise once more than this many downsets are found; ``None`` for no
            budget.

    Returns:
        ``[num_downsets]`` bitmasks, sorted by number of blocks (ties in discovery order).

    Raises:
        DownsetBudgetError: when the graph has more than ``max_count`` downsets; the message
            gives the budget and suggests the ``cpsat`` solver or a larger budget.

    Example:
        >>> from fxsplit.ir import Block, CondensedGraph, Edge
        >>> g = CondensedGraph((Block(0, "a"), Block(1, "b"), Block(2, "c")), (Edge(0, 2), Edge(1, 2)))
        >>> [bin(m) for m in enumerate_downsets(g)]
        ['0b0', '0b1', '0b10', '0b11', '0b111']
    """
    n = len(graph)
    preds = _pred_masks(graph)
    succ = [graph.successors(b) for b in range(n)]
    start_avail = mask_of(b for b in range(n) if preds[b] == 0)
    out = [0]
    layer: dict[int, int] = {0: start_avail}
    for _size in range(n):
        nxt: dict[int, int] = {}
        for downset, avail in layer.items():
            rest = avail
            while rest:
                low = rest & -rest
                rest ^= low
                grown = downset | low
                if grown in nxt:
                    continue
                new_avail = avail & ~low
                for s in succ[low.bit_length() - 1]:
                    if preds[s] & ~grown == 0:
                        new_avail |= 1 << s
                nxt[grown] = new_avail
        out.extend(nxt)
        if max_count is not None and len(out) > max_count:
            raise DownsetBudgetError(
                f"graph {graph.name!r} ({n} blocks, {len(graph.edges)} edges) has more than "
                f"{max_count} downsets (found {len(out)} up to size {_size + 1}); the exact DP "
                "over downsets would be slow: use solver='cpsat', condense the graph further, "
                "or raise max_count",
                max_count=max_count,
                seen=len(out),
            )
        layer = nxt
    logger.debug("graph %r: %d downsets", graph.name, len(out))
    return out


def count_downsets(graph: CondensedGraph, limit: int | None = None) -> int | None:
    """The number of downsets of ``graph`` (including ``∅`` and the full set).

    Args:
        graph: The block DAG.
        limit: Give up past this many; ``None`` counts them all (may be slow on wide graphs).

    Returns:
        The count, or ``None`` when it exceeds ``limit``.

    Example:
        >>> from fxsplit.ir import CondensedGraph
        >>> count_downsets(CondensedGraph.chain([1.0, 1.0, 1.0]))
        4
    """
    try:
        return len(enumerate_downsets(graph, max_count=limit))
    except DownsetBudgetError:
        return None
