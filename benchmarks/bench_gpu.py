"""GPU -> shared memory -> GPU: omnilink's GPU data path beside its ceilings, in one run.

Benchmarks are hard: every figure here is one run on one machine, the median of
several repetitions, and the ratios compare paths measured side by side in that run.

What it measures (needs CUDA; one GPU, and cuda:0 -> cuda:1 when there are two):

1. ceilings, in this process: one pinned device-to-host and host-to-device ``copy_`` of
   the same bytes (and a pageable one); "duplex": a D2H and an H2D of those bytes at
   once on two streams, GB/s per direction (what a pipelined GPU -> host -> GPU
   transfer can reach when both directions of PCIe share the link);
2. the D2H controller copying into a page-locked ``/dev/shm`` arena, against (1);
3. two processes, sender tensors on cuda:0, receiver ``get(..., device="cuda:k")``
   through the shm backend: GB/s at each size with several messages in flight (the
   receiver's side; the sender's blocking ``put`` one at a time, and ``put_async`` with
   8 in flight from a ring of sources: column async8), bytes
   checked on the receiver's GPU; 4 KiB one-way latency (round trip / 2, both copies),
   and the same ping-pong with a host tensor got without a device (omnilink's control
   path alone, which every GPU message runs too);
   beside the raw floor of the same topology: a ring of 8 registered ``/dev/shm``
   slots, D2H in one process and H2D in the other with cuda-python calls and POSIX
   semaphores, nothing of omnilink (two processes sharing one GPU pay its context
   switches in both);
4. the paths omnilink replaces, same processes and sizes: the legacy one (``.cpu()``,
   pickle, a fresh segment, ``.cuda()``), and omnilink's host path with plain ``.to()``
   at both ends;
5. the same transfers through the same shm connector with ``device_ipc="on"``: device to
   device into the receiver's pool, against a local device-to-device ``copy_`` (d2d);
6. overlap: bf16 matmuls with a ``put_async`` of 256 MiB per step, against matmuls
   alone and matmuls beside a raw side-stream copy of the same bytes.

Run: ``python benchmarks/bench_gpu.py [--sizes 1MiB,64MiB,256MiB] [--json out.jsonl]``.
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
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 1 << 20
#: extra options of the sending shm connector (``--slice-bytes``)
SENDER_OPTS: dict = {}
#: receivers check every this many messages byte for byte (``--check-every``)
CHECK_EVERY = 8


def _fmt(n: int) -> str:
    return f"{n >> 20} MiB" if n >= MiB else f"{n >> 10} KiB"


# =================================================================== in-process
def ceilings(sizes: list[int], reps: int) -> dict[str, dict[int, float]]:
    import torch

    out: dict[str, dict[int, float]] = {"d2h-pinned": {}, "h2d-pinned": {}, "d2h-pageable": {}, "d2d": {}}
    for n in sizes:
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        pin = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        page = torch.empty(n, dtype=torch.uint8)
        dev_b = torch.empty(n, dtype=torch.uint8, device="cuda")
        for name, dst, src in (("d2h-pinned", pin, dev), ("h2d-pinned", dev, pin), ("d2h-pageable", page, dev),
                               ("d2d", dev_b, dev)):
            times = []
            for _ in range(reps + 2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            out[name][n] = n / statistics.median(times[2:]) / 1e9
        # Both directions at once, as a pipelined GPU -> host -> GPU transfer runs them:
        # a D2H and an H2D of n bytes each on two streams; GB/s per direction.
        pin2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev2 = torch.empty(n, dtype=torch.uint8, device="cuda")
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        times = []
        for _ in range(reps + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(s1):
                pin.copy_(dev, non_blocking=True)
            with torch.cuda.stream(s2):
                dev2.copy_(pin2, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out.setdefault("duplex", {})[n] = n / statistics.median(times[2:]) / 1e9
        del pin2, dev2
    return out


def d2h_controller(sizes: list[int], reps: int) -> dict[int, float]:
    """The controller's copy into a page-locked /dev/shm segment (the arena's path)."""
    import mmap

    import posix_ipc
    import torch

    from omnilink.cuda import AsyncD2HController, HostRegistration

    cap = max(sizes)
    name = f"/omnilink-bench-{uuid.uuid4().hex[:8]}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=cap)
    try:
        mm = mmap.mmap(shm.fd, cap)
        shm.close_fd()
        arena = torch.frombuffer(mm, dtype=torch.uint8)
        arena.fill_(1)  # pre-fault
        reg = HostRegistration(arena.data_ptr(), cap, what="bench arena")
        out = {}
        with AsyncD2HController("cuda:0") as ctl:
            for n in sizes:
                src = torch.empty(n, dtype=torch.uint8, device="cuda")
                times = []
                for _ in range(reps + 2):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    ctl.copy_into([(src, arena[:n])]).synchronize()
                    times.append(time.perf_counter() - t0)
                out[n] = n / statistics.median(times[2:]) / 1e9
        reg.close()
        del arena
        mm.close()
    finally:
        posix_ipc.unlink_shared_memory(name)
    return out


# =================================================================== raw floor, two processes
# The same topology with nothing of omnilink: a ring of slots in a registered /dev/shm
# file, D2H into a slot in one process, H2D out of it in the other, POSIX semaphores
# for the hand-off, cuda-python calls only. Two processes sharing one GPU pay the
# GPU's context switches here too: this is the floor of any host-staged path.
def _raw_rx(conn, shm_name: str, sems: tuple[str, str], slot: int, slots: int, index: int) -> None:
    import mmap

    import posix_ipc
    import torch

    from omnilink.cuda import HostRegistration, cuda_ops

    ops = cuda_ops()
    rt = ops.rt
    torch.cuda.set_device(index)
    fd = os.open(f"/dev/shm/{shm_name}", os.O_RDWR)
    mm = mmap.mmap(fd, slot * slots)
    os.close(fd)
    host = torch.frombuffer(mm, dtype=torch.uint8)
    reg = HostRegistration(host.data_ptr(), slot * slots, what="raw ring")
    filled, free = (posix_ipc.Semaphore(n) for n in sems)
    stream = ops.check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "stream")
    ext = torch.cuda.ExternalStream(int(stream), device=f"cuda:{index}")
    dst = [torch.empty(slot, dtype=torch.uint8, device=f"cuda:{index}") for _ in range(slots)]
    evs = [ops.check(rt.cudaEventCreateWithFlags(ops.flags), "event") for _ in range(slots)]
    base = host.data_ptr()
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            _, count, n, mode, every = cmd
            ok = torch.ones((), dtype=torch.bool, device=f"cuda:{index}")
            for i in range(count):
                filled.acquire()
                k = i % slots
                if mode == "stream":
                    ops.memcpy(dst[k].data_ptr(), base + k * slot, n, stream)
                    if i % every == 0 or i == count - 1:  # the checks omnilink's receiver makes
                        with torch.cuda.stream(ext):
                            ok &= (dst[k][:n] == (i % 251)).all()
                    ops.check(rt.cudaEventRecord(evs[k], stream), "record")
                    if i:  # the previous slot goes back once its copy is done
                        ops.check(rt.cudaEventSynchronize(evs[(i - 1) % slots]), "sync")
                        free.release()
                else:  # ping: land it, send it back through the same slot
                    ops.memcpy(dst[k].data_ptr(), base + k * slot, n, stream)
                    ops.memcpy(base + k * slot, dst[k].data_ptr(), n, stream)
                    ops.check(rt.cudaStreamSynchronize(stream), "sync")
                    free.release()
            if mode == "stream":
                ops.check(rt.cudaStreamSynchronize(stream), "sync")
                free.release()
            conn.send((time.perf_counter(), bool(ok)))
    finally:
        ops.check(rt.cudaStreamSynchronize(stream), "sync")
        for e in evs:
            rt.cudaEventDestroy(e)
        rt.cudaStreamDestroy(stream)
        reg.close()
        del host
        mm.close()


def raw_two_process(sizes: list[int], rx_index: int, count_for, reps: int) -> dict:
    """GB/s of the raw ring at each size (several in flight) and the 4 KiB one-way
    latency of a raw ping-pong (round trip / 2), sender on cuda:0."""
    import mmap

    import posix_ipc
    import torch

    from omnilink.cuda import HostRegistration, cuda_ops

    ops = cuda_ops()
    rt = ops.rt
    slot, slots = max(sizes), 8
    tag = uuid.uuid4().hex[:8]
    shm_name = f"omnilink-bench-raw-{tag}"
    sems = (f"/omnilink-bench-rawf-{tag}", f"/omnilink-bench-raww-{tag}")
    fd = os.open(f"/dev/shm/{shm_name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, slot * slots)
    mm = mmap.mmap(fd, slot * slots)
    os.close(fd)
    filled = posix_ipc.Semaphore(sems[0], posix_ipc.O_CREX, mode=0o600)
    free = posix_ipc.Semaphore(sems[1], posix_ipc.O_CREX, mode=0o600, initial_value=slots)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_rx, args=(child, shm_name, sems, slot, slots, rx_index), daemon=True)
    proc.start()
    out: dict = {"stream": {}}
    host = torch.frombuffer(mm, dtype=torch.uint8)
    host.fill_(0)  # pre-fault
    reg = HostRegistration(host.data_ptr(), slot * slots, what="raw ring")
    base = host.data_ptr()
    try:
        torch.cuda.set_device(0)
        raw = int(torch.cuda.current_stream().cuda_stream)
        for n in sizes:
            src = torch.empty(n, dtype=torch.uint8, device="cuda:0")
            count = count_for(n)
            best = []
            for _ in range(reps):
                parent.send(("go", count, n, "stream", CHECK_EVERY))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i in range(count):
                    free.acquire()
                    src.fill_(i % 251)  # the same loop shape as omnilink's sender
                    ops.memcpy(base + (i % slots) * slot, src.data_ptr(), n, raw)
                    ops.check(rt.cudaStreamSynchronize(raw), "sync")
                    filled.release()
                t_end, ok = parent.recv()
                out["ok"] = out.get("ok", True) and ok
                best.append(count * n / (t_end - t0) / 1e9)
            out["stream"][n] = statistics.median(best)
        n = 4096
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
        lat = []
        for rep in range(reps):
            for _ in range(slots):  # take every credit: now a release means "sent back"
                free.acquire()
            parent.send(("go", 200, n, "ping", CHECK_EVERY))
            for i in range(200):
                t0 = time.perf_counter()
                ops.memcpy(base, src.data_ptr(), n, raw)
                ops.check(rt.cudaStreamSynchronize(raw), "sync")
                filled.release()
                free.acquire()  # the peer landed it and sent it back
                ops.memcpy(src.data_ptr(), base, n, raw)
                ops.check(rt.cudaStreamSynchronize(raw), "sync")
                lat.append((time.perf_counter() - t0) / 2)
            parent.recv()
            for _ in range(slots):
                free.release()
        lat = sorted(lat[20:])
        out["lat_p50_us"] = lat[len(lat) // 2] * 1e6
        out["lat_p99_us"] = lat[int(len(lat) * 0.99)] * 1e6
        parent.send(("stop",))
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
        reg.close()
        del host
        mm.close()
        os.unlink(f"/dev/shm/{shm_name}")
        filled.unlink()
        free.unlink()
    return out


# =================================================================== two processes
def _receiver(conn, channel: str, reply: str, ipc_channel: str, ipc_pool: int, device: str) -> None:
    import pickle
    from multiprocessing import shared_memory

    import torch

    import omnilink

    torch.cuda.init()
    # spin_us=1000: a waiting get watches its semaphore for 1 ms before sleeping (the
    # default 200 us is shorter than one hop here, so a sleeping wake-up would be timed).
    # The host-staged path (device_ipc="off"), and the same connector with device IPC on
    # a channel of its own (column ipc).
    rx = omnilink.connect("shm", channel=channel, role="receiver", spin_us=1000, device_ipc="off")
    tx = omnilink.connect("shm", channel=reply, role="sender", arena_bytes=64 << 20, linger=0, device_ipc="off")
    rx_ipc = omnilink.connect("shm", channel=ipc_channel, role="receiver", spin_us=1000, device_ipc="on",
                              ipc_pool_bytes=ipc_pool, ipc_device=device)
    try:
        while True:
            cmd = conn.recv()
            op = cmd[0]
            if op == "stop":
                return
            if op == "thr":
                _, count, device, mode, tag, every = cmd
                ok = torch.ones((), dtype=torch.bool, device=device)
                for i in range(count):
                    if mode in ("omnilink", "async"):
                        got = rx.get(f"{tag}m{i}", timeout=120, device=device)["x"]
                    elif mode == "ipc":
                        got = rx_ipc.get(f"{tag}m{i}", timeout=120, device=device)["x"]
                    elif mode == "to":  # host path, then a plain .to()
                        got = rx.get(f"{tag}m{i}", timeout=120)["x"].to(device)
                    else:  # legacy: pickle over a fresh segment
                        seg_name, n = conn.recv()
                        seg = shared_memory.SharedMemory(name=seg_name)
                        # BASELINE BEING MEASURED: what engines do today; never omnilink's path.
                        got = pickle.loads(seg.buf[:n])["x"].cuda(device)
                        seg.close()
                        seg.unlink()
                    if i % every == 0 or i == count - 1:
                        # Every 8th message (--check-every) and the last are checked byte
                        # for byte on the GPU (checking all would time the check at small
                        # sizes); the raw floor checks the same ones.
                        ok &= (got == (i % 251)).all()
                    del got
                torch.cuda.synchronize()
                conn.send((time.perf_counter(), bool(ok)))
            elif op == "ping":
                _, count, device, tag = cmd  # device None: host tensors, get without a device
                for i in range(count):
                    got = rx.get(f"{tag}p{i}", timeout=60, device=device)
                    tx.put(f"{tag}q{i}", got, timeout=60)
                conn.send("done")
    finally:
        rx_ipc.close()
        tx.close()
        rx.close()


def two_process(sizes: list[int], device: str, count_for, reps: int) -> dict:
    import pickle
    from multiprocessing import shared_memory

    import torch

    import omnilink

    ctx = mp.get_context("spawn")
    ch, reply = f"bench/gpu-{uuid.uuid4().hex[:6]}", f"bench/gpu-r-{uuid.uuid4().hex[:6]}"
    arena = max(1 << 30, 3 * max(sizes))
    tx = omnilink.connect("shm", channel=ch, role="sender", arena_bytes=min(arena, 2 << 30), linger=0,
                          device_ipc="off", **SENDER_OPTS)
    rx = omnilink.connect("shm", channel=reply, role="receiver", spin_us=1000, device_ipc="off")
    ipc_ch, ipc_pool = f"bench/gpu-i-{uuid.uuid4().hex[:6]}", 4 * max(sizes)
    tx_ipc = omnilink.connect("shm", channel=ipc_ch, role="sender", arena_bytes=16 << 20, linger=0, device_ipc="on")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, ch, reply, ipc_ch, ipc_pool, device), daemon=True)
    proc.start()
    results: dict = {"omnilink": {}, "async": {}, "ipc": {}, "to": {}, "legacy": {}, "ok": True}
    window = 8  # put_async: messages in flight on the sender's side (a ring of sources)
    try:
        for n in sizes:
            src = torch.empty(n, dtype=torch.uint8, device="cuda:0")
            ring = [torch.empty(n, dtype=torch.uint8, device="cuda:0") for _ in range(window)]
            count = count_for(n)
            for mode in ("omnilink", "async", "ipc", "to", "legacy"):
                if mode == "legacy" and n > 64 * MiB:
                    continue  # minutes per run at 0.2 GB/s; 64 MiB makes the point
                best = []
                if mode == "legacy":
                    count = min(count, 8)
                for rep in range(reps):
                    # Keys are unique per run: each key is delivered once (a consumed key
                    # is an error, not a new message).
                    tag = f"{n}-{mode}-{rep}-"
                    parent.send(("thr", count, device, mode, tag, CHECK_EVERY))
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    futs: list = [None] * window
                    for i in range(count):
                        if mode == "async":
                            # Several in flight: a source is refilled once its put is done.
                            j = i % window
                            if futs[j] is not None:
                                futs[j].result(120)
                            ring[j].fill_(i % 251)
                            futs[j] = tx.put_async(f"{tag}m{i}", {"x": ring[j]}, timeout=120)
                            continue
                        src.fill_(i % 251)
                        if mode == "omnilink":
                            tx.put(f"{tag}m{i}", {"x": src}, timeout=120)
                        elif mode == "ipc":
                            tx_ipc.put(f"{tag}m{i}", {"x": src}, timeout=120)
                        elif mode == "to":
                            tx.put(f"{tag}m{i}", {"x": src.cpu()}, timeout=120)
                        else:
                            # BASELINE BEING MEASURED: pickle of a .cpu() copy into a fresh segment.
                            data = pickle.dumps({"x": src.cpu()}, protocol=5)
                            seg = shared_memory.SharedMemory(create=True, size=len(data))
                            seg.buf[: len(data)] = data
                            parent.send((seg.name, len(data)))
                            seg.close()
                    for f in futs:
                        if f is not None:
                            f.result(120)
                    t_end, ok = parent.recv()
                    results["ok"] &= ok
                    best.append(count * n / (t_end - t0) / 1e9)
                results[mode][n] = statistics.median(best)
        def ping_pong(x: Any, get_device: Any, prefix: str) -> list[float]:
            """Sorted one-way times (round trip / 2) of ``x`` echoed by the receiver
            (``get_device`` None: host tensors both ways); checks the first echo."""
            lat = []
            for rep in range(reps):
                tag = f"{prefix}{rep}-"
                parent.send(("ping", 200, get_device, tag))
                for i in range(200):
                    t0 = time.perf_counter()
                    tx.put(f"{tag}p{i}", {"x": x}, timeout=60)
                    back = rx.get(f"{tag}q{i}", timeout=60, device=None if get_device is None else "cuda:0")
                    if get_device is not None:
                        torch.cuda.current_stream().synchronize()
                    lat.append((time.perf_counter() - t0) / 2)
                    if i == 0 and rep == 0:
                        results["ok"] &= bool(torch.equal(back["x"], x))
                    del back
                assert parent.recv() == "done"
            return sorted(lat[20:])

        # 4 KiB one-way: round trip / 2, both copies each way.
        x = torch.randint(0, 255, (4096,), dtype=torch.uint8, device="cuda:0")
        lat = ping_pong(x, device, "lat")
        results["lat_p50_us"] = lat[len(lat) // 2] * 1e6
        results["lat_p99_us"] = lat[int(len(lat) * 0.99)] * 1e6
        # The same ping-pong with a 4 KiB host tensor, got without a device: the control
        # path alone (header, keys, block, wake-up; no copy to or from a GPU), which the
        # GPU path runs too. No GPU -> GPU message can be faster than this row.
        lat = ping_pong(x.cpu(), None, "lath")
        results["lat_host_p50_us"] = lat[len(lat) // 2] * 1e6
        parent.send(("stop",))
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
        results["ipc_puts"] = tx_ipc.stats().ipc_puts
        rx.close()
        tx.close()
        tx_ipc.close()
    return results


# =================================================================== overlap
def _sink(channel: str, count: int, ready) -> None:
    import omnilink

    with omnilink.connect("shm", channel=channel, role="receiver", device_ipc="off") as rx:
        rx.get("warm", timeout=120)
        ready.set()
        for i in range(count - 1):
            rx.get(f"o{i}", timeout=120)


def overlap(steps: int, size: int) -> dict:
    import torch

    import omnilink

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    pin = torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def loop(extra) -> float:
        # The compute stream's time: the copies may go on (a device-wide synchronize
        # would wait for them too, and time the receiver instead).
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            for _ in range(4):
                b = a @ a  # noqa: F841
            extra(i)
        torch.cuda.current_stream().synchronize()
        return time.perf_counter() - t0

    loop(lambda i: None)
    mm_only = min(loop(lambda i: None) for _ in range(2))
    side = torch.cuda.Stream()

    def raw(i):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            pin.copy_(src, non_blocking=True)

    def raw_loop():
        t = loop(raw)
        side.synchronize()
        return t

    raw_t = min(raw_loop() for _ in range(2))
    copy_t = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pin.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        copy_t.append(time.perf_counter() - t0)
    copy_time = statistics.median(copy_t) * steps
    ch = f"bench/ovl-{uuid.uuid4().hex[:6]}"
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_sink, args=(ch, steps + 1, ready), daemon=True)
    with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=4 * size + (64 << 20), linger=5,
                          device_ipc="off") as tx:
        proc.start()
        tx.put("warm", {"x": src}, timeout=120)
        ready.wait(120)  # the receiver is up and has taken one
        futs = []
        t = loop(lambda i: futs.append(tx.put_async(f"o{i}", {"x": src}, timeout=120)))
        for f in futs:
            f.result(120)
        t_all = time.perf_counter()
        proc.join(120)
    return {"matmul_only_s": mm_only, "matmul_raw_copy_s": raw_t, "matmul_put_async_s": t,
            "copy_only_s": copy_time, "overhead_share_of_copy": (t - mm_only) / copy_time, "_": t_all}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4KiB,1MiB,16MiB,64MiB,256MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-overlap", action="store_true")
    ap.add_argument("--slice-bytes", default=None, help="the sender's slice_bytes (default: the connector's)")
    ap.add_argument("--check-every", type=int, default=8, help="receivers check every N-th message on the GPU")
    args = ap.parse_args()
    import torch

    from omnilink._bench import parse_sizes
    from omnilink.cuda import mps_serving

    if not torch.cuda.is_available():
        print("bench_gpu: needs a CUDA device; none is present", file=sys.stderr)
        return 1
    sizes = parse_sizes(args.sizes)
    global CHECK_EVERY
    CHECK_EVERY = max(1, args.check_every)
    if args.slice_bytes:
        SENDER_OPTS["slice_bytes"] = parse_sizes(args.slice_bytes)[0]
    big = [s for s in sizes if s >= MiB]
    machine = {"gpu": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
               "torch": torch.__version__, "host": platform.node(), "cpus": os.cpu_count(), "mps": mps_serving()}
    print(f"# bench_gpu on {machine}", flush=True)
    ceil = ceilings(sizes, 10)
    ctl = d2h_controller([s for s in big if s >= 16 * MiB] or big, 10)

    def count_for(n: int) -> int:
        return max(8, min(200, (2 << 30) // n))

    devices = ["cuda:0"] + (["cuda:1"] if torch.cuda.device_count() > 1 else [])
    tp = {d: two_process(big, d, count_for, args.reps) for d in devices}
    floor = {d: raw_two_process(big, int(d.split(":")[1]), count_for, args.reps) for d in devices}
    ovl = None if args.skip_overlap else overlap(10, 256 * MiB)
    rows = []
    print(f"\n{'size':>8} | {'d2h pin':>8} {'h2d pin':>8} {'d2h page':>8} {'duplex':>7} | {'ctl d2h':>8} {'ctl/raw':>7} | "
          + " | ".join(f"{d}: omnilink x slower-pin  async8 x slower-pin   .to()  legacy  raw-2proc  x raw-2proc" for d in devices))
    for n in sizes:
        slower = min(ceil["d2h-pinned"][n], ceil["h2d-pinned"][n])
        line = (f"{_fmt(n):>8} | {ceil['d2h-pinned'][n]:8.1f} {ceil['h2d-pinned'][n]:8.1f} "
                f"{ceil['d2h-pageable'][n]:8.1f} {ceil['duplex'][n]:7.1f} | ")
        c = ctl.get(n)
        line += f"{c:8.1f} {c / ceil['d2h-pinned'][n]:7.2f} | " if c else f"{'':8} {'':7} | "
        rec = {"size": n, "d2h_pinned": ceil["d2h-pinned"][n], "h2d_pinned": ceil["h2d-pinned"][n],
               "d2h_pageable": ceil["d2h-pageable"][n], "duplex_per_direction": ceil["duplex"][n],
               "d2d": ceil["d2d"][n], "ctl_d2h": c}
        for d in devices:
            r = tp[d]
            o, t2, lg = r["omnilink"].get(n), r["to"].get(n), r["legacy"].get(n)
            a8 = r["async"].get(n)
            fl = floor[d]["stream"].get(n)
            best = max(o or 0, a8 or 0)
            line += (f"{d}: {o or 0:8.1f} {(o or 0) / slower:9.2f}x {a8 or 0:6.1f} {(a8 or 0) / slower:9.2f}x "
                     f"{t2 or 0:7.1f} {lg or 0:7.2f} {fl or 0:10.1f} {best / fl if fl else 0:8.2f}x | ")
            rec[d] = {"omnilink": o, "omnilink_put_async_x8": a8, "ipc": r["ipc"].get(n), "to": t2, "legacy": lg,
                      "ratio_slower_pinned": (o or 0) / slower, "ratio_slower_pinned_put_async_x8": (a8 or 0) / slower,
                      "raw_two_process": fl, "ratio_raw_two_process": best / fl if fl else None,
                      "ratio_duplex": best / ceil["duplex"][n]}
        rows.append(rec)
        print(line, flush=True)
    for d in devices:
        print(f"{d}: device IPC through the same shm connector (device_ipc='on', {tp[d].get('ipc_puts')} payloads "
              f"routed) GB/s and x a local device copy_: " + ", ".join(
                  f"{_fmt(r['size'])} {r[d]['ipc'] or 0:.1f} ({(r[d]['ipc'] or 0) / ceil['d2d'][r['size']]:.2f}x of "
                  f"{ceil['d2d'][r['size']]:.0f})" for r in rows if r["size"] >= MiB))
    for d in devices:
        print(f"{d}: best of omnilink/async8 against the duplex ceiling: " + ", ".join(
            f"{_fmt(r['size'])} {r[d]['ratio_duplex']:.2f}x" for r in rows if r["size"] >= MiB))
    for d in devices:
        print(f"{d}: 4 KiB one-way (round trip / 2, spin_us=1000) p50 {tp[d]['lat_p50_us']:.1f} us, p99 {tp[d]['lat_p99_us']:.1f} us; "
              f"raw two-process floor p50 {floor[d]['lat_p50_us']:.1f} us, p99 {floor[d]['lat_p99_us']:.1f} us; "
              f"the same ping-pong with host tensors (omnilink's control path alone) p50 {tp[d]['lat_host_p50_us']:.1f} us; "
              f"bytes equal: {tp[d]['ok']} (raw floor: {floor[d].get('ok')})")
    if ovl:
        print(f"overlap (10 steps, 4 bf16 8192^3 matmuls + 256 MiB each): matmul only {ovl['matmul_only_s'] * 1e3:.1f} ms, "
              f"+ raw side-stream copy {ovl['matmul_raw_copy_s'] * 1e3:.1f} ms, + put_async {ovl['matmul_put_async_s'] * 1e3:.1f} ms, "
              f"copies alone {ovl['copy_only_s'] * 1e3:.1f} ms: put_async adds {ovl['overhead_share_of_copy'] * 100:.1f}% of the copy time")
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps({"machine": machine, **{k: v for k, v in r.items()}}) + "\n")
            f.write(json.dumps({"machine": machine, "latency": {d: [tp[d]["lat_p50_us"], tp[d]["lat_p99_us"]] for d in devices},
                                "latency_raw_two_process": {d: [floor[d]["lat_p50_us"], floor[d]["lat_p99_us"]] for d in devices},
                                "latency_host_tensors_p50": {d: tp[d]["lat_host_p50_us"] for d in devices},
                                "overlap": ovl, "bytes_equal": all(tp[d]["ok"] for d in devices)}) + "\n")
    return 0 if all(tp[d]["ok"] for d in devices) else 2


if __name__ == "__main__":
    sys.exit(main())
