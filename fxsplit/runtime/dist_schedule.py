"""One schedule path: fxsplit's action lists run on ``torch.distributed.pipelining``'s runtime.

The schedule the explorer picked and simulated (:class:`fxsplit.schedule.Schedule`: per-rank
lists of ``"0F1"`` / ``"1B0"`` / ``"1I0"`` / ``"1W0"`` actions) is lowered to torch's schedule IR
(``_Action`` with ``FORWARD`` / ``FULL_BACKWARD`` / ``BACKWARD_INPUT`` / ``BACKWARD_WEIGHT``) and handed to ``_PipelineScheduleRuntime``, which adds the
send/receive actions itself (``_prepare_schedule_with_comms``, the same lowering torch applies to
its CSV schedules). So there is no second schedule world: what fxsplit simulates is what runs,
and any schedule fxsplit can generate and validate (several stages per rank included) runs
across processes.

References:
    torch.distributed.pipelining, ``schedules._PipelineScheduleRuntime`` and ``_load_csv``
    (PyTorch 2.4+): https://pytorch.org/docs/stable/distributed.pipelining.html
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    _Action,
    _PipelineScheduleRuntime,
)

from fxsplit.errors import ScheduleError
from fxsplit.schedule import Schedule, validate

__all__ = ["torch_actions", "lowered_schedule"]

_KIND = {"F": FORWARD, "B": FULL_BACKWARD, "I": BACKWARD_INPUT, "W": BACKWARD_WEIGHT}


def torch_actions(schedule: Schedule) -> dict[int, list[_Action | None]]:
    """``schedule``'s per-rank actions in torch's schedule IR (compute only).

    Raises:
        ScheduleError: for an action kind torch's runtime has no counterpart for.

    Example:
        >>> from fxsplit.schedule import make
        >>> [str(a) for a in torch_actions(make("1f1b", 2, 2))[1]]
        ['1F0', '1B0', '1F1', '1B1']
    """
    out: dict[int, list[_Action | None]] = {}
    for rank, actions in enumerate(schedule.actions):
        lowered: list[_Action | None] = []
        for a in actions:
            if a.kind not in _KIND:
                raise ScheduleError(f"action {a} of rank {rank}: torch's runtime has no {a.kind!r} action; "
                                    f"use kinds {sorted(_KIND)}")
            lowered.append(_Action(a.stage, _KIND[a.kind], a.microbatch))
        out[rank] = lowered
    return out


def lowered_schedule(
    stages: Sequence[Any],
    schedule: Schedule,
    loss_fn: Callable[..., Any] | None,
    *,
    scale_grads: bool = False,
) -> _PipelineScheduleRuntime:
    """A ``_PipelineScheduleRuntime`` that runs ``schedule`` over this rank's ``stages``.

    Args:
        stages: This rank's ``PipelineStage`` s (one per stage the rank runs).
        schedule: The validated fxsplit schedule (all ranks' actions).
        loss_fn: ``loss_fn(output, target)`` on the last stage; None for inference.
        scale_grads: Let torch divide gradients by the micro-batch count (fxsplit weights the
            loss by each micro-batch's share instead, so False).

    Returns:
        The runtime; call ``.step(*inputs, target=..., losses=...)`` as with torch's schedules.

    Raises:
        ScheduleError: when ``schedule`` fails :func:`fxsplit.schedule.validate`.
    """
    validate(schedule)
    runtime = _PipelineScheduleRuntime(list(stages), n_microbatches=schedule.microbatches, loss_fn=loss_fn,
                                       scale_grads=scale_grads)
    runtime._prepare_schedule_with_comms(torch_actions(schedule))
    return runtime
