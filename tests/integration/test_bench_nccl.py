"""``benchmarks/bench_nccl.py`` in a short configuration over gloo (CPU): every cell runs
(raw send/recv and the connector side by side, the packed variant, the serial consumer
beside raw's serial consumer, the 4 KiB ping-pong),
the payloads are checked bit for bit and the JSON records carry the ratios. No figure is
compared with a target: speed is measured by the script, not asserted in tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_nccl_gloo_short(tmp_path):
    out = tmp_path / "nccl.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_nccl.py"), "--backend", "gloo",
         "--sizes", "64KiB,1MiB", "--rounds", "1", "--iters", "3", "--latency-iters", "5",
         "--timeout", "240", "--profile", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    steps = {r["variant"]: r["steps"] for r in recs if r["scenario"] == "nccl-steps"}
    recs = [r for r in recs if r["scenario"] != "nccl-steps"]
    cells = {(r["size"], r["variant"]): r for r in recs}
    serial = {(n, v) for n in (64 << 10, 1 << 20) for v in ("raw serial", "omnilink serial")}
    assert set(cells) == {
        (64 << 10, "raw"), (64 << 10, "omnilink"),
        (1 << 20, "raw"), (1 << 20, "omnilink"), (1 << 20, "omnilink +16 small"),
        (4096, "latency raw"), (4096, "latency omnilink"),
    } | serial
    for r in recs:
        assert r["scenario"] == "nccl-vs-raw" and r["machine"]["backend"] == "gloo"
        assert r["ratio_vs_raw"] > 0
        if "gbps" in r:
            assert r["bit_exact"] is True and r["gbps"] > 0 and r["iters"] == 3
        else:
            assert 0 < r["p50_us"] <= r["p99_us"] and r["iters"] == 5
    assert cells[(1 << 20, "raw")]["ratio_vs_raw"] == 1.0
    # Serial rows are set beside raw's serial row, the packed row beside its plain row.
    assert cells[(1 << 20, "raw serial")]["ratio_vs_raw"] == 1.0
    small, plain = cells[(1 << 20, "omnilink +16 small")], cells[(1 << 20, "omnilink")]
    assert small["ratio_vs_plain"] == small["gbps"] / plain["gbps"]
    for n in (64 << 10, 1 << 20):
        one = cells[(n, "omnilink serial")]
        assert one["ratio_vs_raw"] == one["gbps"] / cells[(n, "raw serial")]["gbps"]
    assert "| omnilink +16 small" in proc.stdout and "one-way latency" in proc.stdout
    assert "| omnilink serial" in proc.stdout and "vs plain" in proc.stdout
    # --profile: both processes timed their steps (rank 0 sends the streams and pings,
    # rank 1 reads them and answers the pings).
    assert set(steps) == {"steps rank 0", "steps rank 1"}
    for rank, names in (("0", ("_put", "plan_send", "_send_gloo")), ("1", ("read_bell", "_post_one", "_get"))):
        for name in names:
            st = steps[f"steps rank {rank}"][name]
            assert st["calls"] > 0 and st["us_per_call"] > 0, (rank, name, st)


def test_bench_nccl_latency_ab_gloo(tmp_path):
    """``--latency-ab``: a second connector with the options given answers ping-pongs
    interleaved with the first's (row ``latency omnilink-ab``); a bad option is refused."""
    out = tmp_path / "nccl.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_nccl.py"), "--backend", "gloo",
         "--sizes", "64KiB", "--rounds", "1", "--iters", "2", "--latency-iters", "6", "--latency-ab",
         "spin_us=0,inline_bytes=0", "--timeout", "240", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = {r["variant"]: r for r in map(json.loads, out.read_text().splitlines())}
    for name in ("latency raw", "latency omnilink", "latency omnilink-ab"):
        assert recs[name]["iters"] == 6 and recs[name]["p50_us"] > 0
    assert recs["latency omnilink-ab"]["machine"]["connector_ab"] == {"spin_us": 0, "inline_bytes": 0}
    bad = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_nccl.py"), "--backend", "gloo",
         "--latency-ab", "max_window=3"], capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert bad.returncode == 2 and "is not one of" in bad.stderr
