"""``benchmarks/bench_serial_gpu.py`` on a GPU: one quick run gives every road and size,
beside the in-process copy and the raw floor of the same run, and a timeline of both
processes. Skipped with a reason on a machine without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from omnilink.connectors import backend_unavailable

pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

_REASON = backend_unavailable("cuda_ipc")


@pytest.mark.skipif(_REASON is not None, reason=f"the cuda_ipc backend is unavailable: {_REASON}")
def test_quick_serial_run_has_every_road_and_a_timeline(tmp_path):
    out = tmp_path / "serial.json"
    r = subprocess.run([sys.executable, "benchmarks/bench_serial_gpu.py", "--sizes", "4KiB,1MiB",
                        "--roads", "raw,shm,cuda_ipc", "--n", "3", "--lat-n", "20", "--json", str(out),
                        "--trace", "shm", "--trace-sizes", "4KiB"],
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "# timeline: shm, 4KiB" in r.stdout and "ShmConnector.put" in r.stdout, r.stdout
    rec = json.loads(out.read_text())
    got = {(row["road"], row["size"]) for row in rec["rows"]}
    assert got == {(road, size) for road in ("raw", "shm", "cuda_ipc") for size in (4096, 1 << 20)}, got
    for row in rec["rows"]:
        assert row["p50_us"] > 0 and row["copy_us"] > 0 and row["target_us"] > row["copy_us"], row
    assert rec["machine"]["src"] == rec["machine"]["dst"] == "cuda:0"


@pytest.mark.skipif(_REASON is not None, reason=f"the cuda_ipc backend is unavailable: {_REASON}")
def test_call_costs_times_every_operation(tmp_path):
    out = tmp_path / "costs.json"
    r = subprocess.run([sys.executable, "benchmarks/gpu/call_costs.py", "--number", "200", "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 24 and all(row["us"] > 0 for row in rows)
    ops = " | ".join(row["op"] for row in rows)
    for name in ("cudaMemcpyAsync 4 KiB", "cudaEventRecord", "CudaDeviceOps.view", "devpool split", "encoded_size"):
        assert name in ops, (name, ops)
