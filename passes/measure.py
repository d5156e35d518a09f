"""The measured cost model: time each node's forward and backward on a real device.

Runs a deep copy of the graph (so in-place buffer updates never touch the user's model) with an
interpreter on real inputs. For each compute node: ``warmup`` runs, then the median of ``repeats``
timed runs of the forward; the backward is ``torch.autograd.grad`` of the node's floating outputs
with respect to its floating inputs and the parameters it reads, timed the same way. CUDA work is
synchronised around every timed region.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxsplit.passes.manager import require_meta

__all__ = ["measure_node_times", "median_time_s"]

log = logging.getLogger(__name__)


def median_time_s(fn: Callable[[], Any], warmup: int = 1, repeats: int = 5, device: torch.device | None = None) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls; on CUDA the
    device is synchronised around every timed call."""
    cuda = device is not None and device.type == "cuda"
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(max(1, repeats)):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _float_tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor) and t.is_floating_point()]


class _TimingInterpreter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, device: torch.device, warmup: int, repeats: int) -> None:
        super().__init__(gm)
        self.device = device
        self.warmup, self.repeats = warmup, repeats
        self.times: dict[str, tuple[float, float]] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        cost = require_meta(n, "fxsplit.cost", "annotate_costs") if n.op != "output" else None
        if cost is None or cost.is_view:
            return super().run_node(n)
        with torch.no_grad():
            fwd_s = median_time_s(lambda: super(_TimingInterpreter, self).run_node(n), self.warmup, self.repeats, self.device)
        result = super().run_node(n)
        bwd_s = self._backward_s(n) if cost.bwd_s > 0 else 0.0
        self.times[n.name] = (fwd_s, bwd_s)
        return result

    def _backward_s(self, n: torch.fx.Node) -> float:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        leaves = [t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) and t.requires_grad else t for t in leaves]
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        with torch.enable_grad():
            out = getattr(self, n.op)(n.target, args, kwargs)
        outs = [t for t in _float_tensors(out) if t.requires_grad]
        wrt = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if n.op == "call_module":
            wrt += [p for p in self.module.get_submodule(str(n.target)).parameters() if p.requires_grad]
        if not outs or not wrt:
            return 0.0
        grads = [torch.ones_like(t) for t in outs]
        return median_time_s(
            lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=True, allow_unused=True),
            self.warmup,
            self.repeats,
            self.device,
        )


def measure_node_times(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    device: str = "cpu",
    warmup: int = 2,
    repeats: int = 5,
    scale: float = 1.0,
) -> dict[str, tuple[float, float]]:
    """Time every compute node of ``gm`` and store the times in its ``"fxsplit.cost"``.

    Args:
        gm: Annotated graph (every node has ``"fxsplit.cost"``); its weights must be real.
        example_inputs: Real flat inputs.
        device: Where to time (``"cpu"``, ``"cuda:0"``).
        warmup, repeats: Untimed runs, then timed runs whose median is kept.
        scale: Factor applied to the stored times (``microbatches`` when ``example_inputs`` is
            one micro-batch of the annotated batch).

    Returns:
        ``{node name: (fwd_s, bwd_s)}``.
    """
    dev = torch.device(device)
    work = copy.deepcopy(gm).to(dev)
    inputs = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    interp = _TimingInterpreter(work, dev, warmup, repeats)
    interp.run(*inputs)
    for node in gm.graph.nodes:
        if node.name in interp.times:
            fwd_s, bwd_s = interp.times[node.name]
            cost = node.meta["fxsplit.cost"]
            node.meta["fxsplit.cost"] = dataclasses.replace(
                cost, fwd_s=fwd_s * scale, bwd_s=bwd_s * scale, source="measured"
            )
    log.info("measured %d nodes on %s", len(interp.times), device)
    return interp.times
