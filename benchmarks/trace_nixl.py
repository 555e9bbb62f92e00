"""Both processes of a nixl link on one clock: where a serial message's time goes.

``python benchmarks/trace_nixl.py [--device cpu|cuda] [--size 4KiB] [--n 260] [--warm 120]``

A receiver (its pool on cuda:1 with ``--device cuda``, on cuda:0 where the machine has
one GPU, else host memory) and a sender (a bf16 tensor on cuda:0, or on the host) in two
processes; the sender puts one payload (the tensor plus a flag), the receiver gets it
and answers over a pipe, then the next.
The first ``--warm`` payloads run untraced (their p50 is printed: the figure without
the wrappers); the rest run with every function of the nixl backend, ``omnilink.blob``,
``omnilink._util``, the connector base and ``omnilink.cuda.runtime`` wrapped
(``bench_serial_gpu.install_tracer``, ``time.perf_counter_ns``: CLOCK_MONOTONIC, one
clock for both processes). Printed: per function and side, the median start offset
from the sender's ``put`` and the median time per payload (``bench_serial_gpu.timeline``).

For finding the fixed cost, not for figures to quote (``bench_nixl.py`` is that).
UCX reads ``UCX_TLS`` from the environment (set it as the benchmark does).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from omnilink._bench.units import parse_sizes  # noqa: E402

#: The modules whose functions are timed.
MODULES = (
    "omnilink.blob", "omnilink._util", "omnilink.connectors.base", "omnilink.connectors.nixl.connector",
    "omnilink.connectors.nixl.agent", "omnilink.connectors.nixl.pool", "omnilink.connectors.nixl.wire",
    "omnilink.connectors.nixl.regcache", "omnilink.cuda.runtime",
)
WAIT = 60.0


def _tracer() -> Any:
    import bench_serial_gpu

    bench_serial_gpu.TRACED = MODULES
    return bench_serial_gpu


def _receiver(opts: dict[str, Any], pipe: Any, out: Any) -> None:
    import omnilink

    b = _tracer()
    dev = None
    if opts["device"] == "cuda":
        import torch

        idx = 1 if torch.cuda.device_count() > 1 else 0  # one GPU: both processes on it
        torch.cuda.set_device(idx)
        dev = f"cuda:{idx}"
    conn = omnilink.connect("nixl", channel="trace/nixl", role="receiver", endpoint="tcp://127.0.0.1:*",
                            pool_bytes=max(64 << 20, 4 * opts["size"]), device=dev, timeout=WAIT)
    pipe.send(conn.endpoint)
    spans: list = []
    undo = None
    for i in range(opts["n"]):
        if i == opts["warm"]:
            undo = b.install_tracer(spans)
        got = conn.get(f"k{i}", timeout=WAIT)
        del got
        pipe.send(1)
    if undo is not None:
        undo()
    out.put(("rx", spans))
    pipe.recv()
    conn.close()


def _sender(opts: dict[str, Any], pipe: Any, out: Any) -> None:
    import torch

    import omnilink

    b = _tracer()
    dev = "cpu"
    if opts["device"] == "cuda":
        torch.cuda.set_device(0)
        dev = "cuda:0"
    conn = omnilink.connect("nixl", channel="trace/nixl", role="sender", endpoint=pipe.recv(), timeout=WAIT)
    payload = {"hidden": torch.ones(opts["size"] // 2, dtype=torch.bfloat16, device=dev), "meta": {"finished": False}}
    spans: list = []
    undo = None
    t0s: list[int] = []
    t1s: list[int] = []
    base: list[float] = []
    for i in range(opts["n"]):
        if i == opts["warm"]:
            undo = b.install_tracer(spans)
        t0 = time.perf_counter_ns()
        conn.put(f"k{i}", payload, timeout=WAIT)
        pipe.recv()
        t1 = time.perf_counter_ns()
        if i >= opts["warm"]:
            t0s.append(t0)
            t1s.append(t1)
        elif i >= opts["warm"] // 5:
            base.append((t1 - t0) / 1e3)
    if undo is not None:
        undo()
    out.put(("tx", spans, t0s, t1s, base))
    pipe.send(0)
    conn.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--size", default="4KiB")
    ap.add_argument("--n", type=int, default=260, help="payloads in all")
    ap.add_argument("--warm", type=int, default=120, help="untraced payloads first")
    ap.add_argument("--timeout", type=float, default=150.0)
    args = ap.parse_args(argv)
    if not 0 < args.warm < args.n:
        ap.error("--warm must be between 0 and --n")
    opts = {"device": args.device, "size": parse_sizes(args.size)[0], "n": args.n, "warm": args.warm}
    import bench_serial_gpu as b

    ctx = mp.get_context("spawn")
    a, c = ctx.Pipe()
    out = ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(opts, a, out), daemon=True),
             ctx.Process(target=_sender, args=(opts, c, out), daemon=True)]
    for p in procs:
        p.start()
    got: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + args.timeout
        while len(got) < 2:
            try:
                msg = out.get(timeout=1.0)
            except Exception:  # queue.Empty
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    print("trace_nixl: a process died or the run timed out", file=sys.stderr)
                    return 1
                continue
            got[msg[0]] = msg[1:]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    tx_spans, t0s, t1s, base = got["tx"]
    (rx_spans,) = got["rx"]
    traced = statistics.median((y - x) / 1e3 for x, y in zip(t0s, t1s))
    print(f"# nixl serial {args.size} ({args.device}): untraced p50 {statistics.median(base):.1f} us per message "
          f"(put -> get -> answer), traced {traced:.1f} us")
    print(f"{'side':<9} {'start':>8} {'incl':>8} {'calls':>5}  function")
    for t in b.timeline(t0s, t1s, tx_spans, rx_spans):
        if t["incl_us"] >= 2.0 and t["payloads"] * 2 >= len(t0s):
            print(f"{t['side']:<9} {t['start_us']:>8.1f} {t['incl_us']:>8.1f} {t['calls']:>5g}  {t['fn']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
