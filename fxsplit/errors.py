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
    """No plan satisfies the constraints (memory, device count); the message gives the numbers."""


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
