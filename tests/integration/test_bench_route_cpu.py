"""``benchmarks/bench_route_cpu.py`` in a short run: the flat, route and host rows all
run (the route's payloads really took the device-IPC route over the host double, or the
script fails), land in the JSON and leave /dev/shm clean. No figure is compared with a
target: speed is measured by the script, not asserted in tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_route_cpu_short(tmp_path):
    out = tmp_path / "route.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_route_cpu.py"), "--n", "60",
                           "--json", str(out)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["n"] == 60 and got["size"] == 4096
    assert set(got["rows"]) == {"flat", "route", "general", "host"}
    for name, row in got["rows"].items():
        assert set(row) == {"put_us", "get_us"}, name
        assert all(0 < v < 1e6 for v in row.values()), (name, row)
    assert "route" in proc.stdout and "x the flat steps'" in proc.stdout
