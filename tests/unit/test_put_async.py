"""``put_async`` never blocks the caller: it returns while the transport is full."""

from __future__ import annotations

import omnilink
from omnilink.connectors.memory import MemoryConnector


def test_put_async_returns_while_the_transport_is_full():
    payload = {"x": 1}
    cap = len(omnilink.encode(payload))
    tx = MemoryConnector(channel="async/full", role="sender", capacity_bytes=cap)
    rx = MemoryConnector(channel="async/full", role="receiver", capacity_bytes=cap)
    try:
        tx.put("first", payload, timeout=5)
        fut = tx.put_async("second", {"x": 2}, timeout=30)
        # put() would block here (the channel is full); put_async has already returned.
        assert not fut.done()
        assert rx.get("first", timeout=5) == payload
        assert fut.result(timeout=30) == cap  # room appeared: the queued put completes
        assert rx.get("second", timeout=5) == {"x": 2}
    finally:
        tx.close()
        rx.close()
