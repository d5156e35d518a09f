"""Run a schedule with one worker thread per device, so that stages overlap (as torchgpipe does).

Each rank's action list runs in order in its own thread; an action waits until the actions it
depends on are done (a forward on the previous stage's forward of the same micro-batch, a backward
on its own forward and on the next stage's backward). On CUDA each worker issues its work on its
own stream and synchronises it before it signals, so a consumer never reads a tensor still being
written. The first exception stops every worker and is re-raised in the caller once all threads
have ended: no thread is left running.

References:
    Kim et al., "torchgpipe: On-the-fly pipeline parallelism for training giant models", 2020
    (one worker thread and CUDA stream per device).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from fxsplit.errors import ExecutionError
from fxsplit.schedule import Action, Schedule, dependencies

__all__ = ["run_threaded", "action_dependencies"]

log = logging.getLogger(__name__)

_Key = tuple[int, str, int]
_POLL_S = 0.05


def action_dependencies(action: Action, num_stages: int) -> list[_Key]:
    """The ``(stage, kind, micro-batch)`` actions that must finish before ``action`` starts
    (:func:`fxsplit.schedule.dependencies`)."""
    return [(a.stage, a.kind, a.microbatch) for a in dependencies(action, num_stages)]


@contextlib.contextmanager
def _device_stream(device: torch.device) -> Iterator[torch.cuda.Stream | None]:
    if device.type != "cuda":
        yield None
        return
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield stream


class _Run:
    """Shared state of one threaded run: done events, the first error and where it was raised
    (``"rank 1 on cuda:1"``), the abort flag."""

    def __init__(self, schedule: Schedule) -> None:
        self.done: dict[_Key, threading.Event] = {
            (a.stage, a.kind, a.microbatch): threading.Event() for actions in schedule.actions for a in actions
        }
        self.abort = threading.Event()
        self.error: BaseException | None = None
        self.where = "a worker"
        self.lock = threading.Lock()

    def wait(self, key: _Key) -> bool:
        """Block until ``key`` is done; False when the run was aborted meanwhile."""
        event = self.done[key]
        while not event.wait(_POLL_S):
            if self.abort.is_set():
                return False
        return not self.abort.is_set()

    def fail(self, exc: BaseException, where: str) -> None:
        """Record ``exc`` raised on ``where`` when it is the first error, and abort the run."""
        with self.lock:
            if self.error is None:
                self.error = exc
                self.where = where
        self.abort.set()


def _worker(rank: int, actions: Sequence[Action], device: torch.device, num_stages: int,
            run: Callable[[Action], None], state: _Run) -> None:
    try:
        with _device_stream(device) as stream:
            for action in actions:
                if not all(state.wait(k) for k in action_dependencies(action, num_stages)):
                    return
                run(action)
                if stream is not None:
                    stream.synchronize()
                state.done[(action.stage, action.kind, action.microbatch)].set()
    except BaseException as exc:  # noqa: BLE001 - handed to the caller, which re-raises it
        state.fail(exc, f"rank {rank} on {device}")


def run_threaded(schedule: Schedule, run: Callable[[Action], None], devices: Sequence[str]) -> None:
    """Run ``schedule`` with one thread per rank, calling ``run(action)`` for each action.

    Args:
        schedule: The validated schedule (per-rank action lists).
        run: Executes one action (the pipeline's forward or backward of a stage and micro-batch).
        devices: torch device of each rank, ``[num_ranks]``.

    Raises:
        ExecutionError: the first failure of any worker (an ``ExecutionError`` raised by ``run``
            as is, anything else wrapped with the rank that raised it), after every worker ended.
    """
    state = _Run(schedule)
    threads = [
        threading.Thread(
            target=_worker, name=f"fxsplit-rank{r}", daemon=True,
            args=(r, actions, torch.device(devices[r]), schedule.num_stages, run, state),
        )
        for r, actions in enumerate(schedule.actions)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:  # interrupted (Ctrl-C): stop the workers before leaving
        state.abort.set()
        for t in threads:
            if t.is_alive():
                t.join()
    if state.error is not None:
        if isinstance(state.error, ExecutionError):
            raise state.error
        raise ExecutionError(
            f"pipeline worker failed on {state.where}: {type(state.error).__name__}: {state.error}; "
            "the traceback below (the cause) shows where"
        ) from state.error
