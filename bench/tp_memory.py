"""Peak memory of a tensor-parallel rank while ``fxsplit.distributed.compile`` builds its stage.

Issue 11 ("shard at materialisation"): a rank of a stage split over ``tp`` ranks holds only its
chunk of each split weight. Two gloo ranks (``tensor_parallel=2``, one stage, Megatron's
column/row split) compile an MLP of two ``4096 x 2048`` linears (64 MiB of fp32 weights, all of
them split) from a state dict given as a mapping, from a file (read with ``mmap``), and without
one (the model's own initialisation, one module at a time); "whole stage first" is the
materialisation before this change (every tensor allocated whole, DTensor cuts it after;
``tp_chunks`` patched to split nothing at materialisation), measured in the same run. Each
variant runs in fresh processes, in turn, ``--rounds`` times: the peak anonymous memory a rank
held during ``compile`` (``RssAnon`` sampled every millisecond by a thread) and its peak resident
memory (``VmHWM``, reset through ``/proc/self/clear_refs`` first: it also counts the pages of a
memory-mapped file), each over the value just before, next to the stage's whole weights and the
rank's chunk of them.
Rank 0 also plans: its per-sample check runs the captured graph on stand-in weights (whole),
so rank 1's column is the one that shows what materialising costs.

Run: ``python bench/tp_memory.py [--rounds 2] [--markdown]`` (~1 min; Linux only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
from typing import Any

from common import console, join_gloo, show, spawn_ranks
from rich.table import Table

MiB = 2.0**20
VARIANTS = ("state dict (mapping)", "state dict (mapping), whole stage first", "state dict (file, mmap)",
            "state dict (file, mmap), whole stage first", "no state dict (model's init)",
            "no state dict, whole stage first")
WIDTH, HIDDEN = 2048, 4096


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, WIDTH))


def worker(rank: int, port: int, queue: Any, variant: str, folder: str) -> None:
    import torch
    import torch.distributed as dist

    import fxsplit.dist_build
    import fxsplit.distributed as fxd
    from fxsplit.api import CompileOptions
    from fxsplit.ir import LinkSpec

    torch.set_num_threads(1)
    join_gloo(rank, port)
    state: Any = None
    if not variant.startswith("no state dict"):
        state = _model().state_dict()
        if "file" in variant:
            path = os.path.join(folder, f"mlp-{rank}.pt")
            torch.save(state, path)
            state = path
    if "whole stage first" in variant:
        fxsplit.dist_build.tp_chunks = lambda *a, **k: {}  # type: ignore[assignment]  # materialise every tensor whole
    x = torch.randn(8, WIDTH)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before, anon_before = _status_kib("VmRSS"), _status_kib("RssAnon")
    anon_peak = [anon_before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            anon_peak[0] = max(anon_peak[0], _status_kib("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    pipe = fxd.compile(_model, (x,), microbatches=1, state_dict=state, tensor_parallel=2, replicas=1,
                       tp_strategy="megatron", cost_model="analytic", options=CompileOptions(link=LinkSpec()))
    done.set()
    sampler.join()
    peak = _status_kib("VmHWM")
    local = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
                for p in pipe.parameters())
    whole = sum(p.numel() * p.element_size() for p in _model().parameters())
    rows: list[Any] = [None] * 2
    dist.all_gather_object(rows, {"rank": rank, "peak_mib": (peak - before) / 1024, "local_mib": local / MiB,
                                  "anon_mib": (anon_peak[0] - anon_before) / 1024, "whole_mib": whole / MiB})
    pipe.close()
    if rank == 0:
        queue.put(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    out = console()
    load = os.getloadavg()[0]
    runs: dict[str, list[Any]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            for variant in VARIANTS:  # alternating, each in fresh processes
                runs[variant].append(spawn_ranks(2, worker, variant, folder))
    table = Table(title=f"one stage over tp=2 gloo ranks, MLP {WIDTH}x{HIDDEN}x{WIDTH} fp32; peak resident memory "
                        f"during compile over the memory before it, median of {args.rounds} rounds; load average "
                        f"{load:.2f} before, {os.getloadavg()[0]:.2f} after")
    for col in ("variant", "whole weights (MiB)", "rank's chunk (MiB)", "rank 0 peak anon / resident (MiB)",
                "rank 1 peak anon / resident (MiB)"):
        table.add_column(col)
    for variant, rounds in runs.items():
        first = rounds[0][0]
        cells = [f"{statistics.median(r[rank]['anon_mib'] for r in rounds):.1f} / "
                 f"{statistics.median(r[rank]['peak_mib'] for r in rounds):.1f}" for rank in (0, 1)]
        table.add_row(variant, f"{first['whole_mib']:.1f}", f"{first['local_mib']:.1f}", *cells)
    show(table, out, args.markdown)


if __name__ == "__main__":
    main()
