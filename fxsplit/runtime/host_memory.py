"""Host memory for CPU training: keep freed blocks in the process rather than giving them back.

glibc's ``malloc`` serves a block above its mmap threshold with a fresh ``mmap`` and gives it back
with ``munmap`` when it is freed; the threshold starts at 128 KiB and moves up (to at most 32 MiB)
as such blocks are freed. A training step allocates every weight gradient and many activations
afresh, so whether a 4 MiB gradient comes from the heap or from a new mapping whose pages the
kernel must zero on first touch depends on what the process freed before: the same step then
runs in one of two speeds. Measured here (``fxsplit.passes.profile.profile_node_times`` on the
zoo MLP, 1024-wide layers at 8 rows, one thread, five profiles in one process): 11.5, 10.9, 6.1,
11.2, 6.2 ms per forward and backward; with the thresholds fixed as :func:`keep_freed_memory`
sets them, 6.2-6.6 ms every time (the zoo GPT, whose tensors are smaller, 9.2-10.2 ms either way).
A profile taken in one mode and a pipeline run in the other is a plan that does not come true.

PyTorch's CPU tuning guides give the same advice in another form (``LD_PRELOAD`` jemalloc or
tcmalloc, which cache freed blocks); :func:`keep_freed_memory` does it in-process with glibc's
own ``mallopt``, for the process that calls it. The ``fxsplit`` CLI calls it when it trains on
CPU devices; a script calls it once at start-up.

References:
    ``mallopt(3)``: ``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD`` (glibc);
    https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html (CPU: memory allocators).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["keep_freed_memory", "MMAP_THRESHOLD_MAX_BYTES"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_MAX_BYTES = 32 * 2**20
"""glibc's largest mmap threshold on 64-bit machines (``DEFAULT_MMAP_THRESHOLD_MAX``): blocks
above it are always mapped afresh."""


def keep_freed_memory(trim_threshold_bytes: int = 2**30) -> bool:
    """Serve blocks up to 32 MiB from the heap and keep up to ``trim_threshold_bytes`` of freed
    heap in the process (glibc ``mallopt``); process-wide, from now on.

    Args:
        trim_threshold_bytes: Free memory at the top of the heap kept before it is given back to
            the system, bytes (default 1 GiB); at most ``2**31 - 1``.

    Returns:
        True when glibc took both settings; False where there is no glibc (macOS, musl: nothing
        is changed) or it refused one (logged).

    Raises:
        ValueError: for a threshold outside ``0 .. 2**31 - 1`` (``mallopt`` takes an ``int``).

    Example:
        >>> from fxsplit.runtime.host_memory import keep_freed_memory
        >>> keep_freed_memory()  # doctest: +SKIP (process-wide: not inside the test process)
        True
    """
    if not 0 <= trim_threshold_bytes <= 2**31 - 1:
        raise ValueError(f"trim_threshold_bytes={trim_threshold_bytes}: mallopt takes 0 .. 2**31 - 1 bytes")
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("no glibc mallopt here: the allocator is left as it is")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes))
    if not ok:
        log.warning("glibc refused mallopt(M_MMAP_THRESHOLD=%d, M_TRIM_THRESHOLD=%d)", MMAP_THRESHOLD_MAX_BYTES,
                    trim_threshold_bytes)
    return ok
