"""Profiling for a distributed plan: on rank 0's device, and on every CPU rank at once.

Rank 0 plans for every rank, so it times the graph (the profiled cost model,
:mod:`fxsplit.passes.profile`) on a copy materialised on its device with stand-in weights. On
CPU ranks that share a machine the stages then run beside each other: two processes that share
the cores' caches and the memory system run each other 10-18 % slower than one alone
(``bench/fidelity.py --ranks 2``: GPT, BERT, GPT-2 and ResNet stages measured 7-25 % over a
profile taken by rank 0 alone). :func:`profile_together` therefore lets every CPU rank time the
same graph at the same moment, each in its own process, and gives rank 0 the mean of their
timings: the stages are costed under the load they run under, and with more samples.

References:
    Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training", SOSP 2019,
    section 3.1 (profiling each layer on the device it runs on).
"""

from __future__ import annotations

import copy
import logging
import os
import statistics
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from fxsplit.frontend import load_per_core, profile_options, save_unless_busy
from fxsplit.ir import CondensedGraph, DeviceSpec
from fxsplit.options import CompileOptions
from fxsplit.passes.measure import NodeTimes, grad_accumulate_bytes_per_s
from fxsplit.passes.profile import device_name, is_cached, profile_node_times
from fxsplit.runtime.dist_state import retarget_meta_devices
from fxsplit.runtime.distributed import from_rank0

__all__ = ["Profiled", "fits_device", "materialised", "mean_timings", "profile_together", "profiled_blocks", "shared_cpu"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Profiled:
    """What :func:`profile_together` leaves rank 0.

    Attributes:
        work: Rank 0's copy of the graph on its device (:func:`materialised`).
        timings: Node timings by ``"{size}|{graph digest}|{node}"``, ``(fwd_s, bwd_s)``: the
            mean over the ranks that timed (rank 0's profile cache when it keeps one, extended).
        ranks: How many ranks timed together (0: every timing came from the cache).
    """

    work: torch.fx.GraphModule
    timings: MutableMapping[str, NodeTimes]
    ranks: int


def shared_cpu(device: torch.device, gm: torch.fx.GraphModule, world: int, options: CompileOptions) -> bool:
    """Whether the ranks should profile together: CPU ranks (several processes share the
    cores), ``options.profile_all_ranks``, and ``world`` copies of the model fit this machine's
    free memory (:func:`fits_device`)."""
    return (options.profile_all_ranks and world > 1 and device.type == "cpu"
            and fits_device(gm, device, factor=4.0 * world))


def profile_together(gm: torch.fx.GraphModule | None, flat: Sequence[Any], batched: Sequence[bool],
                     device: torch.device, microbatches: int | str, options: CompileOptions, *,
                     wanted: bool) -> Profiled | None:
    """Time ``gm`` on every rank at once and give rank 0 the mean timings; collective.

    Rank 0 decides (``wanted``, broadcast) and materialises ``gm``; unless its profile cache
    already holds every timing (then nobody times), every other rank materialises ``gm`` on its
    ``device`` too, all wait for each other (a barrier), time every node at the micro-batch
    sizes the schedule search considers (:func:`~fxsplit.passes.profile.profile_node_times`)
    and send their timings to rank 0, which averages each node's over the ranks that timed it
    (:func:`mean_timings`; a rank that failed is left out and logged) and keeps the result in
    its profile cache (under its device name with ``-{world}proc``: timings taken beside
    ``world - 1`` other processes). Every rank makes the same collective calls in every case;
    rank 0's own failures here fall back to None (it then profiles alone in its planning step,
    where an error reaches every rank).

    Args:
        gm: This rank's meta capture (None where the capture failed: that rank only takes part
            in the collectives).
        flat, batched: The example batch's flat inputs and which of them carry the batch.
        device: This rank's device.
        microbatches: The micro-batch count that runs, or ``"auto"`` (the search's candidates).
        options: ``CompileOptions`` (profile cache folder; progress on rank 0).
        wanted: Rank 0's decision (:func:`shared_cpu` and a profiled cost model); read on rank 0.

    Returns:
        On rank 0, when the ranks profiled together (or its cache held it all), a
        :class:`Profiled`; None on the other ranks, when rank 0 did not want it, and when no
        rank could time the graph.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if not from_rank0(lambda: wanted):
        return None
    name = f"{device_name(DeviceSpec('rank0', torch_device=str(device)))}-{world}proc"
    none: tuple[Any, list[Any], dict[str, Any]] = (None, [], {"profile_cache": None, "profile_sizes": (), "progress": None})
    work, values, profile = _prepare(gm, flat, batched, device, microbatches, options, name) if rank == 0 else none
    cache = profile["profile_cache"]  # rank 0's only
    go = from_rank0(lambda: work is not None and not _cached(work, values, profile))
    if go and rank != 0:  # rank 0's cache lacks timings: every rank copies the graph (not before)
        work, values, profile = _prepare(gm, flat, batched, device, microbatches, options, name)
    timings: dict[str, NodeTimes] = {}
    if go:
        dist.barrier()  # start together: the load is each other
        if work is not None:
            try:
                profile_node_times(work, values, batched, profile["profile_sizes"], str(device), cache=timings,
                                   progress=profile["progress"])
            except Exception as exc:  # left out of the mean (rank 0 plans on the others' timings)
                log.warning("rank %d could not profile the graph (%s); rank 0 plans without its timings", rank, exc)
                timings = {}
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(timings, gathered, dst=0)
    if rank != 0 or work is None or gathered is None:
        return None
    timed = [g for g in gathered if g]
    if go and not timed:
        log.warning("no rank could profile the graph together; rank 0 profiles it alone")
        return None
    merged: MutableMapping[str, NodeTimes] = cache if cache is not None else {}
    merged.update(mean_timings(timed))
    if cache is not None and timed:
        try:
            cache.save()
        except OSError as exc:  # the timings are in hand; only the next compile pays again
            log.warning("could not save the profile cache %s (%s)", cache.path, exc)
    log.info("%d ranks profiled the graph together; rank 0 plans on their mean timings", len(timed))
    return Profiled(work, merged, len(timed))


def mean_timings(per_rank: Sequence[Mapping[str, NodeTimes]]) -> dict[str, NodeTimes]:
    """Each key's ``(fwd_s, bwd_s)`` averaged over the ranks that timed it.

    Example:
        >>> mean_timings([{"a": (1.0, 2.0), "b": (1.0, 1.0)}, {"a": (3.0, 4.0)}])
        {'a': (2.0, 3.0), 'b': (1.0, 1.0)}
    """
    keys = dict.fromkeys(k for timings in per_rank for k in timings)
    out = {}
    for key in keys:
        parts = [t[key] for t in per_rank if key in t]
        out[key] = (statistics.fmean(p[0] for p in parts), statistics.fmean(p[1] for p in parts))
    return out


def _cached(work: torch.fx.GraphModule, values: list[Any], profile: dict[str, Any]) -> bool:
    """Rank 0: whether its cache holds every timing (a failure to read it counts as no)."""
    try:
        return is_cached(work, values, profile["profile_sizes"], profile["profile_cache"])
    except Exception as exc:
        log.warning("could not read the profile cache (%s); the ranks profile again", exc)
        return False


def _prepare(gm: torch.fx.GraphModule | None, flat: Sequence[Any], batched: Sequence[bool], device: torch.device,
             microbatches: int | str, options: CompileOptions, name: str
             ) -> tuple[torch.fx.GraphModule | None, list[Any], dict[str, Any]]:
    """This rank's materialised graph, inputs on its device and profile options; no graph (and
    no sizes) when any of it fails here (out of memory, an op without a kernel, bad options:
    rank 0's own planning reports those), so the collectives that follow still meet."""
    if options.progress is not None and dist.get_rank() != 0:
        options = replace(options, progress=None)  # one progress bar: rank 0's
    try:
        if gm is None:
            raise ValueError("this rank has no capture")
        values = [x.to(device) if isinstance(x, torch.Tensor) else x for x in flat]
        return materialised(gm, device), values, profile_options(values, batched, name, microbatches, options, str(device))
    except Exception as exc:
        log.warning("rank %d does not profile the graph (%s)", dist.get_rank(), exc)
        return None, [], {"profile_cache": None, "profile_sizes": (), "progress": None}
def fits_device(gm: torch.fx.GraphModule, device: torch.device, factor: float = 4.0) -> bool:
    """Whether ``factor x`` the graph's parameters and buffers fit the free memory of ``device``
    (the whole model is materialised there to be profiled: weights, gradients, activations)."""
    state_bytes = sum(t.numel() * t.element_size() for t in [*gm.parameters(), *gm.buffers()])
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        try:
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return False
    return factor * state_bytes < free


def materialised(gm: torch.fx.GraphModule, device: torch.device) -> torch.fx.GraphModule:
    """A copy of ``gm`` with real tensors on ``device``, stand-in values that keep activations of
    a usual size (timing does not depend on the values, but uninitialised memory could hold NaNs
    that take slow paths; and the per-sample check compares rows to an absolute tolerance: with
    every weight N(0, 0.02), LayerNorm scales included, a model's activations shrank below it
    and attention over the batch went unseen): a matrix or kernel N(0, 1/fan_in), a 1-D
    ``weight`` or variance (a norm's scale, BatchNorm's ``running_var``) 1, other floats
    N(0, 0.02), the rest zero; plain tensor attributes (export's lifted constants) too, and every
    ``device=meta`` argument of the graph (``arange``, ``full``, ``to``; keyword or positional)
    made ``device``."""
    work = copy.deepcopy(gm).to_empty(device=device)
    made = []
    retarget_meta_devices(work, device)  # ops captured on meta (arange, full, to) carry device=meta
    for node in work.graph.nodes:
        if node.op == "get_attr":  # plain tensor attributes (export's lifted constants): not moved by to_empty
            owner_path, _, attr = str(node.target).rpartition(".")
            owner = work.get_submodule(owner_path)
            value = getattr(owner, attr, None)
            if isinstance(value, torch.Tensor) and value.is_meta:
                setattr(owner, attr, torch.empty_like(value, device=device))
                made.append(getattr(owner, attr))
    work.recompile()
    named = [*work.named_parameters(), *work.named_buffers(), *((f"constant{i}", t) for i, t in enumerate(made))]
    with torch.no_grad():
        for name, t in named:
            if not t.is_floating_point():
                t.zero_()
            elif t.dim() >= 2:
                t.normal_(0.0, (t.numel() // max(1, t.shape[0])) ** -0.5)
            elif t.dim() == 1 and name.endswith(("weight", "var")):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02)
    return work


def profiled_blocks(gm: torch.fx.GraphModule, graph: CondensedGraph, flat: list[Any], batched: tuple[bool, ...],
                    device: torch.device, microbatches: int | str, options: CompileOptions, *,
                    work: torch.fx.GraphModule | None = None, together: Profiled | None = None) -> CondensedGraph:
    """``graph`` (the analytic blocks every rank also made) with block times profiled on
    ``device`` at the micro-batch size: the graph is materialised there with stand-in values,
    every node timed in context (:func:`fxsplit.passes.profile.profile_node_times`, cached as
    ``fxsplit.compile`` caches), and each block's times summed over its nodes. The blocks stay the
    ones every rank has, so the plan fits every rank's capture. ``work``: that materialised copy,
    when the caller has made it; ``together``: the ranks' mean timings (:func:`profile_together`),
    used instead of timing here. Timings taken alone are cached unless the machine was busy
    (load over 1 per core), as ``fxsplit.compile`` does.
    """
    work = together.work if together is not None else work if work is not None else materialised(gm, device)
    inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in flat]
    profile = profile_options(inputs, batched, device_name(DeviceSpec("rank0", torch_device=str(device))),
                              microbatches, options, str(device))
    cache = together.timings if together is not None else profile["profile_cache"]
    load = load_per_core()  # before timing: what else runs here (as fxsplit.compile judges it)
    profile_node_times(work, inputs, batched, profile["profile_sizes"], str(device), cache=cache)
    if together is None and profile["profile_cache"] is not None:
        save_unless_busy(profile["profile_cache"], load, "rank 0's profile")
    costs = {n.name: n.meta["fxsplit.cost"] for n in work.graph.nodes if n.op != "output"}
    blocks = []
    for b in graph.blocks:
        parts = [costs[n] for n in b.nodes if n in costs]
        blocks.append(replace(b, fwd_s=sum(c.fwd_s for c in parts), bwd_s=sum(c.bwd_s for c in parts),
                              fwd_fixed_s=sum(c.fwd_fixed_s for c in parts),
                              bwd_fixed_s=sum(c.bwd_fixed_s for c in parts),
                              bwd_weight_s=sum(c.bwd_weight_s for c in parts)))
    # adding the gradients, at the rate measured here too
    return CondensedGraph(tuple(blocks), graph.edges, graph.name).with_grad_accumulation(
        grad_accumulate_bytes_per_s(str(device)))
