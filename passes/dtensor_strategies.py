"""DTensor's sharding strategies for the nodes of an FX graph, on a metadata-only mesh.

The part of :mod:`fxsplit.passes.parallel_strategies` that talks to
``torch.distributed.tensor``'s private sharding propagator (torch 2.13): for a node, the
``OpStrategy`` DTensor defines for its aten op (single-dim rules first, as DTensor's dispatcher
prefers them, then the op's strategy function, then its decomposition), a replicated strategy for
ops it has none for, and the clean-up its results need (output tensor meta, redistribution costs).
Imported lazily: loading DTensor takes seconds.

References:
    torch/distributed/tensor/_sharding_prop.py; meta-pytorch/autoparallel (enumerating every
    placement of every node).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch
import torch.fx

__all__ = ["all_placements", "complete_costs", "flatten_args", "normalise", "op_strategy", "replicated", "tensor_inputs"]

log = logging.getLogger(__name__)


def all_placements(mesh: Any, val: torch.Tensor) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
    from torch.distributed.tensor._ops.utils import is_tensor_shardable

    meta = TensorMeta(val.shape, val.stride(), val.dtype)
    specs = []
    for placement in [Replicate()] + [Shard(d) for d in range(val.dim())]:
        spec = DTensorSpec(mesh, (placement,), tensor_meta=meta)
        if is_tensor_shardable(val.shape, spec):
            specs.append(OpSpec(spec))
    return OpStrategy(specs)


def op_strategy(node: torch.fx.Node, mesh: Any, strategies: dict[torch.fx.Node, Any]) -> tuple[Any, bool]:
    """DTensor's strategies for ``node`` (an OpStrategy) and whether they are the replicated
    fallback. Single-dim rules first (DTensor's dispatcher prefers them), then the op's strategy
    function, then its decomposition."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, TupleStrategy
    from torch.distributed.tensor._ops.single_dim_strategy import (
        _fill_single_dim_strategy_placeholders,
        _get_num_tensor_inputs,
        _insert_single_dim_replication_strategy,
    )
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    propagator = DTensor._op_dispatcher.sharding_propagator
    op: Any = node.target  # an OpOverload (DTensor's private APIs are typed for that alone)

    def arg(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return strategies[a] if a in strategies else a.meta.get("val")
        if isinstance(a, list | tuple):
            items = [arg(x) for x in a]
            if items and all(isinstance(x, OpStrategy) for x in items):
                return TupleStrategy(items)
            return type(a)(items)
        return a

    info = propagator.op_to_schema_info.get(op) or propagator.op_to_schema_info_for_single_dim_strategy.get(op)
    schema = OpSchema(op, tuple(arg(a) for a in node.args), {k: arg(v) for k, v in node.kwargs.items()},
                      schema_info=info)
    val = node.meta["val"]
    multi = isinstance(val, list | tuple)
    out_meta: Any = (tuple(TensorMeta(v.shape, v.stride(), v.dtype) for v in val) if multi
                     else TensorMeta(val.shape, val.stride(), val.dtype))
    n_out = len(val) if multi else 1
    try:
        if op in propagator.op_single_dim_strategy_funcs:
            single = propagator.op_single_dim_strategy_funcs[op]
            rules = single.func(op, schema.args_meta, schema.kwargs_meta)
            rules = _insert_single_dim_replication_strategy(rules, n_out, _get_num_tensor_inputs(schema), out_meta)
            rules = _fill_single_dim_strategy_placeholders({Shard(0)}, rules)
            return expand_to_full_mesh_op_strategy(
                mesh, schema, rules, output_tensor_meta=out_meta, input_index=n_out,
                inplace_op=str(op).split(".")[-2].endswith("_"),
                allow_unbacked_sharding=single.allow_unbacked_sharding,
                allow_uneven_sharding=single.allow_uneven_sharding), False
        if op in propagator.op_strategy_funcs:
            return propagator.op_strategy_funcs[op](schema), False
        decomposed = _decomposed(node, mesh, schema, out_meta, n_out)
        if decomposed is not None:
            return decomposed, False
    except (NotImplementedError, AssertionError, RuntimeError, IndexError, ValueError, KeyError) as exc:
        log.debug("no DTensor strategy for %s (%s): %s", node.name, op, exc)
    return replicated(mesh, val, tensor_inputs(node, strategies), strategies), True


def replicated(mesh: Any, val: Any, inputs: list[torch.fx.Node], strategies: dict[torch.fx.Node, Any]) -> Any:
    """One strategy: every operand gathered whole, the output whole on every device (what an op
    DTensor has no strategy for costs: its inputs' all-gathers, its full work)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy

    def whole(t: torch.Tensor) -> Any:
        return DTensorSpec(mesh, (Replicate(),), tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype))

    out = tuple(whole(v) for v in val) if isinstance(val, list | tuple) else whole(val)
    spec = OpSpec(out, input_specs=[whole(a.meta["val"]) for a in inputs],
                  redistribute_cost=[[0.0] * len(strategies[a].strategies) for a in inputs])
    return OpStrategy([spec])


def _decomposed(node: torch.fx.Node, mesh: Any, schema: Any, out_meta: Any, n_out: int = 1) -> Any:
    """Strategies of a composite op (``aten.linear``, ``layer_norm``, ``softmax.int``) through
    its decomposition: each combination of input placements that propagates through the
    decomposition without a redistribution inside it is a strategy (DTensor's own decomposition
    path only tries the placements its inputs have). None when the op has no decomposition."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._decompositions import DecompShardingStrategy
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    op: Any = node.target  # an OpOverload (DTensor's private APIs are typed for that alone)
    if not DecompShardingStrategy.has_decomp(op):
        return None

    def spec(a: Any) -> Any:  # contiguous strides: the decomposition's views need them
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor):
                return v
            meta = TensorMeta(v.shape, torch.empty(v.shape, device="meta").stride(), v.dtype)
            return DTensorSpec(mesh, (Replicate(),), tensor_meta=meta)
        if isinstance(a, list | tuple):
            return type(a)(spec(x) for x in a)
        return a

    decomp = DTensor._op_dispatcher.sharding_propagator.decomp_strategy
    decomp.ensure_schema_info(op)
    spec_schema = OpSchema(op, tuple(spec(a) for a in node.args), {k: spec(v) for k, v in node.kwargs.items()})
    leaves = torch.utils._pytree.tree_leaves(list(spec_schema.args_schema) + list(spec_schema.kwargs_schema.values()))
    candidates = [[Replicate(), Partial(), *(Shard(d) for d in range(x.ndim))] if isinstance(x, DTensorSpec) else [None]
                  for x in leaves]
    fake_mesh = decomp._get_fake_mesh(mesh.device_type)
    rules: list[list[Any]] = []
    for combo in itertools.product(*candidates):
        try:
            out = decomp._propagate_through_decomp(spec_schema, tuple[Any, ...](combo), fake_mesh)
        except (RuntimeError, KeyError, IndexError, AssertionError, ValueError):
            continue  # would need a redistribution inside the decomposition
        outs = list(out) if isinstance(out, tuple | list) else [out]
        if len(outs) != n_out:
            continue
        rules.append([*outs, *(p for p in combo if p is not None)])
    if not rules:
        return None
    return expand_to_full_mesh_op_strategy(mesh, schema, rules, output_tensor_meta=out_meta, input_index=n_out)


def normalise(strategy: Any, val: Any) -> None:
    """Give output specs their tensor meta (some strategy functions leave it out) and drop the
    strategies that shard a dimension an output does not have (``val``: a tensor, or the tuple of
    a multi-output op's tensors)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    vals = list(val) if isinstance(val, list | tuple) else [val]
    kept = []
    for spec in strategy.strategies:
        outs = spec.output_specs if isinstance(spec.output_specs, list | tuple) else [spec.output_specs]
        if len(outs) != len(vals) or any(o is None for o in outs):
            continue
        for o, v in zip(outs, vals, strict=True):
            if o.tensor_meta is None:
                o.tensor_meta = TensorMeta(v.shape, v.stride(), v.dtype)
        if all(p.dim < v.dim() for o, v in zip(outs, vals, strict=True) for p in o.placements if isinstance(p, Shard)):
            kept.append(spec)
    if not kept:
        raise ValueError("no strategy with valid outputs")
    strategy.strategies = kept


def complete_costs(strategy: Any, inputs: list[Any]) -> None:
    """Give every option its redistribution costs from each input's strategies (some strategy
    functions leave them out) and its output's tensor meta."""
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs

    for spec in strategy.strategies:
        if spec.input_specs is not None and (spec.redistribute_cost is None
                                             or len(spec.redistribute_cost) != len(inputs)):
            spec.redistribute_cost = [generate_redistribute_costs(s, want)
                                      for s, want in zip(inputs, spec.input_specs, strict=False)]


def tensor_inputs(node: torch.fx.Node, strategies: dict[torch.fx.Node, Any]) -> list[torch.fx.Node]:
    """The node's tensor operands in the order DTensor's input specs list them."""
    flat = flatten_args(node.args) + flatten_args(tuple(node.kwargs.values()))
    return [a for a in flat if isinstance(a, torch.fx.Node) and a in strategies]


def flatten_args(args: Any) -> list[Any]:
    out: list[Any] = []
    for a in args:
        if isinstance(a, list | tuple):
            out.extend(flatten_args(a))
        else:
            out.append(a)
    return out
