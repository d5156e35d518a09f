"""The closed vocabularies of fxsplit: schedule, objective, recomputation and cost-model names.

Each vocabulary is a ``Literal`` type, for signatures, and a tuple of its names built from that
type with :func:`typing.get_args`, for checks and help texts, so the two never disagree. Solvers
and schedules also have open registries (:func:`fxsplit.solvers.register_solver`,
:func:`fxsplit.schedule.register`): a parameter that takes a registered name stays ``str``.

Example:
    >>> from fxsplit.ir.names import OBJECTIVES, SCHEDULES
    >>> OBJECTIVES
    ('bottleneck', 'makespan')
    >>> "zero-bubble" in SCHEDULES
    True
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "AUTO_SCHEDULES",
    "COST_MODELS",
    "CostModelName",
    "LOOPED_SCHEDULES",
    "OBJECTIVES",
    "ObjectiveName",
    "RECOMPUTE",
    "RecomputeName",
    "SCHEDULES",
    "SIMULATED_SCHEDULES",
    "ScheduleName",
]

#: A pipeline schedule the planner costs (:class:`fxsplit.ir.Problem`'s ``schedule``).
ScheduleName = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "interleaved-zero-bubble"]
#: What a solver minimises: the slowest stage per micro-batch, or one training step.
ObjectiveName = Literal["bottleneck", "makespan"]
#: Activation recomputation (checkpointing) per stage.
RecomputeName = Literal["none", "auto", "all"]
#: Where the planner's node times come from (:mod:`fxsplit.passes.costs`).
CostModelName = Literal["analytic", "measured", "profiled"]

SCHEDULES: tuple[ScheduleName, ...] = get_args(ScheduleName)
#: Schedules that run several stages per device in looping placement (stage ``s`` on the
#: ``s mod r``-th of ``r`` devices); :func:`fxsplit.schedule.make` generates them.
LOOPED_SCHEDULES: tuple[ScheduleName, ...] = ("interleaved-1f1b", "interleaved-zero-bubble")
#: What ``schedule="auto"`` chooses from. The zero-bubble kinds run when asked for: on this
#: machine's CPU a backward split into its input and weight halves (torch's own split) measured
#: 29-46 % slower than the whole backward on the second stage of U-Net and GPT
#: (bench/README.md), which the cost model does not see yet, so it would pick them where they lose.
AUTO_SCHEDULES: tuple[ScheduleName, ...] = ("gpipe", "1f1b", "interleaved-1f1b")
#: Schedules whose step has no closed form in the stage times: :func:`fxsplit.schedule.plan_step_s`
#: simulates them (the looped ones, and zero-bubble's split backward).
SIMULATED_SCHEDULES: tuple[ScheduleName, ...] = (*LOOPED_SCHEDULES, "zero-bubble")
OBJECTIVES: tuple[ObjectiveName, ...] = get_args(ObjectiveName)
#: ``"none"``; ``"auto"``, a stage recomputes exactly when keeping its activations would not fit
#: its device and recomputing saves memory (the time-optimal choice for that stage: recomputing
#: only adds a forward); ``"all"``, every stage.
RECOMPUTE: tuple[RecomputeName, ...] = get_args(RecomputeName)
#: ``"analytic"`` (roofline), ``"measured"`` (each node timed on the reference device) or
#: ``"profiled"`` (each node timed at several micro-batch sizes, a fit per node).
COST_MODELS: tuple[CostModelName, ...] = get_args(CostModelName)
