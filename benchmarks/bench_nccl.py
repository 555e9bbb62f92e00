"""The nccl connector against raw ``torch.distributed`` send/recv, side by side in one run.

Benchmarks are hard: this runs two processes on one machine (rank 0 sends, rank 1
receives; over NCCL rank 0 is on cuda:0 and rank 1 on cuda:1, over gloo both on the
CPU) and reports medians of repeated rounds. For each size, in the SAME run, the
variants alternate round by round:

- ``raw``       ``torch.distributed.send``/``recv`` of one bf16 tensor of SIZE bytes over
                the default process group, received into a preallocated tensor (the
                ceiling: no header, no allocation, no flow control);
- ``omnilink``  ``NcclConnector.put``/``get`` of ``{"hidden_states.output": bf16
                tensor, "meta": {...}}`` (protocol 6): the header rides the doorbell
                message (a plain socket) the sender sends just before it queues the
                tensor's send; the receiving ``get`` reads it, posts the receive into
                a freshly allocated tensor and returns with its stream ordered after
                the bytes (with ``--bell-bytes`` set, a payload of at most that many
                device bytes rides the doorbell whole);
- ``omnilink +16 small`` (1 MiB and up) the same plus 16 small tensors of 4 KiB
                (positions, masks, ids...), which travel together in one packed send;
                its ``vs plain`` column is its GB/s over the ``omnilink`` row's;
- ``raw serial`` / ``omnilink serial``  a consumer that uses each payload before the
                next is sent: the receiver sums the SIZE tensor on its stream and reads
                the sum on the host, then answers with a 1-element ``torch.distributed``
                send that the sender waits for (the same answer for both); ratio =
                omnilink serial / raw serial.

Each streaming round moves ``iters`` payloads back to back (serial rounds at most 50)
and is timed on the receiver from a barrier to the last arrival
(``torch.cuda.synchronize`` on NCCL); GB/s = bytes of the SIZE tensor / seconds;
ratio = GB/s / raw GB/s of the same size.

Latency (``--latency-iters``, 4 KiB): ping-pong between the ranks, one-way = half the
round trip, p50 over the iterations. Both variants wait for each receive on the host
(``torch.cuda.synchronize`` on NCCL) before they answer (``get`` orders the caller's
stream after the bytes; the host does not wait by itself). ``--latency-ab
OPTION=VALUE`` adds a second connector with those options (``bell_bytes``,
``pack_bytes``, ``inline_bytes``, ``spin_us``, ``templates`` 0/1) whose ping-pongs interleave with the
first's in the same pair of processes (row ``omnilink-ab``): an A/B out of reach of the
spread between process pairs.

Usage::

    python benchmarks/bench_nccl.py [--backend nccl|gloo] [--sizes 1MiB,64MiB,256MiB]
        [--rounds 5] [--iters N] [--latency-iters 200] [--json FILE]
        [--bell-bytes 0] [--latency-ab OPTION=VALUE] [--profile] [--trace] [--no-templates]

On a CPU-only machine: ``--backend gloo`` (the default is nccl when two GPUs are
visible, else gloo). A worker that hangs prints every thread's Python stack
(``faulthandler``) and exits 15 s before ``--timeout``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from typing import Any

from omnilink._bench.ports import free_ports
from omnilink._bench.units import format_size, parse_sizes

COLS = 4096  # bf16 columns: a hidden state of width 4096
SMALL = 16  # small tensors of the "+16 small" variant
SMALL_BYTES = 4096
LATENCY_BYTES = 4096


def iters_for(nbytes: int, backend: str) -> int:
    # Enough payloads per round that one round lasts >= ~5 ms even at 400 GB/s (NCCL);
    # gloo moves a few GB/s at best.
    budget = (2 << 30) if backend == "nccl" else (256 << 20)
    return max(10, min(400, budget // nbytes))


#: What ``--profile`` times in both processes, perf_counter_ns around each call: the
#: sender's put, its plan, its copy of small device tensors to host and its sends; the
#: receiver's doorbell check (``read_bell``), its posting of one payload (``_post_one``:
#: allocation, bulk receives, views), the views and tree, the hand-out and ``get``
#: (which includes waiting).
PROFILED_WIRE = ("plan_send", "encode_envelope", "read_bell", "build_views", "decode_tree")
PROFILED_CONNECTOR = ("_put", "_stage_region", "_send_nccl", "_send_gloo", "_post", "_post_one", "_hand_out",
                      "_get")


def install_step_timers() -> dict[str, list[int]]:
    """Wrap the steps of ``PROFILED_*``; return ``{step: [total ns, calls]}``, filled as
    they run (in every thread of this process)."""
    import functools

    from omnilink.connectors.nccl import connector, wire

    acc: dict[str, list[int]] = {}
    targets = [(wire, n) for n in PROFILED_WIRE] + [(connector.NcclConnector, n) for n in PROFILED_CONNECTOR]
    for owner, name in targets:
        fn = getattr(owner, name)
        cell = acc.setdefault(name, [0, 0])

        def timed(*args: Any, _fn: Any = fn, _cell: list[int] = cell, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return _fn(*args, **kwargs)
            finally:
                _cell[0] += time.perf_counter_ns() - t0
                _cell[1] += 1

        setattr(owner, name, functools.wraps(fn)(timed))
    return acc


#: What ``--trace`` wraps with span recorders in both processes (every function and
#: method defined there; ``bench_serial_gpu.install_tracer``).
NCCL_TRACED = (
    "omnilink.blob", "omnilink._util", "omnilink.connectors.base", "omnilink.connectors.nccl.connector",
    "omnilink.connectors.nccl.wire", "omnilink.cuda.nccl", "omnilink.cuda.runtime", "omnilink.cuda.events",
    "omnilink.connectors.nccl", "omnilink.cuda",
)


def ping_pong(conn: Any, rank: int, sync: Any, ping: str, pong: str, payload: Any,
              marks: list[int] | None = None) -> None:
    """One exchange of the 4 KiB latency: rank 0 puts ``ping`` and waits for ``pong``;
    rank 1 gets ``ping``, synchronizes its device, and puts it back as ``pong``.
    ``marks``: rank 0 appends when its put begins, rank 1 once the ping is on its host
    (``perf_counter_ns``, one clock for both processes)."""
    if rank == 0:
        if marks is not None:
            marks.append(time.perf_counter_ns())
        conn.put(ping, payload)
        conn.get(pong)
        sync()
    else:
        got = conn.get(ping)
        sync()
        if marks is not None:
            marks.append(time.perf_counter_ns())
        conn.put(pong, got)


def trace_rows(marks0: list[int], marks1: list[int], spans0: list, spans1: list) -> list[dict[str, Any]]:
    """The ping half of each traced exchange on one clock (``bench_serial_gpu.timeline``):
    rank 0's spans as the sender's, rank 1's as the receiver's, from rank 0's put to the
    ping on rank 1's host."""
    import bench_serial_gpu

    n = min(len(marks0), len(marks1))
    return bench_serial_gpu.timeline(marks0[:n], marks1[:n], spans0, spans1)


#: Connector options ``--latency-ab`` may set.
_AB_OPTIONS = ("bell_bytes", "pack_bytes", "inline_bytes", "spin_us", "templates")


def join_pair(rank: int, port: int, backend: str) -> tuple[Any, Any, Any]:
    """This rank's default process group of two over ``tcp://127.0.0.1:port`` (NCCL with
    cuda:``rank`` as the device, or gloo on the CPU); returns ``(device, sync,
    barrier)``: ``sync()`` waits for the device, ``barrier()`` for both ranks, then
    syncs."""
    import torch
    import torch.distributed as dist

    nccl = backend == "nccl"
    if nccl:
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=dev,
        )
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def sync() -> None:
        if nccl:
            torch.cuda.synchronize(dev)

    def barrier() -> None:
        if nccl:
            dist.barrier(device_ids=[rank])
        else:
            dist.barrier()
        sync()

    return dev, sync, barrier


def _worker(rank: int, ports: tuple[int, int], opts: dict[str, Any], out: Any) -> None:
    import faulthandler

    # A hang ends this process with every thread's Python stack on stderr, before the
    # parent gives up on the run.
    faulthandler.dump_traceback_later(opts["hang_s"], exit=True)
    import torch
    import torch.distributed as dist

    import omnilink

    steps = install_step_timers() if opts["profile"] else None

    backend = opts["backend"]
    nccl = backend == "nccl"
    dev, sync, barrier = join_pair(rank, ports[0], backend)
    # "dual": the latency ping-pong answers on the same connector.
    conn = omnilink.connect(
        "nccl", channel="bench/nccl", role="dual", rank=rank, backend=backend, device=str(dev),
        master_port=ports[1], timeout=120.0, bell_bytes=opts["bell_bytes"], pack_bytes=opts["pack_bytes"],
        templates=opts["templates"],
    )
    conn.wait_connected(120.0)
    # ``--latency-ab``: a second connector (its own channel and communicators) with the
    # options given, its ping-pongs interleaved with the first's in this pair of ranks.
    conn_ab = None
    if opts["latency_ab"]:
        conn_ab = omnilink.connect(
            "nccl", channel="bench/nccl-ab", role="dual", rank=rank, backend=backend, device=str(dev),
            master_port=ports[2], timeout=120.0,
            **{"bell_bytes": opts["bell_bytes"], "pack_bytes": opts["pack_bytes"], "templates": opts["templates"],
               **opts["latency_ab"]},
        )
        conn_ab.wait_connected(120.0)
    results: list[dict[str, Any]] = []

    def rand_bf16(n: int, seed: int) -> Any:
        g = torch.Generator(device=dev).manual_seed(seed)
        return torch.randn(n, device=dev, generator=g).to(torch.bfloat16)

    def raw_round(nbytes: int, n: int) -> float:
        buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
        if rank == 0:
            buf.copy_(rand_bf16(nbytes // 2, nbytes))
        barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            if rank == 0:
                dist.send(buf, dst=1)
            else:
                dist.recv(buf, src=0)
        sync()
        return time.perf_counter() - t0

    seq = [0]

    def make_payload(nbytes: int, variant: str, seed: int) -> dict[str, Any]:
        payload: dict[str, Any] = {"meta": {"finished": False}}
        rows, rest = divmod(nbytes // 2, COLS)
        hidden = rand_bf16(nbytes // 2, seed)
        payload["hidden_states.output"] = hidden.view(rows, COLS) if not rest else hidden
        if variant == "omnilink +16 small":
            payload["small"] = [rand_bf16(SMALL_BYTES // 2, seed + 100 + i) for i in range(SMALL)]
        return payload

    def conn_round(nbytes: int, n: int, variant: str) -> float:
        payload = make_payload(nbytes, variant, nbytes) if rank == 0 else None
        barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            key = f"req{seq[0]}_0_0"
            seq[0] += 1
            if rank == 0:
                conn.put(key, payload)
            else:
                got = conn.get(key)
                del got
        sync()
        return time.perf_counter() - t0

    ack = torch.zeros(1, dtype=torch.int32, device=dev)

    def consume(t: Any) -> float:
        # Uses the payload on the receiver's stream and reads the result on the host.
        return float(torch.sum(t, dtype=torch.float32).item())

    def answer() -> None:
        if rank == 1:
            dist.send(ack, dst=0)
        else:
            dist.recv(ack, src=1)
            sync()

    def serial_round(nbytes: int, n: int, variant: str) -> float:
        """One payload at a time: the sender sends the next once the receiver used it."""
        buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
        payload = None
        if rank == 0:
            buf.copy_(rand_bf16(nbytes // 2, nbytes))
            payload = make_payload(nbytes, "omnilink", nbytes)
        barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            if variant == "raw serial":
                if rank == 0:
                    dist.send(buf, dst=1)
                else:
                    dist.recv(buf, src=0)
                    consume(buf)
            else:
                key = f"req{seq[0]}_0_0"
                seq[0] += 1
                if rank == 0:
                    conn.put(key, payload)
                else:
                    consume(conn.get(key)["hidden_states.output"])
            answer()
        sync()
        return time.perf_counter() - t0

    def flat_tensors(payload: dict[str, Any]) -> list[Any]:
        ts = []
        for name in ("hidden_states.output", "small"):
            v = payload.get(name)
            if v is not None:
                ts.extend(v if isinstance(v, list) else [v])
        return ts

    def check(nbytes: int, variant: str) -> bool:
        """One payload compared bit for bit with what the sender sends by raw send."""
        key = f"check{nbytes}-{variant}"
        if rank == 0:
            payload = make_payload(nbytes, variant, 7 + nbytes)
            conn.put(key, payload)
            for t in flat_tensors(payload):
                dist.send(t.contiguous(), dst=1)
            return True
        got = flat_tensors(conn.get(key))
        ok = True
        for t in got:
            ref = torch.empty_like(t)
            dist.recv(ref, src=0)
            ok = ok and t.device == dev and torch.equal(t.view(torch.int16), ref.view(torch.int16))
        return ok

    marks: list[int] | None = [] if opts.get("trace") else None
    spans: list = []

    def latency(n: int) -> dict[str, list[float]]:
        uninstall = None
        if marks is not None:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import bench_serial_gpu

            uninstall = bench_serial_gpu.install_tracer(spans, modules=NCCL_TRACED)
        try:
            return _latency(n)
        finally:
            if uninstall is not None:
                uninstall()

    def _latency(n: int) -> dict[str, list[float]]:
        buf = torch.zeros(LATENCY_BYTES // 2, dtype=torch.bfloat16, device=dev)
        payload = {"hidden_states.output": buf, "meta": {"finished": False}}
        names = ("raw", "omnilink", "omnilink-ab") if conn_ab is not None else ("raw", "omnilink")
        one_way: dict[str, list[float]] = {name: [] for name in names}
        for i in range(n + 5):  # 5 warm-up exchanges
            for name in names:
                barrier()
                t0 = time.perf_counter()
                if name == "raw":
                    if rank == 0:
                        dist.send(buf, dst=1)
                        dist.recv(buf, src=1)
                    else:
                        dist.recv(buf, src=0)
                        sync()
                        dist.send(buf, dst=0)
                    sync()
                else:
                    traced = marks if name == "omnilink" and i >= 5 else None
                    ping_pong(conn if name == "omnilink" else conn_ab, rank, sync, f"ping{i}", f"pong{i}", payload,
                              traced)
                if i >= 5:
                    one_way[name].append((time.perf_counter() - t0) / 2)
        return one_way

    try:
        for nbytes in opts["sizes"]:
            n = opts["iters"] or iters_for(nbytes, backend)
            n_serial = min(n, 50)
            variants = ["omnilink"]
            if nbytes >= (1 << 20):
                variants.append("omnilink +16 small")
            exact = {v: check(nbytes, v) for v in variants}
            exact["omnilink serial"] = exact["omnilink"]
            raw_round(nbytes, 2)  # warm-up
            for v in variants:
                conn_round(nbytes, 2, v)
            for v in ("raw serial", "omnilink serial"):
                serial_round(nbytes, 2, v)
            times: dict[str, list[float]] = {"raw": [], **{v: [] for v in variants},
                                             "raw serial": [], "omnilink serial": []}
            for _ in range(opts["rounds"]):
                times["raw"].append(raw_round(nbytes, n))
                for v in variants:
                    times[v].append(conn_round(nbytes, n, v))
                for v in ("raw serial", "omnilink serial"):
                    times[v].append(serial_round(nbytes, n_serial, v))
            if rank == 1:
                for name, ts in times.items():
                    k = n_serial if name.endswith("serial") else n
                    med = statistics.median(ts)
                    results.append({
                        "size": nbytes, "variant": name, "iters": k, "rounds": opts["rounds"],
                        "median_s": med, "gbps": nbytes * k / med / 1e9,
                        "all_gbps": [nbytes * k / t / 1e9 for t in ts],
                        "bit_exact": exact.get(name, True),
                    })
        lat = latency(opts["latency_iters"]) if opts["latency_iters"] else None
        if rank == 0 and lat is not None:
            # The round trips are timed where they start and end: on rank 0.
            for name, ts in lat.items():
                results.append({
                    "size": LATENCY_BYTES, "variant": f"latency {name}", "iters": len(ts),
                    "p50_us": statistics.median(ts) * 1e6,
                    "p99_us": sorted(ts)[min(len(ts) - 1, int(len(ts) * 0.99))] * 1e6,
                })
        if marks is not None:
            results.append({"size": 0, "variant": f"trace rank {rank}", "marks": marks,
                            "spans": [(n_, a, b) for n_, a, b in spans]})
        if steps is not None:
            results.append({"size": 0, "variant": f"steps rank {rank}", "steps": {
                name: {"total_ms": ns / 1e6, "calls": calls, "us_per_call": ns / calls / 1e3 if calls else 0.0}
                for name, (ns, calls) in steps.items()
            }})
        out.put(("results", rank, results))
    except Exception as exc:
        out.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise
    finally:
        if conn_ab is not None:
            conn_ab.close()
        conn.close()
        dist.destroy_process_group()


def machine(backend: str, opts: dict[str, Any]) -> dict[str, Any]:
    import torch

    from omnilink._bench.machine import machine_record

    rec = machine_record()
    rec["torch"] = torch.__version__
    rec["backend"] = backend
    rec["connector"] = {"protocol": 6, "bell_bytes": opts["bell_bytes"], "pack_bytes": opts["pack_bytes"],
                        "templates": opts["templates"]}
    if opts.get("latency_ab"):
        rec["connector_ab"] = dict(opts["latency_ab"])
    if backend != "nccl":
        rec["gpus"] = []
        return rec
    rec["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
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
    ap.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl with two GPUs, else gloo")
    ap.add_argument("--sizes", default="1MiB,64MiB,256MiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=0, help="payloads per round (default: by size)")
    ap.add_argument("--latency-iters", type=int, default=200, help="4 KiB ping-pongs (0: skip)")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds the whole run may take")
    ap.add_argument("--json", help="append one JSON object per cell to this file")
    ap.add_argument("--bell-bytes", type=int, default=0,
                    help="the connector's bell_bytes: device data that rides the doorbell (default 0, the "
                         "connector's: none)")
    ap.add_argument("--pack-bytes", type=int, default=1 << 20,
                    help="the connector's pack_bytes: device tensors up to this size sent together in one "
                         "pack (default 1048576)")
    ap.add_argument("--latency-ab", default=None, metavar="OPTION=VALUE[,OPTION=VALUE]",
                    help="the 4 KiB ping-pong also through a second connector with these options (bell_bytes, "
                         "pack_bytes, inline_bytes, spin_us), interleaved with the first in the same pair of "
                         "processes: the row omnilink-ab")
    ap.add_argument("--profile", action="store_true",
                    help="time the connector's steps in both processes (perf_counter_ns; slows every call)")
    ap.add_argument("--no-templates", dest="templates", action="store_false",
                    help="the connector sends every payload whole (templates=False; by default a stream of "
                         "payloads of one shape goes by templates)")
    ap.add_argument("--trace", action="store_true",
                    help="the 4 KiB ping-pong with both processes' omnilink calls on one clock: where a "
                         "one-way trip's time goes (a span recorder around every call distorts it a little)")
    args = ap.parse_args(argv)
    import torch

    backend = args.backend or ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    if backend == "nccl" and torch.cuda.device_count() < 2:
        print("bench_nccl --backend nccl needs two CUDA devices; this machine has",
              torch.cuda.device_count(), "(use --backend gloo)", file=sys.stderr)
        return 2
    latency_ab: dict[str, int] = {}
    for item in (args.latency_ab or "").split(",") if args.latency_ab else []:
        key, _, text = item.partition("=")
        if key not in _AB_OPTIONS:
            print(f"--latency-ab: {key!r} is not one of {', '.join(_AB_OPTIONS)}", file=sys.stderr)
            return 2
        try:
            latency_ab[key] = int(text, 0) if key != "templates" else bool(int(text, 0))
        except ValueError:
            print(f"--latency-ab: {key} takes an int, got {text!r}", file=sys.stderr)
            return 2
    opts = {
        "backend": backend, "sizes": parse_sizes(args.sizes), "rounds": args.rounds, "iters": args.iters,
        "latency_iters": args.latency_iters, "bell_bytes": args.bell_bytes, "pack_bytes": args.pack_bytes,
        "templates": args.templates,
        "profile": args.profile, "trace": args.trace, "hang_s": max(5.0, args.timeout - 15.0), "latency_ab": latency_ab,
    }
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = free_ports(3)  # the process group's, the connector's and the A/B connector's store
    procs = [ctx.Process(target=_worker, args=(r, ports, opts, q), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    results: list[dict[str, Any]] = []
    error = None
    deadline = time.monotonic() + args.timeout
    try:
        got = 0
        while got < len(procs):
            try:
                msg = q.get(timeout=1.0)
            except queue.Empty:
                # A worker that died without a word (an import error, a crash) ends the
                # run now rather than at the timeout.
                dead = [f"rank {r} exited {p.exitcode}" for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    error = "; ".join(dead) + " (its stderr is above)"
                    break
                if time.monotonic() > deadline:
                    raise
                continue
            if msg[0] == "error":
                error = msg[1]
                break
            results.extend(msg[2])
            got += 1
    except queue.Empty:
        error = f"no result within {args.timeout} s"
    finally:
        for p in procs:
            p.join(60 if error is None else 20)  # a hung worker dumps its stacks and exits
            if p.is_alive():
                p.kill()
    if error is not None:
        print("benchmark failed:", error, file=sys.stderr)
        return 1
    traces = {r["variant"]: r for r in results if r["variant"].startswith("trace rank")}
    results = [r for r in results if not r["variant"].startswith("trace rank")]
    if len(traces) == 2:
        t0, t1 = traces["trace rank 0"], traces["trace rank 1"]
        rows = trace_rows(t0["marks"], t1["marks"], t0["spans"], t1["spans"])
        results.append({"size": LATENCY_BYTES, "variant": "trace", "timeline": rows})
    order = {"raw": 0, "omnilink": 1, "omnilink +16 small": 2, "raw serial": 3, "omnilink serial": 4}
    results.sort(key=lambda r: (r["variant"].startswith("latency"), r["size"], order.get(r["variant"], 9)))
    rec = machine(backend, opts)
    where = " + ".join(rec["gpus"]) if rec["gpus"] else f"{rec['cpu']} ({rec['cores']} cores)"
    extra = f", NCCL {rec['nccl']}, driver {rec['driver']}" if backend == "nccl" else ""
    print(f"# nccl connector vs raw torch.distributed send/recv over {backend}, {where}, "
          f"torch {rec['torch']}{extra}")
    print(f"{'size':>9} | {'variant':<20} | {'GB/s':>8} | {'ratio':>6} | {'vs plain':>8} | bit-exact")
    print(f"{'-' * 9}-+-{'-' * 20}-+-{'-' * 8}-+-{'-' * 6}-+-{'-' * 8}-+-{'-' * 9}")
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    gbps = {(r["size"], r["variant"]): r["gbps"] for r in results if "gbps" in r}
    lat = {r["variant"]: r for r in results if r["variant"].startswith("latency")}
    for r in results:
        if "gbps" in r:
            # Serial rows against raw's serial row; streaming rows against raw's.
            base = "raw serial" if r["variant"].endswith("serial") else "raw"
            r["ratio_vs_raw"] = r["gbps"] / gbps[(r["size"], base)]
            plain = ""
            if r["variant"] == "omnilink +16 small":
                r["ratio_vs_plain"] = r["gbps"] / gbps[(r["size"], "omnilink")]
                plain = f"{r['ratio_vs_plain']:8.3f}"
            print(f"{format_size(r['size']):>9} | {r['variant']:<20} | {r['gbps']:8.2f} | "
                  f"{r['ratio_vs_raw']:6.3f} | {plain:>8} | {r['bit_exact']}")
    if lat:
        base = lat["latency raw"]["p50_us"]
        print(f"\n{format_size(LATENCY_BYTES)} one-way latency (half a ping-pong), p50 / p99 us:")
        for name, r in lat.items():
            r["ratio_vs_raw"] = r["p50_us"] / base
            print(f"  {name.removeprefix('latency '):<11} {r['p50_us']:9.1f} / {r['p99_us']:9.1f}   "
                  f"x{r['ratio_vs_raw']:.2f} of raw")
    for r in results:
        if "timeline" in r:
            print("\n4 KiB ping on one clock (rank 0 sends, rank 1 receives): median start offset from "
                  "rank 0's put, median time inside, calls per payload (us)")
            for row in r["timeline"]:
                print(f"  {row['side']:<8} {row['start_us']:9.1f} {row['incl_us']:9.1f} {row['calls']:5g}  {row['fn']}")
    for r in results:
        if "steps" in r:
            print(f"\n{r['variant']}: us per call (calls), over the whole run")
            for name, st in sorted(r["steps"].items(), key=lambda kv: -kv[1]["total_ms"]):
                if st["calls"]:
                    print(f"  {name:<16} {st['us_per_call']:9.1f}  ({st['calls']})")
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            for r in results:
                scenario = "nccl-steps" if "steps" in r else "nccl-trace" if "timeline" in r else "nccl-vs-raw"
                f.write(json.dumps({"scenario": scenario, "time": stamp, **r, "machine": rec}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
