"""Helpers shared by the benches: a wide console, a rich table as Markdown (for README.md), two
gloo ranks on this machine, and two pipeline variants timed from the runtime trace in alternating
rounds."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table


def console() -> Console:
    """A console wide enough for the bench tables, also when the output is a pipe."""
    return Console(width=220)


def markdown(table: Table) -> str:
    """``table`` as a GitHub Markdown table (title as a bold line, caption below)."""
    cols = table.columns
    rows = [[str(c) for c in col._cells] for col in cols]
    lines = [f"**{table.title}**", ""] if table.title else []
    lines.append("| " + " | ".join(str(c.header) for c in cols) + " |")
    lines.append("|" + "|".join("---" for _ in cols) + "|")
    lines.extend("| " + " | ".join(r[i] for r in rows) + " |" for i in range(table.row_count))
    if table.caption:
        lines += ["", str(table.caption)]
    return "\n".join(lines) + "\n"


def show(table: Table, out: Console, as_markdown: bool) -> None:
    """Print ``table`` on ``out``, as Markdown with ``as_markdown``."""
    if as_markdown:
        out.print(markdown(table), markup=False, highlight=False, soft_wrap=True)
    else:
        out.print(table)


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (for the ranks' rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def join_gloo(rank: int, port: int, world: int = 2) -> None:
    """Join the ``world``-rank gloo group on 127.0.0.1:``port`` as ``rank``, with torchrun's variables."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def spawn_two(worker: Any, *args: Any) -> Any:
    """Run ``worker(rank, port, queue, *args)`` in 2 spawned processes; what rank 0 puts on
    ``queue``."""
    return spawn_ranks(2, worker, *args)


def spawn_ranks(world: int, worker: Any, *args: Any) -> Any:
    """Run ``worker(rank, port, queue, *args)`` in ``world`` spawned processes; what rank 0 puts
    on ``queue``."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(free_port(), queue, *args), nprocs=world, join=True)
    return queue.get()


# -- two variants of one pipeline, timed per action from the runtime trace ---------------------
def variant_parser(description: str, microbatches: int) -> argparse.ArgumentParser:
    """The arguments of a bench that compares pipeline variants of zoo models (``--models``,
    ``--size``, ``--batch``, ``--microbatches``, ``--rounds``, ``--steps``, ``--markdown``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", default="gpt,mlp,unet")
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=microbatches)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    return parser


def timed(pipe: Any, case: Any, batch: int, steps: int, into: dict[tuple[int, str], list[float]]) -> None:
    """Run ``steps`` training steps after a warm-up; add each action's seconds to ``into[(stage, kind)]``."""
    inputs, target = case.make_batch(batch, 0)
    for i in range(steps + 1):
        pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
        pipe.zero_grad(set_to_none=True)
        if i:
            for e in pipe.recorder.events:
                into.setdefault((e.stage, e.kind), []).append(e.duration_s)


def alternate(pipes: Mapping[str, Any], case: Any, batch: int, rounds: int,
              steps: int) -> dict[str, dict[tuple[int, str], list[float]]]:
    """Each variant's action seconds by ``(stage, kind)``, the variants alternating round by round
    so that a machine that drifts drifts for all of them."""
    times: dict[str, dict[tuple[int, str], list[float]]] = {k: {} for k in pipes}
    for _ in range(rounds):
        for key, pipe in pipes.items():
            timed(pipe, case, batch, steps, times[key])
    return times


def same_split(a: Any, b: Any) -> bool:
    """Whether two pipelines split the blocks the same way."""
    return [st.blocks for st in a.plan.stages] == [st.blocks for st in b.plan.stages]
