"""``benchmarks/trace_nccl.py`` over gloo (CPU): both ranks' steps are recorded on the
host's one clock (every event lies inside the parent's own start and end readings of
``perf_counter_ns``), the ping-pong phases and the streaming phases are summarised for
both ranks, and the merged timeline interleaves them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_trace_nccl_gloo_short(tmp_path):
    t_start = time.perf_counter_ns()
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "trace_nccl.py"), "--backend", "gloo", "--n", "12",
         "--pause-ms", "1", "--streams", "64KiB,64KiB+16", "--stream-n", "6", "--out", str(tmp_path),
         "--timeout", "240"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    t_end = time.perf_counter_ns()
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for phase in ("pp_nopause", "pp_pause"):
        assert f"== {phase}: one-way p50" in out, out
    # One shape every exchange: after the first two, sent by a template (the default).
    for step in ("rank 0 _put", "rank 0 wire.send_by_template", "rank 1 _post_one", "rank 1 wire.read_bell",
                 "rank 1 _get"):
        assert step in out, step
    # The merged timeline: rank 0's put, and rank 1 posting it (on its get's thread, or
    # on the keeper's when the get came late).
    assert "r0 main   _put" in out and re.search(r"r1 (main|thread) +_post_one", out), out
    for phase in ("stream 65536", "stream 65536 +16"):
        for rank in (0, 1):
            assert f"== {phase}, rank {rank}:" in out, (phase, rank)
    traces = [json.loads((tmp_path / f"trace{r}.json").read_text()) for r in (0, 1)]
    for t in traces:
        assert t["ev"] and set(t["phases"]) == {"pp_nopause", "pp_pause", "stream 65536", "stream 65536 +16"}
        for _name, _tid, t0, t1 in t["ev"]:
            assert t_start <= t0 <= t1 <= t_end  # one clock for the parent and both ranks
