"""The runtime-overhead probes (fxsplit.runtime.overhead) and how compile uses them: a pipeline
of trivial stages run for real, its actions read from the runtime's trace."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.api import CompileOptions
from fxsplit.errors import ConfigError
from fxsplit.ir import LinkSpec
from fxsplit.overhead import probe_action_overhead
from fxsplit.runtime.overhead import RuntimeOverhead, with_overhead


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU()), torch.randn(4, 8)


def test_local_probe_is_small_positive_memoised_and_leaves_the_random_stream_alone() -> None:
    state = torch.get_rng_state()
    found = probe_action_overhead.__wrapped__("cpu", "sequential", 5)  # a fresh measurement
    assert torch.equal(torch.get_rng_state(), state)  # the probe's model and batch drew nothing of the caller's
    # a handful of Python calls per action: above zero, far below a millisecond on any CPU here
    assert 0.0 < found.forward_s < 5e-3 and 0.0 < found.backward_s < 5e-3
    assert found.action_s == pytest.approx((found.forward_s + found.backward_s) / 2)
    assert found.message_s == 0.0
    assert probe_action_overhead("cpu") is probe_action_overhead("cpu")


def test_probe_checks_its_arguments() -> None:
    with pytest.raises(ConfigError, match="at least one timed step"):
        probe_action_overhead.__wrapped__("cpu", "sequential", 0)
    with pytest.raises(ConfigError, match="unknown device"):
        probe_action_overhead.__wrapped__("nonsense", "sequential", 1)


def test_compile_charges_the_probed_overhead_only_with_timed_costs() -> None:
    model, x = _model()
    probed = fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, cost_model="profiled",
                             options=CompileOptions(allow_idle_devices=False, profile_cache_dir=False))
    assert probed.context.problem.action_overhead_s == probe_action_overhead("cpu", "sequential").action_s > 0
    model, x = _model()
    analytic = fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, cost_model="analytic")
    assert analytic.context.problem.action_overhead_s == 0.0
    model, x = _model()
    given = fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, cost_model="analytic",
                            options=CompileOptions(allow_idle_devices=False, action_overhead_s=0.01))
    assert given.context.problem.action_overhead_s == 0.01
    # every stage pays it on both actions: the plan's times are at least that
    assert all(st.fwd_s >= 0.01 and st.bwd_s >= 0.01 for st in given.plan.stages)


@pytest.mark.parametrize("cost_model", ["analytic", "profiled"])
def test_compile_leaves_the_callers_random_stream_alone(cost_model: str) -> None:
    """Regression: fxsplit.compile advanced the global random stream (its checks and timings
    draw), so a seeded script drew other batches after compiling than without it."""
    model, x = _model()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, cost_model=cost_model,
                    options=CompileOptions(profile_cache_dir=False))
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "sometimes", True])
def test_a_bad_option_is_a_config_error(bad: object) -> None:
    model, x = _model()
    with pytest.raises(ConfigError, match="action_overhead_s"):
        fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, cost_model="analytic",
                        options=CompileOptions(action_overhead_s=bad))  # type: ignore[arg-type]


def test_with_overhead_sets_the_action_cost_and_shifts_every_link() -> None:
    from fxsplit.ir import CondensedGraph, DeviceSpec, Problem

    pb = Problem(CondensedGraph.chain([1.0, 1.0]), (DeviceSpec("a"), DeviceSpec("b"), DeviceSpec("c")),
                 link=LinkSpec(1e9, 1e-5), links=((1, 2, LinkSpec(2e9, 2e-5)),))
    out = with_overhead(pb, RuntimeOverhead(3e-4, 2e-4, 4e-4, message_s=1e-4))
    assert out.action_overhead_s == 3e-4
    assert out.link.latency_s == pytest.approx(1.1e-4) and out.link.bytes_per_s == 1e9
    assert out.link_between(1, 2).latency_s == pytest.approx(1.2e-4)


def _probe_worker(rank: int, world: int, out_dir: str) -> dict:
    import torch.distributed as dist

    from fxsplit.distributed import probe_distributed_overhead

    dist.init_process_group("gloo")
    try:
        found = probe_distributed_overhead(torch.device("cpu"), steps=5)
        again = probe_distributed_overhead(torch.device("cpu"), steps=5)
        return {"found": found, "memoised": again is found}
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_distributed_probe_gives_every_rank_the_same_overhead(tmp_path) -> None:
    from dist_utils import check_ok, launch

    results = launch(_probe_worker, 2, tmp_path, deadline_s=120)
    check_ok(results)
    a, b = results[0]["result"], results[1]["result"]
    assert a["memoised"] and b["memoised"]
    assert a["found"].message_s == b["found"].message_s  # rank 0's fit, broadcast
    found = a["found"]
    assert 0.0 <= found.action_s < 1e-2 and 0.0 <= found.message_s < 1e-2 and 1.0 <= found.compute_factor <= 2.0
    # the runtime's work is found as a part per action or a factor on the compute: on a loaded
    # machine the two pipelines' fit can put it all in the factor (CI: 1.40, no fixed part)
    assert found.action_s > 0.0 or found.compute_factor > 1.0


def _compile_worker(rank: int, world: int, out_dir: str) -> dict:
    import fxsplit.distributed as fxd
    import fxsplit.models as zoo
    from fxsplit.schedule import plan_step_s, with_loss

    out = {}
    # a given link: a probed one under load (~1 ms per message with 4 busy processes) made the
    # plan keep stage 0 free of parameters, the tied embedding and head both on rank 1
    for name, options in (("gpt", CompileOptions(profile_cache_dir=False, link=LinkSpec())),
                          ("mlp", CompileOptions(profile_cache_dir=False, action_overhead_s=2e-3, link=LinkSpec())),
                          ("gpt+loss", CompileOptions(profile_cache_dir=False, link=LinkSpec()))):
        model = name.split("+")[0]
        case = zoo.get(model, size="tiny", batch_size=4)
        x, y = case.make_batch(4, 1)
        loss = {"loss_fn": case.loss_fn, "target": y} if name.endswith("+loss") else {}
        # 1F1B: one stage per rank (a looped plan may put the tied embedding and head on one rank)
        pipe = fxd.compile(lambda n=model: zoo.get(n, size="tiny", batch_size=4).model,
                           case.example_inputs, microbatches=2, schedule="1f1b", state_dict=case.model.state_dict(),
                           timeout_s=60, options=options, **loss)
        problem = pipe.context.problem if pipe.context is not None else None
        out[name] = {"tied_sync_s": pipe.tied_sync_s, "predicted": pipe.predicted_step_s(),
                     "stages": [list(st.blocks) for st in pipe.running_plan().stages], "tied": [t.name for t in pipe.tied],
                     "loss_planned": pipe.loss_planned,
                     "plan_step": float(plan_step_s(pipe.running_plan())),
                     "overhead": problem.action_overhead_s if problem is not None else None,
                     "latency": problem.link_between(0, 1).latency_s if problem is not None else None}
        pipe.timed_steps(*x, target=y, loss_fn=case.loss_fn, steps=1)  # gathers the step's stage times
        out[name].update(loss_s=pipe.loss_s, predicted_after=pipe.predicted_step_s(),
                         with_loss=float(plan_step_s(with_loss(pipe.running_plan(), pipe.loss_s))))
        pipe.close()
    return out


@pytest.mark.distributed
def test_distributed_compile_charges_the_runtime_and_the_tied_all_reduce(tmp_path) -> None:
    """The plan of fxsplit.distributed.compile charges the probed runtime work (or the number
    given, without probing), and its predicted step ends with the tied embedding's all-reduce,
    timed at build (the same on every rank); a model without tied weights has none. Once a step
    has run, the predicted step holds the loss measured on the last stage (every rank alike),
    unless compile was given the loss and planned it."""
    from dist_utils import check_ok, launch

    results = launch(_compile_worker, 2, tmp_path, deadline_s=240)
    check_ok(results)
    a, b = results[0]["result"], results[1]["result"]
    for r in (a, b):
        assert r["gpt"]["tied_sync_s"] > 0, (r["gpt"]["stages"], r["gpt"]["tied"])
        assert r["gpt"]["predicted"] == pytest.approx(r["gpt"]["plan_step"] + r["gpt"]["tied_sync_s"])
        assert r["mlp"]["tied_sync_s"] == 0.0 and r["mlp"]["predicted"] == r["mlp"]["plan_step"]
    assert a["gpt"]["tied_sync_s"] == b["gpt"]["tied_sync_s"]  # the slowest rank's, on both
    for name in ("gpt", "mlp"):
        assert a[name]["loss_s"] == b[name]["loss_s"] > 0, name  # gathered from the last rank
        for r in (a, b):
            assert r[name]["with_loss"] > r[name]["plan_step"], name
            assert r[name]["predicted_after"] == pytest.approx(r[name]["with_loss"] + r[name]["tied_sync_s"]), name
    assert 0 < a["gpt"]["overhead"] < 1e-2  # probed (rank 0 keeps the problem)
    assert a["mlp"]["overhead"] == 2e-3
    # given the loss, rank 0 plans with it: every rank knows, and the measured one is not added again
    for r in (a, b):
        assert r["gpt+loss"]["loss_planned"] and not r["gpt"]["loss_planned"]
        assert r["gpt+loss"]["predicted_after"] == pytest.approx(r["gpt+loss"]["predicted"])
        assert r["gpt+loss"]["predicted"] == pytest.approx(r["gpt+loss"]["plan_step"] + r["gpt+loss"]["tied_sync_s"])
