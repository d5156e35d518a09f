"""Planning a distributed pipeline once, on rank 0, for the devices the ranks run on.

Every rank captures the model (on the meta device) because it needs the graph to cut its own
stage out of, but only rank 0 plans:

1. rank 0 takes the reference spec of the device it runs on (a CPU measured now with
   :func:`~fxsplit.passes.costs.measure_cpu_spec`, or the preset of the detected GPU, as
   :func:`fxsplit.compile` does) and broadcasts it, so that every rank annotates and condenses
   its graph with the same numbers and gets the same blocks;
2. every rank captures, annotates and condenses; with ``CompileOptions(profile_all_ranks=True)``
   on CPU ranks every rank then times the graph at the same moment as rank 0, which plans on the
   mean (:func:`~fxsplit.dist_profile.profile_together`);
3. rank 0 solves the split (or takes the user's plan) and broadcasts the ``Plan`` JSON with the
   digest of its graph, the cost model it used and what its per-sample check found
   (``torch.distributed.broadcast_object_list``; :class:`DistPlan` holds them on every rank);
4. every rank checks the plan against its own capture (same graph digest, every block in exactly
   one stage, contiguous stages, same schedule and micro-batch count) and all verdicts are
   gathered, so that a mismatch, or a capture or planning failure on any rank, raises on every
   rank instead of leaving the others waiting.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from fxsplit.compiler import plan_pipeline
from fxsplit.dist_profile import (
    Profiled,
    fits_device,
    materialised,
    profile_together,
    profiled_blocks,
    shared_cpu,
)
from fxsplit.errors import ConfigError, InternalError, PlanError
from fxsplit.frontend import Inspection, front_end, loss_cost_s
from fxsplit.ir import CondensedGraph, DeviceSpec, LinkSpec, Plan, Problem
from fxsplit.options import CompileOptions
from fxsplit.runtime.distributed import from_rank0
from fxsplit.runtime.links import probe_pipeline_links
from fxsplit.runtime.microbatch import batch_size_of
from fxsplit.runtime.overhead import RuntimeOverhead, with_overhead

__all__ = ["DistPlan", "example_batch", "rank0_cost_model", "graph_digest", "plan_on_rank0", "per_sample_on_rank0", "reference_spec", "check_plan",
           "profiled_blocks", "fits_device"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class DistPlan:
    """What every rank holds after :func:`plan_on_rank0`.

    Attributes:
        captured: This rank's capture (``fxsplit.passes.capture.Captured``), nodes annotated
            with their blocks.
        plan: Rank 0's plan, checked against this rank's capture.
        reference: The device spec the plan was costed on (rank 0's device).
        problem: On rank 0, the planning problem with whole-batch costs (the cost model's
            blocks on ``world`` copies of ``reference``, over the measured links; analytic costs
            when the user gave the plan), kept so the pipeline can be planned again
            (``calibrate``); None on the other ranks.
        cost_model: The cost model rank 0 solved with, ``"profiled"`` or ``"analytic"``
            (:func:`plan_on_rank0`'s ``cost_model`` as resolved); None when the user gave the plan.
        profiled_ranks: How many ranks timed the graph together for the profiled cost model
            (:func:`~fxsplit.dist_profile.profile_together`; 1: rank 0 alone; ``"cached"``:
            rank 0's cache of such timings held them all); None for analytic costs.
        not_per_sample: Rank 0's per-sample check (:func:`per_sample_on_rank0`): what mixes
            samples or updates a buffer in forward (empty when nothing does); None when it did not
            run (one micro-batch, the user's plan, meta or fake inputs, a model larger than rank
            0's device).
        loss_planned: Whether the plan's costs hold the loss (``options.loss_fn``, timed on rank
            0 with the profiled cost model and a real example batch), so
            ``predicted_step_s`` need not add the measured one.
    """

    captured: Any
    plan: Plan
    reference: DeviceSpec
    problem: Problem | None = None
    cost_model: str | None = None
    not_per_sample: tuple[str, ...] | None = None
    profiled_ranks: int | str | None = None
    loss_planned: bool = False


def reference_spec(device: torch.device) -> DeviceSpec:
    """The spec of ``device`` that plans are costed on: the preset of the detected GPU, or
    this CPU measured now (matmul FLOP/s, copy bandwidth, per-operator overhead)."""
    if device.type == "cuda":
        from fxsplit.passes.costs import cuda_spec

        return cuda_spec(device)
    from fxsplit.passes.costs import measure_cpu_spec

    return measure_cpu_spec("cpu")


def graph_digest(gm: torch.fx.GraphModule, *, blocks: bool = True) -> str:
    """SHA-256 of a captured, condensed graph: every node's name, op, target, shape and (with
    ``blocks``) block; without blocks the digest does not depend on the costs condensation saw."""
    rows = [
        (
            n.name,
            n.op,
            str(n.target),
            str(getattr(n.meta.get("val"), "shape", "")),
            n.meta.get("fxsplit.block") if blocks else None,
        )
        for n in gm.graph.nodes
    ]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def check_plan(plan: Plan, condensed: Any) -> list[str]:
    """Faults of ``plan`` on this rank's condensed graph: blocks in no stage, in two stages, or
    unknown; stages that are not contiguous (a prefix that is not a downset)."""
    graph, faults = condensed.graph, []
    seen: dict[int, int] = {}
    for s, st in enumerate(plan.stages):
        for b in st.blocks:
            if b in seen:
                faults.append(f"block {b} is in stages {seen[b]} and {s}")
            seen[b] = s
    if set(seen) != set(range(len(graph))):
        faults.append(
            f"the plan places blocks 0..{max(seen, default=-1)}, this capture has {len(graph)} blocks"
        )
        return faults
    prefix: set[int] = set()
    for s, st in enumerate(plan.stages):
        prefix |= set(st.blocks)
        if not graph.is_downset(prefix):
            faults.append(f"stages 0..{s} are not contiguous (not a downset of the graph)")
    return faults


def _try(call: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    try:
        return call(), None
    except Exception as exc:  # noqa: BLE001 - re-raised after the ranks have compared notes
        return None, exc


def _verdict(
    payload: dict[str, Any], own: dict[str, Any], plan: Plan | None, condensed: Any
) -> str:
    """Why this rank cannot run rank 0's plan ("" when it can)."""
    if own["error"]:
        return own["error"]
    if payload["error"]:
        return f"rank 0 could not plan: {payload['error']}"
    for key in ("schedule", "microbatches"):
        if payload[key] != own[key]:
            return f"{key}={own[key]!r} where rank 0 has {payload[key]!r}"
    if payload["digest"] != own["digest"]:
        return f"its captured graph differs from rank 0's (digest {own['digest'][:12]} vs {payload['digest'][:12]})"
    faults = check_plan(plan, condensed) if plan is not None else ["no plan"]
    return "; ".join(faults)


def _raise_if_any(verdicts: list[str], failure: BaseException | None) -> None:
    """Raise this rank's own failure, else a PlanError naming every rank that objected."""
    if failure is not None:
        raise failure
    bad = {r: v for r, v in enumerate(verdicts) if v}
    if bad:
        detail = "; ".join(f"rank {r}: {v}" for r, v in bad.items())
        raise PlanError(
            f"the ranks cannot run one pipeline ({detail}); every rank must call compile with the same "
            "model_fn, example inputs, schedule, micro-batches and plan: check for rank-dependent model "
            "code or differing package versions"
        )


def _error(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}" if exc is not None else ""


def _problem(graph: CondensedGraph, reference: DeviceSpec, links: tuple[tuple[int, int, LinkSpec], ...],
             world: int, options: CompileOptions, overhead: RuntimeOverhead | None = None) -> Problem:
    """Rank 0's planning problem: ``world`` stages on copies of ``reference``, over the measured
    links (those between ranks ``i`` and ``i + 1`` below ``world``: with replicated stages, a
    pipeline's neighbours are further apart, and the hop of the first pair stands for theirs),
    charging the runtime's own work per action and per message (``overhead``) when measured."""
    specs = tuple(reference.with_(name=f"rank{i}") for i in range(world))
    link = options.link
    default = link if isinstance(link, LinkSpec) else LinkSpec()
    links = tuple(e for e in links if e[0] < world and e[1] < world)
    problem = Problem(graph, specs, default, links=links, allow_idle_devices=False, recompute=options.recompute)
    return (with_overhead(problem, overhead) if overhead is not None else problem).check()


def example_batch(captured: Any, inputs: tuple[tuple, dict]) -> tuple[list[Any], tuple[bool, ...], int]:
    """Flat inputs, which of them carry the batch, and the batch size."""
    flat = captured.flatten_inputs(*inputs)
    flags = tuple(captured.batched_inputs or [True] * len(flat))
    return flat, flags, batch_size_of([x for x, b in zip(flat, flags, strict=True) if b] or flat)


def _real(flat: Sequence[Any]) -> bool:
    return all(not t.is_meta for t in pytree.tree_leaves(list(flat)) if isinstance(t, torch.Tensor))


def rank0_cost_model(captured: Any, flat: Sequence[Any], device: torch.device, cost_model: str) -> str:
    """``"profiled"`` for ``cost_model`` ``"profiled"`` (or ``"auto"`` when the model fits this
    device) and real inputs; else ``"analytic"``."""
    if cost_model == "analytic" or not _real(flat) or (cost_model == "auto" and not fits_device(captured.gm, device)):
        return "analytic"
    return "profiled"


def _plan(front: Inspection, inputs: tuple[tuple, dict], device: torch.device, cost_model: str,
          links: tuple[tuple[int, int, LinkSpec], ...], reference: DeviceSpec, world: int, schedule: str,
          microbatches: int | str, solver: str, options: CompileOptions,
          together: Profiled | None = None, overhead: RuntimeOverhead | None = None, replicas: int = 1
          ) -> tuple[Plan, Problem, dict[str, Any]]:
    """Rank 0: the per-sample check (with several micro-batches, or replicas: they split the
    batch too) and the graph with the chosen
    cost model, solved, on one materialised copy of the graph (``together``'s when every rank
    profiled, :func:`~fxsplit.dist_profile.profile_together`). Returns the plan, the problem
    (whole-batch costs) it was solved on, and the notes for every rank: ``cost_model`` used,
    ``profiled_ranks`` (how many ranks timed together; 1: rank 0 alone) and ``not_per_sample``
    (the check's findings, None when it did not run)."""
    captured, condensed = front.captured, front.condensed
    flat, flags, batch = example_batch(captured, inputs)
    used = rank0_cost_model(captured, flat, device, cost_model)
    split = microbatches != 1 or replicas > 1
    checked = split and _real(flat) and fits_device(captured.gm, device)
    work = together.work if together is not None else (
        materialised(captured.gm, device) if used == "profiled" or checked else None)
    mixing = per_sample_on_rank0(captured, inputs, device, work=work) if split else None
    graph = condensed.graph if used == "analytic" else profiled_blocks(
        captured.gm, condensed.graph, flat, flags, device, microbatches, options, work=work, together=together)
    loss_planned = options.loss_fn is not None and used == "profiled" and work is not None and _real(flat)
    if loss_planned:  # the loss on the last rank, timed on the stand-in model's outputs here
        on_device = pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x,
                                    (flat, options.loss_target))
        graph = graph.with_loss(*loss_cost_s(captured, on_device[0], replace(options, loss_target=on_device[1]),
                                             microbatches, gm=work))
    elif options.loss_fn is not None:
        log.info("rank 0 plans without the loss (%s cost model%s); predicted_step_s adds it as measured",
                 used, "" if _real(flat) else ", no real example batch")
    problem = _problem(graph, reference, links, world, options, overhead)
    choice = plan_pipeline(problem, batch, microbatches, schedule, solver, options)
    plan = choice.plan.with_(microbatches=choice.microbatches, schedule=choice.schedule)
    log.info("rank 0 planned with the %s cost model: %s", used, choice.reason)
    ranks = (together.ranks or "cached") if together is not None and used == "profiled" else 1 if used == "profiled" else None
    return plan, problem, {"cost_model": used, "not_per_sample": mixing, "profiled_ranks": ranks,
                           "loss_planned": loss_planned}


def per_sample_on_rank0(captured: Any, inputs: tuple[tuple, dict], device: torch.device, *,
                        work: torch.fx.GraphModule | None = None) -> list[str] | None:
    """Rank 0's per-sample check (:func:`~fxsplit.passes.per_sample.find_batch_mixing`) on the
    meta capture materialised on ``device`` with stand-in weights and the real example batch;
    None when it cannot run (meta or fake inputs, a model larger than the device).

    Stand-in weights (:func:`~fxsplit.dist_profile.materialised`: of a usual scale, norms' scales
    1) show an op that mixes samples as the real ones do (with every weight N(0, 0.02) the
    activations of a transformer shrank below the check's tolerance and attention over the batch
    went unseen). ``work``:
    that copy, when the caller has made it (:func:`~fxsplit.dist_profile.materialised`); its buffers are restored.
    """
    from fxsplit.passes.per_sample import find_batch_mixing

    flat, flags, _ = example_batch(captured, inputs)
    if not _real(flat) or not fits_device(captured.gm, device):
        return None
    work = work if work is not None else materialised(captured.gm, device)
    values = [x.to(device) if isinstance(x, torch.Tensor) else x for x in flat]
    found = [str(b) for b in find_batch_mixing(work, values, flags)]
    if found:
        log.warning("the model is not per-sample: %s", "; ".join(found))
    return found


def plan_on_rank0(
    meta_model: nn.Module,
    inputs: tuple[tuple, dict],
    *,
    rank: int,
    world: int,
    device: torch.device,
    schedule: str,
    microbatches: int | str,
    solver: str,
    plan: Plan | None,
    options: CompileOptions,
    cost_model: str = "auto",
    devices: int | None = None,
    overhead: RuntimeOverhead | None = None,
    replicas: int = 1,
) -> DistPlan:
    """Capture on every rank, plan on rank 0, check the plan on every rank; collective.

    Args:
        meta_model: The model on the meta device.
        inputs: ``(args, kwargs)`` of the example batch (any device; only shapes are read).
        rank, world: This rank and the number of ranks.
        device: This rank's device (rank 0's is the reference the plan is costed on).
        schedule, microbatches: How the pipeline runs (must agree across ranks; ``"auto"``: rank
            0 chooses, and the plan says what it chose).
        solver: The solver rank 0 runs.
        plan: A plan to use instead of solving (rank 0's copy is the one used).
        options: ``CompileOptions``.
        cost_model: ``"analytic"`` (the roofline of rank 0's device), ``"profiled"`` (rank 0
            materialises the graph on its device and times every node at the micro-batch size,
            :func:`profiled_blocks`), or ``"auto"``: profiled when the inputs are real and the
            model fits rank 0's device (:func:`fits_device`). Links between neighbouring ranks
            are measured (:func:`~fxsplit.runtime.links.probe_pipeline_links`) unless
            ``options.link`` is a ``LinkSpec``.
        devices: The pipeline's ranks (stages), default ``world`` (fewer: replicated stages).
        overhead: The runtime's own work per action and per message the plan charges
            (:func:`fxsplit.distributed.probe_distributed_overhead`); None: not modelled.
        replicas: Copies of the pipeline, each given a share of the batch (``inputs`` is one
            share): the per-sample check runs with one micro-batch too when there are several.

    Returns:
        The :class:`DistPlan` of this rank.

    Raises:
        PlanError: on every rank when a rank captured a different graph, the plan does not fit
            the capture, the ranks disagree on schedule or micro-batches, or another rank failed.
        CaptureError, InfeasibleError: on the rank where capture or planning failed.
    """
    reference = from_rank0(lambda: reference_spec(device))
    meta_inputs = pytree.tree_map(
        lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, inputs
    )
    args, kwargs = meta_inputs
    # only a planning rank 0 reads the micro-batch cost formulas (a second or so on big graphs)
    annotate = replace(options, symbolic_costs=options.symbolic_costs and rank == 0 and plan is None)
    front, failure = _try(
        lambda: front_end(meta_model, args, kwargs, reference=reference, cost_model="analytic", options=annotate)
    )
    own = {
        "schedule": schedule,
        "microbatches": microbatches,
        "error": _error(failure),
        "digest": graph_digest(front.captured.gm) if front is not None else "",
    }
    links = _links(options, device, world)
    together = _profile_together(front, inputs, device, cost_model, microbatches, options,
                                 wanted=rank == 0 and plan is None and failure is None)
    problem: Problem | None = None
    found: dict[str, Any] = {"cost_model": None, "not_per_sample": None, "profiled_ranks": None, "loss_planned": False}
    if rank == 0 and front is not None and plan is None:
        solved, failure = _try(
            lambda: _plan(front, inputs, device, cost_model, links, reference, devices or world, schedule,
                          microbatches, solver, options, together, overhead, replicas)
        )
        plan, problem, found = solved if solved is not None else (None, None, found)
    elif rank == 0 and front is not None:  # the user's plan; the analytic problem, for calibrate only
        problem, unused = _try(lambda: _problem(front.condensed.graph, reference, links, devices or world, options,
                                                overhead))
        if unused is not None:
            log.info("no planning problem for calibrate: %s", _error(unused))
    notes: dict[str, Any] = {
        **own,
        "error": _error(failure),
        "plan": plan.to_dict() if plan is not None else None,
        **found,
    }
    payload = from_rank0(lambda: notes)
    chosen = Plan.from_dict(payload["plan"]) if payload["plan"] is not None else None
    verdicts: list[Any] = [None] * world
    dist.all_gather_object(
        verdicts, _verdict(payload, own, chosen, front.condensed if front is not None else None)
    )
    _raise_if_any(verdicts, failure)
    if chosen is None or front is None:
        raise InternalError("every rank accepted a plan that is missing (a bug in fxsplit)")
    log.info(
        "rank %d: rank 0's plan (%d stages, costed on %s) fits this capture",
        rank,
        chosen.num_stages,
        reference.name,
    )
    mixing = payload["not_per_sample"]
    return DistPlan(front.captured, chosen, reference, problem, cost_model=payload["cost_model"],
                    profiled_ranks=payload["profiled_ranks"], loss_planned=payload["loss_planned"],
                    not_per_sample=tuple(mixing) if mixing is not None else None)


def _profile_together(front: Inspection | None, inputs: tuple[tuple, dict], device: torch.device, cost_model: str,
                      microbatches: int | str, options: CompileOptions, *, wanted: bool) -> Profiled | None:
    """Every rank's part in :func:`~fxsplit.dist_profile.profile_together` (collective with
    ``options.profile_all_ranks``, which every rank is given alike): rank 0 wants it when it will
    plan on profiled costs and the ranks share a CPU (:func:`~fxsplit.dist_profile.shared_cpu`)."""
    if not options.profile_all_ranks:  # the same options on every rank: no rank enters the collective
        return None
    if front is None:  # this rank's capture failed: it only takes part in the collectives
        return profile_together(None, [], (), device, microbatches, options, wanted=False)
    flat, flags = example_batch(front.captured, inputs)[:2]
    if wanted:
        try:
            wanted = (rank0_cost_model(front.captured, flat, device, cost_model) == "profiled"
                      and shared_cpu(device, front.captured.gm, dist.get_world_size(), options))
        except Exception as exc:  # rank 0's planning step meets it again and reports it on every rank
            log.warning("the ranks do not profile together: %s", exc)
            wanted = False
    return profile_together(front.captured.gm, flat, flags, device, microbatches, options, wanted=wanted)


def _links(options: CompileOptions, device: torch.device, world: int) -> tuple[tuple[int, int, LinkSpec], ...]:
    """The links between neighbouring ranks: measured (collective, every rank takes part) unless
    ``options.link`` is a ``LinkSpec``, which then holds for every pair."""
    link = options.link
    if isinstance(link, LinkSpec) or world == 1:
        return ()
    if link not in ("auto", "probe"):
        raise ConfigError(f"CompileOptions.link={link!r}; give a LinkSpec, 'probe' or 'auto'")
    return probe_pipeline_links(str(device))
