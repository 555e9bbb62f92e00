"""How long a sleeping process takes to wake: the floor under every hand-off to a stage
that waits for its input.

A pipeline stage that has nothing to do sleeps (omnilink's shm receiver spins briefly,
then sleeps on a POSIX semaphore; vLLM-Omni's stage runners sleep 1 ms between polls).
When the previous stage publishes a chunk, the time until the sleeper runs again is paid
on top of any transport work. On a virtual machine an idle vCPU halts, and waking it
costs more than a context switch. This script measures that floor with nothing of
omnilink: two processes, one posts a POSIX semaphore after ``gap`` ms of busy work (as a
stage computes), the other sleeps in ``sem_acquire`` and takes the CLOCK_MONOTONIC time
when it wakes; the sender's stamp travels in a shared mapping. Optionally ``--busy``
processes spin meanwhile, so the machine's other CPUs are not idle.

Prints, per gap and busy count, the wake-up latency p50 / p90 / p99 (microseconds) and
the sender's ``sem_post`` p50. ``--json FILE`` appends one line.

Usage::

    python benchmarks/bench_wake.py [--gaps 0.5,2,10] [--busy 0,1] [--messages 200] [--json F]
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import struct
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_STAMP = struct.Struct("<Q")


def _sleeper(sem_name: str, shm_name: str, n: int, out: Any) -> None:
    import posix_ipc

    sem = posix_ipc.Semaphore(sem_name)
    shm = posix_ipc.SharedMemory(shm_name)
    mm = mmap.mmap(shm.fd, 64)
    shm.close_fd()
    lat = []
    clock = time.clock_gettime_ns
    mono = time.CLOCK_MONOTONIC
    for _ in range(n):
        sem.acquire()
        lat.append(clock(mono) - _STAMP.unpack_from(mm, 0)[0])
    out.put(lat)
    mm.close()
    sem.close()


def _spin(stop: Any) -> None:
    while not stop.is_set():
        for _ in range(10000):
            pass


def _pct(values: list[int], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(len(v) * q))] / 1e3


def measure(gap_ms: float, busy: int, n: int) -> dict[str, Any]:
    import posix_ipc

    ctx = mp.get_context("spawn")
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    sem = posix_ipc.Semaphore(f"/olwake-{tag}", posix_ipc.O_CREX, 0o600, 0)
    shm = posix_ipc.SharedMemory(f"/olwakem-{tag}", posix_ipc.O_CREX, 0o600, 64)
    mm = mmap.mmap(shm.fd, 64)
    shm.close_fd()
    stop = ctx.Event()
    spinners = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
    out = ctx.Queue()
    p = ctx.Process(target=_sleeper, args=(sem.name, shm.name, n, out), daemon=True)
    posts: list[int] = []
    try:
        for s in spinners:
            s.start()
        p.start()
        time.sleep(0.5)  # the sleeper is waiting on the semaphore
        clock, mono, pc = time.clock_gettime_ns, time.CLOCK_MONOTONIC, time.perf_counter
        for _ in range(n):
            end = pc() + gap_ms / 1e3
            while pc() < end:  # the sender computes
                pass
            _STAMP.pack_into(mm, 0, clock(mono))
            t0 = time.perf_counter_ns()
            sem.release()
            posts.append(time.perf_counter_ns() - t0)
        lat = out.get(timeout=60 + n * gap_ms / 1e3)
        p.join(30)
    finally:
        stop.set()
        for s in spinners:
            s.join(10)
        if p.is_alive():
            p.kill()
        mm.close()
        sem.unlink()
        sem.close()
        shm.unlink()
    return {"gap_ms": gap_ms, "busy": busy, "messages": n, "wake_p50_us": _pct(lat, 0.5),
            "wake_p90_us": _pct(lat, 0.9), "wake_p99_us": _pct(lat, 0.99), "post_p50_us": _pct(posts, 0.5)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--gaps", default="0.5,2,10", help="ms of busy work before each post (comma list)")
    ap.add_argument("--busy", default="0,1", help="spinning processes beside the pair (comma list)")
    ap.add_argument("--messages", type=int, default=200, help="posts per cell")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from omnilink._bench.machine import machine_record

    load0 = os.getloadavg()
    cells = [measure(float(g), int(b), args.messages) for g in args.gaps.split(",") for b in args.busy.split(",")]
    load1 = os.getloadavg()
    print(f"{'gap ms':>7} {'busy':>4} {'wake p50':>9} {'p90':>8} {'p99':>8} {'post p50':>9}  (us)")
    for c in cells:
        print(f"{c['gap_ms']:7g} {c['busy']:4d} {c['wake_p50_us']:9.1f} {c['wake_p90_us']:8.1f} "
              f"{c['wake_p99_us']:8.1f} {c['post_p50_us']:9.1f}")
    print(f"{args.messages} posts per cell; load average {load0[0]:.2f} before, {load1[0]:.2f} after")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"benchmark": "bench_wake", "cells": cells, "load_before": load0,
                                "load_after": load1, "machine": machine_record()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
