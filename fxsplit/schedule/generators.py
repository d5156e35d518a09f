"""Schedule generators: pure functions ``(num_stages, num_microbatches) -> Schedule`` (torch-free).

References:
    Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
    Parallelism", NeurIPS 2019, §2.2 (fill-drain: all forwards, then all backwards).
    Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training" (PipeDream-2BW and
    PipeDream-Flush), ICML 2021, §3 (1F1B with a flush: warm-up, steady one-forward-one-backward,
    cool-down).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from fxsplit.errors import ScheduleError
from fxsplit.schedule.actions import Action, B, F, Schedule
from fxsplit.schedule.validate import validate

__all__ = ["ScheduleGenerator", "register", "available", "make", "gpipe", "one_f_one_b"]

logger = logging.getLogger(__name__)


class ScheduleGenerator(Protocol):
    """A pure function that lays out one training step; one stage per rank."""

    def __call__(self, num_stages: int, num_microbatches: int) -> Schedule: ...


_REGISTRY: dict[str, ScheduleGenerator] = {}


def register(name: str) -> Callable[[ScheduleGenerator], ScheduleGenerator]:
    """Decorator that registers a generator under ``name`` for :func:`make`.

    Raises:
        ScheduleError: when ``name`` is already registered (pick another name).
    """

    def deco(fn: ScheduleGenerator) -> ScheduleGenerator:
        if name in _REGISTRY:
            raise ScheduleError(
                f"a schedule named {name!r} is already registered ({_REGISTRY[name]!r}); choose another name"
            )
        _REGISTRY[name] = fn
        return fn

    return deco


def available() -> tuple[str, ...]:
    """Registered schedule names, sorted."""
    return tuple(sorted(_REGISTRY))


def make(kind: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Generate and validate the schedule registered as ``kind``.

    Args:
        kind: A name from :func:`available` (``"gpipe"``, ``"1f1b"``).
        num_stages: Pipeline stages ``p >= 1``, one per rank.
        num_microbatches: Micro-batches per step ``m >= 1``.

    Returns:
        The validated schedule.

    Raises:
        ScheduleError: for an unknown ``kind`` (listing the known ones), ``p < 1`` or ``m < 1``.

    Example:
        >>> print(make("1f1b", 2, 2).to_text(), end="")
        schedule 1f1b: stages=2 microbatches=2 stage_to_rank=0,1
        step  rank0  rank1
           0  0F0    1F0
           1  0F1    1B0
           2  0B0    1F1
           3  0B1    1B1
    """
    if kind not in _REGISTRY:
        raise ScheduleError(f"unknown schedule {kind!r}; choose one of {', '.join(available())}")
    schedule = validate(_REGISTRY[kind](num_stages, num_microbatches))
    logger.debug("made schedule %s: %d stages, %d micro-batches", kind, num_stages, num_microbatches)
    return schedule


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ScheduleError(
            f"need num_stages >= 1 and num_microbatches >= 1, got {num_stages} and {num_microbatches}"
        )


@register("gpipe")
def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe (fill-drain): every stage runs all ``m`` forwards, then all ``m`` backwards.

    Every stage holds the activations of all ``m`` micro-batches at the switch.

    Args:
        num_stages: ``p >= 1``.
        num_microbatches: ``m >= 1``.

    Raises:
        ScheduleError: when ``p < 1`` or ``m < 1``.

    Example:
        >>> [str(a) for a in gpipe(2, 2).actions[1]]
        ['1F0', '1F1', '1B0', '1B1']
    """
    _check_sizes(num_stages, num_microbatches)
    ranks = tuple(
        tuple(Action(s, F, i) for i in range(num_microbatches))
        + tuple(Action(s, B, i) for i in range(num_microbatches))
        for s in range(num_stages)
    )
    return Schedule(ranks, num_stages, num_microbatches, name="gpipe")


@register("1f1b")
def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B with a flush (PipeDream-Flush): warm-up, one forward one backward, cool-down.

    Stage ``s`` runs ``w = min(m, p - s - 1)`` warm-up forwards, then alternates forward of
    micro-batch ``w + i`` with backward of ``i`` for ``i < m - w``, then the ``w`` remaining
    backwards. It holds at most ``min(m, p - s)`` micro-batches' activations.

    Args:
        num_stages: ``p >= 1``.
        num_microbatches: ``m >= 1``.

    Raises:
        ScheduleError: when ``p < 1`` or ``m < 1``.

    Example:
        >>> [str(a) for a in one_f_one_b(3, 4).actions[0]]
        ['0F0', '0F1', '0F2', '0B0', '0F3', '0B1', '0B2', '0B3']
    """
    _check_sizes(num_stages, num_microbatches)
    m = num_microbatches
    ranks = []
    for s in range(num_stages):
        warmup = min(m, num_stages - s - 1)
        acts = [Action(s, F, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action(s, F, warmup + i), Action(s, B, i)]
        acts += [Action(s, B, i) for i in range(m - warmup, m)]
        ranks.append(tuple(acts))
    return Schedule(tuple(ranks), num_stages, m, name="1f1b")
