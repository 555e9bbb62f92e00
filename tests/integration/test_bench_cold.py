"""``benchmarks/bench_cold.py`` in a short configuration: every backend runs hot and cold,
the JSON record carries each figure and the floor. No figure is compared with a target:
speed is measured by the script, not asserted in tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.integration._vllm_omni_stubs import vllm_omni_root

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_cold_short(tmp_path):
    out = tmp_path / "cold.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_cold.py"), "--iters", "40", "--trash-mib", "4",
         "--idle-ms", "1", "--idle-iters", "20", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["benchmark"] == "bench_cold" and rec["machine"]["cores"]
    backends = {"shm", "memory", "floor"}
    if vllm_omni_root() is not None:
        backends.add("vllm-omni-shm")
    assert set(rec["results"]) == backends, rec["skipped"]
    for b, r in rec["results"].items():
        for mode, n in (("hot", 40), ("cold", 40), ("idle", 20)):
            cell = r[mode]
            assert cell["samples"] == n, (b, mode)
            assert 0 < cell["put_p50_us"] and 0 < cell["get_p50_us"] and cell["sum_p50_us"] > 0
        assert r["cold_over_hot"] > 0 and r["idle_over_hot"] > 0
    assert "x floor" in proc.stdout and "cold/hot" in proc.stdout and "idle/hot" in proc.stdout
