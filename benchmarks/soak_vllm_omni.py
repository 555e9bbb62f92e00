"""Soak of ``OmnilinkConnector`` under vLLM-Omni's chunk traffic, with aborted requests.

Two stage processes talk through vLLM-Omni's real ``OmniConnectorFactory`` (loaded
without vLLM, as the integration tests load it: ``tests/integration/_vllm_omni_stubs``),
each holding an ``OmnilinkConnector`` over ``shm``:

- stage 0 (sender) streams N requests of chunked hidden states: 3-20 chunks each, every
  chunk a bf16 ``[tokens, 1024]`` tensor of 16 KiB-8 MiB (log-uniform) plus
  ``meta.finished``, keys ``req{i}_0_{c}`` as the chunk adapter makes them, K requests
  interleaved at a time.
- stage 1 (receiver) takes up each request as its first chunk arrives and reads every
  request it has taken up chunk by chunk, polling like the chunk adapter (non-blocking
  ``get``, a short ``get_with_deadline`` when nothing is there), and holds each live
  request's chunks (zero-copy views of the sender's arena) for the
  request's lifetime. 20% of the requests are aborted after a random number of chunks:
  the receiver stops reading them and drops what it held; the sender still sends their
  remaining chunks, which nobody reads. Nothing tells omnilink about the abort: the
  engine of 0.30.0 would not (its abort cleanup is off for foreign connectors), so the
  unread chunks are left to omnilink's own reclaim (``reclaim_after``).

Sampled every ``--sample-interval`` seconds: arena bytes and blocks in use, /dev/shm
entries of the run, the adapters' index sizes (``health()["pending_keys"]``), the
receiver's shm key index, RSS of both processes, put and get p50/p99 of the interval,
reclaims. At the end: chunks sent, received, reclaimed, left unread, lost (chunks of
requests that were not aborted and never arrived intact: must be 0), and the flatness
checks: each of arena bytes, bookkeeping sizes and RSS averaged over the first 10% of
the requests after the warm-up and over the last 10% (last within 10% of first, plus a
small absolute slack for tiny counts, stated in the output), and put/get p99 of those
two windows (last within 1.5x of first). A get is timed when it finds its chunk there
(the cost of taking it); the waits in between are not latency.

``--kill-receiver-at F`` SIGKILLs the receiver once F of the requests are done. The
sender's next put that has to wait for room gets ``PeerLostError`` (reported for the
edge by the adapter: ``health()["peer_lost"]``); the adapter reclaims the edge's unread
payloads; a new receiver is started and the sender carries on with new requests.
Requests in flight when the receiver died are failed (as the engine fails them), not
lost; every later one must arrive.

Usage::

    python benchmarks/soak_vllm_omni.py [--requests 10000] [--json out.json]
        [--kill-receiver-at 0.5] [--check]

Benchmarks are hard: on a shared machine the latency figures move with the neighbours;
compare windows of one run only.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

HIDDEN = 1024  # bf16 columns: 2 KiB per token row
# status of a request (one byte per request in shared memory, written by its receiver)
UNSEEN, DONE, ABORTED, LOST, CORRUPT = 0, 1, 2, 3, 4
# sender stats slots (doubles in shared memory)
S_CHUNKS, S_REQS, S_ARENA, S_BLOCKS, S_PENDING, S_RECLAIMED, S_FAILED, S_PEER_LOST, S_UNREAD, S_BEAT = range(10)
# receiver stats slots
R_CHUNKS, R_REQS, R_PENDING, R_INDEX, R_HELD, R_BEAT = range(6)


# ------------------------------------------------------------------ the plan
class Plan:
    """Every request's chunk count, chunk sizes and abort point, from one seed."""

    def __init__(self, n: int, seed: int, min_chunks: int, max_chunks: int, min_bytes: int, max_bytes: int,
                 abort_share: float) -> None:
        import numpy as np

        rng = np.random.default_rng(seed)
        self.n = n
        self.chunks = rng.integers(min_chunks, max_chunks + 1, size=n)
        self.offset = np.concatenate([[0], np.cumsum(self.chunks)])
        total = int(self.offset[-1])
        lo, hi = math.log(min_bytes), math.log(max_bytes)
        sizes = np.exp(rng.uniform(lo, hi, size=total))
        self.tokens = np.maximum(1, (sizes // (2 * HIDDEN)).astype(np.int64))
        self.aborted = rng.random(n) < abort_share
        # chunks read before the abort: 0 .. chunks-1 (the rest is never read)
        self.read_upto = np.where(self.aborted, (rng.random(n) * self.chunks).astype(np.int64), self.chunks)
        self.total_chunks = total

    def chunk_index(self, i: int, c: int) -> int:
        return int(self.offset[i]) + c


def _marker(i: int, c: int) -> float:
    return float((i * 31 + c) % 251)


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def _extra(args: argparse.Namespace, role: str, stage: int) -> dict:
    return {
        "channel": args.channel,
        "stage_id": stage,
        "role": role,
        "from_stage": 0,
        "to_stage": 1,
        "options": {"arena_bytes": args.arena_bytes},
        "reclaim_after": args.reclaim_after,
        "put_timeout": args.put_timeout,
    }


def _plan(args: argparse.Namespace) -> Plan:
    return Plan(args.requests, args.seed, args.min_chunks, args.max_chunks, args.min_bytes, args.max_bytes,
                args.abort_share)


# ------------------------------------------------------------------ stage 0
def sender_main(args, shared, q, go, receiver_done) -> None:
    import logging

    logging.basicConfig(level=args.log_level, format="%(asctime)s sender %(levelname)s %(name)s: %(message)s")
    import numpy as np
    import torch

    from omnilink.chunking import chunk_key
    from tests.integration import _vllm_omni_stubs as stubs

    plan = _plan(args)
    stats = np.frombuffer(shared["sstats"], dtype=np.float64)
    put_lat = np.frombuffer(shared["put_lat"], dtype=np.float32)
    put_t = np.frombuffer(shared["put_t"], dtype=np.float64)
    sstatus = np.frombuffer(shared["sstatus"], dtype=np.int8)
    conn = stubs.create(_extra(args, "sender", 0))
    edge = conn.edge("0", "1", side="sender")
    base = torch.zeros((int(plan.tokens.max()), HIDDEN), dtype=torch.bfloat16)
    t0 = shared["t0"]
    try:
        q.put(("ready", os.getpid()))
        active: list[list[int]] = []  # [request, next chunk]
        nxt = 0
        peer_lost_seen = 0
        last_sample = 0.0
        while nxt < plan.n or active:
            while len(active) < args.concurrency and nxt < plan.n:
                active.append([nxt, 0])
                nxt += 1
            for st in list(active):
                i, c = st
                n_chunks = int(plan.chunks[i])
                tokens = int(plan.tokens[plan.chunk_index(i, c)])
                hidden = base[:tokens]
                mark = _marker(i, c)
                hidden[0, 0] = mark
                hidden[tokens - 1, HIDDEN - 1] = mark
                payload = {
                    "hidden_states.output": hidden,
                    "hidden_states.output_shape": torch.tensor([tokens, HIDDEN], dtype=torch.int64),
                    "meta.finished": torch.tensor(c == n_chunks - 1),
                    "req": i,
                    "chunk": c,
                }
                t = time.perf_counter()
                ok, _size, _md = conn.put("0", "1", chunk_key(f"req{i}", 0, c), payload)
                dt = time.perf_counter() - t
                k = plan.chunk_index(i, c)
                if ok:
                    put_lat[k] = dt
                    put_t[k] = time.monotonic() - t0
                    stats[S_CHUNKS] += 1
                    st[1] += 1
                    if st[1] == n_chunks:
                        active.remove(st)
                        sstatus[i] = DONE
                        stats[S_REQS] += 1
                    continue
                health = conn.health()
                if health["peer_lost"] > peer_lost_seen:
                    peer_lost_seen = health["peer_lost"]
                    # The edge's receivers died: the engine fails the requests in flight.
                    for i_failed, _ in active:
                        sstatus[i_failed] = LOST
                    active.clear()
                    stats[S_PEER_LOST] = peer_lost_seen
                    stats[S_RECLAIMED] = health["reclaimed"]
                    q.put(("peer_lost", nxt, health["reclaimed"]))
                    if not go.wait(args.lost_timeout * 4):
                        raise RuntimeError("no new receiver came after the peer was lost")
                    go.clear()
                    break
                stats[S_FAILED] += 1  # a plain put failure: the receiver will see the chunk missing
                st[1] += 1
                if st[1] == n_chunks:
                    active.remove(st)
            now = time.monotonic()
            if now - last_sample >= 0.25:
                last_sample = now
                _sender_sample(conn, edge, stats)
        _sender_sample(conn, edge, stats)
        q.put(("sent", int(stats[S_CHUNKS])))
        if not receiver_done.wait(args.lost_timeout * 4 + 60):
            raise RuntimeError("the receiver never finished")
        conn.reap_consumed()
        _sender_sample(conn, edge, stats)
        stats[S_UNREAD] = len(edge.pending_keys())
        q.put(("final", conn.health()))
    except BaseException as exc:
        q.put(("error", f"sender: {type(exc).__name__}: {exc}"))
        raise
    finally:
        conn.close()


def _sender_sample(conn, edge, stats) -> None:
    health = conn.health()
    st = edge.stats()
    stats[S_ARENA] = st.bytes_in_use
    stats[S_BLOCKS] = st.blocks_in_use
    stats[S_PENDING] = health["pending_keys"]
    stats[S_RECLAIMED] = health["reclaimed"]
    stats[S_BEAT] = time.monotonic()


# ------------------------------------------------------------------ stage 1
def receiver_main(args, shared, start: int, ready, q) -> None:
    import logging

    logging.basicConfig(level=args.log_level, format="%(asctime)s receiver %(levelname)s %(name)s: %(message)s")
    import numpy as np
    import torch  # noqa: F401  (an engine has it loaded; the first decode would import it)

    from omnilink.chunking import chunk_key
    from tests.integration import _vllm_omni_stubs as stubs

    plan = _plan(args)
    stats = np.frombuffer(shared["rstats"], dtype=np.float64)
    get_lat = np.frombuffer(shared["get_lat"], dtype=np.float32)
    get_t = np.frombuffer(shared["get_t"], dtype=np.float64)
    status = np.frombuffer(shared["status"], dtype=np.int8)
    got_chunks = np.frombuffer(shared["got"], dtype=np.int8)
    t0 = shared["t0"]
    try:
        conn = stubs.create(_extra(args, "receiver", 1))
        edge = conn.edge("0", "1", side="receiver")
        ready.set()
        active: list[dict] = []
        nxt = start
        last_sample = 0.0

        def finish(st: dict, outcome: int) -> None:
            active.remove(st)
            st["held"].clear()  # the request ends: its views (and arena blocks) go
            status[st["i"]] = outcome
            stats[R_REQS] += 1

        def take(st: dict, res, timed: float | None) -> None:
            i, c = st["i"], st["c"]
            payload = res[0]
            h = payload["hidden_states.output"]
            k = plan.chunk_index(i, c)
            tokens = int(plan.tokens[k])
            mark = _marker(i, c)
            intact = (payload["req"] == i and payload["chunk"] == c and tuple(h.shape) == (tokens, HIDDEN)
                      and float(h[0, 0]) == mark and float(h[tokens - 1, HIDDEN - 1]) == mark
                      and bool(payload["meta.finished"]) == (c == int(plan.chunks[i]) - 1))
            if timed is not None:
                get_lat[k] = timed
            get_t[k] = time.monotonic() - t0
            got_chunks[k] = 1
            stats[R_CHUNKS] += 1
            st["c"] += 1
            st["since"] = time.monotonic()
            if not intact:
                finish(st, CORRUPT)
                return
            st["held"].append(payload)  # held for the request's lifetime, as engines do
            if st["c"] >= st["upto"]:
                finish(st, ABORTED if plan.aborted[i] else DONE)

        while nxt < plan.n or active:
            progressed = False
            # Admit requests as their first chunk arrives (the engine learns of a request
            # from the orchestrator and polls its chunk 0 at once).
            while nxt < plan.n:
                upto = int(plan.read_upto[nxt])
                if upto == 0:  # aborted before its first chunk was read: never polled
                    status[nxt] = ABORTED
                    stats[R_REQS] += 1
                    nxt += 1
                    continue
                t = time.perf_counter()
                res = conn.get("0", "1", chunk_key(f"req{nxt}", 0, 0))
                dt = time.perf_counter() - t
                if res is None:
                    break
                st = {"i": nxt, "c": 0, "upto": upto, "held": [], "since": time.monotonic()}
                nxt += 1
                active.append(st)
                take(st, res, dt)
                progressed = True
            for st in list(active):
                key = chunk_key(f"req{st['i']}", 0, st["c"])
                t = time.perf_counter()
                res = conn.get("0", "1", key)
                dt = time.perf_counter() - t
                if res is not None:
                    take(st, res, dt)
                    progressed = True
                elif time.monotonic() - st["since"] > args.lost_timeout:
                    finish(st, LOST)
            if not progressed and (active or nxt < plan.n):
                # Nothing there: sleep until the transport wakes us (a short bound, as
                # the chunk adapter's receive loop does), on the oldest stream's next key.
                st = active[0] if active else None
                key = chunk_key(f"req{st['i'] if st else nxt}", 0, st["c"] if st else 0)
                res = conn.get_with_deadline("0", "1", key, deadline=time.monotonic() + 0.005)
                if res is not None:
                    if st is None:
                        st = {"i": nxt, "c": 0, "upto": int(plan.read_upto[nxt]), "held": [],
                              "since": time.monotonic()}
                        nxt += 1
                        active.append(st)
                    take(st, res, None)
            now = time.monotonic()
            if now - last_sample >= 0.25:
                last_sample = now
                _receiver_sample(conn, edge, stats)
        _receiver_sample(conn, edge, stats)
        conn.close()
        q.put(("done", nxt))
    except BaseException as exc:
        q.put(("error", f"receiver: {type(exc).__name__}: {exc}"))
        raise


def _receiver_sample(conn, edge, stats) -> None:
    health = conn.health()
    stats[R_PENDING] = health["pending_keys"]
    stats[R_INDEX] = len(getattr(edge, "_index", ()))  # the shm receiver's key index (diagnostics)
    stats[R_HELD] = edge.stats().bytes_in_use
    stats[R_BEAT] = time.monotonic()


# ------------------------------------------------------------------ the run
def _shm_entries(prefix: str) -> list[str]:
    try:
        return [n for n in os.listdir("/dev/shm") if n.startswith(prefix) or n.startswith("sem." + prefix)]
    except OSError:
        return []


def _pct(values, q: float) -> float | None:
    import numpy as np

    if len(values) == 0:
        return None
    return float(np.percentile(values, q))


def run(args: argparse.Namespace) -> dict:
    import numpy as np

    os.environ["OMNILINK_SHM_PREFIX"] = args.prefix
    ctx = mp.get_context("spawn")
    plan = _plan(args)
    n, total = plan.n, plan.total_chunks
    shared = {
        "sstats": ctx.RawArray("d", 16), "rstats": ctx.RawArray("d", 16),
        "put_lat": ctx.RawArray("f", total), "put_t": ctx.RawArray("d", total),
        "get_lat": ctx.RawArray("f", total), "get_t": ctx.RawArray("d", total),
        "status": ctx.RawArray("b", n), "sstatus": ctx.RawArray("b", n), "got": ctx.RawArray("b", total),
        "t0": time.monotonic(),
    }
    np.frombuffer(shared["put_lat"], dtype=np.float32)[:] = np.nan
    np.frombuffer(shared["get_lat"], dtype=np.float32)[:] = np.nan
    sstats = np.frombuffer(shared["sstats"], dtype=np.float64)
    rstats = np.frombuffer(shared["rstats"], dtype=np.float64)
    put_lat = np.frombuffer(shared["put_lat"], dtype=np.float32)
    put_t = np.frombuffer(shared["put_t"], dtype=np.float64)
    get_lat = np.frombuffer(shared["get_lat"], dtype=np.float32)
    get_t = np.frombuffer(shared["get_t"], dtype=np.float64)
    status = np.frombuffer(shared["status"], dtype=np.int8)
    got = np.frombuffer(shared["got"], dtype=np.int8)
    t0 = shared["t0"]

    sq, go, receiver_done = ctx.Queue(), ctx.Event(), ctx.Event()
    # One queue per receiver: a SIGKILLed child can leave a queue's write lock taken.
    rqs = [ctx.Queue()]
    rready = ctx.Event()
    receiver = ctx.Process(target=receiver_main, args=(args, shared, 0, rready, rqs[0]), daemon=True)
    receiver.start()
    if not rready.wait(120):
        raise RuntimeError("the receiver did not start")
    sender = ctx.Process(target=sender_main, args=(args, shared, sq, go, receiver_done), daemon=True)
    sender.start()
    receivers = [receiver.pid]
    samples: list[dict] = []
    events: list[dict] = []
    final: dict = {}
    killed_at = None
    restart_from = None
    errors: list[str] = []
    last_tick = time.monotonic()
    last_put_t = last_get_t = 0.0
    receiver_finished = False
    kill_at = None if args.kill_receiver_at is None else int(args.kill_receiver_at * n)

    def tick() -> None:
        nonlocal last_put_t, last_get_t
        now = time.monotonic() - t0
        pm = (put_t > last_put_t) & (put_t <= now)
        gm = (get_t > last_get_t) & (get_t <= now)
        pl = put_lat[pm]
        gl = get_lat[gm]
        gl = gl[~np.isnan(gl)]
        last_put_t, last_get_t = now, now
        row = {
            "t": round(now, 2),
            "requests_sent": int(sstats[S_REQS]), "requests_done": int(rstats[R_REQS]),
            "chunks_sent": int(sstats[S_CHUNKS]), "chunks_received": int(rstats[R_CHUNKS]),
            "arena_bytes": int(sstats[S_ARENA]), "arena_blocks": int(sstats[S_BLOCKS]),
            "segments": len(_shm_entries(args.prefix)),
            "sender_pending_keys": int(sstats[S_PENDING]), "receiver_pending_keys": int(rstats[R_PENDING]),
            "receiver_key_index": int(rstats[R_INDEX]), "receiver_held_bytes": int(rstats[R_HELD]),
            "rss_sender": _rss_bytes(sender.pid), "rss_receiver": _rss_bytes(receivers[-1]),
            "put_p50_us": _us(_pct(pl, 50)), "put_p99_us": _us(_pct(pl, 99)),
            "get_p50_us": _us(_pct(gl, 50)), "get_p99_us": _us(_pct(gl, 99)),
            "reclaimed": int(sstats[S_RECLAIMED]),
        }
        samples.append(row)
        if not args.quiet:
            _print_sample(row, header=len(samples) == 1)

    try:
        while True:
            now = time.monotonic()
            if now - last_tick >= args.sample_interval:
                last_tick = now
                tick()
            if kill_at is not None and killed_at is None and rstats[R_REQS] >= kill_at:
                os.kill(receivers[-1], signal.SIGKILL)
                receiver.join(30)
                killed_at = int(rstats[R_REQS])
                events.append({"t": round(now - t0, 2), "event": "receiver SIGKILLed", "requests_done": killed_at})
                print(f"# t={now - t0:.1f}s receiver pid {receivers[-1]} SIGKILLed after {killed_at} requests",
                      flush=True)
            try:
                tag, *value = sq.get(timeout=0.05)
            except Exception:  # queue.Empty
                tag, value = None, None
            if tag == "peer_lost":
                restart_from, reclaimed = value
                events.append({"t": round(time.monotonic() - t0, 2), "event": "sender: PeerLostError for the edge",
                               "restart_from": restart_from, "reclaimed_so_far": reclaimed})
                print(f"# t={time.monotonic() - t0:.1f}s sender reported PeerLostError for the edge; "
                      f"reclaimed so far {reclaimed}; new receiver starts at request {restart_from}", flush=True)
                rready = ctx.Event()
                rqs.append(ctx.Queue())
                receiver = ctx.Process(target=receiver_main, args=(args, shared, restart_from, rready, rqs[-1]),
                                       daemon=True)
                receiver.start()
                receivers.append(receiver.pid)
                if not rready.wait(120):
                    raise RuntimeError("the restarted receiver did not start")
                events.append({"t": round(time.monotonic() - t0, 2), "event": "receiver restarted",
                               "pid": receiver.pid})
                go.set()
            elif tag == "final":
                final = value[0]
                break
            elif tag == "error":
                errors.append(value[0])
                break
            if not receiver_finished and (killed_at is None or restart_from is not None):
                try:
                    rtag, *rvalue = rqs[-1].get_nowait()
                except Exception:
                    rtag = None
                if rtag == "done":
                    receiver_finished = True
                    receiver_done.set()
                elif rtag == "error":
                    errors.append(rvalue[0])
                    break
            if not sender.is_alive() and not final:
                errors.append(f"sender exited with {sender.exitcode}")
                break
        tick()
    finally:
        sender.join(60)
        receiver.join(60)
        for p in (sender, receiver):
            if p.is_alive():
                p.kill()
                p.join(10)
    time.sleep(0.2)
    leftover = _shm_entries(args.prefix)

    # ---- accounting
    live = ~plan.aborted
    failed_by_death = np.zeros(n, dtype=bool)
    if restart_from is not None:
        failed_by_death[:restart_from] = status[:restart_from] == UNSEEN
    lost_requests = live & ~failed_by_death & (status != DONE)
    lost_chunks = 0
    for i in np.nonzero(lost_requests)[0]:
        a, b = plan.offset[i], plan.offset[i + 1]
        lost_chunks += int(b - a - got[a:b].sum())
    corrupt = int((status == CORRUPT).sum())
    sent = int(sstats[S_CHUNKS])
    received = int(rstats[R_CHUNKS])
    reclaimed = int(final.get("reclaimed", sstats[S_RECLAIMED]))
    unread = int(sstats[S_UNREAD])
    accounting = {
        "requests": n, "requests_aborted": int(plan.aborted.sum()),
        "requests_done": int((status == DONE).sum()), "requests_aborted_as_planned": int((status == ABORTED).sum()),
        "requests_failed_by_receiver_death": int(failed_by_death.sum()),
        "requests_lost": int(lost_requests.sum()), "requests_corrupt": corrupt,
        "chunks_planned": total, "chunks_sent": sent, "chunks_received": received,
        "chunks_reclaimed": reclaimed, "chunks_unread_at_end": unread,
        "chunks_discarded": int(final.get("discarded", 0)), "put_failures": int(final.get("put_failures", 0)),
        "chunks_lost": lost_chunks,
        # 0; with a SIGKILLed receiver up to 1: the chunk it had claimed when it died
        "sent_minus_received_reclaimed_unread": sent - received - reclaimed - unread,
        "peer_lost_reported": int(final.get("peer_lost", 0)),
        "dev_shm_left": leftover,
    }

    # ---- flatness: first 10% of the requests after the warm-up vs the last 10%
    flat = _flatness(args, samples, put_lat, put_t, get_lat, get_t, plan, n)
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
        "machine": _machine(),
        "events": events, "errors": errors, "samples": samples, "accounting": accounting,
        "flatness": flat, "elapsed_s": round(time.monotonic() - t0, 1),
    }


def _us(x: float | None) -> float | None:
    return None if x is None else round(x * 1e6, 1)


def _flatness(args, samples, put_lat, put_t, get_lat, get_t, plan, n) -> dict:
    import numpy as np

    warm = int(args.warmup * n)
    win = max(1, int(0.1 * n))
    first = (warm, warm + win)
    last = (n - win, n)
    out: dict = {"warmup_requests": warm, "first_window": list(first), "last_window": list(last)}
    if not samples:
        return out

    def window(rows, lo, hi, key="requests_done"):
        # rows taken while a process was gone (exiting, or killed) have no RSS: left out
        rows = [r for r in rows if r["rss_sender"] and r["rss_receiver"]]
        return [r for r in rows if lo <= r[key] < hi or (hi == n and r[key] >= hi)]

    checks = []
    # (metric, progress key, absolute slack)
    for metric, key, slack in (
        ("arena_bytes", "requests_sent", 4 << 20),
        ("arena_blocks", "requests_sent", 8),
        ("segments", "requests_sent", 0),
        ("sender_pending_keys", "requests_sent", 8),
        ("receiver_pending_keys", "requests_done", 8),
        ("receiver_key_index", "requests_done", 8),
        ("rss_sender", "requests_sent", 8 << 20),
        ("rss_receiver", "requests_done", 8 << 20),
    ):
        a = [r[metric] for r in window(samples, *first, key=key)]
        b = [r[metric] for r in window(samples, *last, key=key)]
        if not a or not b:
            checks.append({"metric": metric, "ok": None, "why": "window without samples"})
            continue
        fa, fb = float(np.mean(a)), float(np.mean(b))
        ok = fb <= 1.10 * fa + slack
        checks.append({"metric": metric, "first": round(fa, 1), "last": round(fb, 1),
                       "ratio": round(fb / fa, 3) if fa else None, "rule": f"last <= 1.10 x first + {slack}",
                       "ok": bool(ok)})
    # p99 of the puts / gets of chunks of the requests in each window
    for name, lat in (("put_p99_us", put_lat), ("get_p99_us", get_lat)):
        vals = []
        for lo, hi in (first, last):
            a, b = int(plan.offset[lo]), int(plan.offset[min(hi, n)])
            x = lat[a:b]
            x = x[~np.isnan(x)]
            vals.append(None if len(x) == 0 else float(np.percentile(x, 99)) * 1e6)
        ok = None if None in vals else vals[1] <= 1.5 * vals[0]
        checks.append({"metric": name, "first": None if vals[0] is None else round(vals[0], 1),
                       "last": None if vals[1] is None else round(vals[1], 1),
                       "ratio": None if None in vals else round(vals[1] / vals[0], 3),
                       "rule": "last <= 1.5 x first", "ok": ok})
    out["checks"] = checks
    out["all_ok"] = all(c["ok"] is not False for c in checks) and any(c["ok"] for c in checks)
    return out


def _machine() -> dict:
    try:
        from omnilink._bench.machine import machine_record

        return machine_record()
    except Exception as exc:  # noqa: BLE001 - diagnostics only
        return {"error": str(exc)}


_COLS = [
    ("t", "t_s", 7), ("requests_sent", "sent", 6), ("requests_done", "done", 6), ("arena_bytes", "arenaMiB", 8),
    ("arena_blocks", "blocks", 6), ("segments", "segs", 4), ("sender_pending_keys", "s_idx", 5),
    ("receiver_pending_keys", "r_idx", 5), ("receiver_key_index", "r_keys", 6), ("rss_sender", "rssS", 5),
    ("rss_receiver", "rssR", 5), ("put_p50_us", "put50", 7), ("put_p99_us", "put99", 7),
    ("get_p50_us", "get50", 7), ("get_p99_us", "get99", 7), ("reclaimed", "reclaim", 7),
]


def _print_sample(row: dict, header: bool) -> None:
    if header:
        print(" ".join(f"{title:>{w}}" for _, title, w in _COLS) + "   (MiB for arena and RSS, us for latency)",
              flush=True)
    cells = []
    for key, _, w in _COLS:
        v = row[key]
        if key in ("arena_bytes", "rss_sender", "rss_receiver"):
            v = f"{v / 2**20:.0f}"
        elif v is None:
            v = "-"
        elif isinstance(v, float):
            v = f"{v:.0f}" if key != "t" else f"{v:.1f}"
        cells.append(f"{v:>{w}}")
    print(" ".join(cells), flush=True)


def _report(res: dict) -> None:
    acc = res["accounting"]
    print("\n== end of run ==")
    for k, v in acc.items():
        print(f"  {k}: {v}")
    for e in res["events"]:
        print(f"  event: {e}")
    for e in res["errors"]:
        print(f"  ERROR: {e}")
    flat = res["flatness"]
    print(f"\n== flatness: requests {flat.get('first_window')} vs {flat.get('last_window')} "
          f"(after {flat.get('warmup_requests')} warm-up requests) ==")
    for c in flat.get("checks", []):
        verdict = {True: "ok", False: "FAIL", None: "n/a"}[c["ok"]]
        print(f"  {c['metric']:<22} first {c.get('first')!s:>14}  last {c.get('last')!s:>14}  "
              f"ratio {c.get('ratio')!s:>6}  {c.get('rule', c.get('why'))}: {verdict}")
    print(f"\nelapsed {res['elapsed_s']} s; machine: {res['machine'].get('cpu')}, {res['machine'].get('cores')} cores")


def _size(text: str) -> int:
    from omnilink._bench.units import parse_size

    return parse_size(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--min-chunks", type=int, default=3)
    ap.add_argument("--max-chunks", type=int, default=20)
    ap.add_argument("--min-bytes", type=_size, default=16 << 10)
    ap.add_argument("--max-bytes", type=_size, default=8 << 20)
    ap.add_argument("--abort-share", type=float, default=0.2)
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight at a time (default 4)")
    ap.add_argument("--arena-bytes", type=_size, default=512 << 20)
    ap.add_argument("--reclaim-after", type=float, default=20.0,
                    help="seconds an unread payload must be old before a full arena reclaims it (default 20; "
                         "the engine's default would be VLLM_OMNI_INPUT_WAIT_TIMEOUT_S = 600)")
    ap.add_argument("--put-timeout", type=float, default=60.0)
    ap.add_argument("--lost-timeout", type=float, default=120.0,
                    help="seconds a live request may wait for its next chunk before it counts as lost")
    ap.add_argument("--sample-interval", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=0.1, help="share of the requests before the first window")
    ap.add_argument("--kill-receiver-at", type=float, default=None,
                    help="SIGKILL the receiver once this share of the requests is done, then restart it")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--channel", default=None)
    ap.add_argument("--json", default=None, help="write the whole result (samples included) here")
    ap.add_argument("--check", action="store_true", help="exit 1 if a chunk of a live request was lost, the "
                    "accounting does not balance, /dev/shm is not clean or a flatness check fails")
    ap.add_argument("--quiet", action="store_true", help="no sample lines while running")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    args.prefix = f"omnilink-soak{os.getpid()}"
    if args.channel is None:
        args.channel = f"soak-{os.getpid()}"
    print(f"# soak: {args.requests} requests, {args.min_chunks}-{args.max_chunks} chunks of "
          f"{args.min_bytes}-{args.max_bytes} bytes, {args.abort_share:.0%} aborted, {args.concurrency} in flight, "
          f"arena {args.arena_bytes >> 20} MiB, reclaim_after {args.reclaim_after} s"
          + (f", receiver SIGKILLed at {args.kill_receiver_at:.0%}" if args.kill_receiver_at is not None else ""),
          flush=True)
    res = run(args)
    _report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    acc = res["accounting"]
    problems = []
    if res["errors"]:
        problems.append("errors")
    if acc["chunks_lost"] or acc["requests_lost"] or acc["requests_corrupt"]:
        problems.append("live chunks lost or corrupt")
    # A receiver SIGKILLed while it held a chunk it had just claimed never counted it:
    # at most the one get it had in flight.
    slack = 1 if args.kill_receiver_at is not None else 0
    if not 0 <= acc["sent_minus_received_reclaimed_unread"] <= slack:
        problems.append("accounting does not balance")
    if acc["dev_shm_left"]:
        problems.append("/dev/shm not clean")
    if args.kill_receiver_at is not None and not acc["peer_lost_reported"]:
        problems.append("the sender never reported PeerLostError")
    if not res["flatness"].get("all_ok", False):
        problems.append("flatness")
    print("verdict: " + ("ok" if not problems else "; ".join(problems)))
    return 1 if (args.check and problems) else 0


if __name__ == "__main__":
    sys.exit(main())
