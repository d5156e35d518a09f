"""Hypothesis properties of fxsplit.schedule: generators, text, validator and simulator.

Strategies are local to this module (tests/strategies.py is shared and not owned here); move them
there when another module needs them.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxsplit.errors import ScheduleError
from fxsplit.schedule import Schedule, find_faults, make, peak_in_flight, simulate
from fxsplit.schedule.generators import stages_per_rank_ok

KINDS = ("gpipe", "1f1b")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

sizes = st.tuples(st.integers(1, 6), st.integers(1, 12))
cost = st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False)


@st.composite
def costed(draw):
    """(kind, p, m, fwd_s, bwd_s) with random per-stage costs."""
    kind = draw(st.sampled_from(KINDS))
    p, m = draw(sizes)
    fwd = draw(st.lists(cost, min_size=p, max_size=p))
    bwd = draw(st.lists(cost, min_size=p, max_size=p))
    return kind, p, m, fwd, bwd


@SETTINGS
@given(kind=st.sampled_from(KINDS), pm=sizes)
def test_generated_schedules_are_valid_and_round_trip(kind, pm):
    p, m = pm
    s = make(kind, p, m)
    assert find_faults(s) == []
    assert Schedule.from_text(s.to_text()) == s
    assert sum(len(a) for a in s.actions) == 2 * p * m


@SETTINGS
@given(kind=st.sampled_from(KINDS), pm=sizes)
def test_peak_in_flight_formula(kind, pm):
    p, m = pm
    expected = (m,) * p if kind == "gpipe" else tuple(min(m, p - s) for s in range(p))
    assert peak_in_flight(make(kind, p, m)) == expected


@SETTINGS
@given(case=costed())
def test_makespan_bounds(case):
    kind, p, m, fwd, bwd = case
    tl = simulate(make(kind, p, m), fwd, bwd)
    assert len(tl.events) == 2 * p * m  # no deadlock: every action ran
    # Stage s starts after micro-batch 0 reaches it, works m * (f + b), and its last gradient
    # must still travel back to stage 0.
    lower = max(sum(fwd[:s]) + m * (fwd[s] + bwd[s]) + sum(bwd[:s]) for s in range(p))
    assert tl.makespan_s >= lower * (1 - 1e-9) - 1e-12
    # Without link delay some rank is always busy, so the step is at most all the work in series.
    assert tl.makespan_s <= sum(tl.busy_s) * (1 + 1e-9) + 1e-12
    assert -1e-9 <= tl.bubble_fraction <= 1.0


@SETTINGS
@given(kind=st.sampled_from(KINDS), pm=sizes, f=st.floats(0.01, 5.0), r=st.floats(0.0, 3.0))
def test_balanced_closed_form(kind, pm, f, r):
    p, m = pm
    b = f * r
    tl = simulate(make(kind, p, m), [f] * p, [b] * p)
    assert tl.makespan_s == pytest.approx(p * (f + b) + (m - 1) * (f + b), rel=1e-9)
    assert tl.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)


@SETTINGS
@given(kind=st.sampled_from(KINDS), pm=sizes, seed=st.integers(0, 2**32 - 1))
def test_shuffled_schedules_validate_or_raise_schedule_error(kind, pm, seed):
    # The validator's verdict decides: a schedule it accepts simulates to completion; one it
    # rejects raises ScheduleError with a marked table, never another exception.
    p, m = pm
    s = make(kind, p, m)
    rng = random.Random(seed)
    rank = rng.randrange(p)
    acts = list(s.actions[rank])
    i, j = rng.randrange(len(acts)), rng.randrange(len(acts))
    acts[i], acts[j] = acts[j], acts[i]
    mutated = Schedule(s.actions[:rank] + (tuple(acts),) + s.actions[rank + 1:], p, m)
    if find_faults(mutated):
        with pytest.raises(ScheduleError, match="# <-- rank"):
            simulate(mutated, [1.0] * p, [1.0] * p)
    else:
        assert len(simulate(mutated, [1.0] * p, [1.0] * p).events) == 2 * p * m


# -- several stages per rank ---------------------------------------------------------------
looped_sizes = st.tuples(st.integers(1, 5), st.integers(1, 4), st.integers(1, 16)).filter(
    lambda t: stages_per_rank_ok(*t))


@SETTINGS
@given(pvm=looped_sizes)
def test_interleaved_is_valid_looped_and_round_trips(pvm):
    p, v, m = pvm
    schedule = make("interleaved-1f1b", p * v, m, num_ranks=p)  # make() validates: complete, no deadlock
    assert schedule.stage_to_rank == tuple(s % p for s in range(p * v))
    assert Schedule.from_text(schedule.to_text()) == schedule
    for rank in range(p):  # each rank runs its chunks' forwards in order of micro-batch
        fwd = [a for a in schedule.actions[rank] if a.kind == "F"]
        for s in schedule.stages_of(rank):
            assert [a.microbatch for a in fwd if a.stage == s] == list(range(m))


@SETTINGS
@given(pvm=looped_sizes.filter(lambda t: t[0] >= 2 and t[1] >= 2 and t[2] % t[0] == 0))
def test_interleaving_shrinks_the_bubble(pvm):
    """Balanced chunks of one model (a stage of 1F1B cut in ``v``): Megatron-LM's step
    ``(m + (p - 1) / v) (f + b)`` against 1F1B's ``(m + p - 1) (f + b)``."""
    p, v, m = pvm
    f, b = 1.0, 2.0
    looped = simulate(make("interleaved-1f1b", p * v, m, num_ranks=p), [f / v] * (p * v), [b / v] * (p * v))
    plain = simulate(make("1f1b", p, m), [f] * p, [b] * p)
    assert looped.makespan_s == pytest.approx((m + (p - 1) / v) * (f + b))
    assert plain.makespan_s == pytest.approx((m + p - 1) * (f + b))
    assert looped.makespan_s < plain.makespan_s


def test_interleaved_refuses_what_it_cannot_run():
    with pytest.raises(ScheduleError, match="multiple of the 4 ranks"):
        make("interleaved-1f1b", 6, 4, num_ranks=4)
    with pytest.raises(ScheduleError, match="multiple of max"):
        make("interleaved-1f1b", 8, 9, num_ranks=4)
    with pytest.raises(ScheduleError, match="runs one stage per rank"):
        make("1f1b", 8, 4, num_ranks=4)


# -- zero bubble: the backward split into I and W --------------------------------------------
zb_sizes = st.tuples(st.integers(1, 5), st.integers(1, 3), st.integers(1, 16)).filter(
    lambda t: t[1] == 1 or stages_per_rank_ok(*t))


@SETTINGS
@given(pvm=zb_sizes)
def test_zero_bubble_is_valid_and_holds_every_weight_half_until_after_its_input_half(pvm):
    """make() validates (each micro-batch's F, I and W on its stage's rank, no deadlock); W
    never comes before its I on a rank; one stage per rank holds min(m, p) micro-batches."""
    p, v, m = pvm
    kind = "zero-bubble" if v == 1 else "interleaved-zero-bubble"
    schedule = make(kind, p * v, m, num_ranks=p)
    assert Schedule.from_text(schedule.to_text()) == schedule
    for rank in range(p):
        order = [str(a) for a in schedule.actions[rank]]
        for s in schedule.stages_of(rank):
            for i in range(m):
                assert order.index(f"{s}I{i}") < order.index(f"{s}W{i}")
    if v == 1:
        assert peak_in_flight(schedule) == (min(m, p),) * p


@SETTINGS
@given(pm=st.tuples(st.integers(1, 6), st.integers(1, 12)), weight=st.floats(0.0, 2.0))
def test_zero_bubble_is_never_slower_than_1f1b_and_faster_when_weights_fill_its_bubble(pm, weight):
    """Balanced stages (F 1, B 2 of which ``weight`` computes weight gradients): deferring W
    into 1F1B's cool-down never lengthens the step, and shortens it as soon as there is a
    bubble (p >= 2) and weight work to fill it (Qi et al., ZB-H1)."""
    p, m = pm
    zb = simulate(make("zero-bubble", p, m), [1.0] * p, [2.0] * p, bwd_weight_s=[weight] * p).makespan_s
    plain = simulate(make("1f1b", p, m), [1.0] * p, [2.0] * p).makespan_s
    assert zb <= plain + 1e-9
    if p >= 2 and m >= 2 and weight > 1e-3:
        assert zb < plain - 1e-9


def test_a_backward_written_twice_or_half_missing_is_a_fault():
    both = Schedule.from_text("schedule bad: stages=1 microbatches=1 stage_to_rank=0\nstep rank0\n0 0F0\n1 0B0\n2 0I0\n3 0W0\n")
    assert any("both compute that backward" in f.message for f in find_faults(both))
    half = Schedule.from_text("schedule bad: stages=1 microbatches=1 stage_to_rank=0\nstep rank0\n0 0F0\n1 0I0\n")
    assert any("missing actions: 0W0" in f.message for f in find_faults(half))
    mixed = Schedule.from_text("schedule bad: stages=2 microbatches=1 stage_to_rank=0,1\nstep rank0 rank1\n"
                               "0 0F0 1F0\n1 0I0 1B0\n2 0W0 .\n")
    assert any("which no rank runs" in f.message for f in find_faults(mixed))
