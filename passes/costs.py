"""Cost annotation: FLOPs, bytes and time of every node, analytic (roofline) or measured.

Analytic model (default), per node, on a :class:`~fxsplit.ir.DeviceSpec` ``d``:

* FLOPs from torch's ``FlopCounterMode`` (matmul, convolution, attention kernels), run on fake
  tensors; attention that the counter does not see (``scaled_dot_product_attention`` on CPU) is
  counted as ``2·B·H·L·S·(E + Ev)``; every other non-view op costs one FLOP per element of its
  largest tensor operand or result (pointwise and reduction rule); views, ``getitem``,
  placeholders and ``get_attr`` cost nothing. Never silently 0 for a matmul or convolution.
* backward FLOPs: ``2 ×`` forward for counted ops (gradient of input and of weight), ``1 ×``
  for elementwise ops, 0 when nothing upstream needs a gradient.
* bytes moved: tensor operands plus results (0 for views); time is the roofline plus the
  device's per-operator overhead ``o`` (kernel launch, dispatch):
  ``fwd_s = max(flops / peak, bytes / d.memory_bandwidth_bytes_per_s) + o`` and
  ``bwd_s = max(bwd_flops / peak, 2 · bytes / bandwidth) + 2·o``, where ``peak`` is the
  device's roof for the dtype the node computes in (``d.peak_flops_for``: fp32 math on a GPU
  preset runs at its fp32 rate, bf16/fp16 at its tensor-core rate). The overhead is the fixed
  part of the time (``fwd_fixed_s = o``, ``bwd_fixed_s = 2·o``): a micro-batch of any size pays
  it whole.
* memory: ``param_bytes``/``buffer_bytes`` of the state the node reads (a tensor read by
  several nodes, e.g. a tied embedding, is counted once, at the first), ``output_bytes`` of its
  result, ``saved_bytes`` = the bytes of what it produced that autograd saves for backward
  (:mod:`fxsplit.passes.autograd_memory`, read from autograd on fake tensors; where the graph
  does not run on fakes, its result when it needs a gradient and is not a view).

``cost_model="measured"`` runs every node on real tensors on ``device`` (warm-up, median of
repeats) for forward and backward time, and keeps the analytic times beside them.
``cost_model="profiled"`` times every node at the micro-batch sizes that run and fits
``t0 + t1 * b`` (:mod:`fxsplit.passes.profile`), with a cache on disk.

References:
    Williams, Waterman, Patterson, "Roofline", CACM 2009; Kaplan et al. 2020 (training FLOPs
    = 3 × forward).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from fxsplit.errors import ConfigError
from fxsplit.ir.devices import DeviceSpec, GiB
from fxsplit.ir.names import COST_MODELS
from fxsplit.passes.autograd_memory import autograd_saved_bytes
from fxsplit.passes.manager import PassResult, carries_value, getattr_path, require_meta
from fxsplit.passes.measure import measure_node_times, median_time_s
from fxsplit.passes.profile import profile_node_times
from fxsplit.passes.shapes import (
    MetaDevicesMoved,
    autocast_run_device,
    fake_like,
    fake_mode_of,
    fake_state,
)

__all__ = ["NodeCost", "AnnotateCosts", "annotate_costs", "measure_cpu_spec", "COST_MODELS", "node_cost", "weight_share",
           "cost_nodes"]

log = logging.getLogger(__name__)

_ATTENTION: set[Any] = {
    torch.ops.aten.scaled_dot_product_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.nn.functional.scaled_dot_product_attention,
}
_EMBEDDING: set[Any] = {torch.ops.aten.embedding.default, torch.nn.functional.embedding}
# Tensor methods / functions that only re-view their input (symbolic_trace graphs).
_VIEW_NAMES = {
    "view", "reshape", "transpose", "permute", "flatten", "unflatten", "unsqueeze", "squeeze",
    "expand", "expand_as", "view_as", "t", "narrow", "select", "split", "chunk", "unbind",
    "size", "dim", "contiguous", "detach", "getattr", "movedim", "swapaxes",
}


@dataclass(frozen=True)
class NodeCost:
    """Cost of one node for the annotated batch (``node.meta["fxsplit.cost"]``).

    Attributes:
        flops, bwd_flops: Forward / backward floating-point operations.
        fwd_s, bwd_s: Time used by the planner, seconds (analytic or measured).
        param_bytes, buffer_bytes: Trainable parameter / buffer bytes the node reads.
        output_bytes: Bytes of the node's result (0 for views and state).
        saved_bytes: Bytes kept for backward.
        is_view: True for views, getitems, placeholders and state reads (free to fold).
        source: ``"analytic"``, ``"measured"`` or ``"profiled"``.
        analytic_fwd_s, analytic_bwd_s: Roofline times, kept when the times are measured.
        fwd_fixed_s, bwd_fixed_s: The part of ``fwd_s`` / ``bwd_s`` paid by every micro-batch
            whatever its size (operator overhead; the intercept of a profiled fit).
        bwd_weight_s: The part of ``bwd_s`` that computes parameter gradients (a zero-bubble
            schedule's ``W``): :func:`weight_share` of it.
        needs_grad: Whether the result gets a gradient in training (it is floating point and
            depends on a trainable parameter): a stage boundary carrying it carries the gradient
            back; masks, positions and integer values come back with none.
    """

    flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    param_bytes: int = 0
    buffer_bytes: int = 0
    output_bytes: int = 0
    saved_bytes: int = 0
    is_view: bool = False
    source: str = "analytic"
    analytic_fwd_s: float = 0.0
    analytic_bwd_s: float = 0.0
    fwd_fixed_s: float = 0.0
    bwd_fixed_s: float = 0.0
    bwd_weight_s: float = 0.0
    needs_grad: bool = True

    def with_bwd_s(self, bwd_s: float, **changes: Any) -> NodeCost:
        """A copy with backward time ``bwd_s`` (measured, say), the weight part keeping its share."""
        share = self.bwd_weight_s / self.bwd_s if self.bwd_s > 0 else 0.0
        return dataclasses.replace(self, bwd_s=bwd_s, bwd_weight_s=bwd_s * share, **changes)

    @property
    def is_free(self) -> bool:
        """True when the node costs no time (a candidate for folding)."""
        return self.fwd_s == 0.0 and self.bwd_s == 0.0


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def value_bytes(x: Any) -> int:
    """Bytes of the tensors in ``x`` (a tensor, or any pytree of them; other leaves count 0)."""
    return sum(t.numel() * t.element_size() for t in _tensors(x))


def _is_view(node: torch.fx.Node) -> bool:
    if node.op in ("placeholder", "get_attr", "output"):
        return True
    if node.target is operator.getitem:
        return True
    if node.op == "call_method" or (node.op == "call_function" and not hasattr(node.target, "_schema")):
        return getattr(node.target, "__name__", str(node.target)) in _VIEW_NAMES
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write


def _is_embedding(node: torch.fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(getattr_path(node.graph.owning_module, str(node.target)), torch.nn.Embedding)
    return node.target in _EMBEDDING


def _attention_flops(args: Sequence[Any]) -> float:
    q, k, v = args[:3]
    bh = q.numel() // (q.shape[-2] * q.shape[-1])
    return 2.0 * bh * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])


def _state_bytes(
    gm: torch.fx.GraphModule, node: torch.fx.Node, trainable: set[str], seen: set[int]
) -> tuple[int, int]:
    """(param_bytes, buffer_bytes) of the state ``node`` reads directly.

    ``seen`` holds the ids of the tensors already counted at earlier nodes; a tensor read by
    several nodes (a tied embedding read by the embedding and the LM head of a symbolically
    traced GPT) is counted once, so the graph's total equals the model's.
    """
    if node.op == "get_attr":
        t = getattr_path(gm, str(node.target))
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            nb = t.numel() * t.element_size()
            return (nb, 0) if str(node.target) in trainable else (0, nb)
    if node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        p = b = 0
        for t in [*sub.parameters(), *sub.buffers()]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            nb = t.numel() * t.element_size()
            if isinstance(t, torch.nn.Parameter) and t.requires_grad:
                p += nb
            else:
                b += nb
        return p, b
    return 0, 0


def _trainable_names(gm: torch.fx.GraphModule) -> set[str]:
    return {n for n, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}


class _FlopInterpreter(MetaDevicesMoved):
    """Runs the graph on fake tensors and counts each node's FLOPs with ``FlopCounterMode``."""

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device | None = None) -> None:
        super().__init__(gm)
        self.device = device  # meta graphs under CPU autocast run as on this device
        self.flops: dict[str, float] = {}
        self.counted: dict[str, bool] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op in ("placeholder", "get_attr", "output") or _is_view(n) or not _tensors(n.meta.get("val")):
            return super().run_node(n)
        with FlopCounterMode(display=False) as counter:
            result = super().run_node(n)
        flops: Any = _number(counter.get_total_flops())
        self.counted[n.name] = not _is_zero(flops)
        if _is_zero(flops) and n.target in _ATTENTION:
            args = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in n.args]
            flops, self.counted[n.name] = _attention_flops(args), True
        if _is_zero(flops) and not _is_embedding(n):
            operands = [t.numel() for a in n.all_input_nodes if a.op != "get_attr" for t in _tensors(a.meta.get("val"))]
            flops = _number(functools.reduce(torch.sym_max, [t.numel() for t in _tensors(result)] + operands, 0))
        elif _is_zero(flops):
            flops = _number(sum(t.numel() for t in _tensors(result)))
        self.flops[n.name] = flops
        return result


def _number(x: Any) -> Any:
    """``x`` as a float, or as it is when symbolic (:mod:`fxsplit.passes.symbolic`)."""
    return x if isinstance(x, torch.SymInt | torch.SymFloat) else float(x)


def _is_zero(x: Any) -> bool:
    return not isinstance(x, torch.SymInt | torch.SymFloat) and x == 0


def _operand_vals(node: torch.fx.Node) -> list[torch.Tensor]:
    vals = [a.meta.get("val") for a in node.all_input_nodes]
    return [t for v in vals for t in _tensors(v)]


def _count_flops(gm: torch.fx.GraphModule, placeholders: list[torch.fx.Node]) -> tuple[dict[str, float], dict[str, bool]]:
    mode = fake_mode_of(gm) or FakeTensorMode(allow_non_fake_inputs=True)
    vals = [p.meta["val"] for p in placeholders]
    device = autocast_run_device(gm, vals)
    inputs = [fake_like(x, mode, device) if isinstance(x, torch.Tensor) else x for x in vals]
    interp = _FlopInterpreter(gm, device)
    with fake_state(gm, mode, device), mode:
        interp.run(*inputs)
    return interp.flops, interp.counted


def _needs_grad(gm: torch.fx.GraphModule, trainable: set[str]) -> set[str]:
    """Names of nodes whose result depends on a trainable parameter (and is floating point)."""
    needs: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr" and str(n.target) in trainable:
            needs.add(n.name)
        elif n.op == "call_module" and any(p.requires_grad for p in gm.get_submodule(str(n.target)).parameters()):
            needs.add(n.name)
        elif n.op in ("call_function", "call_method", "call_module") and any(a.name in needs for a in n.all_input_nodes):
            needs.add(n.name)
        val = n.meta.get("val")
        if n.name in needs and not any(t.is_floating_point() for t in _tensors(val)):
            needs.discard(n.name)
    return needs


def weight_share(gm: torch.fx.GraphModule, node: torch.fx.Node, needs: set[str], trainable: set[str]) -> float:
    """The share of ``node``'s backward that computes parameter gradients (analytic estimate).

    A node that reads a trainable parameter computes its gradient: when no other input needs a
    gradient (an embedding, a first layer) that is the whole backward (1); otherwise half (0.5:
    for a matmul or convolution the weight-gradient product costs what the input-gradient product
    costs; for a norm's affine weight it is an estimate). Nodes without parameters: 0.
    """
    params = [a for a in node.all_input_nodes if a.op == "get_attr" and str(a.target) in trainable]
    owns = node.op == "call_module" and any(p.requires_grad for p in gm.get_submodule(str(node.target)).parameters())
    if not (params or owns) or node.name not in needs:
        return 0.0
    others = [a for a in node.all_input_nodes if a not in params and a.name in needs]
    return 0.5 if others else 1.0


def _is_convolution(node: torch.fx.Node) -> bool:
    """A convolution (cuDNN runs fp32 ones in TF32 by default): ``aten.convolution``,
    ``conv2d``, ``conv_transpose2d``... or a traced ``nn.Conv*`` module."""
    if node.op == "call_module":
        owner = node.graph.owning_module
        return owner is not None and isinstance(owner.get_submodule(str(node.target)), torch.nn.modules.conv._ConvNd)
    return node.op == "call_function" and "conv" in str(getattr(node.target, "__name__", node.target))


def _math_dtype(node: torch.fx.Node, val: Any) -> str:
    """The dtype a node computes in, for its compute roof: its first floating result's (a
    matmul under autocast: bfloat16), else its first floating operand's, else ``"float32"``."""
    for t in [*_tensors(val), *_operand_vals(node)]:
        if t.dtype.is_floating_point:
            return str(t.dtype).removeprefix("torch.")
    return "float32"


def node_cost(
    node: torch.fx.Node, flops: float, counted: bool, needs_grad: bool, state: tuple[int, int], device: DeviceSpec,
    read_bytes: int | None = None, weight_part: float = 0.0,
) -> NodeCost:
    """The analytic :class:`NodeCost` of one node (see the module docstring for the rules).

    ``state`` is the (param, buffer) bytes the node owns; ``read_bytes`` the state bytes it reads
    for the roofline (default ``sum(state)``; larger for a tied weight owned by an earlier node);
    ``weight_part`` the share of the backward that computes parameter gradients (:func:`weight_share`).
    """
    if not carries_value(node):  # a higher-order op's subgraph module: nothing to cost
        return NodeCost(is_view=True)
    val = require_meta(node, "val", "propagate_shapes")
    if _is_view(node) or not _tensors(val):  # views, and shape arithmetic (sym_size, ints)
        out = 0 if node.op == "get_attr" else value_bytes(val)
        return NodeCost(param_bytes=state[0], buffer_bytes=state[1], output_bytes=out, is_view=True,
                        needs_grad=needs_grad)
    out_bytes = value_bytes(val)
    if _is_embedding(node):  # a gather: reads the selected rows, not the whole table
        moved = 2 * out_bytes
    else:
        state_read = sum(state) if read_bytes is None else read_bytes
        moved = out_bytes + sum(t.numel() * t.element_size() for t in _operand_vals(node)) + state_read
    bwd_flops = (2.0 if counted else 1.0) * flops if needs_grad else 0.0
    peak = device.peak_flops_for(_math_dtype(node, val), convolution=_is_convolution(node))
    # torch.sym_max: the max of floats, or a formula of the batch when shapes are symbolic
    fwd_s = torch.sym_max(flops / peak, moved / device.memory_bandwidth_bytes_per_s) + device.op_overhead_s
    bwd_s = (
        torch.sym_max(bwd_flops / peak, 2 * moved / device.memory_bandwidth_bytes_per_s)
        + 2 * device.op_overhead_s
        if needs_grad
        else 0.0
    )
    return NodeCost(
        flops=flops, bwd_flops=bwd_flops, fwd_s=fwd_s, bwd_s=bwd_s, param_bytes=state[0],
        buffer_bytes=state[1], output_bytes=out_bytes, saved_bytes=out_bytes if needs_grad else 0,
        analytic_fwd_s=fwd_s, analytic_bwd_s=bwd_s,
        fwd_fixed_s=device.op_overhead_s, bwd_fixed_s=2 * device.op_overhead_s if needs_grad else 0.0,
        bwd_weight_s=bwd_s * weight_part, needs_grad=needs_grad,
    )


def cost_nodes(gm: torch.fx.GraphModule, device: DeviceSpec) -> dict[torch.fx.Node, NodeCost]:
    """The analytic :class:`NodeCost` of every node but the output, from ``node.meta["val"]``
    (concrete shapes give numbers; symbolic ones, formulas: :mod:`fxsplit.passes.symbolic`)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    trainable = _trainable_names(gm)
    flops, counted = _count_flops(gm, placeholders)
    needs = _needs_grad(gm, trainable)
    seen: set[int] = set()
    out: dict[torch.fx.Node, NodeCost] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        state = _state_bytes(gm, node, trainable, seen)
        read = sum(_state_bytes(gm, node, trainable, set()))
        out[node] = node_cost(
            node, flops.get(node.name, 0.0), counted.get(node.name, False), node.name in needs, state, device,
            read_bytes=read, weight_part=weight_share(gm, node, needs, trainable),
        )
    kept = autograd_saved_bytes(gm)  # what autograd saves, charged to the node that made it
    if kept is not None:
        out = {node: dataclasses.replace(c, saved_bytes=kept.get(node.name, 0)) for node, c in out.items()}
    return out


@dataclass(frozen=True)
class AnnotateCosts:
    """Write ``node.meta["fxsplit.cost"]`` (a :class:`NodeCost`) on every node.

    Args:
        device: The reference device whose roofline gives the analytic times.
        cost_model: ``"analytic"`` (roofline, works on fake/meta tensors) or ``"measured"``
            (times each node on real tensors on ``measure_device``; needs ``example_inputs``).
        example_inputs: Real flat inputs, for ``"measured"``.
        measure_device: torch device string for ``"measured"`` (default ``"cpu"``).
        warmup, repeats: Timing loop of the measured model; the median is kept.
        measure_scale: Multiply measured times by this factor: time a micro-batch
            (``example_inputs`` one micro-batch) and scale to the annotated batch with
            ``measure_scale = microbatches``, so per-micro-batch costs are what a micro-batch
            really takes (small batches run less efficiently than a linear share).
        batched: For ``"profiled"``: which flat inputs carry the batch (default: every tensor
            whose dim 0 equals the first input's).
        profile_sizes: For ``"profiled"``: micro-batch sizes to time (default: the whole batch).
        profile_cache: For ``"profiled"``: a :class:`~fxsplit.passes.profile.ProfileCache` (or
            any mutable mapping) to read and extend; ``None`` times everything afresh.
        progress: For ``"profiled"``: ``progress(done, total)`` after each timed micro-batch size.

    Raises:
        ConfigError: for an unknown ``cost_model`` or ``"measured"`` without real inputs.
        AnnotationError: when a node lacks ``"val"`` (run ``propagate_shapes`` first).
    """

    device: DeviceSpec
    cost_model: str = "analytic"
    example_inputs: Sequence[Any] | None = None
    measure_device: str = "cpu"
    warmup: int = 2
    repeats: int = 5
    measure_scale: float = 1.0
    batched: tuple[bool, ...] | None = None
    profile_sizes: tuple[int, ...] = ()
    profile_cache: Any = None
    progress: Any = None
    requires: tuple[str, ...] = ("val",)
    produces: tuple[str, ...] = ("fxsplit.cost",)

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        if self.cost_model not in COST_MODELS:
            raise ConfigError(f"cost_model={self.cost_model!r} is unknown; choose one of {COST_MODELS}")
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        for p in placeholders:
            require_meta(p, "val", "propagate_shapes")
        for node, cost in cost_nodes(gm, self.device).items():
            node.meta["fxsplit.cost"] = cost
        if self.cost_model == "analytic":
            return PassResult(gm, modified=True)
        if self.example_inputs is None:
            raise ConfigError(f"cost_model={self.cost_model!r} needs example_inputs (real tensors) to time nodes")
        if self.cost_model == "measured":
            measure_node_times(gm, self.example_inputs, self.measure_device, self.warmup, self.repeats, self.measure_scale)
        elif self.cost_model == "profiled":
            self._profile(gm)
        return PassResult(gm, modified=True)

    def _profile(self, gm: torch.fx.GraphModule) -> None:
        flat = list(self.example_inputs or ())
        batched = self.batched
        if batched is None:
            batch = next((x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.dim() >= 1), None)
            batched = tuple(isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch for x in flat)
        if not any(batched):
            raise ConfigError("cost_model='profiled' needs an input with a batch dimension to time micro-batches")
        sizes = self.profile_sizes or (int(next(x for x, b in zip(flat, batched, strict=True) if b).shape[0]),)
        profile_node_times(gm, flat, batched, sizes, self.measure_device, cache=self.profile_cache,
                           warmup=self.warmup, repeats=self.repeats, progress=self.progress)


def annotate_costs(gm: torch.fx.GraphModule, device: DeviceSpec | None = None, **options: Any) -> PassResult:
    """Functional form of :class:`AnnotateCosts` (default device: :func:`measure_cpu_spec`)."""
    return AnnotateCosts(device or measure_cpu_spec(), **options)(gm)


# -- the CPU, measured on the spot ------------------------------------------------------------
def _op_overhead_s(chain: int = 32, device: torch.device | None = None) -> float:
    """Per-operator cost of a training forward (dispatch plus autograd recording, and on CUDA the
    kernel launch): the median time of a chain of tiny multiplications on a tensor that requires
    grad, per operator, on ``device`` (default the CPU)."""
    y = torch.ones(8, requires_grad=True, device=device)

    def run() -> torch.Tensor:
        z = y
        for _ in range(chain):
            z = torch.ops.aten.mul.Tensor(z, 1.0)
        return z

    return median_time_s(run, repeats=21, device=device) / chain


def cuda_spec(dev: torch.device) -> DeviceSpec:
    """The spec of CUDA device ``dev``: the preset of its model (H200, H100, A100, V100, T4) or
    a generic 100 TFLOP/s, 1 TB/s one, with its real memory and its per-operator overhead measured
    here (:func:`_op_overhead_s` on the device: dispatch, autograd recording and the launch; on an
    H100 VM under torch 2.11 it measured 10-14 us, twice the presets' 5 us).

    Raises:
        ConfigError: when CUDA is not available here.
    """
    if not torch.cuda.is_available():
        raise ConfigError(f"device {dev} requested but CUDA is not available; use 'cpu' devices")
    props = torch.cuda.get_device_properties(dev)
    name = props.name.lower()
    preset = next((p for p in ("h200", "h100", "a100", "v100", "t4") if p in name), None)
    base = DeviceSpec.preset(preset) if preset else DeviceSpec("cuda", 100e12, 1e12)
    return base.with_(memory_bytes=int(props.total_memory), torch_device=str(dev), kind=name,
                      op_overhead_s=_op_overhead_s(device=dev))


def measure_cpu_spec(name: str = "cpu", *, size: int = 512) -> DeviceSpec:
    """A :class:`DeviceSpec` for this CPU, measured now: bf16 matmul FLOP/s (``peak_flops``, the
    roof of autocast's math) and fp32 matmul FLOP/s (``fp32_peak_flops``), copy bandwidth and
    the per-operator overhead (a tiny op with autograd recording, see :func:`_op_overhead_s`).

    Args:
        name: Device name in plans.
        size: Matmul side (``size x size``); the copy moves 32 MiB.

    Returns:
        The spec; ``memory_bytes`` is the machine's physical memory.
    """
    a = torch.randn(size, size)
    fp32_peak = 2 * size**3 / median_time_s(lambda: a @ a)
    h = a.to(torch.bfloat16)
    peak = 2 * size**3 / median_time_s(lambda: h @ h)
    src = torch.empty(8 * 1024 * 1024)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 4 / median_time_s(lambda: dst.copy_(src))
    overhead = _op_overhead_s()
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 16 * GiB
    return DeviceSpec(
        name, peak_flops=peak, memory_bandwidth_bytes_per_s=bw, memory_bytes=int(mem), kind="cpu",
        torch_device="cpu", op_overhead_s=overhead, fp32_peak_flops=fp32_peak,
    )
