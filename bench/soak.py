"""Soak the transparency property: thousands of random DAG modules x random valid plans.

Each case (see ``tests/test_pipeline_properties.py::transparency_case``) draws a random DAG module
(linear, layernorm, relu, add, mul, concat, tied linears, in-place relu; skips anywhere, several
outputs), cuts a random linear extension of its blocks into 2-6 stages, picks 1-4 micro-batches and
GPipe or 1F1B, trains one step and checks outputs and every gradient against the unsplit model.
DAG sizes grow with the case number (up to ``--max-nodes``). Seeds are the case numbers, so a
failure is replayed by its seed. A float32 mismatch is replayed in float64: equal there, it is
float rounding (micro-batching changes the order of sums; deep DAGs of products amplify it) and
counted as such; a case that differs in float64 too is a failure. Prints cases/s, the machine's
load, and every failure with its seed; exits 1 when any case failed.

Run: ``python bench/soak.py [--cases 10000] [--max-nodes 40] [--start 0]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from plan_quality import environment, write_json  # noqa: E402
from test_pipeline_properties import transparency_case  # noqa: E402


def _equal_in_float64(seed: int, max_nodes: int, stages: int, m: int, kind: str) -> bool:
    """Replay a case in float64; True when the pipeline then equals the unsplit model."""
    torch.set_default_dtype(torch.float64)
    try:
        transparency_case(seed, max_nodes, stages, m, kind)
        return True
    except AssertionError:
        return False
    finally:
        torch.set_default_dtype(torch.float32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--max-nodes", type=int, default=40)
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument("--quick", action="store_true", help="20 cases")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    cases = 20 if args.quick else args.cases
    load_before = os.getloadavg()
    start = time.perf_counter()
    ran, skipped, failures, rounding = 0, 0, [], []
    for i in range(args.start, args.start + cases):
        rng = random.Random(i)
        max_nodes = 4 + (args.max_nodes - 4) * (i - args.start) // max(1, cases - 1)
        stages, m, kind = rng.randint(2, 6), rng.randint(1, 4), rng.choice(["gpipe", "1f1b"])
        try:
            if transparency_case(i, max_nodes, stages, m, kind):
                ran += 1
            else:
                skipped += 1
        except AssertionError as exc:
            ran += 1
            if _equal_in_float64(i, max_nodes, stages, m, kind):
                rounding.append((i, str(exc).splitlines()[0]))
            else:
                failures.append((i, max_nodes, stages, m, kind, f"AssertionError: {str(exc)[:300]}"))
                traceback.print_exc(limit=3)
        except Exception as exc:  # noqa: BLE001 - every failure is reported with its seed
            failures.append((i, max_nodes, stages, m, kind, f"{type(exc).__name__}: {str(exc)[:300]}"))
            traceback.print_exc(limit=3)
        done = i - args.start + 1
        if done % 500 == 0 or done == cases:
            rate = done / (time.perf_counter() - start)
            print(f"{done}/{cases} cases ({ran} run, {skipped} with one block, {len(rounding)} float32 rounding, "
                  f"{len(failures)} failed), "
                  f"{rate:.1f} cases/s, max_nodes {max_nodes}", flush=True)
    wall = time.perf_counter() - start
    print(f"\n{cases} cases in {wall:.0f} s ({cases / wall:.1f} cases/s): {ran} run, {skipped} skipped "
          f"(one block), {len(rounding)} float32 mismatches equal in float64, {len(failures)} failed; seeds {args.start}..{args.start + cases - 1}, "
          f"DAGs of up to {args.max_nodes} nodes, 2-6 stages, 1-4 micro-batches, GPipe and 1F1B; "
          f"load average before {tuple(round(v, 2) for v in load_before)}, after "
          f"{tuple(round(v, 2) for v in os.getloadavg())}, {os.cpu_count()} cores")
    for seed, nodes, stages, m, kind, err in failures:
        print(f"FAILED seed={seed} max_nodes={nodes} stages={stages} m={m} {kind}: {err}")
    path = write_json(args.out, "soak", {"env": environment(), "cases": cases, "run": ran, "skipped": skipped,
                                         "failures": failures, "float32_rounding": rounding, "wall_s": wall, "start": args.start,
                                         "max_nodes": args.max_nodes, "load": [load_before, os.getloadavg()]})
    print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
