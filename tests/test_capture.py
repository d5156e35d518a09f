"""Capture: every zoo model and the Hugging Face models, both methods, meta-device 7B, errors."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils import _pytree as pytree

import fxsplit.models as zoo
from fxsplit.errors import CaptureError, ConfigError
from fxsplit.ir.downsets import DEFAULT_MAX_DOWNSETS
from fxsplit.passes.capture import METHODS, Captured, capture

ZOO = list(zoo.list_models())
METHODS_USED = ("export", "symbolic_trace")


def _assert_same_outputs(expected: object, actual: object) -> None:
    """Every tensor leaf of ``actual`` equals the matching leaf of ``expected``."""
    want, got = pytree.tree_leaves(expected), pytree.tree_leaves(actual)
    assert len(want) == len(got), f"{len(want)} outputs expected, got {len(got)}"
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        torch.testing.assert_close(g, w, msg=lambda m, i=i: f"output {i}: {m}")


def _state_names(model: nn.Module) -> set[str]:
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return names | {n for n, _ in model.named_buffers(remove_duplicate=False)}


# ---------------------------------------------------------------- zoo models


@pytest.mark.parametrize("method", METHODS_USED)
@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_captures_and_matches_eager(name: str, method: str) -> None:
    case = zoo.get(name)
    model = case.model.eval()  # eval: BatchNorm uses running stats, so two calls agree
    cap = capture(model, case.example_inputs, case.example_kwargs, method=method)

    assert isinstance(cap, Captured) and cap.method == method
    with torch.no_grad():
        _assert_same_outputs(model(*case.example_inputs), cap(*case.example_inputs))
    # The graph is flat: one placeholder per input leaf, a flat tuple out.
    assert len(cap.input_names) == len(pytree.tree_leaves((case.example_inputs, {})))
    out = cap.gm.graph.output_node().args[0]
    assert isinstance(out, tuple) and len(out) == cap.num_outputs


@pytest.mark.parametrize("method", METHODS_USED)
@pytest.mark.parametrize("name", ZOO)
def test_aliases_use_original_state_names(name: str, method: str) -> None:
    case = zoo.get(name)
    cap = capture(case.model, case.example_inputs, method=method)
    originals = _state_names(case.model)

    assert cap.aliases, "the graph reads no parameter or buffer"
    assert set(cap.aliases) <= originals, sorted(set(cap.aliases) - originals)
    for name_, names in cap.aliases.items():
        assert name_ in names and set(names) <= originals
    trainable = {n for n, p in case.model.named_parameters() if p.requires_grad}
    assert trainable <= set(cap.trainable)


@pytest.mark.parametrize("method", METHODS_USED)
def test_gpt_tied_embedding_shows_both_aliases(method: str) -> None:
    case = zoo.get("gpt")
    assert case.model.lm_head.weight is case.model.tok_emb.weight
    cap = capture(case.model, case.example_inputs, method=method)

    tied = {k: v for k, v in cap.aliases.items() if len(v) > 1}
    assert tied, cap.aliases
    for names in tied.values():
        assert set(names) == {"tok_emb.weight", "lm_head.weight"}


def test_auto_uses_export_first() -> None:
    cap = capture(nn.Linear(4, 2), (torch.randn(3, 4),))
    assert cap.method == "export"
    assert "method='export'" in repr(cap) and "outputs=1" in repr(cap)


def test_auto_falls_back_to_symbolic_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    import fxsplit.passes.capture as capture_mod

    def broken_export(*args: object) -> None:
        raise RuntimeError("export is broken today")

    monkeypatch.setattr(capture_mod, "_capture_export", broken_export)
    cap = capture(nn.Linear(4, 2), (torch.randn(3, 4),))
    assert cap.method == "symbolic_trace"


def test_keyword_inputs_are_flattened_in_order() -> None:
    class Scale(nn.Module):
        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return x * scale

    x, s = torch.randn(2, 3), torch.randn(3)
    for method in METHODS_USED:
        cap = capture(Scale(), (x,), {"scale": s}, method=method)
        assert len(cap.input_names) == 2
        torch.testing.assert_close(cap(x, scale=s), x * s)
        with pytest.raises(ConfigError, match="structure"):
            cap(x, s)  # positional instead of keyword: a different input structure


@pytest.mark.parametrize("method", METHODS_USED)
def test_keyword_order_does_not_matter(method: str) -> None:
    # Regression: flatten_inputs compared the pytree spec of the call's kwargs, whose dict
    # context keeps insertion order, with the captured one, so cap(x, b=b, a=a) raised
    # ConfigError for a model captured with {"a": a, "b": b}; the model itself accepts any
    # order. Keywords are now put in captured order first.
    class TwoKeywords(nn.Module):
        def forward(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return x * a - b

    x, a, b = torch.randn(2, 3), torch.randn(3), torch.randn(3)
    cap = capture(TwoKeywords(), (x,), {"a": a, "b": b}, method=method)
    torch.testing.assert_close(cap(x, b=b, a=a), x * a - b)
    torch.testing.assert_close(cap(x, a=a, b=b), x * a - b)
    with pytest.raises(ConfigError, match="structure"):
        cap(x, a=a)  # a missing keyword is still refused


def test_unknown_method_raises_config_error() -> None:
    with pytest.raises(ConfigError, match=r"method='trace' is unknown.*auto.*export.*symbolic_trace"):
        capture(nn.Linear(2, 2), (torch.randn(1, 2),), method="trace")
    assert METHODS == ("auto", "export", "symbolic_trace")


def test_non_module_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="needs an nn.Module"):
        capture(lambda x: x, (torch.randn(1),))  # type: ignore[arg-type]


# ---------------------------------------------------------------- the CaptureError message


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x)
        return x


def test_data_dependent_control_flow_error_names_line_methods_and_fix() -> None:
    with pytest.raises(CaptureError) as info:
        capture(DataDependent(), (torch.randn(2, 4),))
    msg = str(info.value)

    assert "could not capture DataDependent" in msg
    assert os.path.basename(__file__) in msg, msg  # the file of the failing line ...
    assert "if x.sum() > 0:" in msg, msg  # ... and its text
    assert "export:" in msg and "symbolic_trace:" in msg, msg  # what each method said
    assert "fix:" in msg and "torch.where" in msg, msg
    assert isinstance(info.value, RuntimeError) and info.value.__cause__ is not None


def test_single_method_error_reports_only_that_method() -> None:
    with pytest.raises(CaptureError) as info:
        capture(DataDependent(), (torch.randn(2, 4),), method="symbolic_trace")
    msg = str(info.value)
    assert "symbolic_trace:" in msg and "  export:" not in msg
    assert "if x.sum() > 0:" in msg


# ---------------------------------------------------------------- Hugging Face models


HF_NAMES = ("bert", "gpt2", "vit", "llama")


@pytest.mark.hf
@pytest.mark.parametrize("name", HF_NAMES)
def test_hf_model_exports_and_matches_eager(name: str) -> None:
    pytest.importorskip("transformers")
    case = zoo.hf(name, seq_len=8)
    cap = capture(case.model, case.example_inputs, case.example_kwargs, method="export")

    expected = case.model(*case.example_inputs, **case.example_kwargs)
    actual = cap(*case.example_inputs, **case.example_kwargs)
    assert type(actual) is type(expected)  # the ModelOutput comes back, not a bare tuple
    _assert_same_outputs(expected, actual)
    assert set(cap.aliases) <= _state_names(case.model)


@pytest.mark.hf
@pytest.mark.parametrize("name", HF_NAMES)
def test_hf_model_runs_through_the_front_end(name: str) -> None:
    # Regression (llama): the rotary embedding runs under torch.no_grad(), which export turns
    # into a higher-order op reading a get_attr of its subgraph module; that node has no "val",
    # so annotate_costs raised AnnotationError and capture listed "submod_1" as a parameter.
    pytest.importorskip("transformers")
    from fxsplit.api import analyze
    from fxsplit.ir import DeviceSpec

    case = zoo.hf(name, seq_len=8)
    device = DeviceSpec("ref", peak_flops=1e12, memory_bandwidth_bytes_per_s=1e11)
    ins = analyze(case.model, case.example_inputs, case.example_kwargs, method="export",
                  device=device, verify=True, max_downsets=1000)
    graph = ins.condensed.graph
    assert graph.validate() == [] and ins.condensed.num_blocks > 10
    assert graph.total_param_bytes == 4 * case.num_parameters()  # tied GPT-2 head counted once


@pytest.mark.hf
def test_hf_model_symbolic_trace_is_refused_with_a_pointer_to_export() -> None:
    pytest.importorskip("transformers")
    case = zoo.hf("gpt2", seq_len=8)
    with pytest.raises(CaptureError, match="method='export'"):
        capture(case.model, case.example_inputs, case.example_kwargs, method="symbolic_trace")


# ---------------------------------------------------------------- meta device, 7B

_META_7B = textwrap.dedent(
    """
    import json, resource, sys, torch
    import fxsplit.models as zoo
    from fxsplit.ir import DeviceSpec
    from fxsplit.passes.capture import capture
    from fxsplit.passes.condense import CondenseAntichains
    from fxsplit.passes.costs import AnnotateCosts
    from fxsplit.passes.manager import PassManager
    from fxsplit.passes.shapes import PropagateShapes

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.device("meta"):
        if sys.argv[1] == "llama":
            case = zoo.hf("llama", preset="7b", seq_len=8, batch_size=1)
        else:  # the zoo GPT at Llama-7B width and depth: no transformers needed
            case = zoo.get("gpt", vocab_size=32000, max_seq_len=64, seq_len=8, layers=32,
                           width=4096, heads=32, batch_size=1)
    cap = capture(case.model, case.example_inputs, case.example_kwargs, method="export")
    flat = cap.flatten_inputs(case.example_inputs, case.example_kwargs)
    device = DeviceSpec("ref", peak_flops=1e12, memory_bandwidth_bytes_per_s=1e11)
    pm = PassManager([PropagateShapes(tuple(flat)), AnnotateCosts(device), CondenseAntichains()])
    pm.run(cap.gm)
    condensed = pm.artifacts["condense_antichains"]
    print(json.dumps({
        "params": case.num_parameters(),
        "param_bytes": condensed.graph.total_param_bytes,
        "flops": sum(b.flops for b in condensed.graph.blocks),
        "blocks": condensed.num_blocks,
        "truncated": condensed.truncated,
        "downsets": condensed.num_downsets,
        "fine_blocks": condensed.fine_blocks,
        "faults": condensed.graph.validate(),
        "rss_before": before,
        "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))
    """
)


def _run_meta_7b(which: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _META_7B, which], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_meta_7b(result: dict, expected_params: float) -> None:
    assert result["params"] == pytest.approx(expected_params, rel=0.03)
    # fp32: 4 bytes per parameter, every parameter counted once, none allocated.
    assert result["param_bytes"] == 4 * result["params"]
    assert not result["faults"] and result["blocks"] > 32
    # 32 layers of little branches have far too many downsets; coarsening makes them fit.
    assert result["fine_blocks"] > result["blocks"]
    assert not result["truncated"] and result["downsets"] <= DEFAULT_MAX_DOWNSETS
    # forward FLOPs ~ 2 * params * tokens (8 tokens), attention and norms on top.
    assert 0.95 * 2 * result["params"] * 8 <= result["flops"] <= 3 * result["params"] * 8
    peak_gib = result["rss_peak"] / 2**30
    assert peak_gib < 4, f"peak RSS {peak_gib:.1f} GiB: weights were allocated"
    assert result["rss_peak"] - result["rss_before"] < 0.1 * result["param_bytes"]


@pytest.mark.slow
def test_meta_7b_gpt_shape_captures_and_annotates_without_weights() -> None:
    # 32 x (12 d^2) + vocab x d (tied) + positions, d = 4096
    d = 4096
    _check_meta_7b(_run_meta_7b("gpt"), 32 * 12 * d * d + 32000 * d)


@pytest.mark.slow
@pytest.mark.hf
def test_meta_llama_7b_captures_and_annotates_without_weights() -> None:
    pytest.importorskip("transformers")
    _check_meta_7b(_run_meta_7b("llama"), 6.74e9)


def test_symbolic_trace_refuses_a_buffer_update_it_cannot_trace_and_leaves_the_model_as_it_was() -> None:
    """Regression: symbolic_trace runs ``self.t += 1`` on the real buffer while tracing and records
    no update, so the graph read a constant from then on (a pipeline silently diverged from the
    model after its first step) and the model's counter had moved."""
    from pipeline_utils import StatefulBuffers

    model = StatefulBuffers()
    with pytest.raises(CaptureError, match=r"buffers \['t'\].*method='export'") as caught:
        capture(model, (torch.randn(4, 8),), method="symbolic_trace")
    assert "control flow" not in str(caught.value)  # its own fix, not the generic one
    assert float(model.t) == 0.0 and float(model.mean.abs().sum()) == 0.0
    assert capture(model, (torch.randn(4, 8),), method="auto").method == "export"


class _ViewWrites(nn.Module):
    """Writes through views of activations, as T5's and BART's ``_shift_right`` do
    (``shifted[:, 1:] = labels[:, :-1]``), each driven by ``ops``: ``("slice", start)`` copies
    rows in, ``("fill", col)`` fills a column through ``select``, ``("scale", col)`` multiplies
    a column in place (``mul_`` on a ``select``), ``("transposed", row)`` writes a row of the
    transpose; a view taken before the writes is read after them."""

    def __init__(self, ops: list[tuple[str, int]]) -> None:
        super().__init__()
        self.ops = ops
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))  # [batch, 6]
        buf = h.new_zeros(h.shape)
        early = buf[:, :3]  # a view made before the writes: it must show them
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 5
        for kind, k in self.ops:
            if kind == "slice":
                buf[:, k:] = h[:, : 6 - k] * 2
            elif kind == "fill":
                buf[:, k] = 0.5
            elif kind == "scale":
                buf[:, k] *= h[:, k]
            else:
                buf.t()[k] = h[:, k]
        y = self.b(buf + early.sum(-1, keepdim=True)) + shifted.float().mean(-1, keepdim=True)
        return y, shifted


VIEW_OPS = st.lists(st.tuples(st.sampled_from(["slice", "fill", "scale", "transposed"]), st.integers(0, 5)),
                    min_size=1, max_size=4)


@settings(max_examples=20, deadline=None)
@given(ops=VIEW_OPS)
def test_writes_through_views_become_edges_the_stages_keep(ops: list[tuple[str, int]]) -> None:
    """Regression (T5/BART decoder inputs all zeros once split): no in-place write through a view
    of an activation is left in the graph (each is a functional scatter whose result later
    readers read), and the graph computes the model's outputs and gradients."""
    from fxsplit.passes.capture import _views_to_base, writes_in_place

    torch.manual_seed(0)
    model = _ViewWrites(ops)
    x, ids = torch.randn(4, 6), torch.randint(0, 9, (4, 7))
    cap = capture(model, (x, ids))
    for node in cap.gm.graph.nodes:
        if writes_in_place(node):
            found = _views_to_base(node.args[0])
            assert found is None or not found[0] or found[1].op in ("get_attr", "placeholder"), node.format_node()
    got = cap.gm(*cap.flatten_inputs((x, ids), {}))
    want = model(x, ids)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])
    g_got = torch.autograd.grad(got[0].square().sum(), list(cap.gm.parameters()), allow_unused=True)
    g_want = torch.autograd.grad(want[0].square().sum(), list(model.parameters()), allow_unused=True)
    for a, b in zip(g_got, g_want, strict=True):  # None where the writes leave a weight unused (a fill)
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)


def test_writes_through_views_train_like_the_model_over_many_stages() -> None:
    """The T5/BART pattern split over 4 stages: the pipeline's outputs and every gradient are
    the model's, whichever stage the write and its readers land in."""
    import copy

    import fxsplit

    torch.manual_seed(0)
    model = _ViewWrites([("slice", 2), ("fill", 1), ("transposed", 4), ("scale", 3)])
    x, ids = torch.randn(8, 6), torch.randint(0, 9, (8, 7))
    ref = copy.deepcopy(model)
    pipe = fxsplit.compile(model, ["cpu"] * 4, (x, ids), microbatches=2, cost_model="analytic",
                           options=fxsplit.CompileOptions(allow_idle_devices=False))
    loss = pipe.train_step(x, ids, target=None, loss_fn=lambda out, _: out[0].square().mean())
    ref_loss = ref(x, ids)[0].square().mean()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    grads = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)
    assert torch.equal(pipe(x, ids)[1], ref(x, ids)[1])


def test_a_write_through_a_reshaped_view_is_named_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """A write fxsplit cannot rewrite (through ``view``) is left as it was, and the capture says
    where: a split could separate it from its readers."""

    class Reshaped(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            buf = torch.tanh(x).new_zeros(x.shape)
            buf.view(-1)[:3] = 1.0
            return buf + x

    with caplog.at_level("WARNING", logger="fxsplit.passes.capture"):
        cap = capture(Reshaped(), (torch.randn(4, 6),))
    assert "writes in place through a view fxsplit cannot rewrite" in caplog.text
    torch.testing.assert_close(cap.gm(*cap.flatten_inputs((torch.ones(4, 6),), {}))[0], Reshaped()(torch.ones(4, 6)))


class _Flags(nn.Module):
    """Computes and branches with Python arguments and a sequence length: export fixes them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0,
                gate: bool = False) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * scale
        if gate:
            h = h * torch.sigmoid(self.b(h))
        if mask is not None:
            h = h * mask.unsqueeze(-1)
        return self.b(h).sum(1) / x.shape[1]


def test_inputs_the_capture_fixed_are_checked_at_every_call() -> None:
    """Reliability (a probe found each silently running the captured values): export fixes
    Python arguments (a float the model computes with, a bool it branches on, None for an
    optional tensor) and sizes the model uses as numbers (``x.shape[1]``); a call with other
    values is a ConfigError naming the input, the values and the fix, as export's own module
    refuses it, while the batch (symbolic) may change."""
    model = _Flags()
    x = torch.randn(4, 8, 6)
    cap = capture(model, (x,), {"scale": 0.5, "gate": True}, method="export", dynamic_batch=True)
    assert [g.kind for g in cap.guards] == ["tensor", "constant", "constant"]
    assert cap.guards[0].sizes == (None, 8, 6)  # the batch stays symbolic
    torch.testing.assert_close(cap(torch.randn(6, 8, 6), scale=0.5, gate=True).shape, torch.Size([6, 6]))
    cases = [
        (((x,), {"scale": 2.0, "gate": True}), r"kwargs\['scale'\] is float 2\.0 but the model was captured with 0\.5"),
        (((x,), {"scale": 0.5, "gate": False}), r"kwargs\['gate'\] is bool False but the model was captured with True"),
        (((torch.randn(4, 5, 6),), {"scale": 0.5, "gate": True}), r"args\[0\] has shape \[4, 5, 6\]: dim 1 is 5 \(captured 8\)"),
    ]
    for (args, kwargs), match in cases:
        with pytest.raises(ConfigError, match=match):
            cap(*args, **kwargs)
    assert cap(x, scale=0.5, gate=True).shape == (4, 6)
    cap1 = capture(model, (x,), {"scale": 1}, method="export", dynamic_batch=True)
    cap1(x, scale=1.0)  # 1 == 1.0, as export's guard takes it


def test_a_pipeline_refuses_a_tensor_where_it_was_captured_with_none() -> None:
    """``mask=None`` at compile, a mask at the call: the graph has no mask in it (the staged model
    would ignore it); a ConfigError on the local pipeline, for the forward and ``train_step``."""
    import fxsplit

    model = _Flags()
    x = torch.randn(4, 8, 6)
    pipe = fxsplit.compile(model, ["cpu", "cpu"], (x,), {"mask": None}, microbatches=2, cost_model="analytic",
                           options=fxsplit.CompileOptions(allow_idle_devices=False))
    mask = torch.ones(4, 8)
    with pytest.raises(ConfigError, match=r"kwargs\['mask'\] is a tensor of shape \[4, 8\] but the model was captured with None"):
        pipe(x, mask=mask)
    with pytest.raises(ConfigError, match=r"kwargs\['mask'\] is a tensor"):
        pipe.train_step(x, mask=mask, target=torch.zeros(4, 6), loss_fn=nn.functional.mse_loss)
    assert pipe(x, mask=None).shape == (4, 6)


@settings(max_examples=30, deadline=None)
@given(scale=st.sampled_from([0.5, 2.0, -1.0]), gate=st.booleans(), length=st.sampled_from([8, 3, 9]),
       batch=st.integers(1, 5))
def test_a_call_either_matches_the_captured_model_or_is_refused(scale: float, gate: bool, length: int,
                                                                batch: int) -> None:
    """Property: for any call, the captured graph gives the model's own output, or refuses; it
    refuses exactly the calls whose values differ from what the capture fixed."""
    torch.manual_seed(0)
    model = _Flags()
    cap = capture(model, (torch.randn(3, 8, 6),), {"scale": 0.5, "gate": True}, method="export", dynamic_batch=True)
    x = torch.randn(batch, length, 6)
    try:
        got = cap(x, scale=scale, gate=gate)
    except ConfigError:
        assert (scale, gate, length) != (0.5, True, 8)
        return
    assert (scale, gate, length) == (0.5, True, 8)
    torch.testing.assert_close(got, model(x, scale=scale, gate=gate))


class _NoGradBlocks(nn.Module):
    """A step counter and a scale computed from the activations under ``torch.no_grad()``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            self.count += 1
            scale = 1.0 + h.abs().amax(-1, keepdim=True) * self.b.weight.sum()  # no gradient through it
        h = torch.tanh(self.b(h)) * self.count * scale
        return self.c(h)


def test_no_grad_blocks_are_inlined_and_keep_their_meaning() -> None:
    """Reliability (a probe: a counter updated under ``torch.no_grad()`` was updated once per
    micro-batch, silently): export's ``wrap_with_set_grad_enabled`` subgraphs are inlined, their
    operands detached (buffers excepted), so the graph computes the model's outputs and the
    model's gradients (none through the block) and the counter's update is an ordinary write."""
    torch.manual_seed(0)
    model = _NoGradBlocks()
    x = torch.randn(4, 6)
    ref = copy.deepcopy(model)
    cap = capture(model, (x,), method="export", dynamic_batch=True)
    targets = {n.target for n in cap.gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.higher_order.wrap_with_set_grad_enabled not in targets
    assert not any(isinstance(m, torch.fx.GraphModule) for _, m in cap.gm.named_children())
    got = cap(x)
    want = ref(x)
    torch.testing.assert_close(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    params = dict(cap.gm.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")
    assert float(dict(cap.gm.named_buffers())["count"]) == float(ref.count) == 1.0


def test_a_counter_under_no_grad_is_updated_once_per_step_by_the_pipeline() -> None:
    """The probe's case: 3 stages, 4 micro-batches, 1F1B: outputs, loss, every gradient and the
    counter as the unsplit model's (before, it counted micro-batches)."""
    import fxsplit

    torch.manual_seed(0)
    model = _NoGradBlocks()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    pipe = fxsplit.compile(model, ["cpu"] * 3, (x,), microbatches=4, schedule="1f1b", cost_model="analytic",
                           options=fxsplit.CompileOptions(allow_idle_devices=False))
    loss = pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss)
    want = nn.functional.mse_loss(ref(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    grads = dict(pipe.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")
    assert float(pipe.state_dict()["count"]) == float(ref.count) == 1.0
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), ref(x))


class _Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"y": self.b(torch.tanh(self.a(x))), "n": x.shape[0], "k": 2 * x.shape[0] + 1}


def test_an_output_computed_from_the_batch_size_is_the_batchs() -> None:
    """Reliability (a probe: ``x.shape[0]`` returned came back as a micro-batch's count, 4 of 8):
    an output that is a number of the inputs' sizes is evaluated for the whole batch, at any
    batch and with uneven micro-batches."""
    import fxsplit

    model = _Counts()
    pipe = fxsplit.compile(model, ["cpu", "cpu"], (torch.randn(8, 6),), microbatches=3, cost_model="analytic",
                           options=fxsplit.CompileOptions(allow_idle_devices=False))
    for batch in (8, 7, 11):
        x = torch.randn(batch, 6)
        out, want = pipe(x), model(x)
        assert (out["n"], out["k"]) == (want["n"], want["k"]) == (batch, 2 * batch + 1)
        torch.testing.assert_close(out["y"], want["y"])


class _FixedBatch(nn.Module):
    """``math.sqrt(x.shape[0])`` makes export fix the batch; ``temperature`` is an output with
    no batch whose dim 0 equals a micro-batch's size."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.temperature = nn.Parameter(torch.tensor([0.5, 2.0]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import math

        return self.b(torch.tanh(self.a(x))) / math.sqrt(x.shape[0]), self.temperature * 1.0


def test_an_output_no_input_reaches_is_never_taken_for_a_batched_one() -> None:
    """Reliability (a probe: with the batch fixed by export, a ``[2]`` parameter output was
    concatenated into ``[8]`` over micro-batches of 2): an output no input reaches is not
    batched, whatever its shape; the forward, the loss and every gradient are the model's (a
    ``[2]`` target leaf without the batch is not taken for a micro-batch's either)."""
    import fxsplit

    torch.manual_seed(0)
    model = _FixedBatch()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 6)
    pipe = fxsplit.compile(model, ["cpu"] * 3, (x,), microbatches=4, cost_model="analytic",
                           options=fxsplit.CompileOptions(allow_idle_devices=False))
    assert pipe.batched_outputs == (None, False)  # the batch is fixed: shape decides only the first
    with torch.no_grad():
        out, want = pipe(x), ref(x)
    assert out[1].shape == (2,)
    torch.testing.assert_close(out, want)
    target = (torch.randn(8, 6), torch.zeros(2))

    def loss_fn(o: Any, t: Any) -> torch.Tensor:
        return nn.functional.mse_loss(o[0], t[0]) + nn.functional.mse_loss(o[1], t[1])

    loss = pipe.train_step(x, target=target, loss_fn=loss_fn)
    expected = loss_fn(ref(x), target)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    grads = dict(pipe.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")


class _VarKeywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.a(x) * (2.0 if kwargs.get("double") else 1.0)


def test_a_keyword_in_var_kwargs_that_export_cannot_take_is_named_with_the_fix() -> None:
    """torch.export (2.13) fails on a symbolic batch with keywords that land in ``**kwargs``
    (a probe: GPT-2's ``output_hidden_states=True``); the CaptureError names the keyword and the
    fixes instead of the generic advice about control flow; without a symbolic batch it captures."""
    x = torch.randn(3, 4)
    with pytest.raises(CaptureError, match=r"\*\*kwargs \(\['double'\]\); set them on the model instead") as info:
        capture(_VarKeywords(), (x,), {"double": True}, method="export", dynamic_batch=True)
    assert "control flow" not in str(info.value)
    model = _VarKeywords()
    cap = capture(model, (x,), {"double": True}, method="export", dynamic_batch=False)
    torch.testing.assert_close(cap(x, double=True), model(x, double=True))


def test_a_size_output_of_a_size_no_input_has_is_refused() -> None:
    """``size_output_values`` evaluates the capture's formulas at the inputs' sizes; a formula in
    a symbol no input carries (a data-dependent size) cannot be evaluated: a ConfigError, never
    a micro-batch's value."""
    import dataclasses

    import sympy

    cap = capture(_Counts(), (torch.randn(8, 6),), method="export", dynamic_batch=True)
    assert cap.size_output_values([torch.randn(5, 6)]) == {1: 5, 2: 11}
    stray = dataclasses.replace(cap, size_outputs={1: sympy.Symbol("u0", integer=True) + 1})
    with pytest.raises(ConfigError, match=r"output 1 of the model is a number computed from sizes \(u0 \+ 1\)"):
        stray.size_output_values([torch.randn(5, 6)])
