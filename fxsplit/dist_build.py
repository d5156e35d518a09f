"""Building this rank's stage of a distributed pipeline from a checked plan.

:func:`fxsplit.distributed.compile` and :meth:`~fxsplit.dist_calibrate.CompiledDistributedPipeline.calibrate`
(which rebuilds on a new plan) share these steps: cut the captured graph by the plan
(:func:`fxsplit.codegen.split_graph`), create one process group per tensor several stages hold
(:func:`tied_groups`), fill the stage's tensors, and wrap the stage in its runtime
(:func:`build_pipeline`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from fxsplit.codegen.place import get_state
from fxsplit.runtime.dist_shapes import WireShapes
from fxsplit.runtime.dist_stage import StageModule
from fxsplit.runtime.dist_state import StageState
from fxsplit.runtime.distributed import DistributedPipeline, TiedGroup
from fxsplit.runtime.microbatch import batch_size_of, microbatch_sizes

__all__ = ["batched_flags", "broadcast_tied", "build_pipeline", "to_meta", "tied_groups"]

P = TypeVar("P", bound=DistributedPipeline)


def to_meta(values: Any) -> Any:
    """``values`` (any pytree) with every tensor moved to the meta device."""
    return pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, values)


def tied_groups(program: Any, world: int) -> list[TiedGroup]:
    """One subgroup per tensor read by several stages; created on every rank, in name order
    (``new_group`` is collective); returns the groups this rank belongs to."""
    holders: dict[str, list[int]] = {}
    for st in program.stages:
        for name in st.state:
            tensor = get_state(st.gm, name)
            if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:  # buffers need no sum
                holders.setdefault(name, []).append(st.index)
    groups = []
    for name in sorted(holders):
        ranks = tuple(holders[name])
        if len(ranks) > 1:
            group = dist.new_group(ranks=list(ranks))
            if dist.get_rank() in ranks:
                groups.append(TiedGroup(name, ranks, group))
    return groups


def broadcast_tied(gm: Any, tied: list[TiedGroup]) -> None:
    """Give every copy of a tied parameter the first holder's values: without a state dict each
    rank initialises its copy with its own random stream, and the copies must start equal."""
    with torch.no_grad():
        for group in tied:
            dist.broadcast(get_state(gm, group.name).data, src=group.ranks[0], group=group.group)


def batched_flags(captured: Any, flat: Sequence[Any]) -> list[bool]:
    """Which flat inputs carry the batch on dim 0: export's symbolic batch dimension
    (``Captured.batched_inputs``), never a coincidence of sizes; by shape (dim 0 equal to the
    first input's) only when export fixed every input's batch and so left no sign."""
    if captured.batched_inputs is not None:
        return list(captured.batched_inputs)
    batch = batch_size_of(flat)
    return [isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch for x in flat]


def build_pipeline(stage: Any, captured: Any, inputs: tuple[tuple, dict], rank: int, world: int,
                   device: torch.device, schedule: str, m: int, state: StageState, tied: list[TiedGroup], *,
                   meta: dict[str, Any], state_order: list[str], timeout_s: float, watchdog: bool,
                   cls: type[P]) -> P:
    """This rank's runtime (``cls``, a :class:`DistributedPipeline`) around its materialised
    stage; ``inputs`` is ``(args, kwargs)``."""
    flat = captured.flatten_inputs(*inputs)
    batched = batched_flags(captured, flat)
    module = StageModule(stage.gm, first=rank == 0, last=rank == world - 1, batched=batched)
    shapes = WireShapes(
        captured.gm, to_meta(flat), batched, inputs=stage.inputs, outputs=stage.outputs,
        in_layouts=module.in_layouts, out_layouts=module.out_layouts, first=rank == 0, last=rank == world - 1,
        index=rank,
    )
    batch = batch_size_of([x for x, b in zip(flat, batched, strict=True) if b] or flat)
    for size in sorted({s for s in microbatch_sizes(batch, m) if s > 0}):
        shapes.example_args(size, train=True)  # a boundary shape the data decides fails here, on every rank
    return cls(
        module, state=state, stage_index=rank, num_stages=world, device=device, schedule_kind=schedule,
        microbatches=m, in_spec=captured.in_spec, out_spec=captured.out_spec, tied=tied,
        state_order=state_order, meta=meta, timeout_s=timeout_s, watchdog=watchdog, shapes=shapes,
        batched_inputs=batched, batched_outputs=captured.batched_outputs, layout=captured.layout,
    )
