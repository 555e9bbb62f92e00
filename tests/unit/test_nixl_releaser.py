"""``nixl.pool.Releaser``: a released block wakes the receiver's loop only while a sender
waits for room (``eager``), and ``drain`` hands back only blocks whose consumer's work
is done (or waits for it when asked). CPU-only: events are stand-ins."""

from __future__ import annotations

import select

from omnilink.connectors.nixl.pool import Releaser


class _Lease:
    pass


class _FakeEvent:
    def __init__(self, done: bool) -> None:
        self.done = done
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_a_release_wakes_the_loop_only_while_eager():
    rel = Releaser()
    try:
        a, b = _Lease(), _Lease()
        ra = rel.track(a, "a", 10)
        rb = rel.track(b, "b", 20)
        assert rel.live_bytes == 30
        del a  # the last view died: queued, the loop not woken
        assert list(rel.queue) == [("a", None)] and not _readable(rel.fd)
        assert rel.live_bytes == 20
        rel.eager = True  # a sender waits for room
        del b
        assert _readable(rel.fd)
        assert rel.drain() == ["a", "b"] and not rel.queue and not _readable(rel.fd)
        assert rel.live_bytes == 0
        rel.release(ra)  # released once only
        rel.release(rb)
        assert not rel.queue
    finally:
        rel.close()


def test_drain_keeps_blocks_whose_consumer_is_still_running():
    rel = Releaser()
    try:
        busy, done = _FakeEvent(False), _FakeEvent(True)
        rel.queue.extend([("busy", busy), ("done", done), ("host", None)])
        assert rel.drain() == ["done", "host"]
        assert list(rel.queue) == [("busy", busy)] and not busy.waited
        assert rel.drain() == []  # still running: still queued
        assert rel.drain(wait=True) == ["busy"] and busy.waited and not rel.queue
    finally:
        rel.close()


def test_a_closed_releaser_queues_nothing():
    rel = Releaser()
    lease = _Lease()
    rel.track(lease, "x", 1)
    rel.close()
    del lease
    assert not rel.queue and rel.fd < 0 and rel.live_bytes == 0
