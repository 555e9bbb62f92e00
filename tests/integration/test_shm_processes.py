"""The ``shm`` backend across real processes (multiprocessing, spawn).

Every test bounds its waits: children are joined with a timeout and killed if the test
fails, so a bug cannot hang CI. The suite-wide fixture then checks /dev/shm is clean.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import signal

import pytest

import omnilink
from omnilink.connectors.shm import collect_garbage
from tests.conftest import shm_entries
from tests.integration import _shm_workers as W

CTX = mp.get_context("spawn")
WAIT = 30.0


def _channel(name: str) -> str:
    return f"itest/{name}-{os.getpid()}"


@contextlib.contextmanager
def children():
    """Start processes through the yielded list; on exit join them (bounded) and kill
    whatever is still running."""
    procs: list = []
    try:
        yield procs
        for p in procs:
            p.join(WAIT)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def start(procs, target, *args, **kwargs):
    p = CTX.Process(target=target, args=args, kwargs=kwargs, daemon=True)
    p.start()
    procs.append(p)
    return p


def expect(q, tag, timeout=WAIT):
    """Next message from q; it must carry ``tag`` (a worker's "error" fails the test)."""
    try:
        msg = q.get(timeout=timeout)
    except queue_mod.Empty:
        pytest.fail(f"no {tag!r} message from a worker within {timeout} s")
    if msg[0] == "error":
        pytest.fail(f"worker failed: {msg[1]}")
    assert msg[0] == tag, msg
    return msg


def test_two_stage_chain():
    ch = _channel("two")
    q = CTX.Queue()
    with children() as procs:
        # The receiver joins first: a sender that finishes and closes before any receiver
        # has joined drops what it published (its linger waits only for live receivers),
        # and a fast sender puts 200 small payloads in a few milliseconds.
        with omnilink.connect("shm", channel=ch, role="receiver", timeout=WAIT) as rx:
            start(procs, W.sender, ch, 200, q)
            expect(q, "ready")
            for i in range(200):
                W.check_payload(rx.get(f"k{i}"), i)
            expect(q, "sent")
    assert all(p.exitcode == 0 for p in procs)


def test_three_stage_chain():
    a, b = _channel("three-a"), _channel("three-b")
    q = CTX.Queue()
    n = 100
    with children() as procs:
        # The relay and the final receiver start first: a receiver may wait for its sender.
        start(procs, W.relay, a, b, n, q)
        expect(q, "ready")
        with omnilink.connect("shm", channel=b, role="receiver", timeout=WAIT) as rx:
            start(procs, W.sender, a, n, q)
            for i in range(n):
                got = rx.get(f"k{i}")
                assert got["i"] == i and got["meta"] == {"tag": f"m{i}", "hops": 1}
                assert float(got["x"][0]) == float(i % 251) + 1
                del got
        tags = set()
        for _ in range(3):
            msg = q.get(timeout=WAIT)
            if msg[0] == "error":
                pytest.fail(msg[1])
            tags.add(msg[0])
        assert tags == {"ready", "sent", "relayed"}
    assert all(p.exitcode == 0 for p in procs)


def test_receiver_started_before_sender():
    ch = _channel("early")
    q = CTX.Queue()
    with children() as procs:
        start(procs, W.receiver, ch, 20, q)
        expect(q, "ready")
        start(procs, W.sender, ch, 20, q)
        seen = set()
        for _ in range(3):
            msg = q.get(timeout=WAIT)
            if msg[0] == "error":
                pytest.fail(msg[1])
            seen.add(msg[0])
        assert seen == {"ready", "sent", "got"}
    assert all(p.exitcode == 0 for p in procs)


def test_two_receivers_race_exactly_once():
    ch = _channel("race")
    q = CTX.Queue()
    n = 400
    go = CTX.Event()
    with children() as procs:
        with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=8 << 20, timeout=WAIT) as tx:
            start(procs, W.racing_receiver, ch, n, q, go)
            start(procs, W.racing_receiver, ch, n, q, go)
            expect(q, "ready")
            expect(q, "ready")
            for i in range(n):
                tx.put(f"k{i}", W.make_payload(i))
            go.set()
            won = [expect(q, "won")[1], expect(q, "won")[1]]
    a, b = set(won[0]), set(won[1])
    assert not a & b, f"keys delivered twice: {sorted(a & b)[:10]}"
    assert a | b == set(range(n)), f"keys lost: {sorted(set(range(n)) - (a | b))[:10]}"
    assert all(p.exitcode == 0 for p in procs)


def test_sigkill_sender_mid_stream_is_peer_lost():
    ch = _channel("killsender")
    q = CTX.Queue()
    with children() as procs:
        start(procs, W.receive_until_lost, ch, q)
        expect(q, "ready")
        # The sender reports on a queue of its own: a process killed while its queue
        # feeder holds the queue's write lock leaves that lock taken for good, and the
        # receiver's reports would then never arrive.
        qs = CTX.Queue()
        snd = start(procs, W.slow_forever_sender, ch, qs)
        expect(qs, "ready")
        for _ in range(5):
            expect(q, "progress")
        os.kill(snd.pid, signal.SIGKILL)
        snd.join(WAIT)  # reap it: a zombie is dead too, but do not rely on it
        # Drain progress messages until the receiver reports the loss.
        while True:
            msg = q.get(timeout=WAIT)
            if msg[0] == "error":
                pytest.fail(msg[1])
            if msg[0] == "lost":
                assert "died" in msg[2]
                break
        procs.remove(snd)
    assert procs[0].exitcode == 0
    # The receiver reaped the dead sender's arena and, last to leave, the channel.
    assert not shm_entries()
    assert collect_garbage() == []


def test_sigkill_receiver_holding_views_sender_reclaims():
    ch = _channel("killrecv")
    q = CTX.Queue()
    n = 256 << 10  # floats: 1 MiB per payload
    with children() as procs:
        with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=4 << 20, max_bytes=4 << 20,
                              timeout=WAIT) as tx:
            rcv = start(procs, W.holding_receiver, ch, 3, q, n)
            for i in range(3):
                tx.put(f"k{i}", W.make_payload(i, n))
            assert expect(q, "holding")[1] == 3
            os.kill(rcv.pid, signal.SIGKILL)
            rcv.join(WAIT)
            procs.remove(rcv)
            # The arena (4 MiB) only has room for these after the dead receiver's three
            # claimed blocks are reclaimed.
            for i in range(3, 6):
                tx.put(f"k{i}", W.make_payload(i, n), timeout=WAIT)
            assert tx.stats().blocks_in_use == 3
            for i in range(3, 6):
                assert tx.discard(f"k{i}")
            assert tx.stats().blocks_in_use == 0


def test_full_arena_slow_receiver_backpressure_nothing_lost():
    ch = _channel("slow")
    q = CTX.Queue()
    n = 64 << 10  # 256 KiB payloads into a 1 MiB arena
    count = 40
    with children() as procs:
        start(procs, W.receiver, ch, count, q, n, 0.01)
        expect(q, "ready")
        with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=1 << 20, max_bytes=1 << 20,
                              timeout=WAIT) as tx:
            peak = 0
            for i in range(count):
                tx.put(f"k{i}", W.make_payload(i, n))
                peak = max(peak, tx.stats().bytes_in_use)
            assert peak <= 1 << 20
            expect(q, "got")
    assert procs[0].exitcode == 0


def test_zero_copy_by_address_and_block_freed_with_last_view():
    ch = _channel("zerocopy")
    q = CTX.Queue()
    done = CTX.Event()
    n = 1 << 20
    with children() as procs:
        with omnilink.connect("shm", channel=ch, role="receiver", timeout=WAIT) as rx:
            start(procs, W.sender, ch, 1, q, n, 16 << 20, done)
            expect(q, "ready")
            got = rx.get("k0")
            x = got["x"]
            ptr = x.ctypes.data
            where = rx.mapping_of(ptr)
            assert where is not None, "the array is not a view of the sender's arena"
            name, base, length = where
            assert name.endswith(f"-a{procs[0].pid}-" + name.rsplit("-", 1)[1])
            assert base <= ptr and ptr + x.nbytes <= base + length
            assert rx.stats().blocks_in_use == 1
            view = x[10:20]
            del got, x
            assert rx.stats().blocks_in_use == 1  # a slice still views the block
            del view
            assert rx.stats().blocks_in_use == 0
            expect(q, "sent")
            done.set()


def test_many_small_messages_dev_shm_and_rss_flat():
    psutil = pytest.importorskip("psutil")
    count = int(os.environ.get("OMNILINK_SOAK_MESSAGES", "20000"))
    ch = _channel("soak")
    q = CTX.Queue()
    warm = 1000
    # The sender stays open until the last count is taken: once everything is claimed
    # its close() would remove its arena, racing with the count below.
    done = CTX.Event()
    with children() as procs:
        with omnilink.connect("shm", channel=ch, role="receiver", timeout=WAIT) as rx:
            snd = start(procs, W.sender, ch, warm + count, q, 64, done=done)
            expect(q, "ready")
            for i in range(warm):
                W.check_payload(rx.get(f"k{i}"), i, 64)
            # Extension segments of the elastic arena come and go with the load (one made
            # while the warm-up was held may be given back meanwhile): not a leak.
            entries0 = len(shm_entries() - _extension_entries())
            rss0 = psutil.Process().memory_info().rss
            sender_rss0 = psutil.Process(snd.pid).memory_info().rss
            for i in range(warm, warm + count):
                got = rx.get(f"k{i}")
                if i % 97 == 0:
                    W.check_payload(got, i, 64)
                del got
            entries1 = len(shm_entries() - _extension_entries())
            rss1 = psutil.Process().memory_info().rss
            sender_rss1 = psutil.Process(snd.pid).memory_info().rss
            assert rx.stats().blocks_in_use == 0
            expect(q, "sent")
            done.set()
    assert entries1 == entries0
    assert rss1 - rss0 < 16 << 20, f"receiver RSS grew by {(rss1 - rss0) >> 20} MiB over {count} messages"
    assert sender_rss1 - sender_rss0 < 16 << 20, f"sender RSS grew by {(sender_rss1 - sender_rss0) >> 20} MiB"


# ------------------------------------------------------------------ elastic arena
def _extension_entries() -> set[str]:
    from omnilink.connectors.shmem import parse_owned_name
    from tests.conftest import SHM_PREFIX

    return {e for e in shm_entries() if (parse_owned_name(e, SHM_PREFIX) or ("",))[0] == "e"}


def _wait_until(cond, timeout=WAIT) -> bool:
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


ELASTIC_N = 64 << 10  # floats: 256 KiB payloads
ELASTIC_ARENA = 1 << 20


def test_receiver_holding_3x_the_arena_every_put_succeeds_then_extensions_go_back():
    ch = _channel("elastic")
    q = CTX.Queue()
    drop, done = CTX.Event(), CTX.Event()
    with children() as procs:
        with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=ELASTIC_ARENA, max_inflight=64,
                              shrink_after=0.3, timeout=WAIT) as tx:
            capacity = tx._writer.data_bytes
            size = omnilink.encoded_size(W.make_payload(0, ELASTIC_N))
            count = 3 * capacity // size + 1  # held payloads worth 3x the arena
            start(procs, W.holding_then_dropping_receiver, ch, count, q, ELASTIC_N, drop, done)
            for i in range(count):
                tx.put(f"k{i}", W.make_payload(i, ELASTIC_N), timeout=5.0)  # never waits for a release
            held = expect(q, "holding")[1]
            assert held >= 3 * capacity
            st = tx.stats()
            assert st.segments >= 4 and st.bytes_held >= 3 * capacity
            assert len(_extension_entries()) == st.segments - 1
            drop.set()
            assert expect(q, "dropped")[1] == 0
            assert _wait_until(lambda: tx.stats().segments == 1), "extensions were not given back"
            assert not _extension_entries()
            assert tx.stats().bytes_mapped == tx._writer.primary.size
            done.set()
    assert procs[0].exitcode == 0


def test_sigkill_receiver_while_extensions_exist():
    ch = _channel("elastic-killrecv")
    q = CTX.Queue()
    with children() as procs:
        with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=ELASTIC_ARENA, max_inflight=64,
                              shrink_after=0.3, timeout=WAIT) as tx:
            rcv = start(procs, W.holding_receiver, ch, 8, q, ELASTIC_N)
            for i in range(8):
                tx.put(f"k{i}", W.make_payload(i, ELASTIC_N), timeout=5.0)
            expect(q, "holding")
            assert tx.stats().segments > 1 and _extension_entries()
            os.kill(rcv.pid, signal.SIGKILL)
            rcv.join(WAIT)
            procs.remove(rcv)
            # The dead receiver's blocks are reclaimed and the idle extensions given back.
            assert _wait_until(lambda: tx.stats().segments == 1)
            assert tx.stats().blocks_in_use == 0 and not _extension_entries()
    assert not shm_entries()


def test_sigkill_sender_while_extensions_exist():
    ch = _channel("elastic-killsend")
    q = CTX.Queue()
    with children() as procs:
        with omnilink.connect("shm", channel=ch, role="receiver", timeout=WAIT) as rx:
            snd = start(procs, W.growing_sender, ch, 8, q, ELASTIC_N, ELASTIC_ARENA)
            held = [rx.get(f"k{i}") for i in range(8)]
            assert expect(q, "grown")[1] > 1
            assert _extension_entries()
            os.kill(snd.pid, signal.SIGKILL)
            snd.join(WAIT)
            procs.remove(snd)
            with pytest.raises(omnilink.PeerLostError):
                rx.get("never", timeout=WAIT)  # the heartbeat reaps the dead sender
            assert not _extension_entries()
            assert not {e for e in shm_entries() if f"-a{snd.pid}-" in e}
            for i, got in enumerate(held):  # the views still read the (unlinked) memory
                W.check_payload(got, i, ELASTIC_N)
            del got, held
    assert not shm_entries()
