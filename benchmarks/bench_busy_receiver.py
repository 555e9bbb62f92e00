"""What a sending stage feels while its receiver computes: ``put`` time with the
receiving process busy in Python, per backend.

``python benchmarks/bench_busy_receiver.py [--backends shm,zmq,nixl,nccl] [--busy-ms 0,20]
[--n 60] [--gap-ms 7] [--size 4KiB] [--device cpu|cuda] [--json FILE]``

Two processes, one payload shaped as a stage's chunk (a bf16 hidden state of ``--size``
and a flag). The sender puts a payload every ``--gap-ms`` and times each ``put``; the
receiver gets each one, then runs ``--busy-ms`` of pure-Python work (a stage's step:
it holds its GIL, as a model's Python code does between kernel launches), so with a
busy time above the gap every payload arrives while the receiving process computes.
A backend whose ``put`` waits for an answer that the receiving process's threads must
give feels that process's GIL: they wait for it up to the interpreter's switch
interval (5 ms by default). Rows per backend and busy time: ``put`` p50 / p90 in
microseconds (after 5 warm-up payloads), and busy over idle at p50.

Backends: ``shm`` (its default options), ``zmq`` over tcp on loopback, ``nixl`` over
UCX ``tcp`` on loopback (where NIXL is installed), ``nccl`` over gloo (host memory).
With ``--device cuda`` the hidden state is a CUDA tensor of the sender's GPU (cuda:0)
and the receiver's GPU is cuda:1 where there are two, else cuda:0: ``shm`` (device IPC
as it chooses), ``cuda_ipc`` (its pool on the receiver's GPU), ``nixl`` (a device pool
there, UCX's own transports) and ``nccl`` over NCCL (two GPUs only); each row then also
gives how long the sender's stream took to drain after each ``put`` (what it queued
there: a copy, an NCCL send that waits for its receive to be posted).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WAIT = 60.0


def _payload(device: str, nbytes: int) -> dict[str, Any]:
    import torch

    return {"hidden_states.output": torch.zeros(max(1, nbytes // 2), dtype=torch.bfloat16, device=device),
            "meta": {"finished": False}}


def _devices(kind: str) -> tuple[str, str]:
    """(sender's device, receiver's device)."""
    if kind == "cpu":
        return "cpu", "cpu"
    import torch

    return "cuda:0", ("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")


def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    x = 0
    while time.perf_counter() < end:
        x += 1


def _open(backend: str, role: str, channel: str, ports: tuple[int, ...], endpoint: str | None, dev: str) -> Any:
    import omnilink

    cuda = dev.startswith("cuda")
    if cuda:
        import torch

        torch.cuda.set_device(torch.device(dev))
    if backend == "shm":
        return omnilink.connect("shm", channel=channel, role=role, timeout=WAIT)
    if backend == "cuda_ipc":
        extra = {"device": dev} if role == "receiver" else {}
        return omnilink.connect("cuda_ipc", channel=channel, role=role, timeout=WAIT, **extra)
    if backend == "zmq":
        return omnilink.connect("zmq", channel=channel, role=role, timeout=WAIT,
                                endpoint=endpoint or f"tcp://127.0.0.1:{ports[0]}")
    if backend == "nixl":
        os.environ["UCX_TLS"] = "tcp"
        if cuda:
            from omnilink.connectors.nixl.agent import nvidia_gpu_present

            if nvidia_gpu_present():
                del os.environ["UCX_TLS"]  # UCX's own choice (a CUDA transport among them)
        if role == "receiver":
            extra = {"device": dev} if cuda else {}
            return omnilink.connect("nixl", channel=channel, role=role, endpoint="tcp://127.0.0.1:*", timeout=WAIT,
                                    **extra)
        return omnilink.connect("nixl", channel=channel, role=role, endpoint=endpoint, timeout=WAIT)
    if backend == "nccl":
        rank = 0 if role == "sender" else 1
        conn = omnilink.connect("nccl", channel=channel, role=role, rank=rank, backend="nccl" if cuda else "gloo",
                                device=dev, master_port=ports[0], timeout=WAIT)
        conn.wait_connected(WAIT)
        return conn
    raise ValueError(f"unknown backend {backend!r}")


def _receiver(backend: str, channel: str, ports: tuple[int, ...], n: int, busy_ms: float, dev: str, q: Any) -> None:
    if backend != "nixl":
        q.put(("endpoint", None))  # the sender may start (an nccl pair opens together)
    conn = _open(backend, "receiver", channel, ports, None, dev)
    try:
        if backend == "nixl":
            q.put(("endpoint", conn.endpoint))  # the port it bound
        for i in range(n):
            conn.get(f"c{i}", timeout=WAIT)
            _busy(busy_ms)
    finally:
        conn.close()
    q.put(("done", None))


def _sender(backend: str, channel: str, ports: tuple[int, ...], n: int, gap_ms: float, endpoint: str | None,
            dev: str, nbytes: int, q: Any, closing: Any) -> None:
    conn = _open(backend, "sender", channel, ports, endpoint, dev)
    try:
        payload = _payload(dev, nbytes)
        stream = None
        if dev.startswith("cuda"):
            import torch

            stream = torch.cuda.current_stream(torch.device(dev))
        times, drains = [], []
        for i in range(n):
            t0 = time.perf_counter()
            conn.put(f"c{i}", payload, timeout=WAIT)
            t1 = time.perf_counter()
            times.append((t1 - t0) * 1e6)
            if stream is not None:
                stream.synchronize()  # what put queued on this stream
                drains.append((time.perf_counter() - t1) * 1e6)
            time.sleep(gap_ms / 1000)
        q.put(("times", (times, drains)))
        closing.wait(WAIT)  # the receiver closes first (an nccl pair's store lives here)
    finally:
        conn.close()


def run_one(backend: str, busy_ms: float, n: int, gap_ms: float, device: str = "cpu",
            nbytes: int = 4096) -> dict[str, Any]:
    import multiprocessing as mp

    from omnilink._bench.ports import free_ports

    ctx = mp.get_context("spawn")
    ports = free_ports(1)
    channel = f"busy-{backend}-{os.getpid()}-{int(busy_ms)}"
    rq, sq = ctx.Queue(), ctx.Queue()
    closing = ctx.Event()
    src, dst = _devices(device)
    rx = ctx.Process(target=_receiver, args=(backend, channel, ports, n, busy_ms, dst, rq), daemon=True)
    rx.start()
    procs = [rx]
    try:
        kind, endpoint = rq.get(timeout=WAIT)
        tx = ctx.Process(target=_sender, args=(backend, channel, ports, n, gap_ms, endpoint, src, nbytes, sq,
                                               closing), daemon=True)
        tx.start()
        procs.append(tx)
        kind, (times, drains) = sq.get(timeout=WAIT + n * (busy_ms + gap_ms) / 1000)
        rq.get(timeout=WAIT)
        rx.join(WAIT)
        closing.set()
        tx.join(WAIT)
    finally:
        closing.set()
        for p in procs:
            if p.is_alive():
                p.kill()
    ts = sorted(times[5:])
    row = {"backend": backend, "busy_ms": busy_ms, "gap_ms": gap_ms, "n": len(ts), "src": src, "dst": dst,
           "size": nbytes, "put_p50_us": statistics.median(ts), "put_p90_us": ts[int(len(ts) * 0.9)],
           "put_max_us": ts[-1]}
    if drains:
        ds = sorted(drains[5:])
        row.update(stream_p50_us=statistics.median(ds), stream_p90_us=ds[int(len(ds) * 0.9)])
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="shm,zmq,nixl,nccl")
    ap.add_argument("--busy-ms", default="0,20", help="the receiver's Python work after each get, ms (comma-separated)")
    ap.add_argument("--n", type=int, default=60, help="payloads per row (5 more as warm-up)")
    ap.add_argument("--gap-ms", type=float, default=7.0, help="the sender's pause between puts")
    ap.add_argument("--size", default="4KiB", help="the hidden state's bytes (e.g. 4KiB, 1MiB)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the hidden state lives (cuda: cuda:0 to cuda:1, or cuda:0 to cuda:0)")
    ap.add_argument("--json", help="write the run here (one JSON object)")
    args = ap.parse_args(argv)
    from omnilink._bench.machine import machine_record
    from omnilink._bench.units import parse_sizes
    from omnilink.connectors import backend_unavailable

    (nbytes,) = parse_sizes(args.size)

    rows = []
    skipped = {}
    for backend in args.backends.split(","):
        why = backend_unavailable(backend)
        if why is not None:
            skipped[backend] = why
            print(f"{backend}: skipped ({why})", flush=True)
            continue
        for busy in (float(x) for x in args.busy_ms.split(",")):
            r = run_one(backend, busy, args.n + 5, args.gap_ms, args.device, nbytes)
            rows.append(r)
            stream = (f"; its stream drained {r['stream_p50_us']:8.0f} us p50 after put"
                      if "stream_p50_us" in r else "")
            print(f"{backend:5s} receiver busy {busy:5.1f} ms: put p50 {r['put_p50_us']:8.0f} us, "
                  f"p90 {r['put_p90_us']:8.0f} us, max {r['put_max_us']:8.0f} us{stream}", flush=True)
    import datetime

    run = {"scenario": "busy-receiver", "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine_record(include_cuda=args.device == "cuda"), "args": vars(args), "rows": rows,
           "skipped": skipped, "switch_interval_s": sys.getswitchinterval()}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(run, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
