"""The runtime trace: one Chrome trace event per schedule action of the latest train_step."""

from __future__ import annotations

import json

import pytest
from pipeline_utils import Compiled

import fxsplit.models as zoo
from fxsplit.errors import ConfigError
from fxsplit.runtime.trace import TraceRecorder, load_chrome_trace, span


@pytest.fixture(scope="module")
def trained() -> object:
    compiled = Compiled(zoo.get("mlp", batch_size=4))
    pipe = compiled.pipeline(2, "1f1b", 4)
    inputs, target = compiled.case.make_batch(4, seed=0)
    for _ in range(2):  # the recorder keeps the latest step only
        pipe.train_step(*inputs, target=target, loss_fn=compiled.case.loss_fn)
    return pipe


def test_chrome_trace_has_one_event_per_action(trained, tmp_path) -> None:
    path = trained.trace(tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    expected = sorted(str(a) for _, _, a in trained.schedule)
    assert sorted(e["name"] for e in events) == expected
    for e in events:
        assert e["dur"] >= 0 and e["ts"] >= 0
        assert e["tid"] == e["args"]["stage"] == int(e["name"][0])
        assert e["cat"] == ("forward" if e["args"]["kind"] == "F" else "backward")
    rows = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert rows == {0: "stage 0 (cpu)", 1: "stage 1 (cpu)"}
    assert [e.name for e in load_chrome_trace(path)] == [e["name"] for e in events]


def test_recorder_keeps_the_latest_step() -> None:
    rec = TraceRecorder()
    for _ in range(2):
        for stage, kind in ((0, "F"), (1, "F"), (1, "B"), (0, "B")):
            with span(rec, stage, kind, 0):
                pass
    assert [e.name for e in rec.events] == ["0F0", "1F0", "1B0", "0B0"]
    assert rec.events[0].start_s == 0.0
    assert all(b.start_s >= a.start_s for a, b in zip(rec.events, rec.events[1:], strict=False))
    assert rec.per_stage_s(2)[1].keys() == {"fwd_s", "bwd_s", "bwd_weight_s", "loss_s"}


def test_span_without_recorder_is_a_no_op() -> None:
    ran = []
    with span(None, 0, "F", 0):
        ran.append(True)
    assert ran == [True]  # the body runs and nothing is recorded anywhere (no recorder to write to)


def test_trace_before_any_step_says_what_to_do(tmp_path) -> None:
    with pytest.raises(ConfigError, match="train_step"):
        TraceRecorder().write(tmp_path / "t.json")


def test_a_rank_recorder_steps_only_at_begin() -> None:
    """One rank of a distributed pipeline records its own stage only; a step starts at begin()
    (with auto_step, 0F0 would start one and a later stage's recorder would never reset)."""
    rec = TraceRecorder(auto_step=False)
    for t0 in (10.0, 20.0):
        rec.begin(t0)
        rec.add(0, "F", 0, t0 + 1.0, t0 + 1.5)
        rec.add(0, "F", 1, t0 + 2.0, t0 + 2.25)
    assert [(e.name, e.start_s, e.duration_s) for e in rec.events] == [("0F0", 1.0, 0.5), ("0F1", 2.0, 0.25)]
    copy = TraceRecorder.from_events(rec.events)
    assert copy.events == rec.events
    assert copy.per_stage_s(1) == [{"fwd_s": 0.375, "bwd_s": 0.0, "bwd_weight_s": 0.0, "loss_s": 0.0}]


def test_a_loss_recorded_apart_counts_in_the_forward_and_alone() -> None:
    """Across processes torch's runtime computes the loss outside the last stage's forward; the
    recorder keeps it as ``L`` and reports the stage's forward with it (as the local pipeline's
    forward includes it) and the loss alone, and the Chrome trace files it as a loss."""
    rec = TraceRecorder(auto_step=False)
    rec.begin(0.0)
    for i in range(2):
        rec.add(1, "F", i, 1.0 + i, 1.5 + i)
        rec.add(1, "L", i, 1.5 + i, 1.5 + 0.125 * (i + 1) + i)
    assert rec.per_stage_s(2)[1] == {"fwd_s": 0.6875, "bwd_s": 0.0, "bwd_weight_s": 0.0, "loss_s": 0.1875}
    assert rec.per_stage_s(2)[0]["loss_s"] == 0.0
    cats = {e["name"]: e["cat"] for e in rec.to_chrome()["traceEvents"] if e.get("ph") == "X"}
    assert cats == {"1F0": "forward", "1L0": "loss", "1F1": "forward", "1L1": "loss"}
