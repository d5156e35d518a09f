"""Error classes of fxsplit.

Every error fxsplit raises on purpose is a :class:`FxsplitError`, and each kind also subclasses the
matching builtin so that callers who catch ``ValueError`` or ``RuntimeError`` keep working. A message
says what went wrong, where, the values involved, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "FxsplitError",
    "CaptureError",
    "AnnotationError",
    "PassError",
    "InfeasibleError",
    "SolverError",
    "PlanError",
    "ScheduleError",
    "ExecutionError",
    "ConfigError",
    "InternalError",
    "NotPerSampleWarning",
]


class FxsplitError(Exception):
    """Base class of every error fxsplit raises on purpose."""


class CaptureError(FxsplitError, RuntimeError):
    """The model could not be captured as an FX graph by any of the methods tried."""


class AnnotationError(FxsplitError, ValueError):
    """A ``node.meta`` key a pass needs is missing or malformed."""


class PassError(FxsplitError, RuntimeError):
    """A graph pass failed; the message names the pass and the passes that ran before it."""


class InfeasibleError(FxsplitError, ValueError):
    """No plan satisfies the constraints (memory, device count); the message gives the numbers.

    The numbers are also fields, set at construction (keyword-only, ``None`` when the check that
    raised the error does not know them):

    Attributes:
        stage: Stage that overflows most in the split that overflows least.
        device: Index (into the problem's devices) of the device of that stage.
        block: Block that fits no device on its own (the memory bound's proof).
        need_bytes: Memory that stage needs, bytes (the memory bound: least total of any
            placement).
        cap_bytes: Memory that device has, bytes (the memory bound: total of the devices that may
            run stages).
        over_bytes: ``need_bytes - cap_bytes``, bytes.
        min_memory_bytes: Least memory of every device with which the same devices fit, bytes.
        min_devices: Least number of devices (copies of the largest added) that fit; ``None`` when
            none up to the search limit does, or it was not searched.
        min_devices_at_least: Lower bound on the number of devices that could fit (the memory
            bound); ``None`` when no number of devices passes it.
        min_extra_bytes_at_least: Lower bound on the memory to add to every device, bytes.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: int | None = None,
        device: int | None = None,
        block: int | None = None,
        need_bytes: float | None = None,
        cap_bytes: float | None = None,
        over_bytes: float | None = None,
        min_memory_bytes: int | None = None,
        min_devices: int | None = None,
        min_devices_at_least: int | None = None,
        min_extra_bytes_at_least: int | None = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.device = device
        self.block = block
        self.need_bytes = need_bytes
        self.cap_bytes = cap_bytes
        self.over_bytes = over_bytes
        self.min_memory_bytes = min_memory_bytes
        self.min_devices = min_devices
        self.min_devices_at_least = min_devices_at_least
        self.min_extra_bytes_at_least = min_extra_bytes_at_least


class SolverError(FxsplitError, RuntimeError):
    """A solver failed for a reason other than infeasibility (unknown name, bad status)."""


class PlanError(FxsplitError, ValueError):
    """A plan is invalid for its problem, or codegen cannot realise it."""


class ScheduleError(FxsplitError, ValueError):
    """A pipeline schedule is malformed, or an action list fails validation."""


class ExecutionError(FxsplitError, RuntimeError):
    """A stage failed while running; the message names the stage, micro-batch and device."""

    def __init__(
        self,
        message: str,
        *,
        stage: int | None = None,
        microbatch: int | None = None,
        device: str | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.microbatch = microbatch
        self.device = device
        self.rank = rank


class ConfigError(FxsplitError, ValueError):
    """A user argument is invalid (no devices, unknown solver, inputs that do not fit the model)."""


class InternalError(FxsplitError, AssertionError):
    """An invariant of fxsplit broke: this is a bug in fxsplit, please report it."""


class NotPerSampleWarning(UserWarning):
    """The model mixes samples across the batch or updates a buffer in forward, and more than one
    micro-batch was asked for: the pipeline's results differ from the unsplit model's (see
    :mod:`fxsplit.passes.per_sample`)."""
