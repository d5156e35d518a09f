"""Fault reporting of the distributed runtime: what a rank was doing, and a watchdog.

A rank that dies closes its sockets, and its neighbours' pending receives fail at once; a rank
that raises (or hangs) leaves them waiting until the process-group timeout, which
``init_process_group(timeout=...)`` sets to ``timeout_s``. Either way the waiting rank gets a
``RuntimeError`` from the backend, which :class:`Progress` turns into an
:class:`~fxsplit.errors.ExecutionError` naming this rank, its stage, the micro-batch and the
action in flight. :class:`Watchdog` is the last resort for a rank stuck where no backend timeout
reaches (a collective that ignores it, a deadlock in user code): past ``timeout_s`` plus a grace
period it logs what the rank was doing and ends the process, so no launch hangs forever.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from fxsplit.errors import ExecutionError

__all__ = ["Progress", "Watchdog", "WATCHDOG_EXIT_CODE"]

log = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = 75
"""Exit status of a process the :class:`Watchdog` ended."""


@dataclass
class Progress:
    """What one rank is doing now; updated by the runtime, read on failure.

    Attributes:
        rank: Global rank.
        stage: Stage index of the latest action (the rank's first stage before any).
        device: torch device string.
        action: ``"forward"``, ``"backward"``, ``"receiving activations for"``, ...
        microbatch: Micro-batch of that action, or None between steps.
        started_s: ``time.monotonic()`` of the step's last progress (its start, then every
            action), or None when idle; a slow but moving step is never killed.
    """

    rank: int
    stage: int
    device: str
    action: str = "idle"
    microbatch: int | None = None
    started_s: float | None = None

    def at(self, action: str, microbatch: int | None, stage: int | None = None) -> None:
        """Record ``action`` on ``microbatch`` (of ``stage``, when the rank runs several)."""
        self.action, self.microbatch = action, microbatch
        if stage is not None:
            self.stage = stage
        if self.started_s is not None:  # progress: the watchdog measures from the last one
            self.started_s = time.monotonic()

    def error(self, exc: BaseException, what: str = "a step") -> ExecutionError:
        """An :class:`ExecutionError` for ``exc`` raised during ``what``."""
        mb = f" micro-batch {self.microbatch}" if self.microbatch is not None else ""
        peer = _peer_hint(str(exc))
        return ExecutionError(
            f"rank {self.rank} (stage {self.stage} on {self.device}) failed in {what} while "
            f"{self.action}{mb}: {type(exc).__name__}: {_first_line(exc)}{peer}",
            stage=self.stage, microbatch=self.microbatch, device=self.device, rank=self.rank,
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


def _peer_hint(message: str) -> str:
    lowered = message.lower()
    if "closed by peer" in lowered or "connection reset" in lowered:
        return "; a neighbouring rank died: see its log for the first error"
    if "timed out" in lowered or "timeout" in lowered:
        return (
            "; a neighbouring rank stopped answering (it raised, hangs or died): see its log, or "
            "raise timeout_s if a step is legitimately slower"
        )
    return ""


class Watchdog:
    """Ends the process when a step runs past ``timeout_s + grace_s``.

    Args:
        progress: The rank's :class:`Progress` (its ``started_s`` is the step start).
        timeout_s: The runtime's timeout, seconds.
        grace_s: Extra time before acting, seconds (the backend timeout should fire first).
        poll_s: How often to look, seconds.
    """

    def __init__(self, progress: Progress, timeout_s: float, grace_s: float = 5.0, poll_s: float = 0.5) -> None:
        self.progress, self.limit_s, self.poll_s = progress, timeout_s + grace_s, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fxsplit-watchdog-{progress.rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            started = self.progress.started_s
            if started is not None and time.monotonic() - started > self.limit_s:
                p = self.progress
                log.critical(
                    "fxsplit watchdog: rank %d (stage %d) stuck for more than %.0f s while %s micro-batch %s; "
                    "ending the process with status %d", p.rank, p.stage, self.limit_s, p.action, p.microbatch,
                    WATCHDOG_EXIT_CODE,
                )
                os._exit(WATCHDOG_EXIT_CODE)

    def stop(self) -> None:
        self._stop.set()
