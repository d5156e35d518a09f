"""A flag by which one solver stops another: the race of ``auto`` (torch-free).

``auto`` runs the DP in the calling thread and CP-SAT in a second one; whichever proves its
answer first sets the other's :class:`Cancel`. The DP looks at the flag between blocks of
downsets (:func:`fxsplit.solvers.dpcore.run_dp`); CP-SAT registers its ``stop_search`` with
:meth:`Cancel.on_set`, which OR-Tools allows from another thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Cancel"]


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
