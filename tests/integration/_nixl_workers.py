"""Child-process bodies of the nixl two-process tests (importable, spawn-safe)."""

from __future__ import annotations

import os
import time
import traceback


def payload(i: int, size: int = 4096):
    import torch

    n = max(1, size // 2)
    return {"hidden": (torch.arange(n, dtype=torch.int32) % 251 + i).to(torch.bfloat16),
            "ids": torch.arange(7) + i, "meta": {"finished": torch.tensor(i % 2 == 0), "i": i}}


def sender(tls: str, channel: str, endpoint: str | None, count: int, size: int, q) -> None:
    """Put ``count`` payloads, then report and wait to be killed or told to stop."""
    os.environ["UCX_TLS"] = tls
    import omnilink

    opts = {} if endpoint is None else {"endpoint": endpoint}
    with omnilink.connect("nixl", channel=channel, role="sender", timeout=60.0, **opts) as tx:
        for i in range(count):
            tx.put(f"k{i}", payload(i, size))
        q.put(("sent", count))
        time.sleep(120)  # killed by the test (or it times out)


def sender_then_killed(tls: str, channel: str, count: int, size: int) -> None:
    """Put ``count`` payloads and SIGKILL this process the moment the last put returns
    (before the receiver can have answered it)."""
    import signal

    os.environ["UCX_TLS"] = tls
    import omnilink

    tx = omnilink.connect("nixl", channel=channel, role="sender", timeout=60.0)
    for i in range(count):
        tx.put(f"d{i}", payload(i, size))
    os.kill(os.getpid(), signal.SIGKILL)


def receiver(tls: str, channel: str, q, stop) -> None:
    """Open a receiver, report its endpoint, get one key, report, then wait. Any error is
    reported as ("error", traceback text) before the process exits with it.

    ``q`` must be this process's own queue when the test SIGKILLs it: a multiprocessing
    queue's write lock is shared by all its writers, and a writer killed right after the
    reader saw its message (before its feeder thread released the lock) leaves it taken,
    so any later writer on that queue blocks forever."""
    os.environ["UCX_TLS"] = tls
    try:
        import omnilink

        with omnilink.connect("nixl", channel=channel, role="receiver", timeout=60.0, pool_bytes=16 << 20) as rx:
            q.put(("ready", rx.endpoint))
            got = rx.get("first", timeout=60.0)
            q.put(("got", int(got["meta"]["i"])))
            stop.wait(120)
    except BaseException:
        q.put(("error", traceback.format_exc()))
        raise


def streamer(tls: str, channel: str, size: int, q) -> None:
    """Put payloads without bool tensors (published ahead of their WRITE) under keys
    s0, s1, ... until killed, reporting once the first is in."""
    os.environ["UCX_TLS"] = tls
    import omnilink

    with omnilink.connect("nixl", channel=channel, role="sender", timeout=60.0) as tx:
        i = 0
        while True:
            p = payload(i, size)
            del p["meta"]["finished"]
            tx.put(f"s{i}", p)
            if i == 0:
                q.put(("streaming", 0))
            i += 1


def sender_reconnects(tls: str, channel: str, endpoint: str, q, go1, go2) -> None:
    """Put ``a``; on ``go1`` break this sender's doorbell (as a crashed socket), so that
    putting ``b`` ends the session (``PeerLostError``; its connections closed); on
    ``go2`` put ``c``, which connects again. Reports each step, ``("c", "ok")`` or
    ``("c", the error)`` last."""
    os.environ["UCX_TLS"] = tls
    try:
        import torch

        import omnilink

        with omnilink.connect("nixl", channel=channel, role="sender", endpoint=endpoint, timeout=60.0) as tx:
            tx.put("a", {"t": torch.arange(4)})
            q.put(("a", "ok"))
            go1.wait(60)
            tx._tx.bell_w.sock.shutdown(2)
            try:
                tx.put("b", {"t": torch.arange(5)})
                q.put(("b", "no PeerLostError"))
                return
            except omnilink.PeerLostError:
                q.put(("b", "lost"))
            go2.wait(60)
            try:
                tx.put("c", {"t": torch.arange(6)})
            except omnilink.OmnilinkError as exc:
                q.put(("c", f"{type(exc).__name__}: {exc}"))
                return
            q.put(("c", "ok"))
            time.sleep(60)  # killed by the test (or it times out)
    except BaseException:
        q.put(("error", traceback.format_exc()))
        raise
