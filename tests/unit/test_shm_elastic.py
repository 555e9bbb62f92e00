"""The elastic arena and the lock-free miss of the ``shm`` backend, in one process.

A sender whose receivers hold their payloads' views grows its arena by pre-faulted
extension segments up to ``max_bytes`` instead of failing, gives them back once they
have been empty for ``shrink_after`` seconds, and still meets backpressure when payloads
are merely unread. A ``get_nowait`` miss takes no lock. The same across processes, with
SIGKILL of either side, is in ``tests/integration/test_shm_processes.py``.
"""

from __future__ import annotations

import os
import stat
import time

import numpy as np
import pytest

import omnilink
from omnilink.connectors.shmem import parse_owned_name
from tests.conftest import SHM_DIR, SHM_PREFIX, shm_entries

MiB = 1 << 20
CHUNK = 200_000  # bytes of one payload's array: 5 fit in a 1 MiB arena


def _chan(name: str) -> str:
    return f"unit/elastic-{name}-{os.getpid()}"


def _extensions() -> set[str]:
    return {e for e in shm_entries() if (parse_owned_name(e, SHM_PREFIX) or ("",))[0] == "e"}


def _wait_for(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_held_payloads_grow_the_arena_and_idle_extensions_go_back():
    ch = _chan("grow")
    with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=1 * MiB, max_bytes=8 * MiB,
                          shrink_after=0.3) as tx, \
            omnilink.connect("shm", channel=ch, role="receiver") as rx:
        first = tx.stats()
        assert (first.segments, first.bytes_mapped) == (1, tx._writer.primary.size)
        held = []
        for i in range(15):  # 3x what the arena holds, every view kept
            tx.put(f"k{i}", {"i": i, "x": np.full(CHUNK, i % 251, dtype=np.uint8)}, timeout=2.0)
            held.append(rx.get(f"k{i}", timeout=5.0))
        st = tx.stats()
        assert st.segments >= 3 and st.bytes_mapped > 3 * MiB
        assert st.bytes_held >= 15 * CHUNK and st.bytes_mapped <= 8 * MiB + 4096
        assert rx.stats().bytes_held >= 15 * CHUNK
        exts = _extensions()
        assert len(exts) == st.segments - 1
        for e in exts:  # same rules as the arena: owned name, 0600
            assert parse_owned_name(e, SHM_PREFIX)[1] == os.getpid()
            assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, e)).st_mode) == 0o600
        # Every payload is intact, wherever its block lives.
        for i, got in enumerate(held):
            assert got["i"] == i and int(got["x"][CHUNK - 1]) == i % 251
            assert rx.mapping_of(got["x"].ctypes.data) is not None  # a view, never a copy
        del got
        held.clear()
        assert rx.stats().bytes_held == 0
        # After shrink_after of idleness only the arena is left, mapped and on disk.
        assert _wait_for(lambda: tx.stats().segments == 1)
        assert not _extensions()
        assert tx.stats().bytes_mapped == first.bytes_mapped
        # The receiver drops its mappings of the extensions on its next look.
        tx.put("after", {"x": np.ones(10)})
        assert rx.get("after", timeout=5.0)["x"].sum() == 10
        assert not rx._reader_list[0].extensions


def test_unread_payloads_do_not_grow_the_arena():
    ch = _chan("unread")
    with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=1 * MiB, max_bytes=8 * MiB) as tx, \
            omnilink.connect("shm", channel=ch, role="receiver") as rx:
        chunk = {"x": np.zeros(CHUNK, dtype=np.uint8)}
        i = 0
        with pytest.raises(omnilink.TransferTimeout):
            while i < 50:
                tx.put(f"k{i}", chunk, timeout=0.2)
                i += 1
        assert 0 < i < 10
        assert tx.stats().segments == 1 and not _extensions()
        for j in range(i):
            assert rx.get(f"k{j}", timeout=5.0)["x"].size == CHUNK


def test_max_bytes_caps_the_growth_then_backpressure():
    ch = _chan("cap")
    with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=1 * MiB, max_bytes=2 * MiB) as tx, \
            omnilink.connect("shm", channel=ch, role="receiver") as rx:
        held = []
        with pytest.raises(omnilink.TransferTimeout) as info:
            for i in range(50):
                tx.put(f"k{i}", {"x": np.zeros(CHUNK, dtype=np.uint8)}, timeout=0.3)
                held.append(rx.get(f"k{i}", timeout=5.0))
        assert "release" in info.value.peer
        st = tx.stats()
        assert st.segments >= 2 and st.bytes_mapped <= 2 * MiB
        assert 2 * MiB - st.bytes_mapped < tx._writer.data_bytes  # no room for one more extension
        assert 2 < len(held) < 12


def test_fixed_arena_when_max_bytes_is_arena_bytes():
    ch = _chan("fixed")
    with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=1 * MiB, max_bytes=1 * MiB) as tx, \
            omnilink.connect("shm", channel=ch, role="receiver") as rx:
        held = []
        with pytest.raises(omnilink.TransferTimeout):
            for i in range(20):
                tx.put(f"k{i}", {"x": np.zeros(CHUNK, dtype=np.uint8)}, timeout=0.2)
                held.append(rx.get(f"k{i}", timeout=5.0))
        assert tx.stats().segments == 1 and not _extensions()


def test_close_removes_extensions_while_views_live():
    ch = _chan("close")
    tx = omnilink.connect("shm", channel=ch, role="sender", arena_bytes=1 * MiB, shrink_after=60)
    rx = omnilink.connect("shm", channel=ch, role="receiver")
    held = []
    for i in range(8):
        tx.put(f"k{i}", {"x": np.full(CHUNK, 7, dtype=np.uint8)}, timeout=2.0)
        held.append(rx.get(f"k{i}", timeout=5.0))
    assert _extensions()
    tx.close()
    rx.close()
    assert not shm_entries()  # names gone; the mappings live on for the views
    assert all(int(h["x"][-1]) == 7 for h in held)


@pytest.mark.parametrize("bad", [0, 1 * MiB - 1, 1.5, True, "1G"])
def test_bad_max_bytes(bad):
    with pytest.raises(omnilink.ConfigurationError):
        omnilink.connect("shm", channel=_chan("bad"), role="sender", arena_bytes=1 * MiB, max_bytes=bad)


@pytest.mark.parametrize("bad", [-1, None, "x"])
def test_bad_shrink_after(bad):
    with pytest.raises(omnilink.ConfigurationError):
        omnilink.connect("shm", channel=_chan("bad"), role="sender", arena_bytes=1 * MiB, shrink_after=bad)


def test_default_max_bytes_is_a_share_of_free_dev_shm(monkeypatch):
    from omnilink.connectors.shm import connector as shm_connector

    monkeypatch.setattr(shm_connector, "free_shm_bytes", lambda: 12 * MiB)
    with omnilink.connect("shm", channel=_chan("default"), role="sender", arena_bytes=1 * MiB) as tx:
        assert tx.max_bytes == 3 * MiB  # a quarter of what is free
    monkeypatch.setattr(shm_connector, "free_shm_bytes", lambda: 1 << 40)
    with omnilink.connect("shm", channel=_chan("default2"), role="sender", arena_bytes=1 * MiB) as tx:
        assert tx.max_bytes == 8 * MiB  # 8x the arena at most


def test_get_nowait_miss_takes_no_lock(monkeypatch):
    ch = _chan("miss")
    with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=1 * MiB) as tx, \
            omnilink.connect("shm", channel=ch, role="receiver") as rx:
        tx.put("a", {"x": np.ones(4)})
        assert rx.get_nowait("a")["x"].sum() == 4  # maps the sender, reads its log
        chan = rx._chan

        def no_lock(*args, **kwargs):
            raise AssertionError("a miss took the channel mutex")

        from omnilink.connectors.shm import connector as shm_connector

        yields = []
        monkeypatch.setattr(chan, "lock", no_lock)
        monkeypatch.setattr(chan, "lock_within", no_lock)
        monkeypatch.setattr(shm_connector, "_yield", lambda: yields.append(1))
        rx._last_beat = time.monotonic() + 3600  # no heartbeat due during the check
        for _ in range(100):
            with pytest.raises(omnilink.WouldBlock):
                rx.get_nowait("b")
        assert len(yields) == 100  # every miss gives the CPU away
        monkeypatch.undo()
        tx.put("b", {"x": np.ones(3)})
        assert rx.get_nowait("b")["x"].sum() == 3  # news is seen at once


def test_stats_does_not_wait_for_a_put_blocked_on_a_full_arena():
    import threading

    ch = _chan("stats")
    with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=1 * MiB, max_bytes=1 * MiB) as tx, \
            omnilink.connect("shm", channel=ch, role="receiver") as rx:
        chunk = {"x": np.zeros(CHUNK, dtype=np.uint8)}
        n = 0
        while True:  # fill the arena with unread payloads
            try:
                tx.put(f"k{n}", chunk, timeout=0.1)
            except omnilink.TransferTimeout:
                break
            n += 1
        blocked = threading.Thread(target=lambda: tx.put("late", chunk, timeout=30), daemon=True)
        blocked.start()
        time.sleep(0.2)  # the put is now waiting for room, holding the sender's lock
        got: list = []
        reader = threading.Thread(target=lambda: got.append(tx.stats()), daemon=True)
        reader.start()
        reader.join(10)
        assert not reader.is_alive() and got[0].segments == 1 and got[0].blocks_in_use == n
        for i in range(n):  # reading frees room: the blocked put goes through
            rx.get(f"k{i}", timeout=5)
        blocked.join(30)
        assert not blocked.is_alive()
        assert rx.get("late", timeout=5)["x"].size == CHUNK
