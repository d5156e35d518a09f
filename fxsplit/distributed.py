"""Pipelines across processes and machines: ``fxsplit.distributed.compile`` on every rank.

Launch one process per device with ``torchrun`` (gloo on CPU, NCCL on GPUs)::

    torchrun --nproc_per_node=4 train.py          # train.py calls fxsplit.distributed.compile

Every rank builds the model on the meta device and captures it; rank 0 alone plans, costed on
the device it runs on, and broadcasts the plan, which every rank checks against its own capture
(:mod:`fxsplit.dist_plan`). Each rank then materialises only its own stages: global rank ``r`` of
``R`` runs stage ``r`` (and ``r + R, r + 2R, ...`` under interleaved 1F1B). See
:mod:`fxsplit.runtime.distributed` for the runtime.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import os
import statistics
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from fxsplit.calibrate import Measurement, fit_link_latency, refit_problem, stage_rows
from fxsplit.checkpoint import load_shard, read_index
from fxsplit.codegen import split_graph
from fxsplit.compiler import action_overhead_option
from fxsplit.dist_build import (
    batched_flags,
    broadcast_tied,
    build_pipeline,
    rank_chunks,
    rank_stages,
    replica_groups,
    tied_groups,
    tied_holders,
    to_meta,
)
from fxsplit.dist_calibrate import CompiledDistributedPipeline, DistContext
from fxsplit.dist_plan import (
    example_batch,
    graph_digest,
    plan_on_rank0,
    rank0_cost_model,
    reference_spec,
)
from fxsplit.dist_profile import profiled_blocks
from fxsplit.errors import ConfigError, FxsplitError, NotPerSampleWarning, PlanError
from fxsplit.frontend import front_end, with_batch_dim
from fxsplit.ir import DeviceSpec, LinkSpec, Plan
from fxsplit.ir.problem import LOOPED_SCHEDULES
from fxsplit.options import CompileOptions, autocast_dtype, with_loss_options
from fxsplit.runtime.dist_state import StageState, get_tensor, materialise
from fxsplit.runtime.distributed import DistributedPipeline, from_rank0
from fxsplit.runtime.links import probe_collective_link
from fxsplit.runtime.overhead import (
    BUSY_LAYERS,
    BUSY_ROWS,
    BUSY_WIDTH,
    PROBE_MICROBATCHES,
    BusyBlock,
    RuntimeOverhead,
    bare_module_s,
    busy_overhead,
    untouched_rng,
)
from fxsplit.runtime.tensor_parallel import ParallelGraph, ParallelPlan
from fxsplit.schedule import available

__all__ = ["compile", "load", "parallelize", "probe_distributed_overhead", "CompiledDistributedPipeline", "DistributedPipeline", "ParallelGraph",
           "init_process_group", "batched_flags", "STRATEGIES"]

log = logging.getLogger(__name__)

T = TypeVar("T")

def init_process_group(backend: str | None, timeout_s: float) -> tuple[int, int, torch.device]:
    """Join the default process group (from torchrun's environment) unless already joined.

    Args:
        backend: ``"gloo"``, ``"nccl"`` or None (NCCL when CUDA is available, else gloo).
        timeout_s: Seconds any collective or point-to-point call waits before failing.

    Returns:
        ``(rank, world_size, device)``: ``cpu`` for gloo, ``cuda:LOCAL_RANK`` for NCCL.

    Raises:
        ConfigError: when the process was not launched by torchrun (or with ``RANK``,
            ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set).
    """
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ConfigError(
                f"environment variables {missing} are not set: launch with torchrun, e.g. "
                "`torchrun --nproc_per_node=2 train.py`, or call torch.distributed.init_process_group first"
            )
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def _check_args(schedule: str, microbatches: int | str, world: int, num_stages: int | None) -> None:
    if schedule not in available() and schedule != "auto":  # looked up now: schedules registered since count
        raise ConfigError(f"schedule={schedule!r} is unknown; choose 'auto' or one of {sorted(available())}")
    if microbatches != "auto" and (not isinstance(microbatches, int) or microbatches < 1):
        raise ConfigError(f"microbatches={microbatches!r}; pass a positive int or 'auto'")
    if schedule == "auto" or microbatches == "auto":
        return  # checked again once rank 0 has chosen
    looped = schedule in LOOPED_SCHEDULES
    if num_stages is not None and not looped and num_stages != world:
        raise ConfigError(
            f"the plan has {num_stages} stages but {world} processes were launched; under {schedule} rank i runs "
            f"stage i, so launch with --nproc_per_node={num_stages} (times --nnodes) or plan for {world} stages"
        )
    if num_stages is not None and looped and (num_stages % world or num_stages < 2 * world):
        raise ConfigError(
            f"the plan has {num_stages} stages for {world} processes; {schedule} runs several stages per rank "
            f"(stage s on rank s mod {world}), so the stage count must be a multiple of {world}, at least "
            f"{2 * world}: plan with stages_per_device >= 2, or use schedule='1f1b'"
        )
    if schedule == "1f1b" and isinstance(microbatches, int) and microbatches < world:
        raise ConfigError(
            f"1f1b needs at least as many micro-batches as stages: microbatches={microbatches}, "
            f"{world} stages; use microbatches >= {world} or schedule='gpipe'"
        )


def _chosen(schedule: str, microbatches: int | str, plan: Plan) -> tuple[str, int]:
    """The schedule and micro-batch count that run: the ones asked for, or the plan's where
    ``"auto"`` was asked."""
    return (plan.schedule if schedule == "auto" else schedule,
            plan.microbatches if microbatches == "auto" else int(microbatches))


def _warn_if_not_per_sample(gm: torch.fx.GraphModule, m: int, rank: int, checked: Sequence[str] | None,
                            replicas: int = 1) -> None:
    """Warn on rank 0, when ``m > 1`` or ``replicas > 1`` (each splits the batch), about what
    that changes: ``checked`` is rank 0's full check (:func:`fxsplit.dist_plan.per_sample_on_rank0`,
    ops that mix samples and buffers updated in forward) when it could run; else what the meta
    capture shows (buffers only)."""
    from fxsplit.passes.per_sample import mutated_buffers

    if (m <= 1 and replicas <= 1) or rank != 0:
        return
    found = list(checked) if checked is not None else [str(b) for b in mutated_buffers(gm)]
    if found:
        unchecked = "" if checked is not None else (
            " (ops that mix samples were not checked: the example inputs are not real or the model does not fit "
            "rank 0's device)")
        warnings.warn(
            f"the model is not per-sample, and with microbatches={m}{f' x replicas={replicas}' if replicas > 1 else ''} "
            f"the pipeline computes something else than the model: {'; '.join(found)}. Use microbatches=1"
            f"{' and replicas=1' if replicas > 1 else ''}, or make those ops per-sample and keep state out "
            f"of forward{unchecked}", NotPerSampleWarning, stacklevel=3)


def _check_replicas(replicas: int, world: int, schedule: str, tp: int = 1, tp_strategy: str = "auto") -> None:
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1 or world % replicas:
        raise ConfigError(f"replicas={replicas!r} for {world} ranks; give a divisor of {world} (each of the "
                          f"replicas runs a pipeline of world / replicas ranks)")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or world % (replicas * tp):
        raise ConfigError(f"tensor_parallel={tp!r} with replicas={replicas} for {world} ranks; give a degree whose "
                          f"product with replicas divides {world} (each pipeline runs on world / (replicas x tp) ranks)")
    if tp_strategy not in TP_STRATEGIES:
        raise ConfigError(f"tp_strategy={tp_strategy!r}; choose one of {TP_STRATEGIES}")


def _replica_example(args: tuple, kwargs: dict, replicas: int, what: str = "replicas") -> tuple[tuple, dict]:
    """One replica's share of the example batch: every tensor whose dim 0 is the first tensor's
    batch, cut to ``1 / replicas`` (what one replica's pipeline runs and is planned for)."""
    if replicas == 1:
        return args, kwargs
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = [x for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors:
        raise ConfigError(f"{what} > 1 needs example inputs with a batch dimension (a tensor input)")
    batch = tensors[0].shape[0]
    if batch % replicas:
        raise ConfigError(f"the example batch of {batch} samples does not split over {what}={replicas}; "
                          f"give a multiple of {replicas} samples (each share is what is planned for)")
    share = [x[: batch // replicas] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch else x
             for x in flat]
    out_args, out_kwargs = pytree.tree_unflatten(share, spec)
    return tuple(out_args), dict(out_kwargs)


def same_as_first_replica(stages: Sequence[Any], replicas: Any,
                          local: Mapping[int, Mapping[str, Any]] | None = None) -> None:
    """Give every copy of a stage (its replicas and tensor-parallel ranks) the first copy's
    values (each initialised its own); collective over the stage's copies. ``local``: stage
    index -> the tensors each copy holds as its own chunk (read from the state dict, or cut
    from the same initialisation: :func:`_same_draws`; of other shapes on other
    tensor-parallel ranks): left out."""
    with torch.no_grad():
        for stage in stages:
            skip = (local or {}).get(stage.index, {})
            for name, t in [*stage.gm.named_parameters(), *stage.gm.named_buffers()]:
                if name not in skip:
                    dist.broadcast(t.data, src=replicas.first_copy, group=replicas.copies_group)


@contextlib.contextmanager
def _same_draws(replicas: Any, device: torch.device) -> Iterator[None]:
    """Inside the block, every copy of this rank's stage (``replicas.copies_group``) draws the
    same random numbers: the first copy's seed, broadcast (collective over the copies; nothing
    when ``replicas`` is None). The generators are put back after."""
    if replicas is None:
        yield
        return
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    dist.broadcast(seed, src=replicas.first_copy, group=replicas.copies_group)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(int(seed))
        yield


def _choose_mesh(model_fn: Callable[[], nn.Module], args: tuple, kwargs: dict, world: int,
                 microbatches: int | str | None, schedule: str, rank: int, device: torch.device,
                 options: CompileOptions, cost_model: str = "auto") -> Any:
    """Rank 0's :class:`~fxsplit.solvers.hybrid.HybridPlan` for ``world`` devices like its own, on
    every rank (collective: the link is measured over every rank first).

    The model is captured on the meta device at one micro-batch (the example batch cut to
    ``1 / microbatches``), its per-layer plans solved for every ``tp`` dividing ``world``
    (PaSE's and Megatron's families) and every ``[pp, dp, tp]`` mesh of all ``world`` ranks costed.
    The blocks' times are profiled on rank 0's device at that micro-batch (``cost_model``
    ``"auto"`` when the example is real and the model fits, or ``"profiled"``; the per-layer
    plans' factors scale them) or analytic; ``HybridPlan.costs`` says which.

    Raises:
        ConfigError: on every rank, for a micro-batch count that is not a positive integer or
            does not split the example batch, a looped schedule; InfeasibleError when no mesh fits.
    """
    from fxsplit.ir import Problem
    from fxsplit.passes.layer_costs import per_layer_costs
    from fxsplit.solvers.hybrid import plan_hybrid

    m = world if microbatches is None else microbatches
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ConfigError(f"parallel='hybrid' needs microbatches=an integer >= 1 (micro-batches of the whole batch), "
                          f"got {microbatches!r}")
    if schedule not in ("gpipe", "1f1b"):
        raise ConfigError(f"parallel='hybrid' runs gpipe or 1f1b, not schedule={schedule!r}")
    one_args, one_kwargs = _replica_example(args, kwargs, m, "microbatches")  # one micro-batch
    link = options.link if isinstance(options.link, LinkSpec) else probe_collective_link(device=str(device))

    def search() -> Any:
        with torch.device("meta"):
            model = model_fn()
        reference = reference_spec(device)
        front = front_end(model, to_meta(one_args), to_meta(one_kwargs), reference=reference, cost_model="analytic",
                          options=CompileOptions(), name=type(model).__name__)
        degrees = [t for t in range(2, world + 1) if world % t == 0]
        costs = per_layer_costs(front.captured.gm, front.condensed.graph, degrees, link=link,
                                time_limit_s=options.time_limit_s or 30.0, memory_limit_bytes=reference.memory_bytes)
        flat, flags, _ = example_batch(front.captured, (one_args, one_kwargs))
        used = rank0_cost_model(front.captured, flat, device, cost_model)
        graph = front.condensed.graph if used == "analytic" else profiled_blocks(
            front.captured.gm, front.condensed.graph, flat, flags, device, 1, options)
        specs = tuple(reference.with_(name=f"{reference.name}:{i}") for i in range(world))
        problem = Problem(graph, specs, link=link, microbatches=m, schedule=schedule,  # type: ignore[arg-type]
                          objective="makespan", allow_idle_devices=False)
        found = plan_hybrid(problem, costs, time_limit_s=options.time_limit_s or 30.0, every_device=True)
        log.info("hybrid mesh over %d ranks (%s costs): %s, predicted %.3g s per step", world, used,
                 found.best.label, found.best.step_s)
        return dataclasses.replace(found, costs=used)

    return _on_rank0(rank, search)


def _on_rank0(rank: int, call: Callable[[], T]) -> T:
    """``call()`` run on rank 0 and its result broadcast to every rank; collective. An
    :class:`FxsplitError` rank 0 raised is raised on every rank."""
    chosen: list[Any] = [_try(call) if rank == 0 else None]
    dist.broadcast_object_list(chosen, src=0)
    result, failure = chosen[0]
    if failure is not None:
        raise failure
    return result  # type: ignore[no-any-return]


TP_STRATEGIES = ("auto", "megatron", "data-parallel")
"""Per-layer plans a tensor-parallel stage can run (:func:`compile`'s ``tp_strategy``)."""


def _split_layout(gm: torch.fx.GraphModule, tp: int, strategy: str, link: LinkSpec | None, time_limit_s: float,
                  rank: int, device: torch.device) -> tuple[dict[str, Any], list[str], ParallelPlan]:
    """Rank 0's per-layer plan of the whole captured graph over ``tp`` ranks, on every rank:
    ``(layout, fallback, plan)``; collective (the link is measured when not given)."""
    from fxsplit.passes.parallel_strategies import strategy_graph

    mesh_link = link or probe_collective_link(device=str(device))

    def choose() -> tuple[dict[str, Any], list[str], ParallelPlan]:
        found = strategy_graph(gm, tp, link=mesh_link)
        plan = _choose_strategies(found, gm, strategy, time_limit_s)
        return found.layout(plan.choice), list(found.fallback), plan

    return _on_rank0(rank, choose)


def _barrier(timeout_s: float) -> None:
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    else:
        dist.barrier()


def compile(  # noqa: A001 - mirrors fxsplit.compile
    model_fn: Callable[[], nn.Module],
    example_inputs: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    schedule: str = "1f1b",
    microbatches: int | str | None = None,
    backend: str | None = None,
    state_dict: Mapping[str, torch.Tensor] | str | None = None,
    init_fn: Callable[[str, torch.Tensor], None] | None = None,
    plan: Plan | None = None,
    solver: str = "dp",
    timeout_s: float = 60.0,
    watchdog: bool = True,
    options: CompileOptions | None = None,
    cost_model: str = "auto",
    batch_dim: int | None = None,
    replicas: int = 1,
    tensor_parallel: int = 1,
    tp_strategy: str = "auto",
    parallel: str = "pipeline",
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
) -> CompiledDistributedPipeline:
    """Build this rank's stage of a pipeline over all ranks; call on every rank.

    Args:
        model_fn: Builds the model; called under ``torch.device("meta")`` (no weights allocated),
            and once more, parameters on meta, for buffers (and rare parameters) that neither a
            state dict nor the model's initialisation fills.
        example_inputs: A representative batch, batch on dim 0 (fixes the micro-batch size).
        example_kwargs: Keyword inputs.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` (``options.stages_per_device``
            stages per rank, stage ``s`` on rank ``s mod R``; Narayanan et al., SC 2021), or
            ``"auto"``: rank 0 chooses among them as :func:`fxsplit.compile` does (the step of each
            candidate simulated on its costs) and every rank runs its choice.
        microbatches: Micro-batches per step, or ``"auto"`` (rank 0 chooses); default: ``"auto"``
            under ``schedule="auto"``, else the number of ranks.
        backend: ``"gloo"``, ``"nccl"`` or None (NCCL with CUDA, else gloo); used when this
            function creates the process group.
        state_dict: The original model's state dict, or a path to one (``torch.save``); each rank
            reads only its stage's keys.
        init_fn: ``init_fn(original_name, tensor)`` filling a stage tensor in place, for the
            tensors ``state_dict`` lacks. Without both, the tensors the stage owns are initialised
            as the model's constructor does, on this rank's device (a Hugging Face model's
            ``_init_weights``, else each module's ``reset_parameters()``, else the value a second
            ``model_fn()`` gives; see :mod:`fxsplit.runtime.dist_init`); tied copies then take the
            first holder's values.
        plan: A fixed plan (its stage count must equal the world size, or be a multiple of it
            under interleaved 1F1B; rank 0's copy is used);
            default: rank 0 solves, costed on its own device (a measured CPU, or the preset of
            the detected GPU).
        solver: The solver rank 0 runs.
        timeout_s: Seconds a rank waits for a peer before raising ``ExecutionError``.
        watchdog: End a process stuck past ``timeout_s`` + 5 s where no timeout reaches.
        options: :class:`~fxsplit.api.CompileOptions` (capture method, downset budget, mixed
            precision: with ``autocast="fp16"`` train with
            ``pipe.train_step(..., grad_scaler=pipe.grad_scaler())``, see
            :meth:`DistributedPipeline.train_step`).
        cost_model: How rank 0 costs the plan: ``"auto"`` (profiled when the example inputs are
            real and the model fits rank 0's device, else analytic), ``"profiled"`` (rank 0
            materialises the graph on its device with stand-in weights and times every node at
            the micro-batch size) or ``"analytic"``. The links between neighbouring ranks are
            measured in every case (a send/recv ping-pong, collective).
        batch_dim: The batch dimension of the first input, as :func:`fxsplit.compile`'s (default
            ``options.batch_dim``).
        replicas: ``dp``, copies of the whole pipeline (PipeDream's stage replication as a
            ``[pp, dp]`` mesh, the replicas of a stage on neighbouring ranks: rank ``r`` runs stage
            ``r // dp`` of replica ``r % dp``). Each replica trains ``1/dp`` of every batch (the
            example inputs too: the plan is costed on one replica's share) in ``microbatches``
            micro-batches, and each stage's gradients are averaged over its replicas after the
            step, so the gradients are the unsplit model's on the whole batch. ``world / dp``
            pipeline ranks; the batch must split evenly. Not yet with ``calibrate`` or loss
            scaling.
        tensor_parallel: ``tp``, ranks each stage's ops are split over (a ``[pp, dp, tp]`` mesh:
            rank ``(s * dp + d) * tp + t`` runs stage ``s`` of replica ``d``, shard ``t``). Rank 0
            plans every layer of the whole graph over ``tp`` ranks (PaSE's per-layer strategies
            from DTensor's sharding rules, ``tp_strategy``; Elango, IPDPS 2021) and every stage
            runs its part with DTensor (:func:`~fxsplit.runtime.tensor_parallel.shard_stage`):
            parameters split as planned, values whole at stage boundaries, each of the ``tp``
            ranks of a stage in its own pipeline with the same share of the batch. The plan is
            ``pipe.tp_plan``; ``state_dict``, checkpoints and gradients by original name as
            ever (shards gathered; ``p.grad`` of a split parameter is a DTensor, its
            ``full_tensor()`` the unsplit gradient). CPU ranks (gloo), fp32, no recomputation.
        tp_strategy: ``"auto"`` (the cheapest per-layer plan), ``"megatron"`` (column/row
            linear layers) or ``"data-parallel"`` for ``tensor_parallel > 1``.
        parallel: ``"pipeline"``: the mesh ``replicas`` and ``tensor_parallel`` give (default:
            one pipeline over every rank); ``"hybrid"``: rank 0 chooses ``[pp, dp, tp]`` and the
            per-layer family itself (:func:`fxsplit.solvers.hybrid.plan_hybrid` on its analytic
            costs, ``world`` devices like its own joined by the measured link) and every rank
            builds that (``schedule="auto"`` runs 1f1b); ``microbatches`` then counts the
            micro-batches of the whole batch
            (default: the world size; each replica runs ``microbatches / dp`` of them) and the
            search is ``pipe.hybrid``.
        loss_fn, target: The loss ``train_step`` will compute on the last rank and a target for
            ``example_inputs``: with the profiled cost model and a real example batch rank 0
            times it on its stand-in model's outputs and plans the last stage with it
            (``pipe.loss_planned``); otherwise ``predicted_step_s`` adds the loss each step
            measures.

    Returns:
        The :class:`~fxsplit.dist_calibrate.CompiledDistributedPipeline` of this rank (a
        :class:`DistributedPipeline` that can ``calibrate`` itself: measure, re-plan, rebuild).

    Raises:
        ConfigError: for a launch without torchrun's environment, a plan whose stage count does
            not suit the world size and schedule, a bad schedule or micro-batch count, or stage
            tensors no source fills, or an unknown ``options.autocast``; on every rank, before
            any stage is built.
        PlanError: on every rank, when a rank captured a different graph than rank 0, rank 0's
            plan does not fit a rank's capture, or capture or planning failed on another rank.
        CaptureError, InfeasibleError: as :func:`fxsplit.compile`.

    Example:
        >>> # on every rank, under torchrun --nproc_per_node=2:
        >>> # pipe = fxsplit.distributed.compile(lambda: GPT(cfg), (tokens,), microbatches=4)
        >>> # loss = pipe.train_step(tokens, target=labels, loss_fn=F.cross_entropy)
    """
    if cost_model not in ("auto", "profiled", "analytic"):
        raise ConfigError(f"cost_model={cost_model!r}; choose 'auto', 'profiled' or 'analytic'")
    if parallel not in ("pipeline", "hybrid"):
        raise ConfigError(f"parallel={parallel!r}; choose 'pipeline' (the mesh replicas and tensor_parallel give) "
                          "or 'hybrid' (rank 0 chooses pipeline stages x replicas x tensor parallelism)")
    if parallel == "hybrid" and (replicas != 1 or tensor_parallel != 1 or plan is not None):
        raise ConfigError(f"parallel='hybrid' chooses the mesh and the plan itself; drop replicas={replicas}, "
                          f"tensor_parallel={tensor_parallel} and plan, or use parallel='pipeline'")
    options = with_batch_dim(options or CompileOptions(allow_idle_devices=False, time_limit_s=30.0), batch_dim)
    options = with_loss_options(options, loss_fn, target)
    autocast_dtype(options.autocast)  # an unknown name fails here, on every rank, before any work
    rank, world, device = init_process_group(backend, timeout_s)
    hybrid = None
    if parallel == "hybrid":
        schedule = "1f1b" if schedule == "auto" else schedule  # the search costs gpipe and 1f1b
        hybrid = _choose_mesh(model_fn, tuple(example_inputs), dict(example_kwargs or {}), world, microbatches,
                              schedule, rank, device, options, cost_model)
        best = hybrid.best
        replicas, tensor_parallel, microbatches = best.dp, best.tp, (microbatches or world) // best.dp
        tp_strategy = "megatron" if best.family == "megatron" else "auto"
    _check_replicas(replicas, world, schedule, tensor_parallel, tp_strategy)
    tp = tensor_parallel
    if tp > 1 and (device.type != "cpu" or options.autocast is not None):
        raise ConfigError(f"tensor_parallel={tp} runs fp32 stages on CPU ranks (gloo) so far, not {device} with "
                          f"autocast={options.autocast!r}; pass backend='gloo' and no autocast")
    pp = world // (replicas * tp)  # the ranks of one pipeline
    asked = microbatches if microbatches is not None else ("auto" if schedule == "auto" else pp)
    _check_args(schedule, asked, pp, None)
    args, kwargs = _replica_example(tuple(example_inputs), dict(example_kwargs or {}), replicas)
    if plan is not None:
        _check_args(*_chosen(schedule, asked, plan), pp, plan.num_stages)  # before any collective
    with torch.device("meta"):
        meta_model = model_fn()
    overhead = _runtime_overhead(options, device, world, cost_model) if plan is None else None
    planned = plan_on_rank0(meta_model, (args, kwargs), rank=rank, world=world, device=device, schedule=schedule,
                            microbatches=asked, solver=solver, plan=plan, options=options, cost_model=cost_model,
                            devices=pp, overhead=overhead, replicas=replicas)
    captured, plan = planned.captured, planned.plan
    schedule, m = _chosen(schedule, asked, plan)
    if schedule == "1f1b" and m == 1 and pp > 1 and asked == "auto":
        # rank 0 chose one micro-batch (a model that is not per-sample); torch's 1F1B refuses fewer
        # micro-batches than stages, and with one the two schedules run the same actions
        log.info("one micro-batch: running 1f1b as gpipe (the same order of actions)")
        schedule, plan = "gpipe", plan.with_(schedule="gpipe")
    _check_args(schedule, m, pp, plan.num_stages)
    _warn_if_not_per_sample(captured.gm, m, rank, planned.not_per_sample, replicas)
    split_layout = None
    if tp > 1:
        link = options.link if isinstance(options.link, LinkSpec) else None  # else measured over every rank
        layout, fallback, tp_plan = _split_layout(captured.gm, tp, tp_strategy, link, options.time_limit_s or 30.0,
                                                  rank, device)
        split_layout = (layout, fallback)
    program = split_graph(captured.gm, plan.stage_of_block(), [str(device)] * plan.num_stages)
    mesh = replica_groups(world, replicas, tp)
    tied = tied_groups(program, world, replicas, tp)
    mine = [(stage, StageState(stage.state, captured.aliases))
            for stage in rank_stages(program, rank // (replicas * tp), pp)]
    local_shards: dict[int, dict[str, tuple[int, ...]]] = {}
    chunks = {}  # each split weight allocated as this rank's chunk
    if split_layout is not None and mesh is not None:
        chunks = rank_chunks([stage for stage, _ in mine], split_layout[0], mesh.tp_index, mesh.tp,
                             set(tied_holders(program)))
    for stage, state in mine:
        shards = chunks.get(stage.index, {})
        local_shards[stage.index] = {g: tuple(get_tensor(stage.gm, g).shape) for g in shards}
        with _same_draws(mesh if shards else None, device):  # every copy initialises a cut tensor alike
            origin = materialise(stage.gm, state, device, state_dict=state_dict, init_fn=init_fn,
                                 meta_model=meta_model, model_fn=model_fn, shards=shards)
        log.info("rank %d: stage %d state from %s; %d split tensor(s) held as this rank's chunk", rank, stage.index,
                 sorted(set(origin.values())), len(shards))
    broadcast_tied([stage for stage, _ in mine], tied)
    if mesh is not None:
        same_as_first_replica([stage for stage, _ in mine], mesh, local=local_shards)
    meta = {"model": type(meta_model).__name__, "reference": planned.reference.to_dict(), "cost_model": planned.cost_model,
            "profiled_ranks": planned.profiled_ranks}
    pipe = build_pipeline(mine, captured, (args, kwargs), plan.num_stages, device, schedule, m, tied,
                          plan=plan, autocast=options.autocast, meta=meta, state_order=list(meta_model.state_dict().keys()), timeout_s=timeout_s,
                          watchdog=watchdog, cls=CompiledDistributedPipeline, replicas=mesh, split_layout=split_layout,
                          local_shards=local_shards, training=meta_model.training)
    if tp > 1:
        pipe.tp_plan = tp_plan
    pipe.hybrid = hybrid
    pipe.loss_planned = planned.loss_planned
    pipe.context = DistContext(model_fn, meta_model, captured, to_meta((args, kwargs)), planned.problem,
                               example_batch(captured, (args, kwargs))[2], solver, options, split_layout)
    pipe.measure_sync_s()  # the step's tail after the last backward, in predicted_step_s
    _barrier(timeout_s)
    if rank == 0:
        log.info("pipeline of %d stages over %d ranks: %s x %d, stage sizes %s", plan.num_stages, world, schedule, m,
                 [len(s.blocks) for s in plan.stages])
    return pipe


class ShardedStateDict(Mapping[str, torch.Tensor]):
    """The original state dict spread over a checkpoint's shards, read lazily (``mmap``).

    Args:
        directory: A directory written by :meth:`DistributedPipeline.save`.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.which, self.meta, self._paths = read_index(directory)  # shard names checked here
        self._where = {k: shard for shard, keys in self.meta["shards"].items() for k in keys}
        self._open: dict[str, Mapping[str, torch.Tensor]] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        shard = self._where[key]
        if shard not in self._open:
            self._open[shard] = load_shard(self._paths[shard], self.which, mmap=True)
        return self._open[shard][key]

    def __iter__(self) -> Any:
        order = self.meta.get("state_order") or list(self._where)
        return iter([k for k in order if k in self._where])

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where


def load(
    directory: str | os.PathLike[str],
    model_fn: Callable[[], nn.Module],
    example_inputs: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> DistributedPipeline:
    """Rebuild a saved pipeline on the ranks of this launch (same or different number).

    Plans again for the current world size, then each rank reads the keys its new stage needs
    from the shards. The schedule defaults to the saved one; the micro-batch count too, when
    it still suits the new number of stages.

    Args:
        directory: Written by :meth:`DistributedPipeline.save`.
        model_fn, example_inputs, example_kwargs: As :func:`compile`.
        kwargs: Other :func:`compile` arguments (``schedule``, ``microbatches``, ``timeout_s``).

    Raises:
        ConfigError: for a directory without ``plan.json``; and as :func:`compile`.
    """
    shards = ShardedStateDict(directory)
    _, world, _ = init_process_group(kwargs.get("backend"), kwargs.get("timeout_s", 60.0))
    schedule = kwargs.setdefault("schedule", shards.meta.get("schedule", "1f1b"))
    saved_m = int(shards.meta.get("microbatches") or world)
    kwargs.setdefault("microbatches", max(saved_m, world) if schedule == "1f1b" else saved_m)
    log.info("loading a %d-stage checkpoint onto %d ranks", shards.meta.get("num_stages", 0), world)
    return compile(model_fn, example_inputs, example_kwargs, state_dict=shards, **kwargs)


# -- per-layer strategies (PaSE) over all ranks ------------------------------------------------
STRATEGIES = ("auto", "data-parallel", "megatron", "replicate")
"""What :func:`parallelize` runs: the best per-node placements (PaSE), data parallelism, Megatron's
column/row linear layers (the best plan of that family), every rank doing everything."""


def parallelize(
    model_fn: Callable[[], nn.Module],
    example_inputs: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    strategy: str | Sequence[int] | Callable[[Any], Sequence[int]] = "auto",
    backend: str | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    link: LinkSpec | None = None,
    time_limit_s: float = 30.0,
    timeout_s: float = 60.0,
    options: CompileOptions | None = None,
    op_overhead_s: float = 0.0,
) -> ParallelGraph:
    """Split every layer of a model over all ranks as a per-layer plan says (PaSE); call on every rank.

    Every rank builds the model (``model_fn()``; rank 0's weights, or ``state_dict``, are
    broadcast so all ranks agree) and captures it; each node's candidate placements come from
    DTensor's sharding strategies (:func:`fxsplit.passes.parallel_strategies.strategy_graph`, on
    a 1-D mesh of all ranks), rank 0 chooses one per node (PaSE's DP, CP-SAT past its table
    limit; Elango, IPDPS 2021) on the analytic cost model of its device, the link its all-gathers
    measure and ``op_overhead_s``, and every rank runs the choice with DTensor
    (:class:`~fxsplit.runtime.tensor_parallel.ParallelGraph`).

    Args:
        model_fn: Builds the model (on the CPU; gloo) with its weights.
        example_inputs, example_kwargs: A representative batch (shapes fix the plan; a batch of
            another size must split over the ranks the same way).
        strategy: ``"auto"`` (the cheapest per-node plan), ``"data-parallel"``, ``"megatron"``
            (the best plan whose linear layers alternate column and row splits, Shoeybi et al.
            2019), ``"replicate"``, an explicit choice (one option index per vertex of the
            strategy graph), or a function given the
            :class:`~fxsplit.passes.parallel_strategies.NodeStrategies` that returns one (run on
            rank 0).
        backend: As :func:`compile`'s.
        state_dict: The original model's weights (rank 0's are used); default: rank 0's
            ``model_fn()``.
        link: The link of the mesh for the costs; default: all-gathers over every rank timed
            and read as a ring's link (:func:`~fxsplit.runtime.links.probe_collective_link`).
        time_limit_s: CP-SAT's limit when the DP table is too large.
        timeout_s: Seconds a collective waits.
        options: Capture options (:class:`~fxsplit.api.CompileOptions`).
        op_overhead_s: Seconds each op pays for running on DTensors (forward; twice in
            backward), added to every option that splits a value: on a CPU this dispatch
            dominates small models (``bench/layers.py`` measures it; 0 by default).

    Returns:
        This rank's :class:`~fxsplit.runtime.tensor_parallel.ParallelGraph`: ``pg(*inputs)``,
        ``pg.train_step(*inputs, target=..., loss_fn=...)``, ``pg.parameters()`` for an
        optimizer, ``pg.state_dict()`` (whole tensors, original names); ``pg.plan`` says what was
        chosen and predicted; ``pg, report = pg.calibrate(*inputs, target=y, loss_fn=f)``
        measures DTensor's dispatch, re-plans with it and rebuilds when the plan changes.

    Raises:
        ConfigError: for one rank, an unknown ``strategy`` or a choice of the wrong length, or a
            family with no finite plan for this model (on every rank).
        PlanError: when the ranks captured different graphs.

    Example:
        >>> # on every rank, under torchrun --nproc_per_node=4:
        >>> # pg = fxsplit.distributed.parallelize(lambda: GPT(cfg), (tokens,), strategy="megatron")
        >>> # loss = pg.train_step(tokens, target=labels, loss_fn=F.cross_entropy)
    """
    from torch.distributed.device_mesh import init_device_mesh

    from fxsplit.passes.parallel_strategies import strategy_graph

    if isinstance(strategy, str) and strategy not in STRATEGIES:
        raise ConfigError(f"strategy={strategy!r}; choose one of {STRATEGIES} or give one option index per vertex")
    rank, world, device = init_process_group(backend, timeout_s)
    if world < 2:
        raise ConfigError("parallelize splits layers over at least 2 ranks; launch with torchrun --nproc_per_node=2 or more")
    if device.type != "cpu":
        raise ConfigError(f"parallelize runs on CPU ranks (gloo) so far, not {device}; pass backend='gloo'")
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    model = model_fn()
    _agree_on_weights(model, state_dict)
    options = options or CompileOptions()
    reference = reference_spec(device) if rank == 0 else DeviceSpec("cpu")
    front = front_end(model, args, kwargs, reference=reference, cost_model="analytic", options=options,
                      name=type(model).__name__)
    gm = front.captured.gm
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, graph_digest(gm, blocks=False))  # each rank's own costs condensed it
    if len(set(digests)) > 1:
        raise PlanError(f"the ranks captured different graphs (digests {digests}); give every rank the same model "
                        "and example inputs")
    mesh_link = link or probe_collective_link(device=str(device))

    def replan(overhead_s: float) -> tuple[Any, Any, ParallelPlan]:
        """The strategy graph with ``overhead_s`` per split op, rank 0's choice on it (collective)."""
        found = strategy_graph(gm, world, link=mesh_link, op_overhead_s=overhead_s)
        plan = _on_rank0(rank, lambda: _choose_strategies(found, gm, strategy, time_limit_s, overhead_s))
        return found.layout(plan.choice), found.fallback, plan

    layout, fallback, plan = replan(op_overhead_s)
    mesh = init_device_mesh("cpu", (world,))
    pg = ParallelGraph(gm, layout, mesh, trainable=front.captured.trainable,
                       aliases=front.captured.aliases, fallback=fallback,
                       flatten=lambda a, k: front.captured.flatten_inputs(a, k),
                       unflatten=front.captured.unflatten_outputs, state_order=list(model.state_dict()))
    pg.replanner = replan
    pg.plan = plan
    if rank == 0:
        log.info("per-layer plan over %d ranks (%s): predicted %.3g s per step, %s", world, plan.strategy,
                 plan.predicted_step_s, dict(Counter(pg.placements().values())))
    return pg


def _agree_on_weights(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None) -> None:
    """Load ``state_dict`` (when given) and make every rank hold rank 0's tensors."""
    if state_dict is not None:
        model.load_state_dict(dict(state_dict))
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)


def _try(call: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return call(), None
    except FxsplitError as exc:
        return None, exc


def _choose_strategies(found: Any, gm: torch.fx.GraphModule, strategy: str | Sequence[int] | Callable[[Any], Sequence[int]],
                       time_limit_s: float, op_overhead_s: float = 0.0) -> ParallelPlan:
    """Rank 0's pick: the option per vertex for ``strategy``, its predicted seconds and bytes."""
    from fxsplit.passes.parallel_strategies import megatron_placements
    from fxsplit.solvers.pase import solve_strategies

    g = found.graph
    if callable(strategy):
        strategy = strategy(found)
    if not isinstance(strategy, str):
        choice = tuple(int(c) for c in strategy)
        g.cost_s(choice)  # ConfigError for a wrong length or index
        name, solver, proven = "given", "given", False
    elif strategy == "auto":
        best = solve_strategies(g, time_limit_s=time_limit_s)
        choice, name, solver, proven = best.choice, "auto", best.solver, best.proven
    elif strategy == "megatron":
        best = solve_strategies(g.restricted(found.allowing(megatron_placements(gm))), time_limit_s=time_limit_s)
        choice, name, solver, proven = best.choice, "megatron", best.solver, best.proven
    elif strategy == "data-parallel":
        choice, name, solver, proven = found.data_parallel_choice(), "data-parallel", "rule", False
    else:
        choice, name, solver, proven = found.choice_of(("R",)), "replicate", "rule", False
    cost = g.cost_s(choice)
    if not math.isfinite(cost):
        raise ConfigError(f"strategy {name!r} has no finite plan for this model over {found.mesh_size} ranks "
                          "(a pair of placements no collective joins); try strategy='auto'")
    return ParallelPlan(name, choice, cost, g.memory_bytes(choice), solver, proven,
                        {"data-parallel": g.cost_s(found.data_parallel_choice()),
                         "replicate": g.cost_s(found.choice_of(("R",)))}, op_overhead_s)


# -- the runtime's own work, measured on a pipeline of trivial stages ---------------------------
_OVERHEAD_MEMO: dict[tuple[str, int], RuntimeOverhead] = {}


def probe_distributed_overhead(device: torch.device, steps: int = 10) -> RuntimeOverhead:
    """Per-action and per-message seconds of this module's runtime over the world's ranks, and
    how much slower the stages compute inside it (:mod:`fxsplit.runtime.overhead`); collective:
    call on every rank, which all get rank 0's reading. Memoised per process and device.

    Two pipelines of busy stages, one :class:`~fxsplit.runtime.overhead.BusyBlock` per rank (one
    and four 512-wide layers on 64 rows per micro-batch, 256 KiB messages; :func:`compile` with
    analytic costs over its probed links), each run ``steps`` training steps after one warm-up;
    then every rank times its stage bare, all at once. Each traced action (the median forward
    and backward per micro-batch) is read as ``a + c x bare``
    (:func:`~fxsplit.runtime.overhead.busy_overhead`). The per-message part is the latency
    :func:`fxsplit.calibrate.fit_link_latency` adds to the probed links so that a pipeline's
    plan, refitted to the traced actions, predicts rank 0's median step wall (barrier to
    barrier), the mean of the two pipelines': what a message costs beyond the ping-pong of idle
    ranks.

    Raises:
        ConfigError: without an initialised process group of at least 2 ranks.
    """
    if not dist.is_initialized() or dist.get_world_size() < 2:
        raise ConfigError("probe_distributed_overhead needs an initialised process group of at least 2 ranks")
    key = (str(device), dist.get_world_size())
    if key not in _OVERHEAD_MEMO:
        with untouched_rng(device):
            _OVERHEAD_MEMO[key] = _probe_overhead(device, steps, dist.get_world_size())
    return _OVERHEAD_MEMO[key]


def _probe_overhead(device: torch.device, steps: int, world: int) -> RuntimeOverhead:
    traced, bare, extras = [], [], []
    for layers in BUSY_LAYERS:
        found = _probe_pipeline(device, steps, world, layers)
        if isinstance(found, str):
            log.warning("the runtime-overhead probe failed on rank 0 (%s); the plan does not charge the runtime's own "
                        "work per action and message", found)
            return RuntimeOverhead(0.0, 0.0, 0.0)
        traced.append(found[0])
        bare.append(found[1])
        extras.append(found[2])
    out = busy_overhead(traced, bare, statistics.fmean(extras))
    log.info("runtime overhead over %d ranks: %.1f us per forward, %.1f us per backward, %.1f us per message, "
             "compute x %.3f", world, out.forward_s * 1e6, out.backward_s * 1e6, out.message_s * 1e6,
             out.compute_factor)
    return out


def _probe_pipeline(device: torch.device, steps: int, world: int, layers: int
                    ) -> tuple[tuple[float, float], tuple[float, float], float] | str:
    """One probe pipeline of :class:`~fxsplit.runtime.overhead.BusyBlock` stages (one per rank):
    rank 0's ``((traced forward_s, backward_s), (bare forward_s, backward_s), message_s)``, on
    every rank; the failure's text when rank 0 could not measure it."""
    def build() -> nn.Module:
        return nn.Sequential(*(BusyBlock(layers) for _ in range(world)))

    rows = BUSY_ROWS * PROBE_MICROBATCHES
    x, target = torch.randn(rows, BUSY_WIDTH), torch.randn(rows, BUSY_WIDTH)
    options = CompileOptions(allow_idle_devices=False, profile_cache_dir=False, action_overhead_s=0.0, recompute="none",
                             symbolic_costs=False)
    pipe = compile(build, (x,), schedule="1f1b", microbatches=PROBE_MICROBATCHES, cost_model="analytic",
                   state_dict=build().state_dict(), options=options)
    try:
        walls, per_step = pipe.timed_steps(x.to(device), target=target.to(device), loss_fn=nn.functional.mse_loss,
                                           steps=steps)
        dist.barrier()  # every rank times its bare stage at once, as the ranks profile together
        bare = bare_module_s(BusyBlock(layers).to(device), torch.randn(BUSY_ROWS, BUSY_WIDTH, device=device))

        def measured() -> tuple[tuple[float, float], tuple[float, float], float]:
            traced = (statistics.median(st["fwd_s"] for step in per_step for st in step),
                      statistics.median(st["bwd_s"] for step in per_step for st in step))
            ctx, plan = pipe.context, pipe.running_plan()
            if ctx is None or ctx.problem is None:
                return traced, bare, 0.0
            m = pipe.microbatches
            refit = refit_problem(ctx.problem, [Measurement.of(plan, stage_rows(plan, per_step))], m, "1f1b")
            extra = fit_link_latency(refit, [list(st.blocks) for st in plan.stages], [st.device for st in plan.stages],
                                     m, "1f1b", statistics.median(walls))[1]
            return traced, bare, float(extra)

        def answer() -> tuple[tuple[float, float], tuple[float, float], float] | str:
            try:  # rank 0 never leaves the others waiting in the broadcast
                return measured()
            except Exception as exc:  # noqa: BLE001 - reported on every rank by the caller
                return f"{type(exc).__name__}: {exc}"

        return from_rank0(answer)
    finally:
        pipe.close()


def _runtime_overhead(options: CompileOptions, device: torch.device, world: int, cost_model: str
                      ) -> RuntimeOverhead | None:
    """The runtime's own work the plan charges; collective (every rank decides alike from its
    options and ``cost_model``, which agree across ranks): ``options.action_overhead_s`` seconds
    per action when it is a number; measured (:func:`probe_distributed_overhead`) for
    ``"probe"``, and for ``"auto"`` unless ``cost_model="analytic"``; None on one rank."""
    given = action_overhead_option(options)
    if given is not None:
        return RuntimeOverhead(given, given, given)
    if world == 1 or (options.action_overhead_s == "auto" and cost_model == "analytic"):
        return None
    return probe_distributed_overhead(device)
