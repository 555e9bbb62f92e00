"""What a stage feels: one GPU payload at a time, from ``put`` to a tensor read on the
receiver's stream, against the raw floor and the in-process copy of the same run.

A stage of a streaming pipeline uses each payload before the next arrives (the talker
consumes a thinker chunk, computes, then waits for the next). This benchmark times
exactly that, one payload in flight, two processes:

- the sender stamps ``t0`` (``time.perf_counter``: CLOCK_MONOTONIC, one clock for both
  processes of a host) and ``put``s a payload shaped like vLLM-Omni's thinker -> talker
  chunk: ``{"hidden_states.output": <CUDA bf16, SIZE bytes>, "ids.output": <CPU int64
  [16]>, "meta": {"finished": <CPU 0-d bool>, "request_id": str, "chunk_id": int}}``;
- the receiver ``get``s it onto its device, then *uses* it: one 64-byte
  ``cudaMemcpyAsync`` from the hidden state to page-locked host memory on its current
  stream and a ``cudaStreamSynchronize`` (the stream has waited for the transfer, and the
  host has read the tensor), stamps ``t1`` and posts an acknowledgement (a POSIX
  semaphore, nothing of omnilink); only then does the sender send the next payload.

Time per payload = ``t1 - t0`` (median and p90 over ``--n`` payloads after warm-up).

Rows of one run, side by side (same devices, MPS or not alike):

``copy``   an in-process ``dst.copy_(src)`` of the same bytes, synchronized (local on one
           GPU, peer across two with peer access on): the hardware's time for the bytes.
``raw``    the raw floor: the same two processes and the same use with nothing of
           omnilink: a pool the receiver exported once (CUDA IPC), one ``cudaMemcpyAsync``
           into it and one interprocess event per payload, POSIX semaphores, cuda-python
           from Python.
``shm``    ``omnilink.connect("shm")`` with its defaults (device IPC chosen by itself).
``cuda_ipc``  ``omnilink.connect("cuda_ipc")``.
``shm-ipc``   the shm backend with ``device_ipc="on"`` (device IPC at every size).
``shm-host``  the shm backend's host road (``device_ipc="off"``), for reference.

Target (per size): omnilink <= copy + 2 x (raw at 4 KiB). ``--trace`` also writes, for
one road, both processes' spans of every omnilink function on one clock and prints where
a payload's time went (median start offset from ``t0`` and inclusive duration per
function, sender and receiver; tracing adds about a microsecond per call).

Usage (GPU machine, repository root)::

    python3 benchmarks/bench_serial_gpu.py [--sizes 4KiB,1MiB,64MiB,256MiB]
        [--roads raw,shm,cuda_ipc,shm-host] [--src cuda:0] [--dst cuda:0] [--n 8]
        [--lat-n 400] [--pairs K] [--cpus S,R] [--json FILE] [--trace ROAD] [--trace-json FILE]

``--pairs K`` runs each omnilink road in K process pairs (fresh processes each): the rows
pool their payloads, and each pair's p50 is printed, since one pair can run slower as a
whole than the next (seen on H100 VMs with MPS: the same code at 111 us in one pair and
178 us in the next). ``--cpus S,R`` pins the sender to CPU S and each receiver to CPU R
(the raw floor's too), to compare placements or to take placement out of an A/B.

Benchmarks are hard: two processes on one GPU time-slice it unless an MPS server runs
(``nvidia-cuda-mps-control -d``); every run records which.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import datetime
import importlib
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

from omnilink.cuda import mps_serving  # noqa: E402
from omnilink._bench.backends import pool_end as _pool_end  # noqa: E402
from omnilink._bench.units import format_size, parse_sizes  # noqa: E402

builtins_setattr = builtins.setattr
USE_BYTES = 64
SMALL = 64 << 10


def pin(role: int) -> None:
    """Pin this process to the CPU ``--cpus`` gave its role (0: the sender, 1: the
    receiver), if any: the two processes' placement (two vCPUs of one physical core, or
    not) moves a pair's times by up to 2x on a VM."""
    cpus = os.environ.get("OMNILINK_BENCH_CPUS")
    if cpus:
        os.sched_setaffinity(0, {int(cpus.split(",")[role])})


def _count(nbytes: int, n: int, lat_n: int) -> int:
    return lat_n if nbytes <= SMALL else n


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"p50_us": statistics.median(s) * 1e6, "p90_us": s[int(len(s) * 0.9)] * 1e6, "n": len(s)}


def pool_pairs(runs: list[tuple[dict[int, dict[str, float]], dict[int, list[float]]]],
               sizes: list[int]) -> dict[int, dict[str, Any]]:
    """The rows of a road run in several process pairs (``--pairs``): per size the stats
    of every pair's payloads together, and each pair's own p50 (``pair_p50_us``)."""
    return {nb: {**_stats([x for _, smp in runs for x in smp[nb]]),
                 "pair_p50_us": [out[nb]["p50_us"] for out, _ in runs]} for nb in sizes}


def resolve_ref(ref: str) -> object:
    """A knob value: ``@module:a.b`` is that object; anything else a Python literal."""
    if not ref.startswith("@"):
        return ast.literal_eval(ref)
    mod, qual = ref[1:].split(":")
    obj: object = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_knob(spec: str) -> tuple[object, str, list[object]]:
    """``(owner, attribute, values)`` of a knob ``MODULE:ATTR=V1,V2`` (``ATTR`` may be
    dotted, ``PoolSender.send``; values as ``resolve_ref``), every reference resolved."""
    target, vals = spec.split("=", 1)
    mod, attr = target.split(":")
    owner: object = importlib.import_module(mod)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name, [resolve_ref(v) for v in vals.split(",")]


def set_knobs(knobs: list[tuple[object, str, list[object]]], i: int, per: int) -> int:
    """Set every knob to its value for payload ``i`` (blocks of ``per`` payloads take
    the values in turn); returns the value's index."""
    k = (i // per) % len(knobs[0][2])
    for owner, name, vals in knobs:
        setattr(owner, name, vals[k])
    return k


# ------------------------------------------------------------------ tracing
#: Modules whose functions --trace wraps (every function and method defined there).
TRACED = (
    "omnilink.blob", "omnilink._util", "omnilink.connectors.base",
    "omnilink.connectors.shm.connector", "omnilink.connectors.shm.segments", "omnilink.connectors.shm.gpu",
    "omnilink.connectors.shm.ipc", "omnilink.connectors.shmem.alloc", "omnilink.connectors.shmem.segment",
    "omnilink.connectors.cuda_ipc.connector", "omnilink.connectors.devpool.ops",
    "omnilink.connectors.devpool.directory", "omnilink.connectors.devpool.blocks",
    "omnilink.connectors.devpool.sender", "omnilink.connectors.devpool.receiver",
    "omnilink.connectors.devpool.manifest", "omnilink.connectors.devpool.lane", "omnilink.connectors.devpool.plan",
    "omnilink.cuda.runtime", "omnilink.cuda.events", "omnilink.cuda.h2d", "omnilink.cuda.d2h",
    "omnilink.cuda.device", "omnilink.cuda.pool",
    # no functions of its own: listed so that its re-exports (``from omnilink.cuda import
    # payload_to_device`` at call time) are rebound to the traced ones
    "omnilink.cuda",
)


def install_tracer(spans: list, only: tuple[str, ...] = (), modules: tuple[str, ...] | None = None) -> Any:
    """Wrap every function and method defined in ``modules`` (default: this module's
    ``TRACED`` as it is at the call, which other scripts set; or, with ``only``, those
    whose name ends with one of ``only``: fewer wrappers, less distortion) with a span
    recorder; returns a function that puts the originals back."""
    if modules is None:
        modules = TRACED
    import functools
    import importlib
    import inspect

    clock = time.perf_counter_ns
    undo: list[tuple[Any, str, Any]] = []

    def setattr(owner: Any, name: str, value: Any) -> None:  # noqa: A001 - remembered for undo
        undo.append((owner, name, getattr(owner, name)))
        builtins_setattr(owner, name, value)

    def wrap(fn: Any, name: str) -> Any:
        if only and not name.endswith(only):
            return fn

        @functools.wraps(fn)
        def traced(*a: Any, **k: Any) -> Any:
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                spans.append((name, t, clock()))
        return traced

    for modname in modules:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        short = modname.replace("omnilink.", "").replace("connectors.", "")
        for attr, obj in list(vars(mod).items()):
            if inspect.isfunction(obj) and obj.__module__ == modname:
                setattr(mod, attr, wrap(obj, f"{short}.{attr}"))
            elif inspect.isclass(obj) and obj.__module__ == modname:
                for m, f in list(vars(obj).items()):
                    if inspect.isfunction(f) and not (m.startswith("__") and m not in ("__init__", "__call__")):
                        setattr(obj, m, wrap(f, f"{short}.{attr}.{m}"))
    # Names imported before wrapping (from x import f) still point at the originals in
    # the importing modules: rebind them there too.
    for modname in modules:
        mod = sys.modules.get(modname)
        if mod is None:
            continue
        for attr, obj in list(vars(mod).items()):
            src = getattr(obj, "__module__", None)
            if inspect.isfunction(obj) and src in modules and src != modname and not hasattr(obj, "__wrapped__"):
                # by the function's own name: ``from x import f as _f`` binds ``_f`` here
                new = getattr(sys.modules[src], obj.__name__, None)
                if new is not None and hasattr(new, "__wrapped__"):
                    setattr(mod, attr, new)

    def uninstall() -> None:
        for owner, name, value in reversed(undo):
            builtins_setattr(owner, name, value)
        undo.clear()

    return uninstall


def timeline(t0s: list[int], t1s: list[int], tx: list, rx: list) -> list[dict[str, Any]]:
    """Per function and side: median start offset from t0 (us), median inclusive time
    per payload (us), calls per payload; only spans that overlap [t0, t1] of a payload
    (one that began before t0, as a receiver's ``get`` waiting for the payload, has a
    negative start)."""
    rows = []
    for side, spans in (("sender", tx), ("receiver", rx)):
        spans = sorted(spans, key=lambda s: s[1])
        per: dict[str, list[tuple[float, float, int]]] = {}
        j = 0
        for a, b in zip(t0s, t1s):
            acc: dict[str, list[float]] = {}
            while j < len(spans) and spans[j][1] < a and spans[j][2] < a:
                j += 1
            k = j
            while k < len(spans) and spans[k][1] <= b:
                name, s, e = spans[k]
                if e < a:  # over before this payload (a span before it lasted longer)
                    k += 1
                    continue
                x = acc.setdefault(name, [float(s - a), 0.0, 0])
                x[1] += e - s
                x[2] += 1
                k += 1
            for name, (off, dur, cnt) in acc.items():
                per.setdefault(name, []).append((off, dur, cnt))
        for name, xs in per.items():
            rows.append({"side": side, "fn": name, "start_us": statistics.median(x[0] for x in xs) / 1e3,
                         "incl_us": statistics.median(x[1] for x in xs) / 1e3,
                         "calls": statistics.median(x[2] for x in xs), "payloads": len(xs)})
    rows.sort(key=lambda r: (r["side"] != "sender", r["start_us"]))
    return rows


# ------------------------------------------------------------------ the use
class _Use:
    """One 64-byte read of a device tensor on the current stream, host-synchronized."""

    def __init__(self) -> None:
        import torch

        from omnilink.cuda import cuda_ops

        self.ops = cuda_ops()
        self.host = torch.empty(USE_BYTES, dtype=torch.uint8, pin_memory=True)
        self.hptr = self.host.data_ptr()

    def __call__(self, ptr: int, stream: int) -> int:
        self.ops.memcpy(self.hptr, ptr, USE_BYTES, stream)
        self.ops.check(self.ops.rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        return int(self.host[0])


# ------------------------------------------------------------------ in-process copy
def copy_rows(src: str, dst: str, sizes: list[int], n: int, lat_n: int) -> dict[int, dict[str, float]]:
    import torch

    a_idx, b_idx = torch.device(src).index or 0, torch.device(dst).index or 0
    if a_idx != b_idx:
        from omnilink.cuda import cuda_ops

        for x, y in ((a_idx, b_idx), (b_idx, a_idx)):
            with torch.cuda.device(x):
                # Returns an error code (already enabled, or no peer path): either way the
                # copy below still runs, at whatever speed the pair allows.
                cuda_ops().rt.cudaDeviceEnablePeerAccess(y, 0)
    out = {}
    for nbytes in sizes:
        s = torch.empty(nbytes, dtype=torch.uint8, device=src)
        d = torch.empty(nbytes, dtype=torch.uint8, device=dst)
        ts = []
        for i in range(_count(nbytes, n, lat_n) + 3):
            torch.cuda.synchronize(src)
            torch.cuda.synchronize(dst)
            t0 = time.perf_counter()
            with torch.cuda.device(dst):
                d.copy_(s)
                torch.cuda.current_stream(dst).synchronize()
            if i >= 3:
                ts.append(time.perf_counter() - t0)
        out[nbytes] = _stats(ts)
        del s, d
    return out


# ------------------------------------------------------------------ raw floor
def _raw_receiver(conn: Any, dst: str, slot: int, sems: tuple[str, str]) -> None:
    import posix_ipc
    import torch

    from omnilink.connectors.devpool.ops import _handle_bytes
    from omnilink.cuda import cuda_ops

    pin(1)
    ops = cuda_ops()
    rt = ops.rt
    idx = torch.device(dst).index or 0
    torch.cuda.set_device(idx)
    use = _Use()
    pool = ops.check(rt.cudaMalloc(slot * 2), "cudaMalloc")
    conn.send(_handle_bytes(ops.check(rt.cudaIpcGetMemHandle(pool), "cudaIpcGetMemHandle")))
    raws = conn.recv()
    evs = []
    for raw in raws:
        h = rt.cudaIpcEventHandle_t()
        h.reserved = raw
        evs.append(ops.check(rt.cudaIpcOpenEventHandle(h), "cudaIpcOpenEventHandle"))
    stream = int(torch.cuda.current_stream().cuda_stream)
    filled, ack = (posix_ipc.Semaphore(x) for x in sems)
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            count = cmd[1]
            t1s = []
            for i in range(count):
                filled.acquire()
                k = i % 2
                ops.check(rt.cudaStreamWaitEvent(stream, evs[k], 0), "cudaStreamWaitEvent")
                use(pool + k * slot, stream)
                t1s.append(time.perf_counter())
                ack.release()
            conn.send(t1s)
    finally:
        for e in evs:
            rt.cudaEventDestroy(e)
        rt.cudaFree(pool)


def raw_rows(src: str, dst: str, sizes: list[int], n: int, lat_n: int) -> dict[int, dict[str, float]]:
    import posix_ipc
    import torch

    from omnilink.connectors.devpool.ops import _handle_bytes
    from omnilink.cuda import cuda_ops

    ops = cuda_ops()
    rt = ops.rt
    s_idx, r_idx = torch.device(src).index or 0, torch.device(dst).index or 0
    slot = max(max(sizes), 4096)
    tag = uuid.uuid4().hex[:8]
    sems = (f"/omnilink-bench-serf-{tag}", f"/omnilink-bench-sera-{tag}")
    filled = posix_ipc.Semaphore(sems[0], posix_ipc.O_CREX, mode=0o600)
    ack = posix_ipc.Semaphore(sems[1], posix_ipc.O_CREX, mode=0o600)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_receiver, args=(child, dst, slot, sems), daemon=True)
    proc.start()
    out = {}
    try:
        torch.cuda.set_device(s_idx)
        mem_raw = parent.recv()
        for a, b in ((s_idx, r_idx), (r_idx, s_idx)):
            if a != b and ops.check(rt.cudaDeviceCanAccessPeer(a, b), "cudaDeviceCanAccessPeer"):
                prev = ops.swap_device(a)
                rt.cudaDeviceEnablePeerAccess(b, 0)
                ops.restore_device(prev)
        prev = ops.swap_device(r_idx)
        h = rt.cudaIpcMemHandle_t()
        h.reserved = mem_raw
        pool = ops.check(rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle")
        flags = rt.cudaEventInterprocess | rt.cudaEventDisableTiming
        evs = [ops.check(rt.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags") for _ in range(2)]
        copy_stream = ops.check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate")
        # The events' IPC handles while their device is current (asked from another
        # device, the driver crashed the process on 2x H100).
        handles = [_handle_bytes(ops.check(rt.cudaIpcGetEventHandle(e), "cudaIpcGetEventHandle")) for e in evs]
        ops.restore_device(prev)
        parent.send(handles)
        for nbytes in sizes:
            x = torch.empty(nbytes, dtype=torch.uint8, device=src)
            torch.cuda.synchronize()
            count = _count(nbytes, n, lat_n) + 3
            parent.send(("go", count))
            t0s = []
            prev = ops.swap_device(r_idx)
            for i in range(count):
                t0s.append(time.perf_counter())
                k = i % 2
                ops.memcpy(pool + k * slot, x.data_ptr(), nbytes, copy_stream)
                ops.check(rt.cudaEventRecord(evs[k], copy_stream), "cudaEventRecord")
                filled.release()
                ack.acquire()
            ops.restore_device(prev)
            t1s = parent.recv()
            out[nbytes] = _stats([b - a for a, b in list(zip(t0s, t1s))[3:]])
        parent.send(("stop",))
        proc.join(60)
        rt.cudaStreamSynchronize(copy_stream)
        for e in evs:
            rt.cudaEventDestroy(e)
        rt.cudaStreamDestroy(copy_stream)
        rt.cudaIpcCloseMemHandle(pool)
    finally:
        if proc.is_alive():
            proc.kill()
        filled.unlink()
        ack.unlink()
    return out


# ------------------------------------------------------------------ omnilink roads
def _connect(road: str, role: str, channel: str, dev: str, pool_bytes: int) -> Any:
    import omnilink

    if road == "cuda_ipc":
        extra = {"device": dev, "pool_bytes": pool_bytes} if role == "receiver" else {}
        return omnilink.connect("cuda_ipc", channel=channel, role=role, timeout=120.0, **extra)
    if road == "shm":
        return omnilink.connect("shm", channel=channel, role=role, timeout=120.0)
    if road == "shm-ipc":
        return omnilink.connect("shm", channel=channel, role=role, timeout=120.0, device_ipc="on")
    if road == "shm-host":
        return omnilink.connect("shm", channel=channel, role=role, timeout=120.0, device_ipc="off")
    raise ValueError(road)


#: ``--payload``: ``vllm`` (token ids and the flag on the host, as vLLM-Omni sends them) or
#: ``device`` (the same tensors, all on the sender's device: no host tensor to move)
PAYLOAD = "vllm"


def _payload(hidden: Any, i: int) -> dict[str, Any]:
    import torch

    dev = hidden.device if PAYLOAD == "device" else None
    return {"hidden_states.output": hidden, "ids.output": torch.arange(16, dtype=torch.int64, device=dev) + i,
            "meta": {"finished": torch.tensor(False, device=dev), "request_id": "req-7", "chunk_id": i}}


def _ol_receiver(road: str, channel: str, dst: str, pool_bytes: int, ack_name: str, conn: Any,
                 trace: bool, only: tuple[str, ...] = (), knobs: tuple[str, ...] = (), per: int = 25) -> None:
    """The receiving process of an omnilink road. ``knobs``: receiver-side settings
    (``resolve_knob`` specs) switched in blocks of ``per`` payloads, as
    ``benchmarks/gpu/ab_serial.py`` switches the sender's."""
    import posix_ipc
    import torch

    pin(1)
    rknobs = [resolve_knob(k) for k in knobs]

    torch.cuda.set_device(torch.device(dst))
    spans: list = []
    if trace:
        install_tracer(spans, only)
    use = _Use()
    rx = _connect(road, "receiver", channel, dst, pool_bytes)
    ack = posix_ipc.Semaphore(ack_name)
    try:
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            _, prefix, count = cmd
            t1s = []
            spans.clear()
            stream = int(torch.cuda.current_stream().cuda_stream)
            for i in range(count):
                if rknobs:
                    set_knobs(rknobs, i, per)
                got = rx.get(f"{prefix}{i}", timeout=60.0, device=dst)
                h = got["hidden_states.output"]
                if not h.is_cuda or got["meta"]["chunk_id"] != i:
                    raise RuntimeError(f"{road}: payload {i} arrived wrong")
                use(h.data_ptr(), stream)
                t1s.append(time.perf_counter())
                # Checked after t1: reading a device tensor from the host is a synchronous
                # copy of its own, not part of the use the raw floor makes.
                if int(got["ids.output"][0]) != i:
                    raise RuntimeError(f"{road}: payload {i} arrived with the wrong ids")
                del got, h
                ack.release()
            conn.send((t1s, [(n, a, b) for n, a, b in spans]))
        stats = rx.stats()
        out = {f: getattr(stats, f) for f in stats.__struct_fields__}
        pool = _pool_end(rx, "_rx", "_receiver")
        out["prebuilt_hits"] = getattr(pool, "prebuilt_hits", None)  # landings whose views were made ahead
        conn.send(out)
    finally:
        rx.close()


def road_rows(road: str, src: str, dst: str, sizes: list[int], n: int, lat_n: int,
              trace: bool, only: tuple[str, ...] = (),
              samples: dict[int, list[float]] | None = None,
              ) -> tuple[dict[int, dict[str, float]], dict[int, list], dict[str, Any]]:
    """One process pair's run of ``road``: per size its stats, the timeline (``trace``)
    and the receiver's stats; ``samples``: filled with each size's one-way seconds."""
    import posix_ipc
    import torch

    torch.cuda.set_device(torch.device(src))
    tag = uuid.uuid4().hex[:8]
    channel = f"bench-serial-{road}-{tag}"
    ack_name = f"/omnilink-bench-serack-{tag}"
    ack = posix_ipc.Semaphore(ack_name, posix_ipc.O_CREX, mode=0o600)
    pool_bytes = max(256 << 20, 2 * max(sizes) + (16 << 20))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ol_receiver, args=(road, channel, dst, pool_bytes, ack_name, child, trace, only),
                       daemon=True)
    proc.start()
    spans: list = []
    if trace:
        install_tracer(spans, only)
    tx = None
    out: dict[int, dict[str, float]] = {}
    tl: dict[int, list] = {}
    try:
        if parent.recv() != "ready":
            raise RuntimeError("receiver did not start")
        tx = _connect(road, "sender", channel, src, pool_bytes)
        for nbytes in sizes:
            hidden = torch.randn(nbytes // 2, device=src).to(torch.bfloat16)
            torch.cuda.synchronize()
            count = _count(nbytes, n, lat_n) + 3
            prefix = f"s{nbytes}-"
            parent.send(("go", prefix, count))
            spans.clear()
            t0s = []
            for i in range(count):
                p, k = _payload(hidden, i), f"{prefix}{i}"
                t0s.append(time.perf_counter())
                tx.put(k, p, timeout=60.0)
                ack.acquire(60.0)  # posix_ipc.BusyError if the receiver never used it
            t1s, rspans = parent.recv()
            lat = [b - a for a, b in zip(t0s, t1s)][3:]
            out[nbytes] = _stats(lat)
            if samples is not None:
                samples[nbytes] = lat
            if trace:
                ns0 = [int(t * 1e9) for t in t0s[3:]]
                ns1 = [int(t * 1e9) for t in t1s[3:]]
                tl[nbytes] = timeline(ns0, ns1, list(spans), rspans)
            del hidden
        parent.send(("stop",))
        rstats = parent.recv()
        st = tx.stats()
        rstats.update({f"sender_{f}": getattr(st, f, None) for f in ("ipc_puts", "device_puts", "ipc_fallbacks",
                                                              "ipc_fallback_reason")})
        rstats["sender_planned_puts"] = getattr(_pool_end(tx, "_tx", "_sender"), "planned_puts", None)
        proc.join(60)
    finally:
        finish(tx, proc, ack)
    return out, tl, rstats


def finish(tx: Any, proc: Any, ack: Any) -> None:
    """Close the sender, kill a receiver process still running, unlink the ack
    semaphore (a road's teardown, whatever happened)."""
    if tx is not None:
        tx.close()
    if proc.is_alive():
        proc.kill()
    ack.unlink()


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4KiB,1MiB,64MiB,256MiB")
    ap.add_argument("--roads", default="raw,shm,cuda_ipc")
    ap.add_argument("--src", default="cuda:0")
    ap.add_argument("--dst", default="cuda:0")
    ap.add_argument("--n", type=int, default=8, help="payloads per size over 64 KiB (after 3 warm-ups)")
    ap.add_argument("--lat-n", type=int, default=400, help="payloads per size up to 64 KiB")
    ap.add_argument("--pairs", type=int, default=1,
                    help="process pairs per omnilink road: the rows pool every pair's payloads, and each "
                         "pair's p50 is printed (a pair can run slower as a whole than the next)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpus", default=None,
                    help="S,R: pin the sender to CPU S and every receiver to CPU R (default: not pinned)")
    ap.add_argument("--trace", default=None, help="a road whose two processes are traced (a second run)")
    ap.add_argument("--trace-sizes", default="4KiB")
    ap.add_argument("--trace-json", default=None)
    ap.add_argument("--payload", choices=("vllm", "device"), default="vllm",
                    help="vllm: token ids and flag on the host (default); device: every tensor on the sender's GPU")
    ap.add_argument("--trace-only", default="",
                    help="comma-separated name endings: trace only those functions (e.g. '.put,.send')")
    args = ap.parse_args(argv)
    global PAYLOAD
    PAYLOAD = args.payload
    if args.cpus:
        os.environ["OMNILINK_BENCH_CPUS"] = args.cpus  # read by the spawned receivers too
        pin(0)
    import torch

    sizes = parse_sizes(args.sizes)
    roads = [r for r in args.roads.split(",") if r]
    machine = {"gpu_src": torch.cuda.get_device_name(torch.device(args.src)),
               "gpu_dst": torch.cuda.get_device_name(torch.device(args.dst)),
               "src": args.src, "dst": args.dst, "mps": mps_serving(), "payload": PAYLOAD, "torch": torch.__version__,
               "host": platform.node(), "cpus": os.cpu_count(), "pinned": args.cpus,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    print(f"# bench_serial_gpu {json.dumps(machine)}", flush=True)
    results: dict[str, dict[int, dict[str, float]]] = {"copy": copy_rows(args.src, args.dst, sizes, args.n, args.lat_n)}
    extra: dict[str, Any] = {}
    for road in roads:
        if road == "raw":
            results["raw"] = raw_rows(args.src, args.dst, sorted(set(sizes) | {4096}), args.n, args.lat_n)
        elif args.pairs <= 1:
            results[road], _, extra[road] = road_rows(road, args.src, args.dst, sizes, args.n, args.lat_n, False)
        else:
            runs = []
            for _ in range(args.pairs):
                samples: dict[int, list[float]] = {}
                out, _, extra[road] = road_rows(road, args.src, args.dst, sizes, args.n, args.lat_n, False,
                                                samples=samples)
                runs.append((out, samples))
            results[road] = pool_pairs(runs, sizes)
    floor = results.get("raw", {}).get(4096, {}).get("p50_us")
    print(f"\nserial consumer, {args.src} -> {args.dst}, MPS {'on' if machine['mps'] else 'off'}; "
          f"p50 us per payload (p90); target = copy + 2 x raw 4 KiB ({floor and round(floor, 1)} us)")
    head = f"{'size':>8} {'copy':>16}" + "".join(f" {r:>18}" for r in roads) + f" {'target':>9}  verdict"
    print(head)
    rows = []
    for nbytes in sizes:
        c = results["copy"][nbytes]["p50_us"]
        target = c + 2 * floor if floor else None
        line = f"{format_size(nbytes):>8} {c:>9.1f} ({results['copy'][nbytes]['p90_us']:>5.0f})"
        verdicts = []
        for r in roads:
            x = results[r].get(nbytes)
            if x is None:
                line += f" {'-':>18}"
                continue
            line += f" {x['p50_us']:>10.1f} ({x['p90_us']:>5.0f})"
            if r != "raw" and target is not None:
                verdicts.append(f"{r} {'ok' if x['p50_us'] <= target else 'over'} {x['p50_us'] / target:.2f}x")
            rows.append({"road": r, "size": nbytes, **x, "copy_us": c, "target_us": target})
        line += f" {target:>9.1f}  " + ", ".join(verdicts) if target else ""
        print(line, flush=True)
    if args.pairs > 1:
        for r in roads:
            for nbytes in sizes:
                pp = results[r].get(nbytes, {}).get("pair_p50_us")
                if pp:
                    print(f"# pairs {r} {format_size(nbytes)}: p50 per pair " + " / ".join(f"{x:.1f}" for x in pp))
    for r, st in extra.items():
        keep = {k: v for k, v in st.items()
                if v and any(w in k for w in ("ipc", "device", "fallback", "host", "planned", "prebuilt"))}
        print(f"# stats {r}: {keep}")
    traces = {}
    if args.trace:
        tsizes = parse_sizes(args.trace_sizes)
        only = tuple(x for x in args.trace_only.split(",") if x)
        _, tl, _ = road_rows(args.trace, args.src, args.dst, tsizes, max(3, args.n), min(args.lat_n, 200), True,
                             only)
        for nbytes, trows in tl.items():
            print(f"\n# timeline: {args.trace}, {format_size(nbytes)}, one clock, offsets from the sender's t0 (us)")
            print(f"{'side':<9} {'start':>8} {'incl':>8} {'calls':>5}  function")
            npay = max((t["payloads"] for t in trows), default=0)
            for t in trows:  # what most payloads ran (a heartbeat now and then is left out)
                if t["incl_us"] >= 1.0 and t["payloads"] * 2 >= npay:
                    print(f"{t['side']:<9} {t['start_us']:>8.1f} {t['incl_us']:>8.1f} {t['calls']:>5g}  {t['fn']}")
            traces[str(nbytes)] = trows
        if args.trace_json:
            with open(args.trace_json, "w") as f:
                json.dump({"machine": machine, "road": args.trace, "timeline": traces}, f, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "rows": rows, "receiver_stats": extra}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
