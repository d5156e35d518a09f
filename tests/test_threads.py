"""The threaded executor: one worker per device; same results; errors stop every worker."""

from __future__ import annotations

import threading

import pytest
from pipeline_utils import Compiled, assert_same_training

import fxsplit.models as zoo
from fxsplit.errors import ConfigError, ExecutionError
from fxsplit.runtime.local import choose_executor
from fxsplit.runtime.threads import action_dependencies, run_threaded
from fxsplit.schedule import Action, make


@pytest.mark.parametrize("name", ["gpt", "unet", "dag"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_threaded_pipeline_trains_like_the_original(name, schedule):
    case = zoo.get(name, batch_size=4)
    compiled = Compiled(case, copy_tied=name == "gpt", executor="threads")
    pipe = compiled.pipeline(3, schedule, 4)
    assert pipe.executor == "threads"
    inputs, target = case.make_batch(4, 2)
    assert_same_training(pipe, compiled, inputs, target)


def test_threads_run_actions_only_after_their_dependencies():
    schedule = make("1f1b", 3, 4)
    done: list[str] = []
    lock = threading.Lock()

    def run(action: Action) -> None:
        for s, kind, i in action_dependencies(action, 3):
            assert f"{s}{kind}{i}" in done, f"{action} ran before {s}{kind}{i}"
        with lock:
            done.append(str(action))

    run_threaded(schedule, run, ["cpu"] * 3)
    assert sorted(done) == sorted(str(a) for acts in schedule.actions for a in acts)


def test_a_failing_worker_stops_every_worker_and_leaves_no_thread():
    schedule = make("gpipe", 3, 4)

    def run(action: Action) -> None:
        if str(action) == "1F2":
            raise RuntimeError("boom in 1F2")

    with pytest.raises(ExecutionError, match="failed on rank 1 on cpu: RuntimeError: boom in 1F2") as info:
        run_threaded(schedule, run, ["cpu"] * 3)
    assert not [t for t in threading.enumerate() if t.name.startswith("fxsplit-rank")]
    # the location is kept by the runner, not bolted onto the user's exception (issue 15)
    cause = info.value.__cause__
    assert isinstance(cause, RuntimeError) and str(cause) == "boom in 1F2"
    assert "fxsplit_where" not in vars(cause)


def test_stage_error_in_a_thread_keeps_stage_microbatch_and_device():
    case = zoo.get("gpt", batch_size=4)
    compiled = Compiled(case, executor="threads")
    pipe = compiled.pipeline(3, "1f1b", 2)
    pipe.stages[2].gm.forward = lambda *a: (_ for _ in ()).throw(ValueError("bad stage"))
    inputs, target = case.make_batch(4, 0)
    with pytest.raises(ExecutionError, match="stage 2 failed on micro-batch 0") as info:
        pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
    assert (info.value.stage, info.value.microbatch) == (2, 0)
    assert not [t for t in threading.enumerate() if t.name.startswith("fxsplit-rank")]


def test_executor_choice():
    assert choose_executor("auto", ["cpu", "cpu"]) == "sequential"
    assert choose_executor("auto", ["cpu", "cuda:1"]) == "threads"
    with pytest.raises(ConfigError, match="executor='fast'"):
        choose_executor("fast", ["cpu"])
