"""Where a small GPU message's time goes, against the floors of the same machine.

``python benchmarks/profile_gpu_latency.py [--size 4096] [--n 2000] [--device cuda:0]``

Prints, in one run (medians in microseconds):

1. one process, raw cuda-python: a ``cudaMemcpyAsync`` of ``--size`` bytes device ->
   page-locked host + ``cudaStreamSynchronize``, and host -> device;
2. two processes: a POSIX-semaphore ping-pong with no GPU work (the wake-up floor),
   and ``bench_gpu.raw_two_process``: the raw floor of a host-staged GPU -> GPU message
   between processes (context switches of a shared GPU included), 4 KiB ping-pong and
   1 MiB streaming;
3. two processes, omnilink shm: the same ping-pong through ``put`` /
   ``get(device=...)``, with each side's time split into put, get-wait and the rest;
4. receiver-only and sender-only cost per message at ``--bulk-size`` (messages already
   in the arena, or nobody consuming): which side bounds throughput;
5. ``--only calls``: each CUDA / torch call of a small message, back to back and right
   after a 250 us spin or sleep (``call_costs``).

For finding the fixed cost, not for figures to quote (``bench_gpu.py`` is that).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _med(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6 if xs else float("nan")


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[int(len(xs) * 0.99)] * 1e6 if xs else float("nan")


# ------------------------------------------------------------------ 1. raw, one process
def raw_one_process(size: int, n: int, index: int) -> dict:
    import torch

    from omnilink.cuda import cuda_ops

    ops = cuda_ops()
    rt = ops.rt
    torch.cuda.set_device(index)
    dev = torch.empty(size, dtype=torch.uint8, device=f"cuda:{index}")
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    stream = ops.check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "stream")
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        ts = []
        for i in range(n + 100):
            t0 = time.perf_counter()
            ops.memcpy(dst.data_ptr(), src.data_ptr(), size, stream)
            ops.check(rt.cudaStreamSynchronize(stream), "sync")
            if i >= 100:
                ts.append(time.perf_counter() - t0)
        out[f"{name}_us"] = _med(ts)
    ts = []
    for i in range(n + 100):
        t0 = time.perf_counter()
        host.copy_(dev)
        if i >= 100:
            ts.append(time.perf_counter() - t0)
    out["torch_d2h_copy_us"] = _med(ts)
    ts = []
    for i in range(n + 100):
        t0 = time.perf_counter()
        ev = rt.cudaEventCreateWithFlags(ops.flags)[1]
        rt.cudaEventDestroy(ev)
        if i >= 100:
            ts.append(time.perf_counter() - t0)
    out["event_create_destroy_us"] = _med(ts)
    rt.cudaStreamDestroy(stream)
    return out


def call_costs(size: int, n: int, index: int, gap_us: float = 250.0) -> dict:
    """Median cost of each CUDA / torch call a small GPU message makes, back to back
    (``hot``) and right after a ``gap_us`` spin (as a receiver that waits for its next
    message spins) or sleep. Also an ``omnilink.cuda.Event`` made and recorded with its
    handle recycled, and the same with recycling off (``EVENT_POOL_MAX`` = 0)."""
    import torch

    from omnilink.cuda import Event, cuda_ops

    ops = cuda_ops()
    rt = ops.rt
    torch.cuda.set_device(index)
    dev = torch.empty(size, dtype=torch.uint8, device=f"cuda:{index}")
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    stream = ops.check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "stream")
    ev = ops.check(rt.cudaEventCreateWithFlags(ops.flags), "event")
    clock = time.perf_counter_ns

    def raw_event() -> None:
        e = rt.cudaEventCreateWithFlags(ops.flags)[1]
        rt.cudaEventRecord(e, stream)
        rt.cudaEventDestroy(e)

    calls = {
        "memcpy_h2d": lambda: ops.memcpy(dev.data_ptr(), host.data_ptr(), size, stream),
        "memcpy_d2h_and_sync": lambda: (ops.memcpy(host.data_ptr(), dev.data_ptr(), size, stream),
                                        rt.cudaStreamSynchronize(stream)),
        "torch_empty": lambda: torch.empty(size, dtype=torch.uint8, device=f"cuda:{index}"),
        "event_record": lambda: rt.cudaEventRecord(ev, stream),
        "dtype_view_as_strided": lambda: dev.view(torch.bfloat16).as_strided((size // 2,), (1,), 0),
        "event_raw_create_record_destroy": raw_event,
        "event_omnilink_recycled_record": lambda: Event(index).record(stream),
    }
    from omnilink.cuda import runtime

    def no_recycling() -> None:
        # The same omnilink Event with its free list off: created, recorded, destroyed.
        keep = runtime.EVENT_POOL_MAX
        runtime.EVENT_POOL_MAX = 0
        try:
            Event(index).record(stream)
        finally:
            runtime.EVENT_POOL_MAX = keep

    calls["event_omnilink_not_recycled_record"] = no_recycling
    out: dict = {}
    for name, fn in calls.items():
        row = {}
        for mode in ("hot", "after_spin", "after_sleep"):
            ts = []
            for i in range(n + 50):
                if mode == "after_spin":
                    end = clock() + int(gap_us * 1000)
                    while clock() < end:
                        pass
                elif mode == "after_sleep":
                    time.sleep(gap_us / 1e6)
                t0 = clock()
                fn()
                if i >= 50:
                    ts.append(clock() - t0)
                if i % 64 == 63:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
            row[f"{mode}_us"] = round(statistics.median(ts) / 1e3, 2)
        out[name] = row
    rt.cudaEventDestroy(ev)
    rt.cudaStreamDestroy(stream)
    return out


# ------------------------------------------------------------------ 2. raw, two processes
def _wake_peer(sem_a: str, sem_b: str, n: int) -> None:
    import posix_ipc

    a, b = posix_ipc.Semaphore(sem_a), posix_ipc.Semaphore(sem_b)
    b.release()  # ready
    for _ in range(n):
        a.acquire()
        b.release()


def wake_floor(n: int) -> dict:
    """One-way latency of a POSIX-semaphore ping-pong between two processes: no GPU."""
    import posix_ipc

    tag = uuid.uuid4().hex[:8]
    a = posix_ipc.Semaphore(f"/ol-prof-a-{tag}", posix_ipc.O_CREX, mode=0o600)
    b = posix_ipc.Semaphore(f"/ol-prof-b-{tag}", posix_ipc.O_CREX, mode=0o600)
    p = mp.get_context("spawn").Process(target=_wake_peer, args=(a.name, b.name, n + 100))
    p.start()
    try:
        b.acquire(120)
        ts = []
        for i in range(n + 100):
            t0 = time.perf_counter()
            a.release()
            b.acquire(60)
            if i >= 100:
                ts.append((time.perf_counter() - t0) / 2)
        p.join(60)
        return {"one_way_p50_us": _med(ts), "one_way_p99_us": _p99(ts)}
    finally:
        if p.is_alive():
            p.kill()
        a.unlink()
        b.unlink()


# ------------------------------------------------------------------ 3. omnilink ping-pong
def _ol_peer(ch: str, reply: str, size: int, n: int, device: str, q, profile: bool = False) -> None:
    import cProfile
    import io
    import pstats

    import torch

    import omnilink

    torch.cuda.set_device(torch.device(device))
    rx = omnilink.connect("shm", channel=ch, role="receiver", spin_us=1000, device_ipc="off")
    tx = omnilink.connect("shm", channel=reply, role="sender", arena_bytes=64 << 20, linger=0, device_ipc="off")
    t_get, t_put = [], []
    prof = cProfile.Profile() if profile else None
    try:
        for i in range(n):
            if prof is not None and i == 100:
                prof.enable()
            t0 = time.perf_counter()
            got = rx.get(f"p{i}", timeout=60, device=device)
            t1 = time.perf_counter()
            tx.put(f"q{i}", got, timeout=60)
            t2 = time.perf_counter()
            del got
            if i >= 100:
                t_get.append(t1 - t0)
                t_put.append(t2 - t1)
        out = {"peer_get_incl_wait_us": _med(t_get), "peer_put_us": _med(t_put)}
        if prof is not None:
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
            out["profile"] = buf.getvalue()
        q.put(out)
        time.sleep(1)
    finally:
        tx.close()
        rx.close()


def omnilink_two_process(size: int, n: int, device: str, peer_device: str, profile: bool = False) -> dict:
    import cProfile
    import pstats

    import torch

    import omnilink

    tag = uuid.uuid4().hex[:6]
    ch, reply = f"prof/l-{tag}", f"prof/lr-{tag}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    tx = omnilink.connect("shm", channel=ch, role="sender", arena_bytes=64 << 20, linger=0, device_ipc="off")
    rx = omnilink.connect("shm", channel=reply, role="receiver", spin_us=1000, device_ipc="off")
    p = ctx.Process(target=_ol_peer, args=(ch, reply, size, n + 100, peer_device, q, profile))
    p.start()
    try:
        torch.cuda.set_device(torch.device(device))
        x = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
        rt, tp, tg = [], [], []
        ok = True
        prof = cProfile.Profile() if profile else None
        for i in range(n + 100):
            if prof is not None and i == 100:
                prof.enable()
            t0 = time.perf_counter()
            tx.put(f"p{i}", {"x": x}, timeout=60)
            t1 = time.perf_counter()
            back = rx.get(f"q{i}", timeout=60, device=device)
            torch.cuda.current_stream().synchronize()
            t2 = time.perf_counter()
            if i == 0:
                ok = bool(torch.equal(back["x"], x))
            del back
            if i >= 100:
                rt.append((t2 - t0) / 2)
                tp.append(t1 - t0)
                tg.append(t2 - t1)
        if prof is not None:
            prof.disable()
            print("--- omnilink ping-pong, this side (put + get + sync)")
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        peer = q.get(timeout=120)
        if "profile" in peer:
            print("--- omnilink ping-pong, the peer (get + put)")
            print(peer.pop("profile"))
        p.join(60)
        return {"one_way_p50_us": _med(rt), "one_way_p99_us": _p99(rt), "put_us": _med(tp),
                "get_incl_wait_and_sync_us": _med(tg), "bytes_equal": ok, **peer}
    finally:
        if p.is_alive():
            p.kill()
        rx.close()
        tx.close()


# ------------------------------------------------------------------ 4. each side alone
def _bulk_sender(ch: str, size: int, count: int, device: str, q, back) -> None:
    import faulthandler

    import torch

    faulthandler.dump_traceback_later(120, exit=True)

    import omnilink

    torch.cuda.set_device(torch.device(device))
    x = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
    with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=2 * (count + 8) * (size + 4096), linger=60, device_ipc="off") as tx:
        for i in range(8):
            tx.put(f"w{i}", {"x": x}, timeout=60)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(count):
            tx.put(f"b{i}", {"x": x}, timeout=60)
        q.put((time.perf_counter() - t0) / count)
        back.get(timeout=300)  # hold the arena until the receiver is done


def bulk(size: int, count: int, device: str, profile: bool = False) -> dict:
    import cProfile
    import faulthandler
    import pstats

    import torch

    import omnilink

    ch = f"prof/b-{uuid.uuid4().hex[:6]}"
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()  # one queue each way
    with omnilink.connect("shm", channel=ch, role="receiver", device_ipc="off") as rx:
        p = ctx.Process(target=_bulk_sender, args=(ch, size, count, device, q, back))
        p.start()
        try:
            for i in range(8):
                rx.get(f"w{i}", timeout=120, device=device)
            faulthandler.dump_traceback_later(150, exit=True)
            sender_per = q.get(timeout=150)
            faulthandler.cancel_dump_traceback_later()
            torch.cuda.synchronize()
            prof = cProfile.Profile() if profile else None
            t0 = time.perf_counter()
            held = []
            if prof is not None:
                prof.enable()
            for i in range(count):
                held.append(rx.get(f"b{i}", timeout=60, device=device))
            if prof is not None:
                prof.disable()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            del held
            back.put("done")
            p.join(60)
        finally:
            if p.is_alive():
                p.kill()
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return {"sender_put_per_msg_us": sender_per * 1e6, "receiver_get_per_msg_us": (t1 - t0) / count * 1e6,
            "receiver_incl_copies_per_msg_us": (t2 - t0) / count * 1e6}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--bulk-size", type=int, default=1 << 20)
    ap.add_argument("--bulk-count", type=int, default=400)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--peer-device", default=None, help="the other process's device (default: --device)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile the bulk receiver and both sides of the ping-pong")
    ap.add_argument("--only", default="raw,omnilink,bulk",
                    help="parts to run: raw,omnilink,bulk,calls (calls: each CUDA call of a small message, "
                         "hot and after a 250 us spin or sleep)")
    args = ap.parse_args()
    import torch

    index = torch.device(args.device).index or 0
    peer = args.peer_device or args.device
    pidx = torch.device(peer).index or 0
    res = {"size": args.size, "device": args.device, "peer_device": peer,
           "gpu": torch.cuda.get_device_name(index)}
    only = set(args.only.split(","))
    if "raw" in only:
        res["raw_one_process"] = raw_one_process(args.size, args.n, index)
        res["wake_two_process_no_gpu"] = wake_floor(args.n)
        from bench_gpu import raw_two_process  # the floor bench_gpu reports beside omnilink

        floor = raw_two_process([1 << 20], pidx, lambda n: 200, 3)
        res["raw_two_process_gpu"] = {"stream_1MiB_GBps": floor["stream"][1 << 20],
                                      "4KiB_one_way_p50_us": floor["lat_p50_us"], "p99_us": floor["lat_p99_us"]}
    if "calls" in only:
        res["calls"] = call_costs(args.size, min(args.n, 1000), index)
    if "omnilink" in only:
        res["omnilink_two_process"] = omnilink_two_process(args.size, args.n, args.device, peer, args.profile)
    if "bulk" in only:
        res[f"bulk_{args.bulk_size}"] = bulk(args.bulk_size, args.bulk_count, args.device, args.profile)
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
