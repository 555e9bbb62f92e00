"""asyncio ``aput`` + ``aget`` against the synchronous ``put`` + ``get``: 4 KiB latency.

Benchmarks are hard: this is two processes on one machine, whatever else runs on it;
the numbers move by tens of percent between runs on a shared machine. Read the ratio,
re-run on a quiet machine before quoting figures, and always quote the machine record.

What it measures: ping-pong between two processes (``multiprocessing`` spawn,
``torch.set_num_threads(1)`` in both) on two shm channels, a 4 KiB payload (one fp32
tensor of 1,024 elements plus a key) each way. The one-way figure is **RTT / 2**, p50 and
p99 over ROUNDS round trips after WARMUP ones, for:

- ``sync``   ``tx.put`` then ``rx.get`` on both sides (the blocking API);
- ``async``  ``await tx.aput`` then ``await rx.aget`` inside an asyncio event loop on both
  sides: what a serving engine on asyncio pays. ``aput`` hands the put to the
  connector's put thread; ``aget`` waits on the connector's waiter thread and takes the
  payload on the loop: two thread hand-offs per direction more than ``sync``.

Both variants run in the same invocation, alternating, so they see the same machine.

Usage::

    python benchmarks/bench_async.py [--rounds 2000] [--warmup 200] [--repeat 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import omnilink

WAIT = 60.0


def _payload(i: int) -> dict[str, Any]:
    import torch

    return {"seq": i, "x": torch.full((1024,), float(i), dtype=torch.float32)}


def _channels(tag: str) -> tuple[str, str]:
    return f"bench-async-{tag}-ping", f"bench-async-{tag}-pong"


def echo(tag: str, mode: str, total: int) -> None:
    """The far end: take each ping, send it back as the pong."""
    import torch

    torch.set_num_threads(1)
    ping, pong = _channels(tag)
    with omnilink.connect("shm", channel=ping, role="receiver") as rx, \
         omnilink.connect("shm", channel=pong, role="sender", arena_bytes=8 << 20) as tx:
        if mode == "sync":
            for i in range(total):
                got = rx.get(f"p{i}", timeout=WAIT)
                tx.put(f"q{i}", got, timeout=WAIT)
                del got
        else:
            async def loop() -> None:
                for i in range(total):
                    got = await rx.aget(f"p{i}", timeout=WAIT)
                    await tx.aput(f"q{i}", got, timeout=WAIT)
                    del got

            asyncio.run(loop())
        # Stay until the last pong is read: it lives in this process's arena.
        rx.get("bye", timeout=WAIT)


def run(mode: str, rounds: int, warmup: int) -> list[float]:
    """One-way latencies (RTT / 2) in microseconds of ``rounds`` measured round trips."""
    ctx = mp.get_context("spawn")
    tag = f"{os.getpid()}-{mode}-{time.monotonic_ns()}"
    ping, pong = _channels(tag)
    total = warmup + rounds
    payloads = [_payload(i) for i in range(total)]
    out: list[float] = []
    with omnilink.connect("shm", channel=ping, role="sender", arena_bytes=8 << 20) as tx, \
         omnilink.connect("shm", channel=pong, role="receiver") as rx:
        proc = ctx.Process(target=echo, args=(tag, mode, total), daemon=True)
        proc.start()
        try:
            if mode == "sync":
                for i in range(total):
                    t0 = time.perf_counter_ns()
                    tx.put(f"p{i}", payloads[i], timeout=WAIT)
                    got = rx.get(f"q{i}", timeout=WAIT)
                    t1 = time.perf_counter_ns()
                    assert got["seq"] == i
                    del got
                    if i >= warmup:
                        out.append((t1 - t0) / 2e3)
            else:
                async def loop() -> None:
                    for i in range(total):
                        t0 = time.perf_counter_ns()
                        await tx.aput(f"p{i}", payloads[i], timeout=WAIT)
                        got = await rx.aget(f"q{i}", timeout=WAIT)
                        t1 = time.perf_counter_ns()
                        assert got["seq"] == i
                        del got
                        if i >= warmup:
                            out.append((t1 - t0) / 2e3)

                asyncio.run(loop())
            tx.put("bye", {}, timeout=WAIT)
            proc.join(WAIT)
            if proc.exitcode != 0:
                raise RuntimeError(f"echo process exited with {proc.exitcode}")
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each variant, alternating (best p50 is shown)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    runs: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    for _ in range(args.repeat):
        for mode in ("sync", "async"):
            lat = run(mode, args.rounds, args.warmup)
            q = statistics.quantiles(lat, n=100)
            runs[mode].append({"p50_us": statistics.median(lat), "p99_us": q[98]})
            print(f"  {mode}: p50 {runs[mode][-1]['p50_us']:.1f} us", file=sys.stderr)
    best = {mode: min(r, key=lambda x: x["p50_us"]) for mode, r in runs.items()}
    print("\n### shm, 4 KiB one-way latency = ping-pong RTT / 2 (best p50 of "
          f"{args.repeat} runs of {args.rounds} round trips)\n")
    print("| API | p50 us | p99 us | x sync p50 |")
    print("| --- | ---: | ---: | ---: |")
    for mode in ("sync", "async"):
        b = best[mode]
        print(f"| {'put + get' if mode == 'sync' else 'aput + aget'} | {b['p50_us']:.1f} | {b['p99_us']:.1f} | "
              f"{b['p50_us'] / best['sync']['p50_us']:.2f}x |")
    from omnilink._bench.machine import machine_record

    rec = machine_record()
    print(f"\nmachine: {rec.get('cpu')}, {rec.get('cores')} cores, "
          f"{(rec.get('memory_bytes') or 0) / 2**30:.0f} GiB; versions: {rec.get('versions')}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"benchmark": "bench_async", "args": vars(args), "machine": rec, "runs": runs,
                       "best": best}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
