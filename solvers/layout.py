"""Which device may run the next stage: the state space of the exact DP (torch-free).

A *slot* summarises the devices already used by a prefix of the pipeline:

* ``device_order="fixed"``: slot ``j`` = ``j`` stages placed, on devices ``0..j-1``; the next stage
  runs on device ``j`` (its links to ``j - 1`` and ``j + 1`` are known, so per-pair links are exact).
* ``device_order="free"``: devices are grouped into *classes* of equal ``(speed, memory_bytes)``;
  a slot is a vector ``c`` of how many devices of each class are used, and the next stage may run
  on any class with a device left. This is Tarnawski et al.'s "counts per device type" state; it
  needs one link for all pairs (devices of a class are then interchangeable).

Under 1F1B with memory checked, stage ``s`` of a ``p``-stage pipeline holds ``min(m, p - s)``
micro-batches, so a layout built from the first stage needs one chain of slots per ``p``
(``k(k+1)/2`` moves for ``k`` devices). That count is a function of the distance from the
pipeline's *end* alone, so when devices are interchangeable given the counts per class (free
order, or fixed order with identical devices) the layout is built *from the end*
(:attr:`Layout.from_end`): the DP then runs over the reversed graph (its downsets are the upsets,
:meth:`~fxsplit.solvers.tables.DownsetTables.flipped`) with one set of slots for every ``p``.

A *move* adds one stage: from slot ``src`` to slot ``dst`` on a device of speed ``speed``, as
stage number ``stage`` of the pipeline (counted from its end in a layout built from the end). Moves with equal cost parameters share a *signature* so
their stage costs are computed once.

References:
    Tarnawski et al., "Efficient Algorithms for Device Placement of DNN Graph Operators",
    NeurIPS 2020, §4 (DP state with device counts per type).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from fxsplit.errors import SolverError
from fxsplit.ir.devices import LinkSpec
from fxsplit.ir.problem import Problem

__all__ = ["Move", "Signature", "Layout", "build_layout", "can_start_from_end", "device_classes", "stage_counts"]


@dataclass(frozen=True)
class Signature:
    """Cost parameters of a move: device speed and memory, in-flight count, links in and out,
    the runtime's seconds per micro-batch on the stage (:meth:`~fxsplit.ir.Problem.stage_overhead_s`),
    and whether the stage pays its transfers (``comm_scale`` 0 on a ``comm_free`` device)."""

    speed: float
    cap_bytes: float
    flight: int
    link_in: LinkSpec
    link_out: LinkSpec
    fixed_s: float = 0.0
    comm_scale: float = 1.0


@dataclass(frozen=True)
class Move:
    """Add one stage: slot ``src`` -> ``dst``, device class or index ``unit``, stage number ``stage``
    (the number of stages between it and the pipeline's end when :attr:`Layout.from_end`)."""

    src: int
    dst: int
    unit: int
    stage: int
    sig: int


@dataclass(frozen=True)
class Layout:
    """The slots, the moves between them, and the slots where a plan may end.

    Attributes:
        num_slots: Number of slots; slot 0 is "no stage yet".
        stages: ``[num_slots]`` stages placed in each slot.
        moves: All moves, grouped by signature in :attr:`groups`.
        sigs: Distinct signatures.
        groups: ``[len(sigs)]`` tuples of move indices sharing that signature.
        terminal: Slots in which a complete plan may end (ascending number of stages).
        units: Device indices of each unit (fixed: one device each; free: one class each).
        from_end: Slots count the stages from the pipeline's end (the DP places the last stage
            first, over the reversed graph); else from its start.
    """

    num_slots: int
    stages: tuple[int, ...]
    moves: tuple[Move, ...]
    sigs: tuple[Signature, ...]
    groups: tuple[tuple[int, ...], ...]
    terminal: tuple[int, ...]
    units: tuple[tuple[int, ...], ...]
    from_end: bool = False


def device_classes(problem: Problem) -> list[tuple[int, ...]]:
    """Devices grouped by ``(speed, memory_bytes, comm_free)``, in order of first appearance."""
    classes: dict[tuple[float, int, bool], list[int]] = {}
    for i, d in enumerate(problem.devices):
        classes.setdefault((d.speed, d.memory_bytes, d.comm_free), []).append(i)
    return [tuple(v) for v in classes.values()]


def stage_counts(problem: Problem, max_stages: int, per_p: bool) -> list[int | None]:
    """Numbers of stages to lay out separately (``[None]``: any number, in-flight as for ``k``)."""
    if not per_p:
        return [None]
    if not problem.allow_idle_devices:
        return [problem.num_devices] if problem.num_devices <= max_stages else []
    return list(range(1, max_stages + 1))


class _Builder:
    """Accumulates slots, moves and signatures; slot 0 is the empty pipeline."""

    def __init__(self) -> None:
        self.slot: dict[object, int] = {"empty": 0}
        self.stages: list[int] = [0]
        self.moves: list[Move] = []
        self.sigs: list[Signature] = []
        self.terminal: list[tuple[int, int]] = []

    def slot_of(self, key: object, stages: int) -> int:
        if stages == 0:
            return 0
        if key not in self.slot:
            self.slot[key] = len(self.stages)
            self.stages.append(stages)
        return self.slot[key]

    def add(self, src: int, dst: int, unit: int, stage: int, sig: Signature) -> None:
        self.moves.append(Move(src, dst, unit, stage, 0))
        self.sigs.append(sig)

    def build(self, units: tuple[tuple[int, ...], ...], from_end: bool = False) -> Layout:
        index: dict[Signature, int] = {}
        groups: list[list[int]] = []
        moves: list[Move] = []
        for m, sig in zip(self.moves, self.sigs, strict=True):
            if sig not in index:
                index[sig] = len(groups)
                groups.append([])
            groups[index[sig]].append(len(moves))
            moves.append(Move(m.src, m.dst, m.unit, m.stage, index[sig]))
        terminal = tuple(slot for _, slot in sorted(set(self.terminal)))
        return Layout(len(self.stages), tuple(self.stages), tuple(moves), tuple(index),
                      tuple(tuple(g) for g in groups), terminal, units, from_end)


def _sig(problem: Problem, device: int, stage: int, p: int | None, check_memory: bool,
         link_in: LinkSpec, link_out: LinkSpec) -> Signature:
    d = problem.devices[device]
    cap = float(d.memory_bytes) if check_memory else math.inf
    flight = problem.in_flight(stage, p if p is not None else problem.num_devices)
    return Signature(d.speed, cap, flight if check_memory else 0, link_in, link_out, problem.stage_overhead_s(),
                     0.0 if d.comm_free else 1.0)


def _fixed(problem: Problem, max_stages: int, per_p: bool, check_memory: bool,
           counts: Sequence[int | None] | None = None) -> Layout:
    k, b = problem.num_devices, _Builder()
    for p in stage_counts(problem, max_stages, per_p) if counts is None else counts:
        top = p if p is not None else max_stages
        for j in range(top):
            link_in = problem.link_between(j - 1, j) if j > 0 else problem.link
            link_out = problem.link_between(j, j + 1) if j + 1 < k else problem.link
            sig = _sig(problem, j, j, p, check_memory, link_in, link_out)
            b.add(b.slot_of((p, j), j), b.slot_of((p, j + 1), j + 1), j, j, sig)
        if p is not None:
            b.terminal.append((p, b.slot_of((p, p), p)))
        elif problem.allow_idle_devices:
            b.terminal.extend((j, b.slot_of((p, j), j)) for j in range(1, top + 1))
        elif k <= top:
            b.terminal.append((k, b.slot_of((p, k), k)))
    return b.build(tuple((i,) for i in range(k)))


def can_start_from_end(problem: Problem, per_p: bool = True) -> bool:
    """Whether the per-``p`` chains can be replaced by one layout counted from the end: 1F1B's
    in-flight counts (``min(m, p - s)``; zero-bubble's ``min(m, p)`` is not a function of the
    distance from the end), any number of stages, one link, and devices interchangeable given the
    counts per class (free order, or fixed order with all devices alike)."""
    return (per_p and problem.schedule == "1f1b" and problem.allow_idle_devices and not problem.links
            and (problem.device_order == "free" or len(device_classes(problem)) == 1))


def _count_vectors(classes: list[tuple[int, ...]], max_stages: int) -> list[tuple[int, ...]]:
    """Devices used per class, at most ``max_stages`` in all, by total then lexicographically."""
    vectors = [c for c in itertools.product(*(range(len(cl) + 1) for cl in classes)) if sum(c) <= max_stages]
    return sorted(vectors, key=lambda c: (sum(c), c))


def _one_more(c: tuple[int, ...], classes: list[tuple[int, ...]]) -> list[tuple[int, tuple[int, ...]]]:
    """``(class, counts)`` after one more device of each class that has one left."""
    return [(t, c[:t] + (c[t] + 1,) + c[t + 1 :]) for t, cl in enumerate(classes) if c[t] < len(cl)]


def _from_end(problem: Problem, max_stages: int) -> Layout:
    """Counts per class as in free order; the stage placed after ``d`` others is ``d`` stages from
    the end and holds ``min(m, d + 1)`` micro-batches whatever the pipeline's length (the first
    stage of a ``d + 1``-stage pipeline)."""
    classes, b, link = device_classes(problem), _Builder(), problem.link
    for c in _count_vectors(classes, max_stages):
        d = sum(c)
        if d >= 1:
            b.terminal.append((d, b.slot_of(c, d)))
        if d == max_stages:
            continue
        for t, nxt in _one_more(c, classes):
            sig = _sig(problem, classes[t][0], 0, d + 1, True, link, link)
            b.add(b.slot_of(c, d), b.slot_of(nxt, d + 1), t, d, sig)
    return b.build(tuple(classes), from_end=True)


def _free(problem: Problem, max_stages: int, per_p: bool, check_memory: bool,
          counts: Sequence[int | None] | None = None) -> Layout:
    if problem.links:
        raise SolverError(
            "device_order='free' with per-pair link overrides is not supported by the exact "
            f"solvers ({len(problem.links)} overrides): use device_order='fixed' (stage s on "
            "device s) or one link for all pairs"
        )
    classes, b, link = device_classes(problem), _Builder(), problem.link
    vectors = _count_vectors(classes, max_stages)
    for p in stage_counts(problem, max_stages, per_p) if counts is None else counts:
        top = p if p is not None else max_stages
        for c in vectors:
            if sum(c) >= top:
                continue
            for t, nxt in _one_more(c, classes):
                sig = _sig(problem, classes[t][0], sum(c), p, check_memory, link, link)
                b.add(b.slot_of((p, c), sum(c)), b.slot_of((p, nxt), sum(nxt)), t, sum(c), sig)
        want = p if p is not None else (None if problem.allow_idle_devices else problem.num_devices)
        b.terminal.extend((sum(c), b.slot_of((p, c), sum(c))) for c in vectors
                          if sum(c) >= 1 and sum(c) <= top and (want is None or sum(c) == want))
    return b.build(tuple(classes))


def build_layout(problem: Problem, num_blocks: int, check_memory: bool, per_p: bool = False,
                 from_end: bool = True, counts: Sequence[int | None] | None = None) -> Layout:
    """The DP state space for ``problem``.

    Args:
        problem: The problem (devices, order, links, schedule).
        num_blocks: Blocks in the graph (a plan has at most this many stages).
        check_memory: Put device memory into the signatures (else unlimited).
        per_p: Lay out one chain of slots per number of stages ``p`` (1F1B in-flight counts
            ``min(m, p - s)`` depend on it); otherwise in-flight counts are computed as if all
            devices were used (exact whenever they do not depend on ``p`` or memory is unchecked).
        from_end: Allow the layout from the pipeline's end instead of the per-``p`` chains,
            used whenever it is exact (see the module docstring); ``False``: never.
        counts: With ``per_p``, lay out only these numbers of stages (a subset of
            :func:`stage_counts`; the DP solves the others separately or proves them worse).

    Raises:
        SolverError: for ``device_order="free"`` with per-pair link overrides.
    """
    max_stages = min(problem.num_devices, num_blocks)
    if from_end and check_memory and can_start_from_end(problem, per_p) and counts is None:
        return _from_end(problem, max_stages)
    chains = None if counts is None or not per_p else list(counts)
    if problem.device_order == "fixed":
        return _fixed(problem, max_stages, per_p, check_memory, chains)
    return _free(problem, max_stages, per_p, check_memory, chains)
