"""In-run A/B of a sender-side setting on one road of ``bench_serial_gpu.py``.

The same code timed twice moves up to 2x between runs (process pairs, MPS, the VM's
idle states), more than most changes worth measuring. This script keeps one process
pair and alternates a sender-side module attribute between values in blocks of
payloads (``--blocks`` x ``--per``), so both values see the same pair and the same
drift; it prints the p50 of each (the first 3 payloads of every block dropped).

Usage (GPU machine, repository root)::

    python3 benchmarks/gpu/ab_serial.py --road cuda_ipc --sizes 4KiB,1MiB \
        --knob omnilink.connectors.cuda_ipc.connector:HOST_TO_POOL_BYTES=0,65536

``--knob MODULE:ATTR=V1,V2`` (repeatable; all knobs switch together): the values are
Python literals, or ``@MODULE:QUALNAME`` for an object (a function of an older version
of a module, kept in a scratch module, to A/B a code change); ``ATTR`` may be dotted
(``PoolSender.send``). Set in the sender before each payload.
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

def _resolve(ref: str) -> object:
    """``@module:a.b``: the object; anything else: a Python literal."""
    if not ref.startswith("@"):
        return ast.literal_eval(ref)
    mod, qual = ref[1:].split(":")
    obj: object = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _knob(spec: str) -> tuple[object, str, list[object]]:
    """``(owner, attribute, values)`` of one ``--knob``."""
    target, vals = spec.split("=", 1)
    mod, attr = target.split(":")
    owner: object = importlib.import_module(mod)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name, [_resolve(v) for v in vals.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--road", default="shm-ipc")
    ap.add_argument("--sizes", default="4KiB")
    ap.add_argument("--knob", action="append", required=True, help="MODULE:ATTR=V1,V2 (repeatable)")
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--per", type=int, default=25)
    ap.add_argument("--src", default="cuda:0")
    ap.add_argument("--dst", default="cuda:0")
    a = ap.parse_args()
    import posix_ipc
    import torch

    knobs = [_knob(k) for k in a.knob]  # every reference resolved before anything is set
    nvals = len(knobs[0][2])
    if any(len(v) != nvals for _, _, v in knobs):
        raise SystemExit("every --knob needs as many values")
    labels = [",".join(a.knob[j].split("=", 1)[1].split(",")[k] for j in range(len(knobs))) for k in range(nvals)]
    torch.cuda.set_device(torch.device(a.src))
    tag = uuid.uuid4().hex[:8]
    channel, ack_name = f"ab-{tag}", f"/omnilink-ab-{tag}"
    ack = posix_ipc.Semaphore(ack_name, posix_ipc.O_CREX, mode=0o600)
    sizes = parse_sizes(a.sizes)
    pool_bytes = max(256 << 20, 2 * max(sizes) + (16 << 20))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=B._ol_receiver, args=(a.road, channel, a.dst, pool_bytes, ack_name, child, False),
                       daemon=True)
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
                k = (i // a.per) % nvals
                for owner, name, vals in knobs:
                    setattr(owner, name, vals[k])
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
