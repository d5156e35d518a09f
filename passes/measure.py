"""Timing of graph nodes on a real device: the core of the measured and profiled cost models.

Runs a deep copy of the graph (so in-place buffer updates never touch the user's model) on real
inputs, whole forward and backward passes at a time, and times every compute node where it
stands (:func:`time_nodes_in_context`), as PipeDream's profiler times layers. Timing nodes one
at a time in a loop instead underestimates them: a node repeated alone finds its weights in the
cache, which a real step has evicted (measured on this project's CPU: 1.2-1.5x too fast for a
GPT and an MLP). CUDA work is timed with events, read after one synchronisation.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxsplit.passes.manager import require_meta

__all__ = ["gc_paused", "grad_accumulate_bytes_per_s", "measure_node_times", "median_time_s", "time_nodes_in_context",
           "NodeTimes"]

log = logging.getLogger(__name__)

NodeTimes = tuple[float, float]
"""``(fwd_s, bwd_s)`` of one node on one micro-batch size."""


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


_ACCUMULATE_RATES: dict[tuple[str, int], float] = {}


def grad_accumulate_bytes_per_s(device: str = "cpu", size_bytes: int = 16 * 2**20) -> float:
    """Gradient bytes per second this process adds into a gradient already there on ``device``
    (``grad.add_(new)`` of ``size_bytes`` fp32, median of 7 after two warm-ups, at this
    process's thread count; memoised per device and thread count): what every micro-batch after
    a step's first pays per parameter byte, which a profile that starts each step without
    gradients does not see (one core here: about 13 GB/s, a 4 MiB layer 0.32 ms).

    Raises:
        ConfigError: for a device torch does not know.
    """
    from fxsplit.errors import ConfigError

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"grad_accumulate_bytes_per_s: unknown device {device!r}: {exc}") from exc
    key = (str(dev), torch.get_num_threads())
    if key not in _ACCUMULATE_RATES:
        grad = torch.zeros(size_bytes // 4, device=dev)
        new = torch.ones(size_bytes // 4, device=dev)
        _ACCUMULATE_RATES[key] = size_bytes / median_time_s(lambda: grad.add_(new), warmup=2, repeats=7, device=dev)
    return _ACCUMULATE_RATES[key]


def _float_tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor) and t.is_floating_point()]


class _Clock:
    """Start/stop marks around regions: ``perf_counter`` on the CPU, CUDA events on a GPU (read
    after one synchronisation at the end, so timing does not serialise the stream)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            return start.elapsed_time(end) / 1e3
        return end - start

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect garbage, then keep Python's cyclic collector off while timing (as ``timeit``
    does): a collection pass over a large heap (every graph the process has built) lands in one
    timed interval at random and skews it (calibrate's per-stage times were off by 45 % after a
    few dozen compiles in one process)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _ContextInterpreter(torch.fx.Interpreter):
    """One forward of the whole graph, each compute node's call timed where it stands.

    A view node (``view``, ``permute``, ``split``, ``expand``, ``getitem``) has no cost of its own
    in the cost model, but its call and its backward are real work (``split``'s backward is a
    ``cat``, ``expand``'s a sum): both are timed and charged to its *owner*, the compute node
    whose output it views (or, for a view of a weight or an input, the first compute node that
    uses it), so the block that holds the owner pays them.
    """

    def __init__(self, gm: torch.fx.GraphModule, clock: _Clock, owners: dict[str, str | None] | None = None) -> None:
        super().__init__(gm)
        self.clock = clock
        self.owners = owners if owners is not None else _owners(gm)  # the same for every step: made once
        self.marks: dict[str, list[tuple[Any, Any]]] = {}
        self.grad_fns: dict[Any, str] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        owner = self.owners.get(n.name)
        if owner is None:
            return super().run_node(n)
        cost = n.meta["fxsplit.cost"]
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        start = self.clock.mark()
        result = getattr(self, n.op)(n.target, args, kwargs)
        self.marks.setdefault(owner, []).append((start, self.clock.mark()))
        if cost.bwd_s > 0 or cost.is_view:
            self._own_new_grad_fns([t.grad_fn for t in _float_tensors(result)], owner)
        return result

    def _own_new_grad_fns(self, roots: list[Any], owner: str) -> None:
        """Charge to ``owner`` every autograd node its call made: from the outputs' ``grad_fn``
        back to the nodes earlier calls made (an aten op can record several: ``linear`` on a 3-d
        input is ``view``, ``mm``, ``_unsafe_view``, and only the last is the output's)."""
        todo = [fn for fn in roots if fn is not None]
        while todo:
            fn = todo.pop()
            if fn in self.grad_fns or type(fn).__name__ == "AccumulateGrad":
                continue
            self.grad_fns[fn] = owner
            todo.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)


def _owners(gm: torch.fx.GraphModule) -> dict[str, str | None]:
    """The node each timed node's call is charged to (:class:`_ContextInterpreter`): itself for
    a compute node; for a view, the owner of the first input that has one, else (a view of a
    weight or an input) its first compute user; None: not timed."""
    owners: dict[str, str | None] = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        cost = require_meta(n, "fxsplit.cost", "annotate_costs")
        owners[n.name] = _view_owner(n, owners) if cost.is_view else n.name
    return owners


def _view_owner(n: torch.fx.Node, owners: dict[str, str | None]) -> str | None:
    for a in n.all_input_nodes:
        if owners.get(a.name):
            return owners[a.name]
    todo, seen = collections.deque(n.users), set()
    while todo:  # a view of a weight or an input: its first compute user
        u = todo.popleft()
        if u.name in seen or u.op == "output":
            continue
        seen.add(u.name)
        cost = u.meta.get("fxsplit.cost")
        if cost is not None and not cost.is_view:
            return u.name
        todo.extend(u.users)
    return None


def _backward_ones(out: Any) -> bool:
    """Backward from every floating output that requires grad, with gradient ones; whether any did."""
    outs = [t for t in _float_tensors(out) if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    return bool(outs)


def _backward_marks(grad_fns: dict[Any, str], clock: _Clock) -> tuple[dict[str, list[tuple[Any, Any]]], list[Any]]:
    """Hooks on each autograd node that a graph node made: start mark before, end mark after."""
    marks: dict[str, list[tuple[Any, Any]]] = {}
    handles = []
    for fn, name in grad_fns.items():
        pending: list[Any] = []
        handles.append(fn.register_prehook(lambda _g, pending=pending: pending.append(clock.mark())))
        handles.append(fn.register_hook(
            lambda _gi, _go, pending=pending, name=name: marks.setdefault(name, []).append((pending.pop(), clock.mark()))
        ))
    return marks, handles


def _one_step(gm: torch.fx.GraphModule, inputs: Sequence[Any], clock: _Clock, owners: dict[str, str | None]
              ) -> tuple[dict[str, float], dict[str, float]]:
    """Forward and backward of the whole graph: per-node forward and backward seconds."""
    interp = _ContextInterpreter(gm, clock, owners)
    out = interp.run(*inputs)
    marks, handles = _backward_marks(interp.grad_fns, clock)
    try:
        _backward_ones(out)
        clock.sync()
    finally:
        for h in handles:
            h.remove()
    fwd = {name: sum(clock.seconds(a, b) for a, b in pairs) for name, pairs in interp.marks.items()}
    bwd = {name: sum(clock.seconds(a, b) for a, b in pairs) for name, pairs in marks.items()}
    return fwd, bwd


def _clean_step(gm: torch.fx.GraphModule, inputs: Sequence[Any], clock: _Clock) -> tuple[float, float]:
    """Wall seconds of the graph's own forward (its generated code, no interpreter, views and
    glue included) and of the backward without hooks: what a stage really pays."""
    start = clock.mark()
    out = gm(*inputs)
    mid = clock.mark()
    ran = _backward_ones(out)
    end = clock.mark()
    clock.sync()
    return clock.seconds(start, mid), clock.seconds(mid, end) if ran else 0.0


def _shared(times: dict[str, float], wall_s: float, floor: float = 0.1) -> dict[str, float]:
    """``times`` made to sum to ``wall_s``: the residual is a per-operator cost, shared equally
    among the timed nodes; positive, it is what no mark sees (dispatch of untimed view ops, the
    engine, gradient accumulation), negative, what the timing hooks themselves add to every
    backward node. No node drops below ``floor`` times its own mark (then the sum stays above
    ``wall_s``)."""
    timed = [n for n, t in times.items() if t > 0]
    if not timed or wall_s <= 0:
        return dict(times)
    share = (wall_s - sum(times[n] for n in timed)) / len(timed)
    return {n: max(t + share, floor * t) if t > 0 else 0.0 for n, t in times.items()}


def time_nodes_in_context(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    device: str = "cpu",
    warmup: int = 2,
    repeats: int = 5,
) -> dict[str, NodeTimes]:
    """Time every compute node inside whole forward + backward passes of the graph, as
    PipeDream's profiler times layers: each node runs after the nodes before it, with the caches
    and allocator in the state a real step leaves them.

    Forward: each node's call, in graph order, with the calls of the view nodes it owns (see
    :class:`_ContextInterpreter`). Backward: the autograd nodes each graph node (and its views)
    made, timed by pre- and post-hooks. Every other timed step also runs the graph's own code (no
    interpreter, no hooks), and the node times are made to add up to those walls: the forward's
    rest (Python glue) and the backward's rest (entering the engine, gradient accumulation into
    parameters, autograd nodes no hook sees) are shared equally among the nodes that have a
    forward / backward, as a per-operator cost; where the hooks cost more than the rest, their
    cost is taken off every node alike.

    Args:
        gm: Annotated graph (every node has ``"fxsplit.cost"``); its weights must be real. Not
            modified: a deep copy runs, and parameter gradients land on the copy.
        example_inputs: Real flat inputs (any batch size the graph takes).
        device: Where to time.
        warmup, repeats: Untimed steps, then timed steps whose per-node median is kept.

    Returns:
        ``{node name: (fwd_s, bwd_s)}`` for every compute node.
    """
    dev = torch.device(device)
    work = copy.deepcopy(gm).to(dev)
    inputs = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    clock = _Clock(dev)
    samples, clean = [], []
    owners = _owners(work)
    with gc_paused():
        for i in range(warmup + max(1, repeats)):
            step = _one_step(work, inputs, clock, owners)
            work.zero_grad(set_to_none=True)
            if i >= warmup:
                samples.append(step)
                if (i - warmup) % 2 == 0:
                    clean.append(_clean_step(work, inputs, clock))
                    work.zero_grad(set_to_none=True)
    names = list(samples[0][0])
    fwd = {n: statistics.median(s[0].get(n, 0.0) for s in samples) for n in names}
    bwd = {n: statistics.median(s[1].get(n, 0.0) for s in samples) for n in names}
    fwd = _shared(fwd, statistics.median(c[0] for c in clean))
    bwd = _shared(bwd, statistics.median(c[1] for c in clean))
    return {n: (fwd[n], bwd[n]) for n in names}


def measure_node_times(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    device: str = "cpu",
    warmup: int = 2,
    repeats: int = 5,
    scale: float = 1.0,
) -> dict[str, NodeTimes]:
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
    times = time_nodes_in_context(gm, example_inputs, device, warmup, repeats)
    for node in gm.graph.nodes:
        if node.name in times:
            fwd_s, bwd_s = times[node.name]
            node.meta["fxsplit.cost"] = node.meta["fxsplit.cost"].with_bwd_s(
                bwd_s * scale, fwd_s=fwd_s * scale, source="measured", fwd_fixed_s=0.0, bwd_fixed_s=0.0)
    log.info("measured %d nodes on %s", len(times), device)
    return times
