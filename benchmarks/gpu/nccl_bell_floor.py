"""The floor of the nccl connector's doorbell path for a small device payload, beside raw
``torch.distributed`` send/recv, on two GPUs.

``python benchmarks/gpu/nccl_bell_floor.py [--n 200] [--modes doorbell,nccl-bell,raw] [--eager]
[--json FILE]`` (a machine with two GPUs)

Two processes (cuda:0 and cuda:1) join one torch.distributed NCCL group and one Unix
socket. A 4 KiB bf16 tensor goes back and forth (a ping-pong, a barrier before each
exchange, as ``bench_nccl.py``'s latency), alternately:

- ``doorbell``: what the connector's path for a payload that rides its doorbell cannot
  do without, and nothing else (no header, no key, no checks, no index, no credits):
  the sender copies the tensor to pinned host memory on its current stream and waits
  for that copy, then writes one length-prefixed socket message; the receiver spins on
  the socket, allocates the tensor on a side stream, copies the message's bytes up on
  it, records an event and makes its current stream wait for it; then it synchronizes
  its device (as the ping-pong does);
- ``nccl-bell``: the tensor by NCCL and only its size on the socket: the sender queues
  ``ncclSend`` from the tensor on its current stream (no copy, no wait) and writes one
  socket message; the receiver spins on the socket, allocates the tensor on a side
  stream, queues ``ncclRecv`` into it there (posted only once the message came, as the
  connector posts), records an event and makes its current stream wait for it; NCCL's
  C API through ``omnilink.cuda.nccl``, one communicator of the two ranks;
- ``nccl-first``: as ``nccl-bell`` with the socket message first (the sender writes
  the size, then queues ``ncclSend``, so the receiver posts its receive while the
  sender's host call runs) and the receive into a slot allocated beforehand (a receive
  pool), not a fresh tensor;
- ``lean``: the nccl connector's own wire steps for the payload it would send (its
  cached send plan, the envelope, the checked doorbell, the allocation on a side
  stream, ``ncclRecv``, an event, the views and the tree, the stream wait and
  ``record_stream``), the doorbell first, without the connector around them (no lock,
  index, credits, keeper or pump): what the connector's path could cost;
- ``template`` (only with ``--modes``): what a path for a stream of one payload shape
  could cost at least with the checks a connector cannot skip: the sender matches the
  payload against the shape it sent last and sends the shape's number, the sequence
  number, the key and the tree's other values (msgpack), the doorbell first; the
  receiver checks them, carves the tensor out of a slab allocated beforehand for many
  payloads (a receive pool), posts ``ncclRecv``, records one of a few reused events,
  builds the payload and makes its current stream wait (``record_stream`` too). Not
  run on a GPU yet;
- ``raw``: ``dist.send`` / ``dist.recv`` of the same tensor;
- ``nccl-ahead`` (only with ``--modes``): the receive posted ahead (2x H200: 52.5 us
  one-way against raw 53.3 in the run that first ran it, a floor only: the connector
  cannot post ahead, see its docs). Before each exchange (after its barrier, untimed, as a receiver would post
  the next receive right after a get) each rank posts ``ncclRecv`` into a slot of its
  own on a side stream, on a communicator per direction (a waiting receive on one, the
  rank's send on the other), and records an event after it; the sender queues
  ``ncclSend`` and writes the size on the socket at once, so the transfer and the
  socket message overlap; the receiver spins on the socket and makes its current
  stream wait for the event. A receive waiting on the GPU makes a first-time kernel
  launch in its process wait under CUDA's lazy module loading: every kernel the
  exchanges use runs once before any receive is posted ahead, and ``--eager`` sets
  ``CUDA_MODULE_LOADING=EAGER`` in both processes.

``--pin N`` pins each rank's process to N CPUs of physical cores of its own (2x H200,
one hardware thread per core: alternating pinned and unpinned runs, the pinned ones
were no faster, raw 55 / 86 us against 61 / 79, lean 153 / 231 against 161 / 218; the
spread between runs is the machine's over time, not where the threads ran).

Prints each mode's one-way p50 (half an exchange, timed on rank 0) and the receiver's
and sender's step medians (rank 1). Nothing of omnilink but its CUDA and NCCL calls
(``omnilink.cuda``: cuda-python, NCCL's library through ctypes; ``lean`` also its nccl
wire functions): 2x H200, 2026-11-29,
doorbell 99 / 160 us one-way against raw 62 / 92 us in two runs, where the connector
took 237 us; in three later runs (two calls), nccl-bell 82 / 124 / 102 us, doorbell
84 / 127 / 107 us, raw 58 / 72 / 72 us (``benchmarks/results/nccl-bell-floor-2xh200.json``). ``BELL_DEBUG=1`` prints each rank's progress
(NCCL connects a pair of ranks inside their first send / receive host calls, which
wait for each other: the communicator makes one exchange both ways before the runs).
"""
import argparse
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def pinned_sets(count: int = 4) -> list[set[int]]:
    """Two disjoint sets of ``count`` CPUs, one per rank, each CPU on a physical core of
    its own whose other hardware threads neither rank gets (``lscpu -p``)."""
    import subprocess

    cores: dict[tuple[str, str], list[int]] = {}
    for line in subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        if line and not line.startswith("#"):
            cpu, core, sock = line.split(",")
            cores.setdefault((sock, core), []).append(int(cpu))
    firsts = [cpus[0] for cpus in cores.values() if set(cpus) <= os.sched_getaffinity(0)]
    if len(firsts) < 2 * count + 1:
        raise SystemExit(f"--pin needs {2 * count + 1} physical cores; this machine has {len(firsts)}")
    return [set(firsts[1:1 + count]), set(firsts[1 + count:1 + 2 * count])]


def worker(rank: int, port: int, name: str, n: int, q, modes: tuple[str, ...] = ("doorbell", "nccl-bell", "raw"),
           eager: bool = False, cpus: set[int] | None = None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)  # before any thread starts: NCCL's and torch's follow
    if eager:
        os.environ["CUDA_MODULE_LOADING"] = "EAGER"  # before CUDA starts in this process
    import numpy as np
    import torch
    import torch.distributed as dist

    from omnilink.cuda import Event, cuda_ops

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=dev)
    if rank == 1:
        ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ls.bind("\0" + name)
        ls.listen(1)
        dist.barrier(device_ids=[rank])
        s, _ = ls.accept()
        ls.close()
    else:
        dist.barrier(device_ids=[rank])
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\0" + name)
    s.setblocking(False)
    ops = cuda_ops()
    C = torch._C
    side = torch.cuda.Stream(dev)
    ids = (side.stream_id, side.device_index, side.device_type)
    raw_side = int(side.cuda_stream)
    pinned = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)
    pinned_np = pinned.numpy()
    pinned_ptr = pinned.data_ptr()
    copied = Event(rank)
    from omnilink.cuda.nccl import nccl_library

    nccl = nccl_library()
    say = (lambda *a: print(f"[rank {rank}]", *a, file=sys.stderr, flush=True)) if os.environ.get("BELL_DEBUG") else (
        lambda *a: None)
    warm = torch.zeros(1024, dtype=torch.uint8, device=dev)
    stream0 = C._cuda_getCurrentRawStream(rank)

    def connect():
        """A communicator of the two ranks (its unique id from rank 0 over the socket),
        connected: NCCL connects a pair of ranks at their first send / receive, inside
        the host call, which waits for the peer's matching call, so one exchange both
        ways now (the connector's link does the same when it opens), not a first send
        that blocks while its peer waits on the socket for the message sent after it."""
        s.setblocking(True)
        if rank == 0:
            uid = nccl.unique_id()
            s.sendall(uid)
        else:
            uid = b""
            while len(uid) < 128:
                uid += s.recv(128 - len(uid))
        c = nccl.init_rank(uid, 2, rank)
        c.group_start()
        c.send(warm.data_ptr(), warm.numel(), 1 - rank, stream0)
        c.recv(warm.data_ptr(), warm.numel(), 1 - rank, stream0)
        c.group_end()
        torch.cuda.synchronize()
        s.setblocking(False)
        return c

    comm = connect()
    say("communicator up")
    # nccl-ahead: a communicator per direction (a receive waiting on one, the rank's own
    # send on the other); rank 0 sends on ``fwd``, rank 1 on ``back``.
    fwd, back = (connect(), connect()) if "nccl-ahead" in modes else (None, None)
    say("connected")
    peer = 1 - rank
    length = struct.Struct("<I")
    steps: dict[str, list[int]] = {}
    buf = bytearray(1 << 20)
    view = memoryview(buf)

    def mark(step: str, t0: int) -> int:
        t1 = time.perf_counter_ns()
        steps.setdefault(step, []).append(t1 - t0)
        return t1

    def put(t) -> None:
        t0 = time.perf_counter_ns()
        stream = C._cuda_getCurrentRawStream(rank)
        ops.memcpy(pinned_ptr, t.data_ptr(), t.nbytes, stream)
        copied.record(stream).synchronize()
        t0 = mark("put: copy to host, wait", t0)
        s.sendall(length.pack(t.nbytes) + pinned_np[: t.nbytes].tobytes())
        mark("put: socket send", t0)

    def spin() -> int:
        """Wait for one socket message (spinning); the time it came."""
        while True:
            try:
                if s.recv_into(view, len(buf)):
                    return time.perf_counter_ns()
            except BlockingIOError:
                pass

    def allocate(shape, dtype=torch.bfloat16):
        """A tensor allocated on the side stream (the caller's comes back)."""
        prev = C._cuda_getCurrentStream(rank)
        C._cuda_setStream(stream_id=ids[0], device_index=ids[1], device_type=ids[2])
        out = torch.empty(shape, dtype=dtype, device=dev)
        C._cuda_setStream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])
        return out

    def get():
        t0 = spin()
        (m,) = length.unpack_from(buf, 0)
        data = bytes(view[4: 4 + m])
        out = allocate(m // 2)
        t0 = mark("get: allocate", t0)
        ops.memcpy(out.data_ptr(), int(np.frombuffer(data, dtype=np.uint8).ctypes.data), m, raw_side)
        event = Event(rank).record(raw_side)
        t0 = mark("get: copy up, record", t0)
        ops.wait(C._cuda_getCurrentRawStream(rank), event)
        mark("get: stream waits", t0)
        return out

    def send_then_bell(c, what: str, t, bell_first: bool = False) -> None:
        """``ncclSend`` of ``t`` on communicator ``c`` (the current stream) and its size
        on the socket, the send first (or the socket message, ``bell_first``); steps
        marked ``what``."""
        def send() -> None:
            c.send(t.data_ptr(), t.nbytes, peer, C._cuda_getCurrentRawStream(rank))

        def bell() -> None:
            s.sendall(length.pack(4) + length.pack(t.nbytes))

        steps = ((bell, "socket send"), (send, "ncclSend"))
        t0 = time.perf_counter_ns()
        for step, name in steps if bell_first else steps[::-1]:
            step()
            t0 = mark(f"{what}: {name}", t0)

    def put_nccl(t) -> None:
        send_then_bell(comm, "nccl put", t)

    def get_nccl():
        t0 = spin()
        (m,) = length.unpack_from(buf, 4)
        out = allocate(m // 2)
        t0 = mark("nccl get: allocate", t0)
        comm.recv(out.data_ptr(), m, peer, raw_side)
        event = Event(rank).record(raw_side)
        t0 = mark("nccl get: ncclRecv, record", t0)
        ops.wait(C._cuda_getCurrentRawStream(rank), event)
        mark("nccl get: stream waits", t0)
        return out

    slot = torch.empty(2048, dtype=torch.bfloat16, device=dev)
    posted = Event(rank)

    def post_ahead() -> None:
        """The receive of the next message, posted on the side stream (untimed)."""
        comm_in = back if rank == 0 else fwd
        comm_in.recv(slot.data_ptr(), slot.nbytes, peer, raw_side)
        posted.record(raw_side)

    def put_ahead(t) -> None:
        send_then_bell(fwd if rank == 0 else back, "ahead put", t)

    def put_first(t) -> None:
        """The size on the socket first, then ``ncclSend``: the receiver posts its
        receive while the sender's host call runs."""
        send_then_bell(comm, "first put", t, bell_first=True)

    def get_first():
        """Into a slot allocated beforehand (a receive pool), posted once the size came."""
        t0 = spin()
        (m,) = length.unpack_from(buf, 4)
        comm.recv(slot.data_ptr(), m, peer, raw_side)
        posted.record(raw_side)
        t0 = mark("first get: ncclRecv, record", t0)
        ops.wait(C._cuda_getCurrentRawStream(rank), posted)
        mark("first get: stream waits", t0)
        return slot

    # lean: the connector's own wire steps (its send plan, envelope, checked doorbell,
    # allocation, views, tree, stream wait and record_stream), the doorbell first as
    # the connector rings it, without the connector around them (no lock, index,
    # credits, keeper, pump).
    from omnilink import blob
    from omnilink.connectors.nccl import wire

    pad = torch.zeros(blob.FRAME_ALIGN, dtype=torch.uint8, device=dev)
    seqs = {"out": 0, "in": 0}
    bell_cache: dict = {}
    cur_stream = {}

    def wait_and_keep(event, bufs) -> None:
        """The current stream waits for ``event``; ``bufs`` (allocated on the side
        stream) kept for it (``record_stream``), as the connector's get does."""
        ops.wait(C._cuda_getCurrentRawStream(rank), event)
        ids_now = C._cuda_getCurrentStream(rank)
        stream = cur_stream.get(ids_now)
        if stream is None:
            stream = cur_stream[ids_now] = torch.cuda.Stream(stream_id=ids_now[0], device_index=ids_now[1],
                                                            device_type=ids_now[2])
        for b in bufs:
            b.record_stream(stream)

    def put_lean(t) -> None:
        t0 = time.perf_counter_ns()
        key = f"req{seqs['out']}_0_0"
        sp = wire.plan_send({"hidden_states.output": t, "meta": {"finished": False}}, device=dev, nccl=True,
                            inline_bytes=1 << 16, max_inline_total=1 << 20, key=key, pack_bytes=1 << 20, pad=pad)
        raw = wire.encode_envelope(wire.Envelope(seqs["out"], key, sp.meta, sp.plan, sp.inline, 0, b""))
        seqs["out"] += 1
        t0 = mark("lean put: plan, envelope", t0)
        s.sendall(length.pack(len(raw)) + raw)
        t0 = mark("lean put: socket send", t0)
        p = sp.p2p[0]
        comm.send(p.data_ptr(), p.nbytes, peer, C._cuda_getCurrentRawStream(rank))
        mark("lean put: ncclSend", t0)

    def get_lean():
        t0 = spin()
        (m,) = length.unpack_from(buf, 0)
        ann = wire.read_bell(bytes(view[4: 4 + m]), seq=seqs["in"], max_header_bytes=1 << 20,
                             max_message_bytes=1 << 32, nccl=True, cache=bell_cache)
        seqs["in"] += 1
        allocs, _ = wire.receive_allocs(ann.header, ann.env.plan)
        t0 = mark("lean get: read, check", t0)
        bufs = [allocate(shape, dtype) for shape, dtype in allocs]
        t0 = mark("lean get: allocate", t0)
        comm.recv(bufs[0].data_ptr(), ann.sizes[0], peer, raw_side)
        event = Event(rank).record(raw_side)
        t0 = mark("lean get: ncclRecv, record", t0)
        views = wire.build_views(ann.header, ann.env.plan, ann.env.inline, bufs, device=dev)
        got = wire.decode_tree(ann.header, views)
        t0 = mark("lean get: views, tree", t0)
        wait_and_keep(event, bufs)
        mark("lean get: stream waits, record_stream", t0)
        return got["hidden_states.output"]

    # template: what a path for a stream of one payload shape could cost at least, with
    # the checks a connector cannot skip: the sender matches the payload against the
    # shape it sent last (keys, dtype, shape, device, layout) and sends an envelope of
    # the shape's number, the sequence number, the key and the tree's other values; the
    # receiver checks sequence, shape number and key, carves the tensor out of a slab
    # it allocated beforehand for many payloads (a receive pool; a slab lives on while
    # a tensor cut from it does), posts ``ncclRecv``, records one of a few events it
    # reuses, builds the payload from the shape and makes the current stream wait.
    import msgspec

    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder()
    tmpl_head = struct.Struct("<IIQ")  # length, shape number, seq
    tmpl = {"keys": None, "dtype": None, "shape": None}
    slab_items = 256
    slab = {"t": None, "at": slab_items}
    events = [Event(rank) for _ in range(4)]
    ev_at = [0]
    strided = torch.strided
    Tensor = torch.Tensor

    def put_template(t) -> None:
        t0 = time.perf_counter_ns()
        p = {"hidden_states.output": t, "meta": {"finished": False}}
        h = p["hidden_states.output"]
        if not (type(p) is dict and p.keys() == tmpl["keys"] and type(h) is Tensor and h.dtype is tmpl["dtype"]
                and h.shape == tmpl["shape"] and h.is_cuda and h.get_device() == rank and h.layout is strided
                and not h.requires_grad and h.is_contiguous()):
            tmpl["keys"], tmpl["dtype"], tmpl["shape"] = p.keys(), h.dtype, h.shape  # (a new shape: sent as is)
        key = f"req{seqs['out']}_0_0".encode()
        body = enc.encode((key, p["meta"]))
        raw = tmpl_head.pack(len(body) + 12, 7, seqs["out"]) + body
        seqs["out"] += 1
        t0 = mark("template put: match, envelope", t0)
        s.sendall(raw)
        t0 = mark("template put: socket send", t0)
        comm.send(h.data_ptr(), h.nbytes, peer, C._cuda_getCurrentRawStream(rank))
        mark("template put: ncclSend", t0)

    def get_template():
        t0 = spin()
        m, tid, seq = tmpl_head.unpack_from(buf, 0)
        if tid != 7 or seq != seqs["in"] or m > len(buf):
            raise RuntimeError("template: bad envelope")
        key, meta = dec.decode(view[16: 4 + m])
        if not key or len(key) > 256:
            raise RuntimeError("template: bad key")
        seqs["in"] += 1
        t0 = mark("template get: read, check", t0)
        if slab["at"] == slab_items:
            slab["t"] = allocate((slab_items, 2048))
            slab["at"] = 0
        out = slab["t"][slab["at"]]
        slab["at"] += 1
        t0 = mark("template get: carve", t0)
        comm.recv(out.data_ptr(), 4096, peer, raw_side)
        ev = events[ev_at[0] % 4]
        ev_at[0] += 1
        ev.record(raw_side)
        t0 = mark("template get: ncclRecv, record", t0)
        got = {"hidden_states.output": out, "meta": meta}
        wait_and_keep(ev, [out])
        mark("template get: payload, stream wait, record_stream", t0)
        return got["hidden_states.output"]

    def get_ahead():
        t0 = spin()
        ops.wait(C._cuda_getCurrentRawStream(rank), posted)
        mark("ahead get: stream waits", t0)
        return slot

    t = torch.zeros(2048, dtype=torch.bfloat16, device=dev)
    # Every kernel the exchanges launch, once, before any receive waits on the GPU.
    t.add_(0)
    dist.barrier(device_ids=[rank])
    torch.cuda.synchronize()
    lat: dict[str, list[float]] = {mode: [] for mode in modes}
    for i in range(n + 5):
        for mode in (modes if i % 2 else modes[::-1]):
            if i < 2:
                say("exchange", i, mode)
            dist.barrier(device_ids=[rank])
            torch.cuda.synchronize()
            if mode == "nccl-ahead":
                # Posted now (a device-wide synchronize with a receive waiting would wait
                # for its message), untimed: each rank's next receive, as a receiver
                # posts it after a get; the peer's send may come before it, and neither
                # waits for the socket message.
                post_ahead()
            t0 = time.perf_counter()
            if mode == "raw":
                if rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    dist.recv(t, 0)
                    torch.cuda.synchronize()
                    dist.send(t, 0)
            else:
                send, recv = {"doorbell": (put, get), "nccl-bell": (put_nccl, get_nccl),
                              "nccl-ahead": (put_ahead, get_ahead), "nccl-first": (put_first, get_first),
                              "lean": (put_lean, get_lean), "template": (put_template, get_template)}[mode]
                if rank == 0:
                    send(t)
                    t = recv()
                else:
                    t = recv()
                    torch.cuda.synchronize()
                    send(t)
            if mode in ("nccl-ahead", "nccl-first") and rank == 0:
                t = t.clone()  # (the slot is the next receive's)
            torch.cuda.synchronize()
            if i >= 5:
                lat[mode].append((time.perf_counter() - t0) / 2 * 1e6)
    q.put((rank, {k: statistics.median(v) for k, v in lat.items()},
           {k: statistics.median(v) / 1e3 for k, v in steps.items()}))
    s.close()
    for c in (fwd, back):
        if c is not None:
            c.destroy()
    comm.destroy()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="exchanges per mode (after 5 warm-ups)")
    ap.add_argument("--modes", default="doorbell,nccl-bell,raw",
                    help="comma-separated: doorbell, nccl-bell, nccl-ahead, nccl-first, lean, template, raw")
    ap.add_argument("--eager", action="store_true", help="CUDA_MODULE_LOADING=EAGER in both processes")
    ap.add_argument("--json", default=None, help="also write the figures and the machine record to FILE")
    ap.add_argument("--pin", type=int, default=0, metavar="N",
                    help="pin each rank's process to N CPUs of physical cores of its own (0: not pinned)")
    args = ap.parse_args()
    modes = tuple(m for m in args.modes.split(",") if m)
    bad = [m for m in modes if m not in ("doorbell", "nccl-bell", "nccl-ahead", "nccl-first", "lean", "template",
                                         "raw")]
    if bad or not modes:
        ap.error(f"unknown modes {bad}" if bad else "no mode")
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    sets = pinned_sets(args.pin) if args.pin else [None, None]
    procs = [ctx.Process(target=worker, args=(r, port, f"bellfloor{os.getpid()}", args.n, q, modes, args.eager,
                                              sets[r]))
             for r in (0, 1)]
    for p in procs:
        p.start()
    out = dict((r, (lat, steps)) for r, lat, steps in (q.get(timeout=300) for _ in procs))
    for p in procs:
        p.join(30)
    lat = out[0][0]
    names = {"doorbell": "doorbell floor", "nccl-bell": "NCCL + bell floor", "nccl-ahead": "NCCL posted ahead floor",
             "nccl-first": "bell first, NCCL into a slot floor",
             "lean": "the connector's wire steps alone",
             "template": "a path for one payload shape, checked",
             "raw": "raw torch.distributed"}
    print("4 KiB one-way p50: " + ", ".join(f"{names[m]} {lat[m]:.1f} us" for m in modes))
    print("rank 1 steps (median us): " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(out[1][1].items())))
    if args.json:
        import json

        from omnilink._bench.machine import machine_record

        record = {"scenario": "nccl-bell-floor", "command": " ".join(["python", *sys.argv]), "n": args.n,
                  "eager": args.eager, "pinned": [sorted(c) for c in sets] if args.pin else None, "modes": list(modes), "one_way_p50_us": {m: lat[m] for m in modes},
                  "rank1_steps_median_us": out[1][1], "machine": machine_record(include_cuda=True),
                  "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
