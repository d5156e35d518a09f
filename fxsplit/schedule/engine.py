"""Dependencies between actions and in-order execution of a schedule (torch-free).

Both the validator (unit durations: does it finish?) and the simulator (real durations: when does
each action run?) execute a schedule the same way: each rank runs its list in order, and an action
starts when its rank is free and every action it depends on has finished (plus any transfer delay).
Start times are a function of the order only, so ranks may be advanced in any order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fxsplit.errors import ScheduleError
from fxsplit.schedule.actions import Action, B, F, I, Schedule, W

__all__ = ["dependencies", "Execution", "execute"]


def dependencies(action: Action, num_stages: int) -> tuple[Action, ...]:
    """Actions that must finish before ``action`` can start.

    Forward of stage ``s`` needs the forward of ``s - 1`` (its input activation); backward of
    ``s`` needs its own forward (saved activations) and the backward of ``s + 1`` (the gradient of
    its output). The last stage's backward starts from the loss, i.e. after its own forward.
    In a zero-bubble schedule the input-gradient half ``I`` takes the place of ``B`` (``sI`` needs
    ``sF`` and ``(s+1)I``), and the weight-gradient half ``sW`` needs ``sI`` alone.

    Example:
        >>> [str(a) for a in dependencies(Action.parse("1B3"), num_stages=3)]
        ['1F3', '2B3']
        >>> [str(a) for a in dependencies(Action.parse("1W3"), num_stages=3)]
        ['1I3']
    """
    s, i = action.stage, action.microbatch
    if action.kind == F:
        return (Action(s - 1, F, i),) if s > 0 else ()
    if action.kind in (B, I):
        own = Action(s, F, i)
        return (own, Action(s + 1, action.kind, i)) if s < num_stages - 1 else (own,)
    if action.kind == W:
        return (Action(s, I, i),)
    raise ScheduleError(f"no dependency rule for action kind {action.kind!r}")  # pragma: no cover


@dataclass(frozen=True)
class Execution:
    """What :func:`execute` found.

    Attributes:
        events: ``(rank, step, action, start_s, end_s)`` in the order they were executed.
        blocked: ``{rank: step}`` of each rank that could not finish its list (empty when the
            schedule ran to completion, i.e. it does not deadlock).
    """

    events: tuple[tuple[int, int, Action, float, float], ...]
    blocked: dict[int, int]

    @property
    def finished(self) -> bool:
        return not self.blocked


def execute(
    schedule: Schedule,
    duration_s: Callable[[Action], float],
    delay_s: Callable[[Action, Action], float] | None = None,
) -> Execution:
    """Run every rank's list in order as far as the dependencies allow.

    Args:
        schedule: The schedule (structurally valid: each action once, on its stage's rank).
        duration_s: Seconds the rank is busy with an action.
        delay_s: Seconds between the end of a dependency and the moment its result is available to
            the dependent action (``delay_s(dep, action)``), e.g. a link transfer; default 0.

    Returns:
        The executed events and, if it got stuck, where each rank stopped.
    """
    lists, p = schedule.actions, schedule.num_stages
    ptr = [0] * len(lists)
    free = [0.0] * len(lists)
    end: dict[Action, float] = {}
    events: list[tuple[int, int, Action, float, float]] = []
    progressed = True
    while progressed:
        progressed = False
        for r, acts in enumerate(lists):
            while ptr[r] < len(acts):
                action = acts[ptr[r]]
                ready = _ready_time(action, p, end, delay_s)
                if ready is None:
                    break
                start = max(free[r], ready)
                stop = start + duration_s(action)
                end[action] = free[r] = stop
                events.append((r, ptr[r], action, start, stop))
                ptr[r] += 1
                progressed = True
    blocked = {r: ptr[r] for r, acts in enumerate(lists) if ptr[r] < len(acts)}
    return Execution(events=tuple(events), blocked=blocked)


def _ready_time(
    action: Action,
    num_stages: int,
    end: dict[Action, float],
    delay_s: Callable[[Action, Action], float] | None,
) -> float | None:
    """When every input of ``action`` is available, or None if one has not run yet."""
    ready = 0.0
    for dep in dependencies(action, num_stages):
        done = end.get(dep)
        if done is None:
            return None
        ready = max(ready, done + (delay_s(dep, action) if delay_s else 0.0))
    return ready
