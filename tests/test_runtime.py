"""The local pipeline's API: compile arguments, state dicts, optimizer steps, errors, micro-batches."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pipeline_utils import Compiled, devices
from typer.testing import CliRunner

import fxsplit
import fxsplit.models as zoo
from fxsplit.errors import ConfigError, ExecutionError, FxsplitError
from fxsplit.runtime import execution_order, merge_outputs, split_microbatches
from fxsplit.schedule import make


@pytest.fixture(scope="module")
def gpt():
    return Compiled(zoo.get("gpt", batch_size=4), copy_tied=True)


def test_compile_public_api_runs_and_prints_a_table():
    case = zoo.get("mlp", batch_size=4)
    pipe = fxsplit.compile(case.model, devices(2), case.example_inputs, microbatches=2, schedule="gpipe",
                           options=fxsplit.CompileOptions(allow_idle_devices=False))
    assert pipe.num_stages == 2 and pipe.schedule_kind == "gpipe" and pipe.microbatches == 2
    text = repr(pipe)
    assert "stage" in text and "cpu#1" in text and "gpipe" in text
    assert pipe.report is not None and pipe.report.reason
    from fxsplit.viz import describe

    table = describe(pipe)  # the rich table the CLI prints
    assert "cpu#1" in table and "time/mb" in table and "lower bound" in table


def test_auto_schedule_records_why(gpt):
    case = zoo.get("gpt", batch_size=8)
    pipe = fxsplit.compile(case.model, devices(3), case.example_inputs)
    from fxsplit.ir.problem import AUTO_SCHEDULES, LOOPED_SCHEDULES

    assert pipe.schedule_kind in AUTO_SCHEDULES
    assert 1 <= pipe.microbatches <= 8
    assert f"{pipe.schedule_kind} m={pipe.microbatches}" in pipe.report.reason
    looped = pipe.schedule_kind in LOOPED_SCHEDULES  # two stages per device, else one (a device may idle)
    assert pipe.plan.num_stages == (2 * pipe.plan.num_ranks if looped else pipe.plan.num_ranks) <= (6 if looped else 3)
    assert "interleaved-1f1b" in pipe.report.candidates  # auto weighed several stages per device too
    assert "zero-bubble" not in pipe.report.candidates  # asked for by name only (AUTO_SCHEDULES)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"devices": []}, "devices is empty"),
        ({"solver": "magic"}, "solver='magic' is unknown"),
        ({"microbatches": 64}, "exceeds the batch of 4"),
        ({"schedule": "zigzag"}, "schedule='zigzag'"),
        ({"microbatches": 0}, "microbatches=0"),
        ({"cost_model": "guess"}, "cost_model='guess'"),
        ({"example_kwargs": {"labels": 1}}, "example inputs do not match MLP.forward"),
        # issue 10: meta compiled and returned data-less outputs; 'tpu' was a raw RuntimeError
        ({"devices": ["meta", "meta"]}, r"devices\[0\]='meta': a meta device holds no data"),
        ({"devices": ["cpu", "tpu"]}, r"devices\[1\]='tpu' is not a torch device"),
        ({"devices": ["cpu", "mps"]}, r"devices\[1\]='mps': fxsplit runs stages on 'cpu' and 'cuda'"),
        ({"devices": 10**7}, r"devices=10000000: give 1 to 1024 devices"),  # was: out of memory
        ({"devices": ["cpu"] * 2000}, r"2000 devices: fxsplit plans at most 1024"),
    ],
)
def test_bad_arguments_fail_before_any_work(kwargs, match):
    case = zoo.get("mlp", batch_size=4)
    args = {"devices": devices(2), **kwargs}
    with pytest.raises(ConfigError, match=match):
        fxsplit.compile(case.model, args.pop("devices"), case.example_inputs, **args)


def test_inputs_of_the_wrong_structure_are_refused(gpt):
    pipe = gpt.pipeline(2, "1f1b", 2)
    tokens = gpt.case.example_inputs[0]
    with pytest.raises(ConfigError, match="structure"):
        pipe(tokens, tokens)


def test_optimizer_step_keeps_state_dict_equal_to_the_original():
    case = zoo.get("gpt", batch_size=4)
    compiled = Compiled(case, copy_tied=True)
    pipe = compiled.pipeline(3, "1f1b", 2)
    ref = compiled.reference
    # SGD: Adam divides by sqrt(v), which turns 1e-9 gradient noise on near-zero gradients into
    # visible differences; the property under test is the gradient and the update rule, not Adam.
    opt_pipe = torch.optim.SGD(list(pipe.parameters()), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        inputs, target = case.make_batch(4, step)
        opt_pipe.zero_grad()
        opt_ref.zero_grad()
        pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
        case.loss_fn(ref(*inputs), target).backward()
        opt_pipe.step()
        opt_ref.step()
    ours, theirs = pipe.state_dict(), ref.state_dict()
    assert list(ours) == list(theirs)
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    # Tied copies stay identical after the update.
    head = dict(pipe.named_parameters())
    torch.testing.assert_close(head["lm_head.weight"], head["tok_emb.weight"])


def test_load_state_dict_round_trips_into_every_copy(gpt):
    pipe = gpt.pipeline(3, "1f1b", 2)
    fresh = copy.deepcopy(gpt.reference)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(0.5)
    pipe.load_state_dict(fresh.state_dict())
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], value)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.detach(), fresh.state_dict()[name], msg=lambda m, n=name: f"copy {n}: {m}")
    with pytest.raises(ConfigError, match="missing keys"):
        pipe.load_state_dict({"tok_emb.weight": fresh.tok_emb.weight})
    pipe.load_state_dict(gpt.reference.state_dict())


def test_a_mis_shaped_state_dict_loads_nothing(gpt):
    """Issue 10: ``load_state_dict`` broadcast a ``[d]`` or 0-d value into a ``[vocab, d]`` weight
    without a word, and a bad key raised after earlier keys were already written. Every value is
    now checked first; nothing is written unless all fit."""
    pipe = gpt.pipeline(2, "1f1b", 2)
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    sd = {k: v + 1.0 if v.is_floating_point() else v for k, v in gpt.reference.state_dict().items()}
    last = list(sd)[-1]
    sd["tok_emb.weight"] = sd["tok_emb.weight"][0]  # [d] into [vocab, d]: copy_ would broadcast it
    sd[last] = torch.tensor(0.0) if sd[last].dim() else torch.zeros(2)
    with pytest.raises(ConfigError, match=r"nothing was loaded.*tok_emb\.weight: shape \[\d+\] in the state dict, \[\d+, \d+\]"):
        pipe.load_state_dict(sd)
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} was written by a load that failed"


def test_a_failing_stage_names_stage_microbatch_and_device(gpt):
    pipe = gpt.pipeline(3, "1f1b", 2)
    stage = pipe.stages[1]
    original = stage.gm.forward

    def broken(*args):
        raise RuntimeError("boom")

    stage.gm.forward = broken
    try:
        inputs, target = gpt.case.make_batch(4, 0)
        with pytest.raises(ExecutionError, match="stage 1 failed on micro-batch 0 on cpu") as info:
            pipe.train_step(*inputs, target=target, loss_fn=gpt.case.loss_fn)
        assert (info.value.stage, info.value.microbatch, info.value.device) == (1, 0, "cpu")
        assert isinstance(info.value, FxsplitError) and isinstance(info.value.__cause__, RuntimeError)
    finally:
        stage.gm.forward = original


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 3), (4, 8), (3, 1)])
def test_execution_order_respects_dependencies(kind, p, m):
    order = [str(a) for a in execution_order(make(kind, p, m))]
    assert len(order) == 2 * p * m
    pos = {a: i for i, a in enumerate(order)}
    for s in range(p):
        for i in range(m):
            assert pos[f"{s}F{i}"] < pos[f"{s}B{i}"]
            if s:
                assert pos[f"{s - 1}F{i}"] < pos[f"{s}F{i}"]
                assert pos[f"{s}B{i}"] < pos[f"{s - 1}B{i}"]


def test_microbatches_split_and_merge_back():
    x, scale = torch.arange(10.0).reshape(5, 2), torch.tensor(3.0)
    mbs, sizes = split_microbatches([x, scale, 7], 3)
    assert sizes == [2, 2, 1] and [mb[0].shape[0] for mb in mbs] == sizes
    assert all(mb[1] is scale and mb[2] == 7 for mb in mbs)
    per_mb = [[mb[0], mb[0].mean(), mb[0].sum()] for mb in mbs]
    merged = merge_outputs(per_mb, sizes, reductions={1: "mean", 2: "sum"})
    torch.testing.assert_close(merged[0], x)
    torch.testing.assert_close(merged[1], sum(mb[0].mean() * n / 5 for mb, n in zip(mbs, sizes, strict=True)))
    torch.testing.assert_close(merged[2], x.sum())
    with pytest.raises(ConfigError, match="output 1 .* it is 0-d"):  # how it adds up was not found
        merge_outputs(per_mb, sizes)
    with pytest.raises(ConfigError, match="cannot be split into 6"):
        split_microbatches([x], 6)


def test_cli_compile_trains_and_compares():
    from fxsplit.cli import _register_all, app

    _register_all()
    result = CliRunner().invoke(app, ["compile", "gpt", "--devices", "2", "--steps", "2", "--size", "tiny", "--batch-size", "4"])
    assert result.exit_code == 0, result.output
    assert "predicted step time" in result.output and "largest gradient difference" in result.output
    diff = next(line for line in result.output.splitlines() if "largest loss difference" in line)
    assert float(diff.split("│")[-2]) < 1e-4


def test_pipe_plan_keeps_its_graph_for_pictures_and_serialises_without_it(tmp_path):
    pytest.importorskip("matplotlib")
    case = zoo.get("gpt", batch_size=4)
    pipe = fxsplit.compile(case.model, devices(3), case.example_inputs, microbatches=2, schedule="1f1b",
                           options=fxsplit.CompileOptions(allow_idle_devices=False))
    assert pipe.plan.graph is not None and len(pipe.plan.graph) > 0
    from fxsplit import viz

    out = viz.draw_plan(pipe.plan, pipe.plan.graph, tmp_path / "plan.png")
    assert out.exists() and out.stat().st_size > 1000
    from fxsplit.ir import Plan

    again = Plan.from_json(pipe.plan.to_json())
    assert again.to_dict() == pipe.plan.to_dict() and again.graph is None


class _Structured(torch.nn.Module):
    """Dict input, two keyword inputs, a scale without a batch dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, batch: dict, *, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(batch["x"] + left))) * right


def test_structured_inputs_keyword_order_and_unbatched_targets():
    """Regressions: dict inputs failed at compile ("no input is a tensor with a batch dimension"),
    keywords in another order were refused, and a 0-d target was split like an input."""
    model = _Structured()
    x, left, right = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)
    pipe = fxsplit.compile(model, devices(2), ({"x": x},), {"left": left, "right": right}, microbatches=2,
                           schedule="gpipe", options=fxsplit.CompileOptions(allow_idle_devices=False))
    with torch.no_grad():
        torch.testing.assert_close(pipe({"x": x}, right=right, left=left), model({"x": x}, left=left, right=right))
    scale = torch.tensor(3.0)

    def loss_fn(out, target):
        return (out * target).pow(2).mean()

    loss = pipe.train_step({"x": x}, target=scale, loss_fn=loss_fn, left=left, right=right)
    torch.testing.assert_close(loss, loss_fn(model({"x": x}, left=left, right=right), scale))


def test_eval_or_train_must_match_the_compiled_mode():
    case = zoo.get("resnet", batch_size=4)
    case.model.eval()
    pipe = fxsplit.compile(case.model, devices(2), case.example_inputs, microbatches=2, schedule="gpipe")
    assert pipe.eval() is pipe
    with pytest.raises(ConfigError, match=r"compiled from a model in eval mode.*model.train\(\)"):
        pipe.train()


class _WithMixer(torch.nn.Module):
    """``mixer [4, 4]`` has no batch dimension, but dim 0 equals the batch of 4."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mixer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.b(torch.relu(self.a(x))) @ mixer
        return h, mixer.sum(0)  # second output: not batched, though its dim 0 is 4 as well


def test_batch_dimension_comes_from_export_not_from_shape_coincidence():
    """Regression: an input whose dim 0 happened to equal the batch size was split across
    micro-batches, and an unbatched output of that size was concatenated."""
    model = _WithMixer()
    x, mixer = torch.randn(4, 4), torch.randn(4, 4)
    pipe = fxsplit.compile(model, devices(2), (x, mixer), microbatches=2, schedule="gpipe",
                           options=fxsplit.CompileOptions(allow_idle_devices=False))
    assert pipe.batched_inputs == (True, False) and pipe.batched_outputs == (True, False)
    with torch.no_grad():
        ours, theirs = pipe(x, mixer), model(x, mixer)
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1])


def _sum_loss(output, target):
    return torch.nn.functional.cross_entropy(output.flatten(0, -2), target.flatten(), reduction="sum")


@pytest.mark.parametrize(("schedule", "m"), [("gpipe", 4), ("1f1b", 3)])
def test_a_sum_reduced_loss_trains_like_the_unsplit_model(gpt, schedule, m):
    """Issue 10: ``loss_fn`` with ``reduction="sum"`` silently gave 1/m of the loss and of every
    gradient (the micro-batch losses were weighted by their share, the rule for a mean). The
    reduction is now found on the first micro-batch and a sum is added unweighted."""
    from pipeline_utils import reference_grads

    pipe = gpt.pipeline(2, schedule, m)
    inputs, target = gpt.case.make_batch(gpt.batch, seed=3)
    case = type("SumCase", (), {"loss_fn": staticmethod(_sum_loss)})
    ref_loss, ref_grads = reference_grads(gpt.reference, case, inputs, target)
    loss = pipe.train_step(*inputs, target=target, loss_fn=_sum_loss)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=lambda msg, n=name: f"{n}: {msg}")


def test_a_loss_that_mixes_samples_is_refused_before_any_backward(gpt):
    """Issue 10: a loss over the whole batch (here a log-sum-exp across samples) is neither a
    mean nor a sum of per-sample terms, so micro-batching changes it; refused, not run wrong."""
    pipe = gpt.pipeline(2, "1f1b", 2)
    pipe.zero_grad()
    inputs, target = gpt.case.make_batch(gpt.batch, seed=3)

    def batch_lse(output, target):
        return torch.logsumexp(output.mean(dim=(1, 2)), dim=0)

    with pytest.raises(ConfigError, match="neither a mean nor a sum over the batch"):
        pipe.train_step(*inputs, target=target, loss_fn=batch_lse)
    assert all(p.grad is None for p in pipe.parameters()), "a backward ran before the refusal"


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 5), seed=st.integers(0, 2**16), reduction=st.sampled_from(["mean", "sum"]))
def test_loss_reduction_tells_mean_from_sum(rows, cols, seed, reduction):
    from fxsplit.runtime.microbatch import loss_reduction

    g = torch.Generator().manual_seed(seed)
    out, tgt = torch.randn(rows, cols, generator=g), torch.randn(rows, cols, generator=g)
    loss = lambda o, t: torch.nn.functional.mse_loss(o["y"], t, reduction=reduction)  # noqa: E731
    found = loss_reduction(loss, [out], None, lambda flat: {"y": flat[0]}, tgt, rows)
    assert found in (reduction, "unknown")
    assert found == reduction or float(loss({"y": out}, tgt)) == 0.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_step_that_fails_part_way_leaves_the_gradients_as_they_were(gpt, schedule):
    """Issue 10: a ``train_step`` that failed after some micro-batches' backwards left their
    gradients in the parameters. Gradients accumulated before the step survive a failed step
    unchanged, and a later good step still accumulates onto them."""
    pipe = gpt.pipeline(2, schedule, 4)
    pipe.zero_grad()
    inputs, target = gpt.case.make_batch(gpt.batch, seed=5)
    pipe.train_step(*inputs, target=target, loss_fn=gpt.case.loss_fn)
    one = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    backwards = []

    def fails_in_the_third_micro_batchs_backward(output, target):
        if not output.requires_grad:  # the reduction check runs the loss on detached outputs
            return gpt.case.loss_fn(output, target)
        index = len(backwards)
        backwards.append(None)

        def hook(grad):
            backwards[index] = "done"
            if index == 2:
                raise RuntimeError("boom")
            return grad

        output.register_hook(hook)
        return gpt.case.loss_fn(output, target)

    with pytest.raises(ExecutionError, match="boom"):
        pipe.train_step(*inputs, target=target, loss_fn=fails_in_the_third_micro_batchs_backward)
    assert backwards.count("done") >= 2, f"no other micro-batch's backward ran first; the test proves nothing: {backwards}"
    for name, p in pipe.named_parameters():
        assert torch.equal(p.grad, one[name]), f"{name}: the failed step changed its gradient"
    pipe.train_step(*inputs, target=target, loss_fn=gpt.case.loss_fn)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, 2 * one[name], msg=lambda m, n=name: f"{n}: {m}")


def test_bad_example_inputs_and_train_step_arguments_say_what_to_do():
    """Issue 10: a bare tensor as example_inputs, an empty batch, train_step without a loss_fn
    and a loss_fn failing for want of a target gave raw tracebacks or unclear messages."""
    case = zoo.get("mlp", batch_size=4)
    x = case.example_inputs[0]
    with pytest.raises(ConfigError, match=r"bare tensor \[4, \d+\]; wrap it in a tuple"):
        fxsplit.compile(case.model, devices(2), x)
    with pytest.raises(ConfigError, match="0 samples"):
        fxsplit.compile(case.model, devices(2), (x[:0],))
    pipe = fxsplit.compile(case.model, devices(2), case.example_inputs, microbatches=2, schedule="gpipe")
    with pytest.raises(ConfigError, match="train_step needs loss_fn"):
        pipe.train_step(*case.example_inputs, target=None, loss_fn=None)
    with pytest.raises(ExecutionError, match=r"loss_fn failed on micro-batch 0.*given no target"):
        pipe.train_step(*case.example_inputs, loss_fn=case.loss_fn)


def test_repr_names_the_blocks_of_a_stage_that_is_not_one_run():
    """Regression (found re-reading the change): ``repr(pipe)`` printed ``min-max`` of a stage's
    blocks, so a looped plan's stage 0 read ``blocks 0-9`` while block 2 ran in stage 2."""
    from fxsplit.ir.units import format_ids

    case = zoo.get("gpt", batch_size=8)
    # analytic costs: the profiled ones vary with the machine's load, and so did this plan (a CI run)
    pipe = fxsplit.compile(case.model, devices(2), case.example_inputs, microbatches=4, schedule="interleaved-1f1b",
                           cost_model="analytic", options=fxsplit.CompileOptions(allow_idle_devices=False))
    text = repr(pipe)
    split = [st.blocks for st in pipe.plan.stages if tuple(st.blocks) != tuple(range(min(st.blocks), max(st.blocks) + 1))]
    assert split, "no stage of this plan has blocks out of one run; the test proves nothing"
    for blocks in split:
        assert f"blocks {format_ids(blocks)}," in text and f"blocks {min(blocks)}-{max(blocks)}," not in text, text


class _SizeAcrossStages(torch.nn.Module):
    """``b = x.shape[0]`` read once (one ``sym_size`` node under a symbolic batch) and used in the
    first and the last layer: the size crosses every stage boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = torch.nn.Linear(8, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        h = torch.relu(self.l1(x.reshape(b, 8)))
        h = torch.relu(self.l2(h))
        return self.l3(h).reshape(b, 2, 4).sum(1)


def test_a_symbolic_size_may_cross_stages_and_the_pipeline_trains_like_the_model():
    """A ``SymInt`` boundary value (seen on torch 2.11's export of a Hugging Face BERT, where the
    local codegen refused it) is an int at run time: it crosses, and loss and gradients match."""
    from fxsplit.codegen.split import _check_sendable
    from fxsplit.errors import PlanError

    torch.manual_seed(0)
    model = _SizeAcrossStages()
    batch = torch.export.Dim("batch")
    ep = torch.export.export(model, (torch.randn(8, 8),), dynamic_shapes=({0: batch},), strict=False)
    sizes = [n for n in ep.graph.nodes if isinstance(n.meta.get("val"), torch.SymInt)]
    assert sizes, "export read no symbolic size: the case tests nothing"
    _check_sendable(sizes, 0)
    bad = torch.fx.Graph().placeholder("bad")
    bad.meta["val"] = {"not": "sendable"}
    with pytest.raises(PlanError, match="would cross the boundary"):
        _check_sendable([bad], 0)

    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    pipe = fxsplit.compile(model, ["cpu"] * 3, (x,), microbatches=2, schedule="gpipe",
                           options=fxsplit.CompileOptions(allow_idle_devices=False, capture_method="export"))
    crossing = [n.name for st in pipe.program.stages[1:] for n in st.gm.graph.find_nodes(op="placeholder")]
    assert any(name.startswith("sym_size") for name in crossing), crossing
    loss = pipe.train_step(x, target=y, loss_fn=torch.nn.functional.mse_loss)
    ref_loss = torch.nn.functional.mse_loss(reference(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, msg=lambda m, n=name: f"gradient of {n}: {m}")


@pytest.mark.parametrize(("model", "cost_model"), [("mlp", "analytic"), ("mlp", "profiled"), ("resnet", "profiled")])
def test_a_dropped_pipeline_frees_the_model_weights(model, cost_model):
    """Once the user drops the pipeline and the model, the weights are freed (on a GPU: the
    memory comes back; found on an H100, where each compile kept the last model's weights). The
    activation-memory pass's autograd hook, held from C++ by the fake autograd graph, had the
    interpreter (the captured graph, every weight) in its closure: a cycle never collected."""
    import gc
    import weakref

    def build() -> weakref.ref:
        case = zoo.get(model, size="tiny", batch_size=8)
        weight = weakref.ref(next(case.model.parameters()))
        pipe = fxsplit.compile(case.model, ["cpu"] * 2, case.example_inputs, microbatches=2, schedule="gpipe",
                               cost_model=cost_model,
                               options=fxsplit.CompileOptions(allow_idle_devices=False, profile_cache_dir=False))
        x, y = case.make_batch(8, 1)
        pipe.train_step(*x, target=y, loss_fn=case.loss_fn)
        return weight

    weight = build()
    gc.collect()
    assert weight() is None, "a weight of the dropped pipeline is still alive"


def test_clip_grad_norm_clips_by_the_whole_models_norm() -> None:
    case = zoo.get("gpt")
    ref = copy.deepcopy(case.model)
    inputs, target = case.make_batch(4, 3)
    pipe = fxsplit.compile(case.model, ["cpu"] * 3, example_inputs=case.example_inputs)
    for norm_type in (2.0, 1.0, float("inf")):
        pipe.zero_grad()
        pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
        ref.zero_grad()
        case.loss_fn(ref(*inputs), target).backward()
        expected = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type))
        assert expected > 0.1  # the case clips
        assert pipe.clip_grad_norm_(0.05, norm_type) == pytest.approx(expected, rel=1e-5), norm_type
        grads = dict(ref.named_parameters(remove_duplicate=False))
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-8, msg=f"{norm_type} {name}")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="max_norm"):
            pipe.clip_grad_norm_(bad)


def test_an_output_the_pipeline_cannot_merge_is_refused_not_cut_to_one_micro_batch() -> None:
    """An output whose dim 0 is batch x seq (``logits.flatten(0, 1)``) used to come back as the
    first micro-batch's rows alone, silently; a value the same in every micro-batch is kept."""

    class Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 5)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            y = self.b(torch.relu(self.a(x)))
            return y.flatten(0, 1), y, torch.ones(3)

    torch.manual_seed(0)
    model, x = Flat(), torch.randn(4, 3, 8)
    pipe = fxsplit.compile(model, ["cpu"] * 2, (x,), microbatches=4)
    with pytest.raises(ConfigError, match=r"output 0 of the model differs between micro-batches .* \[3, 5\]"):
        pipe(x)
    single = fxsplit.compile(model, ["cpu"] * 2, (x,), microbatches=1)
    flat, whole, ones = single(x)
    torch.testing.assert_close(flat, model(x)[0])
    # the merge itself: batched rows concatenated, equal values kept, differing ones refused
    from fxsplit.runtime import merge_outputs

    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    assert merge_outputs([[a, "k", torch.ones(3)], [b, "k", torch.ones(3)]], [2, 2], [True, False, False])[1] == "k"
    with pytest.raises(ConfigError, match="output 1"):
        merge_outputs([[a, a], [b, b]], [2, 2], [True, False])


class _TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def _token_mean(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())  # ignore_index=-100


def _token_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")


def test_a_token_mean_over_uneven_padding_is_refused_not_reweighted() -> None:
    """cross_entropy's mean skips ignored tokens: with uneven padding the micro-batches' losses
    weighted by samples are not the batch's loss, and passed for a mean before (silently other
    gradients); even padding, or a token sum, trains as the unsplit model."""
    torch.manual_seed(0)
    model = _TinyLM()
    ids = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(2))
    uneven, even = target.clone(), target.clone()
    uneven[0, 2:] = -100
    even[:, 4:] = -100
    pipe = fxsplit.compile(model, ["cpu"] * 2, (ids,), microbatches=4)
    with pytest.raises(ConfigError, match="normalised by something other than the samples"):
        pipe.train_step(ids, target=uneven, loss_fn=_token_mean)
    for loss_fn, tgt in ((_token_mean, even), (_token_sum, uneven)):
        ref = copy.deepcopy(model)
        ref_loss = loss_fn(ref(ids), tgt)
        ref_loss.backward()
        pipe.zero_grad()
        loss = pipe.train_step(ids, target=tgt, loss_fn=loss_fn)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        grads = dict(ref.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_an_input_that_needs_a_gradient_gets_the_unsplit_models(schedule: str) -> None:
    """``train_step`` and the forward on an input with ``requires_grad``: its gradient is the
    unsplit model's, and no warning (stage 0 read ``.grad`` of the input's micro-batch views,
    which autograd never fills: a UserWarning every step)."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    pipe = fxsplit.compile(model, devices(3), (x,), microbatches=4, schedule=schedule, cost_model="analytic",
                           options=fxsplit.CompileOptions(allow_idle_devices=False))
    got, want = x.clone().requires_grad_(), x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        pipe.train_step(got, target=y, loss_fn=torch.nn.functional.mse_loss)
    torch.nn.functional.mse_loss(ref(want), y).backward()
    torch.testing.assert_close(got.grad, want.grad)
    got.grad = want.grad = None
    pipe(got).square().sum().backward()
    ref(want).square().sum().backward()
    torch.testing.assert_close(got.grad, want.grad)
