"""In-run A/B of a sender- or receiver-side setting on one road of ``bench_serial_gpu.py``.

The same code timed twice moves up to 2x between runs (process pairs, MPS, the VM's
idle states), more than most changes worth measuring. This script keeps one process
pair and alternates a module attribute of the sender (``--knob``) and/or the receiver
(``--rknob``) between values in blocks of payloads (``--blocks`` x ``--per``), so both
values see the same pair and the same drift; it prints the p50 of each (the first 3
payloads of every block dropped).

Usage (GPU machine, repository root)::

    python3 benchmarks/gpu/ab_serial.py --road cuda_ipc --sizes 4KiB,1MiB \
        --knob omnilink.connectors.devpool.sender:HOST_TO_POOL_BYTES=0,65536

``--knob MODULE:ATTR=V1,V2`` (repeatable; all knobs switch together): the values are
Python literals, or ``@MODULE:QUALNAME`` for an object (a function of an older version
of a module, kept in a scratch module, to A/B a code change); ``ATTR`` may be dotted
(``PoolSender.send``). ``--knob`` is set in the sender before each put, ``--rknob`` in
the receiver before each get (the same schedule; they switch together).
"""

from __future__ import annotations

import argparse
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--road", default="shm-ipc")
    ap.add_argument("--sizes", default="4KiB")
    ap.add_argument("--knob", action="append", default=[], help="sender: MODULE:ATTR=V1,V2 (repeatable)")
    ap.add_argument("--rknob", action="append", default=[], help="receiver: MODULE:ATTR=V1,V2 (repeatable)")
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--per", type=int, default=25)
    ap.add_argument("--src", default="cuda:0")
    ap.add_argument("--dst", default="cuda:0")
    a = ap.parse_args()
    import posix_ipc
    import torch

    specs = a.knob + a.rknob
    if not specs:
        raise SystemExit("give at least one --knob or --rknob")
    knobs = [B.resolve_knob(k) for k in a.knob]  # every reference resolved before anything is set
    nvals = len(B.resolve_knob(specs[0])[2])
    if any(len(spec.split("=", 1)[1].split(",")) != nvals for spec in specs):
        raise SystemExit("every --knob and --rknob needs as many values")
    labels = [",".join(spec.split("=", 1)[1].split(",")[k] for spec in specs) for k in range(nvals)]
    torch.cuda.set_device(torch.device(a.src))
    tag = uuid.uuid4().hex[:8]
    channel, ack_name = f"ab-{tag}", f"/omnilink-ab-{tag}"
    ack = posix_ipc.Semaphore(ack_name, posix_ipc.O_CREX, mode=0o600)
    sizes = parse_sizes(a.sizes)
    pool_bytes = max(256 << 20, 2 * max(sizes) + (16 << 20))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=B._ol_receiver, args=(a.road, channel, a.dst, pool_bytes, ack_name, child, False,
                                                    (), tuple(a.rknob), a.per), daemon=True)
    proc.start()
    tx = None
    try:
        if parent.recv() != "ready":
            raise RuntimeError("receiver did not start")
        tx = B._connect(a.road, "sender", channel, a.src, pool_bytes)
        for nbytes in sizes:
            hidden = torch.randn(nbytes // 2, device=a.src).to(torch.bfloat16)
            torch.cuda.synchronize()
            count = a.blocks * a.per
            prefix = f"s{nbytes}-"
            parent.send(("go", prefix, count))
            t0s, which = [], []
            for i in range(count):
                k = B.set_knobs(knobs, i, a.per) if knobs else (i // a.per) % nvals
                p = B._payload(hidden, i)
                t0s.append(time.perf_counter())
                which.append((k, i % a.per))
                tx.put(f"{prefix}{i}", p, timeout=60.0)
                ack.acquire(60.0)
            t1s, _ = parent.recv()
            per: dict[int, list[float]] = {k: [] for k in range(nvals)}
            for (k, j), x, y in zip(which, t0s, t1s):
                if j >= 3:
                    per[k].append((y - x) * 1e6)
            row = "  ".join(f"[{labels[k]}] p50 {statistics.median(v):7.1f} us (p10 {sorted(v)[len(v) // 10]:6.1f})"
                            for k, v in per.items())
            print(f"{a.road} {nbytes:>10}  {row}", flush=True)
            del hidden
        parent.send(("stop",))
        parent.recv()
        proc.join(60)
    finally:
        B.finish(tx, proc, ack)


if __name__ == "__main__":
    main()
