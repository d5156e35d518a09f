"""A flag by which one solver stops another: the race of ``auto`` (torch-free).

``auto`` runs the DP in the calling thread and CP-SAT in a second one; whichever proves its
answer first sets the other's :class:`Cancel`. The DP looks at the flag between blocks of
downsets (:func:`fxsplit.solvers.dpcore.run_dp`); CP-SAT's solve is watched by
:func:`stop_search_when`, which calls the solver's ``stop_search`` (allowed from another thread)
once the flag is set, again until the solve returns: OR-Tools ignores a stop that comes before
its search has started.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Cancel", "stop_search_when"]


class Cancel:
    """A thread-safe, one-way flag with hooks run when it is set.

    Example:
        >>> c = Cancel()
        >>> seen = []
        >>> remove = c.on_set(lambda: seen.append("stop"))
        >>> c.set(); c.is_set(), seen
        (True, ['stop'])
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._hooks: list[Callable[[], None]] = []

    def set(self) -> None:
        """Set the flag and run the hooks registered so far (once)."""
        with self._lock:
            if self._event.is_set():
                return
            self._event.set()
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()

    def is_set(self) -> bool:
        return self._event.is_set()

    def on_set(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Run ``hook`` when the flag is set (now, if it is); returns a function that unregisters it."""
        with self._lock:
            if not self._event.is_set():
                self._hooks.append(hook)

                def remove() -> None:
                    with self._lock:
                        if hook in self._hooks:
                            self._hooks.remove(hook)

                return remove
        hook()
        return lambda: None


def stop_search_when(cancel: Cancel, stop_search: Callable[[], None], *,
                     every_s: float = 0.02) -> Callable[[], None]:
    """Call ``stop_search`` once ``cancel`` is set and every ``every_s`` seconds after that, until
    the returned function is called (when the solve has returned); a watcher thread does it."""
    wake, done = threading.Event(), threading.Event()

    def watch() -> None:
        wake.wait()
        while not done.is_set():
            stop_search()
            done.wait(every_s)

    thread = threading.Thread(target=watch, name="fxsplit-stop-search", daemon=True)
    thread.start()
    remove = cancel.on_set(wake.set)

    def finished() -> None:
        remove()
        done.set()
        wake.set()
        thread.join()

    return finished
