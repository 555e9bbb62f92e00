"""``benchmarks/bench_small.py`` in its short configuration (``--quick``): every cell runs
(one process, two processes, the 8 MiB polling against blocking receiver, the batches of
``put_many`` / ``get_many`` against a loop), the JSON record carries every figure, beside
the memory backend and, when installed, vLLM-Omni's ``SharedMemoryConnector``. No figure
is compared with a target: speed is measured by the script, not asserted in tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.integration._vllm_omni_stubs import vllm_omni_root

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_small_quick(tmp_path):
    out = tmp_path / "small.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_small.py"), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["benchmark"] == "bench_small" and rec["machine"]["cores"]
    backends = {"shm", "memory", "floor"}
    if vllm_omni_root() is not None:
        backends.add("vllm-omni-shm")
    assert set(rec["results"]["one_process"]) == backends
    assert set(rec["results"]["two_process"]) == backends - {"memory", "floor"}
    assert set(rec["results"]["two_process_hot"]) == backends - {"memory", "floor"}
    for cell in [*rec["results"]["one_process"].values(), *rec["results"]["two_process"].values(),
                 *rec["results"]["two_process_hot"].values(),
                 *rec["results"]["big"].values()]:
        assert cell["samples"] > 0 and 0 < cell["p50_us"] <= cell["p99_us"]
    assert set(rec["results"]["big"]) == {"block", "poll"}
    assert set(rec["figures"]) >= {"one_process_shm_p50_us", "two_process_shm_p50_us", "poll_vs_block_ratio"}
    assert "| 1 process put+get_nowait 4 KiB, p50" in proc.stdout and "load average" in proc.stdout
    assert "| same, sender hot between messages, p50" in proc.stdout
    # The batch cells: put_many + get_many against a loop, one and two processes.
    assert set(rec["results"]["batch"]) == {f"{w}_{how}" for w in ("one_process_shm", "one_process_memory",
                                                                   "two_process_shm") for how in ("batch", "loop")
                                            } | {"two_process_shm_put_many"}
    for cell in rec["results"]["batch"].values():
        assert cell["samples"] > 0 and 0 < cell["p50_us"] <= cell["p99_us"]
    assert rec["figures"]["batch_two_process_shm_ratio"] > 0
    assert "| 2 processes shm one-way, p50 |" in proc.stdout


def test_bench_small_interleaved_baseline(tmp_path):
    # The checkout against itself: both children run and report, alternately.
    out = tmp_path / "ab.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_small.py"), "--baseline", ROOT, "--rounds", "2",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(out.read_text().splitlines()[-1])["result"]
    for side in ("this", "baseline"):
        assert rec[side]["bursts"] == 2 and 0 < rec[side]["min_us"] <= rec[side]["median_us"]
        assert rec[f"{side}_module"].startswith(ROOT)
    assert rec["ratio_median"] > 0 and "this / baseline" in proc.stdout
