"""The nccl connector against raw ``torch.distributed`` send/recv, GPU to GPU.

Benchmarks are hard: this runs two processes (rank 0 on cuda:0 sends, rank 1 on cuda:1
receives) on one machine and reports medians of repeated rounds. In the SAME run, for
each size, it alternates:

- ``raw``       ``torch.distributed.send``/``recv`` of one bf16 tensor of SIZE bytes over
                the default NCCL process group, received into a preallocated tensor (the
                ceiling: no header, no allocation, no flow control);
- ``omnilink``  ``NcclConnector.put``/``get`` of ``{"hidden_states.output": bf16
                tensor, "meta": {...}}``: header on the TCPStore side channel, receive
                into a freshly allocated tensor on cuda:1, ``get`` returns once the data
                has arrived;
- ``omnilink x8`` (256 MiB only) the same bytes as 8 tensors of SIZE/8 (one
                coalesced NCCL group per payload).

Each round moves ``iters`` payloads back to back and is timed on the receiver from a
barrier to the last arrival (``torch.cuda.synchronize``); GB/s = bytes / seconds.

Usage::

    python benchmarks/bench_nccl.py [--sizes 1MiB,64MiB,256MiB] [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any

from omnilink._bench.units import format_size, parse_sizes

COLS = 4096  # bf16 columns: a hidden state of width 4096




def iters_for(nbytes: int) -> int:
    # Enough payloads per round that one round lasts >= ~5 ms even at 400 GB/s.
    return max(10, min(400, (2 << 30) // nbytes))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, ports: tuple[int, int], sizes: list[int], rounds: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    import omnilink

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=2,
        device_id=dev,
    )
    role = "sender" if rank == 0 else "receiver"
    conn = omnilink.connect(
        "nccl", channel="bench/nccl", role=role, device=str(dev), master_port=ports[1], timeout=120.0,
    )
    conn.wait_connected(120.0)
    results = []

    def barrier() -> None:
        dist.barrier(device_ids=[rank])
        torch.cuda.synchronize(dev)

    def raw_round(nbytes: int, n: int) -> float:
        buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
        if rank == 0:
            buf.copy_(torch.randn(nbytes // 2, device=dev).to(torch.bfloat16))
        barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            if rank == 0:
                dist.send(buf, dst=1)
            else:
                dist.recv(buf, src=0)
        torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    seq = [0]

    def conn_round(nbytes: int, n: int, parts: int) -> float:
        rows = nbytes // 2 // COLS // parts
        if rank == 0:
            g = torch.Generator(device=dev).manual_seed(nbytes + parts)
            tensors = [
                torch.randn(rows, COLS, device=dev, generator=g).to(torch.bfloat16) for _ in range(parts)
            ]
        barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            key = f"req{seq[0]}_0_0"
            seq[0] += 1
            if rank == 0:
                payload = {"meta": {"finished": False}}
                if parts == 1:
                    payload["hidden_states.output"] = tensors[0]
                else:
                    payload["hidden_states.parts"] = tensors
                conn.put(key, payload)
            else:
                got = conn.get(key)
                del got
        torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    def check(nbytes: int, parts: int) -> bool:
        """One payload compared bit for bit with what the sender announces by raw send."""
        rows = nbytes // 2 // COLS // parts
        key = f"check{nbytes}-{parts}"
        if rank == 0:
            g = torch.Generator(device=dev).manual_seed(7 + nbytes + parts)
            ts = [torch.randn(rows, COLS, device=dev, generator=g).to(torch.bfloat16) for _ in range(parts)]
            conn.put(key, {"parts": ts})
            for t in ts:
                dist.send(t, dst=1)
            return True
        got = conn.get(key)["parts"]
        ok = True
        for t in got:
            ref = torch.empty_like(t)
            dist.recv(ref, src=0)
            ok = ok and t.device == dev and torch.equal(t.view(torch.int16), ref.view(torch.int16))
        return ok

    try:
        for nbytes in sizes:
            n = iters_for(nbytes)
            variants = [("omnilink", 1)] + ([("omnilink x8", 8)] if nbytes >= (256 << 20) else [])
            ok = check(nbytes, 1) and (check(nbytes, 8) if nbytes >= (256 << 20) else True)
            raw_round(nbytes, 2)  # warm-up
            for _, parts in variants:
                conn_round(nbytes, 2, parts)
            times: dict[str, list[float]] = {"raw": []}
            for name, _ in variants:
                times[name] = []
            for _ in range(rounds):
                times["raw"].append(raw_round(nbytes, n))
                for name, parts in variants:
                    times[name].append(conn_round(nbytes, n, parts))
            if rank == 1:
                for name, ts in times.items():
                    med = statistics.median(ts)
                    results.append({
                        "size": nbytes, "variant": name, "iters": n, "rounds": rounds,
                        "median_s": med, "gbps": nbytes * n / med / 1e9,
                        "all_gbps": [nbytes * n / t / 1e9 for t in ts],
                        "bit_exact": ok,
                    })
        if rank == 1:
            out.put(("results", results))
    except Exception as exc:
        out.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise
    finally:
        conn.close()
        dist.destroy_process_group()


def machine() -> dict[str, Any]:
    import torch

    from omnilink._bench.machine import machine_record

    rec = machine_record()
    rec["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    rec["torch"] = torch.__version__
    rec["cuda"] = torch.version.cuda
    try:
        v = torch.cuda.nccl.version()
        rec["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except (AttributeError, RuntimeError):
        rec["nccl"] = None
    try:
        import subprocess

        rec["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        ).stdout.split("\n")[0].strip() or None
    except (OSError, subprocess.SubprocessError):
        rec["driver"] = None
    rec["env"] = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "NCCL_P2P_DISABLE") if k in os.environ}
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1MiB,64MiB,256MiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="append one JSON object per cell to this file")
    args = ap.parse_args(argv)
    import torch

    if torch.cuda.device_count() < 2:
        print("bench_nccl needs two CUDA devices; this machine has", torch.cuda.device_count(), file=sys.stderr)
        return 2
    sizes = parse_sizes(args.sizes)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = (free_port(), free_port())
    procs = [ctx.Process(target=_worker, args=(r, ports, sizes, args.rounds, q), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        kind, results = q.get(timeout=540)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    if kind == "error":
        print("benchmark failed:", results, file=sys.stderr)
        return 1
    rec = machine()
    raw = {r["size"]: r["gbps"] for r in results if r["variant"] == "raw"}
    print(f"# nccl connector vs raw torch.distributed, {' + '.join(rec['gpus'])}, torch {rec['torch']}, "
          f"NCCL {rec['nccl']}, driver {rec['driver']}")
    print(f"{'size':>9} | {'variant':<12} | {'GB/s':>8} | {'ratio':>6} | bit-exact")
    print(f"{'-' * 9}-+-{'-' * 12}-+-{'-' * 8}-+-{'-' * 6}-+-{'-' * 9}")
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for r in results:
        r["ratio_vs_raw"] = r["gbps"] / raw[r["size"]]
        print(f"{format_size(r['size']):>9} | {r['variant']:<12} | {r['gbps']:8.1f} | {r['ratio_vs_raw']:6.3f} | {r['bit_exact']}")
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps({"scenario": "nccl-vs-raw", "time": stamp, **r, "machine": rec}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
