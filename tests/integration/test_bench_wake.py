"""``benchmarks/bench_wake.py`` in a short configuration: every cell is measured, the
JSON record carries it, and no semaphore or segment is left behind. No figure is
compared with a target."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import SHM_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ours() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if "olwake" in n} if os.path.isdir(SHM_DIR) else set()


def test_bench_wake_short(tmp_path):
    out = tmp_path / "wake.jsonl"
    before = _ours()
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_wake.py"), "--gaps", "0.2,1", "--busy", "0,1",
         "--messages", "20", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["benchmark"] == "bench_wake" and rec["machine"]["cores"]
    assert [(c["gap_ms"], c["busy"]) for c in rec["cells"]] == [(0.2, 0), (0.2, 1), (1.0, 0), (1.0, 1)]
    for c in rec["cells"]:
        assert c["messages"] == 20
        assert 0 < c["wake_p50_us"] <= c["wake_p90_us"] <= c["wake_p99_us"] and c["post_p50_us"] > 0
    assert "wake p50" in proc.stdout
    assert _ours() == before  # its semaphore and mapping were unlinked
