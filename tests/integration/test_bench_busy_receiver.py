"""``benchmarks/bench_busy_receiver.py`` in a short configuration: a row per backend and
busy time, with the sender's put times, and the JSON the performance page reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_busy_receiver_short(tmp_path):
    out = tmp_path / "busy.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_busy_receiver.py"), "--backends", "shm,nixl",
         "--busy-ms", "0,5", "--n", "6", "--gap-ms", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["scenario"] == "busy-receiver" and run["machine"]["cpu"]
    ran = {(r["backend"], r["busy_ms"]) for r in run["rows"]}
    want = {("shm", 0.0), ("shm", 5.0)} | ({("nixl", 0.0), ("nixl", 5.0)} if "nixl" not in run["skipped"] else set())
    assert ran == want, (ran, run["skipped"])
    for r in run["rows"]:
        assert r["n"] == 6 and 0 < r["put_p50_us"] <= r["put_p90_us"] <= r["put_max_us"], r
