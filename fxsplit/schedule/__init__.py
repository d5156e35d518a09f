"""Pipeline schedules as data: actions, generators, validator, simulator, exploration (torch-free).

A schedule is per-rank lists of actions such as ``"0F1"`` (stage 0, forward, micro-batch 1) with a
text round-trip; generators are pure functions registered by name; :func:`validate` proves a
schedule complete and deadlock-free; :func:`simulate` predicts its timeline, makespan, bubble and
activation memory; :func:`explore` picks the schedule and micro-batch count for a plan.

Example:
    >>> from fxsplit.schedule import make, simulate
    >>> tl = simulate(make("1f1b", 4, 8), fwd_s=[1.0] * 4, bwd_s=[2.0] * 4)
    >>> tl.makespan_s, tl.peak_in_flight
    (33.0, (4, 3, 2, 1))
"""

from fxsplit.schedule.actions import KINDS, Action, B, F, Schedule, format_actions, parse_actions
from fxsplit.schedule.engine import dependencies
from fxsplit.schedule.explore import Candidate, ScheduleChoice, default_microbatches, explore
from fxsplit.schedule.generators import (
    ScheduleGenerator,
    available,
    gpipe,
    make,
    one_f_one_b,
    register,
)
from fxsplit.schedule.simulate import (
    Event,
    Timeline,
    peak_in_flight,
    plan_step_s,
    simulate,
    simulate_plan,
    with_loss,
)
from fxsplit.schedule.validate import Fault, find_faults, validate

__all__ = [
    "Action",
    "B",
    "Candidate",
    "Event",
    "F",
    "Fault",
    "KINDS",
    "Schedule",
    "ScheduleChoice",
    "ScheduleGenerator",
    "Timeline",
    "available",
    "default_microbatches",
    "dependencies",
    "explore",
    "find_faults",
    "format_actions",
    "gpipe",
    "make",
    "one_f_one_b",
    "parse_actions",
    "peak_in_flight",
    "plan_step_s",
    "register",
    "simulate",
    "simulate_plan",
    "with_loss",
    "validate",
]
