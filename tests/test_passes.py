"""The PassManager (requires, wrapping, verify, dump) and shape propagation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import fxsplit.models as zoo
from fxsplit.errors import AnnotationError, ConfigError, PassError
from fxsplit.passes.capture import capture
from fxsplit.passes.condense import CondenseAntichains
from fxsplit.passes.costs import AnnotateCosts
from fxsplit.passes.manager import PassManager, PassResult, carries_value, graph_pass, require_meta
from fxsplit.passes.shapes import PropagateShapes

METHODS = ("export", "symbolic_trace")


def _linear_gm(method: str = "symbolic_trace") -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    x = torch.randn(3, 4)
    cap = capture(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (x,), method=method)
    return cap.gm, [x]


@graph_pass(produces=("test.mark",))
def mark_nodes(gm: torch.fx.GraphModule) -> PassResult:
    for node in gm.graph.nodes:
        node.meta["test.mark"] = True
    return PassResult(gm)


@graph_pass(requires=("test.mark",))
def read_marks(gm: torch.fx.GraphModule) -> PassResult:
    for node in gm.graph.nodes:
        if node.op != "output":
            require_meta(node, "test.mark", "mark_nodes")
    return PassResult(gm)


@graph_pass()
def explode(gm: torch.fx.GraphModule) -> PassResult:
    raise KeyError("boom")


@graph_pass()
def refuse_config(gm: torch.fx.GraphModule) -> PassResult:
    raise ConfigError("bad option")


@graph_pass(produces=("test.never",))
def forget_to_produce(gm: torch.fx.GraphModule) -> PassResult:
    return PassResult(gm)


# ---------------------------------------------------------------- PassManager


def test_requires_are_checked_before_any_pass_runs() -> None:
    gm, _ = _linear_gm()
    ran: list[str] = []

    @graph_pass()
    def first(gm: torch.fx.GraphModule) -> PassResult:
        ran.append("first")
        return PassResult(gm)

    pm = PassManager([first, read_marks])
    with pytest.raises(AnnotationError, match=r"pass 'read_marks' requires .*'test.mark'"):
        pm.run(gm)
    assert ran == [], "a pass ran although a later pass could not have its requirements met"


def test_requires_satisfied_by_an_earlier_pass() -> None:
    gm, _ = _linear_gm()
    pm = PassManager([mark_nodes, read_marks], verify=True)
    pm.run(gm)
    assert [r.name for r in pm.records] == ["mark_nodes", "read_marks"]
    assert all(r.time_s >= 0 and r.num_nodes == len(gm.graph.nodes) for r in pm.records)


def test_requires_satisfied_by_the_graph_itself() -> None:
    gm, x = _linear_gm()
    PropagateShapes(x)(gm)
    PassManager([AnnotateCosts(_device())]).run(gm)  # "val" already there: no error
    assert all("fxsplit.cost" in n.meta for n in gm.graph.nodes if n.op != "output")


def test_class_pass_requires_are_checked_too() -> None:
    gm, _ = _linear_gm()
    with pytest.raises(AnnotationError, match=r"'annotate_costs' requires .*'val'"):
        PassManager([AnnotateCosts(_device())]).run(gm)


def test_foreign_exception_is_wrapped_naming_pass_and_predecessors() -> None:
    gm, _ = _linear_gm()
    with pytest.raises(PassError) as info:
        PassManager([mark_nodes, explode]).run(gm)
    msg = str(info.value)
    assert "'explode'" in msg and "mark_nodes" in msg and "boom" in msg
    assert isinstance(info.value.__cause__, KeyError)


def test_foreign_exception_in_first_pass_says_no_passes_before() -> None:
    gm, _ = _linear_gm()
    with pytest.raises(PassError, match="'explode' failed .*no passes"):
        PassManager([explode]).run(gm)


def test_fxsplit_errors_keep_their_type() -> None:
    gm, _ = _linear_gm()
    with pytest.raises(ConfigError, match="bad option"):
        PassManager([mark_nodes, refuse_config]).run(gm)


def test_verify_catches_a_pass_that_does_not_produce_what_it_declares() -> None:
    gm, _ = _linear_gm()
    with pytest.raises(PassError, match=r"'forget_to_produce' declares 'test.never' but node"):
        PassManager([forget_to_produce], verify=True).run(gm)
    PassManager([forget_to_produce], verify=False).run(gm)  # only verify looks


def test_verify_catches_a_graph_that_does_not_lint() -> None:
    @graph_pass()
    def break_graph(gm: torch.fx.GraphModule) -> PassResult:
        out = gm.graph.output_node()
        out.args = (tuple(out.args[0]) + (out,),)  # the output reads itself
        return PassResult(gm, modified=True)

    gm, _ = _linear_gm()
    with pytest.raises(PassError, match="does not lint after pass 'break_graph'"):
        PassManager([break_graph], verify=True).run(gm)


def test_dump_writes_one_file_per_pass(tmp_path: Path) -> None:
    gm, x = _linear_gm("export")
    pm = PassManager(
        [PropagateShapes(x), AnnotateCosts(_device()), CondenseAntichains()], dump_dir=tmp_path / "d"
    )
    pm.run(gm)
    files = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert files == [
        "000_captured.txt",
        "001_propagate_shapes.txt",
        "002_annotate_costs.txt",
        "003_condense_antichains.txt",
    ]
    last = (tmp_path / "d" / "003_condense_antichains.txt").read_text()
    assert "# graph after pass 3: condense_antichains" in last
    assert "linear" in last and "fxsplit.cost" in last and "fxsplit.block" in last
    assert "condense_antichains" in pm.artifacts


def test_pass_names_come_from_function_or_class() -> None:
    from fxsplit.passes.manager import pass_name

    assert pass_name(mark_nodes) == "mark_nodes"
    assert pass_name(PropagateShapes(())) == "propagate_shapes"
    assert pass_name(CondenseAntichains()) == "condense_antichains"


# ---------------------------------------------------------------- shape propagation


@pytest.mark.parametrize("method", METHODS)
def test_propagate_shapes_writes_val_on_every_node(method: str) -> None:
    case = zoo.get("resnet")
    cap = capture(case.model, case.example_inputs, method=method)
    flat = cap.flatten_inputs(case.example_inputs)
    PassManager([PropagateShapes(tuple(flat), force=True)], verify=True).run(cap.gm)
    out_val = cap.gm.graph.output_node().args[0][0].meta["val"]
    assert tuple(out_val.shape) == tuple(case.model(*case.example_inputs).shape)
    assert isinstance(out_val, torch._subclasses.fake_tensor.FakeTensor)


@pytest.mark.parametrize("method", METHODS)
def test_shape_passes_never_touch_the_real_model_state(method: str) -> None:
    # Regression: running the graph for shapes (and FLOPs) on the real parameters would run
    # BatchNorm's in-place updates (running_mean/var, num_batches_tracked += 1) on the user's
    # model; symbolic_trace graphs share their submodules with the model. The passes swap
    # parameters and buffers for fakes (fake_state) while they run.
    case = zoo.get("resnet")  # training mode: BatchNorm updates its running statistics
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    assert any(k.endswith("num_batches_tracked") for k in before)
    cap = capture(case.model, case.example_inputs, method=method)
    flat = cap.flatten_inputs(case.example_inputs)
    PassManager([PropagateShapes(tuple(flat), force=True), AnnotateCosts(_device())]).run(cap.gm)

    after = case.model.state_dict()
    changed = [k for k, v in before.items() if not torch.equal(v, after[k])]
    assert changed == []
    graph_state = dict(cap.gm.state_dict())
    for name, value in graph_state.items():
        if name in before:
            assert torch.equal(value, before[name]), name


def test_propagate_shapes_keeps_export_vals_unless_forced() -> None:
    gm, x = _linear_gm("export")
    vals = {n.name: n.meta["val"] for n in gm.graph.nodes if "val" in n.meta}
    assert not PropagateShapes(x)(gm).modified
    assert all(n.meta["val"] is vals[n.name] for n in gm.graph.nodes if n.name in vals)
    assert PropagateShapes(x, force=True)(gm).modified


def test_symbolic_trace_gpt_non_tensor_nodes_get_val() -> None:
    # Regression: the symbolically traced zoo GPT has ``tokens.device`` (a torch.device) and
    # ``tokens.size(1)`` nodes; torch's FakeTensorProp records "val" only for tensors and
    # numbers, so the device node had none and annotate_costs stopped with AnnotationError
    # ("node 'getattr_1' has no meta['val']"). PropagateShapes now stores immutable non-tensor
    # results (devices, dtypes, None) as they are.
    case = zoo.get("gpt")
    cap = capture(case.model, case.example_inputs, method="symbolic_trace")
    flat = cap.flatten_inputs(case.example_inputs)
    pm = PassManager([PropagateShapes(tuple(flat)), AnnotateCosts(_device()), CondenseAntichains()], verify=True)
    pm.run(cap.gm)
    devices = [n for n in cap.gm.graph.nodes if isinstance(n.meta.get("val"), torch.device)]
    assert devices, "expected the tokens.device node"
    assert all(n.meta["fxsplit.cost"].is_view for n in devices)


class NoGradBlock(nn.Module):
    """A forward with a ``torch.no_grad()`` block: export wraps it in a higher-order op whose
    subgraph is a ``get_attr`` of a GraphModule (as Hugging Face's rotary embedding does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("freq", torch.linspace(0.0, 1.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = (self.freq * 2).cos()
        return self.lin(x) * scale


class NoGradWrite(NoGradBlock):
    """A ``torch.no_grad()`` block that writes into an activation: capture keeps it a subgraph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        with torch.no_grad():
            y.clamp_(-0.5, 0.5)
        return y * (self.freq * 2).cos()


@pytest.mark.parametrize("cls, kept", [(NoGradBlock, False), (NoGradWrite, True)])
def test_no_grad_block_under_export_is_annotated_and_condensed(cls: type, kept: bool) -> None:
    # Regression: export turns a ``torch.no_grad()`` block into ``wrap_with_set_grad_enabled``
    # reading a ``get_attr`` of its subgraph GraphModule. That node has no tensor value, so
    # annotate_costs raised AnnotationError ("node 'submod_3' has no meta['val']") on every
    # Hugging Face Llama (its rotary embedding runs under no_grad), and PropagateShapes re-ran
    # on every call because not every node had "val". Capture now inlines such blocks
    # (passes.capture._inline_no_grad_regions); one that writes into an activation is kept,
    # and its subgraph node needs no "val" (manager.carries_value) and costs nothing; capture
    # does not list it as state.
    model, x = cls(), torch.randn(2, 4)
    cap = capture(model, (x,), method="export")
    subgraphs = [n for n in cap.gm.graph.nodes if n.op == "get_attr" and not carries_value(n)]
    assert bool(subgraphs) is kept, cap.gm.graph
    assert set(cap.aliases) == {"lin.weight", "lin.bias", "freq"}

    shapes = PropagateShapes((x,))
    assert not shapes(cap.gm).modified  # export's "val" is complete
    pm = PassManager([shapes, AnnotateCosts(_device()), CondenseAntichains()], verify=True)
    pm.run(cap.gm)
    condensed = pm.artifacts["condense_antichains"]
    assert condensed.graph.validate() == []
    assert condensed.graph.total_param_bytes == 4 * (16 + 4)
    torch.testing.assert_close(cap(x), model(x))


def _device():  # type: ignore[no-untyped-def]
    from fxsplit.ir import DeviceSpec

    return DeviceSpec("ref", peak_flops=1e12, memory_bandwidth_bytes_per_s=1e11)
