"""Helpers shared by the benches: a wide console, a rich table as Markdown (for README.md), and
two gloo ranks on this machine."""

from __future__ import annotations

import os
import socket
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


def join_gloo(rank: int, port: int) -> None:
    """Join the 2-rank gloo group on 127.0.0.1:``port`` as ``rank``, with torchrun's variables."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)


def spawn_two(worker: Any, *args: Any) -> Any:
    """Run ``worker(rank, port, queue, *args)`` in 2 spawned processes; what rank 0 puts on
    ``queue``."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(free_port(), queue, *args), nprocs=2, join=True)
    return queue.get()
