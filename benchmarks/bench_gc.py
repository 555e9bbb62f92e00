"""What Python's garbage collector costs a stream of payloads, per process, with and
without ``gc.freeze()`` after start-up.

A serving process holds a large heap of long-lived objects (torch alone makes more than
100,000). Every payload a connector moves allocates a few dozen short-lived objects
(the payload's dict and tensors, an envelope, an index entry); the collector runs its
young generation every 700 net allocations, and once enough objects have been promoted
it walks the whole heap: one pause of tens to hundreds of milliseconds, in whichever
``put`` or ``get`` happened to allocate then. ``gc.freeze()`` after start-up (vLLM's
engine does it) moves the start-up heap out of the collector's sight, so those full
collections go through a few objects instead of the whole heap.

Two processes (a sender and a receiver) stream ``--n`` payloads shaped like vLLM-Omni's
thinker chunk (a bf16 hidden state of ``--size`` bytes, 16 int64 token ids, a Python
flag and metadata) over each backend; each process times every collection with
``gc.callbacks``. Rows per backend, process and setting: the wall time per payload,
collections per generation, the collector's time per payload and its longest pause.

Usage (repository root)::

    python benchmarks/bench_gc.py [--backends shm,nccl] [--n 3000] [--size 4KiB] [--json FILE]

``nccl`` runs over gloo on a machine without two GPUs (the CPU test transport), over
NCCL with its tensors on ``cuda:0`` -> ``cuda:1`` where two GPUs are present.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from omnilink._bench.ports import free_ports  # noqa: E402
from omnilink._bench.machine import machine_record  # noqa: E402
from omnilink._bench.units import parse_size  # noqa: E402

BACKENDS = ("shm", "nccl")
WARMUP = 200


class GcClock:
    """Every collection's generation and duration (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, int]] = []
        self._t0 = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        else:
            self.pauses.append((info["generation"], time.perf_counter_ns() - self._t0))

    def summary(self, n: int) -> dict[str, Any]:
        counts = [0, 0, 0]
        for gen, _ns in self.pauses:
            counts[gen] += 1
        total = sum(ns for _g, ns in self.pauses)
        return {"collections": counts, "gc_us_per_payload": total / 1e3 / n,
                "max_pause_ms": max((ns for _g, ns in self.pauses), default=0) / 1e6}


def _connect(backend: str, role: str, channel: str, port: int, device: str | None) -> Any:
    import omnilink

    if backend == "nccl":
        return omnilink.connect("nccl", channel=channel, role=role, rank=0 if role == "sender" else 1,
                                backend="nccl" if device else "gloo", device=device, master_port=port,
                                timeout=120.0)
    return omnilink.connect(backend, channel=channel, role=role, timeout=120.0)


def _side(role: str, backend: str, channel: str, port: int, n: int, size: int, freeze: bool, q: Any,
          done: Any) -> None:
    import gc

    import torch

    gpus = backend == "nccl" and torch.cuda.device_count() >= 2
    device = (f"cuda:{0 if role == 'sender' else 1}") if gpus else None
    if device:
        torch.cuda.set_device(torch.device(device))
    conn = _connect(backend, role, channel, port, device)
    hidden = torch.randn(size // 2, device=device).to(torch.bfloat16)
    ids = torch.arange(16, dtype=torch.int64)

    def stream(first: int, count: int) -> float:
        t0 = time.perf_counter()
        for i in range(first, first + count):
            if role == "sender":
                conn.put(f"k{i}", {"hidden_states.output": hidden, "ids.output": ids + i,
                                   "meta": {"finished": False, "request_id": "req-7", "chunk_id": i}}, timeout=120.0)
            else:
                got = conn.get(f"k{i}", timeout=120.0)
                if got["meta"]["chunk_id"] != i:
                    raise RuntimeError(f"payload {i} arrived wrong")
                del got
        return time.perf_counter() - t0

    try:
        if hasattr(conn, "wait_connected"):
            conn.wait_connected(120.0)
        stream(0, WARMUP)
        gc.collect()
        if freeze:
            gc.freeze()
        clock = GcClock()
        gc.callbacks.append(clock)
        try:
            wall = stream(WARMUP, n)
        finally:
            gc.callbacks.remove(clock)
            if freeze:
                gc.unfreeze()
        q.put(("ok", role, {"wall_us_per_payload": wall * 1e6 / n, "frozen": freeze,
                            "transport": ("nccl" if gpus else "gloo") if backend == "nccl" else backend,
                            **clock.summary(n)}))
    except BaseException as exc:  # reported to the parent
        q.put(("error", role, f"{type(exc).__name__}: {exc}"))
    finally:
        if role == "sender":
            # A sender that closes before its receiver attached takes its payloads with
            # it: it closes once the parent has the receiver's report.
            done.wait(600)
        conn.close()


def run(backend: str, n: int, size: int, freeze: bool) -> dict[str, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    done = ctx.Event()
    channel = f"bench-gc-{os.getpid()}-{backend}-{int(freeze)}"
    (port,) = free_ports(1)
    procs = [ctx.Process(target=_side, args=(role, backend, channel, port, n, size, freeze, q, done), daemon=True)
             for role in ("receiver", "sender")]
    for p in procs:
        p.start()
    out: dict[str, dict[str, Any]] = {}
    try:
        for _ in procs:
            status, role, body = q.get(timeout=600)
            if status != "ok":
                raise RuntimeError(f"bench_gc {backend}: {role}: {body}")
            out[role] = body
    finally:
        done.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: shm, zmq, nccl")
    ap.add_argument("--n", type=int, default=3000, help="payloads timed per run (after %d warm-up)" % WARMUP)
    ap.add_argument("--size", default="4KiB", help="the hidden state's bytes")
    ap.add_argument("--json", help="append one JSON line per row to FILE")
    args = ap.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    bad = [b for b in backends if b not in ("shm", "zmq", "nccl")]
    if bad or args.n < 1:
        print(f"bench_gc: unknown backend(s) {bad}" if bad else "bench_gc: --n must be at least 1", file=sys.stderr)
        return 2
    size = parse_size(args.size)
    machine = machine_record()
    print(f"# bench_gc, {args.n} payloads of a {args.size} hidden state + ids + metadata per run; "
          f"{machine.get('cpu')}, {machine.get('cores')} cores")
    print(f"{'backend':10s} {'gc.freeze':9s} {'process':8s} {'us/payload':>10s} {'gen0/1/2':>12s} "
          f"{'gc us/payload':>13s} {'longest pause ms':>16s}")
    rows = []
    for backend in backends:
        for freeze in (False, True):
            got = run(backend, args.n, size, freeze)
            for role in ("sender", "receiver"):
                r = got[role]
                c = r["collections"]
                print(f"{r['transport']:10s} {'yes' if freeze else 'no':9s} {role:8s} "
                      f"{r['wall_us_per_payload']:10.1f} {'/'.join(map(str, c)):>12s} "
                      f"{r['gc_us_per_payload']:13.2f} {r['max_pause_ms']:16.2f}")
                rows.append({"scenario": "gc", "backend": backend, "process": role, "size": size, "n": args.n,
                             **r, "machine": machine, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    worst = {(r["backend"], r["frozen"]): r["max_pause_ms"] for r in rows}
    for backend in backends:
        a, b = worst.get((backend, False)), worst.get((backend, True))
        if a is not None and b is not None:
            print(f"# {backend}: longest pause {a:.1f} ms without gc.freeze(), {b:.1f} ms with")
    return 0


if __name__ == "__main__":
    sys.exit(main())
