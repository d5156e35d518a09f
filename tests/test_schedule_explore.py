"""Tests of fxsplit.schedule.explore: schedule and micro-batch choice under memory limits."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import condensed_graphs

from fxsplit.errors import ConfigError, InfeasibleError
from fxsplit.ir import CondensedGraph, DeviceSpec, GiB, LinkSpec, Problem
from fxsplit.ir.graph import Block, Edge
from fxsplit.schedule import default_microbatches, explore
from fxsplit.schedule.explore import Candidate, pareto_front


def two_stage_problem(memory_gib: float, latency_s: float = 0.0, edge_bytes: int = 0) -> Problem:
    """Two blocks of 4 s forward / 8 s backward and 8 GiB of activations (whole batch) each."""
    blocks = tuple(
        Block(i, f"b{i}", fwd_s=4.0, bwd_s=8.0, activation_bytes=8 * GiB) for i in range(2)
    )
    devices = tuple(DeviceSpec(f"d{i}", memory_bytes=int(memory_gib * GiB)) for i in range(2))
    return Problem(
        CondensedGraph(blocks, (Edge(0, 1, edge_bytes),)),
        devices,
        link=LinkSpec(bytes_per_s=1e30, latency_s=latency_s),
    )


def test_ample_memory_picks_most_microbatches_and_1f1b_on_ties():
    # Step = (m + 1) * 12 / m: m=8 gives 13.5 s for both schedules; 1F1B wins the tie on memory.
    choice = explore(two_stage_problem(64), [[0], [1]], batch_size=8)
    assert (choice.kind, choice.microbatches) == ("1f1b", 8)
    assert choice.step_time_s == pytest.approx(13.5)
    assert choice.timeline.makespan_s == choice.step_time_s
    assert len(choice.table_of_candidates) == 2 * 4
    assert choice.reason.startswith("1f1b m=8: 13.5 s per step (bubble 11%), the fastest of 8 of 8")
    # Balanced stages without link delay: the simulation equals the closed form.
    for c in choice.table_of_candidates:
        assert c.step_time_s == pytest.approx(c.closed_form_s)


def test_memory_limit_excludes_gpipe_and_few_microbatches():
    # GPipe holds 8 GiB per stage for every m; 1F1B stage 0 holds 8/m * min(m, 2) GiB.
    choice = explore(two_stage_problem(6), [[0], [1]], batch_size=8, microbatch_candidates=[1, 2, 4, 8])
    fits = {(c.schedule, c.microbatches) for c in choice.table_of_candidates if c.fits}
    assert fits == {("1f1b", 4), ("1f1b", 8)}
    assert (choice.kind, choice.microbatches) == ("1f1b", 8)
    assert choice.reason.endswith("runner-up: 1f1b m=4: 15 s")
    assert choice.timeline.peak_activation_bytes == (2 * GiB, 1 * GiB)
    assert choice.plan.stages[0].memory_bytes == 2 * GiB


def test_latency_makes_middle_count_fastest_and_reason_names_faster_oom():
    # Per micro-batch each stage pays 2 * 1 s of link latency: step = (m + 1) * (12 / m + 2):
    # m=1: 28, m=2: 24, m=4: 25, m=8: 31.5. m=2 is fastest but needs 8 GiB (stage 1 also holds its input bytes).
    pb = two_stage_problem(6, latency_s=1.0, edge_bytes=8)
    choice = explore(pb, [[0], [1]], batch_size=8)
    assert (choice.kind, choice.microbatches) == ("1f1b", 4)
    assert choice.step_time_s == pytest.approx(25.0)
    assert "faster but out of memory: gpipe m=2: 24 s needs 8.0 GiB on stage 1 (d1 has 6.0 GiB)" in choice.reason
    table = choice.format_table()
    assert "* 1f1b" in table and table.count("*") == 1


def test_simulated_in_flight_matches_cost_model():
    pb = two_stage_problem(64)
    choice = explore(pb, [[0], [1]], batch_size=6)
    p = 2
    kind_pb = pb.with_(microbatches=choice.microbatches, schedule=choice.kind)
    assert choice.timeline.peak_in_flight == tuple(kind_pb.in_flight(s, p) for s in range(p))


def test_nothing_fits_raises_with_numbers_and_fix():
    with pytest.raises(InfeasibleError) as info:
        explore(two_stage_problem(0.5), [[0], [1]], batch_size=8)
    msg = str(info.value)
    assert "the closest, 1f1b with m=8, needs 2.0 GiB on stage 0 (d0 has 0.5 GiB)" in msg
    assert "Fix:" in msg and "at least 2.0 GiB" in msg


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"batch_size": 0}, "batch_size=0"),
        ({"batch_size": 4, "microbatch_candidates": [8]}, r"\[8\] must lie in 1..batch_size=4"),
        ({"batch_size": 4, "microbatch_candidates": []}, "must lie in"),
        ({"batch_size": 4, "schedules": ()}, "schedules is empty"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        explore(two_stage_problem(64), [[0], [1]], **kwargs)


def test_uneven_microbatch_is_costed_at_its_largest_part():
    # batch 8 in 3 micro-batches: the largest has 3 samples, so each costs 3/8 of the batch.
    choice = explore(two_stage_problem(64), [[0], [1]], batch_size=8, microbatch_candidates=[3],
                     schedules=("gpipe",))
    assert choice.step_time_s == pytest.approx(4 * 12 * 3 / 8)


def test_default_microbatches():
    assert default_microbatches(1) == (1,)
    assert default_microbatches(12) == (1, 2, 3, 4, 6, 12)
    assert max(default_microbatches(2**12)) == 256


def test_recomputation_joins_the_search_and_draws_the_memory_front():
    """Issue 13 item 3: under recompute="auto" each (schedule, m) is costed with the stages that
    must recompute recomputing, and once with every stage recomputing (the memory-lean end); the
    choice is the fastest that fits, and the table marks the step-time / peak-memory front."""
    # 6 GiB devices: GPipe keeps 8 GiB of activations per stage at any m, so it fits only by
    # recomputing (inputs in flight and one micro-batch's activations: 8/m GiB)
    problem = two_stage_problem(6).with_(recompute="auto")
    choice = explore(problem, [[0], [1]], batch_size=8, microbatch_candidates=[1, 2, 4, 8])
    rows = {c.key: c for c in choice.table_of_candidates}
    assert len(rows) == 2 * 4 * 2
    gpipe = rows[("gpipe", 8, "auto")]
    assert gpipe.fits and gpipe.recompute_stages == 2 and gpipe.step_time_s > rows[("1f1b", 8, "auto")].step_time_s
    assert rows[("1f1b", 8, "auto")].recompute_stages == 0  # 1F1B fits as it is: nothing recomputes
    assert choice.key == ("1f1b", 8, "auto")  # never an "all" row: those only show the trade-off
    for (kind, m, mode), c in rows.items():
        if mode == "all":
            keep = rows[(kind, m, "auto")]
            assert max(c.memory_bytes) <= max(keep.memory_bytes) and c.step_time_s >= keep.step_time_s
    front = choice.pareto()
    assert front[0] == choice.chosen
    assert all(max(a.memory_bytes) > max(b.memory_bytes) and a.step_time_s <= b.step_time_s
               for a, b in itertools.pairwise(front))
    text = choice.format_table()
    assert "* 1f1b" in text and "+ " in text and "2 (auto)" in text


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 10.0), st.integers(1, 100), st.booleans()), min_size=1, max_size=12))
def test_the_front_is_exactly_the_undominated_fitting_candidates(points):
    table = [Candidate("1f1b", i + 1, t, t, 0.0, (mem,), (100 if fits else mem - 1,), ("d",))
             for i, (t, mem, fits) in enumerate(points)]
    front = pareto_front(table)
    fitting = [c for c in table if c.fits]

    def dominated(c):
        return any((o.step_time_s <= c.step_time_s and max(o.memory_bytes) < max(c.memory_bytes))
                   or (o.step_time_s < c.step_time_s and max(o.memory_bytes) <= max(c.memory_bytes))
                   for o in fitting)

    assert all(c.fits and not dominated(c) for c in front)
    assert all(dominated(c) or any(f.step_time_s <= c.step_time_s and max(f.memory_bytes) <= max(c.memory_bytes)
                                   for f in front) for c in fitting)



@settings(max_examples=25, deadline=None)
@given(condensed_graphs(min_blocks=4, max_blocks=9), st.sampled_from([2, 3]), st.sampled_from([4, 8]))
def test_the_searched_plan_is_the_exact_optimum_of_the_schedule_it_picked(graph, k, batch):
    # The search explores on fast splits along the block order; the winner is then solved
    # exactly: its plan equals the DP's optimum for that schedule and micro-batch count.
    from fxsplit.compiler import per_microbatch, plan_pipeline
    from fxsplit.options import CompileOptions
    from fxsplit.solvers import solve

    pb = Problem(graph, tuple(DeviceSpec(f"d{i}") for i in range(k)),
                 link=LinkSpec(bytes_per_s=2**20, latency_s=0.01), objective="makespan")
    choice = plan_pipeline(pb, batch, "auto", "auto", "dp", CompileOptions())
    best = solve(per_microbatch(choice.problem, choice.microbatches, choice.schedule), "dp")
    assert choice.plan.status == "optimal"
    assert choice.plan.objective_s == pytest.approx(best.objective_s, rel=1e-9)
