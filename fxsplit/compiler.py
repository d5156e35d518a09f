"""The steps of :func:`fxsplit.compile`, in order: capture, passes, plan (+ schedule), codegen, runtime.

Orchestration only: every algorithm lives in its layer (passes, solvers, schedule, codegen,
runtime). Called by :func:`fxsplit.api.compile` after the arguments are checked.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn

from fxsplit import solvers
from fxsplit.codegen import BatchNormTracker, defer_batch_norm, place_stages, split_graph
from fxsplit.codegen.buffers import defer_buffer_updates
from fxsplit.codegen.split import StagedProgram
from fxsplit.errors import ConfigError, InfeasibleError, NotPerSampleWarning, SolverError
from fxsplit.frontend import capture_with, front_end
from fxsplit.ir import DeviceSpec, LinkSpec, Plan, Problem, evaluate
from fxsplit.ir.plan import trivial_lower_bound
from fxsplit.ir.problem import AUTO_SCHEDULES, LOOPED_SCHEDULES, ObjectiveName
from fxsplit.ir.units import format_seconds
from fxsplit.options import CompileOptions, autocast_dtype
from fxsplit.passes.batch_layout import primary_input
from fxsplit.passes.capture import Captured, capture
from fxsplit.passes.condense import Condensed
from fxsplit.runtime import Pipeline, StateMap
from fxsplit.runtime.links import pipeline_links
from fxsplit.runtime.microbatch import batch_size_of
from fxsplit.schedule import explore, make, plan_step_s
from fxsplit.solvers.tables import is_chain_order

__all__ = ["compile_pipeline", "example_batch_size", "plan_pipeline", "assemble", "assemble_choice", "PlanChoice", "CompileContext",
           "CompileReport"]

log = logging.getLogger(__name__)

P = TypeVar("P", bound=Pipeline)


@dataclass(frozen=True)
class CompileContext:
    """What :func:`fxsplit.compile` planned from, kept so the pipeline can be planned again.

    Attributes:
        model: The user's module (its parameters live in the stages).
        captured: The captured, annotated and condensed graph.
        problem: The planning problem with whole-batch costs.
        specs: The devices.
        batch: Samples in the example batch.
        microbatches, schedule, solver: The arguments ``compile`` was given (``"auto"`` allowed).
        options: The ``CompileOptions``.
    """

    model: nn.Module
    captured: Captured
    problem: Problem
    specs: tuple[DeviceSpec, ...]
    batch: int
    microbatches: int | str
    schedule: str
    solver: str
    options: CompileOptions


@dataclass(frozen=True)
class CompileReport:
    """What :func:`fxsplit.compile` did and predicts (``pipe.report``; read only, drives nothing).

    Attributes:
        reason: Why the schedule and micro-batch count were chosen (the exploration's pick).
        candidates: The exploration's table of the candidates it weighed.
        capture_method: ``"export"`` or ``"symbolic_trace"``.
        num_blocks: Blocks of the condensed graph.
        num_downsets: Downsets enumerated (a lower bound when enumeration stopped at its budget).
        front_end_s, plan_s, codegen_s: Wall seconds of capture + passes, planning, codegen.
        devices: The devices' names.
        predicted_step_s: The plan's simulated step, seconds.
        not_per_sample: Ops that mix samples across the batch (empty for a per-sample model).
    """

    reason: str
    candidates: str
    capture_method: str
    num_blocks: int
    num_downsets: int
    front_end_s: float
    plan_s: float
    codegen_s: float
    devices: tuple[str, ...]
    predicted_step_s: float
    not_per_sample: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlanChoice:
    """The plan with its schedule and micro-batch count, and why they were chosen."""

    plan: Plan
    problem: Problem
    schedule: str
    microbatches: int
    reason: str
    candidates: str = ""
    autocast: str | None = None


#: What ``CompileOptions(autocast="auto")`` chooses between: the model's own dtypes, and bf16
#: autocast (mixed precision that needs no loss scaling).
AUTO_PRECISIONS: tuple[str | None, ...] = (None, "bf16")


def precision_label(autocast: str | None) -> str:
    """``"autocast bf16"``, or ``"own dtypes"`` without mixed precision."""
    return f"autocast {autocast}" if autocast else "own dtypes"


def plan_precisions(
    annotate: Callable[[str | None], Problem], batch: int, microbatches: int | str, schedule: str, solver: str,
    options: CompileOptions, schedules: Sequence[str] = AUTO_SCHEDULES,
) -> tuple[Problem, PlanChoice]:
    """:func:`plan_pipeline` for each precision ``options.autocast`` allows, keeping the fastest.

    ``options.autocast="auto"`` tries :data:`AUTO_PRECISIONS` (BaPipe's joint exploration, with
    precision as one more knob: bf16 halves activation and boundary bytes and runs at the
    device's low-precision roof, ``DeviceSpec.peak_flops_for``); any other value plans once.

    Args:
        annotate: ``annotate(autocast) -> Problem``: the whole-batch problem with costs
            annotated under that precision (``None``: the model's own dtypes).
        batch, microbatches, schedule, solver, options, schedules: as :func:`plan_pipeline`.

    Returns:
        ``(problem, choice)`` of the winner: the smallest predicted step (simulated), ties to the
        earlier precision (the model's own dtypes first). ``choice.autocast`` names it; with
        several precisions its ``reason`` starts with the comparison and ``candidates`` holds
        every precision's table.

    Raises:
        InfeasibleError: when no precision has a plan that fits (the message names each).
        SolverError: when none has a plan and a solver gave up on one within its time limit.
    """
    precisions = AUTO_PRECISIONS if options.autocast == "auto" else (options.autocast,)
    tried: list[tuple[str | None, Problem, PlanChoice]] = []
    failures: list[tuple[Exception, str]] = []
    for autocast in precisions:
        problem = annotate(autocast)
        try:
            choice = plan_pipeline(problem, batch, microbatches, schedule, solver,
                                   dataclasses.replace(options, autocast=autocast), schedules)
        except (InfeasibleError, SolverError) as exc:  # a time-out in one precision leaves the others
            if len(precisions) == 1:
                raise
            failures.append((exc, f"{precision_label(autocast)}: {exc}"))
            continue
        tried.append((autocast, problem, dataclasses.replace(choice, autocast=autocast)))
    if not tried:
        text = "no precision has a plan; " + " | ".join(f for _, f in failures)
        if all(isinstance(e, InfeasibleError) for e, _ in failures):
            raise InfeasibleError(text)
        raise SolverError(text)
    autocast, problem, best = min(tried, key=lambda t: plan_step_s(t[2].plan))
    if len(precisions) == 1:
        return problem, best
    steps = ", ".join(f"{precision_label(a)} {format_seconds(plan_step_s(c.plan), significant=3)}"
                      for a, _, c in tried)
    reason = (f"{precision_label(autocast)}, the fastest precision per step ({steps}"
              + "".join(f"; {f}" for _, f in failures) + f"); {best.reason}")
    tables = "".join(f"{precision_label(a)}:\n{c.candidates}" for a, _, c in tried)
    return problem, dataclasses.replace(best, reason=reason, candidates=tables)


def check_microbatches(microbatches: int | str, batch: int) -> None:
    """Raise :class:`ConfigError` when a fixed micro-batch count exceeds the batch."""
    if isinstance(microbatches, int) and microbatches > batch:
        raise ConfigError(
            f"microbatches={microbatches} exceeds the batch of {batch} samples in example_inputs; "
            f"use microbatches <= {batch}"
        )


def per_microbatch(problem: Problem, m: int, kind: str) -> Problem:
    """``problem`` (whole-batch costs) as ``m`` micro-batches under schedule ``kind``."""
    return problem.with_(graph=problem.graph.scaled(1.0 / m), microbatches=m, schedule=kind)


def _solve(problem: Problem, solver: str, options: CompileOptions, m: int, kind: str, seed: Plan | None = None) -> Plan:
    """``solver``'s split of ``problem`` at ``m`` micro-batches under ``kind``.

    ``seed``: the schedule search's split, which fits memory at the winner's ``(kind, m)``; it
    hints CP-SAT (``auto`` runs the DP alone first, CP-SAT with the time left, instead of racing
    them: Llama-70B on 64 devices, the DP alone proves the optimum in 13 s where, racing an
    unfinished CP-SAT model on two cores, it timed out), and when the exact solver finds no plan
    within the time limit it is returned re-costed, status ``feasible`` with the trivial lower
    bound (``stats["fallback"]`` says why), so a search that found a plan never ends without one."""
    pb = per_microbatch(problem, m, kind)
    if seed is None:
        return solvers.solve(pb, solver, time_limit_s=options.time_limit_s)
    fallback = evaluate(pb, [list(st.blocks) for st in seed.stages], [st.device for st in seed.stages],
                        solver=seed.solver, lower_bound_s=trivial_lower_bound(pb),
                        stats={**seed.stats, "fallback": "the schedule search's split"})
    usable = not fallback.validate(pb)
    opts: dict[str, Any] = {"hint": fallback} if usable and solver in ("auto", "cpsat") else {}
    if usable and solver == "auto":  # the DP alone, then CP-SAT hinted (no race: on few cores the
        opts["race"] = False        # race slows the DP more than CP-SAT's first plans help)
    try:
        plan = solvers.solve(pb, solver, time_limit_s=options.time_limit_s, **opts)
    except SolverError as exc:  # a time-out (an InfeasibleError is a proof, and no SolverError)
        if not usable:
            raise
        log.warning("%s; keeping the schedule search's split (%s)", exc, format_seconds(fallback.objective_s))
        return fallback.with_(status="feasible", stats={**fallback.stats, "fallback": str(exc)})
    if usable and fallback.objective_s < plan.objective_s * (1 - 1e-9):
        return fallback.with_(status="feasible", lower_bound_s=min(plan.lower_bound_s, fallback.objective_s),
                              stats={**fallback.stats, "fallback": f"better than {plan.solver}'s {plan.status} plan"})
    return plan


EXPLORE_ROUNDS = 6
"""DP runs of the makespan search for the split the schedule search ranks candidates on."""


def _explore_plan(problem: Problem, solver: str, options: CompileOptions, m: int, kind: str) -> Plan:
    """The split the schedule search simulates its candidates on.

    For an exact ``solver``, the DP over the prefixes of the block order
    (``solve_dp(states="chain")``, milliseconds, measured within 2 % of the optimum on Hugging
    Face tiny models, bench/README.md *Solvers at scale*); the exact solver when no such split
    fits. The winner is then solved exactly. A heuristic ``solver`` is used as is."""
    if not solvers.is_exact(solver):
        return _solve(problem, solver, options, m, kind)
    pb = per_microbatch(problem, m, kind)
    try:  # a split to rank the schedules on: a few rounds of the makespan search are plenty
        return solvers.solve(pb, "dp", states="chain", time_limit_s=options.time_limit_s, max_rounds=EXPLORE_ROUNDS)
    except SolverError as exc:  # out of time (InfeasibleError is no SolverError)
        log.info("%s; ranking the schedules on the greedy split", exc)
        return solvers.solve(pb, "greedy")
    except InfeasibleError:
        if is_chain_order(problem):  # the prefixes are all the downsets: a proof
            raise
    # memory binds so hard that no split along the block order fits: the exact DP proves
    # infeasibility or finds the split (CP-SAT, unhinted, rarely does either in time)
    opts: dict[str, Any] = {"race": False} if solver == "auto" else {}
    return solvers.solve(pb, solver, time_limit_s=options.time_limit_s, **opts)


def looped_problem(problem: Problem, options: CompileOptions) -> Problem | None:
    """``problem`` with ``options.stages_per_device`` stages on each device (looped schedules),
    or None when that cannot help: one device, or fewer blocks than stages."""
    v = options.stages_per_device
    if problem.num_devices < 2 or v < 2 or len(problem.graph) < v * problem.num_devices:
        return None
    return problem.with_(stages_per_device=v)


def say_phase(options: CompileOptions, text: str) -> None:
    """Log what compile does now and hand it to ``options.phase`` (the CLI's spinner)."""
    log.info("%s", text)
    if options.phase is not None:
        options.phase(text)


def evaluate_fixed(problem: Problem, stages: Sequence[Sequence[int]], devices: Sequence[int], m: int, kind: str) -> Plan:
    """Cost a hand-made split at ``m`` micro-batches (benches compare it with the solvers')."""
    return evaluate(per_microbatch(problem, m, kind), stages, devices, solver="manual")


def plan_pipeline(
    problem: Problem, batch: int, microbatches: int | str, schedule: str, solver: str, options: CompileOptions,
    schedules: Sequence[str] = AUTO_SCHEDULES,
) -> PlanChoice:
    """Solve the split and choose the schedule and micro-batch count.

    ``problem`` holds whole-batch costs. With both ``microbatches`` and ``schedule`` fixed the
    solver runs once on per-micro-batch costs. Otherwise a first plan per placement (one stage
    per device under 1F1B; ``options.stages_per_device`` stages per device in looping placement
    under interleaved 1F1B, when the graph has the blocks; from :func:`_explore_plan`, a fast
    split along the block order when ``solver`` is exact) is handed to
    :func:`fxsplit.schedule.explore`, which simulates every candidate schedule and micro-batch
    count that fits memory; the split is then solved by ``solver`` for the winner (once: the
    first plan is reused when the winner is what it solved and it is optimal or ``solver`` is a
    heuristic). The reason and the table of candidates are those of the first plans' splits.

    Args:
        schedules: The kinds ``schedule="auto"`` chooses from (the distributed runtime passes
            the one-stage-per-rank ones).
    """
    kinds = tuple(schedules) if schedule == "auto" else (schedule,)
    check_microbatches(microbatches, batch)
    if isinstance(microbatches, int):
        candidates: Sequence[int] | None = (microbatches,)
        m0 = microbatches
    else:
        candidates, m0 = None, min(batch, 2 * problem.num_devices)
    flat_kinds = [k for k in kinds if k not in LOOPED_SCHEDULES]
    looped_kinds = [k for k in kinds if k in LOOPED_SCHEDULES]
    looped = looped_problem(problem, options) if looped_kinds else None
    if looped is None and not flat_kinds:
        raise ConfigError(f"schedule {schedule!r} runs {options.stages_per_device} stages per device "
                          f"and needs at least 2 devices and that many stages' worth of blocks; the graph has "
                          f"{len(problem.graph)} blocks for {problem.num_devices} devices. Use schedule='1f1b'")
    say_phase(options, f"planning {len(problem.graph)} blocks on {problem.num_devices} devices: "
                       + ("solving the split" if schedule != "auto" and isinstance(microbatches, int)
                          else f"searching {', '.join(kinds)} and micro-batch counts"))
    first: dict[str, tuple[Problem, Plan]] = {}  # the first plan of each placement, by its kind
    fixed = schedule != "auto" and isinstance(microbatches, int)  # one solve, by the solver
    first_plan = _solve if fixed else _explore_plan
    if flat_kinds:
        kind0 = "1f1b" if "1f1b" in flat_kinds else flat_kinds[0]
        first[kind0] = (problem, first_plan(problem, solver, options, m0, kind0))
    if looped is not None:
        plan = _first_looped(looped, first_plan, solver, options, m0, looped_kinds[0], required=not flat_kinds)
        if plan is not None:
            first[looped_kinds[0]] = (looped, plan)
    if fixed:
        (kind0, (pb0, plan0)), = first.items()
        make(kind0, plan0.num_stages, m0, num_ranks=plan0.num_ranks)  # ScheduleError when it cannot run m0
        return PlanChoice(plan0, pb0.with_(microbatches=m0, schedule=kind0), kind0, m0,
                          f"{kind0} with {m0} micro-batches, as asked")
    placement = {k in LOOPED_SCHEDULES: ([st.blocks for st in plan.stages], [st.device for st in plan.stages])
                 for k, (_, plan) in first.items()}
    tried = [k for k in kinds if (k in LOOPED_SCHEDULES) in placement]
    flat = placement.get(False) or placement[True]
    choice = explore(problem, *flat, batch_size=batch, schedules=tried, microbatch_candidates=candidates,
                     looped=placement.get(True))
    m, kind = choice.microbatches, choice.kind
    pb = looped if kind in LOOPED_SCHEDULES and looped is not None else problem  # the winner's placement
    reuse = kind in first and m == m0 and (first[kind][1].status == "optimal" or not solvers.is_exact(solver))
    if not reuse:
        say_phase(options, f"planning: the {solver} split for {kind} with {m} micro-batch{'es' if m != 1 else ''}")
    seed = next(plan for k, (_, plan) in first.items() if (k in LOOPED_SCHEDULES) == (kind in LOOPED_SCHEDULES))
    plan = first[kind][1] if reuse else _solve(pb, solver, options, m, kind, seed)
    return PlanChoice(plan, pb.with_(microbatches=m, schedule=kind), kind, m, choice.reason, choice.format_table())


def _first_looped(problem: Problem, first_plan: Callable[..., Plan], solver: str, options: CompileOptions, m: int,
                  kind: str, *, required: bool) -> Plan | None:
    """The looping placement at ``m`` micro-batches (from ``first_plan``); None when none fits
    and another placement is tried too (``required=False``)."""
    try:
        return first_plan(problem, solver, options, m, kind)
    except InfeasibleError as exc:
        if required:
            raise
        log.info("no looping placement with %d stages per device: %s", problem.stages_per_device, exc)
        return None


def _links(specs: Sequence[DeviceSpec], options: CompileOptions, cost_model: str) -> tuple[LinkSpec, tuple]:
    """The default link and per-pair links of the problem: ``options.link`` when it is a
    :class:`LinkSpec`; measured between the devices (:func:`pipeline_links`) for ``"probe"``, and
    for ``"auto"`` when the devices are here to be timed (a timed cost model); else the default."""
    chosen = options.link or "auto"
    if isinstance(chosen, LinkSpec):
        return chosen, ()
    if chosen not in ("auto", "probe"):
        raise ConfigError(f"link={chosen!r}; pass a LinkSpec, 'probe' or 'auto'")
    if chosen == "probe" or cost_model in ("profiled", "measured"):
        return LinkSpec(), pipeline_links([s.torch_device for s in specs])
    return LinkSpec(), ()


def action_overhead_option(options: CompileOptions) -> float | None:
    """``options.action_overhead_s`` as seconds, or None for ``"auto"`` / ``"probe"``.

    Raises:
        ConfigError: for anything else than a finite number >= 0, ``"auto"`` or ``"probe"``.
    """
    chosen = options.action_overhead_s
    if chosen in ("auto", "probe"):
        return None
    if isinstance(chosen, bool) or not isinstance(chosen, int | float) or not math.isfinite(chosen) or chosen < 0:
        raise ConfigError(f"action_overhead_s={chosen!r}; give seconds per stage action (a finite number >= 0, 0: "
                          "not modelled), 'probe' or 'auto'")
    return float(chosen)


def _orphans(model: nn.Module, captured: Captured) -> dict[str, torch.Tensor]:
    used = {a for names in captured.aliases.values() for a in names}
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in used}


def inputs_where_model_lives(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example inputs on the device the model's parameters and buffers live on, when that is
    one accelerator (``cuda:0``) and an input tensor is on the CPU: the passes that run the model
    on them (the per-sample check, the profiler) need both in one place; the pipeline moves each
    micro-batch to its stage's device at run time anyway. Anything else is returned as given."""
    places = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(places) != 1:
        return args, kwargs
    (place,) = places
    if place.type in ("cpu", "meta"):
        return args, kwargs

    def move(x: Any) -> Any:
        return x.to(place) if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x

    return pytree.tree_map(move, args), pytree.tree_map(move, kwargs)


def compile_pipeline(
    model: nn.Module,
    specs: list[DeviceSpec],
    args: tuple,
    kwargs: dict,
    *,
    microbatches: int | str,
    schedule: str,
    solver: str,
    cost_model: str,
    objective: ObjectiveName,
    options: CompileOptions,
    build: Callable[[CompileContext, PlanChoice, CompileReport], P],
) -> P:
    """Capture and plan ``model``, then ``build`` the pipeline (codegen and runtime) from what
    was planned; see :func:`fxsplit.compile` (whose ``build`` is ``CompiledPipeline.build``)."""
    t0 = time.perf_counter()
    batch = example_batch_size(args, kwargs, options.batch_dim)
    check_microbatches(microbatches, batch)  # before any work
    args, kwargs = inputs_where_model_lives(model, args, kwargs)
    reference = options.reference or specs[0]
    say_phase(options, f"capturing {type(model).__name__}")
    captured = capture_with(model, args, kwargs, options)
    # before the passes: the profiled cost model times micro-batches, which such a model may not run
    mixing = _not_per_sample(captured, args, kwargs, once_per_step=options.deferred_batch_norm)
    hint = _batch_dim_hint(model, args, kwargs, options, mixing) if mixing and microbatches != 1 else ""
    unsplittable = [m for m in mixing if m.kind == "needs the whole batch"]
    if unsplittable and microbatches != "auto" and microbatches != 1:
        raise ConfigError(f"{type(model).__name__} cannot run micro-batches of its example batch: "
                          f"{'; '.join(map(str, unsplittable))}. Use microbatches=1 (or 'auto'){hint}")
    if mixing and microbatches == "auto":
        log.warning("%s is not per-sample, so one micro-batch: %s%s", type(model).__name__,
                    "; ".join(map(str, mixing)), hint)
        microbatches = 1
    elif mixing and microbatches != 1:
        warnings.warn(
            f"{type(model).__name__} is not per-sample, and with microbatches={microbatches} the pipeline computes "
            f"something else than the model: {'; '.join(map(str, mixing))}. Use microbatches=1 (or 'auto'), or make "
            f"those ops per-sample{hint}", NotPerSampleWarning, stacklevel=3)
    link, links = _links(specs, options, cost_model)
    # the runtime's work per action: fxsplit.compile measures it first (fxsplit.overhead); a
    # caller that left "auto"/"probe" here plans without it
    overhead_s = action_overhead_option(options) or 0.0
    # each precision's condensation and the node metadata it wrote (values, costs, blocks): the
    # winner's are put back on captured.gm for codegen, never recomputed (timed costs, and so the
    # blocks, differ from one annotation to the next)
    annotations: dict[str | None, tuple[Condensed, dict[torch.fx.Node, dict[str, Any]]]] = {}
    annotate_s = [0.0]

    def annotate(autocast: str | None) -> Problem:
        start = time.perf_counter()
        say_phase(options, f"annotating {cost_model} costs on {reference.name}"
                           f"{' under ' + precision_label(autocast) if autocast else ''} and condensing")
        condensed = front_end(
            model, args, kwargs, reference=reference, cost_model=cost_model,
            options=dataclasses.replace(options, autocast=autocast), microbatches=microbatches,
            captured=captured).condensed
        annotations[autocast] = (condensed, {n: dict(n.meta) for n in captured.gm.graph.nodes})
        annotate_s[0] += time.perf_counter() - start
        return Problem(
            condensed.graph, tuple(specs), link=link, links=links, objective=objective,
            training=options.training, schedule="1f1b", allow_idle_devices=options.allow_idle_devices,
            recompute=options.recompute, action_overhead_s=overhead_s,
        ).check()

    t1 = time.perf_counter()
    problem, choice = plan_precisions(annotate, batch, microbatches, schedule, solver, options)
    plan_s = time.perf_counter() - t1 - annotate_s[0]  # annotation counts as front end, not planning
    front_end_s = t1 - t0 + annotate_s[0]
    condensed, metas = annotations[choice.autocast]
    for node, meta in metas.items():  # the winner's blocks on the nodes codegen splits
        node.meta.clear()
        node.meta.update(meta)
    options = dataclasses.replace(options, autocast=choice.autocast)
    say_phase(options, f"building {choice.plan.num_stages} stage(s) ({choice.schedule}, {choice.microbatches} micro-batch(es))")
    context = CompileContext(model, captured, problem, tuple(specs), batch, microbatches, schedule, solver, options)
    report = CompileReport(
        reason=choice.reason, candidates=choice.candidates, capture_method=captured.method,
        num_blocks=condensed.num_blocks, num_downsets=condensed.num_downsets, front_end_s=front_end_s, plan_s=plan_s,
        codegen_s=0.0, devices=tuple(s.name for s in specs), predicted_step_s=plan_step_s(choice.plan),
        not_per_sample=tuple(str(m) for m in mixing),
    )
    pipe = build(context, choice, report)
    log.info("compiled %s into %d stages: %s", type(model).__name__, choice.plan.num_stages, choice.reason)
    return pipe


def example_batch_size(args: tuple, kwargs: dict, batch_dim: int = 0) -> int:
    """The example batch's size: dim ``batch_dim`` of the first tensor input that has it.

    Raises:
        ConfigError: when no input tensor has dimension ``batch_dim``.
    """
    if batch_dim == 0:
        return batch_size_of(pytree.tree_leaves((args, kwargs)))
    return int(primary_input(args, kwargs, batch_dim)[1].shape[batch_dim])  # type: ignore[index]


def _batch_dim_hint(model: nn.Module, args: tuple, kwargs: dict, options: CompileOptions, mixing: Sequence[Any]) -> str:
    """When dim 0 is not the batch (a sequence-first model): the dimensions of the first input
    that no op mixes, found by capturing with each as the batch and checking that capture as
    :func:`_not_per_sample` does. Never applied, only said: the user decides (``batch_dim=``)."""
    from fxsplit.passes.per_sample import find_batch_mixing

    if options.batch_dim != 0 or all(m.kind == "updates a buffer" for m in mixing):
        return ""
    first = next((x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.dim() >= 1), None)
    if first is None or first.is_meta or not options.dynamic_batch:
        return ""
    clean = []
    for d in range(1, min(first.dim(), 4)):
        if first.shape[d] < 2:
            continue
        try:
            cap = capture(model, args, kwargs, method="export", dynamic_batch=True, batch_dim=d)
            flat = cap.flatten_inputs(args, kwargs)
            if all(m.kind == "updates a buffer" for m in find_batch_mixing(cap.gm, flat, cap.batched_inputs or [])):
                clean.append(d)
        except Exception as exc:  # noqa: BLE001 - a dimension that cannot be the batch is no candidate
            log.debug("batch_dim=%d is no candidate: %s", d, exc)
    if len(clean) == 1:
        return (f". Dim {clean[0]} of the first input {list(first.shape)} is a dimension no op mixes: if it holds the "
                f"samples (a sequence-first model), compile with batch_dim={clean[0]}")
    return ""


def _not_per_sample(captured: Captured, args: tuple, kwargs: dict, *, once_per_step: bool = True) -> list[Any]:
    """:func:`~fxsplit.passes.per_sample.find_batch_mixing` on the example batch, when its
    tensors and the model's are real (a meta or fake model cannot run: nothing is checked)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from fxsplit.passes.per_sample import find_batch_mixing, mutated_buffers

    flat = captured.flatten_inputs(args, kwargs)
    tensors = [*captured.gm.parameters(), *captured.gm.buffers(), *(x for x in flat if isinstance(x, torch.Tensor))]
    if any(t.is_meta or isinstance(t, FakeTensor) for t in tensors):
        return mutated_buffers(captured.gm, once_per_step=once_per_step)
    batched = captured.batched_inputs or [isinstance(x, torch.Tensor) and x.dim() > 0 for x in flat]
    return find_batch_mixing(captured.gm, flat, batched, once_per_step=once_per_step)


def _defer_updates(program: StagedProgram, captured: Captured, model: nn.Module) -> BatchNormTracker | None:
    """Deferred BatchNorm statistics and once-per-step buffer updates
    (:mod:`fxsplit.codegen.batchnorm`, :mod:`fxsplit.codegen.buffers`); warns about buffer
    updates that read no input but could not be made once per step."""
    tracker = defer_batch_norm(program) or BatchNormTracker()
    left = defer_buffer_updates(program, captured.gm, tracker)
    if left:
        warnings.warn(
            f"{type(model).__name__}: buffers {left} are updated in forward by each micro-batch (their update reads "
            "no input, but stages share it), so m times per step; use microbatches=1 for the unsplit model's update",
            NotPerSampleWarning, stacklevel=4)
    return tracker if tracker.batch_norms or tracker.tracked else None


def assemble_choice(context: CompileContext, choice: PlanChoice, cls: type[P]) -> P:
    """:func:`assemble` for ``choice`` of ``context``'s planning, the plan keeping its graph (per
    micro-batch costs) for pictures."""
    plan = choice.plan.with_(graph=choice.problem.graph.scaled(1.0 / choice.microbatches))
    return assemble(context.model, context.captured, plan, context.specs, choice.schedule, choice.microbatches,
                    context.options, cls=cls)


def assemble(
    model: nn.Module,
    captured: Captured,
    plan: Plan,
    specs: Sequence[DeviceSpec],
    schedule: str,
    microbatches: int,
    options: CompileOptions,
    cls: type[P] = Pipeline,  # type: ignore[assignment]
) -> P:
    """Codegen and runtime for a given plan (any valid plan, not only a solver's).

    Args:
        model: The original module (for state names and state the graph never reads).
        captured: Its captured, condensed graph (nodes carry ``"fxsplit.block"``).
        plan: The split; ``plan.stages[s].device`` indexes ``specs``.
        specs: The devices.
        schedule, microbatches: How the pipeline runs.
        options: ``CompileOptions`` (``copy_tied``).
        cls: The pipeline class to build (:class:`Pipeline` or a subclass).
    """
    program = split_graph(captured.gm, plan.stage_of_block(), [specs[st.device].torch_device for st in plan.stages])
    program = place_stages(program, copy_tied=options.copy_tied)
    tracker = _defer_updates(program, captured, model) if microbatches > 1 and options.deferred_batch_norm else None
    state = StateMap(
        program, captured.aliases, [n for n, _ in model.named_parameters(remove_duplicate=False)],
        list(model.state_dict().keys()), _orphans(model, captured),
    )
    return cls(
        program, in_spec=captured.in_spec, out_spec=captured.out_spec, state=state,
        schedule_kind=schedule, microbatches=microbatches, plan=plan,
        device_names=[specs[st.device].name for st in plan.stages], training=model.training,
        executor=options.executor, bn_tracker=tracker,
        batched_inputs=captured.batched_inputs, batched_outputs=captured.batched_outputs, layout=captured.layout,
        autocast=autocast_dtype(options.autocast), input_guards=captured.guards,
        size_outputs=captured.size_output_values if captured.size_outputs else None,
    )
