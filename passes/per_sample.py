"""Is the model per-sample? Find what micro-batching would silently change.

Pipelining splits the batch into micro-batches and runs each through the model on its own. That
computes what the unsplit model computes only when every sample's outputs depend on that sample
alone, and the forward changes no state. Two things break it, and this pass finds both:

* **an op that mixes samples** (``h - h.mean(0)``, BatchNorm in training mode, a batch-level
  auxiliary loss, attention over the *batch* of a sequence-first model whose dim 0 is the
  sequence): found by running the graph on the example batch and on each of its halves, side by
  side, and comparing every node's rows of each half; the first node whose rows differ is the
  one that mixes (random ops such as dropout take the full run's rows, so their draws match).
  An output without the batch (a loss) must be the halves' size-weighted mean, as the pipeline
  merges it (a sum over the batch is not);
* **a buffer updated in forward** (counters, moving averages): an in-place op on a buffer runs
  once per micro-batch, ``m`` times per step. BatchNorm's running statistics are left out: the
  runtime defers them to one exact update per step (:mod:`fxsplit.codegen.batchnorm`).

References:
    Huang et al., "GPipe", NeurIPS 2019, section 2.2 (micro-batches and batch normalisation).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxsplit.passes.capture import in_place_root, reads_inputs, writes_in_place

__all__ = ["BatchMixing", "buffer_writes", "find_batch_mixing", "is_random", "mutated_buffers", "once_per_step_buffers",
           "reads_inputs", "written_buffers"]

log = logging.getLogger(__name__)

#: Names (whole, of an op, function or method) that draw random numbers.
_RANDOM = frozenset({
    "dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d",
    "dropout2d", "dropout3d", "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint",
    "randint_like", "randperm", "normal", "normal_", "uniform_", "exponential_", "geometric_", "cauchy_",
    "log_normal_", "random_", "multinomial", "rrelu", "rrelu_", "rrelu_with_noise", "gumbel_softmax",
})
_RANDOM_MODULES = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
                   torch.nn.FeatureAlphaDropout, torch.nn.RReLU)
_ATTENTION_NAMES = frozenset({"scaled_dot_product_attention"})
_DEFERRED_BUFFERS = (".running_mean", ".running_var", ".num_batches_tracked")


@dataclass(frozen=True)
class BatchMixing:
    """One reason the model is not per-sample.

    Attributes:
        node: The graph node (``print(gm.code)`` shows it).
        kind: ``"mixes samples"``, ``"needs the whole batch"`` (it fails on part of the
            batch: dim 0 is not a batch it can split) or ``"updates a buffer"``.
        where: The model's source line that made the node (``File ..., line N``), or ``""``.
        detail: What was found (the largest difference, or the buffer's name).
    """

    node: str
    kind: str
    where: str
    detail: str

    def __str__(self) -> str:
        at = f" at {self.where}" if self.where else ""
        return f"node {self.node!r}{at} {self.kind}: {self.detail}"


def _where(node: torch.fx.Node) -> str:
    """The innermost frame of the node's stack outside torch itself (the model's own line)."""
    lines = [ln.strip() for ln in str(node.meta.get("stack_trace") or "").strip().splitlines() if ln.strip()]
    frames = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    if not frames:
        return ""
    own = [i for i in frames if "/torch/" not in lines[i]]
    i = own[-1] if own else frames[-1]
    return f"{lines[i]}: {lines[i + 1]}" if i + 1 < len(lines) else lines[i]


def _root_buffer(node: Any, buffers: set[str]) -> str | None:
    """The buffer an in-place chain writes into (``add_(mul_(ema, .9), x)`` -> ``ema``)."""
    root = in_place_root(node)
    is_buffer = isinstance(root, torch.fx.Node) and root.op == "get_attr" and str(root.target) in buffers
    return str(root.target) if is_buffer else None


def written_buffers(gm: torch.fx.GraphModule) -> list[str]:
    """Every buffer an op of ``gm`` writes into, through any argument its schema marks written
    (``add_``'s first, ``batch_norm``'s running statistics; in-place chains followed to their
    buffer), BatchNorm's included; in graph order."""
    buffers = {name for name, _ in gm.named_buffers()}
    found: dict[str, None] = {}
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        written = [arg for arg, spec in zip(node.args, schema.arguments if schema is not None else (), strict=False)
                   if spec.alias_info is not None and spec.alias_info.is_write]
        if node.target is torch.ops.aten.batch_norm.default and len(node.args) > 5 and node.args[5]:
            written += node.args[3:5]  # composite: its schema does not mark the running statistics it updates
        for arg in written:
            buf = _root_buffer(arg, buffers)
            if buf is not None:
                found[buf] = None
    return list(found)


def buffer_writes(gm: torch.fx.GraphModule) -> dict[str, list[torch.fx.Node]]:
    """The in-place ops of ``gm`` on each buffer (``add_``, ``copy_``; chains such as
    ``add_(mul_(ema, .9), x)`` count for ``ema``), BatchNorm's running statistics left out."""
    buffers = {name for name, _ in gm.named_buffers()}
    writes: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        buf = _root_buffer(node.args[0], buffers) if writes_in_place(node) else None
        if buf is not None and not buf.endswith(_DEFERRED_BUFFERS):
            writes.setdefault(buf, []).append(node)
    return writes


def once_per_step_buffers(gm: torch.fx.GraphModule) -> set[str]:
    """Buffers whose every update in forward reads no input (a step counter): running the update
    once per step, on the first micro-batch, is exactly the unsplit model's update
    (:mod:`fxsplit.codegen.buffers`). An update that reads the data (a moving average of
    activations) has no such exact form."""
    return {buf for buf, nodes in buffer_writes(gm).items() if not _any_reads_inputs(nodes)}


def _any_reads_inputs(nodes: Sequence[torch.fx.Node]) -> bool:
    return any(reads_inputs(n) for n in nodes)


def mutated_buffers(gm: torch.fx.GraphModule, *, once_per_step: bool = False) -> list[BatchMixing]:
    """Buffers an in-place op updates in forward, BatchNorm's running statistics left out, and
    with ``once_per_step`` those a runtime that updates them once per step makes exact
    (:func:`once_per_step_buffers`)."""
    return [BatchMixing(nodes[0].name, "updates a buffer", _where(nodes[0]),
                        f"buffer {buf!r} changes in forward, so m micro-batches update it m times per step")
            for buf, nodes in buffer_writes(gm).items() if not once_per_step or _any_reads_inputs(nodes)]


def _rows(full: torch.Tensor, part: torch.Tensor, batch: int, start: int, n: int) -> list[torch.Tensor]:
    """The rows of ``full`` that belong to samples ``start .. start + n``, laid out as ``part``:
    one candidate when the dimension is the batch, two when the batch is merged with another
    dimension of ``k`` (batch outer: ``[batch * k]`` from ``[batch, k]``, entries ``start * k``
    on; batch inner: ``[k * batch]`` from ``[k, batch]``, the same ``n`` of every ``batch``)."""
    if full.dim() != part.dim() or full.dim() == 0:
        return []
    for d in range(full.dim()):
        f, h = full.shape[d], part.shape[d]
        if f != h and f * n == h * batch and all(full.shape[k] == part.shape[k] for k in range(full.dim()) if k != d):
            k = f // batch
            outer = full.narrow(d, start * k, h)
            if k == 1 or f % batch:
                return [outer]
            return [outer, full.unflatten(d, (k, batch)).narrow(d + 1, start, n).flatten(d, d + 1)]
    return []


def _differs(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> float | None:
    if a.dtype != b.dtype or a.shape != b.shape:
        return None
    if not a.is_floating_point():
        return None if torch.equal(a, b) else float("inf")
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0
    return diff if diff > atol + rtol * scale else None


def _names(node: torch.fx.Node) -> set[str]:
    """The name parts of what ``node`` calls (``aten.native_dropout.default`` -> its three parts)."""
    target = node.target
    text = target if isinstance(target, str) else getattr(target, "__name__", None) or str(target)
    return set(str(text).split("."))


def is_random(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws random numbers: a dropout (function, op or module in training mode),
    ``bernoulli``, ``rand*``, ``normal``, ``uniform_``, ``multinomial``, ``rrelu``... (whole names,
    so ``normalize`` is not one), or attention with ``dropout_p > 0``."""
    if node.op == "call_module":
        owner = node.graph.owning_module
        module = owner.get_submodule(str(node.target)) if owner is not None else None
        return isinstance(module, _RANDOM_MODULES) and module.training
    if node.op not in ("call_function", "call_method"):
        return False
    names = _names(node)
    if names & _ATTENTION_NAMES:
        p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        return not isinstance(p, int | float) or p > 0
    return bool(names & _RANDOM)


def find_batch_mixing(
    gm: torch.fx.GraphModule,
    flat_inputs: Sequence[Any],
    batched: Sequence[bool],
    *,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    once_per_step: bool = False,
) -> list[BatchMixing]:
    """Why micro-batching would change what ``gm`` computes; ``[]`` when it would not.

    Args:
        gm: The captured graph (real weights; run on the batch and on each half under
            ``no_grad``, its buffers restored after, so nothing of the model changes).
        flat_inputs: The example batch, flat; ``[batch, ...]`` for the batched ones.
        batched: ``[len(flat_inputs)]`` which inputs carry the batch.
        rtol, atol: Tolerance of the row comparison (a half batch may take other kernels).
        once_per_step: Leave out the buffers whose updates read no input (the local pipeline
            updates them once per step, exactly as the unsplit model).

    Returns:
        The first node that mixes samples (if any), then every buffer updated in forward.
        Nothing is checked for a batch of one sample.
    """
    found = mutated_buffers(gm, once_per_step=once_per_step)
    sizes = [x.shape[0] for x, b in zip(flat_inputs, batched, strict=True) if b and isinstance(x, torch.Tensor) and x.dim()]
    if not sizes or sizes[0] < 2:
        return found
    batch = int(sizes[0])
    n = batch // 2
    parts = [(0, n), (n, batch - n)]  # the two micro-batches of m = 2
    part_inputs = [[x.narrow(0, start, size) if b and isinstance(x, torch.Tensor) and x.dim() else x
                    for x, b in zip(flat_inputs, batched, strict=True)] for start, size in parts]
    saved = {name: buf.detach().clone() for name, buf in gm.named_buffers()}
    try:
        mixing = _first_mixing_node(gm, list(flat_inputs), part_inputs, batch, parts, rtol, atol)
    finally:
        with torch.no_grad():
            for name, buf in gm.named_buffers():
                buf.copy_(saved[name])
    return ([mixing] if mixing is not None else []) + found


def _first_mixing_node(gm: torch.fx.GraphModule, full_in: list[Any], part_in: list[list[Any]], batch: int,
                       parts: list[tuple[int, int]], rtol: float, atol: float) -> BatchMixing | None:
    """Run the batch and each part side by side, node by node. The graph mixes samples when an
    output's rows of a part differ from that part run alone (named by the first differing node
    it depends on), or when an output without the batch is not the parts' size-weighted mean (a
    sum or a maximum over the batch: the pipeline averages). A node whose rows differ but that
    no differing output depends on (``arange(batch)`` indexing the samples of a mask) is not
    reported: the micro-batches compute what the batch computes."""
    full_run = torch.fx.Interpreter(gm)
    full_run.args_iter = iter(full_in)
    runs = []
    for values in part_in:
        run = torch.fx.Interpreter(gm)
        run.args_iter = iter(values)
        runs.append(run)
    differing: dict[torch.fx.Node, BatchMixing] = {}
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node.op == "output":
                return (_unmergeable_output(node, full_run, runs, batch, parts, rtol, atol)
                        or _culprit(node, differing))
            f = full_run.run_node(node)
            full_run.env[node] = f
            for run, (start, n) in zip(runs, parts, strict=True):
                try:
                    h = run.run_node(node)
                except Exception as exc:  # noqa: BLE001 - the graph needs the whole batch: say so
                    return BatchMixing(node.name, "needs the whole batch", _where(node),
                                       f"fails on samples {start}..{start + n - 1} of the {batch} alone "
                                       f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}), so dim 0 is not "
                                       "a batch it can split")
                upstream = next((differing[a] for a in node.all_input_nodes if a in differing), None)
                if is_random(node):
                    if upstream is not None:  # its input already differs: so does it, for that reason
                        differing.setdefault(node, upstream)
                    else:
                        h = _same_draws(f, h, batch, start, n)
                run.env[node] = h
                if node.op in ("placeholder", "get_attr") or node in differing:
                    continue
                diff = _rows_differ(f, h, batch, start, n, rtol, atol)
                if diff is not None:
                    differing[node] = BatchMixing(
                        node.name, "mixes samples", _where(node),
                        f"samples {start}..{start + n - 1}' values differ by up to {diff:.3g} between the batch "
                        f"of {batch} and a batch of those {n} alone")
    return None


def _rows_differ(f: Any, h: Any, batch: int, start: int, n: int, rtol: float, atol: float) -> float | None:
    """The largest difference between a part's values ``h`` and its rows of the batch's ``f``
    (any tensor leaf whose every row layout differs), else None."""
    for a, b in zip(pytree.tree_leaves(f), pytree.tree_leaves(h), strict=False):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            continue
        diffs = [_differs(mine, b, rtol, atol) for mine in _rows(a, b, batch, start, n)]
        if diffs and all(x is not None for x in diffs):
            return min(x for x in diffs if x is not None)
    return None


def _culprit(output: torch.fx.Node, differing: dict[torch.fx.Node, BatchMixing]) -> BatchMixing | None:
    """The first differing node (graph order) that a differing output depends on, or None."""
    bad = [a for a in pytree.tree_leaves(output.args[0]) if isinstance(a, torch.fx.Node) and a in differing]
    if not bad:
        return None
    upstream: set[torch.fx.Node] = set()
    todo = list(bad)
    while todo:
        node = todo.pop()
        if node not in upstream:
            upstream.add(node)
            todo.extend(node.all_input_nodes)
    return next(mix for node, mix in differing.items() if node in upstream)


def _same_draws(f: Any, h: Any, batch: int, start: int, n: int) -> Any:
    """A random op's output for a part: the full run's rows of those samples (same draws)."""
    f_leaves, spec = pytree.tree_flatten(f)
    h_leaves = pytree.tree_leaves(h)
    if len(h_leaves) != len(f_leaves):
        return h
    rows = [next(iter(_rows(a, b, batch, start, n)), None)
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else None
            for a, b in zip(f_leaves, h_leaves, strict=True)]
    return pytree.tree_unflatten([r if r is not None else b for r, b in zip(rows, h_leaves, strict=True)], spec)


def _unmergeable_output(node: torch.fx.Node, full_run: Any, runs: list[Any], batch: int,
                        parts: list[tuple[int, int]], rtol: float, atol: float) -> BatchMixing | None:
    """A floating output without the batch (a loss, a statistic) is merged as the size-weighted
    mean of the micro-batches' values, or a 0-d one as their sum
    (:func:`~fxsplit.runtime.microbatch.scalar_reductions`): anything else over the batch is not
    per-sample."""
    for i, arg in enumerate(pytree.tree_leaves(node.args[0])):
        if not isinstance(arg, torch.fx.Node):
            continue
        full, mine = full_run.env.get(arg), [run.env.get(arg) for run in runs]
        if not isinstance(full, torch.Tensor) or not all(isinstance(x, torch.Tensor) for x in mine):
            continue
        if mine[0].shape != full.shape and not _rows(full, mine[0], batch, 0, parts[0][1]):
            return BatchMixing(arg.name, "mixes samples", _where(arg),
                               f"output {i} {list(full.shape)} changes shape with the batch in more than one "
                               f"dimension ({list(mine[0].shape)} for {parts[0][1]} samples): it pairs samples "
                               "(x @ x.T), which micro-batches cannot merge")
        if not full.is_floating_point() or any(x.shape != full.shape for x in mine):
            continue
        mean = sum(x * (n / batch) for x, (_, n) in zip(mine, parts, strict=True))
        diff = _differs(full, mean, rtol, atol)  # type: ignore[arg-type]
        if diff is not None:
            summed = _differs(full, sum(mine), rtol, atol) is None  # type: ignore[arg-type]
            if summed and full.dim() == 0:  # the runtimes add a 0-d sum up (merge_outputs' "sum")
                continue
            how = "their sum" if summed else "neither their mean nor their sum"
            return BatchMixing(arg.name, "mixes samples", _where(arg),
                               f"output {i} {list(full.shape)} has no batch dimension and is {how} over the "
                               "micro-batches, not their mean (the pipeline merges a 0-d output as the mean or the sum "
                               "of the micro-batches' values and refuses another that differs between them): it "
                               "reduces over the batch in a way micro-batches change")
    return None
