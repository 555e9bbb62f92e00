"""The host CPU a device-IPC message costs, on a machine without a GPU: the `shm`
backend's device-IPC route (the device pool's sender and receiver, its lane, its
checks) over the host-memory double of the device operations, beside the same steps
written flat and beside the `shm` host road, in one process.

On a GPU host a stage that uses each payload before the next one arrives waits for
every microsecond of Python on both sides of a message (``bench_serial_gpu.py``), and
that Python is the same code whether the pool is device or host memory. This measures
it where the timing holds still, so that a change to the route's hot path can be
compared before it goes to a GPU. On the 2-core CPU machine the rows moved up to 1.6x
between runs, mostly together (the machine's speed of the moment): compare ratios, over
several runs. Rows, per message, median of ``--n`` after warm-up, put and get timed
apart (the receiver's get starts once the put has returned, so no row waits for the
other side):

``flat``     the route's steps and nothing else: walk the payload, build the manifest,
             encode one record, write it to a ring, post a semaphore, copy the tensors
             into a block; take the semaphore, decode, views of the block put in place.
             No validation, no lifetime tracking, no allocator, no deadline: the floor
             the route's Python sits on.
``route``    ``omnilink.connect("shm")`` with its device-IPC route on the host double
             (every tensor but int64 and bool ones counts as a device tensor: a bf16
             hidden state goes in the block as a device tensor, token ids and the flag as
             small host tensors, as on a GPU), ``get`` onto the pool's device, as a
             stream of same-shaped payloads runs: by the sender's send plan, the views
             made while the receiver waited (``PoolReceiver.prebuild``, untimed: a waiting
             get does it before the payload comes).
``general``  the same route the general way (no send plan, no views made ahead),
             alternated with ``route`` in blocks of 50 messages of the one pair.
``host``     ``omnilink.connect("shm")``'s host road (tensor_blob in the arena) for the
             same payload, for reference.

The payload is vLLM-Omni's thinker -> talker chunk: a bf16 hidden state of ``--size``
bytes, 16 int64 token ids, a bool ``finished`` flag and Python metadata. A route's
``put`` includes the payload's tensor_blob size it returns (the general way computes it
after the copy is queued, off the receiver's path on a GPU).

Usage (repository root)::

    python benchmarks/bench_route_cpu.py [--n 3000] [--size 4KiB] [--profile route] [--json FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import mmap
import os
import platform
import statistics
import struct
import sys
import time
import uuid
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from omnilink._bench.units import format_size, parse_sizes  # noqa: E402

WARM = 300


def _payload(hidden: Any, i: int) -> dict[str, Any]:
    import torch

    return {"hidden_states.output": hidden, "ids.output": torch.arange(16, dtype=torch.int64) + i,
            "meta": {"finished": torch.tensor(False), "request_id": "req-7", "chunk_id": i}}


def _median_us(xs: list[int]) -> float:
    return statistics.median(xs) / 1e3


# --------------------------------------------------------------------------- flat
class Flat:
    """The route's steps written flat (see the module docstring)."""

    def __init__(self, pool_bytes: int) -> None:
        import msgspec
        import numpy as np
        import posix_ipc
        import torch

        self.torch = torch
        self.enc, self.dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
        self.pool = mmap.mmap(-1, pool_bytes)
        self.pool_np = np.frombuffer(self.pool, dtype=np.uint8)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.pool))
        self.ring = mmap.mmap(-1, 1 << 16)
        self.sem = posix_ipc.Semaphore(f"/omnilink-bench-route-{uuid.uuid4().hex[:8]}", posix_ipc.O_CREX,
                                       mode=0o600)
        self.codes = {torch.bfloat16: 0, torch.int64: 1, torch.bool: 2}
        self.by_code = {v: k for k, v in self.codes.items()}
        self.u32 = struct.Struct("<I")

    def put(self, key: str, payload: dict[str, Any]) -> None:
        tensor = self.torch.Tensor
        codes = self.codes
        host: dict[str, Any] = {}
        items, entries = [], []
        off = 0
        for k, v in payload.items():
            if isinstance(v, tensor):
                n = v.nbytes
                off = (off + 255) & -256
                entries.append([codes[v.dtype], off, n, list(v.shape), [k]])
                items.append((off, v, n))
                off += n
                host[k] = None
            elif isinstance(v, dict):
                h = {}
                for k2, v2 in v.items():
                    if isinstance(v2, tensor):
                        n = v2.nbytes
                        off = (off + 255) & -256
                        entries.append([codes[v2.dtype], off, n, list(v2.shape), [k, k2]])
                        items.append((off, v2, n))
                        off += n
                        h[k2] = None
                    else:
                        h[k2] = v2
                host[k] = h
            else:
                host[k] = v
        body = self.enc.encode([key, {"d": [0, off, entries], "h": host}])
        self.u32.pack_into(self.ring, 0, len(body))
        self.ring[4:4 + len(body)] = body
        self.sem.release()
        for o, t, n in items:  # the copy into the block
            ctypes.memmove(self.base + o, t.data_ptr(), n)

    def get(self, key: str) -> Any:
        self.sem.acquire()
        n = self.u32.unpack_from(self.ring, 0)[0]
        got_key, m = self.dec.decode(self.ring[4:4 + n])
        if got_key != key:
            raise RuntimeError(f"flat: {got_key!r} arrived for {key!r}")
        (blk, total, entries), out = m["d"], m["h"]
        block = self.torch.from_numpy(self.pool_np[blk:blk + total])
        for code, o, nb, shape, path in entries:
            node = out
            for p in path[:-1]:
                node = node[p]
            node[path[-1]] = block[o:o + nb].view(self.by_code[code]).view(shape)
        return out

    def close(self) -> None:
        self.sem.unlink()


# -------------------------------------------------------------------------- route
def _route_pair(channel: str) -> tuple[Any, Any]:
    """A shm sender and receiver on ``channel`` whose device-IPC route runs on the host
    double, int64 and bool tensors standing for host tensors, gets landing on the pool's
    device (no walk to move anything)."""
    import torch

    import omnilink
    import omnilink.cuda
    from tests import cuda_ipc_double as double

    Route = double.HostLikeIpcRoute

    # The double's pool is on "device 0" and a get without ``device`` asks for host
    # copies; on a GPU a get onto the pool's device returns the views as they are.
    omnilink.cuda.map_tensors = lambda payload, fn: payload  # type: ignore[assignment]
    rx = omnilink.connect("shm", channel=channel, role="receiver", device_ipc="off")
    tx = omnilink.connect("shm", channel=channel, role="sender", linger=0, device_ipc="off")
    rx._ipc = Route(rx, "on", 4 << 20, 0, None)
    tx._ipc = Route(tx, "on", 4 << 20, 0, None)
    double.route_put(tx, "attach", {"x": torch.zeros(8)})  # the sender maps the pool
    rx.get("attach", timeout=5.0)
    return tx, rx


def _timed(name: str, put: Any, get: Any, hidden: Any, count: int,
           before: Any = None) -> tuple[list[tuple[int, int]], list[int]]:
    """``count`` messages after ``WARM``: each payload ``put(key, payload)`` then
    ``get(key)`` (checked, dropped); per timed message ``(block, put ns)`` and the get
    ns. ``before(i)``: called before message ``i``, returns its block (0 without it)."""
    puts: list[tuple[int, int]] = []
    gets: list[int] = []
    for i in range(WARM + count):
        block = before(i) if before is not None else 0
        p = _payload(hidden, i)
        k = f"{name}{i}"
        t0 = time.perf_counter_ns()
        put(k, p)
        t1 = time.perf_counter_ns()
        got = get(k)
        t2 = time.perf_counter_ns()
        if got["meta"]["chunk_id"] != i or int(got["ids.output"][0]) != i:
            raise RuntimeError(f"{name}: payload arrived wrong")
        del got
        if i >= WARM:
            puts.append((block, t1 - t0))
            gets.append(t2 - t1)
    return puts, gets


def _row(puts: list[tuple[int, int]], gets: list[int]) -> dict[str, float]:
    return {"put_us": _median_us([ns for _, ns in puts]), "get_us": _median_us(gets)}


def _time_rows(args: argparse.Namespace, nbytes: int) -> dict[str, dict[str, float]]:
    import torch

    import omnilink
    from omnilink.connectors.devpool import receiver as pool_receiver
    from omnilink.connectors.devpool import sender as pool_sender

    hidden = torch.randn(nbytes // 2).to(torch.bfloat16)
    out: dict[str, dict[str, float]] = {}
    flat = Flat(max(4 << 20, 2 * nbytes))
    try:
        out["flat"] = _row(*_timed("flat", flat.put, flat.get, hidden, args.n))
    finally:
        flat.close()
    # The route by its send plan with the views made while the receiver waited
    # (``idle``, untimed: a get that waits does it before the payload comes), and the
    # route the general way (no plan, no views made ahead), alternated in blocks of 50
    # messages in the one pair (drift cancels out).
    tx, rx = _route_pair(f"bench-route-{uuid.uuid4().hex[:8]}")
    route = rx._ipc

    def switch(i: int) -> int:
        planned = (i // 50) % 2 == 0
        pool_sender.PoolSender.plans = planned
        pool_receiver.PREBUILD = planned
        if planned:
            rx._wait_hook()  # what a get that waits does first (``PoolReceiver.prebuild``)
        return 0 if planned else 1

    try:
        puts, gets = _timed("r", lambda k, p: tx.put(k, p, timeout=5.0), lambda k: rx.get(k, timeout=5.0), hidden,
                            2 * args.n, switch)
        for name, b in (("route", 0), ("general", 1)):
            out[name] = {"put_us": _median_us([ns for k, ns in puts if k == b]),
                         "get_us": _median_us([ns for (k, _), ns in zip(puts, gets) if k == b])}
        if tx.stats().ipc_puts < WARM + 2 * args.n:
            raise RuntimeError("route: payloads went by the host road, not the device-IPC route")
        if route._rx.prebuilt_hits < args.n // 2 or tx._ipc._tx.planned_puts < args.n // 2:
            raise RuntimeError("route: payloads did not go by the send plan with their views made ahead")
        if args.profile == "route":
            switch(0)  # by the send plan, as the route row (the loop may have ended on the general way)
            _profile(lambda i: (tx.put(f"p{i}", _payload(hidden, i), timeout=5.0), rx.get(f"p{i}", timeout=5.0)),
                     args.n)
    finally:
        pool_sender.PoolSender.plans = True
        pool_receiver.PREBUILD = True
        tx.close()
        rx.close()
    ch = f"bench-route-host-{uuid.uuid4().hex[:8]}"
    with omnilink.connect("shm", channel=ch, role="receiver", device_ipc="off") as hrx, \
            omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="off") as htx:
        out["host"] = _row(*_timed("h", lambda k, p: htx.put(k, p, timeout=5.0), lambda k: hrx.get(k, timeout=5.0),
                                   hidden, args.n))
    return out


def _profile(one: Any, n: int) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for i in range(n):
        one(i)
    prof.disable()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(40)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=3000, help="messages timed per row (after 300 of warm-up)")
    ap.add_argument("--size", default="4KiB", help="the hidden state's bytes")
    ap.add_argument("--profile", choices=("route",), default=None, help="then cProfile n messages of the route")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    (nbytes,) = parse_sizes(args.size)
    import torch

    # Each row twice, the first pass discarded: the first row of a fresh process ran
    # up to 1.5x slower than the same row later in it (caches, the CPU's clock).
    _time_rows(argparse.Namespace(n=min(args.n, 500), profile=None), nbytes)
    rows = _time_rows(args, nbytes)
    machine = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
               "python": platform.python_version(), "torch": torch.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    flat = rows["flat"]
    print(f"# bench_route_cpu {json.dumps(machine)}")
    print(f"\nhost CPU per message, {format_size(nbytes)} hidden state + ids + flag + metadata, median us "
          f"(x the flat steps')")
    print(f"{'row':<8} {'put':>16} {'get':>16}")
    for name in ("flat", "route", "general", "host"):
        r = rows[name]
        print(f"{name:<8} {r['put_us']:>8.1f} ({r['put_us'] / flat['put_us']:>4.1f}x) "
              f"{r['get_us']:>8.1f} ({r['get_us'] / flat['get_us']:>4.1f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "size": nbytes, "n": args.n, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
