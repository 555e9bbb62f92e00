"""What a small message costs in a pipeline stage: hot loop against "after a compute step".

A stage of a streaming pipeline computes (matmuls over weights far larger than the CPU's
caches), then sends one small chunk, then computes again. Its ``put`` and the next
stage's ``get`` therefore run with cold caches: instructions, Python objects and
shared-memory lines were evicted by the compute. Microbenchmarks that loop ``put`` +
``get`` back to back (``bench_small.py``) measure the hot figure only; the pipeline
(``omnilink bench pipeline``) shows the cold one. This script measures both, in one
process and one run, for the same payload:

- payload: the thinker's decode-step chunk of ``omnilink bench pipeline`` (a bf16
  ``[1, hidden]`` hidden state, its int64 shape, one int64 token id and a ``meta`` dict
  with a 0-d bool tensor; 4 KiB at hidden 2048);
- modes: ``hot`` (``put`` + ``get_nowait`` back to back), ``cold`` (before each
  message, a step that streams ``--trash-mib`` of float32 through the caches, as a
  stage's compute does; it is not timed) and ``idle`` (before each message the process
  sleeps ``--idle-ms``, as a stage that waits for its next input does; on the 2-core
  KVM machine a put after 10 ms asleep costs several times a hot one, for every
  backend and the floor alike: the CPU's caches and predictors are cold after the
  host ran something else meanwhile);
- backends: omnilink ``shm`` and ``memory``, vLLM-Omni 0.30.0's ``SharedMemoryConnector``
  (when installed; pickle-free msgpack of its own, a fresh segment per message), and a
  *floor*: the fewest Python steps over the same libraries that move the tensors
  (a msgspec header, one ``ctypes.memmove`` per tensor into a shared mapping, a POSIX
  semaphore post; then acquire, header decode, one ``torch.frombuffer`` per tensor). The
  floor has no keys, no allocator, no block lifetime and no validation: it is a lower
  bound, not a competitor.

Prints p50 of ``put`` and of ``get`` (microseconds) per backend and mode, the cold/hot
ratio and each backend against the floor. ``--json FILE`` appends one line.

Usage::

    python benchmarks/bench_cold.py [--iters 1000] [--trash-mib 32] [--hidden 2048] [--json F]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _payload(hb: Any, step: int) -> dict[str, Any]:
    import torch

    return {
        "hidden_states.output": hb,
        "hidden_states.output_shape": torch.tensor(list(hb.shape), dtype=torch.int64),
        "ids.output": torch.tensor([step], dtype=torch.int64),
        "meta": {"finished": torch.tensor(step % 16 == 15)},
    }


class _Floor:
    """The fewest Python steps that move the payload's tensors between two ends."""

    def __init__(self) -> None:
        import msgspec
        import posix_ipc

        self.mm = mmap.mmap(-1, 1 << 20)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.sem = posix_ipc.Semaphore(None, posix_ipc.O_CREX, initial_value=0)
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder()
        self.header = b""

    def put(self, key: str, payload: dict[str, Any]) -> None:
        off = 0
        head = []
        memmove, base = ctypes.memmove, self.base
        for k, t in payload.items():
            if type(t) is dict:
                t = t["finished"]
            n = t.nbytes
            memmove(base + off, t.data_ptr(), n)
            head.append((k, off, n))
            off += (n + 63) & ~63
        self.header = self.enc.encode(head)
        self.sem.release()

    def try_get(self, key: str) -> Any:
        import torch

        self.sem.acquire(0)
        mm = self.mm
        return {k: torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=off) if n else None
                for k, off, n in self.dec.decode(self.header)}

    def close(self) -> None:
        self.sem.unlink()
        self.sem.close()
        # the mapping stays alive as long as tensors built over it do


def _open(backend: str, channel: str) -> tuple[Any, Any]:
    if backend == "floor":
        f = _Floor()
        return f, f
    import bench_small

    tx = bench_small._open(backend, channel, "sender")
    rx = tx if backend == "vllm-omni-shm" else bench_small._open(backend, channel, "receiver")
    return tx, rx


MODES = ("hot", "cold", "idle")


def measure(backend: str, iters: int, trash_mib: int, hidden: int, idle_ms: float = 10.0,
            idle_iters: int = 300) -> dict[str, Any]:
    import torch

    hb = torch.randn(1, hidden).to(torch.bfloat16)
    channel = f"cold{os.getpid()}{backend.replace('-', '')}"
    tx, rx = _open(backend, channel)
    trash = torch.zeros(trash_mib << 18, dtype=torch.float32)
    out: dict[str, Any] = {}
    try:
        for mode in MODES:
            puts: list[int] = []
            gets: list[int] = []
            n = idle_iters if mode == "idle" else iters
            for i in range(n + n // 5):
                if mode == "cold":
                    trash.add_(1.0)
                elif mode == "idle":
                    time.sleep(idle_ms / 1e3)
                p = _payload(hb, i)
                key = f"{mode}{i}"
                t0 = time.perf_counter_ns()
                tx.put(key, p)
                t1 = time.perf_counter_ns()
                got = rx.try_get(key)
                t2 = time.perf_counter_ns()
                del got
                if i >= n // 5:
                    puts.append(t1 - t0)
                    gets.append(t2 - t1)
            out[mode] = {"put_p50_us": statistics.median(puts) / 1e3,
                         "get_p50_us": statistics.median(gets) / 1e3,
                         "sum_p50_us": statistics.median([a + b for a, b in zip(puts, gets)]) / 1e3,
                         "samples": len(puts)}
    finally:
        for c in {id(tx): tx, id(rx): rx}.values():
            c.close()
    out["cold_over_hot"] = out["cold"]["sum_p50_us"] / out["hot"]["sum_p50_us"]
    out["idle_over_hot"] = out["idle"]["sum_p50_us"] / out["hot"]["sum_p50_us"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--iters", type=int, default=1000, help="messages per backend and mode")
    ap.add_argument("--trash-mib", type=int, default=32, help="MiB streamed through the caches before each cold message")
    ap.add_argument("--idle-ms", type=float, default=10.0, help="ms asleep before each idle message")
    ap.add_argument("--idle-iters", type=int, default=300, help="messages per backend in the idle mode")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--backends", default="shm,memory,vllm-omni-shm,floor")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    from omnilink._bench.machine import machine_record

    torch.set_num_threads(1)  # as the pipeline's stages run
    load0 = os.getloadavg()
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for b in args.backends.split(","):
        try:
            results[b] = measure(b, args.iters, args.trash_mib, args.hidden, args.idle_ms, args.idle_iters)
        except ImportError as exc:
            skipped[b] = str(exc)
    load1 = os.getloadavg()

    floor = results.get("floor")
    print(f"{'backend':<15} {'mode':<5} {'put p50':>9} {'get p50':>9} {'sum p50':>9}  x floor")
    for b, r in results.items():
        for mode in MODES:
            m = r[mode]
            vs = f"{m['sum_p50_us'] / floor[mode]['sum_p50_us']:.1f}x" if floor and b != "floor" else ""
            print(f"{b:<15} {mode:<5} {m['put_p50_us']:9.1f} {m['get_p50_us']:9.1f} {m['sum_p50_us']:9.1f}  {vs}")
        print(f"{'':<15} cold/hot {r['cold_over_hot']:.2f}x, idle/hot {r['idle_over_hot']:.2f}x")
    for b, why in skipped.items():
        print(f"{b}: skipped ({why})")
    print(f"payload: decode-step chunk, hidden {args.hidden} bf16; cold: {args.trash_mib} MiB streamed "
          f"before each message; idle: {args.idle_ms:g} ms asleep before each; {args.iters} messages per "
          f"hot and cold cell, {args.idle_iters} per idle cell; microseconds")
    print(f"load average {load0[0]:.2f} before, {load1[0]:.2f} after")
    if args.json:
        rec = {"benchmark": "bench_cold", "iters": args.iters, "trash_mib": args.trash_mib, "hidden": args.hidden,
               "idle_ms": args.idle_ms, "idle_iters": args.idle_iters,
               "results": results, "skipped": skipped, "load_before": load0, "load_after": load1,
               "machine": machine_record()}
        with open(args.json, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
