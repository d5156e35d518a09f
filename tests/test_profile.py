"""The profiled cost model: affine fits, micro-batch sizes, in-context timing, the disk cache."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxsplit
import fxsplit.passes.profile as profile_mod
from fxsplit.api import CompileOptions
from fxsplit.errors import ConfigError, PlanError
from fxsplit.ir import Block, CondensedGraph, DeviceSpec, Edge
from fxsplit.passes.capture import capture
from fxsplit.passes.costs import AnnotateCosts
from fxsplit.passes.measure import time_nodes_in_context
from fxsplit.passes.profile import (
    ProfileCache,
    fit_affine,
    is_cached,
    profile_node_times,
    profile_sizes,
)
from fxsplit.passes.shapes import PropagateShapes

# -- the fit -----------------------------------------------------------------------------------


@given(
    t0=st.floats(0.0, 1e-2), t1=st.floats(0.0, 1e-3),
    sizes=st.lists(st.integers(1, 64), min_size=2, max_size=4, unique=True),
)
def test_fit_affine_recovers_exact_lines(t0: float, t1: float, sizes: list[int]) -> None:
    f0, f1 = fit_affine(sizes, [t0 + t1 * b for b in sizes])
    assert f0 == pytest.approx(t0, abs=1e-12) and f1 == pytest.approx(t1, abs=1e-12)


@given(
    sizes=st.lists(st.integers(1, 64), min_size=1, max_size=4),
    times=st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4),
)
def test_fit_affine_is_never_negative_and_fits_the_mean(sizes: list[int], times: list[float]) -> None:
    """Noisy points never give a negative intercept or slope, and the fit is exact in the mean
    when it is unconstrained or a constant."""
    times = times[: len(sizes)]
    t0, t1 = fit_affine(sizes, times)
    assert t0 >= 0 and t1 >= 0
    assert all(math.isfinite(v) for v in (t0, t1))


def test_fit_affine_with_one_size_is_proportional() -> None:
    assert fit_affine([4], [2.0]) == (0.0, 0.5)
    assert fit_affine([4, 4], [2.0, 4.0]) == (0.0, 0.75)


def test_fit_affine_falls_back_to_a_constant_when_times_shrink() -> None:
    assert fit_affine([1, 8], [3.0, 1.0]) == (2.0, 0.0)


# -- the sizes ---------------------------------------------------------------------------------


@given(batch=st.integers(1, 512), data=st.data())
def test_profile_sizes_span_the_candidates(batch: int, data: st.DataObject) -> None:
    counts = data.draw(st.lists(st.integers(1, batch), min_size=1, max_size=8))
    sizes = profile_sizes(batch, counts)
    wanted = {math.ceil(batch / m) for m in counts}
    assert min(wanted) in sizes and max(wanted) in sizes
    assert len(sizes) <= 3 and set(sizes) <= wanted and list(sizes) == sorted(sizes)


def test_profile_sizes_of_one_count_is_its_micro_batch() -> None:
    assert profile_sizes(10, 4) == (3,)


def test_profile_sizes_refuses_counts_outside_the_batch() -> None:
    with pytest.raises(ConfigError, match=r"\[9\] must lie in 1..batch=8"):
        profile_sizes(8, [2, 9])


# -- the fixed part in the IR ------------------------------------------------------------------


@given(fwd=st.floats(0.0, 10.0), share=st.floats(0.0, 1.0), f=st.floats(0.01, 1.0))
def test_scaled_keeps_the_fixed_part_whole(fwd: float, share: float, f: float) -> None:
    block = Block(0, "b", fwd_s=fwd, fwd_fixed_s=fwd * share, bwd_s=2 * fwd, bwd_fixed_s=2 * fwd * share)
    got = CondensedGraph((block,)).scaled(f).blocks[0]
    assert got.fwd_s == pytest.approx(fwd * share + fwd * (1 - share) * f)
    assert got.bwd_s == pytest.approx(2 * fwd * share + 2 * fwd * (1 - share) * f)
    assert got.fwd_fixed_s == block.fwd_fixed_s  # still the fixed share of the scaled time
    assert not CondensedGraph((got,)).validate()


@given(bwd=st.one_of(st.just(0.0), st.floats(1e-6, 10.0)), weight=st.floats(0.0, 1.0), acc=st.floats(0.0, 5.0),
       m=st.integers(1, 16), factor=st.floats(0.1, 10.0))
def test_every_micro_batch_after_the_first_adds_its_gradients(bwd: float, weight: float, acc: float, m: int,
                                                              factor: float) -> None:
    """Property: a micro-batch of ``1/m`` of the batch costs its share of the backward plus
    ``(m - 1)/m`` of the block's gradient accumulation (every micro-batch after a step's first
    adds into the gradient there: the profile, which starts every step without gradients, does
    not see it); one micro-batch pays none; the weight-gradient half keeps its share; a refit
    factor on the backward scales the accumulation with it (as calibrate measures it)."""
    block = Block(0, "b", bwd_s=bwd, bwd_weight_s=bwd * weight, grad_accumulate_s=acc)
    got = CondensedGraph((block,)).scaled(1.0 / m).blocks[0]
    assert got.bwd_s == pytest.approx(bwd / m + acc * (m - 1) / m)
    if bwd > 0:
        assert got.bwd_weight_s == pytest.approx(weight * got.bwd_s)
    assert not CondensedGraph((got,)).validate()
    refit = CondensedGraph((block,)).with_time_factors([1.0], [factor]).scaled(1.0 / m).blocks[0]
    assert refit.bwd_s == pytest.approx(factor * got.bwd_s)
    assert CondensedGraph.from_json(CondensedGraph((block,)).to_json()).blocks[0] == block


def test_the_front_end_costs_adding_the_gradients_at_the_rate_measured(ref_device: DeviceSpec) -> None:
    """Profiled costs: each block's accumulation is its parameter bytes (own and tied copies) at
    the add rate measured on the device that timed the nodes; analytic costs: at the reference's
    memory bandwidth, an add reading two and writing one."""
    from fxsplit.frontend import front_end
    from fxsplit.passes.measure import grad_accumulate_bytes_per_s

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(8, 64)
    rate = grad_accumulate_bytes_per_s("cpu")
    assert rate > 0 and grad_accumulate_bytes_per_s("cpu") == rate  # memoised
    profiled = front_end(model, (x,), {}, reference=ref_device.with_(torch_device="cpu"), cost_model="profiled",
                         options=CompileOptions(profile_cache_dir=False)).condensed.graph
    analytic = front_end(model, (x,), {}, reference=ref_device, cost_model="analytic",
                         options=CompileOptions()).condensed.graph
    with_params = [b for b in profiled.blocks if b.param_bytes]
    assert with_params and all(b.grad_accumulate_s == pytest.approx(b.param_bytes / rate) for b in with_params)
    assert all(b.grad_accumulate_s == 0.0 for b in profiled.blocks if not b.param_bytes + b.replica_param_bytes)
    for b in analytic.blocks:
        assert b.grad_accumulate_s == pytest.approx(3 * (b.param_bytes + b.replica_param_bytes)
                                                    / ref_device.memory_bandwidth_bytes_per_s)


@given(n=st.integers(1, 6), data=st.data(), fwd=st.floats(0.0, 5.0), bwd=st.floats(0.0, 5.0),
       fixed=st.floats(0.0, 1.0), m=st.integers(1, 16))
def test_the_loss_goes_to_the_block_that_makes_the_outputs(n: int, data: st.DataObject, fwd: float, bwd: float,
                                                           fixed: float, m: int) -> None:
    """Property: the loss is charged whole to the last sink block (the one a chain's last stage
    holds) and nowhere else; a micro-batch of 1/m pays its share plus the fixed part whole."""
    edges = tuple(Edge(u, v) for u in range(n) for v in range(u + 1, n)
                  if data.draw(st.booleans(), label=f"edge {u}->{v}"))
    graph = CondensedGraph(tuple(Block(i, f"b{i}", fwd_s=0.1, bwd_s=0.2) for i in range(n)), edges)
    sink = max(b for b in range(n) if not graph.successors(b))
    got = graph.with_loss(fwd, bwd, fixed * fwd, fixed * bwd)
    for before, after in zip(graph.blocks, got.blocks, strict=True):
        if before.id == sink:
            assert after.fwd_s == pytest.approx(before.fwd_s + fwd) and after.bwd_s == pytest.approx(before.bwd_s + bwd)
            assert after.bwd_weight_s == before.bwd_weight_s  # the loss has no weights
        else:
            assert after == before
    assert got.total_time_s == pytest.approx(graph.total_time_s + fwd + bwd)
    per_mb = got.scaled(1.0 / m).blocks[sink]
    assert per_mb.fwd_s == pytest.approx(0.1 / m + fixed * fwd + (1 - fixed) * fwd / m)
    assert not got.validate()


def test_compile_times_the_loss_on_the_models_outputs_and_plans_it_on_the_last_stage() -> None:
    """A loss that takes 50 ms (it sleeps; well above what a tiny layer takes even on a loaded
    machine) lands on the block that makes the logits, and the model's other blocks and its
    buffers (batch statistics) are as without it."""
    import time as _time

    from fxsplit.frontend import front_end

    def slow_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _time.sleep(0.05)
        return nn.functional.cross_entropy(out, target)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    stats = [b.clone() for b in model.buffers()]
    cpu = DeviceSpec("cpu")
    graph = front_end(model, (x,), {}, reference=cpu, cost_model="measured",
                      options=CompileOptions(loss_fn=slow_loss, loss_target=y)).condensed.graph
    sink = max(b.id for b in graph.blocks if not graph.successors(b.id))
    assert any("linear" in n for n in graph.blocks[sink].nodes)  # the logits
    assert graph.blocks[sink].fwd_s >= 0.05
    assert all(b.fwd_s < 0.05 for b in graph.blocks if b.id != sink)
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers(), strict=True))
    analytic = front_end(model, (x,), {}, reference=cpu, cost_model="analytic",
                         options=CompileOptions(loss_fn=slow_loss, loss_target=y)).condensed.graph
    assert all(b.fwd_s < 0.05 for b in analytic.blocks)  # analytic costs leave the loss out (said in the log)


def test_a_plan_given_the_loss_lightens_the_last_stage() -> None:
    """Eight equal layers on two devices: with a loss as slow as several layers, the last stage
    takes fewer layers than the first, and the plan predicts it with the loss."""
    import time as _time

    def slow_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _time.sleep(0.004)
        return nn.functional.mse_loss(out, target)

    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(8) for m in (nn.Linear(256, 256), nn.ReLU())))
    x, y = torch.randn(32, 256), torch.randn(32, 256)
    pipe = fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, schedule="1f1b", cost_model="measured",
                           options=CompileOptions(allow_idle_devices=False), loss_fn=slow_loss, target=y)
    first, last = pipe.plan.stages
    graph = pipe.context.problem.graph
    layers = [sum(1 for b in st.blocks if graph.blocks[b].param_bytes) for st in (first, last)]
    assert layers[1] < layers[0], layers
    assert last.fwd_s >= 0.002  # half the batch's loss, per micro-batch
    loss = pipe.train_step(x, target=y, loss_fn=slow_loss)
    assert loss.item() == pytest.approx(nn.functional.mse_loss(model(x), y).item(), rel=1e-5)


def test_a_loss_that_fails_on_the_outputs_is_a_config_error() -> None:
    model = nn.Linear(4, 3)
    x = torch.randn(6, 4)
    with pytest.raises(ConfigError, match=r"cannot cost loss_fn=.*\[6, 3\] torch.float32.*loss_fn=None"):
        fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, loss_fn=nn.functional.cross_entropy,
                        target=torch.randn(5))
    with pytest.raises(ConfigError, match="not a scalar"):
        fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, loss_fn=lambda out, _t: out, target=None)
    with pytest.raises(ConfigError, match="needs a callable loss_fn"):
        fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, loss_fn="mse")  # type: ignore[arg-type]


def test_a_fixed_part_larger_than_the_time_is_a_fault() -> None:
    graph = CondensedGraph((Block(0, "b", fwd_s=1.0, fwd_fixed_s=2.0),))
    with pytest.raises(PlanError, match="fwd_fixed_s=2.0 > fwd_s=1.0"):
        graph.check()


def test_fixed_parts_round_trip_through_json() -> None:
    graph = CondensedGraph((Block(0, "b", fwd_s=1.0, fwd_fixed_s=0.25, bwd_s=2.0, bwd_fixed_s=0.5),))
    assert CondensedGraph.from_json(graph.to_json()) == graph


def test_analytic_overhead_is_the_fixed_part(ref_device: DeviceSpec) -> None:
    """A micro-batch pays the per-operator overhead whole: scaling a graph by 1/m must not divide
    it (the analytic model used to, and underpredicted small micro-batches)."""
    device = ref_device.with_(op_overhead_s=1e-5)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    x = torch.randn(16, 8)
    cap = capture(model, (x,))
    PropagateShapes((x,))(cap.gm)
    AnnotateCosts(device)(cap.gm)
    costs = [n.meta["fxsplit.cost"] for n in cap.gm.graph.nodes if n.op != "output"]
    computing = [c for c in costs if not c.is_view]
    assert computing and all(c.fwd_fixed_s == 1e-5 and c.bwd_fixed_s == 2e-5 for c in computing)


# -- timing and the cache ----------------------------------------------------------------------


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)), torch.randn(8, 16)


def _annotated(model: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    cap = capture(model, (x,), dynamic_batch=True)
    PropagateShapes((x,), force=True)(cap.gm)
    AnnotateCosts(DeviceSpec("ref"))(cap.gm)
    return cap.gm


def test_in_context_timing_covers_every_compute_node_and_leaves_the_model_alone() -> None:
    model, x = _mlp()
    gm = _annotated(model, x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    times = time_nodes_in_context(gm, (x,), warmup=1, repeats=2)
    compute = [n.name for n in gm.graph.nodes if n.op != "output" and not n.meta["fxsplit.cost"].is_view]
    assert sorted(times) == sorted(compute)
    assert all(f > 0 for f, _ in times.values())
    assert sum(b for _, b in times.values()) > 0
    assert all(p.grad is None for p in model.parameters())  # gradients land on the copy
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("walls", [(1.0, 2.0)])
def test_node_times_add_up_to_the_graphs_own_forward_and_backward(monkeypatch: pytest.MonkeyPatch, walls) -> None:
    """Issue 9: the forward of a stage was under-predicted 10-20 %: the per-node marks miss the
    view ops and glue between them. Node times now sum to the graph's own forward / backward wall
    (here a stand-in clock: 1 s / 2 s, above every mark)."""
    import fxsplit.passes.measure as measure_mod

    monkeypatch.setattr(measure_mod, "_clean_step", lambda *a: walls)
    model, x = _mlp()
    times = time_nodes_in_context(_annotated(model, x), (x,), warmup=0, repeats=3)
    assert math.isclose(sum(f for f, _ in times.values()), walls[0], rel_tol=1e-9)
    assert math.isclose(sum(b for _, b in times.values()), walls[1], rel_tol=1e-9)
    assert all(f > 0 for f, _ in times.values())


def test_every_autograd_node_a_call_records_is_charged_to_it() -> None:
    """Issue 9: a stage's backward was under-predicted by up to 28 %: ``aten.linear`` on a 3-d
    input records ``view -> addmm -> view`` and only the output's ``ViewBackward`` was timed (the
    ``AddmmBackward`` fell into the shared residual), and a view's backward (``split``'s is a
    ``cat``) was charged to nobody. Now every autograd node a call records is charged to the
    node, and a view's to the node whose output it views."""
    from fxsplit.passes.measure import _Clock, _ContextInterpreter

    class LinearSplit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, b = self.lin(x).split(3, dim=-1)
            return a * b

    x = torch.randn(2, 3, 4)
    interp = _ContextInterpreter(_annotated(LinearSplit(), x), _Clock(torch.device("cpu")))
    interp.run(x)
    owned = {}
    for fn, owner in interp.grad_fns.items():
        owned.setdefault(owner, set()).add(type(fn).__name__)
    assert "AddmmBackward0" in owned["linear"] and "SplitBackward0" in owned["linear"], owned
    assert owned["mul"] == {"MulBackward0"}
    assert set(interp.marks) == {"linear", "mul"}  # split and getitem calls are timed as linear's


@given(times=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8), wall=st.floats(1e-6, 10.0))
def test_shared_residual_keeps_untimed_nodes_at_zero_and_sums_to_the_wall_above_the_floors(times: list[float], wall: float) -> None:
    from fxsplit.passes.measure import _shared

    out = _shared({str(i): t for i, t in enumerate(times)}, wall)
    assert all(out[str(i)] == 0.0 for i, t in enumerate(times) if t == 0)
    assert all(out[str(i)] >= 0.1 * t for i, t in enumerate(times))
    timed = [t for t in times if t > 0]
    if timed and all(t + (wall - sum(timed)) / len(timed) >= 0.1 * t for t in timed):
        assert math.isclose(sum(out.values()), wall, rel_tol=1e-9)  # no floor reached
    elif timed:
        assert sum(out.values()) > wall  # a floor kept some node's time


def test_profiled_costs_are_the_fit_at_the_whole_batch() -> None:
    model, x = _mlp()
    gm = _annotated(model, x)
    fits = profile_node_times(gm, (x,), (True,), (1, 4, 8), warmup=1, repeats=2)
    assert fits
    for node in gm.graph.nodes:
        if node.name in fits:
            f0, f1, b0, b1 = fits[node.name]
            cost = node.meta["fxsplit.cost"]
            assert cost.source == "profiled"
            assert cost.fwd_s == pytest.approx(f0 + 8 * f1) and cost.fwd_fixed_s == f0
            assert cost.bwd_s == pytest.approx(b0 + 8 * b1) and cost.bwd_fixed_s == b0


def test_is_cached_says_whether_profiling_would_time_anything() -> None:
    """``is_cached`` (rank 0 asks it before every rank profiles together) matches what
    ``profile_node_times`` would look up: every node at every size."""
    model, x = _mlp()
    gm = _annotated(model, x)
    store: dict = {}
    assert not is_cached(gm, (x,), (2, 8), store) and not is_cached(gm, (x,), (2,), None)
    profile_node_times(gm, (x,), (True,), (2, 8), warmup=1, repeats=1, cache=store)
    assert is_cached(gm, (x,), (2, 8), store) and is_cached(gm, (x,), (8,), store)
    assert not is_cached(gm, (x,), (2, 4), store), "size 4 was never timed"
    del store[next(iter(store))]
    assert not is_cached(gm, (x,), (2, 8), store)


def test_profile_refuses_sizes_beyond_the_batch() -> None:
    model, x = _mlp()
    with pytest.raises(ConfigError, match=r"profile sizes \[16\] must lie in 1..batch=8"):
        profile_node_times(_annotated(model, x), (x,), (True,), (16,))


class _BakedBatch(nn.Module):
    """Adds a buffer expanded to the batch, as BERT's token-type ids are: an export specialised to
    the example batch bakes the batch size into the ``expand``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("bias_row", torch.zeros(1, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.bias_row.expand(x.shape[0], -1)


def test_inspect_with_profiled_costs_runs_micro_batches_of_a_model_that_bakes_the_batch() -> None:
    """Regression: ``fxsplit.inspect(..., cost_model="profiled")`` captured at the example batch
    only and failed (PassError) timing smaller micro-batches; it now captures with a symbolic
    batch as compile does and times them."""
    torch.manual_seed(0)
    ins = fxsplit.inspect(_BakedBatch(), (torch.randn(8, 16),), cost_model="profiled")
    costs = [n.meta["fxsplit.cost"] for n in ins.captured.gm.graph.nodes if "fxsplit.cost" in n.meta]
    assert any(c.source == "profiled" for c in costs)


def test_profile_of_a_graph_specialised_to_the_batch_says_how_to_capture() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    cap = capture(_BakedBatch(), (x,), method="export", dynamic_batch=False)
    PropagateShapes((x,))(cap.gm)
    AnnotateCosts(DeviceSpec("ref"))(cap.gm)
    with pytest.raises(ConfigError, match=r"micro-batch of 2 of the 8 samples.*dynamic_batch=True"):
        profile_node_times(cap.gm, (x,), (True,), (2, 8), warmup=1, repeats=1)


def test_cache_hit_times_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A second profile of the same graph reads every time from the cache file; a graph of other
    shapes misses it."""
    calls = []
    real = profile_mod.time_nodes_in_context
    monkeypatch.setattr(profile_mod, "time_nodes_in_context", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, x = _mlp()
    cache = ProfileCache(tmp_path, "cpu-test")
    first = profile_node_times(_annotated(model, x), (x,), (True,), (2, 8), cache=cache, warmup=0, repeats=1)
    cache.save()
    assert len(calls) == 2 and cache.misses > 0
    again = ProfileCache(tmp_path, "cpu-test")
    second = profile_node_times(_annotated(model, x), (x,), (True,), (2, 8), cache=again, warmup=0, repeats=1)
    assert len(calls) == 2, "the second profile timed again"
    assert second == first and again.hits > 0 and again.misses == 0
    wider = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    profile_node_times(_annotated(wider, x), (x,), (True,), (2,), cache=again, warmup=0, repeats=1)
    assert len(calls) == 3


def test_cache_file_is_json_and_a_broken_one_is_ignored(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    cache = ProfileCache(tmp_path, "cpu/odd name")
    cache["k"] = (1.0, 2.0)
    cache.save()
    assert json.loads(cache.path.read_text()) == {"reference_s": None, "timings": {"k": [1.0, 2.0]}}
    assert "/" not in cache.path.name.replace("torch", "")
    cache.path.write_text("{not json")
    assert len(ProfileCache(tmp_path, "cpu/odd name")) == 0
    assert "ignoring unreadable profile cache" in caplog.text


def test_timings_taken_at_another_machine_speed_are_timed_again(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """The file keeps the reference kernel's time its timings were taken at; opened when the
    machine runs it more than STALE_RTOL faster or slower, the timings are dropped (and said),
    within it they are kept; a file of the first format (timings only) is read as before, and
    timed again where the speed is checked."""
    import logging

    from fxsplit.passes.profile import STALE_RTOL, reference_kernel_s

    cache = ProfileCache(tmp_path, "cpu-test", reference_s=0.010)
    cache["k"] = (1.0, 2.0)
    cache.save()
    close = ProfileCache(tmp_path, "cpu-test", reference_s=0.010 * (1 + STALE_RTOL / 2))
    assert close["k"] == (1.0, 2.0) and not close.stale and close.reference_s == 0.010
    with caplog.at_level(logging.INFO, logger="fxsplit.passes.profile"):
        for now in (0.010 * (1 + 2 * STALE_RTOL), 0.010 * (1 - 2 * STALE_RTOL)):
            moved = ProfileCache(tmp_path, "cpu-test", reference_s=now)
            assert len(moved) == 0 and moved.stale and moved.reference_s == now
    assert "timing again" in caplog.text
    unchecked = ProfileCache(tmp_path, "cpu-test")
    assert unchecked["k"] == (1.0, 2.0)
    cache.path.write_text(json.dumps({"k": [3.0, 4.0]}))  # the first format: read, of unknown speed
    assert ProfileCache(tmp_path, "cpu-test")["k"] == (3.0, 4.0)
    assert len(ProfileCache(tmp_path, "cpu-test", reference_s=1.0)) == 0
    assert 0 < reference_kernel_s("cpu", repeats=1) < 1.0
    with pytest.raises(ConfigError, match="no such device"):
        reference_kernel_s("nonsense")


def test_compile_with_the_profiled_model_plans_on_micro_batch_costs(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet machine keeps its profile
    model, x = _mlp()
    opts = CompileOptions(profile_cache_dir=tmp_path)
    pipe = fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=4, schedule="gpipe", cost_model="profiled",
                           options=opts)
    assert list(tmp_path.glob("*.json")), "no cache file written"
    # The plan's per-micro-batch stage times are the fits at the micro-batch size (2 samples).
    assert pipe.plan.stages and all(st.fwd_s > 0 for st in pipe.plan.stages)
    out = pipe(x)
    assert out.shape == (8, 4)


def test_compile_says_each_phase_it_waits_on(tmp_path) -> None:
    """Issue 14 (item 5): ``CompileOptions(phase=...)`` hears capture, costs, the schedule search,
    the exact split of the winner and the build, in that order (the CLI shows them)."""
    model, x = _mlp()
    seen: list[str] = []
    fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, schedule="auto",
                    options=CompileOptions(profile_cache_dir=tmp_path, phase=seen.append))
    assert seen[0] == "capturing Sequential" and seen[1].startswith("annotating profiled costs on ")
    assert seen[2].startswith("planning 3 blocks on 2 devices: searching gpipe, 1f1b")
    assert seen[-1].startswith("building ") and "2 micro-batch(es)" in seen[-1]
    fixed: list[str] = []
    fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, schedule="gpipe",
                    options=CompileOptions(profile_cache_dir=tmp_path, phase=fixed.append))
    assert fixed[2] == "planning 3 blocks on 2 devices: solving the split"


@settings(deadline=None, max_examples=5)
@given(m=st.sampled_from([1, 2, 4]))
def test_profiled_costs_scale_to_the_fit_at_each_micro_batch(m: int) -> None:
    """``graph.scaled(1/m)`` of a profiled graph gives, for each block, the sum of its nodes'
    fitted ``t0 + t1 * B/m``."""
    from fxsplit.passes.condense import condense_antichains

    model, x = _mlp()
    gm = _annotated(model, x)
    fits = profile_node_times(gm, (x,), (True,), (1, 8), warmup=0, repeats=1)
    graph = condense_antichains(gm).graph.scaled(1 / m)
    b = 8 / m
    for block in graph.blocks:
        want = sum(fits[n][0] + fits[n][1] * b for n in block.nodes if n in fits)
        assert block.fwd_s == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_a_profile_taken_on_a_busy_machine_is_not_cached(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Timings inflated by other processes would poison every later compile of the model."""
    import os

    monkeypatch.setattr(os, "getloadavg", lambda: (4.0 * (os.cpu_count() or 1), 0.0, 0.0))
    model, x = _mlp()
    fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, cost_model="profiled",
                    options=CompileOptions(profile_cache_dir=tmp_path))
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.parametrize("folder", [True, None])
def test_profile_cache_dir_true_or_none_is_the_default_folder(folder: bool | None, tmp_path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: ``profile_cache_dir=True`` (which the option's type allows) reached
    ``ProfileCache`` as a path and failed with a TypeError inside compile."""
    import os

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet machine keeps its profile
    model, x = _mlp()
    fxsplit.compile(model, ["cpu", "cpu"], (x,), microbatches=2, cost_model="profiled",
                    options=CompileOptions(profile_cache_dir=folder))
    assert list((tmp_path / "fxsplit" / "profiles").glob("*.json"))
    assert profile_mod.open_cache(False, "cpu") is None
