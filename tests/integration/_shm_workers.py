"""Worker processes for the ``shm`` integration tests.

They live in an importable module because the tests start them with the multiprocessing
``spawn`` context. Each reports to the test through a ``multiprocessing`` queue as
``(tag, value)`` tuples and bounds every wait it makes.
"""

from __future__ import annotations

import os
import time

WAIT = 20.0


def make_payload(i: int, n: int = 1024):
    # numpy, not torch: importing torch would add seconds to every spawned worker.
    import numpy as np

    return {"i": i, "x": np.full((n,), float(i % 251), dtype=np.float32), "meta": {"tag": f"m{i}"}}


def check_payload(got, i: int, n: int = 1024) -> None:
    if got["i"] != i or got["meta"]["tag"] != f"m{i}":
        raise AssertionError(f"payload {i}: header fields {got['i']!r} {got['meta']!r}")
    x = got["x"]
    if x.size != n or float(x.min()) != float(i % 251) or float(x.max()) != float(i % 251):
        raise AssertionError(f"payload {i}: tensor contents differ")


def _connect(channel: str, role: str, **options):
    import omnilink

    return omnilink.connect("shm", channel=channel, role=role, **options)


def _report_errors(q, fn):
    try:
        fn()
    except BaseException as exc:  # report everything; the test decides
        q.put(("error", f"{type(exc).__name__}: {exc}"))
        raise


# ------------------------------------------------------------------ senders
def sender(channel: str, count: int, q, n: int = 1024, arena_bytes: int = 8 << 20, done=None, start=0) -> None:
    """Put payloads ``start .. start+count-1``; then wait for ``done`` (if given) and close."""

    def body():
        with _connect(channel, "sender", arena_bytes=arena_bytes, timeout=WAIT) as tx:
            q.put(("ready", os.getpid()))
            for i in range(start, start + count):
                tx.put(f"k{i}", make_payload(i, n))
            q.put(("sent", count))
            if done is not None:
                done.wait(WAIT)

    _report_errors(q, body)


def slow_forever_sender(channel: str, q) -> None:
    """Put a payload every 10 ms until killed."""

    def body():
        tx = _connect(channel, "sender", arena_bytes=4 << 20, timeout=WAIT)
        q.put(("ready", os.getpid()))
        i = 0
        while True:
            tx.put(f"k{i}", make_payload(i))
            i += 1
            time.sleep(0.01)

    _report_errors(q, body)


# ---------------------------------------------------------------- receivers
def receiver(channel: str, count: int, q, n: int = 1024, delay: float = 0.0, start: int = 0) -> None:
    """Get ``k<start>`` .. in order, checking each payload; report ("got", count)."""

    def body():
        with _connect(channel, "receiver", timeout=WAIT) as rx:
            q.put(("ready", os.getpid()))
            for i in range(start, start + count):
                got = rx.get(f"k{i}")
                check_payload(got, i, n)
                del got
                if delay:
                    time.sleep(delay)
            q.put(("got", count))

    _report_errors(q, body)


def relay(channel_in: str, channel_out: str, count: int, q) -> None:
    """A middle stage: get ``k<i>`` from ``channel_in``, put it on ``channel_out`` with
    ``x`` incremented by one and ``hops`` counted."""

    def body():
        with _connect(channel_in, "receiver", timeout=WAIT) as rx, \
                _connect(channel_out, "sender", arena_bytes=8 << 20, timeout=WAIT) as tx:
            q.put(("ready", os.getpid()))
            for i in range(count):
                got = rx.get(f"k{i}")
                out = {"i": got["i"], "x": got["x"] + 1, "meta": dict(got["meta"], hops=got["meta"].get("hops", 0) + 1)}
                del got
                tx.put(f"k{i}", out)
            q.put(("relayed", count))

    _report_errors(q, body)


def racing_receiver(channel: str, count: int, q, go) -> None:
    """Once ``go`` is set, try every key once with ``get_nowait``; report the ones won."""
    import omnilink

    def body():
        with _connect(channel, "receiver", timeout=WAIT) as rx:
            q.put(("ready", os.getpid()))
            if not go.wait(WAIT):
                raise TimeoutError("no go signal")
            won = []
            for i in range(count):
                try:
                    got = rx.get_nowait(f"k{i}")
                except omnilink.WouldBlock:
                    continue
                check_payload(got, i)
                won.append(i)
                del got
            q.put(("won", won))

    _report_errors(q, body)


def receive_until_lost(channel: str, q) -> None:
    """Get k0, k1, ... reporting progress, until PeerLostError."""
    import omnilink

    def body():
        with _connect(channel, "receiver", timeout=WAIT) as rx:
            q.put(("ready", os.getpid()))
            i = 0
            while True:
                try:
                    got = rx.get(f"k{i}")
                except omnilink.PeerLostError as exc:
                    q.put(("lost", i, str(exc)))
                    return
                check_payload(got, i)
                del got
                i += 1
                q.put(("progress", i))

    _report_errors(q, body)


def holding_receiver(channel: str, count: int, q, n: int) -> None:
    """Get ``count`` payloads, keep their views, report, then sleep until killed."""

    def body():
        rx = _connect(channel, "receiver", timeout=WAIT)
        held = [rx.get(f"k{i}") for i in range(count)]
        q.put(("holding", rx.stats().blocks_in_use))
        time.sleep(3600)
        del held

    _report_errors(q, body)


def holding_then_dropping_receiver(channel: str, count: int, q, n: int, drop, done) -> None:
    """Get ``count`` payloads keeping every view (as engines keep a request's inputs),
    report ``("holding", bytes_held)``; on ``drop`` check and drop them all, report
    ``("dropped", bytes_held)``; then wait for ``done`` (or be killed)."""

    def body():
        import gc

        with _connect(channel, "receiver", timeout=WAIT) as rx:
            held = [rx.get(f"k{i}") for i in range(count)]
            q.put(("holding", rx.stats().bytes_held))
            if not drop.wait(WAIT):
                raise RuntimeError("never told to drop")
            for i, got in enumerate(held):
                check_payload(got, i, n)
            del got
            held.clear()
            gc.collect()
            q.put(("dropped", rx.stats().bytes_held))
            done.wait(WAIT)

    _report_errors(q, body)


def growing_sender(channel: str, count: int, q, n: int, arena_bytes: int) -> None:
    """Put ``count`` payloads with a short timeout (a receiver holds them all, so the
    arena must grow), report ``("grown", segments)``, then sleep until killed."""

    def body():
        tx = _connect(channel, "sender", arena_bytes=arena_bytes, max_inflight=64, timeout=WAIT)
        for i in range(count):
            tx.put(f"k{i}", make_payload(i, n), timeout=5.0)
        q.put(("grown", tx.stats().segments))
        time.sleep(3600)

    _report_errors(q, body)


# ------------------------------------------------------------------ batches
def batch_keys(step: int, per_step: int) -> list[str]:
    return [f"s{step}-r{r}" for r in range(per_step)]


def batch_sender(channel: str, steps: int, per_step: int, q, n: int = 1024, arena_bytes: int = 8 << 20,
                 done=None, leave_out: str | None = None) -> None:
    """Every step, ``put_many`` one payload per request (``s<step>-r<r>``, payload
    ``step * per_step + r``), leaving out the key ``leave_out``; report ("sent", the
    number of payloads); then wait for ``done`` (if given) and close."""

    def body():
        with _connect(channel, "sender", arena_bytes=arena_bytes, max_bytes=arena_bytes, timeout=WAIT) as tx:
            q.put(("ready", os.getpid()))
            total = 0
            for s in range(steps):
                items = {k: make_payload(s * per_step + r, n) for r, k in enumerate(batch_keys(s, per_step))
                         if k != leave_out}
                sizes = tx.put_many(items)
                if len(sizes) != len(items):
                    raise AssertionError(f"put_many returned {len(sizes)} sizes for {len(items)} items")
                total += len(items)
            q.put(("sent", total))
            if done is not None:
                done.wait(WAIT)

    _report_errors(q, body)


def batch_receiver(channel: str, steps: int, per_step: int, q, n: int = 1024, keys: list | None = None) -> None:
    """``get_many`` each step's keys (or ``keys`` once), checking every payload;
    report ("got", count, gets counted)."""

    def body():
        with _connect(channel, "receiver", timeout=WAIT) as rx:
            q.put(("ready", os.getpid()))
            count = 0
            batches = [keys] if keys is not None else [batch_keys(s, per_step) for s in range(steps)]
            for batch in batches:
                got = rx.get_many(batch)
                if list(got) != list(batch):
                    raise AssertionError(f"get_many returned keys {list(got)[:4]}..., asked {batch[:4]}...")
                for k, payload in got.items():
                    s, r = (int(part[1:]) for part in k.split("-"))
                    check_payload(payload, s * per_step + r, n)
                count += len(got)
                del got, payload
            q.put(("got", count, rx.stats().gets))

    _report_errors(q, body)
