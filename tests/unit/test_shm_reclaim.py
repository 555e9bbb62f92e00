"""Reclaiming unread payloads in the ``shm`` backend: ``reclaim_after`` (under arena
pressure, oldest first, only payloads older than the limit that the receivers have read
past), ``reclaim_unread`` and ``pending_keys``. A payload a receiver has claimed is never
reclaimed."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

import omnilink
from omnilink.connectors.shm import ShmConnector

ARENA = 1 << 20  # the smallest arena: with 16 descriptors, 4 payloads of 240 KiB fill it
N = 240 << 10


def _payload(i: int) -> dict:
    return {"i": i, "x": np.full(N, i % 251, dtype=np.uint8)}


@pytest.fixture
def channel(request):
    return f"reclaim-{os.getpid()}-{request.node.name[:40]}"


def _fill(tx, count: int) -> list[str]:
    keys = [f"k{i}" for i in range(count)]
    for i, key in enumerate(keys):
        tx.put(key, _payload(i), timeout=5.0)
    return keys


def test_full_arena_reclaims_overtaken_unread_payloads_oldest_first(channel, caplog):
    with ShmConnector(channel=channel, role="sender", arena_bytes=ARENA, max_bytes=ARENA, max_inflight=16, reclaim_after=0.0) as tx, \
            ShmConnector(channel=channel, role="receiver") as rx:
        keys = _fill(tx, 4)
        held = rx.get_nowait("k3")  # the receiver read past k0..k2 (and holds k3)
        assert tx.stats().reclaimed == 0
        with caplog.at_level(logging.INFO, logger="omnilink.connectors.shm.connector"):
            tx.put("new", _payload(99), timeout=5.0)  # the arena is full: k0 goes, only k0
        assert tx.stats().reclaimed == 1
        assert any("'k0'" in r.getMessage() and "s ago" in r.getMessage() for r in caplog.records)
        with pytest.raises(omnilink.WouldBlock):
            rx.get_nowait("k0")
        for i, key in enumerate(keys[1:3], start=1):
            assert int(rx.get_nowait(key)["x"][0]) == i
        assert rx.get_nowait("new")["i"] == 99
        assert int(held["x"][0]) == 3
        del held


def test_claimed_and_not_overtaken_payloads_are_never_reclaimed(channel):
    with ShmConnector(channel=channel, role="sender", arena_bytes=ARENA, max_bytes=ARENA, max_inflight=16, reclaim_after=0.0) as tx, \
            ShmConnector(channel=channel, role="receiver") as rx:
        _fill(tx, 4)
        held0 = rx.get_nowait("k0")  # claimed and still viewed: a live request holds it
        held3 = rx.get_nowait("k3")
        addr = held0["x"].ctypes.data
        for i in (4, 5):  # each put reclaims an overtaken unread one (k1, k2)
            tx.put(f"k{i}", _payload(i), timeout=5.0)
        assert tx.stats().reclaimed == 2
        # k4 and k5 were published after everything read so far: not reclaimed.
        with pytest.raises(omnilink.TransferTimeout):
            tx.put("k6", _payload(6), timeout=0.3)
        assert tx.stats().reclaimed == 2
        assert held0["x"].ctypes.data == addr and int(held0["x"].min()) == 0 and int(held0["x"].max()) == 0
        assert int(held3["x"].min()) == 3 and int(held3["x"].max()) == 3
        assert [rx.get_nowait(k)["i"] for k in ("k4", "k5")] == [4, 5]
        del held0, held3


def test_a_receiver_that_is_only_behind_loses_nothing(channel):
    # Reading in publication order, however slowly, never reads past an unread payload.
    with ShmConnector(channel=channel, role="sender", arena_bytes=ARENA, max_bytes=ARENA, max_inflight=16, reclaim_after=0.0) as tx, \
            ShmConnector(channel=channel, role="receiver") as rx:
        keys = _fill(tx, 4)
        held = rx.get_nowait("k0")
        with pytest.raises(omnilink.TransferTimeout):
            tx.put("new", _payload(9), timeout=0.3)
        assert tx.stats().reclaimed == 0
        assert [rx.get_nowait(k)["i"] for k in keys[1:]] == [1, 2, 3]
        del held


def test_payloads_younger_than_the_limit_are_not_reclaimed(channel):
    with ShmConnector(channel=channel, role="sender", arena_bytes=ARENA, max_bytes=ARENA, max_inflight=16, reclaim_after=3600.0) as tx, \
            ShmConnector(channel=channel, role="receiver") as rx:
        keys = _fill(tx, 4)
        held = rx.get_nowait("k3")
        with pytest.raises(omnilink.TransferTimeout):
            tx.put("new", _payload(9), timeout=0.3)
        assert tx.stats().reclaimed == 0
        assert [rx.get_nowait(k)["i"] for k in keys[:3]] == [0, 1, 2]
        del held


def test_without_reclaim_after_a_full_arena_blocks(channel):
    with ShmConnector(channel=channel, role="sender", arena_bytes=ARENA, max_bytes=ARENA, max_inflight=16) as tx:
        _fill(tx, 4)
        with pytest.raises(omnilink.TransferTimeout):
            tx.put("new", _payload(9), timeout=0.3)
        assert tx.stats().reclaimed == 0


def test_reclaim_unread_drops_unclaimed_payloads_oldest_first(channel, caplog):
    with ShmConnector(channel=channel, role="sender", arena_bytes=ARENA, max_bytes=ARENA, max_inflight=16) as tx, \
            ShmConnector(channel=channel, role="receiver") as rx:
        _fill(tx, 3)
        held = rx.get_nowait("k1")
        assert tx.reclaim_unread(3600.0) == []
        assert sorted(tx.pending_keys()) == ["k0", "k2"]
        with caplog.at_level(logging.INFO, logger="omnilink.connectors.shm.connector"):
            dropped = tx.reclaim_unread(0)
        assert [k for k, _ in dropped] == ["k0", "k2"]
        assert all(age >= 0 for _, age in dropped)
        assert sum("reclaimed unread payload" in r.getMessage() for r in caplog.records) == 2
        assert tx.stats().reclaimed == 2
        assert tx.pending_keys() == []
        assert held["i"] == 1
        del held


def test_reclaim_options_are_validated(channel):
    for bad in (-1, "5", True, float("nan")):
        with pytest.raises(omnilink.ConfigurationError, match="reclaim_after"):
            ShmConnector(channel=channel, role="sender", arena_bytes=ARENA, max_bytes=ARENA, max_inflight=16, reclaim_after=bad)
    with ShmConnector(channel=channel, role="sender", arena_bytes=ARENA, max_bytes=ARENA, max_inflight=16) as tx:
        with pytest.raises(omnilink.ConfigurationError, match="older_than"):
            tx.reclaim_unread(-1)
    with ShmConnector(channel=channel, role="receiver") as rx:
        with pytest.raises(omnilink.ConfigurationError, match="no arena"):
            rx.reclaim_unread(0)
        assert rx.pending_keys() == []
    with pytest.raises(omnilink.ClosedError):
        rx.pending_keys()


def test_receiver_key_index_forgets_payloads_it_never_read(channel):
    # Unread payloads the sender dropped (discarded or reclaimed) leave no entry behind in
    # a receiver's key index once their descriptor is published again: it stays as small
    # as the arena however many go by.
    with ShmConnector(channel=channel, role="sender", arena_bytes=ARENA, max_bytes=ARENA, max_inflight=16) as tx, \
            ShmConnector(channel=channel, role="receiver") as rx:
        for i in range(200):
            tx.put(f"gone{i}", {"i": i}, timeout=5.0)
            with pytest.raises(omnilink.WouldBlock):
                rx.get_nowait("nothing")  # the receiver scans and indexes gone{i}
            assert tx.discard(f"gone{i}")
        assert len(rx._index) <= 16
        tx.put("last", {"i": -1}, timeout=5.0)
        assert rx.get_nowait("last")["i"] == -1


def test_reclaim_comes_before_the_arena_grows(channel):
    with ShmConnector(channel=channel, role="sender", arena_bytes=ARENA, max_bytes=4 * ARENA, max_inflight=16,
                      reclaim_after=0.0) as tx, ShmConnector(channel=channel, role="receiver") as rx:
        _fill(tx, 4)
        held = rx.get_nowait("k3")  # held blocks alone would let the arena grow
        tx.put("new", _payload(9), timeout=5.0)
        st = tx.stats()
        assert (st.reclaimed, st.segments) == (1, 1)
        del held


def test_pending_keys_does_not_wait_for_a_put_blocked_on_a_full_arena(channel):
    import threading
    import time

    with ShmConnector(channel=channel, role="sender", arena_bytes=ARENA, max_bytes=ARENA, max_inflight=16) as tx, \
            ShmConnector(channel=channel, role="receiver") as rx:
        _fill(tx, 4)
        blocked = threading.Thread(target=lambda: tx.put("late", _payload(9), timeout=30), daemon=True)
        blocked.start()
        time.sleep(0.2)  # the put now waits for room, holding the sender's lock
        got: list = []
        reader = threading.Thread(target=lambda: got.append(sorted(tx.pending_keys())), daemon=True)
        reader.start()
        reader.join(10)
        assert not reader.is_alive() and got == [["k0", "k1", "k2", "k3"]]
        for i in range(4):  # reading frees room: the blocked put goes through
            assert rx.get(f"k{i}", timeout=5)["i"] == i
        blocked.join(30)
        assert not blocked.is_alive()
        assert rx.get("late", timeout=5)["i"] == 9
