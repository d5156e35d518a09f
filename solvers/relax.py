"""A memory bound that proves infeasibility in microseconds, without searching (torch-free).

Every plan of ``p`` stages keeps, on stage ``s``, the state of its blocks (params × (1 + grad +
optimizer) + buffers) and their activations × ``f_s`` micro-batches in flight (see
:func:`fxsplit.ir.evaluate`; boundary buffers only add). Drop the rest of the structure: let state
and activations split freely over the stages, ignore contiguity and boundary buffers, and pair
the stages' in-flight counts with the devices in the best way (most memory where fewest
micro-batches are in flight; one when stages may recompute their activations). What remains is a small fractional problem with a closed-form
answer: place the activations where memory per activation byte is cheapest (``f_s`` bytes of
memory per byte), then the state must fit in what is left. When even that fails, no plan exists;
the numbers in the message are the arithmetic of the proof.

The bound is monotone in the number of devices and in their memory, so the least number of
devices (copies of the largest) and the least memory to add to every device that pass it are
found by bisection; both are lower bounds, not guarantees.

Example:
    >>> from fxsplit.ir import Block, CondensedGraph, DeviceSpec, Problem
    >>> g = CondensedGraph(tuple(Block(i, f"b{i}", param_bytes=100) for i in range(6)))
    >>> pb = Problem(g, (DeviceSpec("a", memory_bytes=1000), DeviceSpec("b", memory_bytes=1000)))
    >>> memory_bound_error(pb).min_devices_at_least
    3
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from fxsplit.errors import InfeasibleError
from fxsplit.ir.problem import Problem
from fxsplit.solvers.diagnose import fmt_bytes

__all__ = ["MemoryBound", "memory_bound", "memory_bound_error"]

_MAX_EXTRA_DEVICES = 1 << 16


@dataclass(frozen=True)
class MemoryBound:
    """The relaxed memory check of a problem.

    Attributes:
        stages: ``p``, the number of stages checked (the most the problem allows).
        flights: ``[p]`` in-flight micro-batches per stage.
        state_bytes: Params × (1 + grad + optimizer) + buffers of all blocks.
        act_bytes: Activations kept for backward per micro-batch, all blocks.
        cap_bytes: Memory of the ``p`` devices that may run stages (the largest in free order).
        need_bytes: Least total memory of any placement in the relaxation.
        block: A block that fits no device on its own (``None`` when every block fits).
        unplaced_act_bytes: Activation bytes per micro-batch that fit nowhere even with all the
            memory given to activations (counted in ``need_bytes`` at the largest in-flight).
    """

    stages: int
    flights: tuple[int, ...]
    state_bytes: int
    act_bytes: int
    cap_bytes: int
    need_bytes: float
    block: int | None = None
    unplaced_act_bytes: float = 0.0

    @property
    def fits(self) -> bool:
        return self.block is None and self.need_bytes <= self.cap_bytes


def _least_memory(act: int, caps: list[int], flights: list[int]) -> tuple[Fraction, Fraction]:
    """Least memory that hosts ``act`` activation bytes: cheapest ``f`` first, best pairing.

    Activations that fit no device are priced at the largest ``f`` (the total then exceeds the
    devices' memory, so the check fails, with a finite number to report).
    """
    left, spent = Fraction(act), Fraction(0)
    for cap, f in zip(sorted(caps, reverse=True), sorted(flights), strict=True):
        if left <= 0:
            break
        take = min(left, Fraction(cap, f))
        spent += take * f
        left -= take
    left = max(left, Fraction(0))
    return spent + left * max(flights), left


def memory_bound(problem: Problem, extra_devices: int = 0, extra_bytes: int = 0) -> MemoryBound:
    """The relaxed check for ``problem`` (with ``extra_devices`` copies of its largest device and
    ``extra_bytes`` more memory on every device)."""
    g, k = problem.graph, problem.num_devices + extra_devices
    caps = [d.memory_bytes + extra_bytes for d in problem.devices]
    caps = sorted(caps + [max(caps)] * extra_devices, reverse=True)
    p = k if not problem.allow_idle_devices else min(k, max(1, len(g)))
    caps = caps[:p]  # the p largest: exact in free order, a relaxation in fixed order
    # a stage that recomputes holds its activations for one micro-batch (its inputs only add)
    flights = [1 if problem.may_recompute() else _least_flight(problem, s, p) for s in range(p)]
    state = [problem.static_bytes(b) for b in g.blocks]
    acts = [b.activation_bytes for b in g.blocks]
    block = next((b for b in range(len(g)) if state[b] + acts[b] * min(flights) > max(caps)), None)
    spent, left = _least_memory(sum(acts), caps, flights)
    return MemoryBound(p, tuple(flights), int(sum(state)), sum(acts), sum(caps),
                       float(spent + Fraction(sum(state))), block, float(left))


def _least_flight(problem: Problem, s: int, p: int) -> int:
    """In-flight micro-batches of stage ``s`` of ``p`` in the relaxation: the problem's count,
    except under zero-bubble with idle devices allowed, where a plan of ``q < p`` stages holds
    ``min(m, q)`` on each, at least 1F1B's ``min(m, q - s)``, which the ``p``-stage 1F1B counts
    cover; ``min(m, p)`` everywhere would overstate a plan of fewer stages."""
    if problem.schedule == "zero-bubble" and problem.allow_idle_devices and problem.training:
        return min(problem.microbatches, p - s)
    return problem.in_flight(s, p)


def _least_devices(problem: Problem) -> int | None:
    """Fewest devices (copies of the largest added) that pass the bound, or ``None`` when no
    number does (a block fits no device, or even one stage per block is not enough)."""
    n, k = max(1, len(problem.graph)), problem.num_devices
    if memory_bound(problem).block is not None:
        return None
    lo, hi = 0, 1
    while not memory_bound(problem, extra_devices=hi).fits:
        if k + hi >= n or hi >= _MAX_EXTRA_DEVICES:
            return None
        lo, hi = hi, min(2 * hi, max(hi + 1, n - k))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if memory_bound(problem, extra_devices=mid).fits else (mid, hi)
    return k + hi


def _least_extra_bytes(problem: Problem) -> int:
    """Least memory to add to every device so that the bound passes (to 1 part in 2^20)."""
    lo, hi = 0, 1
    while not memory_bound(problem, extra_bytes=hi).fits:
        lo, hi = hi, 2 * hi
    while hi - lo > max(1, hi >> 20):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if memory_bound(problem, extra_bytes=mid).fits else (mid, hi)
    return hi


def _flight_text(flights: tuple[int, ...]) -> str:
    runs: list[tuple[int, int, int]] = []
    for s, f in enumerate(flights):
        if runs and runs[-1][2] == f:
            runs[-1] = (runs[-1][0], s, f)
        else:
            runs.append((s, s, f))
    return ", ".join(f"{f} on stage{'s' if a != b else ''} {a}{'-' + str(b) if a != b else ''}"
                     for a, b, f in runs)


def memory_bound_error(problem: Problem) -> InfeasibleError | None:
    """An :class:`InfeasibleError` when the relaxed memory check proves that no plan fits, else
    ``None`` (which proves nothing). Cheap: ``O(k log k)`` per check, bisection for the fixes.

    The error's fields: ``need_bytes`` and ``cap_bytes`` (totals of the relaxation),
    ``over_bytes``, ``min_devices_at_least`` (``None`` when no number of devices passes, e.g. a
    block larger than every device), ``min_extra_bytes_at_least``; ``stage``, ``device`` and
    ``min_devices`` are ``None`` (the relaxation has no stages).
    """
    mb = memory_bound(problem)
    if mb.fits:
        return None
    g, devs = problem.graph, problem.devices
    head = (f"no split of graph {g.name!r} ({len(g)} blocks) over {problem.num_devices} devices "
            f"fits in memory (schedule={problem.schedule}, microbatches={problem.microbatches}), "
            "proven by a relaxation that ignores contiguity and boundary buffers: ")
    if mb.block is not None:
        b = g.blocks[mb.block]
        alone = problem.static_bytes(b) + b.activation_bytes * min(mb.flights)
        biggest = max(d.memory_bytes for d in devs)
        why = (f"block {mb.block} ({b.name!r}) alone needs {fmt_bytes(alone)} (state + activations × "
               f"{min(mb.flights)} in flight), the largest device has {fmt_bytes(biggest)}")
        over = float(alone) - biggest
    else:
        need = (f"need at least {fmt_bytes(mb.need_bytes)} in total" if not mb.unplaced_act_bytes else
                f"do not fit even with all memory given to activations where fewest micro-batches are"
                f" in flight ({fmt_bytes(mb.unplaced_act_bytes)} of activations per micro-batch left)")
        why = (f"params × {problem.state_bytes_per_param_byte():g} + buffers = {fmt_bytes(mb.state_bytes)}"
               f" plus activations {fmt_bytes(mb.act_bytes)} per micro-batch × in flight "
               f"({_flight_text(mb.flights)}) {need}, the {mb.stages} devices have "
               f"{fmt_bytes(mb.cap_bytes)}")
        over = mb.need_bytes - mb.cap_bytes
    min_dev = _least_devices(problem)
    extra = _least_extra_bytes(problem)
    dev_fix = (f"at least {min_dev} devices like {max(devs, key=lambda d: d.memory_bytes).name!r}"
               if min_dev is not None else "adding devices alone does not help")
    fewer = "schedule='1f1b', " if problem.schedule == "gpipe" and problem.training else ""
    fewer += "" if problem.may_recompute() or not problem.training else "recompute='auto', "
    err = InfeasibleError(
        f"{head}{why}. Fix (each a lower bound): {dev_fix}, or at least {fmt_bytes(extra)} more on "
        f"every device; or keep fewer activation bytes in flight ({fewer}shorter sequences, "
        "lower precision)",
        block=mb.block, need_bytes=mb.need_bytes, cap_bytes=mb.cap_bytes, over_bytes=over,
        min_devices_at_least=min_dev, min_extra_bytes_at_least=extra,
    )
    return err
