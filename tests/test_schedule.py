"""Unit and golden tests of fxsplit.schedule: actions, text, generators, validator, simulator.

Golden files live in tests/golden/schedule/ and are compared whole. To regenerate them after an
intended change, run with FXSPLIT_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fxsplit.errors import ScheduleError
from fxsplit.ir import CondensedGraph, DeviceSpec, Problem, evaluate
from fxsplit.ir.graph import Block, Edge
from fxsplit.schedule import (
    Action,
    Schedule,
    available,
    find_faults,
    gpipe,
    make,
    one_f_one_b,
    parse_actions,
    register,
    simulate,
    simulate_plan,
    validate,
)
from fxsplit.viz.text import render_gantt

GOLDEN = Path(__file__).parent / "golden" / "schedule"
CASES = [(kind, p, m) for kind in ("gpipe", "1f1b") for p, m in ((2, 4), (4, 8))]


def check_golden(name: str, text: str) -> None:
    """Compare ``text`` with the golden file ``name`` whole (regenerate with FXSPLIT_UPDATE_GOLDEN=1)."""
    path = GOLDEN / name
    if os.environ.get("FXSPLIT_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} differs from its golden file; see the diff above"


# -- actions and text ----------------------------------------------------------------------
@pytest.mark.parametrize("text", ["0F1", "2B0", "13F7", "0B12"])
def test_action_text_round_trip(text):
    assert str(Action.parse(text)) == text


def test_action_fields():
    assert Action.parse("3B12") == Action(stage=3, kind="B", microbatch=12)


@pytest.mark.parametrize("bad", ["", "F1", "0F", "0X1", "0f1", "-1F0", "0F1x"])
def test_action_parse_rejects(bad):
    with pytest.raises(ScheduleError):
        Action.parse(bad)


def test_action_rejects_negative_and_unknown_kind():
    with pytest.raises(ScheduleError, match="indices must be >= 0"):
        Action(-1, "F", 0)
    with pytest.raises(ScheduleError, match="unknown action kind"):
        Action(0, "Z", 0)


def test_parse_actions():
    assert parse_actions("0F0 0F1\n0B0") == (Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 0))


@pytest.mark.parametrize("kind,p,m", CASES)
def test_text_round_trip(kind, p, m):
    s = make(kind, p, m)
    assert Schedule.from_text(s.to_text()) == s


def test_text_round_trip_uneven_ranks_and_shared_rank():
    # Two stages on one rank (room for interleaved schedules), and ranks of unequal length.
    s = Schedule(((Action(0, "F", 0), Action(1, "F", 0), Action(1, "B", 0), Action(0, "B", 0)), ()),
                 num_stages=2, microbatches=1, stage_to_rank=(0, 0), name="custom")
    text = s.to_text()
    assert text == (
        "schedule custom: stages=2 microbatches=1 stage_to_rank=0,0\n"
        "step  rank0  rank1\n"
        "   0  0F0    .\n"
        "   1  1F0    .\n"
        "   2  1B0    .\n"
        "   3  0B0    .\n"
    )
    assert Schedule.from_text(text) == s
    validate(s)


def test_from_text_ignores_marks_and_comments():
    s = make("gpipe", 2, 2)
    assert Schedule.from_text("# a comment\n" + s.to_text({(1, 2): "note"})) == s


@pytest.mark.parametrize(
    "text,match",
    [
        ("nonsense\nstep rank0\n", "not a schedule header"),
        ("schedule x: stages=1 microbatches=1 stage_to_rank=0\nstep r0\n", "must read 'step rank0"),
        ("schedule x: stages=1 microbatches=1 stage_to_rank=0\nstep rank0\n   1  0F0\n", "expected step 0"),
        ("schedule x: stages=1 microbatches=1 stage_to_rank=0\nstep rank0\n0 .\n1 0F0\n", "after an empty"),
        ("schedule x: stages=2 microbatches=1 stage_to_rank=0\nstep rank0\n", "stage_to_rank has 1"),
        ("schedule x: stages=1 microbatches=1 stage_to_rank=1\nstep rank0\n", "outside 0..0"),
    ],
)
def test_from_text_errors(text, match):
    with pytest.raises(ScheduleError, match=match):
        Schedule.from_text(text)


# -- generators and registry ---------------------------------------------------------------
@pytest.mark.parametrize("kind,p,m", CASES)
def test_golden_tables(kind, p, m):
    check_golden(f"{kind}_p{p}_m{m}.txt", make(kind, p, m).to_text())


@pytest.mark.parametrize("kind,p,m", CASES)
def test_golden_gantt(kind, p, m):
    tl = simulate(make(kind, p, m), fwd_s=[1.0] * p, bwd_s=[2.0] * p)
    check_golden(f"{kind}_p{p}_m{m}.gantt.txt", render_gantt(tl, width=int(2 * tl.makespan_s)))


def test_registry():
    assert {"gpipe", "1f1b"} <= set(available())
    assert make("gpipe", 3, 2) == gpipe(3, 2)
    assert make("1f1b", 3, 2) == one_f_one_b(3, 2)
    with pytest.raises(ScheduleError, match="already registered"):
        register("gpipe")(gpipe)
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'; choose one of 1f1b, gpipe"):
        make("zb", 2, 2)


@pytest.mark.parametrize("p,m", [(0, 1), (1, 0), (-1, 3)])
def test_generators_reject_bad_sizes(p, m):
    for gen in (gpipe, one_f_one_b):
        with pytest.raises(ScheduleError, match="num_stages >= 1"):
            gen(p, m)


def test_one_f_one_b_few_microbatches_is_gpipe_like():
    # m <= p - s - 1: the warm-up covers every micro-batch, the cool-down every backward.
    assert one_f_one_b(4, 2).actions[0] == gpipe(4, 2).actions[0]


# -- validator -----------------------------------------------------------------------------
def _custom(rows: list[str], p: int, m: int) -> Schedule:
    return Schedule(tuple(parse_actions(r) for r in rows), p, m)


def test_validate_accepts_generated():
    for kind, p, m in CASES:
        assert validate(make(kind, p, m)).num_stages == p


def test_validate_missing_and_duplicate():
    s = _custom(["0F0 0F0 0B0", "1F0"], 2, 1)
    with pytest.raises(ScheduleError) as info:
        validate(s)
    msg = str(info.value)
    assert "0F0 appears twice (first at rank 0 step 0)" in msg
    assert "missing actions: 1B0" in msg
    assert "   1  0F0    .    # <-- rank 0: 0F0 appears twice" in msg
    assert "fix:" in msg


def test_validate_wrong_rank_and_range():
    s = _custom(["0F0 1F0 0B0 1B0", ""], 2, 1)
    msgs = [f.message for f in find_faults(s)]
    assert "1F0 is on rank 0 but stage 1 runs on rank 1" in msgs
    s = _custom(["0F0 0B0 0F1 0B1"], 1, 1)
    assert any("0F1 is out of range" in f.message for f in find_faults(s))


def test_validate_backward_before_forward():
    s = _custom(["0B0 0F0"], 1, 1)
    with pytest.raises(ScheduleError, match="0B0 comes before its forward 0F0"):
        validate(s)


def test_validate_backward_before_forward_is_marked():
    s = _custom(["0F0 0F1 0B1 0B0", "1F0 1B1 1F1 1B0"], 2, 2)
    with pytest.raises(ScheduleError) as info:
        validate(s)
    assert "   1  0F1    1B1    # <-- rank 1: 1B1 comes before its forward 1F1" in str(info.value)


def test_validate_deadlock_marks_blocked_steps():
    # Rank 0 runs the backward of micro-batch 0 before the forward of micro-batch 1, while rank 1
    # wants micro-batch 1 first: each waits for the other.
    s = _custom(["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"], 2, 2)
    with pytest.raises(ScheduleError) as info:
        validate(s)
    msg = str(info.value)
    expected_table = (
        "schedule custom: stages=2 microbatches=2 stage_to_rank=0,1\n"
        "step  rank0  rank1\n"
        "   0  0F0    1F1    # <-- rank 1: deadlock: 1F1 waits for 0F1 (rank 0 step 2), "
        "which rank 0 never reaches: it is stuck at step 1 (0B0)\n"
        "   1  0B0    1B1    # <-- rank 0: deadlock: 0B0 waits for 1B0 (rank 1 step 3), "
        "which rank 1 never reaches: it is stuck at step 0 (1F1)\n"
        "   2  0F1    1F0\n"
        "   3  0B1    1B0\n"
    )
    assert expected_table in msg
    assert msg.startswith("schedule 'custom' (2 stages, 2 micro-batches, 2 ranks) is invalid: 2 fault(s)")
    # The marked table in the message is still a parseable schedule.
    assert Schedule.from_text(expected_table) == s


# -- simulator -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 4), (4, 8), (3, 2), (5, 3)])
def test_simulate_closed_form_balanced(kind, p, m):
    f, b = 0.7, 1.9
    tl = simulate(make(kind, p, m), [f] * p, [b] * p)
    assert tl.makespan_s == pytest.approx(p * (f + b) + (m - 1) * (f + b))
    assert tl.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert len(tl.events) == 2 * p * m


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 2), (6, 12)])
def test_peak_in_flight(p, m):
    assert simulate(make("gpipe", p, m), [1.0] * p, [1.0] * p).peak_in_flight == (m,) * p
    tl = simulate(make("1f1b", p, m), [1.0] * p, [1.0] * p, activation_bytes=[10] * p)
    assert tl.peak_in_flight == tuple(min(m, p - s) for s in range(p))
    assert tl.peak_activation_bytes == tuple(10 * min(m, p - s) for s in range(p))


def test_simulate_unbalanced_forward_backward_exceeds_formula():
    # Stage 0 is all forward, stage 1 all backward: the fill-drain formula says 10 + 10 + 3 * 10,
    # but in GPipe stage 1's backwards cannot start before every forward has passed stage 0.
    tl = simulate(make("gpipe", 2, 4), fwd_s=[10.0, 0.0], bwd_s=[0.0, 10.0])
    assert tl.makespan_s == pytest.approx(80.0)
    assert simulate(make("1f1b", 2, 4), [10.0, 0.0], [0.0, 10.0]).makespan_s == pytest.approx(50.0)


def test_simulate_link_delay():
    # The critical path crosses p - 1 boundaries forward and p - 1 back, each adding the delay;
    # the delay is link time, not busy time.
    p, m, d = 3, 4, 0.5
    tl = simulate(make("gpipe", p, m), [1.0] * p, [1.0] * p, comm_s=d)
    assert tl.makespan_s == pytest.approx((m + p - 1) * 2.0 + 2 * (p - 1) * d)
    assert tl.busy_s == (8.0, 8.0, 8.0)
    same = simulate(make("gpipe", p, m), [1.0] * p, [1.0] * p, comm_s=[d, d])
    assert same.makespan_s == tl.makespan_s


def test_simulate_stage_comm_is_busy_time():
    tl = simulate(make("1f1b", 2, 3), [1.0, 1.0], [1.0, 1.0], stage_comm_s=[0.5, 0.5])
    assert tl.makespan_s == pytest.approx(4 * 2.5)
    assert all(e.duration_s == pytest.approx(1.25) for e in tl.events)


def test_simulate_events_respect_order_and_dependencies():
    delay = [0.1, 0.2]
    tl = simulate(make("1f1b", 3, 5), [1.0, 2.0, 1.5], [2.0, 1.0, 3.0], comm_s=delay)
    ends = {e.action: e.end_s for e in tl.events}
    eps = 1e-12
    for e in tl.events:
        s, i = e.action.stage, e.action.microbatch
        if e.action.kind == "F" and s > 0:
            assert e.start_s >= ends[Action(s - 1, "F", i)] + delay[s - 1] - eps
        if e.action.kind == "B":
            assert e.start_s >= ends[Action(s, "F", i)] - eps
            if s < 2:
                assert e.start_s >= ends[Action(s + 1, "B", i)] + delay[s] - eps
    last_end: dict[int, float] = {}
    for e in tl.events:  # sorted by (rank, start): each rank runs one action at a time
        assert e.start_s >= last_end.get(e.rank, 0.0) - eps
        last_end[e.rank] = e.end_s


def test_gantt_hides_numbers_that_do_not_fit():
    tl = simulate(make("1f1b", 2, 12), [1.0, 1.0], [1.0, 1.0])
    chart = render_gantt(tl, width=int(tl.makespan_s))  # one column per action: kinds only
    assert chart.splitlines()[0] == "rank0 |FF.BFBFBFBFBFBFBFBFBFBFB.B|"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"fwd_s": [1.0]}, "fwd_s has 1 entries; expected 2"),
        ({"bwd_s": [1.0, -1.0]}, "negative or NaN"),
        ({"comm_s": [1.0, 1.0]}, "comm_s has 2 entries; expected 1"),
        ({"activation_bytes": [1]}, "activation_bytes has 1 entries"),
        ({"stage_comm_s": [0.0]}, "stage_comm_s has 1"),
    ],
)
def test_simulate_rejects_bad_costs(kwargs, match):
    args = {"fwd_s": [1.0, 1.0], "bwd_s": [1.0, 1.0], **kwargs}
    with pytest.raises(ScheduleError, match=match):
        simulate(make("gpipe", 2, 2), **args)


def test_simulate_rejects_invalid_schedule():
    with pytest.raises(ScheduleError, match="missing actions"):
        simulate(_custom(["0F0"], 1, 1), [1.0], [1.0])


def _balanced_problem(p: int, m: int, schedule: str) -> Problem:
    blocks = tuple(Block(i, f"b{i}", fwd_s=1.0, bwd_s=2.0, activation_bytes=100) for i in range(p))
    edges = tuple(Edge(i, i + 1, 1000) for i in range(p - 1))
    devices = tuple(DeviceSpec(f"d{i}") for i in range(p))
    return Problem(CondensedGraph(blocks, edges), devices, microbatches=m, schedule=schedule)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_simulate_plan_matches_cost_model_when_balanced(kind):
    # Interior stages pay comm on both sides, end stages on one: balance by giving p = 2.
    pb = _balanced_problem(2, 6, kind)
    plan = evaluate(pb, [[0], [1]])
    tl = simulate_plan(plan)
    assert tl.makespan_s == pytest.approx(plan.makespan_s)
    assert simulate_plan(plan, kind, 6) == tl
    inference = simulate_plan(plan, kind, 6, training=False)
    assert inference.makespan_s < tl.makespan_s


def test_simulate_plan_rejects_empty_plan():
    from fxsplit.ir import Plan

    with pytest.raises(ScheduleError, match="no stages"):
        simulate_plan(Plan(stages=()))


def test_schedule_package_never_imports_torch():
    code = "import sys, fxsplit.schedule; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
