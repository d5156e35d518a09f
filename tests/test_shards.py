"""Shard parallelism (Hydra): the torch-free scheduler, simulator and bound, and the sharding solver.

The runtime and ``train_many`` (same parameters and optimizer state as training alone) are in
``tests/test_train_many.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import condensed_graphs

from fxsplit.errors import ConfigError, InfeasibleError
from fxsplit.ir import DeviceSpec, Problem
from fxsplit.schedule.shards import (
    POLICIES,
    ShardDispatcher,
    ShardTask,
    makespan_lower_bound,
    simulate_shards,
    task_units,
)
from fxsplit.solvers import solve
from fxsplit.solvers.shards import _shard_problem, fewest_shards
from fxsplit.viz.text import render_shard_gantt

MiB = 2**20


@st.composite
def shard_tasks(draw: st.DrawFn, max_tasks: int = 5, max_shards: int = 4) -> list[ShardTask]:
    tasks = []
    for j in range(draw(st.integers(1, max_tasks))):
        shards = draw(st.integers(1, max_shards))
        fwd = tuple(draw(st.integers(0, 6)) * 0.5 for _ in range(shards))
        bwd = tuple(draw(st.integers(0, 6)) * 0.5 for _ in range(shards))
        tasks.append(ShardTask(f"t{j}", fwd, bwd, steps=draw(st.integers(1, 3))))
    return tasks


def test_units_of_one_step_follow_the_chain_forward_then_backward() -> None:
    units = task_units([1.0, 2.0, 3.0], [10.0, 20.0, 30.0], steps=2, shard_step_s=[0.1, 0.2, 0.3])
    assert [str(u) for u in units] == ["F0", "F1", "L2", "B1", "B0"] * 2
    assert [u.step for u in units] == [0] * 5 + [1] * 5
    # a backward unit runs its shard's backward and optimizer step; the last shard all of it
    assert [round(u.est_s, 6) for u in units[:5]] == [1.0, 2.0, 33.3, 20.2, 10.1]
    # recomputing, the backward runs the shard's forward again first
    again = task_units([1.0, 2.0, 3.0], [10.0, 20.0, 30.0], steps=1, shard_step_s=[0.1, 0.2, 0.3], recompute=True)
    assert [round(u.est_s, 6) for u in again] == [1.0, 2.0, 33.3, 22.2, 11.1]


@pytest.mark.parametrize("fwd, bwd, steps, step_s", [
    ([], [], 1, ()), ([1.0], [1.0, 2.0], 1, ()), ([-1.0], [1.0], 1, ()), ([1.0], [1.0], 0, ()),
    ([1.0], [1.0], 1, (0.1, 0.2)),
])
def test_bad_shard_times_are_refused(fwd: list[float], bwd: list[float], steps: int, step_s: tuple) -> None:
    with pytest.raises(ConfigError):
        task_units(fwd, bwd, steps, step_s)


@settings(max_examples=300, deadline=None)
@given(tasks=shard_tasks(), devices=st.integers(1, 4), policy=st.sampled_from(POLICIES),
       prefetch=st.booleans())
def test_simulated_schedule_is_valid_and_between_the_bounds(tasks: list[ShardTask], devices: int, policy: str,
                                                            prefetch: bool) -> None:
    run = simulate_shards(tasks, devices, policy, prefetch=prefetch)
    # every unit of every task runs exactly once, in its task's order, never two at once
    for j, task in enumerate(tasks):
        mine = sorted((e for e in run.events if e.task == j), key=lambda e: e.start_s)
        assert [e.unit for e in mine] == list(task.units)
        for a, b in zip(mine, mine[1:], strict=False):
            assert b.start_s >= a.end_s - 1e-9
    for d in range(devices):
        mine = sorted((e for e in run.events if e.device == d), key=lambda e: e.start_s)
        for a, b in zip(mine, mine[1:], strict=False):
            assert b.start_s >= a.end_s - 1e-9
    bound = makespan_lower_bound(tasks, devices)
    work = sum(t.total_s for t in tasks)
    assert run.makespan_s >= bound - 1e-9
    # list scheduling of chains (Graham): never idle while a unit is ready, so within W/m + L
    assert run.makespan_s <= work / devices + max(t.total_s for t in tasks) + 1e-9
    assert all(0.0 <= u <= 1.0 + 1e-9 for u in run.utilisation())


def test_one_device_runs_all_work_back_to_back() -> None:
    tasks = [ShardTask("a", (1.0, 2.0), (2.0, 4.0), steps=2), ShardTask("b", (1.0,), (1.0,), steps=3)]
    for policy in POLICIES:
        assert simulate_shards(tasks, 1, policy).makespan_s == pytest.approx(sum(t.total_s for t in tasks))


def test_lrtf_starts_the_longest_model_and_fifo_the_first() -> None:
    short, long = ShardTask("short", (1.0,), (1.0,)), ShardTask("long", (5.0,), (5.0,))
    assert ShardDispatcher([short, long], "lrtf").pick() == 1
    assert ShardDispatcher([short, long], "fifo").pick() == 0


def test_round_robin_takes_turns() -> None:
    tasks = [ShardTask(n, (1.0, 1.0), (1.0, 1.0)) for n in "abc"]
    dispatch = ShardDispatcher(tasks, "round-robin")
    order = []
    for _ in range(6):
        j = dispatch.pick()
        assert j is not None
        dispatch.start(j)
        dispatch.finish(j)
        order.append(j)
    assert order == [0, 1, 2, 0, 1, 2]


def test_lrtf_beats_fifo_when_the_long_model_comes_last() -> None:
    """Three short models and a long one on 2 devices: FIFO leaves the long model to the end;
    Sharded-LRTF starts it first and meets the lower bound."""
    tasks = [ShardTask(f"s{j}", (1.0,), (1.0,)) for j in range(3)] + [ShardTask("long", (1.0,) * 3, (2.0,) * 3)]
    bound = makespan_lower_bound(tasks, 2)
    lrtf, fifo = simulate_shards(tasks, 2, "lrtf"), simulate_shards(tasks, 2, "fifo")
    assert lrtf.makespan_s == pytest.approx(bound)
    assert fifo.makespan_s > lrtf.makespan_s


def test_measured_times_change_what_lrtf_picks() -> None:
    a, b = ShardTask("a", (1.0, 1.0), (1.0, 1.0), steps=2), ShardTask("b", (1.5, 1.5), (1.0, 1.0), steps=2)
    dispatch = ShardDispatcher([a, b], "lrtf")
    assert dispatch.pick() == 1
    dispatch.start(0)
    dispatch.finish(0, measured_s=10.0)  # a's forward of shard 0 is much slower than estimated
    assert dispatch.remaining_s(0) == pytest.approx(10.0 + a.total_s - 2 * 1.0)
    assert dispatch.pick() == 0


def test_prefetch_hides_loads_behind_the_previous_unit() -> None:
    tasks = [ShardTask("a", (2.0, 2.0), (2.0, 2.0), load_s=(1.0, 1.0))]
    assert simulate_shards(tasks, 1, prefetch=True).makespan_s < simulate_shards(tasks, 1, prefetch=False).makespan_s


def test_dispatcher_refuses_bad_use() -> None:
    with pytest.raises(ConfigError, match="scheduler"):
        ShardDispatcher([ShardTask("a", (1.0,), (1.0,))], "sjf")
    with pytest.raises(ConfigError, match="no tasks"):
        ShardDispatcher([], "lrtf")
    with pytest.raises(ConfigError, match="num_devices"):
        simulate_shards([ShardTask("a", (1.0,), (1.0,))], 0)


def test_gantt_draws_a_row_per_device_and_a_legend() -> None:
    tasks = [ShardTask("a", (1.0,), (1.0,)), ShardTask("b", (1.0,), (3.0,))]
    text = render_shard_gantt(simulate_shards(tasks, 2), ["a", "b"], width=8)
    assert text.splitlines()[0] == "dev0 |BBBBBBBB|"
    assert text.splitlines()[1] == "dev1 |AAAA....|"
    assert "a=a  b=b" in text


# -- the fewest shards that fit -------------------------------------------------------------------
def _fits(problem: Problem, k: int) -> bool:
    try:
        solve(_shard_problem(problem, k), "dp")
        return True
    except InfeasibleError:
        return False


@settings(max_examples=60, deadline=None)
@given(graph=condensed_graphs(max_blocks=7), memory_mib=st.integers(4, 200))
def test_fewest_shards_is_the_smallest_count_that_fits(graph: object, memory_mib: int) -> None:
    problem = Problem(graph, (DeviceSpec("d", peak_flops=1e12, memory_bytes=memory_mib * MiB),))  # type: ignore[arg-type]
    smallest = next((k for k in range(1, len(problem.graph) + 1) if _fits(problem, k)), None)
    if smallest is None:
        with pytest.raises(InfeasibleError):
            fewest_shards(problem)
        return
    plan = fewest_shards(problem)
    assert plan.num_stages == smallest
    assert all(st.memory_bytes <= memory_mib * MiB for st in plan.stages)
