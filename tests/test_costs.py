"""Cost annotation: FLOPs against hand formulas, the roofline, bytes, and the measured model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxsplit.models as zoo
from fxsplit.errors import ConfigError
from fxsplit.ir import DeviceSpec
from fxsplit.passes.capture import capture
from fxsplit.passes.condense import condense_antichains
from fxsplit.passes.costs import AnnotateCosts, NodeCost
from fxsplit.passes.shapes import PropagateShapes

METHODS = ("export", "symbolic_trace")
F32 = 4


def _annotate(model: nn.Module, inputs: tuple, method: str, device: DeviceSpec) -> torch.fx.GraphModule:
    cap = capture(model, inputs, method=method)
    gm = cap.gm
    PropagateShapes(tuple(cap.flatten_inputs(inputs)))(gm)
    AnnotateCosts(device)(gm)
    return gm


def _compute_costs(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, NodeCost]]:
    """(node, cost) of every node that is not free, in graph order."""
    return [
        (n, n.meta["fxsplit.cost"]) for n in gm.graph.nodes
        if n.op != "output" and not n.meta["fxsplit.cost"].is_view
    ]


def _param_bytes(gm: torch.fx.GraphModule) -> int:
    return sum(n.meta["fxsplit.cost"].param_bytes for n in gm.graph.nodes if n.op != "output")


def _only(gm: torch.fx.GraphModule) -> NodeCost:
    costs = _compute_costs(gm)
    assert len(costs) == 1, [n.name for n, _ in costs]
    return costs[0][1]


# ---------------------------------------------------------------- FLOPs vs hand formulas


@pytest.mark.parametrize("method", METHODS)
def test_linear_flops_and_roofline(method: str, ref_device: DeviceSpec) -> None:
    m, k, n = 5, 8, 6
    gm = _annotate(nn.Linear(k, n), (torch.randn(m, k),), method, ref_device)
    cost = _only(gm)

    assert cost.flops == 2 * m * n * k
    assert cost.bwd_flops == 2 * cost.flops  # grad of input and of weight
    moved = F32 * (m * k + n * k + n + m * n)  # x, weight, bias in; y out
    assert cost.fwd_s == pytest.approx(max(cost.flops / 1e12, moved / 1e11))
    assert cost.bwd_s == pytest.approx(max(cost.bwd_flops / 1e12, 2 * moved / 1e11))
    assert _param_bytes(gm) == F32 * (n * k + n)  # on the node or its get_attr inputs
    assert cost.output_bytes == F32 * m * n
    # what autograd keeps: the input x (for the weight's gradient), charged to the node that made
    # it (the placeholder); the output is saved by nothing (passes.autograd_memory)
    assert cost.saved_bytes == 0
    saved = {n.op: n.meta["fxsplit.cost"].saved_bytes for n in gm.graph.nodes if n.op != "output"}
    assert saved["placeholder"] == F32 * m * k
    assert cost.source == "analytic" and cost.analytic_fwd_s == cost.fwd_s


@pytest.mark.parametrize("method", METHODS)
def test_activation_memory_is_what_autograd_saves(method: str, ref_device: DeviceSpec) -> None:
    """linear -> relu -> add: the linear keeps its input, the relu its output, the add nothing;
    each saved tensor counts once, at the node that produced it (a view is its base's)."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.fc(x))
            return h + h.view(4, 8)

    gm = _annotate(Net(), (torch.randn(4, 8),), method, ref_device)
    saved = {n.name: n.meta["fxsplit.cost"].saved_bytes for n in gm.graph.nodes if n.op != "output"}
    relu = next(k for k in saved if "relu" in k)
    assert saved[relu] == F32 * 4 * 8  # relu saves its output (its own gradient needs it)
    assert sum(saved.values()) == F32 * 4 * 8 * 2  # + the input x kept by the linear; the add keeps nothing


@pytest.mark.parametrize("method", METHODS)
def test_roofline_takes_the_compute_roof_when_bandwidth_is_ample(method: str) -> None:
    slow_compute = DeviceSpec("slow", peak_flops=1e9, memory_bandwidth_bytes_per_s=1e15)
    m, k, n = 16, 32, 32
    cost = _only(_annotate(nn.Linear(k, n), (torch.randn(m, k),), method, slow_compute))
    assert cost.fwd_s == pytest.approx(2 * m * n * k / 1e9)
    assert cost.bwd_s == pytest.approx(2 * 2 * m * n * k / 1e9)


def test_op_overhead_is_added_per_operator() -> None:
    device = DeviceSpec("o", peak_flops=1e12, memory_bandwidth_bytes_per_s=1e11, op_overhead_s=1e-6)
    base = DeviceSpec("b", peak_flops=1e12, memory_bandwidth_bytes_per_s=1e11)
    x = (torch.randn(5, 8),)
    with_o = _only(_annotate(nn.Linear(8, 6), x, "export", device))
    without = _only(_annotate(nn.Linear(8, 6), x, "export", base))
    assert with_o.fwd_s == pytest.approx(without.fwd_s + 1e-6)
    assert with_o.bwd_s == pytest.approx(without.bwd_s + 2e-6)


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


@pytest.mark.parametrize("method", METHODS)
def test_conv2d_flops(method: str, ref_device: DeviceSpec) -> None:
    batch, cin, cout, h, w, kh, kw = 2, 3, 4, 9, 7, 3, 3
    ho, wo = (h + 2 - kh) // 2 + 1, (w + 2 - kw) // 2 + 1
    cost = _only(_annotate(Conv(), (torch.randn(batch, cin, h, w),), method, ref_device))
    assert cost.flops == 2 * batch * cout * ho * wo * cin * kh * kw
    assert cost.bwd_flops == 2 * cost.flops
    assert cost.output_bytes == F32 * batch * cout * ho * wo


class MatmulParam(nn.Module):
    """``relu(x @ w)`` with ``w`` a parameter: the matmul needs a gradient, so does the relu."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(k, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.matmul(x, self.w))


@pytest.mark.parametrize("method", METHODS)
def test_matmul_flops_and_backward_is_twice_forward(method: str, ref_device: DeviceSpec) -> None:
    b, m, k, n = 3, 4, 5, 6
    gm = _annotate(MatmulParam(k, n), (torch.randn(b, m, k),), method, ref_device)
    (mm_node, mm), (relu_node, relu) = _compute_costs(gm)
    assert mm.flops == 2 * b * m * n * k
    assert mm.bwd_flops == 2 * mm.flops  # counted op: grad of both operands
    assert relu.flops == b * m * n  # one FLOP per element
    assert relu.bwd_flops == relu.flops  # elementwise: 1x
    assert _param_bytes(gm) == F32 * k * n


class Products(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.bmm(a, b), torch.matmul(a, b)


@pytest.mark.parametrize("method", METHODS)
def test_bmm_and_matmul_flops_without_gradients(method: str, ref_device: DeviceSpec) -> None:
    bs, m, k, n = 4, 3, 5, 6
    gm = _annotate(Products(), (torch.randn(bs, m, k), torch.randn(bs, k, n)), method, ref_device)
    costs = _compute_costs(gm)
    assert [c.flops for _, c in costs] == [2 * bs * m * n * k] * 2
    # No input requires a gradient and no parameter is upstream: no backward.
    assert all(c.bwd_flops == 0 and c.bwd_s == 0 and c.saved_bytes == 0 for _, c in costs)


class Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("method", METHODS)
def test_attention_flops(method: str, ref_device: DeviceSpec) -> None:
    b, h, lq, s, e, ev = 2, 3, 7, 9, 16, 12
    q, k, v = torch.randn(b, h, lq, e), torch.randn(b, h, s, e), torch.randn(b, h, s, ev)
    cost = _only(_annotate(Attention(), (q, k, v), method, ref_device))
    # Q K^T: 2·B·H·L·S·E, then P V: 2·B·H·L·S·Ev (softmax not counted).
    assert cost.flops == 2 * b * h * lq * s * (e + ev)
    assert cost.output_bytes == F32 * b * h * lq * ev


class Views(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y.view(2, 3, 6).transpose(1, 2).reshape(2, 18).unsqueeze(0)


@pytest.mark.parametrize("method", METHODS)
def test_views_cost_nothing(method: str, ref_device: DeviceSpec) -> None:
    gm = _annotate(Views(), (torch.randn(6, 6),), method, ref_device)
    views = [
        n for n in gm.graph.nodes
        if n.op in ("call_function", "call_method") and not n.name.startswith("lin")
    ]
    assert len(views) == 4, [n.name for n in views]
    for node in views:
        cost = node.meta["fxsplit.cost"]
        assert cost.is_view and cost.is_free, node.name
        assert cost.flops == 0 and cost.fwd_s == 0 and cost.bwd_s == 0 and cost.saved_bytes == 0
    assert len(_compute_costs(gm)) == 1  # only the linear


@pytest.mark.parametrize("method", METHODS)
def test_placeholders_and_state_are_free(method: str, ref_device: DeviceSpec) -> None:
    gm = _annotate(nn.Linear(4, 4), (torch.randn(2, 4),), method, ref_device)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            assert node.meta["fxsplit.cost"].is_free


def test_matmul_flops_are_never_zero_on_meta_tensors(ref_device: DeviceSpec) -> None:
    with torch.device("meta"):
        model, x = nn.Linear(64, 32), torch.randn(8, 64)
    cost = _only(_annotate(model, (x,), "export", ref_device))
    assert cost.flops == 2 * 8 * 64 * 32


# ---------------------------------------------------------------- whole models


@pytest.mark.parametrize("method", METHODS)
def test_tied_embedding_bytes_are_counted_once(method: str, ref_device: DeviceSpec) -> None:
    # Regression: symbolic_trace keeps the tied GPT head as two call_module nodes (tok_emb,
    # lm_head) owning the same tensor; _state_bytes counted it at both, so the graph had
    # 16 KiB more parameters than the model (138752 vs 122368 bytes for the tiny GPT). Each
    # tensor is now counted once, at the first node that reads it.
    case = zoo.get("gpt")
    gm = _annotate(case.model, case.example_inputs, method, ref_device)
    costs = [n.meta["fxsplit.cost"] for n in gm.graph.nodes if n.op != "output"]
    assert sum(c.param_bytes for c in costs) == F32 * case.num_parameters()
    buffers = sum(b.numel() * b.element_size() for b in case.model.buffers())
    assert sum(c.buffer_bytes for c in costs) == buffers
    # The head still pays for reading its weight in the roofline.
    head = [c for c in costs if c.flops == 2 * 2 * 16 * 32 * 128]
    assert head and head[0].fwd_s > F32 * 128 * 32 / 1e11


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ["mlp", "resnet", "unet", "inception"])
def test_zoo_param_bytes_match_the_model(name: str, method: str, ref_device: DeviceSpec) -> None:
    case = zoo.get(name)
    gm = _annotate(case.model, case.example_inputs, method, ref_device)
    graph = condense_antichains(gm).graph
    assert graph.total_param_bytes == F32 * case.num_parameters()


def test_unknown_cost_model_raises_config_error(ref_device: DeviceSpec) -> None:
    cap = capture(nn.Linear(2, 2), (torch.randn(1, 2),))
    with pytest.raises(ConfigError, match="cost_model='guess' is unknown"):
        AnnotateCosts(ref_device, cost_model="guess")(cap.gm)


def test_measured_needs_example_inputs(ref_device: DeviceSpec) -> None:
    cap = capture(nn.Linear(2, 2), (torch.randn(1, 2),))
    with pytest.raises(ConfigError, match="needs example_inputs"):
        AnnotateCosts(ref_device, cost_model="measured")(cap.gm)


# ---------------------------------------------------------------- measured cost model


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ["mlp", "resnet"])
def test_measured_cost_model(name: str, method: str, ref_device: DeviceSpec) -> None:
    case = zoo.get(name, blocks=(1,)) if name == "resnet" else zoo.get(name)
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    cap = capture(case.model, case.example_inputs, method=method)
    flat = tuple(cap.flatten_inputs(case.example_inputs))
    PropagateShapes(flat)(cap.gm)
    analytic = {n.name: n.meta["fxsplit.cost"] for n in _annotated_copy(cap.gm, ref_device)}
    AnnotateCosts(ref_device, cost_model="measured", example_inputs=flat, warmup=1, repeats=2)(cap.gm)

    compute = _compute_costs(cap.gm)
    assert compute
    for node, cost in compute:
        assert cost.source == "measured", node.name
        assert cost.fwd_s > 0, node.name
        assert cost.analytic_fwd_s == pytest.approx(analytic[node.name].fwd_s), node.name
        assert cost.analytic_bwd_s == pytest.approx(analytic[node.name].bwd_s), node.name
        assert cost.flops == analytic[node.name].flops
    needs_grad = [c for _, c in compute if c.bwd_flops > 0]
    # Timed in context, a node that makes no autograd node of its own (nn.Identity returns its
    # input) has no backward; every node with parameters has one.
    assert needs_grad and all(c.bwd_s >= 0 for c in needs_grad)
    assert all(c.bwd_s > 0 for c in needs_grad if c.param_bytes > 0)
    # The user's model (and its BatchNorm statistics) is untouched.
    after = case.model.state_dict()
    assert [k for k, v in before.items() if not torch.equal(v, after[k])] == []


def _annotated_copy(gm: torch.fx.GraphModule, device: DeviceSpec) -> list[torch.fx.Node]:
    """Analytic annotation on a copy of ``gm`` (``node.meta`` is copied with the graph)."""
    import copy

    other = copy.deepcopy(gm)
    AnnotateCosts(device)(other)
    return [n for n in other.graph.nodes if n.op != "output"]


def test_measured_cpu_spec_is_positive(cpu_spec: DeviceSpec) -> None:
    assert cpu_spec.kind == "cpu" and cpu_spec.torch_device == "cpu"
    assert cpu_spec.peak_flops > 1e8 and cpu_spec.memory_bandwidth_bytes_per_s > 1e8
    assert cpu_spec.memory_bytes > 2**30
    cpu_spec.check()


def test_measured_times_are_scaled_from_one_microbatch():
    """compile(cost_model="measured", microbatches=m) times one micro-batch and stores m x that
    time for the batch, so the per-micro-batch cost the planner sees is a measured one."""
    import torch

    from fxsplit.ir import DeviceSpec
    from fxsplit.passes.capture import capture
    from fxsplit.passes.costs import AnnotateCosts
    from fxsplit.passes.measure import measure_node_times
    from fxsplit.passes.shapes import PropagateShapes

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(8, 8)
    cap = capture(model, (x,))
    PropagateShapes((x,))(cap.gm)
    AnnotateCosts(DeviceSpec("ref"))(cap.gm)
    times = measure_node_times(cap.gm, (x[:2],), "cpu", warmup=1, repeats=3, scale=4.0)
    assert times
    for node in cap.gm.graph.nodes:
        if node.name in times:
            cost = node.meta["fxsplit.cost"]
            assert cost.source == "measured"
            assert cost.fwd_s == times[node.name][0] * 4.0 and cost.bwd_s == times[node.name][1] * 4.0


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.att = nn.MultiheadAttention(32, 4, batch_first=True)
        self.fc = nn.Linear(32, 32)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("table", torch.randn(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.att(x, x, x)
        return self.drop(self.fc(h)) + x * self.table[:16]


@pytest.mark.parametrize("method", METHODS)
def test_activation_bytes_equal_what_autograd_keeps_on_real_tensors(method: str, ref_device: DeviceSpec) -> None:
    """Review findings: tensors made inside a node and never handed on (dropout's mask, attention's
    internals) were not charged, and a slice of a constant charged its whole storage. The estimate
    (fake tensors) now equals what autograd saves on real ones, parameters and constants aside."""
    model, x = _Attention().train(), torch.randn(4, 16, 32)
    gm = _annotate(model, (x,), method, ref_device)
    estimate = sum(n.meta["fxsplit.cost"].saved_bytes for n in gm.graph.nodes if n.op != "output")
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    assert estimate == sum(b for ptr, b in seen.items() if ptr not in state)
    before = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    AnnotateCosts(ref_device)(gm)
    assert all(n.meta.get("val") is before[n.name] for n in gm.graph.nodes)  # the shapes are not touched
