"""Both processes of an nccl channel on one clock: where a message's time goes.

``python benchmarks/trace_nccl.py [--backend nccl|gloo] [--n 100] [--pause-ms 3]
[--streams 1MiB,64MiB+16,1MiB+16] [--out DIR]``

Two ranks (cuda:0 and cuda:1 on ``nccl``; CPU on ``gloo``) open one ``role="dual"``
nccl connector each. Every step of the connector and of its wire format, ZeroMQ's
``poll``, ``Condition.wait``, CUDA event record / synchronize and ``torch.empty`` are
wrapped to record ``(step, thread, start, end)`` with ``time.perf_counter_ns``
(CLOCK_MONOTONIC: one clock for every process of the host). Phases:

- ``pp_nopause``: a 4 KiB bf16 hidden state (plus a flag) ping-pong, back to back;
- ``pp_pause``: the same with ``--pause-ms`` of idleness before each exchange (a stage
  computing between chunks: the keeper thread holds the doorbell, cores go idle);
- one streaming phase per ``--streams`` item (``SIZE`` or ``SIZE+16``: 16 small 4 KiB
  tensors beside the hidden state), rank 0 putting, rank 1 getting.

Prints, per ping-pong phase, the one-way p50 / p10, each step's median time per
exchange on each rank, and the merged timeline of the exchange closest to the median;
per streaming phase, each rank's time per message and each step's share of it. With
``--out`` both ranks' raw events land in ``DIR/trace{0,1}.json``.

For finding the fixed cost, not for figures to quote (``bench_nccl.py`` is that): the
wrappers add about a microsecond per step.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_nccl import free_ports, join_pair, ping_pong  # noqa: E402  (the same pair of ranks as the benchmark)

#: Connector methods and wire functions timed (those a version lacks are skipped).
CONNECTOR_STEPS = (
    "_put", "_stage_region", "_ring_bell", "_send_nccl", "_send_gloo", "_wait_window", "_read_credits",
    "_await_credits", "_get", "_take", "_progress", "_pump", "_drain", "_announce", "_post_deferred", "_post_one",
    "_stage_post", "_list_posted", "_post", "_hand_out", "_flush_credits", "_send_credit",
)
WIRE_STEPS = ("plan_send", "send_by_template", "encode_envelope", "read_bell", "build_views", "decode_tree")
LATENCY_BYTES = 4096
SMALL = 16


def _install(rec: dict[str, Any]) -> None:
    """Wrap every step so that it records itself while ``rec["on"]``."""
    import functools

    import torch
    import zmq

    from omnilink.connectors.nccl import connector, wire

    events = rec["ev"]

    def wrap(owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return

        def timed(*args: Any, _fn: Any = fn, _label: str = label, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return _fn(*args, **kwargs)
            finally:
                if rec["on"]:
                    events.append((_label, threading.get_ident(), t0, time.perf_counter_ns()))

        setattr(owner, name, functools.wraps(fn)(timed))

    for name in CONNECTOR_STEPS:
        wrap(connector.NcclConnector, name, name)
    for name in WIRE_STEPS:
        wrap(wire, name, "wire." + name)
    wrap(zmq.Poller, "poll", "zmq.poll")
    wrap(threading.Condition, "wait", "cond.wait")
    wrap(torch, "empty", "torch.empty")
    try:
        from omnilink.cuda import Event

        wrap(Event, "record", "event.record")
        wrap(Event, "synchronize", "event.sync")
    except ImportError:  # pragma: no cover - the CUDA layer always imports
        pass


def parse_streams(text: str) -> list[tuple[int, bool]]:
    """``"1MiB,64MiB+16"`` -> ``[(1 MiB, False), (64 MiB, True)]``."""
    from omnilink._bench.units import parse_size

    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        small = item.endswith("+16")
        out.append((parse_size(item[:-3] if small else item), small))
    return out


def _worker(rank: int, ports: tuple[int, int], opts: dict[str, Any], q: Any) -> None:
    try:
        q.put(("done", rank, _run_rank(rank, ports, opts)))
    except BaseException as exc:  # report, then let the parent fail the run
        q.put(("error", rank, f"{type(exc).__name__}: {exc}"))


def _run_rank(rank: int, ports: tuple[int, int], opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    rec: dict[str, Any] = {"on": False, "ev": []}
    _install(rec)
    import omnilink

    dev, sync, barrier = join_pair(rank, ports[0], opts["backend"])
    conn = omnilink.connect("nccl", channel="trace/nccl", role="dual", rank=rank, backend=opts["backend"],
                            device=str(dev), master_port=ports[1], timeout=120.0)
    conn.wait_connected(120.0)

    def mark(name: str) -> None:
        if rec["on"]:
            t = time.perf_counter_ns()
            rec["ev"].append((name, threading.get_ident(), t, t))

    phases: dict[str, int] = {}
    buf = torch.zeros(LATENCY_BYTES // 2, dtype=torch.bfloat16, device=dev)
    payload = {"hidden_states.output": buf, "meta": {"finished": False}}
    warm = 10
    for phase, pause in (("pp_nopause", 0.0), ("pp_pause", opts["pause_ms"] / 1000)):
        barrier()
        for i in range(opts["n"] + warm):
            rec["on"] = i >= warm
            if pause:
                time.sleep(pause)
            mark(f"iter{i}")
            ping_pong(conn, rank, sync, f"{phase}ping{i}", f"{phase}pong{i}", payload)
            mark(f"end{i}")
        rec["on"] = False
        phases[phase] = len(rec["ev"])
    for nbytes, small in opts["streams"]:
        name = f"stream {nbytes}" + (" +16" if small else "")
        big: dict[str, Any] = {
            "hidden_states.output": torch.randn(nbytes // 2, device=dev).to(torch.bfloat16),
            "meta": {"finished": False},
        }
        if small:
            big["small"] = [torch.randn(2048, device=dev).to(torch.bfloat16) for _ in range(SMALL)]
        count = opts["stream_n"]
        for r in range(2):  # a warm-up round, then the recorded one
            rec["on"] = r == 1
            barrier()
            mark("stream_start")
            for i in range(count):
                if rank == 0:
                    conn.put(f"{name}-{r}-{i}", big)
                else:
                    conn.get(f"{name}-{r}-{i}")
            sync()
            mark("stream_end")
        rec["on"] = False
        phases[name] = len(rec["ev"])
    barrier()
    conn.close()
    dist.destroy_process_group()
    return {"ev": rec["ev"], "phases": phases, "main": threading.main_thread().ident}


def _slice(t: dict[str, Any], phase: str) -> list[Any]:
    names = list(t["phases"])
    i = names.index(phase)
    lo = t["phases"][names[i - 1]] if i else 0
    return t["ev"][lo: t["phases"][phase]]


def report(traces: list[dict[str, Any]]) -> list[str]:
    """The printed summary of both ranks' events (see the module docstring)."""
    lines: list[str] = []
    for phase in ("pp_nopause", "pp_pause"):
        ev = [_slice(traces[0], phase), _slice(traces[1], phase)]
        its: dict[int, dict[str, int]] = collections.defaultdict(dict)
        for r in (0, 1):
            for name, _tid, t0, _t1 in ev[r]:
                if name.startswith("iter"):
                    its[int(name[4:])][f"s{r}"] = t0
                elif name.startswith("end"):
                    its[int(name[3:])][f"e{r}"] = t0
        durs = {i: (v["e0"] - v["s0"]) / 2e3 for i, v in its.items() if "e0" in v and "s0" in v}
        if not durs:
            continue
        med = statistics.median(durs.values())
        lines.append(f"== {phase}: one-way p50 {med:.1f} us, p10 {sorted(durs.values())[len(durs) // 10]:.1f} us "
                     f"({len(durs)} exchanges)")
        per: dict[tuple[int, str], list[float]] = collections.defaultdict(list)
        spans = sorted((v["s0"], v["e0"], i) for i, v in its.items() if "s0" in v and "e0" in v)
        for r in (0, 1):
            acc: dict[int, dict[str, int]] = collections.defaultdict(lambda: collections.defaultdict(int))
            for name, _tid, t0, t1 in ev[r]:
                if name.startswith(("iter", "end")):
                    continue
                for s, e, i in spans:
                    if s <= t0 <= e:
                        acc[i][name] += t1 - t0
                        break
            for m in acc.values():
                for name, x in m.items():
                    per[(r, name)].append(x / 1e3)
        for (r, name), xs in sorted(per.items()):
            lines.append(f"   rank {r} {name:22s} median {statistics.median(xs):8.1f} us per exchange (in {len(xs)})")
        pick = min(durs, key=lambda k: abs(durs[k] - med))
        base = its[pick]["s0"]
        rows = []
        for r in (0, 1):
            main = traces[r]["main"]
            for name, tid, t0, t1 in ev[r]:
                if base - 50_000 <= t0 <= its[pick]["e0"] + 20_000 and not name.startswith(("iter", "end")):
                    rows.append((t0 - base, t1 - base, r, "main" if tid == main else "thread", name))
        lines.append(f"   exchange {pick}, both ranks (us from rank 0's start; rank 1 indented):")
        for a, b, r, who, name in sorted(rows):
            lines.append(f"   {a / 1e3:9.1f} {b / 1e3:9.1f} ({(b - a) / 1e3:7.1f})  {'      ' * r}r{r} {who:6s} {name}")
    for phase in [p for p in traces[0]["phases"] if p.startswith("stream")]:
        for r in (0, 1):
            ev = _slice(traces[r], phase)
            start = [t0 for name, _, t0, _ in ev if name == "stream_start"]
            end = [t0 for name, _, t0, _ in ev if name == "stream_end"]
            count = sum(1 for name, _, _, _ in ev if name in ("_put", "_get"))
            if not (start and end and count):
                continue
            lines.append(f"== {phase}, rank {r}: {(end[0] - start[0]) / count / 1e3:.1f} us per message ({count})")
            acc2: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
            main = traces[r]["main"]
            for name, tid, t0, t1 in ev:
                if name.startswith("stream"):
                    continue
                cell = acc2[(name, "main" if tid == main else "thread")]
                cell[0] += t1 - t0
                cell[1] += 1
            for (name, who), (total, calls) in sorted(acc2.items(), key=lambda kv: -kv[1][0]):
                lines.append(f"   {who:6s} {name:22s} {total / count / 1e3:8.1f} us per message ({calls} calls)")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--n", type=int, default=100, help="recorded exchanges per ping-pong phase")
    ap.add_argument("--pause-ms", type=float, default=3.0)
    ap.add_argument("--streams", default="1MiB,64MiB+16,1MiB+16")
    ap.add_argument("--stream-n", type=int, default=40, help="messages per streaming phase")
    ap.add_argument("--out", default=None, help="a directory for both ranks' raw events")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    opts = {"backend": args.backend, "n": args.n, "pause_ms": args.pause_ms, "streams": parse_streams(args.streams),
            "stream_n": args.stream_n}
    ports = free_ports(2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, ports, opts, q), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    traces: dict[int, Any] = {}
    deadline = time.monotonic() + args.timeout
    try:
        while len(traces) < 2:
            kind, rank, body = q.get(timeout=max(1.0, deadline - time.monotonic()))
            if kind == "error":
                print(f"rank {rank} failed: {body}", file=sys.stderr)
                return 1
            traces[rank] = body
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        for r in (0, 1):
            with open(os.path.join(args.out, f"trace{r}.json"), "w") as f:
                json.dump(traces[r], f)
    print("\n".join(report([traces[0], traces[1]])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
