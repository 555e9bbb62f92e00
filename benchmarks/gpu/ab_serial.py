"""In-run A/B of a sender-side setting on one road of ``bench_serial_gpu.py``.

The same code timed twice moves up to 2x between runs (process pairs, MPS, the VM's
idle states), more than most changes worth measuring. This script keeps one process
pair and alternates a sender-side module attribute between values in blocks of
payloads (``--blocks`` x ``--per``), so both values see the same pair and the same
drift; it prints the p50 of each (the first 3 payloads of every block dropped).

Usage (GPU machine, repository root)::

    python3 benchmarks/gpu/ab_serial.py --road cuda_ipc --sizes 4KiB,1MiB \
        --knob omnilink.connectors.cuda_ipc.connector:HOST_TO_POOL_BYTES=0,65536

``--knob MODULE:ATTR=V1,V2``: Python literals, set in the sender before each payload.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_serial_gpu as B  # noqa: E402

from omnilink._bench.units import parse_sizes  # noqa: E402

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--road", default="shm-ipc"); ap.add_argument("--sizes", default="4KiB")
    ap.add_argument("--knob", required=True)  # module:attr=v1,v2 (python literals)
    ap.add_argument("--blocks", type=int, default=20); ap.add_argument("--per", type=int, default=25)
    ap.add_argument("--src", default="cuda:0"); ap.add_argument("--dst", default="cuda:0")
    a = ap.parse_args()
    import posix_ipc, torch
    spec, vals = a.knob.split("=")
    mod, attr = spec.split(":")
    vals = [ast.literal_eval(v) for v in vals.split(",")]
    m = importlib.import_module(mod)
    torch.cuda.set_device(torch.device(a.src))
    tag = uuid.uuid4().hex[:8]; channel = f"ab-{tag}"; ack_name = f"/omnilink-ab-{tag}"
    ack = posix_ipc.Semaphore(ack_name, posix_ipc.O_CREX, mode=0o600)
    sizes = parse_sizes(a.sizes)
    pool_bytes = max(256 << 20, 2 * max(sizes) + (16 << 20))
    ctx = mp.get_context("spawn"); parent, child = ctx.Pipe()
    proc = ctx.Process(target=B._ol_receiver, args=(a.road, channel, a.dst, pool_bytes, ack_name, child, False), daemon=True)
    proc.start()
    tx = None
    try:
        assert parent.recv() == "ready"
        tx = B._connect(a.road, "sender", channel, a.src, pool_bytes)
        for nbytes in sizes:
            hidden = torch.randn(nbytes // 2, device=a.src).to(torch.bfloat16); torch.cuda.synchronize()
            count = a.blocks * a.per; prefix = f"s{nbytes}-"
            parent.send(("go", prefix, count))
            t0s, which = [], []
            for i in range(count):
                b = i // a.per; v = vals[b % len(vals)]
                setattr(m, attr, v)
                p = B._payload(hidden, i)
                t0s.append(time.perf_counter()); which.append((b % len(vals), i % a.per))
                tx.put(f"{prefix}{i}", p, timeout=60.0)
                ack.acquire(60.0)
            t1s, _ = parent.recv()
            per = {k: [] for k in range(len(vals))}
            for (k, j), x, y in zip(which, t0s, t1s):
                if j >= 3: per[k].append((y - x) * 1e6)
            row = "  ".join(f"{attr}={vals[k]!r}: p50 {statistics.median(v):7.1f} us (p10 {sorted(v)[len(v)//10]:6.1f})" for k, v in per.items())
            print(f"{a.road} {nbytes:>10}  {row}", flush=True)
            del hidden
        parent.send(("stop",)); parent.recv(); proc.join(60)
    finally:
        if tx is not None: tx.close()
        if proc.is_alive(): proc.kill()
        ack.unlink()

if __name__ == "__main__":
    main()
