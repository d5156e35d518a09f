"""The GPT-2 workload of ``bench/runtime.py``: eager vs torch's pipelining vs fxsplit.distributed.

Hugging Face ``GPT2LMHeadModel`` (default 8 layers, d 512, vocab 8192, tied embeddings), batch
16 x 128 tokens, 8 micro-batches, 2 ranks with gloo, 1 thread per process, SGD step included:

* eager: the whole model in one process (rank 0; rank 1 waits);
* ``torch.distributed.pipelining``: the even hand split people write (4 layers per rank, the LM
  head and final norm on the last), manual ``PipelineStage`` s, GPipe and 1F1B;
* ``fxsplit.distributed.compile`` with its own plan, GPipe and 1F1B.

All variants live in the same two processes and run in rounds, each round timing every variant
in turn (``--steps`` steps each after a warm-up in the first round), so a change of load on this
shared machine hits them alike. The table gives median step time, samples/s, the ratio to
eager and to torch's pipelining, and the machine's load average before and after.

Run: ``python bench/runtime.py --workload gpt2 [--quick] [--rounds 3 --steps 3]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common import join_gloo, spawn_two
from rich.table import Table


def gpt2_config(args: argparse.Namespace) -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64, vocab_size=args.vocab,
                      n_positions=args.seq, use_cache=False, bos_token_id=0, eos_token_id=0,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(gpt2_config(args)).train()


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits: Any, target: torch.Tensor) -> torch.Tensor:
    logits = logits.logits if hasattr(logits, "logits") else logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class _Embed(torch.nn.Module):
    def __init__(self, model: Any, blocks: list[Any]) -> None:
        super().__init__()
        self.wte, self.wpe, self.h = model.transformer.wte, model.transformer.wpe, torch.nn.ModuleList(blocks)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.h:
            h = block(h)
        return h


class _Head(torch.nn.Module):
    def __init__(self, model: Any, blocks: list[Any]) -> None:
        super().__init__()
        self.h, self.ln_f = torch.nn.ModuleList(blocks), model.transformer.ln_f
        self.lm_head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
        self.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied copy

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            h = block(h)
        return self.lm_head(self.ln_f(h))


def _variant_torch_pp(args: argparse.Namespace, rank: int, kind: str) -> tuple[Callable[[], None], Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    model = build_model(args)
    half = args.layers // 2
    module = _Embed(model, list(model.transformer.h[:half])) if rank == 0 else _Head(model, list(model.transformer.h[half:]))
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(stage, n_microbatches=args.microbatches, loss_fn=lm_loss)
    x, y = batch(args)
    run = (lambda: schedule.step(x)) if rank == 0 else (lambda: schedule.step(target=y, losses=[]))
    return run, torch.optim.SGD(module.parameters(), lr=1e-4)


def _variant_fxsplit(args: argparse.Namespace, rank: int, kind: str) -> tuple[Callable[[], None], Any]:
    import fxsplit.distributed as fxd

    x, y = batch(args)
    pipe = fxd.compile(lambda: build_model(args), (x,), schedule=kind, microbatches=args.microbatches,
                       timeout_s=600.0, loss_fn=lm_loss, target=y)  # the loss planned on the last rank
    if rank == 0:  # the plan's simulated step (the loss in it) and the all-reduces that end it, as every rank agreed
        _PREDICTED[f"fxsplit {kind}"] = pipe.predicted_step_s()
    return (lambda: pipe.train_step(x, target=y, loss_fn=lm_loss)), torch.optim.SGD(list(pipe.parameters()), lr=1e-4)


def _variant_eager(args: argparse.Namespace, rank: int) -> tuple[Callable[[], None], Any]:
    model = build_model(args)
    x, y = batch(args)
    if rank != 0:
        return (lambda: None), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    return (lambda: lm_loss(model(x), y).backward()), torch.optim.SGD(model.parameters(), lr=1e-4)


_PREDICTED: dict[str, float] = {}


def _worker(rank: int, port: int, queue: Any, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    join_gloo(rank, port)
    try:
        variants: dict[str, tuple[Callable[[], None], Any]] = {"eager, 1 process": _variant_eager(args, rank)}
        for kind in ("gpipe", "1f1b"):
            variants[f"torch pipelining, even split, {kind}"] = _variant_torch_pp(args, rank, kind)
            variants[f"fxsplit.distributed, {kind}"] = _variant_fxsplit(args, rank, kind)
        times: dict[str, list[float]] = {name: [] for name in variants}
        load_before = os.getloadavg()
        for rnd in range(args.rounds):
            for name, (run, opt) in variants.items():
                for i in range(args.steps + (args.warmup if rnd == 0 else 0)):
                    dist.barrier()
                    start = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    run()
                    opt.step()
                    dist.barrier()
                    if rnd > 0 or i >= args.warmup:
                        times[name].append(time.perf_counter() - start)
        if rank == 0:
            queue.put({"times": times, "predicted": dict(_PREDICTED), "load": [load_before, os.getloadavg()]})
    finally:
        dist.destroy_process_group()


def run_gpt2(args: argparse.Namespace) -> dict[str, Any]:
    """Spawn the two ranks, run every variant in alternating rounds, return rank 0's times."""
    return spawn_two(_worker, args)


def gpt2_table(result: dict[str, Any], args: argparse.Namespace) -> Table:
    t = Table(title=f"training throughput, HF GPT-2 {args.layers} layers d{args.width} vocab {args.vocab}, batch "
                    f"{args.batch} x {args.seq}, {args.microbatches} micro-batches, 2 ranks gloo, 1 thread each")
    for col in ("variant", "step ms (median)", "samples/s", "vs eager", "vs torch pipelining (same schedule)",
                "predicted step ms"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    med = {name: statistics.median(ts) for name, ts in result["times"].items()}
    eager = med["eager, 1 process"]
    for name, step in med.items():
        kind = name.rsplit(", ", 1)[-1]
        ref = med.get(f"torch pipelining, even split, {kind}")
        pred = result["predicted"].get(f"fxsplit {kind}") if name.startswith("fxsplit") else None
        t.add_row(name, f"{step * 1e3:.1f}", f"{args.batch / step:.1f}", f"{eager / step:.2f}x",
                  f"{ref / step:.2f}x" if ref and name.startswith("fxsplit") else "-",
                  f"{pred * 1e3:.1f}" if pred else "-")
    return t


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
