"""Bytes, seconds and id lists for people: the one place fxsplit formats them (torch-free).

Every layer that shows a size or a duration (error messages of the solvers, the schedule's tables
and Gantt charts, the reports, the pictures) formats it here, in binary units for bytes and
s / ms / us for seconds.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["BINARY_UNITS", "bytes_unit", "format_bytes", "format_ids", "format_seconds"]

#: Binary byte units, largest first.
BINARY_UNITS: tuple[tuple[str, int], ...] = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def bytes_unit(n: float, largest: str = "TiB") -> tuple[str, int]:
    """The largest binary unit up to ``largest`` that ``n`` bytes fill at least once, and its size.

    Example:
        >>> bytes_unit(3 * 2**30), bytes_unit(100), bytes_unit(2**41, largest="GiB")
        (('GiB', 1073741824), ('B', 1), ('GiB', 1073741824))
    """
    allowed = BINARY_UNITS[[u for u, _ in BINARY_UNITS].index(largest):]
    return next(((unit, size) for unit, size in allowed if abs(n) >= size), ("B", 1))


def format_bytes(n: float, decimals: int = 1, largest: str = "TiB") -> str:
    """``n`` bytes in the largest unit up to ``largest`` it fills (whole bytes below 1 KiB).

    Example:
        >>> format_bytes(1536), format_bytes(3 * 2**30, decimals=2), format_bytes(12)
        ('1.5 KiB', '3.00 GiB', '12 B')
    """
    unit, size = bytes_unit(n, largest)
    return f"{n:.0f} B" if unit == "B" else f"{n / size:.{decimals}f} {unit}"


def format_seconds(seconds: float, significant: int | None = None) -> str:
    """A duration in s, ms or us: two decimals (one in us), or ``significant`` digits.

    Example:
        >>> format_seconds(0.0123), format_seconds(2.5), format_seconds(4.2e-5)
        ('12.30 ms', '2.50 s', '42.0 us')
        >>> format_seconds(0.0123, significant=3), format_seconds(4.2e-5, significant=3)
        ('12.3 ms', '42 us')
    """
    for unit, scale, decimals in (("s", 1.0, 2), ("ms", 1e-3, 2), ("us", 1e-6, 1)):
        if abs(seconds) >= scale or unit == "us":
            value = seconds / scale
            return f"{value:.{significant}g} {unit}" if significant else f"{value:.{decimals}f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def format_ids(ids: Iterable[int], shown: int = 6) -> str:
    """Block (or stage) ids: a contiguous run as ``first-last``, else the first ``shown`` ids.

    Example:
        >>> format_ids((3, 1, 2)), format_ids((5,)), format_ids((4, 52, 53)), format_ids(range(0, 20, 2))
        ('1-3', '5', '4,52,53', '0,2,4,6,8,10...')
    """
    ids = tuple(sorted(ids))
    if not ids:
        return ""
    if ids == tuple(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return ",".join(map(str, ids[:shown])) + ("..." if len(ids) > shown else "")
