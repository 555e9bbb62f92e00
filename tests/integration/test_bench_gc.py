"""``benchmarks/bench_gc.py`` in a short configuration: both backends run in two
processes with and without ``gc.freeze()``, every row says what the collector did in
each process (a collection per generation is a whole number, its time is not negative),
and the JSON records carry them. No figure is compared with a target."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_gc_short(tmp_path):
    out = tmp_path / "gc.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_gc.py"), "--backends", "shm,nccl", "--n", "50",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["backend"], r["frozen"], r["process"]) for r in rows} == {
        (b, f, p) for b in ("shm", "nccl") for f in (False, True) for p in ("sender", "receiver")
    }
    for r in rows:
        assert r["scenario"] == "gc" and r["n"] == 50 and r["size"] == 4096
        assert len(r["collections"]) == 3 and all(type(c) is int and c >= 0 for c in r["collections"])
        assert r["gc_us_per_payload"] >= 0 and r["max_pause_ms"] >= 0 and r["wall_us_per_payload"] > 0
        assert r["transport"] in (("gloo", "nccl") if r["backend"] == "nccl" else ("shm",))
    assert "longest pause" in proc.stdout


def test_bench_gc_refuses_an_unknown_backend():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gc.py"), "--backends", "tcp"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "unknown backend" in proc.stderr
