"""The ``cuda_ipc`` backend against its ceilings and the other roads, side by side in one run.

Two processes per measurement (spawned; a sender and a receiver), bf16 payloads
``{"hidden_states.output": tensor, "meta": {...}}``. Cases:

- ``same GPU`` (cuda:0 -> cuda:0), always:
  ``copy_ (local)``  an in-process device-to-device ``dst.copy_(src)`` on cuda:0 (ceiling);
  ``raw IPC floor``  the same two-process topology with nothing of omnilink: a pool the
                     receiver exported once, one ``cudaMemcpyAsync`` + interprocess event
                     per payload, POSIX semaphores for the hand-off, cuda-python only (two
                     processes time-slicing one GPU pay its context switches here too);
  ``cuda_ipc``       this backend, two processes;
  ``shm (host)``     the shm backend's host path: DMA into the arena, ``get(device=)``.
- ``cuda:0 -> cuda:1``, with two GPUs:
  ``copy_ (peer)``   an in-process peer ``dst.copy_(src)`` from cuda:0 to cuda:1 (ceiling);
  ``cuda_ipc``       sender on cuda:0, the receiver's pool on cuda:1 (peer copy);
  ``shm (host)``     as above across the two GPUs;
  ``nccl``           the nccl connector, rank 0 on cuda:0, rank 1 on cuda:1.

Throughput: each round the sender puts ``iters`` payloads back to back (several in flight:
the cuda_ipc pool holds ``--inflight`` of them) and the receiver gets each and drops it;
a round is timed on the receiver from a shared barrier to its last ``get`` plus
``torch.cuda.synchronize()``; GB/s = bytes / seconds, median over ``--rounds``.
Latency: a 4 KiB payload ping-pongs between the two processes (the echo is the received
view itself, so each leg is a real device copy); the pinger synchronizes its stream after
each pong; one-way p50 = median RTT / 2. The same ping-pong with 4 KiB *host* tensors over
the shm backend (``shm, host tensors``) times the control path alone (header, keys, block,
wake-up: no device copy, no CUDA call), which carries cuda_ipc's descriptors too: no
device road through it can be faster than that row on the same machine.

Usage (on the GPU machine, from the repository root)::

    python3 benchmarks/bench_cuda_ipc.py [--sizes 256MiB,64MiB,1MiB] [--rounds 5]
        [--inflight 4] [--latency-iters 2000] [--json FILE] [--quick] [--latency-only]

Targets (issue): same GPU 256 MiB >= 0.8x ``copy_ (local)``; 4 KiB p50 <= 60 us;
cross-GPU >= 0.8x ``copy_ (peer)`` and >= the nccl connector.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from typing import Any

from omnilink._bench.units import format_size, parse_sizes
from omnilink.connectors.devpool.ops import _handle_bytes  # the 64 raw bytes of a CUDA IPC handle

LAT_BYTES = 4096


def iters_for(nbytes: int, quick: bool) -> int:
    n = max(8, min(200, (2 << 30) // nbytes))
    return min(n, 8) if quick else n


def free_port() -> int:
    from omnilink._bench.ports import free_ports

    return free_ports(1)[0]


def _connect(backend: str, role: str, channel: str, dev: str, opts: dict[str, Any]) -> Any:
    import omnilink

    if backend == "cuda_ipc":
        extra = {"device": dev, "pool_bytes": opts["pool_bytes"]} if role == "receiver" else {"linger": 5.0}
        return omnilink.connect("cuda_ipc", channel=channel, role=role, timeout=120.0, **extra)
    if backend in ("shm", "shm-host"):
        # The host-staged road (the shm connector would otherwise pick device IPC itself).
        extra = {"arena_bytes": opts["arena_bytes"]} if role == "sender" else {}
        return omnilink.connect("shm", channel=channel, role=role, timeout=120.0, device_ipc="off", **extra)
    if backend == "nccl":
        conn = omnilink.connect("nccl", channel=channel, role=role, device=dev,
                                master_port=opts["master_port"], timeout=120.0)
        conn.wait_connected(120.0)
        return conn
    raise ValueError(backend)


def _throughput_worker(backend: str, role: str, dev: str, channel: str, sizes: list[int], rounds: int,
                       quick: bool, opts: dict[str, Any], barrier: Any, out: Any) -> None:
    try:
        import torch

        torch.cuda.set_device(torch.device(dev))
        conn = _connect(backend, role, channel, dev, opts)
        results = []
        seq = 0
        try:
            for nbytes in sizes:
                n = iters_for(nbytes, quick)
                src = None
                if role == "sender":
                    g = torch.Generator(device=dev).manual_seed(nbytes)
                    src = torch.randn(nbytes // 2, device=dev, generator=g).to(torch.bfloat16)
                times = []
                for r in range(rounds + 1):  # round 0: warm-up
                    barrier.wait(timeout=300)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        key = f"p{seq}"
                        seq += 1
                        if role == "sender":
                            conn.put(key, {"hidden_states.output": src, "meta": {"finished": False}})
                        else:
                            got = conn.get(key, device=dev if backend == "shm" else None)
                            del got
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    if r:
                        times.append(dt)
                if role == "receiver":
                    med = statistics.median(times)
                    results.append({"size": nbytes, "iters": n, "rounds": rounds, "median_s": med,
                                    "gbps": nbytes * n / med / 1e9,
                                    "all_gbps": [nbytes * n / t / 1e9 for t in times]})
            barrier.wait(timeout=300)
        finally:
            conn.close()
        if role == "receiver":
            out.put(("ok", results))
    except BaseException as exc:
        out.put(("error", f"{backend} {role} on {dev}: {type(exc).__name__}: {exc}"))
        raise


def _latency_worker(backend: str, side: str, dev: str, channels: tuple[str, str], iters: int,
                    opts: dict[str, Any], out: Any) -> None:
    """side "ping": sender on channels[0], receiver on channels[1]; "pong": the reverse."""
    try:
        import torch

        torch.cuda.set_device(torch.device(dev))
        if side == "ping":
            rx = _connect(backend, "receiver", channels[1], dev, opts)
            tx = _connect(backend, "sender", channels[0], dev, opts)
        else:
            rx = _connect(backend, "receiver", channels[0], dev, opts)
            tx = _connect(backend, "sender", channels[1], dev, opts)
        get_dev = dev if backend == "shm" else None
        host = backend == "shm-host"  # host tensors both ways: the control path alone
        try:
            x = torch.ones(LAT_BYTES // 2, dtype=torch.bfloat16, device="cpu" if host else dev)
            rtts = []
            warm = max(10, iters // 10)
            for i in range(warm + iters):
                if side == "ping":
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    tx.put(f"ping{i}", {"x": x})
                    got = rx.get(f"pong{i}", device=get_dev)
                    if not host:
                        torch.cuda.current_stream().synchronize()
                    dt = time.perf_counter() - t0
                    if i >= warm:
                        rtts.append(dt)
                    del got
                else:
                    got = rx.get(f"ping{i}", device=get_dev)
                    tx.put(f"pong{i}", {"x": got["x"]})
                    del got
            if side == "ping":
                rtts.sort()
                out.put(("ok", {"p50_us": rtts[len(rtts) // 2] / 2 * 1e6,
                                "p90_us": rtts[int(len(rtts) * 0.9)] / 2 * 1e6, "iters": iters}))
        finally:
            tx.close()
            rx.close()
    except BaseException as exc:
        out.put(("error", f"latency {backend} {side} on {dev}: {type(exc).__name__}: {exc}"))
        raise


def _run_pair(ctx: Any, target: Any, args_a: tuple, args_b: tuple, q: Any, timeout: float = 580) -> Any:
    procs = [ctx.Process(target=target, args=a, daemon=True) for a in (args_a, args_b)]
    for p in procs:
        p.start()
    try:
        kind, res = q.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    if kind == "error":
        raise RuntimeError(res)
    return res


def local_copy(src_dev: str, dst_dev: str, sizes: list[int], rounds: int, quick: bool) -> list[dict[str, Any]]:
    """In-process ``dst.copy_(src)``: the same bytes, no transport (the ceiling)."""
    import torch

    out = []
    for nbytes in sizes:
        n = iters_for(nbytes, quick)
        src = torch.randn(nbytes // 2, device=src_dev).to(torch.bfloat16)
        dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dst_dev)
        times = []
        with torch.cuda.device(torch.device(dst_dev)):
            for r in range(rounds + 1):
                torch.cuda.synchronize(src_dev)
                torch.cuda.synchronize(dst_dev)
                t0 = time.perf_counter()
                for _ in range(n):
                    dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize(dst_dev)
                torch.cuda.synchronize(src_dev)
                if r:
                    times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        out.append({"size": nbytes, "iters": n, "rounds": rounds, "median_s": med, "gbps": nbytes * n / med / 1e9,
                    "all_gbps": [nbytes * n / t / 1e9 for t in times]})
    return out


# --------------------------------------------------------------------- the raw floor
# The same topology with nothing of omnilink: the receiver cudaMalloc-s a ring of slots
# and exports it once, the sender opens it once and creates one interprocess event per
# slot on the pool's device; a payload is one cudaMemcpyAsync into a slot plus an event
# record, POSIX semaphores hand slots over; the receiver's stream waits on the event and
# records its own event, and the slot goes back once that has run. cuda-python calls
# only. Two processes on one GPU pay the GPU's context switches here too.
def _raw_ipc_receiver(conn: Any, index: int, slot: int, slots: int, sems: tuple[str, str]) -> None:
    import posix_ipc
    import torch

    from omnilink.cuda import cuda_ops

    ops = cuda_ops()
    rt = ops.rt
    torch.cuda.set_device(index)
    pool = ops.check(rt.cudaMalloc(slot * (slots + 1)), "cudaMalloc")
    handle = ops.check(rt.cudaIpcGetMemHandle(pool), "cudaIpcGetMemHandle")
    flags = rt.cudaEventInterprocess | rt.cudaEventDisableTiming
    back = ops.check(rt.cudaEventCreateWithFlags(flags), "event")  # the pong's event
    conn.send((_handle_bytes(handle), _handle_bytes(ops.check(rt.cudaIpcGetEventHandle(back), "handle"))))
    evs = []
    for raw in conn.recv():
        h = rt.cudaIpcEventHandle_t()
        h.reserved = raw
        evs.append(ops.check(rt.cudaIpcOpenEventHandle(h), "cudaIpcOpenEventHandle"))
    mine = [ops.check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "event") for _ in range(slots)]
    stream = int(torch.cuda.current_stream().cuda_stream)
    filled, free = (posix_ipc.Semaphore(n) for n in sems)
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            _, count, n, mode = cmd
            for i in range(count):
                filled.acquire()
                k = i % slots
                ops.check(rt.cudaStreamWaitEvent(stream, evs[k], 0), "wait")
                if mode == "stream":
                    ops.check(rt.cudaEventRecord(mine[k], stream), "record")
                    if i:  # the previous slot goes back once this stream is past it
                        ops.check(rt.cudaEventSynchronize(mine[(i - 1) % slots]), "sync")
                        free.release()
                else:  # pong: copy it to the spare slot, the sender reads it back from there
                    ops.memcpy(pool + slots * slot, pool + k * slot, n, stream)
                    ops.check(rt.cudaEventRecord(back, stream), "record")
                    free.release()
            ops.check(rt.cudaStreamSynchronize(stream), "sync")
            if mode == "stream":
                free.release()
            conn.send(time.perf_counter())
    finally:
        rt.cudaStreamSynchronize(stream)
        for e in evs + mine + [back]:
            rt.cudaEventDestroy(e)
        rt.cudaFree(pool)


def raw_ipc_floor(sdev: str, rdev: str, sizes: list[int], rounds: int, quick: bool,
                  lat_iters: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """GB/s of the raw ring per size and the 4 KiB one-way p50 of a raw ping-pong."""
    import posix_ipc
    import torch

    from omnilink.cuda import cuda_ops

    ops = cuda_ops()
    rt = ops.rt
    s_idx, r_idx = torch.device(sdev).index or 0, torch.device(rdev).index or 0
    slot, slots = max(max(sizes), LAT_BYTES), 4
    tag = uuid.uuid4().hex[:8]
    sems = (f"/omnilink-bench-ipcf-{tag}", f"/omnilink-bench-ipcw-{tag}")
    filled = posix_ipc.Semaphore(sems[0], posix_ipc.O_CREX, mode=0o600)
    free = posix_ipc.Semaphore(sems[1], posix_ipc.O_CREX, mode=0o600, initial_value=slots)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_ipc_receiver, args=(child, r_idx, slot, slots, sems), daemon=True)
    proc.start()
    rows: list[dict[str, Any]] = []
    try:
        torch.cuda.set_device(s_idx)
        mem_raw, back_raw = parent.recv()
        for a, b in ((s_idx, r_idx), (r_idx, s_idx)):  # peer access both ways, as cuda_ipc does
            if a != b and ops.check(rt.cudaDeviceCanAccessPeer(a, b), "canAccessPeer"):
                prev = ops.swap_device(a)
                rt.cudaDeviceEnablePeerAccess(b, 0)
                ops.restore_device(prev)
        prev = ops.swap_device(r_idx)
        h = rt.cudaIpcMemHandle_t()
        h.reserved = mem_raw
        pool = ops.check(rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle")
        flags = rt.cudaEventInterprocess | rt.cudaEventDisableTiming
        evs = [ops.check(rt.cudaEventCreateWithFlags(flags), "event") for _ in range(slots)]
        eh = rt.cudaIpcEventHandle_t()
        eh.reserved = back_raw
        back = ops.check(rt.cudaIpcOpenEventHandle(eh), "cudaIpcOpenEventHandle")
        copy_stream = ops.check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "stream")
        ops.restore_device(prev)
        parent.send([_handle_bytes(ops.check(rt.cudaIpcGetEventHandle(e), "handle")) for e in evs])
        cur = int(torch.cuda.current_stream().cuda_stream)
        # Copies into the pool and its events' records go on the pool's device, current
        # there (a peer copy pulls from the sender's GPU).
        prev = ops.swap_device(r_idx)
        for nbytes in sizes:
            n = iters_for(nbytes, quick)
            src = torch.empty(nbytes, dtype=torch.uint8, device=sdev)
            times = []
            for r in range(rounds + 1):
                parent.send(("go", n, nbytes, "stream"))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i in range(n):
                    free.acquire()
                    k = i % slots
                    ops.memcpy(pool + k * slot, src.data_ptr(), nbytes, copy_stream)
                    ops.check(rt.cudaEventRecord(evs[k], copy_stream), "record")
                    filled.release()
                dt = parent.recv() - t0
                if r:
                    times.append(dt)
            med = statistics.median(times)
            rows.append({"size": nbytes, "iters": n, "rounds": rounds, "median_s": med,
                         "gbps": nbytes * n / med / 1e9, "all_gbps": [nbytes * n / t / 1e9 for t in times]})
        ops.restore_device(prev)
        x = torch.ones(LAT_BYTES, dtype=torch.uint8, device=sdev)
        for _ in range(slots):  # take every credit: now a release means "sent back"
            free.acquire()
        warm = max(10, lat_iters // 10)
        parent.send(("go", warm + lat_iters, LAT_BYTES, "ping"))
        rtts = []
        for i in range(warm + lat_iters):
            t0 = time.perf_counter()
            k = i % slots
            prev = ops.swap_device(r_idx)
            ops.memcpy(pool + k * slot, x.data_ptr(), LAT_BYTES, copy_stream)
            ops.check(rt.cudaEventRecord(evs[k], copy_stream), "record")
            ops.restore_device(prev)
            filled.release()
            free.acquire()
            ops.check(rt.cudaStreamWaitEvent(cur, back, 0), "wait")
            ops.memcpy(x.data_ptr(), pool + slots * slot, LAT_BYTES, cur)
            ops.check(rt.cudaStreamSynchronize(cur), "sync")
            if i >= warm:
                rtts.append(time.perf_counter() - t0)
        parent.recv()
        for _ in range(slots):
            free.release()
        rtts.sort()
        lat = {"p50_us": rtts[len(rtts) // 2] / 2 * 1e6, "p90_us": rtts[int(len(rtts) * 0.9)] / 2 * 1e6,
               "iters": lat_iters}
        parent.send(("stop",))
        proc.join(60)
        rt.cudaStreamSynchronize(copy_stream)
        for e in evs + [back]:
            rt.cudaEventDestroy(e)
        rt.cudaStreamDestroy(copy_stream)
        rt.cudaIpcCloseMemHandle(pool)
    finally:
        if proc.is_alive():
            proc.kill()
        filled.unlink()
        free.unlink()
    return rows, lat


def machine() -> dict[str, Any]:
    import torch

    from omnilink._bench.machine import machine_record

    rec = machine_record()
    rec["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    rec["torch"] = torch.__version__
    rec["cuda"] = torch.version.cuda
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256MiB,64MiB,1MiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inflight", type=int, default=4, help="payloads the cuda_ipc pool holds at once")
    ap.add_argument("--latency-iters", type=int, default=2000)
    ap.add_argument("--no-nccl", action="store_true", help="skip the nccl connector (two GPUs only)")
    ap.add_argument("--cases", default="same,cross", help="same (cuda:0 -> cuda:0), cross (cuda:0 -> cuda:1)")
    ap.add_argument("--quick", action="store_true", help="1 MiB, 1 round, 100 latency iterations (a smoke test)")
    ap.add_argument("--latency-only", action="store_true",
                    help="the 4 KiB ping-pongs only (the raw floor's throughput at 1 MiB, one round, comes with them)")
    ap.add_argument("--json", help="write the whole record (machine, command, results, ratios) here")
    args = ap.parse_args(argv)

    import torch

    from omnilink.connectors import backend_unavailable

    if not torch.cuda.is_available():
        print("bench_cuda_ipc needs a CUDA device; this machine has none", file=sys.stderr)
        return 2
    reason = backend_unavailable("cuda_ipc")
    if reason is not None:
        print(f"bench_cuda_ipc: the cuda_ipc backend is unavailable: {reason}", file=sys.stderr)
        return 2
    sizes = parse_sizes("1MiB") if args.quick else parse_sizes(args.sizes)
    rounds = 1 if args.quick else args.rounds
    lat_iters = 100 if args.quick else args.latency_iters
    two = torch.cuda.device_count() >= 2
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    tag = f"{os.getpid()}"
    pool_bytes = max(64 << 20, (args.inflight + 1) * max(sizes) + (16 << 20))
    opts = {"pool_bytes": pool_bytes, "arena_bytes": max(128 << 20, 2 * max(sizes) + (16 << 20))}

    want = set(args.cases.split(","))
    cases = ([("same GPU", "cuda:0", "cuda:0")] if "same" in want else []) + (
        [("cuda:0 -> cuda:1", "cuda:0", "cuda:1")] if two and "cross" in want else [])
    results: list[dict[str, Any]] = []
    latency: list[dict[str, Any]] = []

    def add(case: str, what: str, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            results.append({"case": case, "what": what, **row})
            print(f"  {case:<17} {what:<14} {format_size(row['size']):>9} {row['gbps']:9.1f} GB/s", flush=True)

    for case, sdev, rdev in cases:
        ceiling = "copy_ (local)" if sdev == rdev else "copy_ (peer)"
        if not args.latency_only:
            add(case, ceiling, local_copy(sdev, rdev, sizes, rounds, args.quick))
        if sdev == rdev:
            # Same GPU only: across two GPUs this raw probe crashed the process on 2x H200
            # (2026-11-23; the backend's own cross-GPU path is separate code); there the
            # in-process peer copy_ is the ceiling.
            floor_rows, floor_lat = raw_ipc_floor(sdev, rdev, parse_sizes("1MiB") if args.latency_only else sizes,
                                                  1 if args.latency_only else rounds, args.quick, lat_iters)
            add(case, "raw IPC floor", floor_rows)
            latency.append({"case": case, "what": "raw IPC floor", "bytes": LAT_BYTES, **floor_lat})
            print(f"  {case:<17} {'raw IPC floor':<14} 4 KiB one-way p50 {floor_lat['p50_us']:.1f} us "
                  f"(p90 {floor_lat['p90_us']:.1f})", flush=True)
        backends = [] if args.latency_only else (
            ["cuda_ipc", "shm"] + (["nccl"] if sdev != rdev and not args.no_nccl else []))
        for backend in backends:
            barrier = ctx.Barrier(2)
            o = dict(opts, master_port=free_port())
            ch = f"bench/cipc-{tag}-{backend}-{sdev[-1]}{rdev[-1]}"
            try:
                rows = _run_pair(ctx, _throughput_worker,
                                 (backend, "sender", sdev, ch, sizes, rounds, args.quick, o, barrier, q),
                                 (backend, "receiver", rdev, ch, sizes, rounds, args.quick, o, barrier, q), q)
            except RuntimeError as exc:
                print(f"  {case:<17} {backend:<14} failed: {exc}", file=sys.stderr, flush=True)
                results.append({"case": case, "what": backend, "error": str(exc)})
                continue
            add(case, "shm (host)" if backend == "shm" else backend, rows)
        for backend in ("cuda_ipc", "shm", "shm-host"):
            chs = (f"bench/lat-{tag}-{backend}-{sdev[-1]}{rdev[-1]}-a", f"bench/lat-{tag}-{backend}-{sdev[-1]}{rdev[-1]}-b")
            lo = dict(opts, pool_bytes=64 << 20, arena_bytes=16 << 20)
            try:
                rec = _run_pair(ctx, _latency_worker, (backend, "ping", sdev, chs, lat_iters, lo, q),
                                (backend, "pong", rdev, chs, lat_iters, lo, q), q)
            except RuntimeError as exc:
                print(f"  {case:<17} latency {backend} failed: {exc}", file=sys.stderr, flush=True)
                continue
            what = "shm, host tensors" if backend == "shm-host" else backend
            latency.append({"case": case, "what": what, "bytes": LAT_BYTES, **rec})
            print(f"  {case:<17} {what:<14} 4 KiB one-way p50 {rec['p50_us']:.1f} us (p90 {rec['p90_us']:.1f})",
                  flush=True)

    def gbps(case: str, what: str, size: int) -> float | None:
        for r in results:
            if r["case"] == case and r["what"] == what and r.get("size") == size and "gbps" in r:
                return float(r["gbps"])
        return None

    ratios = []
    for case, sdev, rdev in cases:
        ceiling = "copy_ (local)" if sdev == rdev else "copy_ (peer)"
        for size in sizes:
            mine = gbps(case, "cuda_ipc", size)
            if mine is None:
                continue
            for base in (ceiling, "raw IPC floor", "shm (host)", "nccl"):
                other = gbps(case, base, size)
                if other:
                    ratios.append({"case": case, "size": size, "vs": base, "ratio": mine / other})
    rec = machine()
    print(f"\n# cuda_ipc vs ceilings and other roads: {' + '.join(rec['gpus'])}, torch {rec['torch']}, CUDA {rec['cuda']}")
    print(f"{'case':<17} | {'size':>9} | {'vs':<14} | ratio")
    for r in ratios:
        print(f"{r['case']:<17} | {format_size(r['size']):>9} | {r['vs']:<14} | {r['ratio']:.3f}")
    if args.json:
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"scenario": "cuda-ipc", "time": stamp, "command": " ".join(sys.argv), "machine": rec,
                       "results": results, "latency": latency, "ratios": ratios}, f, indent=1)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
