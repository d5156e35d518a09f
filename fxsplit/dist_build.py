"""Building this rank's stages of a distributed pipeline from a checked plan.

:func:`fxsplit.distributed.compile` and :meth:`~fxsplit.dist_calibrate.CompiledDistributedPipeline.calibrate`
(which rebuilds on a new plan) share these steps: cut the captured graph by the plan
(:func:`fxsplit.codegen.split_graph`), create one process group per tensor several ranks hold
(:func:`tied_groups`), fill the stages' tensors, and wrap the stages in their runtime
(:func:`build_pipeline`). Rank ``r`` of ``R`` runs stages ``r, r + R, ...``
(:func:`~fxsplit.runtime.distributed.rank_of`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from fxsplit.codegen.place import get_state
from fxsplit.errors import ConfigError
from fxsplit.ir import Plan
from fxsplit.options import autocast_dtype
from fxsplit.runtime.dist_shapes import WireShapes
from fxsplit.runtime.dist_stage import StageModule
from fxsplit.runtime.dist_state import StageState
from fxsplit.runtime.distributed import DistributedPipeline, RankStage, Replicas, TiedGroup, rank_of
from fxsplit.runtime.microbatch import batch_size_of, microbatch_sizes
from fxsplit.runtime.tensor_parallel import shard_stage

__all__ = ["batched_flags", "broadcast_tied", "build_pipeline", "rank_chunks", "rank_stages", "tied_groups", "tied_holders",
           "to_meta", "tp_chunks"]

P = TypeVar("P", bound=DistributedPipeline)


def to_meta(values: Any) -> Any:
    """``values`` (any pytree) with every tensor moved to the meta device."""
    return pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, values)


def rank_stages(program: Any, rank: int, world: int) -> list[Any]:
    """The stages of ``program`` that ``rank`` of ``world`` runs (looping placement)."""
    return [st for st in program.stages if rank_of(st.index, world) == rank]


def replica_groups(world: int, replicas: int, tp: int = 1) -> Replicas | None:
    """The ``[pp, dp, tp]`` mesh of ``world`` ranks with ``replicas`` (``dp``) copies of every
    stage, each split over ``tp`` ranks: rank ``r`` runs pipeline rank ``r // (dp * tp)`` of
    replica ``(r // tp) % dp``, shard ``r % tp`` (a ``DeviceMesh`` of that shape, ``tp``
    innermost, lays the ranks out so). Creates every pipeline's, every stage's and every tensor-
    parallel process group on every rank, in one order (``new_group`` is collective); None for
    ``replicas == tp == 1`` (one pipeline over every rank).

    Raises:
        ConfigError: when ``replicas * tp`` does not divide ``world``.
    """
    if replicas < 1 or tp < 1 or world % (replicas * tp):
        raise ConfigError(f"replicas={replicas} x tensor_parallel={tp} does not divide the {world} ranks; give "
                          f"degrees whose product divides {world} (each pipeline needs world / (replicas x tp) ranks)")
    if replicas == tp == 1:
        return None
    rank, pp = dist.get_rank(), world // (replicas * tp)

    def at(s: int, d: int, t: int) -> int:
        return (s * replicas + d) * tp + t

    mine: dict[str, Any] = {}
    for d in range(replicas):  # the pipelines
        for t in range(tp):
            group = dist.new_group(ranks=[at(s, d, t) for s in range(pp)])
            if rank in {at(s, d, t) for s in range(pp)}:
                mine["pipeline"] = group
    if replicas > 1:
        for s in range(pp):  # each stage's replicas (one group per shard)
            for t in range(tp):
                group = dist.new_group(ranks=[at(s, d, t) for d in range(replicas)])
                if rank in {at(s, d, t) for d in range(replicas)}:
                    mine["stage"] = group
    tp_mesh = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        tp_mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("copies", "tp"))["tp"]
    if replicas > 1 and tp > 1:
        for s in range(pp):  # every copy of each stage (with one of dp or tp, the stage's or the tp group)
            group = dist.new_group(ranks=list(range(at(s, 0, 0), at(s + 1, 0, 0))))
            if at(s, 0, 0) <= rank < at(s + 1, 0, 0):
                mine["copies"] = group
    copies = mine.get("copies") or (mine["stage"] if tp == 1 else tp_mesh.get_group())  # type: ignore[union-attr]
    return Replicas(replicas, (rank // tp) % replicas, mine.get("stage"), mine["pipeline"], tp, rank % tp, tp_mesh,
                    copies)


def tied_groups(program: Any, world: int, replicas: int = 1, tp: int = 1) -> list[TiedGroup]:
    """The tensors read by several stages that this rank holds a copy of; one subgroup per
    tensor held on several ranks (per replica and shard of the pipeline, :func:`replica_groups`),
    created on every rank in name order (``new_group`` is collective)."""
    groups = []
    pp = world // (replicas * tp)
    holders = tied_holders(program)
    for name in sorted(holders):
        for d in range(replicas):
            for t in range(tp):
                ranks = tuple(sorted({(rank_of(s, pp) * replicas + d) * tp + t for s in holders[name]}))
                group = dist.new_group(ranks=list(ranks)) if len(ranks) > 1 else None
                if dist.get_rank() in ranks:
                    groups.append(TiedGroup(name, ranks, group))
    return groups


def tied_holders(program: Any) -> dict[str, list[int]]:
    """Graph name -> the stages (indices) of ``program`` that read it, for every trainable
    parameter read by more than one stage (a tied weight: its copies' gradients are summed;
    buffers need no sum)."""
    holders: dict[str, list[int]] = {}
    for st in program.stages:
        for name in st.state:
            tensor = get_state(st.gm, name)
            if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
                holders.setdefault(name, []).append(st.index)
    return {name: stages for name, stages in holders.items() if len(stages) > 1}


def tp_chunks(gm: torch.fx.GraphModule, layout: Mapping[str, Any], index: int, count: int, *,
              keep_whole: set[str] | frozenset[str] = frozenset()) -> dict[str, tuple[int, int, int]]:
    """The state tensors of the stage ``gm`` that the per-layer plan ``layout`` splits
    (``Shard(d)``, :func:`~fxsplit.runtime.tensor_parallel.attr_placements`, as
    :class:`~fxsplit.runtime.tensor_parallel.ParallelGraph` holds them): ``get_attr`` target -> ``(d, index, count)``, the chunk this tensor-parallel rank
    holds (:func:`~fxsplit.runtime.dist_state.materialise`'s ``shards``). ``keep_whole``: targets
    left whole (a tied weight: its copies in other stages may be split otherwise)."""
    from fxsplit.runtime.tensor_parallel import attr_placements

    return {target: (want.dim, index, count) for target, want in attr_placements(gm, layout).items()
            if target not in keep_whole and want is not None and want.is_shard() and want.dim >= 0}


def rank_chunks(stages: Sequence[Any], layout: Mapping[str, Any], index: int, count: int,
                tied: set[str] | frozenset[str]) -> dict[int, dict[str, tuple[int, int, int]]]:
    """Stage index -> :func:`tp_chunks` of each of one rank's ``stages`` (``fxsplit.codegen``
    stages): what tensor-parallel rank ``index`` of ``count`` holds as its chunk. A tensor in
    ``tied`` (read by several stages) or held by two of these stages stays whole."""
    out = {}
    for stage in stages:
        shared = set(tied) | {g for other in stages if other is not stage for g in other.state}
        out[stage.index] = {g: c for g, c in tp_chunks(stage.gm, layout, index, count, keep_whole=shared).items()
                            if g in stage.state}
    return out


def broadcast_tied(stages: Sequence[Any], tied: list[TiedGroup]) -> None:
    """Give every copy of a tied parameter the first holder's values: without a state dict each
    stage initialises its copy with its own random stream, and the copies must start equal.
    ``stages``: this rank's materialised stages (:func:`rank_stages`)."""
    with torch.no_grad():
        for group in tied:
            copies = [get_state(st.gm, group.name).data for st in stages if group.name in st.state]
            if group.group is not None:
                dist.broadcast(copies[0], src=group.ranks[0], group=group.group)
            for copy in copies[1:]:
                copy.copy_(copies[0])


def batched_flags(captured: Any, flat: Sequence[Any]) -> list[bool]:
    """Which flat inputs carry the batch on dim 0: export's symbolic batch dimension
    (``Captured.batched_inputs``), never a coincidence of sizes; by shape (dim 0 equal to the
    first input's) only when export fixed every input's batch and so left no sign."""
    if captured.batched_inputs is not None:
        return list(captured.batched_inputs)
    batch = batch_size_of(flat)
    return [isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch for x in flat]


def build_pipeline(stages: Sequence[tuple[Any, StageState]], captured: Any, inputs: tuple[tuple, dict],
                   num_stages: int, device: torch.device, schedule: str, m: int, tied: list[TiedGroup], *,
                   plan: Plan, autocast: str | None, meta: dict[str, Any], state_order: list[str], timeout_s: float,
                   watchdog: bool, cls: type[P], replicas: Replicas | None = None,
                   split_layout: tuple[Mapping[str, Any], Sequence[str]] | None = None,
                   local_shards: Mapping[int, Mapping[str, tuple[int, ...]]] | None = None,
                   training: bool | None = None) -> P:
    """This rank's runtime (``cls``, a :class:`DistributedPipeline`) around its materialised
    stages, ``(stage, state)`` pairs (:func:`rank_stages`); ``inputs`` is ``(args, kwargs)``,
    one replica's share of a batch. ``split_layout``: ``(layout, fallback)`` of the per-layer
    plan each stage runs over ``replicas.tp_mesh`` (:func:`~fxsplit.runtime.tensor_parallel.shard_stage`;
    every copy of a stage must hold the same weights); ``local_shards``: stage index -> the
    tensors it holds as this rank's chunk already (``shard_stage``'s ``local``); ``training``: the
    mode the model was captured in."""
    flat = captured.flatten_inputs(*inputs)
    batched = batched_flags(captured, flat)
    batch = batch_size_of([x for x, b in zip(flat, batched, strict=True) if b] or flat)
    dtype = autocast_dtype(autocast)  # mixed precision: stages, wire shapes and loss under autocast
    held = []
    for stage, state in stages:
        first, last = stage.index == 0, stage.index == num_stages - 1
        recompute = plan.stages[stage.index].recompute
        parallel = None
        if split_layout is not None and replicas is not None and replicas.tp > 1:
            parallel = shard_stage(stage.gm, split_layout[0], replicas.tp_mesh, fallback=split_layout[1],
                                   local=(local_shards or {}).get(stage.index))
        module = StageModule(stage.gm, first=first, last=last, batched=batched, recompute=recompute,
                             autocast=(device.type, dtype) if dtype is not None else None, parallel=parallel)
        shapes = WireShapes(
            captured.gm, to_meta(flat), batched, inputs=stage.inputs, outputs=stage.outputs,
            in_layouts=module.in_layouts, out_layouts=module.out_layouts, first=first, last=last, index=stage.index,
            autocast=(device, dtype) if dtype is not None else None,
        )
        for size in sorted({s for s in microbatch_sizes(batch, m) if s > 0}):
            shapes.example_args(size, train=True)  # a boundary shape the data decides fails here, on every rank
        held.append(RankStage(module, state, stage.index, shapes))
    return cls(
        held, num_stages=num_stages, device=device, schedule_kind=schedule,
        microbatches=m, in_spec=captured.in_spec, out_spec=captured.out_spec, tied=tied,
        state_order=state_order, plan=plan, autocast=autocast, meta=meta, timeout_s=timeout_s, watchdog=watchdog,
        batched_inputs=batched, batched_outputs=captured.batched_outputs, layout=captured.layout, replicas=replicas,
        input_guards=captured.guards, size_outputs=captured.size_output_values if captured.size_outputs else None,
        training=training,
    )
