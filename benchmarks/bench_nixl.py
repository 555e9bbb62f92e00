"""omnilink's ``nixl`` backend beside vLLM-Omni 0.30.0's own ``NixlConnector``, zmq over
tcp, a raw NIXL WRITE + notification, and (on two GPUs) the nccl connector and an
in-process peer copy: one payload at a time, as a stage consumes them.

Benchmarks are hard: two processes on one machine, whatever else runs on it. Read the
ratios of one run (every connector measured in the same run, same machine, same UCX
transport), re-run before quoting, and quote the machine record.

What it measures: per size, ROUNDS messages one after the other (after WARMUP). A
message's time runs from the sender's ``put`` until the receiver's answer on a pipe
says it holds the payload (``get`` returned and, for a GPU tensor, the receiver's
current stream synchronized: a road that lands asynchronously, as the nccl connector's
receive on its stream, is timed until the bytes are there; first bytes checked on the
first message of each size): put + transport + get + one pipe hop, the same for every
row; the receiver drops the payload after it answered (its release overlaps the next
put, as a consuming stage's does while the next payload comes). The *one-way* time of a message runs from the sender's ``put`` until that moment in
the receiver (``time.perf_counter``, CLOCK_MONOTONIC: one clock for both processes; the
answer carries it): what the consuming stage waits for, whatever ``put`` still does
after it (omnilink's nixl ``put`` returns on the receiver's acknowledgement); the
second table gives it with its ratio to the raw WRITE + notification's.

- ``omnilink-nixl``    ``omnilink.connect("nixl")``: the receiver's pool registered once,
                       sender-side allocation, the receiver blocks in ``get``
- ``vllm-omni-nixl``   vLLM-Omni 0.30.0's ``NixlConnector`` from its wheel (loaded
                       without vLLM, see ``omnilink._bench.vllm_omni_shm``), used as
                       fast as it allows: the metadata ``put`` returns goes straight to
                       the receiver over the pipe, which calls ``get`` with it (the
                       producer registers per put; the consumer registers, READs, polls
                       with its 1 ms sleep, deregisters and acknowledges per get)
- ``zmq-tcp``          ``omnilink.connect("zmq")`` over ``tcp://127.0.0.1`` (GPU tensors
                       bounce through host memory)
- ``raw-nixl``         the floor: one NIXL WRITE with a notification from memory
                       registered once into memory registered once; the receiver spins
                       on its notifications; no header, no allocation, no views
- ``nccl`` (GPU)       ``omnilink.connect("nccl")`` between the two processes
- ``peer-copy`` (GPU)  one process: ``dst.copy_(src)`` cuda:0 -> cuda:1, synchronised

``--ab NAME=VALUE[,NAME=VALUE]``: an A/B of sender-side constants of omnilink's nixl
backend inside ONE pair of processes (one version's figures move by up to 1.5x from one
pair of processes to the next on the GPU hosts, more than most changes worth testing):
the ``omnilink-nixl`` sender alternates message by message between the constants as
they are and as given (looked up in ``omnilink.connectors.nixl.connector``, then
``.agent``, then ``.wire``; e.g. ``DIRECT_CACHED_MIN_BYTES=1``, ``AHEAD_MIN_BYTES=0``,
``INLINE_MAX_BYTES=0``, ``INLINE_TO_DEVICE=true``), and the
second half is the row ``nixl-ab``, each with half the rounds.

The UCX transport is ``UCX_TLS``, set per run (``--tls``): ``tcp`` and ``cma,tcp`` (cma
moves the bytes with ``process_vm_writev``; UCX needs tcp beside it for its messages).
With ``--device cuda`` the sender's tensors are on cuda:0 and the receiver's land on
cuda:1 (UCX picks cuda_ipc; leave ``--tls`` at ``default``), or on cuda:0 too where the
machine has one GPU.

Usage::

    python benchmarks/bench_nixl.py [--device cpu|cuda] [--tls tcp,cma,tcp] [--sizes 4KiB,1MiB,64MiB]
                                    [--rounds 200] [--ab NAME=VALUE] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import time
from typing import Any

from omnilink._bench.units import format_size, parse_size

WAIT = 120.0
CONNECTORS_CPU = ("omnilink-nixl", "vllm-omni-nixl", "zmq-tcp", "raw-nixl")
CONNECTORS_GPU = ("omnilink-nixl", "vllm-omni-nixl", "zmq-tcp", "raw-nixl", "nccl", "peer-copy")


def _rounds(size: int, rounds: int) -> int:
    return max(5, min(rounds, (512 << 20) // max(size, 1)))


def _payload(size: int, dev: str) -> dict[str, Any]:
    import torch

    n = size // 2
    hidden = torch.arange(n, dtype=torch.int32, device=dev).remainder_(251).to(torch.bfloat16)
    return {"hidden": hidden, "meta": {"finished": False}}


def _free_port() -> int:
    from omnilink._bench.ports import free_ports

    return free_ports(1)[0]


def _setup_process(opts: dict[str, Any]) -> None:
    tls = opts["tls"]
    if tls == "default":
        os.environ.pop("UCX_TLS", None)
    else:
        from omnilink.connectors.nixl.agent import nvidia_gpu_present

        # NIXL's UCX backend refuses a transport list without a CUDA one on a GPU machine.
        os.environ["UCX_TLS"] = tls + ",cuda_copy" if "cuda" not in tls and nvidia_gpu_present() else tls
    import logging

    logging.getLogger("nixl").setLevel(logging.WARNING)
    import torch

    torch.set_num_threads(1)


def _vllm_connector(role: str, dev: str) -> Any:
    from omnilink._bench.vllm_omni_shm import load_nixl_connector

    cls = load_nixl_connector()
    extra: dict[str, Any] = {"role": role, "stage_id": 0 if role == "sender" else 1, "host": "127.0.0.1"}
    if dev.startswith("cuda"):
        extra["receive_device"] = dev
    return cls(extra)


def _sender(name: str, opts: dict[str, Any], pipe: Any) -> None:
    _setup_process(opts)
    import torch

    import omnilink

    dev = "cuda:0" if opts["device"] == "cuda" else "cpu"
    if dev != "cpu":
        torch.cuda.set_device(0)
    info = pipe.recv()  # the receiver is up: its endpoint / metadata
    conn: Any = None
    agent = None
    if name == "omnilink-nixl":
        conn = omnilink.connect("nixl", channel=opts["channel"], role="sender", endpoint=info, timeout=WAIT)
    elif name == "zmq-tcp":
        conn = omnilink.connect("zmq", channel=opts["channel"], role="sender", endpoint=info, timeout=WAIT)
    elif name == "vllm-omni-nixl":
        conn = _vllm_connector("sender", dev)
    elif name == "nccl":
        conn = omnilink.connect("nccl", channel=opts["channel"], role="dual", rank=0, backend="nccl", device=dev,
                                master_port=info, timeout=WAIT)
        conn.wait_connected(WAIT)
    out: dict[str, Any] = {}
    ab = _ab_settings(opts.get("ab")) if name == "omnilink-nixl" else []
    for size in opts["sizes"]:
        payload = _payload(size, dev)
        if name == "raw-nixl":
            agent, peer, src, remote = _raw_sender_setup(payload["hidden"], info, agent)
        n = opts["warmup"] + _rounds(size, opts["rounds"]) * (2 if ab else 1)
        times = []
        one_way = []
        times_ab: list[float] = []
        one_way_ab: list[float] = []
        for i in range(n):
            key = f"s{size}-{i}"
            variant = bool(ab) and i % 2 == 1
            for mod, attr, base, value in ab:
                setattr(mod, attr, value if variant else base)
            t0 = time.perf_counter()
            if name == "vllm-omni-nixl":
                ok, _n, meta = conn.put("0", "1", key, payload)
                if not ok:
                    raise RuntimeError("vLLM-Omni NixlConnector put failed")
                pipe.send(meta)
            elif name == "raw-nixl":
                _raw_write(agent, peer, src, remote, key)
            else:
                conn.put(key, payload)
            t1 = pipe.recv()
            if i >= opts["warmup"]:
                (times_ab if variant else times).append(time.perf_counter() - t0)
                (one_way_ab if variant else one_way).append(t1 - t0)
        out[str(size)] = times
        out[f"{size}/one_way"] = one_way
        if ab:
            out[f"ab/{size}"] = times_ab
            out[f"ab/{size}/one_way"] = one_way_ab
    for mod, attr, base, _value in ab:
        setattr(mod, attr, base)
    pipe.send(("done", out))
    pipe.recv()
    if conn is not None:
        conn.close()


def _receiver(name: str, opts: dict[str, Any], pipe: Any) -> None:
    _setup_process(opts)
    import torch

    import omnilink

    dev = f"cuda:{_rx_index()}" if opts["device"] == "cuda" else "cpu"
    if dev != "cpu":
        torch.cuda.set_device(_rx_index())
    conn: Any = None
    if name == "omnilink-nixl":
        pool = max(256 << 20, 4 * max(opts["sizes"]))
        conn = omnilink.connect("nixl", channel=opts["channel"], role="receiver", endpoint="tcp://127.0.0.1:*",
                                pool_bytes=pool, device=None if dev == "cpu" else dev, timeout=WAIT)
        pipe.send(conn.endpoint)
    elif name == "zmq-tcp":
        conn = omnilink.connect("zmq", channel=opts["channel"], role="receiver", endpoint="tcp://127.0.0.1:*",
                                timeout=WAIT, max_buffered_bytes=8 * max(opts["sizes"]))
        pipe.send(conn.endpoint)
    elif name == "vllm-omni-nixl":
        conn = _vllm_connector("receiver", dev)
        pipe.send(None)
    elif name == "nccl":
        port = _free_port()
        pipe.send(port)
        conn = omnilink.connect("nccl", channel=opts["channel"], role="dual", rank=1, backend="nccl", device=dev,
                                master_port=port, timeout=WAIT)
        conn.wait_connected(WAIT)
    agent = None
    for size in opts["sizes"]:
        expect = _payload(size, "cpu")["hidden"][:64]
        if name == "raw-nixl":
            agent, dst = _raw_receiver_setup(size, dev, pipe, agent)
        n = opts["warmup"] + _rounds(size, opts["rounds"]) * (2 if opts.get("ab") and name == "omnilink-nixl" else 1)
        for i in range(n):
            key = f"s{size}-{i}"
            if name == "vllm-omni-nixl":
                meta = pipe.recv()
                got = conn.get("0", "1", key, meta)
                if got is None:
                    raise RuntimeError("vLLM-Omni NixlConnector get failed")
                hidden = got[0]["hidden"]
            elif name == "raw-nixl":
                _raw_wait(agent, key)
                hidden = dst.view(torch.bfloat16)
            elif name == "zmq-tcp" and dev != "cpu":
                hidden = conn.get(key, timeout=WAIT, device=dev)["hidden"]  # the host bounce, landed on the GPU
            else:
                hidden = conn.get(key, timeout=WAIT)["hidden"]
            if hidden.is_cuda:  # the bytes are there, not only queued (see the docstring)
                torch.cuda.current_stream(hidden.device).synchronize()
            if i == 0 and not torch.equal(hidden[:64].cpu(), expect):
                raise RuntimeError(f"{name}: the first {format_size(size)} payload arrived with other bytes")
            if i == 0 and name == "omnilink-nixl" and dev != "cpu" and hidden.device != torch.device(dev):
                raise RuntimeError(f"omnilink-nixl: payload landed on {hidden.device}, not {dev}")
            pipe.send(time.perf_counter())  # it holds the payload now (one clock for both processes)
            # Dropped after the answer: its release overlaps the next put, as a stage's does.
            del hidden
            got = None
    msg = pipe.recv()
    pipe.send(msg)
    if conn is not None:
        conn.close()


# --------------------------------------------------------------- raw NIXL floor
def _raw_agent(name: str) -> Any:
    from omnilink.connectors.nixl.agent import Agent

    return Agent(name)


def _raw_receiver_setup(size: int, dev: str, pipe: Any, agent: Any) -> tuple[Any, Any]:
    import torch

    agent = agent or _raw_agent(f"raw-rx-{os.getpid()}")
    dst = torch.empty(size, dtype=torch.uint8, device=dev)
    mem = "DRAM" if dev == "cpu" else "VRAM"
    index = 0 if dev == "cpu" else torch.device(dev).index
    agent.register(dst.data_ptr(), size, mem, index)
    pipe.send((agent.metadata(), dst.data_ptr(), mem, index))
    agent._held = getattr(agent, "_held", []) + [dst]
    return agent, dst


def _raw_sender_setup(hidden: Any, info: Any, agent: Any) -> tuple[Any, str, Any, Any]:
    import torch

    agent = agent or _raw_agent(f"raw-tx-{os.getpid()}")
    src = hidden.reshape(-1).view(torch.uint8)
    mem = "DRAM" if src.device.type == "cpu" else "VRAM"
    index = 0 if mem == "DRAM" else src.device.index
    agent.register(src.data_ptr(), src.numel(), mem, index)
    md, addr, rmem, rindex = info if isinstance(info, tuple) else (None, None, None, None)
    return agent, md, (src, mem, index), (addr, rmem, rindex)


def _raw_write(agent: Any, md: Any, src: Any, remote: Any, key: str) -> None:
    if not hasattr(agent, "_peers"):
        agent._peers = {}
    peer = agent._peers.get(md)
    if peer is None:
        peer = agent._peers[md] = agent.add_remote(md)
    t, mem, index = src
    addr, rmem, rindex = remote
    raw_write_pieces(agent, peer, mem, [(t.data_ptr(), t.numel(), index)], rmem, [(addr, t.numel(), rindex)], key)


def raw_write_pieces(agent: Any, peer: str, mem: str, local: list[tuple[int, int, int]], rmem: str,
                     remote: list[tuple[int, int, int]], key: str) -> None:
    """One raw NIXL WRITE of the ``local`` pieces into the peer's ``remote`` ones with the
    notification ``key``, spun on until complete (the floor: no header, no allocation)."""
    b = agent._b
    ld = b.nixlXferDList(agent._mems[mem], local)
    rd = b.nixlXferDList(agent._mems[rmem], remote)
    req = agent._agent.createXferReq(b.NIXL_WRITE, ld, rd, peer, key.encode(), [agent._ucx])
    status = agent._agent.postXferReq(req, key.encode())
    while status == b.NIXL_IN_PROG:
        status = agent._agent.getXferStatus(req)
    agent._agent.releaseXferReq(req)
    if status != b.NIXL_SUCCESS:
        raise RuntimeError(f"raw NIXL WRITE failed: {status}")


def _raw_wait(agent: Any, key: str) -> None:
    want = key.encode()
    seen = getattr(agent, "_seen", None)
    if seen is None:
        seen = agent._seen = set()
    deadline = time.monotonic() + WAIT
    while want not in seen:
        for msgs in agent._agent.getNotifs({}, [agent._ucx]).values():
            seen.update(bytes(m) for m in msgs)
        if time.monotonic() > deadline:
            raise RuntimeError(f"raw NIXL: notification {key} never came")
    seen.discard(want)


def _raw_loop_sender(name: str, opts: dict[str, Any], pipe: Any) -> None:
    # The raw floor's receiver sends fresh metadata per size: read it per size.
    _setup_process(opts)
    import torch

    dev = "cuda:0" if opts["device"] == "cuda" else "cpu"
    if dev != "cpu":
        torch.cuda.set_device(0)
    out: dict[str, Any] = {}
    agent = None
    for size in opts["sizes"]:
        payload = _payload(size, dev)
        info = pipe.recv()
        agent, md, src, remote = _raw_sender_setup(payload["hidden"], info, agent)
        n = opts["warmup"] + _rounds(size, opts["rounds"])
        times = []
        one_way = []
        for i in range(n):
            key = f"s{size}-{i}"
            t0 = time.perf_counter()
            _raw_write(agent, md, src, remote, key)
            t1 = pipe.recv()
            if i >= opts["warmup"]:
                times.append(time.perf_counter() - t0)
                one_way.append(t1 - t0)
        out[str(size)] = times
        out[f"{size}/one_way"] = one_way
    pipe.send(("done", out))
    pipe.recv()


def _rx_index() -> int:
    """The receiver's GPU: cuda:1, or cuda:0 on a machine with one GPU (both ends on it;
    the ``peer-copy`` row is then a local copy)."""
    import torch

    return 1 if torch.cuda.device_count() > 1 else 0


def _peer_copy(opts: dict[str, Any]) -> dict[str, list[float]]:
    import torch

    out = {}
    rx = _rx_index()
    for size in opts["sizes"]:
        src = torch.empty(size, dtype=torch.uint8, device="cuda:0").fill_(7)
        dst = torch.empty(size, dtype=torch.uint8, device=f"cuda:{rx}")
        n = opts["warmup"] + _rounds(size, opts["rounds"])
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize(rx)
            torch.cuda.synchronize(0)
            if i >= opts["warmup"]:
                times.append(time.perf_counter() - t0)
        out[str(size)] = times
        out[f"{size}/one_way"] = times
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--tls", default=None, help="comma-separated UCX_TLS values, ';' between runs "
                    "(default: 'tcp;cma,tcp' on cpu, 'default' on cuda)")
    ap.add_argument("--sizes", default=None, help="default 4KiB,1MiB,64MiB (cpu); 4KiB,1MiB,64MiB,256MiB (cuda)")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--connectors", default=None)
    ap.add_argument("--ab", default=None, metavar="NAME=VALUE[,NAME=VALUE]",
                    help="omnilink-nixl only: alternate message by message between the nixl backend's sender-side "
                         "constants as they are and as given; the given ones are the row nixl-ab")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.ab:
        _ab_settings(args.ab)  # refused here, before any process starts
    gpu = args.device == "cuda"
    sizes = [parse_size(s) for s in (args.sizes or ("4KiB,1MiB,64MiB,256MiB" if gpu else "4KiB,1MiB,64MiB")).split(",")]
    tls_runs = (args.tls or ("default" if gpu else "tcp;cma,tcp")).split(";")
    names = args.connectors.split(",") if args.connectors else list(CONNECTORS_GPU if gpu else CONNECTORS_CPU)
    from omnilink._bench.machine import machine_record

    machine = machine_record(include_cuda=gpu)
    rows = []
    for tls in tls_runs:
        for name in names:
            if name in ("nccl", "peer-copy") and tls != tls_runs[0]:
                continue
            opts = {"device": args.device, "tls": tls, "sizes": sizes, "rounds": args.rounds, "warmup": args.warmup,
                    "ab": args.ab}
            try:
                res = _run_pipe(name, opts)
            except Exception as exc:  # a row that cannot run is reported, the rest go on
                print(f"{name} ({tls}): unavailable: {exc}", file=sys.stderr)
                rows.append({"connector": name, "tls": tls, "error": str(exc)})
                continue
            for label, prefix in ((name, ""), ("nixl-ab", "ab/")):
                if f"{prefix}{sizes[0]}" not in res:
                    continue
                for size in sizes:
                    ts = sorted(res[f"{prefix}{size}"])
                    p50 = statistics.median(ts)
                    row = {"connector": label, "tls": tls, "size": size, "p50_s": p50,
                           "p10_s": ts[len(ts) // 10], "p90_s": ts[(len(ts) * 9) // 10], "n": len(ts),
                           "gbps": size / p50 / 1e9,
                           "one_way_p50_s": statistics.median(res[f"{prefix}{size}/one_way"])}
                    if prefix:
                        row["ab"] = args.ab
                    rows.append(row)
    _print(rows, sizes, tls_runs)
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps({"scenario": "nixl", "device": args.device, "machine": machine,
                                "command": "python benchmarks/bench_nixl.py " + " ".join(argv or sys.argv[1:])})
                    + "\n")
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


def _ab_settings(spec: str | None) -> list[tuple[Any, str, Any, Any]]:
    """``(module, name, value as it is, value given)`` for ``--ab NAME=VALUE,...``: each
    NAME a constant of omnilink's nixl connector module, its agent module or its wire
    module (e.g. ``INLINE_MAX_BYTES=0``: the sender sends nothing inline)."""
    if not spec:
        return []
    import importlib

    mods = [importlib.import_module("omnilink.connectors.nixl.connector"),
            importlib.import_module("omnilink.connectors.nixl.agent"),
            importlib.import_module("omnilink.connectors.nixl.wire")]
    out = []
    for item in spec.split(","):
        attr, _, text = item.partition("=")
        mod = next((m for m in mods if attr.isupper() and hasattr(m, attr)), None)
        if mod is None or not text:
            raise SystemExit(f"--ab: {item!r} is not NAME=VALUE for a constant of omnilink's nixl backend")
        base = getattr(mod, attr)
        try:
            if isinstance(base, bool):
                if text.lower() not in ("0", "1", "false", "true"):
                    raise ValueError(text)
                value: Any = text.lower() in ("1", "true")
            else:
                value = type(base)(text) if not isinstance(base, int) else int(text, 0)
        except ValueError:
            raise SystemExit(f"--ab: {text!r} is not a value of {attr}'s type ({type(base).__name__})") from None
        out.append((mod, attr, base, value))
    return out


def _run_pipe(name: str, opts: dict[str, Any]) -> dict[str, list[float]]:
    if name == "peer-copy":
        return _peer_copy(opts)
    ctx = mp.get_context("spawn")
    rx_end, tx_end = ctx.Pipe()
    results_r, results_w = ctx.Pipe(duplex=False)
    opts = {**opts, "channel": f"bench-nixl/{name}-{secrets.token_hex(3)}"}
    send_target = _raw_loop_sender if name == "raw-nixl" else _sender
    rx = ctx.Process(target=_receiver_main, args=(name, opts, rx_end, results_w), daemon=True)
    tx = ctx.Process(target=send_target, args=(name, opts, tx_end), daemon=True)
    rx.start()
    tx.start()
    # Only the children hold the pipes' ends now: one that dies closes its end, and the
    # other's recv() ends at once instead of waiting for the whole run's time.
    for end in (rx_end, tx_end, results_w):
        end.close()
    try:
        end_by = time.monotonic() + WAIT * 10
        dead_since = None
        while not results_r.poll(1.0):
            if time.monotonic() > end_by:
                raise RuntimeError("no result in time")
            died = [p for p in (rx, tx) if p.exitcode not in (None, 0)]
            if died:
                dead_since = dead_since or time.monotonic()
                if time.monotonic() - dead_since > 10:  # time for the other to report why
                    raise RuntimeError(f"{name}: a benchmark process died (exit code {died[0].exitcode})")
        try:
            out = results_r.recv()
        except EOFError:
            raise RuntimeError(f"{name}: the receiver ended without a result") from None
    finally:
        for p in (rx, tx):
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)
    if isinstance(out, str):
        raise RuntimeError(out)
    return out


def _receiver_main(name: str, opts: dict[str, Any], pipe: Any, results: Any) -> None:
    """The receiver, whose pipe end also carries the sender's results at the end."""
    import traceback

    class _Tap:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def send(self, obj: Any) -> None:
            self.inner.send(obj)

        def recv(self) -> Any:
            obj = self.inner.recv()
            if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "done":
                results.send(obj[1])
            return obj

    try:
        _receiver(name, opts, _Tap(pipe))
    except BaseException as exc:
        results.send(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise


def _print(rows: list[dict[str, Any]], sizes: list[int], tls_runs: list[str]) -> None:
    for tls in tls_runs:
        print(f"\nUCX_TLS={tls}: per-message time p50 (put -> get -> answer), ratio = vllm-omni-nixl / row")
        print(f"{'connector':<16}" + "".join(f"{format_size(s):>22}" for s in sizes))
        _print_table(rows, sizes, tls, "p50_s", "vllm-omni-nixl", lambda v, ref: f" {ref / v:5.1f}x")
        print(f"\nUCX_TLS={tls}: one-way p50 (put called -> the receiver holds the payload, one clock), "
              "ratio = row / raw-nixl")
        _print_table(rows, sizes, tls, "one_way_p50_s", "raw-nixl", lambda v, ref: f" {v / ref:5.2f}x")


def _print_table(rows: list[dict[str, Any]], sizes: list[int], tls: str, field: str, ref_name: str,
                 ratio: Any) -> None:
    """One line per connector of ``tls``'s rows: ``field`` per size in us, with
    ``ratio(value, the ref_name row's value)`` where that row has the size."""
    mine = [r for r in rows if r.get("tls") == tls and "size" in r]
    ref = {r["size"]: r[field] for r in mine if r["connector"] == ref_name}
    for name in dict.fromkeys(r["connector"] for r in rows if r.get("tls") == tls):
        cells = []
        for s in sizes:
            r = next((r for r in mine if r["connector"] == name and r["size"] == s), None)
            if r is None:
                cells.append(f"{'-':>22}")
                continue
            text = ratio(r[field], ref[s]) if s in ref else ""
            cells.append(f"{r[field] * 1e6:>10.0f} us{text:>8}"[:22].rjust(22))
        print(f"{name:<16}" + "".join(cells))

if __name__ == "__main__":
    sys.exit(main())
