"""Issue 11 (runtime): per-layer plans (PaSE) run with DTensor over gloo ranks compute what the
unsplit model computes: outputs, loss, every gradient by original name, and the state after an
optimizer step; a random valid plan (the optimum under random costs) as well as the named ones.
"""

from __future__ import annotations

import pytest
import tp_workers as w
from dist_utils import check_ok, launch, printed_differences

from fxsplit.errors import ConfigError

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world", [2, 4])
def test_per_layer_plans_train_like_the_unsplit_model(tmp_path, world):
    """GPT (attention, tied embedding) and an MLP; data parallelism, Megatron's column/row
    linear layers, PaSE's pick and two random valid plans per model."""
    runs = [(name, s) for name in ("gpt", "mlp") for s in ("data-parallel", "megatron", "auto", ("random", 0),
                                                          ("random", 1))]
    if world == 2:
        runs = [r for r in runs if r[0] == "gpt" and r[1] in ("megatron", ("random", 2))] + [("gpt", ("random", 2))]
    results = launch(w.train_like_unsplit, world, tmp_path, runs, deadline_s=240)
    check_ok(results)
    shown = results[0]["result"]
    for tag, r in shown.items():
        assert r["out_diff"] < 1e-5, (tag, r)
        assert r["loss_diff"] < 1e-5, (tag, r)
        assert r["grad_rel_diff"] < 1e-4, (tag, r)
        assert r["grads_named"] == r["params_named"], (tag, r)  # every gradient, tied names too
        assert r["keys"], f"{tag}: state_dict keys differ from the model's"
        assert r["state_diff"] < 1e-5, (tag, r)
        for other in results.values():  # every rank sees the same whole tensors
            assert other["result"][tag]["loss_diff"] == r["loss_diff"]
    if world == 4:
        assert shown["gpt-data-parallel"]["placements"] == ["R"]  # parameters replicated, batch split
        assert {"S(0)", "S(1)"} <= set(shown["gpt-megatron"]["placements"])  # column and row splits ran
        assert any(set(r["placements"]) - {"R"} for t, r in shown.items() if "random" in t)


def test_ranks_with_different_targets_are_refused_on_every_rank(tmp_path):
    """A per-layer plan splits one batch: a rank given another target would train on another
    batch and the shards would silently disagree; every rank refuses before backward."""
    results = launch(w.different_targets, 2, tmp_path, deadline_s=120)
    check_ok(results)
    for r in results.values():
        assert r["result"]["refused"] and "different inputs and targets" in r["result"]["refused"]
        assert r["result"]["grads"] == []  # nothing trained


def test_placement_names_and_layout_errors():
    from fxsplit.runtime.tensor_parallel import placement_of

    assert placement_of("R").is_replicate()
    assert placement_of("S(2)").dim == 2
    assert placement_of("P").is_partial()
    assert placement_of("SS(0)") is None and placement_of("(S(0),S(0))") is None
    import torch

    import fxsplit
    from fxsplit.passes.parallel_strategies import strategy_graph

    ins = fxsplit.inspect(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)),
                          (torch.randn(4, 8),))
    found = strategy_graph(ins.captured.gm, 2)
    layout = found.layout(found.data_parallel_choice())
    for v, name in enumerate(found.nodes):  # one expected placement per operand, under every option
        assert all(len(p) == len(found.inputs[v]) for p in found.input_placements[v]), name
    assert layout[ins.captured.input_names[0]].output == "S(0)"  # the batch split
    assert {layout[n].output for n, is_param in zip(found.nodes, found.parameters, strict=True) if is_param} == {"R"}
    with pytest.raises(ConfigError, match="does not pick one option"):
        found.layout((0,))


def test_cli_trains_every_layer_split_beside_the_unsplit_model(tmp_path):
    """``torchrun -m fxsplit compile mlp --distributed --parallel layers``: rank 0 prints the plan,
    the predicted and measured step and differences of 0 against the unsplit model."""
    results = launch(w.cli_layers, 2, tmp_path, "megatron", deadline_s=120)
    check_ok(results)
    text = results[0]["result"]
    assert "every layer split over 2 processes (megatron" in text, text
    loss, grad = printed_differences(text)
    assert grad < 1e-5 and loss < 1e-5, text
    assert results[1]["result"] == "" or "step" not in results[1]["result"]  # only rank 0 prints


def test_cli_parallel_needs_distributed():
    from typer.testing import CliRunner

    from fxsplit.cli import _register_all, app

    _register_all()
    out = CliRunner().invoke(app, ["compile", "mlp", "--parallel", "megatron"])
    assert out.exit_code == 2 and "add --distributed" in out.output, out.output


def test_dispatch_overhead_is_charged_to_split_ops_only():
    """``op_overhead_s`` adds 3x (forward, twice in backward) to every option of an op that runs
    on DTensors and nothing to an all-replicated one, so with a large overhead the replicated
    plan wins and with none a split plan can."""
    import math

    import torch

    import fxsplit
    from fxsplit.passes.parallel_strategies import strategy_graph
    from fxsplit.solvers.pase import solve_strategies

    ins = fxsplit.inspect(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)),
                          (torch.randn(32, 64),))
    plain = strategy_graph(ins.captured.gm, 2)
    taxed = strategy_graph(ins.captured.gm, 2, op_overhead_s=1.0)
    ops = {n.name for n in ins.captured.gm.graph.nodes if n.op == "call_function"}
    for v, name in enumerate(plain.nodes):
        for k, (a, b) in enumerate(zip(plain.graph.vertices[v].options, taxed.graph.vertices[v].options, strict=True)):
            if math.isinf(a.compute_s):
                continue
            whole = plain.placements[v][k] == "R" and set(plain.input_placements[v][k]) <= {"R"}
            assert b.compute_s - a.compute_s == pytest.approx(0.0 if whole or name not in ops else 3.0), (name, k)
    best = solve_strategies(taxed.graph)
    assert set(taxed.layout(best.choice)[n].output for n in ops) == {"R"}


def test_outputs_dtensor_places_otherwise_are_moved_to_the_plan_and_train_alike(tmp_path):
    """When DTensor's propagation gives an op's output another placement than the plan's, the
    runtime moves it (``relayouts`` counts them) and the gradients stay the unsplit model's."""
    results = launch(w.relayout_equal, 2, tmp_path, deadline_s=120)
    check_ok(results)
    for r in results.values():
        assert r["result"]["relayouts"] > 0
        assert r["result"]["loss_diff"] < 1e-6 and r["result"]["grad_diff"] < 1e-6, r["result"]


def test_calibrate_fits_the_dispatch_overhead_replans_and_keeps_training_alike(tmp_path):
    """``pg.calibrate``: measures the plan and the replicated one, fits DTensor's per-op price,
    re-plans with it (PaSE's pick, starting from no price); the gradients of before the call
    stay, the returned graph holds the same weights and trains like the unsplit model. When the
    fitted price is positive the new plan splits no more ops than the old one."""
    import math

    results = launch(w.calibrate_equal, 2, tmp_path, deadline_s=150)
    check_ok(results)
    reports = [r["result"]["report"] for r in results.values()]
    assert all(rep == reports[0] for rep in reports)  # every rank made the same decision
    for r in results.values():
        res, rep = r["result"], r["result"]["report"]
        assert rep["op_overhead_s"] >= 0 and all(math.isfinite(v) for v in rep.values() if isinstance(v, float))
        assert res["grads_kept"] == 0.0, res
        assert res["state_same"] == 0.0, res
        assert res["loss_diff"] < 1e-5 and res["grad_diff"] < 1e-5, res
        if rep["op_overhead_s"] > 0:
            assert res["split_after"] <= res["split_before"], res


def test_collective_probe_gives_every_rank_one_ring_link(tmp_path):
    """All-gathers over 3 ranks, read back as a ring's bandwidth and per-step latency: finite,
    positive, and the same on every rank (the slowest rank's timings)."""
    import math

    results = launch(w.collective_link, 3, tmp_path, deadline_s=90)
    check_ok(results)
    links = {r["result"] for r in results.values()}
    assert len(links) == 1, links
    bandwidth, latency = links.pop()
    assert 0 < bandwidth and (math.isfinite(bandwidth) or latency > 0) and 0 <= latency < 1.0


def test_state_moves_between_layouts_by_original_names(tmp_path):
    """Resharding: a Megatron plan's state after an SGD step (original names, whole tensors)
    loads into a data-parallel plan of the same model and both continue alike."""
    results = launch(w.reshard_equal, 2, tmp_path, deadline_s=120)
    check_ok(results)
    for r in results.values():
        res = r["result"]
        assert res["moved"] > 0  # the step changed the weights, so the load carried something
        assert res["state_diff"] == 0.0 and res["loss_diff"] < 1e-6 and res["grad_diff"] < 1e-6, res
        assert res["layouts"][0] != res["layouts"][1], res


def test_clip_grad_norm_of_a_per_layer_plan_is_the_unsplit_models(tmp_path):
    """Sharded gradients (Megatron's column/row linears on 2 ranks) count once in the norm."""
    results = launch(w.clip_like_unsplit, 2, tmp_path, "megatron", deadline_s=120)
    check_ok(results)
    for r in results.values():
        res = r["result"]
        assert res["ref_total"] > 0.1, res  # the case clips
        assert res["total"] == pytest.approx(res["ref_total"], rel=1e-5), res
        assert res["grad_rel_diff"] < 1e-4, res
        assert any(p.startswith("S(") for p in res["placements"]), res
