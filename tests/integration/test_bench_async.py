"""``benchmarks/bench_async.py`` runs end to end in a short configuration (no timing is
asserted: figures come from full runs on a quiet machine)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_bench_async_short_run(tmp_path):
    out = tmp_path / "async.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_async.py"), "--rounds", "30",
                        "--warmup", "5", "--repeat", "1", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| put + get |" in r.stdout and "| aput + aget |" in r.stdout and "machine:" in r.stdout
    rec = json.loads(out.read_text())
    assert set(rec["best"]) == {"sync", "async"}
    assert all(v["p50_us"] > 0 and v["p99_us"] >= v["p50_us"] for v in rec["best"].values())
    assert {"cpu", "cores", "versions"} <= set(rec["machine"])
