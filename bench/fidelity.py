"""Does the cost model come true? Predicted vs measured time of every stage, before and after calibration.

For each model: ``fxsplit.compile`` on this CPU (1 thread) with a cost model (default the
*profiled* one: every node timed inside whole forward+backward passes at the micro-batch sizes the
schedule search considers, ``t0 + t1 * b`` fitted per node), a fixed stage count, schedule and
micro-batch count; then ``pipe.calibrate`` trains a few steps and reads the runtime trace (the
mean forward and backward time of each stage per micro-batch) against the plan's ``fwd_s`` /
``bwd_s``, refits, re-plans when that pays, and measures again. Ratios are measured / predicted.

The local pipeline runs every action in turn (one process), so its step should take
``m x sum of stage times``: that is the step prediction compared here.

``--ranks 2``: the same models on ``fxsplit.distributed`` (2 processes, gloo on 127.0.0.1, 1
thread each, rank 0 profiles and plans over the measured link): per stage the plan's forward and
backward time per micro-batch against the runtime trace of every rank
(``pipe.stage_times_s()``, medians over the timed steps), and the predicted step
(``pipe.predicted_step_s()``: the plan's simulated step, with schedule, bubble, links and the
runtime's own work per action and message, plus the tied-gradient all-reduces timed at build)
against the wall time of ``train_step``; then
``pipe.calibrate`` (every rank's measured stage times refitted on rank 0, re-planned, the stages
rebuilt across the ranks when that pays) and the same measurement again. "replay" is
the same simulation on the *measured* stage times (plus the tied all-reduces): its error is what
lies outside the stages' compute and the model (the loss, waiting on sends and receives beyond
the probes).

Run: ``python bench/fidelity.py [--quick] [--steps 5] [--cost-model profiled|measured|analytic]
[--ranks 2]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from common import console, join_gloo, show, spawn_two
from plan_quality import environment, write_json
from rich.table import Table

import fxsplit
import fxsplit.models as zoo
from fxsplit.api import CompileOptions

# (name, zoo model, size, overrides, stages, micro-batches, batch)
CASES = [
    ("mlp-small", "mlp", "small", {}, 2, 4, 32),
    ("mlp-small", "mlp", "small", {}, 4, 8, 32),
    ("gpt-small", "gpt", "small", {}, 4, 4, 8),
    ("resnet-small", "resnet", "small", {}, 2, 4, 8),
    ("hf-bert", "hf:bert", "tiny", {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                                    "intermediate_size": 1024, "vocab_size": 2048, "seq_len": 64}, 2, 4, 8),
    ("hf-gpt2", "hf:gpt2", "tiny", {"n_embd": 256, "n_layer": 4, "n_head": 4, "vocab_size": 2048,
                                    "seq_len": 64}, 2, 4, 8),
]
QUICK = [("mlp-tiny", "mlp", "tiny", {}, 2, 2, 4)]
# --only hf-gpt2-8l: bench/runtime.py's GPT-2 workload (8 layers, d 512, vocab 8192, 16 x 128, 8
# micro-batches), ~2 min a run; not in the default set
EXTRA_CASES = [("hf-gpt2-8l", "hf:gpt2", "tiny", {"n_embd": 512, "n_layer": 8, "n_head": 8, "vocab_size": 8192,
                                                  "n_positions": 128, "seq_len": 128}, 2, 8, 16)]
# --device cuda: real-world sizes as well (GPT-2 small's shape, ResNet-18), where kernels, not
# launches, take the time.
GPU_CASES = [*CASES,
             ("gpt-base", "gpt", "base", {}, 4, 4, 32),
             ("resnet-base", "resnet", "base", {}, 4, 4, 64),
             ("mlp-base", "mlp", "base", {}, 4, 4, 256)]


def _rows(rows: Any) -> list[dict[str, float]]:
    return [{"stage": r.stage, "pred_fwd_s": r.pred_fwd_s, "pred_bwd_s": r.pred_bwd_s,
             "meas_fwd_s": r.meas_fwd_s, "meas_bwd_s": r.meas_bwd_s} for r in rows]


def run_case(name: str, model: str, size: str, overrides: dict, p: int, m: int, batch: int,
             steps: int, schedule: str, cost_model: str, device: str = "cpu") -> dict[str, Any]:
    """Compile, calibrate (which measures before and after); per-stage predicted and measured times.
    Every stage on ``device``; on CUDA the actions run in turn too (``executor="sequential"``)."""
    case = zoo.get(model, size=size, batch_size=batch, **overrides)
    options = CompileOptions(allow_idle_devices=False, profile_cache_dir=False, executor="sequential")
    x, y = case.make_batch(batch, 1)
    start = time.perf_counter()
    pipe = fxsplit.compile(case.model.to(device), [device] * p, case.example_inputs, case.example_kwargs or None,
                           microbatches=m, schedule=schedule, cost_model=cost_model, options=options,
                           loss_fn=case.loss_fn, target=y)
    compile_s = time.perf_counter() - start
    report = pipe.calibrate(*x, target=y, loss_fn=case.loss_fn, steps=steps, **(case.example_kwargs or {}))
    return {"name": name, "cost_model": cost_model, "device": device, "stages": p, "microbatches": m, "batch": batch,
            "schedule": schedule, "compile_s": compile_s, "before": _rows(report.before), "after": _rows(report.after),
            "step_before": report.step_before_s, "step_after": report.step_after_s,
            "gains": report.predicted_gains, "replanned": report.replanned}


def _dist_timed(pipe: Any, x: Any, y: Any, loss_fn: Any, kwargs: dict, steps: int, schedule: str
                ) -> dict[str, Any]:
    """``steps`` timed train steps after one warm-up: per-stage medians (every rank's trace), the
    median step wall between barriers, and the schedule replayed on the measured stage times."""
    from fxsplit.schedule import make, simulate

    step_s, per_step = pipe.timed_steps(*x, target=y, loss_fn=loss_fn, steps=steps, **kwargs)
    plan = pipe.running_plan().to_dict()
    stages = [{"stage": s, "pred_fwd_s": st["fwd_s"], "pred_bwd_s": st["bwd_s"],
               "meas_fwd_s": statistics.median(r[s]["fwd_s"] for r in per_step),
               "meas_bwd_s": statistics.median(r[s]["bwd_s"] for r in per_step)}
              for s, st in enumerate(plan["stages"])]
    replay = simulate(make(schedule, len(stages), pipe.microbatches), [r["meas_fwd_s"] for r in stages],
                      [r["meas_bwd_s"] for r in stages], stage_comm_s=[st["comm_s"] for st in plan["stages"]]).makespan_s
    # the plan's step and the all-reduces that end it (pipe.sync_s), as predicted_step_s
    return {"stages": stages, "step": (pipe.predicted_step_s(), statistics.median(step_s)),
            "replay_s": replay + pipe.sync_s}


def _rank_setup(keep_freed: bool) -> None:
    """One thread, and the allocator mode of ``--keep-freed-memory`` (each spawned rank is a fresh
    process: the parent's ``mallopt`` does not reach it)."""
    torch.set_num_threads(1)
    if keep_freed:
        from fxsplit.runtime.host_memory import keep_freed_memory

        keep_freed_memory()


def _dist_worker(rank: int, port: int, queue: Any, case_args: tuple, steps: int, schedule: str,
                 cost_model: str, keep_freed: bool = False) -> None:
    """One rank of the 2-rank fidelity run: compile, time ``steps`` train steps, ``calibrate``
    (which re-plans and rebuilds across the ranks when that pays), time again."""
    import torch.distributed as dist

    import fxsplit.distributed as fxd

    _rank_setup(keep_freed)
    join_gloo(rank, port)
    try:
        name, model, size, overrides, p, m, batch = case_args
        case = zoo.get(model, size=size, batch_size=batch, **overrides)
        x, y = case.make_batch(batch, 1)
        start = time.perf_counter()
        pipe = fxd.compile(lambda: zoo.get(model, size=size, batch_size=batch, **overrides).model, case.example_inputs,
                           case.example_kwargs or None, schedule=schedule, microbatches=m,
                           state_dict=case.model.state_dict(), cost_model=cost_model, timeout_s=300.0,
                           options=CompileOptions(profile_cache_dir=False), loss_fn=case.loss_fn, target=y)
        compile_s = time.perf_counter() - start
        kwargs = case.example_kwargs or {}
        before = _dist_timed(pipe, x, y, case.loss_fn, kwargs, steps, schedule)
        report = pipe.calibrate(*x, target=y, loss_fn=case.loss_fn, steps=steps, **kwargs)
        after = _dist_timed(pipe, x, y, case.loss_fn, kwargs, steps, schedule)
        if rank == 0:
            queue.put({"name": name, "cost_model": pipe.meta.get("cost_model") or cost_model,
                       "stages": p, "microbatches": m, "batch": batch, "schedule": schedule, "compile_s": compile_s,
                       "before": before["stages"], "step": before["step"], "replay_s": before["replay_s"],
                       "after": after["stages"], "step_after": after["step"], "replay_after_s": after["replay_s"],
                       "gains": report.predicted_gains, "replanned": report.replanned,
                       "link_latency_s": report.link_latency_s})
        pipe.close()
    finally:
        dist.destroy_process_group()


def _profiling_worker(rank: int, port: int, queue: Any, case_args: tuple, steps: int, schedule: str,
                      rounds: int, together_first: bool, keep_freed: bool = False) -> None:
    """One rank of ``--compare-profiling``: compile the case twice, once with every rank profiling
    together (``CompileOptions.profile_all_ranks``) and once with rank 0 profiling alone (the
    default), ``together_first`` or not (a process's first profile runs colder than its second),
    then time both pipelines in alternating rounds (no calibrate)."""
    import torch.distributed as dist

    import fxsplit.distributed as fxd

    _rank_setup(keep_freed)
    join_gloo(rank, port)
    try:
        name, model, size, overrides, p, m, batch = case_args
        case = zoo.get(model, size=size, batch_size=batch, **overrides)
        pipes = {}
        for together in (True, False) if together_first else (False, True):
            pipes[together] = fxd.compile(
                lambda: zoo.get(model, size=size, batch_size=batch, **overrides).model, case.example_inputs,
                case.example_kwargs or None, schedule=schedule, microbatches=m, state_dict=case.model.state_dict(),
                timeout_s=300.0, options=CompileOptions(profile_cache_dir=False, profile_all_ranks=together))
        x, y = case.make_batch(batch, 1)
        kwargs = case.example_kwargs or {}
        runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
        for _ in range(rounds):
            for together, pipe in pipes.items():
                runs[together].append(_dist_timed(pipe, x, y, case.loss_fn, kwargs, steps, schedule))
        if rank == 0:
            queue.put({"name": name, "stages": p, "microbatches": m, "batch": batch,
                       "first": "together" if together_first else "alone", **{
                ("together" if k else "alone"): {"profiled_ranks": pipes[k].meta.get("profiled_ranks"),
                                                 "stages": _median_stages(v), "step": _median_step(v)}
                for k, v in runs.items()}})
        for pipe in pipes.values():
            pipe.close()
    finally:
        dist.destroy_process_group()


def _median_stages(runs: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per stage, the median over rounds of each measured time (the prediction is the same)."""
    out = []
    for i, first in enumerate(runs[0]["stages"]):
        row = dict(first)
        for key in ("meas_fwd_s", "meas_bwd_s"):
            row[key] = statistics.median(r["stages"][i][key] for r in runs)
        out.append(row)
    return out


def _median_step(runs: list[dict[str, Any]]) -> tuple[float, float, float]:
    """(predicted step, median measured step, median replay) over rounds."""
    return (runs[0]["step"][0], statistics.median(r["step"][1] for r in runs),
            statistics.median(r["replay_s"] for r in runs))


def profiling_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="2 ranks (gloo), before calibrate: stages profiled by every rank together vs by rank 0 alone; "
                    "error = predicted / measured - 1, medians over alternating rounds")
    for col in ("model", "profiled first", "stage", "together: pred F+B ms", "meas F+B ms", "error",
                "alone: pred F+B ms", "meas F+B ms", "error"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        a, b = r["together"], r["alone"]
        for sa, sb in zip(a["stages"], b["stages"], strict=True):
            cells = []
            for st in (sa, sb):
                pred, meas = st["pred_fwd_s"] + st["pred_bwd_s"], st["meas_fwd_s"] + st["meas_bwd_s"]
                cells += [f"{pred * 1e3:.3f}", f"{meas * 1e3:.3f}", f"{_err(pred, meas):+.1%}"]
            t.add_row(r["name"], r["first"], str(sa["stage"]), *cells)
        cells = []
        for v in (a, b):
            pred, meas, _replay = v["step"]
            cells += [f"{pred * 1e3:.2f}", f"{meas * 1e3:.2f}", f"{_err(pred, meas):+.1%}"]
        t.add_row(r["name"], r["first"], "step", *cells)
        t.add_row(r["name"], r["first"], "median |stage err|", "", "", f"{_median_stage_err(a['stages']):.1%}", "", "",
                  f"{_median_stage_err(b['stages']):.1%}")
    return t


def run_case_distributed(case_args: tuple, steps: int, schedule: str, cost_model: str,
                         keep_freed: bool = False) -> dict[str, Any]:
    """Spawn 2 gloo ranks for one case (its stage count is taken as 2)."""
    case_args = (*case_args[:4], 2, *case_args[5:])
    return spawn_two(_dist_worker, case_args, steps, schedule, cost_model, keep_freed)


def dist_step_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="step time, 2 ranks (gloo): plan's simulated step vs measured train_step, before and after "
                    "calibrate; error = predicted / measured - 1")
    for col in ("model", "p x m", "pred ms", "meas ms", "error", "median |stage err|", "replay error",
                "calibrated: pred ms", "meas ms", "error", "median |stage err|", "replay error", "replanned",
                "latency us: probed / fitted"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        (pb, mb), (pa, ma) = r["step"], r["step_after"]
        t.add_row(r["name"], f"{r['stages']} x {r['microbatches']}", f"{pb * 1e3:.2f}", f"{mb * 1e3:.2f}",
                  f"{_err(pb, mb):+.1%}", f"{_median_stage_err(r['before']):.1%}", f"{_err(r['replay_s'], mb):+.1%}",
                  f"{pa * 1e3:.2f}", f"{ma * 1e3:.2f}", f"{_err(pa, ma):+.1%}", f"{_median_stage_err(r['after']):.1%}",
                  f"{_err(r['replay_after_s'], ma):+.1%}", "yes" if r["replanned"] else "no",
                  "{:.0f} / {:.0f}".format(*(x * 1e6 for x in r["link_latency_s"])))
    return t


def _err(pred: float, meas: float) -> float:
    return pred / meas - 1 if meas > 0 else float("nan")


def stage_table(rows: list[dict[str, Any]], when: str, title: str | None = None) -> Table:
    t = Table(title=title or f"per stage, per micro-batch, {when} calibration: predicted vs measured (runtime trace), ms")
    for col in ("model", "p x m", "stage", "pred F", "meas F", "F err", "pred B", "meas B", "B err",
                "pred F+B", "meas F+B", "F+B err"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        for s in r[when]:
            pf, pb, mf, mb = s["pred_fwd_s"], s["pred_bwd_s"], s["meas_fwd_s"], s["meas_bwd_s"]
            t.add_row(r["name"], f"{r['stages']} x {r['microbatches']}", str(s["stage"]),
                      f"{pf * 1e3:.3f}", f"{mf * 1e3:.3f}", f"{_err(pf, mf):+.1%}", f"{pb * 1e3:.3f}",
                      f"{mb * 1e3:.3f}", f"{_err(pb, mb):+.1%}", f"{(pf + pb) * 1e3:.3f}", f"{(mf + mb) * 1e3:.3f}",
                      f"{_err(pf + pb, mf + mb):+.1%}")
    return t


def step_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="step time (stages in turn, one process): predicted vs measured, error = predicted / measured - 1")
    for col in ("model", "p x m", "pred ms", "meas ms", "error", "median |stage err|", "calibrated: pred ms",
                "meas ms", "error", "median |stage err|", "replanned"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        (pb, mb), (pa, ma) = r["step_before"], r["step_after"]
        t.add_row(r["name"], f"{r['stages']} x {r['microbatches']}", f"{pb * 1e3:.2f}", f"{mb * 1e3:.2f}",
                  f"{_err(pb, mb):+.1%}", f"{_median_stage_err(r['before']):.1%}", f"{pa * 1e3:.2f}",
                  f"{ma * 1e3:.2f}", f"{_err(pa, ma):+.1%}", f"{_median_stage_err(r['after']):.1%}",
                  "yes" if r["replanned"] else "no")
    return t


def _median_stage_err(stages: list[dict[str, float]]) -> float:
    return statistics.median(abs(_err(s["pred_fwd_s"] + s["pred_bwd_s"], s["meas_fwd_s"] + s["meas_bwd_s"]))
                             for s in stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one tiny model, 2 steps")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    parser.add_argument("--cost-model", choices=("profiled", "measured", "analytic"), default="profiled")
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=1,
                        help="1: the local pipeline and calibrate; 2: fxsplit.distributed on 2 gloo ranks")
    parser.add_argument("--device", default="cpu",
                        help="where every stage runs (cpu, cuda:0; with --ranks 1): on CUDA the analytic "
                             "costs are the GPU's preset (h100, a100, ...) and the cases include base sizes")
    parser.add_argument("--only", default="", help="comma-separated case names to run (default: all)")
    parser.add_argument("--compare-profiling", type=int, default=0, metavar="ROUNDS",
                        help="with --ranks 2: compile each case with every rank profiling together and with rank 0 "
                             "alone, time both in ROUNDS alternating rounds, print the stage errors of each")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="fxsplit.runtime.host_memory.keep_freed_memory() first (as the CLI does)")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.compare_profiling and args.ranks != 2:
        parser.error("--compare-profiling compares how the 2 ranks profile: give --ranks 2 as well")
    torch.set_num_threads(1)
    if args.keep_freed_memory:
        from fxsplit.runtime.host_memory import keep_freed_memory

        keep_freed_memory()
    out = console()
    load_before = os.getloadavg()
    rows = []
    cuda = torch.device(args.device).type == "cuda"
    cases = QUICK if args.quick else GPU_CASES if cuda else CASES
    if args.only:
        cases = [c for c in [*cases, *EXTRA_CASES] if c[0] in args.only.split(",")]
    if args.ranks == 2:  # one row per model (the stage count is the world size)
        cases = list({c[0]: c for c in reversed(cases)}.values())[::-1]
    if args.compare_profiling:
        found = []
        for name, model, size, overrides, _p, m, batch in cases:
            for first in (True, False):
                with out.status(f"{name}: profiled together and alone ..."):
                    found.append(spawn_two(_profiling_worker, (name, model, size, overrides, 2, m, batch), args.steps,
                                           args.schedule, args.compare_profiling, first, args.keep_freed_memory))
        show(profiling_table(found), out, args.markdown)
        load_after = os.getloadavg()
        out.print(f"profiled ranks (together / alone): {[(r['together']['profiled_ranks'], r['alone']['profiled_ranks']) for r in found]}; "
                  f"1 thread per rank, {os.cpu_count()} cores; load average (1, 5, 15 min) before "
                  f"{tuple(round(v, 2) for v in load_before)}, after {tuple(round(v, 2) for v in load_after)}")
        return
    for name, model, size, overrides, p, m, batch in cases:
        steps = 2 if args.quick else args.steps
        with out.status(f"{name}: {p if args.ranks == 1 else 2} stages, {m} micro-batches ..."):
            if args.ranks == 2:
                rows.append(run_case_distributed((name, model, size, overrides, p, m, batch), steps, args.schedule,
                                                 args.cost_model, args.keep_freed_memory))
            else:
                rows.append(run_case(name, model, size, overrides, p, m, batch, steps, args.schedule,
                                     args.cost_model, args.device))
    load_after = os.getloadavg()
    if args.ranks == 2:
        for when in ("before", "after"):
            show(stage_table(rows, when, f"per stage, per micro-batch, 2 ranks (gloo), {when} calibrate: plan vs every "
                                         "rank's runtime trace (median over steps), ms"), out, args.markdown)
        show(dist_step_table(rows), out, args.markdown)
    else:
        show(stage_table(rows, "before"), out, args.markdown)
        show(stage_table(rows, "after"), out, args.markdown)
        show(step_table(rows), out, args.markdown)
    where = torch.cuda.get_device_name(torch.device(args.device)) if cuda else "CPU"
    out.print(f"cost model {args.cost_model} on {where}, 1 thread, {os.cpu_count()} cores; load average (1, 5, 15 min) "
              f"before {tuple(round(v, 2) for v in load_before)}, after {tuple(round(v, 2) for v in load_after)}")
    stem = ("fidelity-cuda" if cuda else "fidelity") if args.ranks == 1 else "fidelity-2ranks"
    path = write_json(args.out, stem, {"env": environment(), "threads": 1, "load": [load_before, load_after],
                                             "rows": rows})
    out.print(f"wrote {path}")


if __name__ == "__main__":
    main()
