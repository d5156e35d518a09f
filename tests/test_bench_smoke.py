"""Every bench's ``--quick`` mode runs and writes its JSON (numbers are never asserted)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("bench", "extra"),
    [
        ("plan_quality", []),
        ("plan_speed", []),
        ("fidelity", []),
        ("planning_memory", []),
        ("runtime", []),
        ("soak", []),
        ("hybrid", []),
    ],
)
def test_bench_quick_mode_runs(bench: str, extra: list[str], tmp_path: pathlib.Path) -> None:
    if bench in ("planning_memory", "hybrid"):
        pytest.importorskip("transformers")
    cmd = [sys.executable, str(ROOT / "bench" / f"{bench}.py"), "--quick", "--out", str(tmp_path), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = list(tmp_path.glob(f"{bench}-[0-9]*.json"))
    assert len(written) == 1, proc.stdout[-2000:]
    doc = json.loads(written[0].read_text())
    assert doc["env"]["commit"] is not None and "python" in doc["env"]
