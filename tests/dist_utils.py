"""Launch small process groups for the distributed tests: gloo on 127.0.0.1, spawn, free ports.

``launch(worker, world, ...)`` starts ``world`` processes that run ``worker(rank, world, out_dir,
*args)`` with torchrun's environment variables set (so ``fxsplit.distributed`` creates the
process group as under torchrun), waits for all of them with a deadline, kills and reports any
process left behind, and returns each rank's exit code and the object it saved.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, out_dir: str, worker: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    result: Any
    code = 0
    try:
        result = worker(rank, world, out_dir, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result = {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc(),
                  "attrs": {k: getattr(exc, k, None) for k in ("rank", "stage", "microbatch")}}
        code = 1
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    # os._exit skips interpreter teardown: a broken process group must not hang the exit.
    os._exit(code)


def launch(worker: Callable, world: int, out_dir: str | Path, *args: Any, deadline_s: float = 60.0) -> dict[int, Any]:
    """Run ``worker`` on ``world`` ranks; return ``{rank: {"code": exit code, "result": obj}}``.

    Fails the test (AssertionError) when a process is still alive at the deadline, after
    killing it, so no test leaves processes behind.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(_entry, args=(world, free_port(), str(out_dir), worker, args), nprocs=world,
                             join=False, start_method="spawn")
    end = time.monotonic() + deadline_s
    for p in ctx.processes:
        p.join(max(0.0, end - time.monotonic()))
    alive = [p.pid for p in ctx.processes if p.is_alive()]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not alive, f"processes {alive} still running after {deadline_s} s (killed)"
    results = {}
    for rank, p in enumerate(ctx.processes):
        path = out_dir / f"rank{rank}.pkl"
        result = pickle.loads(path.read_bytes()) if path.exists() else None
        results[rank] = {"code": p.exitcode, "result": result}
    return results


def check_ok(results: dict[int, Any]) -> None:
    """Assert every rank exited 0; show the first failing rank's traceback otherwise."""
    for rank, r in results.items():
        res = r["result"]
        detail = res.get("traceback") if isinstance(res, dict) and "traceback" in res else res
        assert r["code"] == 0, f"rank {rank} exited with {r['code']}:\n{detail}"


def printed_differences(text: str) -> tuple[float, float]:
    """``(loss, gradient)``: the largest differences vs the unsplit model a ``fxsplit compile
    --distributed`` summary table printed."""
    import re

    def cell(label: str) -> float:
        found = re.search(label + r"[^│]*│\s*([0-9.e+-]+)", text)
        assert found is not None, f"no {label!r} row in:\n{text}"
        return float(found.group(1))

    return cell("largest loss difference vs original"), cell("largest gradient difference vs original")
