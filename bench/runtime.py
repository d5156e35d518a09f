"""Measured training throughput on this machine: the original model against four pipelines.

Variants, all on one MLP (zoo ``mlp``: ``layers`` x ``Linear(width) -> GELU``, then a head), the
same batch, micro-batches and schedule, one SGD step per training step:

(a) the original model in one process (1 thread; also shown with 2 threads);
(b) fxsplit's local pipeline: 2 stages run one after another in one process;
(c) fxsplit across 2 processes with gloo, when ``fxsplit.distributed`` exists (skipped otherwise);
(d) ``torch.distributed.pipelining``: a hand-placed even split (half the hidden layers per stage,
    the head on the last), manual ``PipelineStage`` s, ``ScheduleGPipe`` / ``Schedule1F1B``, 2
    processes with gloo.

Every process runs ``torch.set_num_threads(1)``. Reported: median step time, samples/s, the ratio
to (a), and the simulator's prediction from the measured cost model of this CPU: (a) the whole
model's forward+backward, (b) every action in turn, (c)/(d) the simulated pipelined step of the
plan (for (d): the even split costed with the same model). The local pipeline's last step is also
written as a Chrome trace and a predicted-vs-measured Gantt chart next to the JSON.

Run: ``python bench/runtime.py [--quick] [--width 1024 --layers 8 --batch 64 --microbatches 4]``.

``--workload gpt2`` runs the Hugging Face GPT-2 comparison instead (eager, torch's pipelining with
the even split, fxsplit.distributed; GPipe and 1F1B; alternating rounds in one pair of processes;
see ``bench/runtime_gpt2.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from pathlib import Path
from typing import Any

import runtime_gpt2
import torch
import torch.distributed as dist
from common import console, join_gloo, show, spawn_two
from plan_quality import environment, write_json
from rich.table import Table

import fxsplit
import fxsplit.models as zoo
from fxsplit.api import CompileOptions
from fxsplit.compiler import assemble, evaluate_fixed, plan_pipeline
from fxsplit.frontend import front_end
from fxsplit.ir import LinkSpec, Problem
from fxsplit.passes.costs import measure_cpu_spec
from fxsplit.schedule import simulate_plan


def make_case(args: argparse.Namespace) -> Any:
    return zoo.get("mlp", size="small", batch_size=args.batch, width=args.width, layers=args.layers, seed=0)


def time_steps(step: Any, warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step()`` after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        out.append(time.perf_counter() - start)
    return out


def run_original(args: argparse.Namespace, threads: int) -> list[float]:
    torch.set_num_threads(threads)
    case = make_case(args)
    opt = torch.optim.SGD(case.model.parameters(), lr=1e-3)
    x, y = case.make_batch(args.batch, 1)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        case.loss_fn(case.model(*x), y).backward()
        opt.step()

    return time_steps(step, args.warmup, args.steps)


class Built:
    """fxsplit's 2-stage plan of the MLP (measured cost model, 1 thread) and its local pipeline."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.set_num_threads(1)
        self.case = make_case(args)
        self.options = CompileOptions(allow_idle_devices=False)
        cpu = measure_cpu_spec()
        self.specs = tuple(cpu.with_(name=f"cpu#{i}") for i in range(2))
        ins = front_end(self.case.model, tuple(self.case.example_inputs), {}, reference=self.specs[0],
                        cost_model="measured", options=self.options)
        self.captured, self.condensed = ins.captured, ins.condensed
        self.problem = Problem(self.condensed.graph, self.specs, LinkSpec(), allow_idle_devices=False).check()
        choice = plan_pipeline(self.problem, args.batch, args.microbatches, args.schedule, "auto", self.options)
        self.plan = choice.plan
        self.pipe = assemble(self.case.model, self.captured, self.plan, self.specs, args.schedule, args.microbatches,
                             self.options)

    def module_of_block(self) -> dict[int, list[str]]:
        """Module paths (``hidden.4``, ``head``) of each block's nodes."""
        paths: dict[str, str] = {}
        for node in self.captured.gm.graph.nodes:
            stack = node.meta.get("nn_module_stack")
            if stack:
                paths[node.name] = list(stack.values())[-1][0]
            elif node.op == "get_attr":
                paths[node.name] = node.target.rsplit("_", 2)[0].replace("_", ".")
        return {b.id: [paths.get(n, "") for n in b.nodes] for b in self.condensed.graph.blocks}


def run_local(args: argparse.Namespace, built: Built, out_dir: Path) -> list[float]:
    case, pipe = built.case, built.pipe
    opt = torch.optim.SGD(list(pipe.parameters()), lr=1e-3)
    x, y = case.make_batch(args.batch, 1)

    def step() -> None:
        pipe.zero_grad()
        pipe.train_step(*x, target=y, loss_fn=case.loss_fn)
        opt.step()

    times = time_steps(step, args.warmup, args.steps)
    try:
        from fxsplit import viz

        pipe.trace(out_dir / "runtime-local-trace.json")
        viz.gantt(simulate_plan(pipe.plan, args.schedule, args.microbatches), out_dir / "runtime-local-gantt.png",
                  measured=pipe.recorder, title="bench/runtime.py: fxsplit local pipeline, last step")
    except fxsplit.FxsplitError as exc:  # matplotlib missing: the numbers still count
        print(f"no picture: {exc}")
    return times


# -- multi-process variants ------------------------------------------------------------------
def _even_split(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    hidden = list(model.hidden)
    half = len(hidden) // 2 // 2 * 2  # whole Linear+GELU pairs
    if rank == 0:
        return torch.nn.Sequential(*hidden[:half])
    return torch.nn.Sequential(*hidden[half:], model.head)


def _timed_on_two_ranks(rank: int, port: int, queue: Any, build: Any, warmup: int, steps: int) -> None:
    """Join a 2-rank gloo group, ``build(rank) -> (train_step, optimizer)``, time SGD steps and
    hand rank 0's times to ``queue``."""
    torch.set_num_threads(1)
    join_gloo(rank, port)
    try:
        train_step, opt = build(rank)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            train_step()
            opt.step()
            dist.barrier()

        times = time_steps(step, warmup, steps)
        if rank == 0:
            queue.put(times)
    finally:
        dist.destroy_process_group()


def _worker_torch_pp(rank: int, port: int, queue: Any, args: argparse.Namespace) -> None:
    """torch.distributed.pipelining with a hand-placed even split."""

    def build(rank: int) -> tuple[Any, Any]:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        case = make_case(args)
        module = _even_split(case.model, rank)
        stage = PipelineStage(module, rank, 2, torch.device("cpu"))
        kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
        schedule = kind(stage, n_microbatches=args.microbatches, loss_fn=torch.nn.functional.mse_loss)
        x, y = case.make_batch(args.batch, 1)
        run = (lambda: schedule.step(*x)) if rank == 0 else (lambda: schedule.step(target=y, losses=[]))
        return run, torch.optim.SGD(module.parameters(), lr=1e-3)

    _timed_on_two_ranks(rank, port, queue, build, args.warmup, args.steps)


def _worker_fxsplit(rank: int, port: int, queue: Any, args: argparse.Namespace) -> None:
    """fxsplit.distributed (issue 5), called as its issue describes: compile on every rank."""

    def build(rank: int) -> tuple[Any, Any]:
        import fxsplit.distributed as fxd  # type: ignore[import-not-found]

        case = make_case(args)
        x, y = case.make_batch(args.batch, 1)
        pipe = fxd.compile(lambda: make_case(args).model, case.example_inputs, microbatches=args.microbatches,
                           schedule=args.schedule, loss_fn=case.loss_fn, target=y)  # the loss planned on the last rank
        return (lambda: pipe.train_step(*x, target=y, loss_fn=case.loss_fn)), torch.optim.SGD(list(pipe.parameters()), lr=1e-3)

    _timed_on_two_ranks(rank, port, queue, build, args.warmup, args.steps)


def run_two_processes(worker: Any, args: argparse.Namespace) -> list[float]:
    return spawn_two(worker, args)


# -- predictions and the table ----------------------------------------------------------------
def predictions(built: Built, args: argparse.Namespace) -> dict[str, float]:
    """Predicted step seconds of each variant from the measured cost model."""
    plan, m = built.plan, args.microbatches
    return {"original": built.condensed.graph.total_time_s,
            "local": m * sum(st.compute_s for st in plan.stages),
            "fxsplit-distributed": simulate_plan(plan, args.schedule, m).makespan_s,
            "torch-pipelining": _even_split_step_s(built, args)}


def _even_split_step_s(built: Built, args: argparse.Namespace) -> float:
    """The simulated step of the hand-placed even split (see :func:`_even_split`)."""
    half = args.layers // 2 * 2

    def late(path: str) -> bool:
        return path.startswith("head") or (path.startswith("hidden.") and int(path.split(".")[1]) >= half)

    second = {b for b, paths in built.module_of_block().items() if any(late(p) for p in paths)}
    blocks = range(len(built.condensed.graph))
    stages = [[b for b in blocks if b not in second], sorted(second)]
    plan = evaluate_fixed(built.problem, stages, [0, 1], args.microbatches, args.schedule)
    return simulate_plan(plan, args.schedule, args.microbatches).makespan_s


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> Table:
    t = Table(title=f"training throughput, MLP {args.layers}x{args.width}, batch {args.batch}, "
                    f"{args.microbatches} micro-batches, {args.schedule}, {os.cpu_count()} CPU cores")
    for col in ("variant", "procs x threads", "step ms (median)", "samples/s", "vs (a)", "predicted samples/s", "measured / predicted"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    base = rows[0]["samples_per_s"]
    for r in rows:
        if r.get("skipped"):
            t.add_row(r["variant"], r["procs"], "-", "-", "-", "-", r["skipped"][:60])
            continue
        pred = r.get("predicted_samples_per_s")
        t.add_row(r["variant"], r["procs"], f"{r['step_s'] * 1e3:.2f}", f"{r['samples_per_s']:.1f}",
                  f"{r['samples_per_s'] / base:.2f}x", "-" if pred is None else f"{pred:.1f}",
                  "-" if pred is None else f"{r['samples_per_s'] / pred:.2f}")
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small MLP and 3 steps (smoke test)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--skip-distributed", action="store_true", help="only the one-process variants")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--workload", choices=("mlp", "gpt2"), default="mlp")
    runtime_gpt2.add_arguments(parser)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = console()
    if args.workload == "gpt2":
        main_gpt2(args, out)
        return
    if args.quick:
        args.width, args.layers, args.batch, args.steps, args.warmup = 64, 4, 8, 3, 1
    built = Built(args)
    predicted = predictions(built, args)
    measured: list[tuple[str, str, str, Any]] = [
        ("(a) original, one process", "1 x 1", "original", lambda: run_original(args, 1)),
        ("(a') original, one process, 2 threads", "1 x 2", "", lambda: run_original(args, 2)),
        ("(b) fxsplit local pipeline, 2 stages", "1 x 1", "local", lambda: run_local(args, built, args.out)),
        ("(c) fxsplit.distributed, 2 processes, gloo", "2 x 1", "fxsplit-distributed", lambda: _fxsplit_distributed(args)),
        ("(d) torch.distributed.pipelining, even split, gloo", "2 x 1", "torch-pipelining",
         lambda: run_two_processes(_worker_torch_pp, args)),
    ]
    rows = []
    for name, procs, key, run in measured:
        if args.skip_distributed and procs.startswith("2"):
            rows.append({"variant": name, "procs": procs, "skipped": "--skip-distributed"})
            continue
        with out.status(f"{name} ..."):
            try:
                times = run()
            except SkipVariant as exc:
                rows.append({"variant": name, "procs": procs, "skipped": str(exc)})
                continue
        step = statistics.median(times)
        row = {"variant": name, "procs": procs, "step_s": step, "samples_per_s": args.batch / step, "times_s": times}
        if key:
            row["predicted_step_s"] = predicted[key]
            row["predicted_samples_per_s"] = args.batch / predicted[key]
        rows.append(row)
    show(table(rows, args), out, args.markdown)
    for r in rows:
        if r.get("skipped"):
            out.print(f"note: {r['variant']}: {r['skipped']}")
    plan = [{"blocks": len(st.blocks), "fwd_s": st.fwd_s, "bwd_s": st.bwd_s} for st in built.plan.stages]
    path = write_json(args.out, "runtime", {"env": environment(), "args": {k: v for k, v in vars(args).items() if k != "out"},
                                            "plan": plan, "rows": rows})
    out.print(f"wrote {path} (trace and Gantt chart of (b): {args.out}/runtime-local-*)")


def main_gpt2(args: argparse.Namespace, out: Any) -> None:
    """The GPT-2 workload: defaults of the issue (8 layers, d 512, batch 16 x 128, 8 micro-batches)."""
    defaults = {"width": 512, "layers": 8, "batch": 16, "microbatches": 8, "steps": 3, "warmup": 1}
    if args.quick:
        defaults.update(width=64, layers=2, batch=8, microbatches=4, steps=2, vocab=256, seq=16, rounds=2)
    for key, value in defaults.items():
        if key in ("vocab", "seq", "rounds") or getattr(args, key) == parser_default(key):
            setattr(args, key, value)
    with out.status("GPT-2: eager, torch pipelining and fxsplit.distributed in alternating rounds ..."):
        result = runtime_gpt2.run_gpt2(args)
    show(runtime_gpt2.gpt2_table(result, args), out, args.markdown)
    before, after = result["load"]
    out.print(f"load average (1, 5, 15 min) before {tuple(round(v, 2) for v in before)}, "
              f"after {tuple(round(v, 2) for v in after)}; {os.cpu_count()} cores")
    path = write_json(args.out, "runtime-gpt2", {"env": environment(), "args": {k: v for k, v in vars(args).items()
                                                                                 if k != "out"}, **result})
    out.print(f"wrote {path}")


_DEFAULTS = {"width": 1024, "layers": 8, "batch": 64, "microbatches": 4, "steps": 20, "warmup": 3}


def parser_default(key: str) -> Any:
    """The MLP workload's default of ``--key`` (the GPT-2 workload replaces untouched defaults)."""
    return _DEFAULTS[key]


class SkipVariant(Exception):
    """A variant that cannot run here; the message says why."""


def _fxsplit_distributed(args: argparse.Namespace) -> list[float]:
    if importlib.util.find_spec("fxsplit.distributed") is None:
        raise SkipVariant("fxsplit.distributed does not exist yet (issue 5)")
    try:
        return run_two_processes(_worker_fxsplit, args)
    except Exception as exc:  # its API may differ from issue 5's sketch
        raise SkipVariant(f"fxsplit.distributed failed: {type(exc).__name__}: {exc}") from exc


if __name__ == "__main__":
    main()
