"""The schedule validator: complete, well placed, and free of deadlock (torch-free).

References:
    ``torch.distributed.pipelining`` validates its action lists the same way and shows the table
    with the failing step marked (``_validate_pipeline_order``, ``_format_pipeline_order``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fxsplit.errors import ScheduleError
from fxsplit.schedule.actions import Action, B, F, I, Schedule, W
from fxsplit.schedule.engine import dependencies, execute

__all__ = ["Fault", "find_faults", "validate"]

_MAX_LISTED = 12
_FIX = (
    "fix: every (stage, micro-batch) needs exactly one F and one B on the stage's rank; a rank runs "
    "its list in order, so F of stage s must be reachable after F of stage s-1, and B of stage s "
    "after its own F and after B of stage s+1"
)


@dataclass(frozen=True)
class Fault:
    """One problem of a schedule; ``rank``/``step`` locate it in the table when known."""

    message: str
    rank: int | None = None
    step: int | None = None


def validate(schedule: Schedule) -> Schedule:
    """Check that ``schedule`` is complete, placed on the right ranks and runs to the end.

    Checks: sizes are positive; each action names a stage and micro-batch in range and sits on
    its stage's rank; every (stage, micro-batch) has exactly one ``F`` and one ``B``; each ``B``
    comes after its own ``F``; executing the lists in order never deadlocks (forward of stage
    ``s`` needs forward of ``s - 1``; backward of ``s`` needs backward of ``s + 1``).

    Args:
        schedule: The schedule to check.

    Returns:
        ``schedule`` itself, so calls chain.

    Raises:
        ScheduleError: listing every fault, then the table with each failing step marked
            ``# <--``, then how to fix it.

    Example:
        >>> from fxsplit.schedule.generators import gpipe
        >>> validate(gpipe(3, 5)).num_stages
        3
    """
    faults = find_faults(schedule)
    if faults:
        raise ScheduleError(format_faults(schedule, faults))
    return schedule


def find_faults(schedule: Schedule) -> list[Fault]:
    """Every fault of ``schedule`` (empty when valid); deadlock is checked only if the rest passes."""
    if schedule.num_stages < 1 or schedule.microbatches < 1:
        return [Fault(f"need num_stages >= 1 and microbatches >= 1, got "
                      f"{schedule.num_stages} and {schedule.microbatches}")]
    faults = _placement_faults(schedule) + _coverage_faults(schedule)
    if faults:
        return faults
    return _deadlock_faults(schedule)


def format_faults(schedule: Schedule, faults: list[Fault]) -> str:
    """The error message: a summary, the fault list, the marked table and the fix."""
    lines = [f"schedule {schedule.name!r} ({schedule.num_stages} stages, {schedule.microbatches} "
             f"micro-batches, {schedule.num_ranks} ranks) is invalid: {len(faults)} fault(s)"]
    lines += [f"  - {f.message}" for f in faults[:_MAX_LISTED]]
    if len(faults) > _MAX_LISTED:
        lines.append(f"  - ... and {len(faults) - _MAX_LISTED} more")
    marks: dict[tuple[int, int], str] = {}
    for f in faults:
        if f.rank is not None and f.step is not None and (f.rank, f.step) not in marks:
            marks[(f.rank, f.step)] = f.message
    return "\n".join(lines) + "\n" + schedule.to_text(marks) + _FIX


def _placement_faults(schedule: Schedule) -> list[Fault]:
    p, m = schedule.num_stages, schedule.microbatches
    faults = []
    for rank, step, a in schedule:
        if a.stage >= p or a.microbatch >= m:
            faults.append(Fault(f"{a} is out of range: stages 0..{p - 1}, micro-batches 0..{m - 1}", rank, step))
        elif schedule.stage_to_rank[a.stage] != rank:
            faults.append(Fault(f"{a} is on rank {rank} but stage {a.stage} runs on rank "
                                f"{schedule.stage_to_rank[a.stage]}", rank, step))
    return faults


def _coverage_faults(schedule: Schedule) -> list[Fault]:
    faults = []
    where: dict[Action, tuple[int, int]] = {}
    for rank, step, a in schedule:
        if a in where:
            r0, s0 = where[a]
            faults.append(Fault(f"{a} appears twice (first at rank {r0} step {s0})", rank, step))
        else:
            where[a] = (rank, step)
        if a.kind in (B, I) and a.stage < schedule.num_stages:
            own = where.get(Action(a.stage, F, a.microbatch))
            if own is None or own[0] != rank:
                later = "is missing" if own is None else f"is on rank {own[0]}"
                faults.append(Fault(f"{a} comes before its forward {a.stage}F{a.microbatch}, which "
                                    f"{later} or comes later", rank, step))
    missing = [a for s in range(schedule.num_stages) for i in range(schedule.microbatches)
               for a in _backward_faults(s, i, where, faults)]
    if missing:
        shown = ", ".join(str(a) for a in missing[:_MAX_LISTED])
        more = f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        faults.append(Fault(f"missing actions: {shown}{more} (add them to their stage's rank)"))
    return faults


def _backward_faults(s: int, i: int, where: dict[Action, tuple[int, int]], faults: list[Fault]) -> list[Action]:
    """The actions missing for micro-batch ``i`` on stage ``s``: its forward, and either one full
    backward ``B`` or both halves ``I`` and ``W`` (a backward in both forms is a fault)."""
    missing = [Action(s, F, i)] if Action(s, F, i) not in where else []
    halves = [Action(s, k, i) for k in (I, W)]
    if Action(s, B, i) in where:
        for h in halves:
            if h in where:
                faults.append(Fault(f"{h} and {s}B{i} both compute that backward (use B, or I and W)", *where[h]))
        return missing
    present = [h for h in halves if h in where]
    return missing + ([Action(s, B, i)] if not present else [h for h in halves if h not in where])


def _deadlock_faults(schedule: Schedule) -> list[Fault]:
    run = execute(schedule, duration_s=lambda a: 1.0)
    if run.finished:
        return []
    done = {ev[2] for ev in run.events}
    where = {a: (rank, step) for rank, step, a in schedule}
    faults = []
    for rank, step in sorted(run.blocked.items()):
        action = schedule.actions[rank][step]
        for dep in dependencies(action, schedule.num_stages):
            if dep in done:
                continue
            if dep not in where:
                faults.append(Fault(f"deadlock: {action} waits for {dep}, which no rank runs (a backward "
                                    f"written as B on one stage and as I on the next?)", rank, step))
                continue
            r2, s2 = where[dep]
            if r2 == rank:
                why = "which comes later on the same rank"
            else:
                k = run.blocked[r2]
                why = f"which rank {r2} never reaches: it is stuck at step {k} ({schedule.actions[r2][k]})"
            faults.append(Fault(f"deadlock: {action} waits for {dep} (rank {r2} step {s2}), {why}", rank, step))
    return faults
