"""Benchmark of the ``shm`` backend against a memcpy and against the engines' current
path (pickle into a fresh ``multiprocessing.shared_memory`` segment per message).

Two processes (multiprocessing, spawn) in every measurement:

- throughput: a sender streams 16 MiB bf16 payloads, the receiver gets each one and
  drops it (its tensors are zero-copy views; the consumer's own reads are not timed).
  Steady state: (messages - 1) * bytes / (time of the last get - time of the first get),
  both taken in the receiver.
- latency: ping-pong of a 4 KiB payload over two channels; the one-way latency of a
  round trip is half of it (put + wake-up + get, each way).
- memcpy: ``dst.copy_(src)`` of the same 16 MiB with torch on one thread, in this run.
- baseline: ``pickle.dumps(payload, protocol=5)`` (in-band), a fresh ``SharedMemory``
  created and written by the sender, attached, read, unlinked and unpickled by the
  receiver (pickle appears here only, never in omnilink).

Benchmarks are hard: this machine may be shared, and two processes on two cores fight
with everything else. Repeat runs; compare numbers only from the same machine and run.

Usage::

    python benchmarks/bench_shm.py [--messages 100] [--pings 2000] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

MiB = 1 << 20
BIG = 16 * MiB
SMALL = 4096


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import numpy
    import torch

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1) if mem else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "platform": platform.platform(),
    }


def _big_payload():
    import torch

    return {"hidden_states.output": torch.randn(BIG // 2).to(torch.bfloat16), "meta": {"finished": False}}


def _small_payload():
    import torch

    return {"codes.audio": torch.arange(SMALL // 2, dtype=torch.int16), "meta": {"finished": False}}


# ----------------------------------------------------------------- omnilink side
def _omni_receiver(channel: str, count: int, q) -> None:
    import torch

    import omnilink

    torch.set_num_threads(1)
    with omnilink.connect("shm", channel=channel, role="receiver", timeout=60) as rx:
        q.put("ready")
        stamps = []
        for i in range(count):
            got = rx.get(f"k{i}")
            stamps.append(time.perf_counter())
            del got
        q.put(stamps)


def omni_throughput(messages: int, warmup: int) -> float:
    import torch

    import omnilink

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    channel = f"bench/tput-{os.getpid()}"
    payload = _big_payload()
    total = warmup + messages
    with omnilink.connect("shm", channel=channel, role="sender", timeout=60) as tx:
        p = ctx.Process(target=_omni_receiver, args=(channel, total, q), daemon=True)
        p.start()
        try:
            assert q.get(timeout=120) == "ready"
            for i in range(total):
                tx.put(f"k{i}", payload)
            stamps = q.get(timeout=300)[warmup:]
            p.join(60)
        finally:
            if p.is_alive():
                p.kill()
    nbytes = omnilink.encoded_size(payload)
    return (len(stamps) - 1) * nbytes / (stamps[-1] - stamps[0])


def _omni_echo(ping: str, pong: str, count: int, q) -> None:
    import omnilink

    with omnilink.connect("shm", channel=ping, role="receiver", timeout=60) as rx, \
            omnilink.connect("shm", channel=pong, role="sender", arena_bytes=16 * MiB, timeout=60) as tx:
        q.put("ready")
        for i in range(count):
            got = rx.get(f"p{i}")
            tx.put(f"p{i}", got)
            del got


def omni_latency(pings: int, warmup: int) -> list[float]:
    import omnilink

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ping, pong = f"bench/ping-{os.getpid()}", f"bench/pong-{os.getpid()}"
    payload = _small_payload()
    total = warmup + pings
    rtts = []
    with omnilink.connect("shm", channel=ping, role="sender", arena_bytes=16 * MiB, timeout=60) as tx, \
            omnilink.connect("shm", channel=pong, role="receiver", timeout=60) as rx:
        p = ctx.Process(target=_omni_echo, args=(ping, pong, total, q), daemon=True)
        p.start()
        try:
            assert q.get(timeout=120) == "ready"
            for i in range(total):
                t0 = time.perf_counter()
                tx.put(f"p{i}", payload)
                got = rx.get(f"p{i}")
                rtts.append(time.perf_counter() - t0)
                del got
            p.join(60)
        finally:
            if p.is_alive():
                p.kill()
    return [r / 2 for r in rtts[warmup:]]


# ------------------------------------------------------------------ the baseline
def _pickle_receiver(conn, count: int) -> None:
    import pickle
    from multiprocessing import resource_tracker, shared_memory

    conn.send("ready")
    stamps = []
    for _ in range(count):
        name, n = conn.recv()
        shm = shared_memory.SharedMemory(name=name)
        try:
            obj = pickle.loads(bytes(shm.buf[:n]))
        finally:
            shm.close()
            shm.unlink()  # also unregisters it from this process's resource tracker
        stamps.append(time.perf_counter())
        conn.send("ack") if obj is None else None
        del obj
    conn.send(stamps)


def _pickle_send(conn, payload) -> None:
    import pickle
    from multiprocessing import resource_tracker, shared_memory

    data = pickle.dumps(payload, protocol=5)
    shm = shared_memory.SharedMemory(create=True, size=len(data))
    shm.buf[: len(data)] = data
    name = shm.name
    shm.close()
    resource_tracker.unregister(shm._name, "shared_memory")  # the receiver unlinks it
    conn.send((name, len(data)))


def pickle_throughput(messages: int, warmup: int) -> float:
    import omnilink

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    payload = _big_payload()
    total = warmup + messages
    p = ctx.Process(target=_pickle_receiver, args=(b, total), daemon=True)
    p.start()
    try:
        assert a.recv() == "ready"
        for _ in range(total):
            _pickle_send(a, payload)
        stamps = a.recv()[warmup:]
        p.join(60)
    finally:
        if p.is_alive():
            p.kill()
    return (len(stamps) - 1) * omnilink.encoded_size(payload) / (stamps[-1] - stamps[0])


def memcpy_bandwidth(reps: int = 30) -> float:
    import torch

    torch.set_num_threads(1)
    src = torch.randint(0, 255, (BIG,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return BIG / statistics.median(times)


# ----------------------------------------------------------------------- report
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=100, help="16 MiB payloads timed (default 100)")
    ap.add_argument("--baseline-messages", type=int, default=20, help="pickle baseline payloads timed")
    ap.add_argument("--pings", type=int, default=2000, help="4 KiB round trips timed (default 2000)")
    ap.add_argument("--json", metavar="PATH", help="append the results as one JSON line to PATH")
    args = ap.parse_args(argv)

    info = machine()
    memcpy = memcpy_bandwidth()
    shm = omni_throughput(args.messages, 5)
    base = pickle_throughput(args.baseline_messages, 2)
    lat = sorted(omni_latency(args.pings, 200))
    p50 = lat[len(lat) // 2] * 1e6
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6
    rows = [
        ("16 MiB bf16, shm throughput (GB/s)", shm / 1e9, memcpy / 1e9, "memcpy 1 thread", shm / memcpy, ">= 0.7"),
        ("16 MiB bf16, shm throughput (GB/s)", shm / 1e9, base / 1e9, "pickle + fresh SharedMemory", shm / base, ">= 30"),
        ("4 KiB one-way latency p50 (us)", p50, None, "half a ping-pong", None, "<= 25"),
        ("4 KiB one-way latency p99 (us)", p99, None, "half a ping-pong", None, "<= 200"),
    ]
    print(f"machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, "
          f"Python {info['python']}, torch {info['torch']}, numpy {info['numpy']}")
    print("benchmarks are hard: a shared or loaded machine moves these numbers; repeat them.\n")
    print(f"| {'measurement':38} | {'omnilink':>9} | {'baseline':>9} | {'baseline is':28} | {'ratio':>7} | target |")
    print(f"|{'-' * 40}|{'-' * 11}|{'-' * 11}|{'-' * 30}|{'-' * 9}|--------|")
    for name, value, ref, what, ratio, target in rows:
        ref_s = f"{ref:9.2f}" if ref is not None else f"{'':>9}"
        ratio_s = f"{ratio:7.2f}" if ratio is not None else f"{'':>7}"
        print(f"| {name:38} | {value:9.2f} | {ref_s} | {what:28} | {ratio_s} | {target:6} |")
    result = {
        "benchmark": "bench_shm",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": info,
        "memcpy_gbps": memcpy / 1e9,
        "shm_gbps": shm / 1e9,
        "pickle_shm_gbps": base / 1e9,
        "ratio_vs_memcpy": shm / memcpy,
        "ratio_vs_pickle": shm / base,
        "latency_4k_p50_us": p50,
        "latency_4k_p99_us": p99,
        "latency_method": "ping-pong round trip / 2",
        "messages": args.messages,
        "pings": args.pings,
    }
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
