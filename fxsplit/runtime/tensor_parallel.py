"""Run a captured graph with a placement per node over a device mesh (DTensor): PaSE's plans executed.

:func:`fxsplit.passes.parallel_strategies.strategy_graph` gives every node candidate placements
from DTensor's own sharding strategies and :func:`fxsplit.solvers.pase.solve_strategies` picks
one per node; :class:`ParallelGraph` runs that choice on ``torch.distributed``:

* a value planned replicated stays a plain tensor (every rank holds it whole) and an op whose
  output and operands are all replicated runs as the op itself, with no DTensor dispatch;
* every other parameter and buffer becomes a DTensor with its node's planned placement (a
  trainable one an ``nn.Parameter`` the optimizer steps; each rank holds its shard);
* the graph's inputs are distributed as planned (each rank takes its piece of the batch it was
  given: every rank passes the same batch);
* before each other op, each tensor operand is redistributed to the placement the chosen strategy
  expects (``DTensor.redistribute``: its backward moves the gradient back the opposite way; a
  plain one enters as a replicated DTensor, whose backward all-reduces the partial gradients a
  split op gives it), the op runs on DTensors, and its output is moved to its planned placement
  when DTensor's own propagation chose another (:attr:`ParallelGraph.relayouts` counts those);
* an op DTensor has no strategy for (the planner's fallback, or one that fails sharded at run
  time) runs on whole tensors: operands gathered, the op run locally, the result replicated;
* every output of the model comes back whole (plain tensors, the same on every rank), so any
  loss function applies; every gradient reaches the parameter shards, whose ``full_tensor()``
  is the unsplit model's gradient.

Each node's output passes through an autograd identity whose backward gives the gradient the
placement of the value in forward: DTensor's backward rules are written for those (a view's
backward on a gradient sharded another way can need an uneven split DTensor refuses).

References:
    Elango, "Automatic Parallelization Strategies for Efficient DNN Training" (PaSE), IPDPS 2021;
    torch.distributed.tensor (DTensor: ``distribute_tensor``, ``redistribute``, ``full_tensor``).
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from fxsplit.errors import ConfigError
from fxsplit.passes.parallel_strategies import NodeLayout
from fxsplit.runtime.state import ParameterAPI, grad_norm

__all__ = ["LayersCalibration", "ParallelGraph", "ParallelPlan", "attr_placements", "placement_of", "same_on_every_rank",
           "shard_stage"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelPlan:
    """What a :class:`ParallelGraph` runs and what the planner predicted for it.

    Attributes:
        strategy: ``"auto"``, ``"data-parallel"``, ``"megatron"``, ``"replicate"`` or ``"given"``.
        choice: ``[num_vertices]`` the option index per vertex of the strategy graph.
        predicted_step_s: Compute plus redistribution per device and step, seconds (the
            strategy graph's cost model).
        memory_bytes: Per-device bytes of the choice (parameters with their gradients and
            optimizer state, activations, after sharding).
        solver: ``"pase-elimination"``, ``"pase-dp"``, ``"pase-cpsat"``, ``"rule"`` or ``"given"``.
        proven: An exact solver proved the choice optimal for its family.
        baselines: Predicted seconds of ``"data-parallel"`` and ``"replicate"`` on the same model.
    """

    strategy: str
    choice: tuple[int, ...]
    predicted_step_s: float
    memory_bytes: float
    solver: str
    proven: bool
    baselines: dict[str, float] = field(default_factory=dict)
    op_overhead_s: float = 0.0


@dataclass(frozen=True)
class LayersCalibration:
    """What :meth:`ParallelGraph.calibrate` measured and chose (seconds per training step, the
    slowest rank's median).

    Attributes:
        op_overhead_s: The DTensor dispatch per split op fitted (forward; backward twice).
        before_predicted_s, before_measured_s: The plan it started from.
        replicated_predicted_s, replicated_measured_s: Every rank doing everything (plain).
        after_predicted_s, after_measured_s: The plan re-chosen with ``op_overhead_s`` (the same
            plan when nothing changed).
        changed: Whether the plan changed (a new :class:`ParallelGraph` was built).
    """

    op_overhead_s: float
    before_predicted_s: float
    before_measured_s: float
    replicated_predicted_s: float
    replicated_measured_s: float
    after_predicted_s: float
    after_measured_s: float
    changed: bool


def placement_of(name: str) -> Any:
    """The DTensor placement of a name :func:`~fxsplit.passes.parallel_strategies.placement_name`
    gives: ``"R"`` -> ``Replicate()``, ``"S(d)"`` -> ``Shard(d)``, ``"P"`` -> ``Partial()``; None for
    one this runtime does not build (a strided shard, a multi-output op's tuple).

    Example:
        >>> placement_of("S(1)")
        Shard(dim=1)
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    if name == "R":
        return Replicate()
    if name == "P":
        return Partial()
    if name.startswith("S(") and name.endswith(")") and name[2:-1].lstrip("-").isdigit():
        return Shard(int(name[2:-1]))
    return None


class _KeepGradLayout(torch.autograd.Function):
    """Identity in forward; in backward, the gradient redistributed to the placements the value
    had in forward (when it arrives otherwise), a partial sum's as a replica (the gradient of
    each addend is the whole gradient)."""

    @staticmethod
    def forward(ctx: Any, value: Any) -> Any:
        from torch.distributed.tensor import Replicate

        ctx.placements = tuple(Replicate() if p.is_partial() else p for p in value.placements)
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(ctx.placements):
            grad = grad.redistribute(grad.device_mesh, ctx.placements)
        return grad


class ParallelGraph(ParameterAPI):
    """A graph run over a 1-D device mesh with one placement per node; call on every rank.

    Args:
        gm: The captured graph (``torch.export``'s flat graph, parameters and buffers as
            ``get_attr`` nodes), with this rank's copy of every weight (the same on every rank).
        layout: Node name -> :class:`~fxsplit.passes.parallel_strategies.NodeLayout`
            (:meth:`NodeStrategies.layout` of the chosen strategies); nodes not named run on
            whatever placements their operands have.
        mesh: The ``DeviceMesh`` (1-D) the placements are over.
        trainable: Graph names (``get_attr`` targets) of trainable parameters.
        aliases: Graph name -> every original name of that tensor (tied weights have several).
        fallback: Nodes to run on whole tensors (no DTensor strategy).
        local: ``get_attr`` target -> the whole tensor's shape, for the tensors ``gm`` holds
            already as this rank's chunk of the placement the layout gives them
            (:func:`~fxsplit.runtime.dist_state.materialise` with ``shards``): wrapped as they
            are (``DTensor.from_local``), never cut again.
        unflatten: Builds the model's output structure from the graph's flat outputs.
        flatten: Flattens ``(args, kwargs)`` into the graph's inputs.
        state_order: Original names in the model's ``state_dict`` order.

    Raises:
        ConfigError: for a layout naming a node the graph lacks.
    """

    def __init__(self, gm: torch.fx.GraphModule, layout: Mapping[str, NodeLayout], mesh: Any, *,
                 trainable: frozenset[str], aliases: Mapping[str, tuple[str, ...]],
                 fallback: Sequence[str] = (),
                 flatten: Callable[[Sequence[Any], Mapping[str, Any]], list[Any]],
                 unflatten: Callable[[Sequence[Any]], Any],
                 state_order: Sequence[str] = (), local: Mapping[str, tuple[int, ...]] | None = None) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        names = {n.name for n in gm.graph.nodes}
        unknown = sorted(set(layout) - names)
        if unknown:
            raise ConfigError(f"the layout names nodes {unknown[:5]} the graph does not have; build it from "
                              "strategy_graph(gm, ...) of this graph")
        self.gm, self.layout, self.mesh = gm, dict(layout), mesh
        self.trainable = frozenset(trainable)
        self.fallback = frozenset(fallback)
        self.aliases = dict(aliases)
        self._flatten, self._unflatten = flatten, unflatten
        self.state_order = list(state_order)
        self.relayouts: Counter[str] = Counter()
        self.run_whole: set[str] = set()
        self.values: dict[str, Any] = {}  # get_attr target -> DTensor (Parameter when trainable)
        self.plan: ParallelPlan | None = None
        self.replanner: Callable[[float], tuple[Mapping[str, NodeLayout], Sequence[str], ParallelPlan]] | None = None
        """Set by :func:`fxsplit.distributed.parallelize`: the plan again for a dispatch overhead
        (collective), for :meth:`calibrate`."""
        for target, want in attr_placements(gm, self.layout).items():
            tensor = _attr(gm, target)
            if not isinstance(tensor, torch.Tensor):
                continue
            value: torch.Tensor
            if local and target in local and want is not None:  # this rank's chunk since materialised
                shape = torch.Size(local[target])
                value = DTensor.from_local(tensor.detach(), mesh, [want], run_check=False, shape=shape,
                                           stride=torch.empty(shape, device="meta").stride())
            else:
                value = tensor.detach() if want is None or want.is_replicate() else distribute_tensor(
                    tensor.detach(), mesh, [want], src_data_rank=None)  # a replica: a plain tensor, whole
            self.values[target] = nn.Parameter(value) if target in trainable else value

    # -- running -----------------------------------------------------------------------------
    def run_flat(self, flat: Sequence[Any], *, check: bool = True) -> list[Any]:
        """Run the graph on its flat inputs (the whole batch, the same on every rank; ``check``:
        verify that with one ``all_gather_object``); return the flat outputs, whole. Collective.

        Raises:
            ConfigError: on every rank, when the ranks were given different inputs.
        """
        if check:
            same_on_every_rank(flat, "inputs")
        return _Runner(self).run(*flat)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output for the whole batch (every rank passes the same inputs), whole on
        every rank. Collective."""
        return self._unflatten(self.run_flat(self._flatten(args, kwargs)))

    def train_step(self, *args: Any, target: Any = None, loss_fn: Callable[[Any, Any], torch.Tensor],
                   **kwargs: Any) -> torch.Tensor:
        """Forward, ``loss_fn(output, target)`` and backward on every rank (the same batch and
        target everywhere); gradients accumulate in the parameter shards. Returns the loss,
        detached, on every rank. Collective.

        Raises:
            ConfigError: for a ``loss_fn`` that is not callable or returns no scalar tensor; on
                every rank, when the ranks were given different inputs or targets (each rank
                would otherwise train on its own batch and the shards would disagree silently).
        """
        if not callable(loss_fn):
            raise ConfigError(f"train_step needs loss_fn=callable(output, target) -> scalar, got {loss_fn!r}")
        flat = self._flatten(args, kwargs)
        same_on_every_rank([*flat, target], "inputs and targets")  # one collective for both
        loss = loss_fn(self._unflatten(self.run_flat(flat, check=False)), target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigError(f"loss_fn returned {type(loss).__name__} {getattr(loss, 'shape', '')}; give a scalar tensor")
        loss.backward()
        return loss.detach()

    def calibrate(self, *args: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor], steps: int = 3,
                  **kwargs: Any) -> tuple[ParallelGraph, LayersCalibration]:
        """Measure this plan and the replicated one, fit the dispatch each op run on DTensors
        costs, re-plan with it and rebuild when the plan changes; collective.

        ``steps`` training steps of each (after one warm-up) on the given batch; the fitted
        overhead is ``((measured - replicated measured) - (predicted - replicated predicted)) /
        (3 x split ops)`` on top of the overhead the plan was made with. Gradients are left as
        they were before the call, and a rebuilt plan starts from this one's weights: make the
        optimizer over the returned graph's parameters.

        Returns:
            ``(graph, report)``: ``self`` when the plan did not change, else a new
            :class:`ParallelGraph`; the :class:`LayersCalibration`.

        Raises:
            ConfigError: for ``steps < 1``, or a graph :func:`fxsplit.distributed.parallelize`
                did not make (no re-planner).
        """
        if steps < 1:
            raise ConfigError(f"calibrate(steps={steps}): measure at least 1 step")
        if self.replanner is None or self.plan is None:
            raise ConfigError("calibrate needs a graph made by fxsplit.distributed.parallelize (it re-plans)")
        saved = self._stash_grads()
        try:
            replicated = self._sibling({}, ())
            before = _median_step_s(self, args, kwargs, target, loss_fn, steps)
            whole = _median_step_s(replicated, args, kwargs, target, loss_fn, steps)
            plan = self.plan
            replicated_predicted = plan.baselines.get("replicate", plan.predicted_step_s)
            extra = (before - whole) - (plan.predicted_step_s - replicated_predicted)
            overhead = max(0.0, plan.op_overhead_s + extra / (3 * self.split_ops)) if self.split_ops else plan.op_overhead_s
            layout, fallback, new_plan = self.replanner(overhead)
            graph = self
            if new_plan.choice != plan.choice:
                graph = self._sibling(layout, fallback)
                graph.load_state_dict(self.state_dict())
                graph.plan, graph.replanner = new_plan, self.replanner
                after = _median_step_s(graph, args, kwargs, target, loss_fn, steps)
            else:
                self.plan = new_plan
                after = before
        finally:
            self._unstash_grads(saved, ok=False)  # this graph's gradients as before the call
        return graph, LayersCalibration(overhead, plan.predicted_step_s, before, replicated_predicted, whole,
                                        new_plan.predicted_step_s, after, graph is not self)

    def _sibling(self, layout: Mapping[str, NodeLayout], fallback: Sequence[str]) -> ParallelGraph:
        """Another plan of the same graph (weights from the graph's own tensors)."""
        return ParallelGraph(self.gm, layout, self.mesh, trainable=self.trainable, aliases=self.aliases,
                             fallback=fallback, flatten=self._flatten, unflatten=self._unflatten,
                             state_order=self.state_order)

    # -- state ---------------------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(original name, DTensor parameter)``; a tied parameter once, under its first name."""
        for target, value in self.values.items():
            if isinstance(value, nn.Parameter):
                yield self.aliases.get(target, (target,))[0], value

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, whole, under every original name: the unsplit model's keys in
        its order (``state_order``; every graph tensor when that is empty). Collective: gathers
        the shards on every rank."""
        out: dict[str, torch.Tensor] = {}
        for target, value in self.values.items():
            whole = _whole_value(value.detach())
            for name in self.aliases.get(target, (target,)):
                out[name] = whole
        if not self.state_order:
            return out
        return {k: out[k] for k in self.state_order if k in out}  # the model's keys (no non-persistent buffers)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy whole tensors (original names, e.g. another plan's :meth:`state_dict`) into this
        plan's shards and replicas; every rank passes the same ones.

        Raises:
            ConfigError: naming the trainable parameters no key of ``state_dict`` fills (a buffer
                it leaves out, a non-persistent one, keeps its value).
        """
        from torch.distributed.tensor import DTensor, distribute_tensor

        found = {t: next((n for n in self.aliases.get(t, (t,)) if n in state_dict), None) for t in self.values}
        missing = [t for t, n in found.items() if n is None and t in self.trainable]
        if missing:
            raise ConfigError(f"state_dict has no value for {missing[:5]} ({len(missing)} graph tensors); pass the "
                              "model's whole state dict")
        with torch.no_grad():
            for target, value in self.values.items():
                if found[target] is None:
                    continue  # a buffer the state dict leaves out (non-persistent): keeps its value
                whole = state_dict[str(found[target])]
                if isinstance(value, DTensor):
                    piece = distribute_tensor(whole.detach(), value.device_mesh, value.placements, src_data_rank=None)
                    value.to_local().copy_(piece.to_local())
                else:
                    value.copy_(whole)

    def _grad_norms(self, norm_type: float) -> dict[str, float]:
        """Each trainable tensor's gradient norm, its shards gathered whole first (collective:
        every rank holds every tensor, split or replicated, so each counts it once)."""
        return {target: grad_norm(_whole_value(value.grad), norm_type) for target, value in self.values.items()
                if isinstance(value, nn.Parameter) and value.grad is not None}

    def grads(self) -> dict[str, torch.Tensor | None]:
        """Every trainable parameter's gradient, whole, under its original names. Collective."""
        out: dict[str, torch.Tensor | None] = {}
        for target, value in self.values.items():
            if isinstance(value, nn.Parameter):
                whole = None if value.grad is None else _whole_value(value.grad)
                for name in self.aliases.get(target, (target,)):
                    out[name] = whole
        return out

    @property
    def split_ops(self) -> int:
        """Ops that run on DTensors (an operand or the output split or partial); the rest run plain."""
        return sum(1 for n in self.gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
                   and not _replicated(self.layout.get(n.name)) and n.name not in self.fallback)

    def placements(self) -> dict[str, str]:
        """Original parameter name -> its placement (``"S(0)"``, ``"R"``)."""
        from fxsplit.passes.parallel_strategies import placement_name

        return {name: placement_name(value._spec) if hasattr(value, "_spec") else "R"
                for name, value in self.named_parameters()}


def attr_placements(gm: torch.fx.GraphModule, layout: Mapping[str, NodeLayout]) -> dict[str, Any]:
    """Each ``get_attr`` target of ``gm`` -> the placement ``layout`` gives its first
    ``get_attr`` node (:func:`placement_of`; None where the layout names none): how
    :class:`ParallelGraph` holds that tensor, and so the chunk a rank materialises of it."""
    out: dict[str, Any] = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        target = str(node.target)
        if target not in out:
            out[target] = placement_of(layout[node.name].output) if node.name in layout else None
    return out


def shard_stage(gm: torch.fx.GraphModule, layout: Mapping[str, NodeLayout], mesh: Any, *,
                fallback: Sequence[str] = (), local: Mapping[str, tuple[int, ...]] | None = None) -> ParallelGraph:
    """Split one pipeline stage's ops over a tensor-parallel mesh, in place: every parameter and
    buffer of ``gm`` the plan splits becomes a DTensor shard (a trainable one an
    ``nn.Parameter``), set on ``gm`` itself so the stage's state, optimizer and checkpoints see
    it; call on every rank of ``mesh``, each holding the same whole weights.

    Args:
        gm: The stage (``fxsplit.codegen`` keeps the captured graph's node names and shapes).
        layout: Node name -> placement, from the per-layer plan of the whole captured graph
            (:meth:`NodeStrategies.layout`); entries for other stages' nodes are ignored.
        mesh: The stage's 1-D tensor-parallel ``DeviceMesh``.
        fallback: Nodes to run on whole tensors.
        local: The tensors ``gm`` holds as this rank's chunk already (as :class:`ParallelGraph`).

    Returns:
        The :class:`ParallelGraph` whose :meth:`~ParallelGraph.run_flat` runs the stage: its
        inputs arrive whole (each rank takes its piece as planned; a received activation's
        gradient goes back whole), its outputs leave whole.
    """
    names = {n.name for n in gm.graph.nodes}
    mine = {k: v for k, v in layout.items() if k in names}
    trainable = frozenset(str(n.target) for n in gm.graph.find_nodes(op="get_attr")
                          if isinstance(_attr(gm, str(n.target)), nn.Parameter) and _attr(gm, str(n.target)).requires_grad)
    graph = ParallelGraph(gm, mine, mesh, trainable=trainable, aliases={}, fallback=[f for f in fallback if f in names],
                          flatten=lambda a, k: list(a), unflatten=list, local=local)
    for target, value in graph.values.items():
        owner_name, _, leaf = target.rpartition(".")
        owner = gm.get_submodule(owner_name) if owner_name else gm
        if leaf in owner._parameters:
            owner._parameters[leaf] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
        else:
            owner._buffers[leaf] = value
    return graph


def _median_step_s(graph: ParallelGraph, args: Sequence[Any], kwargs: Mapping[str, Any], target: Any,
                   loss_fn: Callable[[Any, Any], torch.Tensor], steps: int) -> float:
    """The slowest rank's median seconds of ``graph.train_step`` (a barrier before and after each
    step; one warm-up step first); gradients set to None after each."""
    import statistics

    import torch.distributed as dist

    from fxsplit.runtime.trace import barrier_timed_s

    times = []
    for i in range(steps + 1):
        wall = barrier_timed_s(lambda: graph.train_step(*args, target=target, loss_fn=loss_fn, **kwargs))
        if i:
            times.append(wall)
        graph.zero_grad(set_to_none=True)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def _whole_value(value: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (collective); a plain tensor (a replica) as it is."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def same_on_every_rank(values: Sequence[Any], what: str) -> None:
    """Check that every rank holds the same ``values`` (shapes, dtypes and a float64 checksum of
    each tensor; other values by ``repr``); one ``all_gather_object``.

    Raises:
        ConfigError: on every rank, naming the first value that differs and the ranks' digests.
    """
    import torch.distributed as dist

    def digest(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            t = torch.view_as_real(v.detach()) if v.is_complex() else v.detach()
            t = t.cpu().double()  # the same tensor gives the same sums, bit for bit
            return (tuple(v.shape), str(v.dtype), float(t.sum()), float((t * t).sum()))
        return repr(v)

    mine = [digest(v) for v in values]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for i in range(len(mine)):
        seen = [d[i] if i < len(d) else None for d in every]
        if any(d != seen[0] for d in seen):
            raise ConfigError(f"the ranks were given different {what} (value {i}: {seen}); a per-layer plan splits one "
                              "batch over the ranks, so every rank must pass the same batch and target")


def _attr(gm: torch.nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _replicated(plan: NodeLayout | None) -> bool:
    """Whether a node runs on whole values everywhere: its output (each output of a multi-output
    op, ``"(R,R)"``) and every operand replicated."""
    if plan is None:
        return True
    outputs = plan.output[1:-1].split(",") if plan.output.startswith("(") else [plan.output]
    return all(p == "R" for p in [*outputs, *plan.inputs])


class _Runner(torch.fx.Interpreter):
    """One forward of a :class:`ParallelGraph`: an FX interpreter over plain tensors (replicated
    values: every rank holds the whole value) and DTensors (split or partial values)."""

    def __init__(self, owner: ParallelGraph) -> None:
        super().__init__(owner.gm)
        self.owner = owner
        self.node: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        self.node = n
        return super().run_node(n)

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

        value = super().placeholder(target, args, kwargs)
        assert self.node is not None
        want = _want(self.owner.layout.get(self.node.name))
        if not isinstance(value, torch.Tensor) or want is None or want.is_replicate():
            return value
        if value.requires_grad:  # a stage's input: its gradient (whole, on every rank) goes back to the sender
            whole = DTensor.from_local(value, self.owner.mesh, [Replicate()], run_check=False)
            return _KeepGradLayout.apply(whole.redistribute(self.owner.mesh, [want]))
        return distribute_tensor(value, self.owner.mesh, [want], src_data_rank=None)

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        value = self.owner.values.get(str(target))
        return value if value is not None else super().get_attr(target, args, kwargs)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        node = self.node
        assert node is not None
        plan = self.owner.layout.get(node.name)
        if target is operator.getitem or plan is None:
            # an item of a multi-output op, or no vertex (sizes, non-tensor values): as it comes
            # (DTensor answers sizes with the global ones)
            return super().call_function(target, args, kwargs)
        if node.name in self.owner.fallback or node.name in self.owner.run_whole or _replicated(plan):
            return self._whole(target, args, kwargs)  # replicated: the op itself, on whole values
        args, kwargs = self._operands(plan, args, kwargs)
        try:
            out = super().call_function(target, args, kwargs)
        except (NotImplementedError, RuntimeError) as exc:
            if "DTensor" not in str(exc) and "shard" not in str(exc).lower():
                raise
            log.warning("%s (%s) fails sharded on DTensor (%s); it runs on whole tensors", node.name, target,
                        str(exc).splitlines()[0])
            self.owner.run_whole.add(node.name)
            return self._whole(target, args, kwargs)
        return self._settle(out, plan, node.name)

    def _operands(self, plan: NodeLayout, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Plain tensors (whole values) replicated; each DTensor operand moved to the placement the
        chosen strategy expects of it (operands in DTensor's order: args, then kwargs, depth first)."""
        from torch.distributed.tensor import DTensor, Replicate

        wants = [placement_of(p) for p in plan.inputs]
        position = 0

        def move(value: Any) -> Any:
            nonlocal position
            if not isinstance(value, torch.Tensor):
                return value
            if not isinstance(value, DTensor):
                value = DTensor.from_local(value, self.owner.mesh, [Replicate()], run_check=False)
            want = wants[position] if position < len(wants) else None
            position += 1
            if want is not None and tuple(value.placements) != (want,):
                return value.redistribute(value.device_mesh, [want])
            return value

        flat, spec = pytree.tree_flatten((args, kwargs))
        return pytree.tree_unflatten([move(v) for v in flat], spec)

    def _settle(self, out: Any, plan: NodeLayout, name: str) -> Any:
        """The op's output at its planned placement (a whole value as a plain tensor), its
        gradient kept at that placement."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        want = _want(plan)
        if isinstance(out, torch.Tensor) and not isinstance(out, DTensor):  # a factory (arange, zeros)
            return out if want is None or want.is_replicate() else distribute_tensor(out, self.owner.mesh, [want],
                                                                                     src_data_rank=None)
        if not isinstance(out, DTensor):
            return out
        if want is not None and tuple(out.placements) != (want,):
            self.owner.relayouts[name] += 1
            out = out.redistribute(out.device_mesh, [want])
        if want is not None and want.is_replicate():
            return out.to_local()  # whole on every rank: plain from here on
        return _KeepGradLayout.apply(out) if out.requires_grad else out

    def _whole(self, target: Any, args: Any, kwargs: Any) -> Any:
        """Run an op on whole values: DTensor operands gathered; the result is plain (whole on
        every rank)."""
        from torch.distributed.tensor import DTensor

        def gather(value: Any) -> Any:
            return value.full_tensor() if isinstance(value, DTensor) else value

        return target(*pytree.tree_map(gather, args), **pytree.tree_map(gather, kwargs))

    def output(self, target: Any, args: Any, kwargs: Any) -> Any:
        from torch.distributed.tensor import DTensor

        return [v.full_tensor() if isinstance(v, DTensor) else v for v in args[0]]


def _want(plan: NodeLayout | None) -> Any:
    return placement_of(plan.output) if plan is not None else None
