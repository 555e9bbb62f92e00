"""Unit tests of the ``shm`` backend's pieces: allocator, descriptor queue, names,
permissions, preflight, overflow, backpressure, close, validation and garbage collection.
All in one process; the multi-process behaviour is in tests/integration."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import posix_ipc
import pytest

import omnilink
from omnilink.connectors.shm import segments as seg
from omnilink.connectors.shmem import segment as shm_segment
from omnilink.connectors.shmem.alloc import ALIGN, Allocator
from omnilink.connectors.shmem.names import (
    arena_name,
    channel_names,
    parse_channel_name,
    parse_owned_name,
    read_prefix,
)
from omnilink.connectors.shm import ShmConnector, collect_garbage
from tests.conftest import SHM_DIR, SHM_PREFIX, shm_entries

MiB = 1 << 20


def _chan(name: str) -> str:
    return f"unit/{name}-{os.getpid()}"


def _pair(name: str, **tx_options):
    ch = _chan(name)
    tx = omnilink.connect("shm", channel=ch, role="sender", arena_bytes=tx_options.pop("arena_bytes", 2 * MiB), **tx_options)
    rx = omnilink.connect("shm", channel=ch, role="receiver")
    return tx, rx


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------- allocator
def test_allocator_aligns_and_coalesces():
    a = Allocator(64 * ALIGN)
    offs = [a.alloc(n) for n in (1, 100, 64, 65, 200)]
    assert all(o % ALIGN == 0 for o in offs)
    assert offs == [0, 64, 192, 256, 384]
    assert a.used_bytes == 64 + 128 + 64 + 128 + 256
    for o in (offs[1], offs[3], offs[0], offs[4], offs[2]):
        a.free(o)
    assert a.extents() == [(0, 64 * ALIGN)] and a.used_bytes == 0 and a.blocks == 0


def test_allocator_full_then_reuse_hole_first_fit():
    a = Allocator(4 * ALIGN)
    o = [a.alloc(ALIGN) for _ in range(4)]
    assert a.alloc(1) is None
    a.free(o[1])
    a.free(o[2])
    assert a.extents() == [(ALIGN, 2 * ALIGN)]
    assert a.alloc(2 * ALIGN) == ALIGN
    assert a.alloc(1) is None


def test_allocator_double_free_is_an_error():
    a = Allocator(4 * ALIGN)
    o = a.alloc(10)
    a.free(o)
    with pytest.raises(KeyError):
        a.free(o)


def test_allocator_random_workload_never_overlaps():
    rng = np.random.default_rng(0)
    a = Allocator(1024 * ALIGN)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.5:
            off = list(live)[rng.integers(len(live))]
            a.free(off)
            del live[off]
        else:
            n = int(rng.integers(1, 40 * ALIGN))
            off = a.alloc(n)
            if off is not None:
                live[off] = n
        spans = sorted((o, o + a.size_of(o)) for o in live)
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
        free = a.extents()
        assert all(s1 + n1 < s2 for (s1, n1), (s2, _) in zip(free, free[1:]))  # coalesced
    for off in list(live):
        a.free(off)
    assert a.extents() == [(0, 1024 * ALIGN)]


# ------------------------------------------------------------ descriptor queue
@pytest.fixture
def arena():
    ch = seg.Channel(read_prefix(), _chan("queue"))
    ch.join(seg.ROLE_SEND | seg.ROLE_RECV, "0" * 16)
    w = seg.ArenaWriter(read_prefix(), os.getpid(), "1" * 16, 2 * MiB, 8)
    r = seg.ArenaReader(read_prefix(), os.getpid(), "1" * 16)
    yield ch, w, r
    r.close()
    w.close()
    ch.leave()


def _publish(ch, w, key: str, n: int = 100) -> int:
    off = w.alloc.alloc(n)
    idx = w.free_desc.pop()
    with ch.locked():
        w.publish(idx, key.encode(), seg._OutRec(0, key, off, w.alloc.size_of(off), None), n, 0, b"")
    return idx


def _watch_pub_seq(prefix: str, pid: int, token: str, conn, seconds: float) -> None:
    """Child: read the arena's pub_seq without the mutex, as a polling receiver does, and
    report how often it went backwards (a torn read) and how many values it saw."""
    r = seg.ArenaReader(prefix, pid, token)
    conn.send("ready")
    while r.published() == 0:
        pass
    back = reads = 0
    last = r.published()
    seen = {last}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(1000):
            v = r.published()
            if v < last:
                back += 1
            else:
                last = v
            if len(seen) < 100:
                seen.add(v)
            reads += 1
    conn.send((back, reads, len(seen)))
    r.close()


def test_pub_seq_being_published_never_reads_backwards_in_another_process(arena, procs):
    # A receiver decides a miss by reading pub_seq without the mutex. Written with
    # struct.pack_into (which zero-fills its target first) it could read 0 for an
    # instant: a receiver that had never scanned (cursor 0) then reported a miss of a
    # payload published long ago. It is one native 8-byte store now (segments._word).
    from tests.procs import CTX, start_process

    ch, w, r = arena
    here, there = CTX.Pipe()
    p = start_process(procs, _watch_pub_seq, read_prefix(), os.getpid(), "1" * 16, there, 1.5)
    assert here.poll(120), "the reader never started"
    assert here.recv() == "ready"
    off = w.alloc.alloc(64)
    idx = w.free_desc.pop()
    rec = seg._OutRec(0, "k", off, w.alloc.size_of(off), None)
    with ch.locked():
        while not here.poll():
            for _ in range(200):
                w.publish(idx, b"k", rec, 64, 0, b"")
    back, reads, distinct = here.recv()
    p.join(30)
    assert reads > 10_000 and distinct > 2  # it really read while we published
    assert back == 0, f"{back} of {reads} reads of pub_seq went backwards (torn)"


def test_queue_publish_scan_claim_release_reclaim(arena):
    ch, w, r = arena
    _publish(ch, w, "a")
    _publish(ch, w, "b/c")
    index: dict = {}
    with ch.locked():
        r.scan(index)
    assert set(index) == {"a", "b/c"}
    (reader, idx, seq), = index["b/c"]
    with ch.locked():
        assert r.claim(idx, seq, os.getpid()) is not None
        assert r.claim(idx, seq, os.getpid()) is None  # exactly once
        r.mark_released(idx, seq, os.getpid())
        assert w.drain() == 1
        assert w.drain() == 0
    assert len(w.out) == 1 and len(w.free_desc) == 7
    # a second reader's scan no longer lists the consumed key
    index2: dict = {}
    with ch.locked():
        r2 = seg.ArenaReader(read_prefix(), os.getpid(), "1" * 16)
        r2.scan(index2)
    assert set(index2) == {"a"}
    r2.close()


def test_queue_reader_behind_the_log_rescans(arena):
    ch, w, r = arena
    index: dict = {}
    keys = []
    for round_ in range(6):  # 48 publications through a log of 32 entries
        batch = [f"k{round_}-{j}" for j in range(8)]
        for k in batch:
            _publish(ch, w, k, 64)
        if round_ < 5:
            with ch.locked():
                for k in batch:
                    assert w.discard(k)
        keys = batch
    with ch.locked():
        r.scan(index)
    assert set(index) == set(keys)


def test_queue_abandoned_claim_reclaimed(arena):
    ch, w, r = arena
    idx = _publish(ch, w, "x")
    index: dict = {}
    dead = _dead_pid()
    with ch.locked():
        r.scan(index)
        (_, i, seq), = index["x"]
        assert r.claim(i, seq, dead) is not None
        assert w.reclaim_abandoned() == 1
    assert idx in w.free_desc and w.alloc.used_bytes == 0


# ----------------------------------------------------------------------- names
def test_names_carry_prefix_pid_token_and_parse_back():
    prefix = read_prefix()
    assert prefix == SHM_PREFIX
    name = arena_name(prefix, 1234, "ab" * 8)
    assert name == f"/{prefix}-a1234-{'ab' * 8}"
    assert parse_owned_name(name[1:], prefix) == ("a", 1234, "ab" * 8, False, False)
    assert parse_owned_name("sem." + name[1:] + "-s", prefix) == ("a", 1234, "ab" * 8, True, True)
    assert parse_owned_name("other-a1234-" + "ab" * 8, prefix) is None
    ctrl, mutex, wake = channel_names(prefix, "job/with/slashes")
    assert "/" not in ctrl[1:] and mutex == ctrl + "-m" and wake == ctrl + "-w"
    assert parse_channel_name("sem." + mutex[1:], prefix) == (ctrl, mutex)
    assert channel_names(prefix, "a/b") != channel_names(prefix, "a_b")
    assert len("sem." + arena_name("p" * 100, 2**22, "f" * 16) + "-s") < 255


def test_bad_prefix_is_a_configuration_error(monkeypatch):
    monkeypatch.setenv("OMNILINK_SHM_PREFIX", "bad/prefix")
    with pytest.raises(omnilink.ConfigurationError, match="OMNILINK_SHM_PREFIX"):
        omnilink.connect("shm", channel="x", role="receiver")


def test_every_entry_is_prefixed_owned_and_mode_0600():
    before = shm_entries()
    tx, rx = _pair("mode")
    try:
        made = shm_entries() - before
        # arena, its semaphore, control segment, mutex and wake semaphores
        assert len(made) == 5
        for entry in made:
            assert entry.startswith((SHM_PREFIX, "sem." + SHM_PREFIX))
            mode = os.stat(os.path.join(SHM_DIR, entry)).st_mode
            assert stat.S_IMODE(mode) == 0o600, (entry, oct(mode))
        assert any(f"-a{os.getpid()}-" in e for e in made)
    finally:
        rx.close()
        tx.close()
    assert shm_entries() == before


# ------------------------------------------------------------------- preflight
def test_preflight_fails_with_actionable_message(monkeypatch):
    monkeypatch.setattr(shm_segment, "free_shm_bytes", lambda: 3 * MiB)
    before = shm_entries()
    with pytest.raises(omnilink.CapacityError) as info:
        omnilink.connect("shm", channel=_chan("tiny"), role="sender", arena_bytes=64 * MiB)
    msg = str(info.value)
    assert "--shm-size" in msg and "remount" in msg and "arena_bytes" in msg and "3.0 MiB" in msg
    # The message names the channel, and sizes come from what was asked.
    assert repr(_chan("tiny")) in msg and "arena of sender pid" in msg
    assert "arena_bytes=2097152 (2 MiB)" in msg   # the largest power of two in 90% of 3 MiB
    assert shm_entries() == before


@pytest.mark.parametrize(
    "used, asked, docker, mount",
    [(0, 64 * MiB, "128m", "128M"), (10 * MiB, 1024 * MiB, "2g", "2G"), (0, 3 << 30, "4g", "4G")],
)
def test_shm_size_advice_grows_with_the_request(monkeypatch, used, asked, docker, mount):
    class _St:
        f_frsize = 4096
        f_blocks = 1 << 20
        f_bfree = f_blocks - used // 4096

    monkeypatch.setattr(shm_segment.os, "statvfs", lambda path: _St())
    text = shm_segment.shm_size_advice(asked, 1 * MiB)
    assert f"--shm-size={docker};" in text and f"remount,size={mount} " in text
    assert "arena_bytes=" in text


# -------------------------------------------------------------------- overflow
def test_overflow_segment_carries_payload_larger_than_arena():
    tx, rx = _pair("overflow", arena_bytes=1 * MiB)
    try:
        big = {"x": np.arange(600_000, dtype=np.float32)}  # 2.4 MB > 1 MiB arena
        n = tx.put("big", big)
        assert n == omnilink.encoded_size(big)
        assert tx.stats().fallbacks == 1
        got = rx.get("big", timeout=5)
        np.testing.assert_array_equal(got["x"], big["x"])
        assert rx.stats().fallbacks == 1
        # the receiver mapped the segment and unlinked its name already
        assert not [e for e in shm_entries() if f"-o{os.getpid()}-" in e]
        assert rx.stats().blocks_in_use == 1
        del got
        assert rx.stats().blocks_in_use == 0
        tx.put("small", {"y": 1})  # drains the release
        assert tx.stats().blocks_in_use == 1
        assert rx.get("small", timeout=5) == {"y": 1}
    finally:
        rx.close()
        tx.close()


def test_overflow_error_mode_raises_capacity_error_and_keeps_nothing():
    tx, rx = _pair("overflow-err", arena_bytes=1 * MiB, overflow="error")
    try:
        with pytest.raises(omnilink.CapacityError, match="arena_bytes"):
            tx.put("big", {"x": np.zeros(600_000, dtype=np.float32)})
        assert tx.stats().blocks_in_use == 0 and tx.stats().puts == 0
        with pytest.raises(omnilink.WouldBlock):
            rx.get_nowait("big")
    finally:
        rx.close()
        tx.close()


def test_overflow_segment_of_unclaimed_payload_removed_at_close():
    before = shm_entries()
    tx = omnilink.connect("shm", channel=_chan("overflow-close"), role="sender", arena_bytes=1 * MiB)
    tx.put("big", {"x": np.zeros(600_000, dtype=np.float32)})
    assert [e for e in shm_entries() if f"-o{os.getpid()}-" in e]
    tx.close()
    assert shm_entries() == before


# ---------------------------------------------------------------- backpressure
def test_full_arena_put_times_out_naming_channel_key_and_peer():
    tx, rx = _pair("full", arena_bytes=1 * MiB)
    try:
        chunk = {"x": np.zeros(200_000, dtype=np.uint8)}
        i = 0
        with pytest.raises(omnilink.TransferTimeout) as info:
            while i < 100:
                tx.put(f"k{i}", chunk, timeout=0.2)
                i += 1
        assert 0 < i < 100
        exc = info.value
        assert exc.channel == tx.channel and exc.key == f"k{i}" and "release" in exc.peer
        assert tx.stats().timeouts == 1
        # nothing was lost: every accepted payload is still there
        for j in range(i):
            assert rx.get(f"k{j}", timeout=5)["x"].size == 200_000
    finally:
        rx.close()
        tx.close()


def test_blocked_put_is_woken_by_a_release():
    tx, rx = _pair("wake", arena_bytes=2 * MiB, max_bytes=2 * MiB)  # a fixed arena
    try:
        chunk = {"x": np.zeros(300_000, dtype=np.uint8)}
        fits = tx._writer.data_bytes // (omnilink.encoded_size(chunk) + 64)
        assert fits >= 2
        for i in range(fits):
            tx.put(f"k{i}", chunk)
        result: list = []
        t = threading.Thread(target=lambda: result.append(tx.put(f"k{fits}", chunk, timeout=30)))
        t.start()
        t.join(0.3)
        assert t.is_alive(), "put into a full arena did not block"
        got = rx.get("k0", timeout=5)
        assert t.is_alive(), "a claim without a release must not free the block"
        del got  # the release wakes the blocked put
        t.join(30)
        assert not t.is_alive() and result and result[0] > 300_000
        for i in range(1, fits + 1):
            rx.get(f"k{i}", timeout=5)
    finally:
        rx.close()
        tx.close()


def test_release_hands_block_back_early():
    tx, rx = _pair("release")
    try:
        tx.put("k", {"x": np.ones(1000)})
        got = rx.get("k", timeout=5)
        assert rx.stats().blocks_in_use == 1
        assert rx.release("k") is True
        assert rx.release("k") is False
        assert rx.stats().blocks_in_use == 0
        tx.put("k2", {})
        assert tx.stats().blocks_in_use == 1  # only k2: k's block came back
        del got
    finally:
        rx.close()
        tx.close()


# ---------------------------------------------------------------------- close
def test_close_is_idempotent_and_removes_everything():
    before = shm_entries()
    tx, rx = _pair("close")
    tx.put("pending", {"a": 1})
    rx.close()
    rx.close()
    tx.close()
    tx.close()
    assert shm_entries() == before
    with pytest.raises(omnilink.ClosedError):
        tx.put("x", {})
    with pytest.raises(omnilink.ClosedError):
        rx.get_nowait("pending")


def test_views_outlive_close():
    tx, rx = _pair("outlive")
    tx.put("k", {"x": np.arange(100, dtype=np.int64)})
    got = rx.get("k", timeout=5)
    rx.close()
    tx.close()
    np.testing.assert_array_equal(got["x"], np.arange(100))
    del got


def test_unclosed_connector_is_cleaned_when_garbage_collected():
    before = shm_entries()
    tx = omnilink.connect("shm", channel=_chan("gc"), role="sender", arena_bytes=1 * MiB)
    assert shm_entries() != before
    del tx
    assert shm_entries() == before


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("channel", ["", None, "a" * 129, "bad name", "a//b", "/abs", "a/", "é", 7])
def test_bad_channel_names(channel):
    with pytest.raises(omnilink.ConfigurationError):
        ShmConnector(channel=channel, role="sender")


@pytest.mark.parametrize(
    "options",
    [{"arena_bytes": 10}, {"arena_bytes": True}, {"max_inflight": 0}, {"overflow": "drop"},
     {"linger": -1}, {"role": "both"}, {"timeout": -1}, {"spin_us": -1}, {"spin_us": 1.5}],
)
def test_bad_options(options):
    with pytest.raises(omnilink.ConfigurationError):
        omnilink.connect("shm", channel=_chan("opts"), **{"role": "sender", **options})


@pytest.mark.parametrize("key", ["", None, "k" * 513, 5, "nul\x00"])
def test_bad_keys(key):
    tx, rx = _pair("keys")
    try:
        with pytest.raises(omnilink.ConfigurationError):
            tx.put(key, {})
        with pytest.raises(omnilink.ConfigurationError):
            rx.get_nowait(key)
        assert tx.stats().blocks_in_use == 0
    finally:
        rx.close()
        tx.close()


def test_keys_with_slashes_and_max_length_are_fine():
    tx, rx = _pair("goodkeys")
    try:
        for key in ("req/7/0", "k" * 512, "é" * 256):
            tx.put(key, {"k": key})
            assert rx.get(key, timeout=5) == {"k": key}
    finally:
        rx.close()
        tx.close()


def test_role_mismatch():
    tx, rx = _pair("roles")
    try:
        with pytest.raises(omnilink.ConfigurationError, match="role='receiver'"):
            rx.put("k", {})
        with pytest.raises(omnilink.ConfigurationError, match="role='sender'"):
            tx.get_nowait("k")
    finally:
        rx.close()
        tx.close()


# ------------------------------------------------------------------------- gc
def _make_dead_leftovers():
    """Objects as a SIGKILLed sender and a SIGKILLed receiver leave them; returns their
    /dev/shm entry names and the channel holding the dead participant."""
    prefix = read_prefix()
    dead = _dead_pid()
    token = "ab" * 8
    names = [arena_name(prefix, dead, token), f"/{prefix}-o{dead}-{token}", f"/{prefix}-e{dead}-{token}"]
    for n in names:
        posix_ipc.SharedMemory(n, posix_ipc.O_CREX, 0o600, 4096).close_fd()
    posix_ipc.Semaphore(names[0] + "-s", posix_ipc.O_CREX, 0o600, 0)
    # a channel whose only participant is dead
    ch = seg.Channel(prefix, _chan("gc-dead"))
    ch.join(seg.ROLE_RECV, "0" * 16)
    seg._PART.pack_into(ch._mm, seg._C_PART + ch.slot * seg._PART.size, dead, seg.ROLE_RECV, b"")
    ch.slot = -1
    expected = {names[0][1:], "sem." + names[0][1:] + "-s", names[1][1:], names[2][1:]}
    expected |= {ch.ctrl_name[1:], "sem." + ch.mutex_name[1:], "sem." + ch.wake_name[1:]}
    return expected


def test_collect_garbage_removes_dead_owners_only():
    live = omnilink.connect("shm", channel=_chan("gc-live"), role="sender", arena_bytes=1 * MiB)
    try:
        live_entries = shm_entries()
        expected = _make_dead_leftovers()
        would = collect_garbage(dry_run=True)
        assert set(would) == expected
        assert all(os.path.exists(os.path.join(SHM_DIR, e)) for e in would)
        assert collect_garbage() == would
        assert shm_entries() == live_entries  # a live process's objects are untouched
        assert collect_garbage() == []
    finally:
        live.close()


def test_connector_start_up_collects_garbage():
    expected = _make_dead_leftovers()
    assert expected <= shm_entries()
    with omnilink.connect("shm", channel=_chan("gc-start"), role="receiver"):
        assert not expected & shm_entries()


def test_get_without_spin_still_woken_by_the_semaphore():
    tx, rx = _pair("nospin")
    rx2 = omnilink.connect("shm", channel=tx.channel, role="receiver", spin_us=0)
    try:
        got: list = []
        t = threading.Thread(target=lambda: got.append(rx2.get("late", timeout=30)))
        t.start()
        t.join(0.3)
        assert t.is_alive(), "get returned before the key was put"
        tx.put("late", {"v": 7})
        t.join(30)
        assert not t.is_alive() and got == [{"v": 7}]
    finally:
        rx2.close()
        rx.close()
        tx.close()


def test_blocked_put_sees_close_from_another_thread():
    tx, rx = _pair("close-wakes-put", arena_bytes=1 * MiB)
    try:
        chunk = {"x": np.zeros(100_000, dtype=np.uint8)}
        fits = tx._writer.data_bytes // (omnilink.encoded_size(chunk) + 64)
        for i in range(fits):
            tx.put(f"k{i}", chunk, timeout=5)
        errors: list = []

        def blocked():
            try:
                tx.put("last", chunk)  # no timeout: only close() can end it
            except omnilink.OmnilinkError as exc:
                errors.append(exc)

        t = threading.Thread(target=blocked)
        t.start()
        t.join(0.3)
        assert t.is_alive(), "put into a full arena did not block"
        tx.close()
        t.join(30)
        assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], omnilink.ClosedError)
    finally:
        rx.close()
        tx.close()


def test_peer_watch_sees_a_death_at_once_zombie_or_reaped():
    from omnilink._util import PeerWatch

    w = PeerWatch()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert w.alive(child.pid) and w.alive(child.pid)
        assert w.alive(os.getpid())
        child.kill()
        deadline = time.monotonic() + 10
        while w.alive(child.pid):  # a zombie until reaped: dead all the same
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            assert b") Z " in f.read()  # not reaped yet
        child.wait()
        assert not w.alive(child.pid)  # reaped: still dead
    finally:
        child.kill()
        child.wait()
    assert not w.alive(0) and not w.alive(-5)
    w.close()
    assert w._probes == {}


def test_peer_watch_without_pidfds_asks_pid_alive(monkeypatch):
    from omnilink import _util

    monkeypatch.delattr(_util.os, "pidfd_open", raising=False)
    asked: list[int] = []
    monkeypatch.setattr(_util, "pid_alive", lambda pid: asked.append(pid) or pid == 7)
    w = _util.PeerWatch()
    assert w.alive(7) and w.alive(7) and not w.alive(8)
    assert asked == [7, 7, 8]


def test_peer_watch_is_safe_from_several_threads():
    # One poll object per pid: two threads polling it at once made the second raise
    # RuntimeError("concurrent poll() invocation") (a sender's put and its heartbeat).
    from omnilink._util import PeerWatch

    w = PeerWatch()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    errors: list[BaseException] = []
    wrong: list[bool] = []

    def hammer() -> None:
        try:
            for _ in range(20000):
                if not w.alive(child.pid):
                    wrong.append(True)
                    return
        except BaseException as exc:  # the failure this test is about
            errors.append(exc)

    try:
        threads = [threading.Thread(target=hammer) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        child.kill()
        child.wait()
    assert errors == [] and wrong == []
    assert not w.alive(child.pid)
    w.close()
