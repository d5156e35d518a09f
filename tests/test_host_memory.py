"""fxsplit.runtime.host_memory.keep_freed_memory: large blocks from the heap, not fresh mappings.

Root cause it addresses: glibc served a step's multi-MiB gradients by mmap or from the heap
depending on what the process had freed before, so the same MLP forward and backward profiled
at 6 or 11 ms in one process (page faults of fresh mappings), and a plan's profile and its run
could land in different modes.
"""

from __future__ import annotations

import ctypes.util
import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent("""
    import ctypes, sys, torch
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    from fxsplit.runtime.host_memory import keep_freed_memory
    applied = keep_freed_memory() if sys.argv[1] == "kept" else None
    before = libc.mallinfo2().hblkhd
    block = torch.empty(4 << 20, dtype=torch.float32)  # 16 MiB
    print(applied, libc.mallinfo2().hblkhd - before)
""")


def _mapped_bytes(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True).stdout
    applied, mapped = out.split()
    return applied, int(mapped)


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                    reason="glibc's mallopt and mallinfo2")
def test_a_16_mib_block_comes_from_the_heap_once_freed_memory_is_kept() -> None:
    """In a fresh process glibc maps a 16 MiB block afresh (above its 128 KiB start threshold);
    after keep_freed_memory() the same block comes from the heap (no new mapping)."""
    applied_default, mapped_default = _mapped_bytes("default")
    applied, mapped = _mapped_bytes("kept")
    assert mapped_default >= 16 * 2**20, "the default allocator mapped it: the probe can tell the two apart"
    assert applied == "True" and mapped == 0


def test_a_threshold_mallopt_cannot_take_is_refused() -> None:
    from fxsplit.runtime.host_memory import keep_freed_memory

    with pytest.raises(ValueError, match="2\\*\\*31 - 1"):
        keep_freed_memory(2**31)
