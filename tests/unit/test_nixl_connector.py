"""The nixl backend in one process: zero-copy views of the pool, hostile block
descriptors refused before anything is read (the channel stays usable), capacity,
option checks and how the backend reports NIXL missing."""

from __future__ import annotations

import os

import pytest
import torch

import omnilink
from omnilink.connectors import backend_unavailable, check_backend_options
from omnilink.connectors.nixl import agent as nixl_agent
from omnilink.connectors.nixl import wire
from tests.nixl_pair import answered, nixl_pair, ucx_tls

_REASON = backend_unavailable("nixl")
needs_nixl = pytest.mark.skipif(_REASON is not None, reason=f"nixl backend unavailable: {_REASON}")


@pytest.fixture
def pair(monkeypatch):
    with nixl_pair(monkeypatch, f"olnx/unit-{os.getpid()}", pool_bytes=8 << 20, extent_bytes=1 << 20) as p:
        yield p


def _in_pool(rx, t):
    pool = rx._rx.pool
    return pool.addr <= t.data_ptr() < pool.addr + pool.nbytes


@needs_nixl
def test_views_of_the_pool_and_freed_when_the_last_view_dies(pair):
    tx, rx = pair
    a = torch.arange(1000, dtype=torch.float32)
    tx.put("k", {"a": a, "b": torch.ones(3, dtype=torch.bool), "s": "text"})
    got = rx.get("k")
    assert torch.equal(got["a"], a) and got["s"] == "text" and bool(got["b"].all())
    assert _in_pool(rx, got["a"]) and _in_pool(rx, got["b"])
    assert rx.stats().blocks_in_use == 1
    view = got["a"][10:20]
    del got
    assert rx.stats().blocks_in_use == 1  # a view of the block is still alive
    del view
    assert rx.stats().blocks_in_use == 0


@needs_nixl
def test_payload_without_tensors_and_capacity(pair):
    tx, rx = pair
    tx.put("plain", {"x": [1, 2, (3, "4")]})
    assert rx.get("plain") == {"x": [1, 2, (3, "4")]}
    with pytest.raises(omnilink.CapacityError):
        tx.put("big", {"t": torch.empty(9 << 20, dtype=torch.uint8)})
    tx.put("after", {"t": torch.arange(5)})
    assert torch.equal(rx.get("after")["t"], torch.arange(5))


def _hostile(tx, offset, length, key="evil"):
    """Publish a block descriptor the sender never allocated (the socket of a real
    session, so only the descriptor is hostile)."""
    s = tx._tx
    meta = omnilink.blob.prepare({"t": torch.zeros(16, dtype=torch.uint8)}).meta
    s.seq += 1
    seq = s.seq
    from omnilink._util import Deadline

    s._send(wire.Publish(seq=seq, key=key, offset=offset, length=length, meta=meta), Deadline(10), "publishing")
    s._receive(Deadline(10), lambda m: isinstance(m, wire.Ack) and m.seq == seq, key, "ack")
    return s.acks.pop(seq)


@needs_nixl
def test_hostile_block_descriptors_are_refused(pair):
    tx, rx = pair
    tx.put("warm", {"t": torch.arange(64, dtype=torch.uint8)})  # a session and an extent
    held = rx.get("warm")
    (ext, blocks), = tx._tx.extents.items()
    live = ext  # the block 'warm' occupies (its view is alive)
    pool = rx._rx.pool.nbytes
    for offset, length in [(pool, 256), (pool - 256, 512), (wire.MAX_OFFSET, 1), (ext + (1 << 20), 256),
                           (live, 256), (live + 64, 256), (ext + 256 * 7 + 1, 256), (0, 1 << 47)]:
        if offset == live + 64 or offset % 256:
            pass
        ack = _hostile(tx, offset, length)
        assert ack.status == wire.ACK_BAD_BLOCK, (offset, length, ack)
    # A well-formed meta whose data region is longer than the block.
    ack = _hostile(tx, ext + (512 << 10), 8)
    assert ack.status in (wire.ACK_DECODE_ERROR, wire.ACK_BAD_BLOCK)
    # Nothing was published, the live block is intact, and the channel still works.
    with pytest.raises(omnilink.WouldBlock):
        rx.get_nowait("evil")
    assert torch.equal(held["t"], torch.arange(64, dtype=torch.uint8))
    tx.put("good", {"t": torch.arange(9)})
    assert torch.equal(rx.get("good")["t"], torch.arange(9))


def test_check_options_refuses_bad_values():
    for bad in ({"pool_bytes": 10}, {"extent_bytes": 0}, {"peer_timeout": 0}, {"device": "cpu"},
                {"endpoint": "udp://x"}, {"heartbeat_interval": -1}, {"spin_us": -1}, {"spin_us": 1.5}):
        with pytest.raises(omnilink.ConfigurationError):
            check_backend_options("nixl", {"channel": "c", "role": "receiver", **bad})
    check_backend_options("nixl", {"channel": "c", "role": "receiver", "endpoint": "tcp://127.0.0.1:*",
                                   "device": "cuda:1"})


def test_reports_nixl_missing(monkeypatch):
    monkeypatch.setattr(nixl_agent, "_bindings", None)
    monkeypatch.setattr(nixl_agent, "_load_error", None)
    monkeypatch.setattr(nixl_agent, "_CANDIDATES", ("omnilink_no_such_nixl._bindings",))
    reason = backend_unavailable("nixl")
    assert reason is not None and 'pip install "pyomnilink[nixl]"' in reason
    with pytest.raises(omnilink.ConfigurationError, match=r"pyomnilink\[nixl\]"):
        omnilink.connect("nixl", channel="c", role="receiver", endpoint="tcp://127.0.0.1:*")


def test_tls_without_cuda_on_a_gpu_machine_is_named(monkeypatch):
    """NIXL refuses UCX when UCX_TLS names no CUDA transport on a GPU machine and says
    why only in its log: the error omnilink raises then says it (nothing otherwise)."""
    from omnilink.connectors.nixl import agent

    gpu = {"on": True}
    real = os.path.exists
    monkeypatch.setattr(agent.os.path, "exists", lambda p: gpu["on"] if p.startswith("/dev/nvidia") else real(p))
    monkeypatch.setenv("UCX_TLS", "cma,tcp")
    assert "cuda_copy" in agent._tls_hint() and "UCX_TLS=cma,tcp" in agent._tls_hint()
    for tls in ("tcp,cuda_copy", "^ib", "all"):
        monkeypatch.setenv("UCX_TLS", tls)
        assert agent._tls_hint() == ""
    monkeypatch.delenv("UCX_TLS")
    assert agent._tls_hint() == ""
    monkeypatch.setenv("UCX_TLS", "tcp")
    gpu["on"] = False
    assert agent._tls_hint() == ""


@needs_nixl
@pytest.mark.parametrize("spin_us", [0, 200, 20_000])
def test_a_waiting_get_with_any_spin_takes_what_comes_later(spin_us, monkeypatch):
    """A get that waits (watching the index, or asleep at once) takes a payload put
    after it began waiting, and another after a pause longer than the spin."""
    import threading

    monkeypatch.setenv("UCX_TLS", "tcp")
    rx = omnilink.connect("nixl", channel=f"olnx/spin-{os.getpid()}-{spin_us}", role="receiver",
                          endpoint="tcp://127.0.0.1:*", pool_bytes=8 << 20, extent_bytes=1 << 20, timeout=30.0,
                          spin_us=spin_us)
    tx = omnilink.connect("nixl", channel=f"olnx/spin-{os.getpid()}-{spin_us}", role="sender", endpoint=rx.endpoint,
                          timeout=30.0, spin_us=spin_us)
    try:
        for i, pause in enumerate((0.0, 0.05)):
            got = {}
            t = threading.Thread(target=lambda i=i: got.__setitem__(i, rx.get(f"k{i}", timeout=30.0)))
            t.start()
            threading.Event().wait(pause)
            tx.put(f"k{i}", {"t": torch.arange(1000) + i}, timeout=30.0)
            t.join(30.0)
            assert not t.is_alive()
            assert torch.equal(got[i]["t"], torch.arange(1000) + i)
            del got
    finally:
        tx.close()
        rx.close()


def _tcp_pair(monkeypatch, channel, spin_us):
    """A receiver (8 MiB pool, 1 MiB extents, ``spin_us``) and a sender over UCX tcp."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    rx = omnilink.connect("nixl", channel=channel, role="receiver", endpoint="tcp://127.0.0.1:*",
                          pool_bytes=8 << 20, extent_bytes=1 << 20, timeout=30.0, spin_us=spin_us)
    tx = omnilink.connect("nixl", channel=channel, role="sender", endpoint=rx.endpoint, timeout=30.0)
    return rx, tx


@needs_nixl
@pytest.mark.parametrize("mode", ["spinning-get", "watching-get", "no-get-waiting"])
def test_a_waiting_get_publishes_in_its_own_thread(mode, monkeypatch):
    """A get that waits, spinning or (past its spin) in poll(), reads the senders'
    messages itself: the payload that comes meanwhile is published in the getter's
    thread, not handed over from the loop thread; one that comes while no get waits is
    published by the loop thread."""
    import threading

    from omnilink.connectors.nixl.connector import _Receiver

    where = []
    publish = _Receiver._publish
    spin, watch = _Receiver._spin, _Receiver._watch
    waiting = threading.Event()

    def spy_publish(self, s, msg):
        where.append(threading.current_thread().name)
        return publish(self, s, msg)

    def spy_spin(self, key, index, spin_end):
        waiting.set()
        return spin(self, key, index, spin_end)

    def spy_watch(self, key, index, remaining):
        waiting.set()
        return watch(self, key, index, remaining)

    monkeypatch.setattr(_Receiver, "_publish", spy_publish)
    monkeypatch.setattr(_Receiver, "_spin" if mode == "spinning-get" else "_watch",
                        spy_spin if mode == "spinning-get" else spy_watch)
    rx, tx = _tcp_pair(monkeypatch, f"olnx/spin-{os.getpid()}-{mode}", spin_us=0)
    try:
        tx.put("warm", {"a": torch.zeros(4)})  # the session and its extent first
        assert rx.get("warm")["a"].sum() == 0
        # A spin long enough for any machine (no timing in the test): the put comes
        # once the get is spinning (or watching).
        rx._rx.spin_ns = 30 * 10**9 if mode == "spinning-get" else 0
        where.clear()
        waiting.clear()
        if mode == "no-get-waiting":
            tx.put("k", {"a": torch.arange(8, dtype=torch.float32)})
            answered(tx)  # published (and answered) before the get
            got = rx.get("k", timeout=30.0)
            assert where[0].startswith("omnilink-nixl-rx-") and len(where) == 1, where
        else:
            errors = []

            def put_later():
                try:
                    assert waiting.wait(30)
                    tx.put("k", {"a": torch.arange(8, dtype=torch.float32)})
                except BaseException as exc:  # pragma: no cover - reported below
                    errors.append(exc)

            t = threading.Thread(target=put_later, name="putter")
            t.start()
            got = rx.get("k", timeout=30.0)
            t.join(30)
            assert not errors, errors
            assert where == [threading.current_thread().name], where
        assert got["a"].tolist() == list(range(8))
    finally:
        tx.close()
        rx.close()


@needs_nixl
def test_gets_waiting_together_each_take_theirs_and_close_ends_a_watch(monkeypatch):
    """Two gets wait at once (one watches in poll(), the other sleeps until it may): each
    takes its payload whatever the order they come in; a get left watching when the
    receiver closes raises ClosedError instead of waiting out its timeout."""
    import threading

    rx, tx = _tcp_pair(monkeypatch, f"olnx/watch2-{os.getpid()}", spin_us=0)
    got, errors = {}, []

    def get(key, timeout=30.0):
        try:
            got[key] = rx.get(key, timeout=timeout)
        except BaseException as exc:
            errors.append((key, exc))

    try:
        ts = [threading.Thread(target=get, args=(k,)) for k in ("a", "b")]
        for t in ts:
            t.start()
        threading.Event().wait(0.05)
        tx.put("b", {"x": torch.arange(3)})
        tx.put("a", {"x": torch.arange(5)})
        for t in ts:
            t.join(30)
        assert not errors, errors
        assert got["a"]["x"].tolist() == list(range(5)) and got["b"]["x"].tolist() == list(range(3))
        got.clear()
        late = threading.Thread(target=get, args=("never", 60.0))
        late.start()
        for _ in range(3000):
            if rx._rx.watching:
                break
            threading.Event().wait(0.01)
        assert rx._rx.watching
        rx.close()
        late.join(20)
        assert not late.is_alive()
        assert [type(e).__name__ for _k, e in errors] == ["ClosedError"], errors
    finally:
        tx.close()
        rx.close()


@needs_nixl
def test_publishes_and_acks_ride_the_doorbell_and_strangers_are_shut_out(pair):
    """After the welcome, a sender's publishes go on the receiver's doorbell (a plain
    socket, no zmq I/O thread) and their acks come back on it; a connection to the
    doorbell that names no live session, or announces a message larger than the bound,
    is closed and the link goes on."""
    import socket
    import struct

    tx, rx = pair
    tx.put("a", {"t": torch.arange(10)})
    assert rx.get("a")["t"].tolist() == list(range(10))
    sessions = list(rx._rx.sessions.values())
    assert len(sessions) == 1 and sessions[0].bell_r is not None and sessions[0].bell_w is not None
    assert tx._tx.bell_w is not None and tx._tx.bell_r is not None
    port = int(rx._rx.bell_name.removeprefix("tcp:"))
    for first in (struct.pack("<I", 32) + b"0" * 32, struct.pack("<I", 1 << 30)):
        stranger = socket.create_connection(("127.0.0.1", port), timeout=10)
        stranger.sendall(first)
        stranger.settimeout(10)
        assert stranger.recv(1) == b""  # closed by the receiver
        stranger.close()
    tx.put("b", {"t": torch.arange(3)})
    assert rx.get("b")["t"].tolist() == [0, 1, 2]


@needs_nixl
def test_a_sender_whose_doorbell_breaks_connects_again(pair):
    """The doorbell's socket closing under a sender ends its session: the put that finds
    it raises PeerLostError (nothing half-sent is taken for a payload), the next put says
    hello again, with a new doorbell."""
    tx, rx = pair
    tx.put("a", {"t": torch.arange(4)})
    assert rx.get("a")["t"].tolist() == [0, 1, 2, 3]
    old = tx._tx.bell_w
    old.sock.shutdown(2)  # as a crashed peer's socket: reads and writes fail
    with pytest.raises(omnilink.PeerLostError):
        tx.put("b", {"t": torch.arange(5)})
    tx.put("c", {"t": torch.arange(6)})
    assert tx._tx.bell_w is not None and tx._tx.bell_w is not old
    assert rx.get("c")["t"].tolist() == list(range(6))


def test_the_get_spin_adapts_to_when_payloads_come():
    """The spin of a waiting get grows to twice the typical wait while payloads come a
    little after it ends (up to SPIN_GROWTH x spin_us) and falls back to spin_us when
    they come much later or at once (the rule the shm and nccl backends share)."""
    from omnilink._util import SPIN_GROWTH
    from omnilink.connectors.nixl.connector import _Receiver

    r = object.__new__(_Receiver)
    r.spin_ns = r.spin_min_ns = r.arrival_ns = 200_000
    r.spin_max_ns = 200_000 * SPIN_GROWTH
    for _ in range(30):
        r._adapt_spin(400_000)
    assert r.spin_ns == pytest.approx(800_000, rel=0.01)
    for _ in range(30):
        r._adapt_spin(1_500_000)  # between half the ceiling and the ceiling: spin to it
    assert r.spin_ns == r.spin_max_ns
    for _ in range(30):
        r._adapt_spin(50_000_000)
    assert r.spin_ns == 200_000
    for _ in range(30):
        r._adapt_spin(1_000)
    assert r.spin_ns == 200_000


@needs_nixl
def test_a_get_that_waited_feeds_the_spin(monkeypatch):
    """A get that had to wait folds its wait into the typical wait; one that found its
    payload there does not."""
    import threading

    rx, tx = _tcp_pair(monkeypatch, f"olnx/adapt-{os.getpid()}", spin_us=200)
    try:
        tx.put("first", {"a": torch.zeros(4)})
        answered(tx)
        assert rx.get("first")["a"].sum() == 0  # there already: no wait
        assert rx._rx.arrival_ns == 200_000
        t = threading.Timer(0.02, lambda: tx.put("late", {"a": torch.ones(4)}))
        t.start()
        assert rx.get("late", timeout=30.0)["a"].sum() == 4
        t.join()
        assert rx._rx.arrival_ns > 200_000  # a wait of 20 ms or more went in
    finally:
        tx.close()
        rx.close()


@needs_nixl
def test_a_stream_of_payloads_larger_than_an_extent_does_not_ask_for_room_each_time(monkeypatch):
    """Payloads larger than the extent size, each held by the receiver while the next
    is put: the receiver grants the room for the next one with the ack of this one, so
    the sender stops asking for extents (it asked before every put); and in a pool too
    small for that, puts still go through as the receiver lets payloads go."""
    from omnilink.connectors.nixl import wire
    from omnilink.connectors.nixl.connector import _Sender

    asked = []
    send = _Sender._send

    def spy_send(self, msg, deadline, what):
        if isinstance(msg, wire.Extent):
            asked.append(msg.need)
        return send(self, msg, deadline, what)

    monkeypatch.setattr(_Sender, "_send", spy_send)
    monkeypatch.setenv("UCX_TLS", "tcp")
    for pool_mib, want_asks_after_warmup in ((64, 0), (9, None)):
        ch = f"olnx/ahead-{os.getpid()}-{pool_mib}"
        rx = omnilink.connect("nixl", channel=ch, role="receiver", endpoint="tcp://127.0.0.1:*",
                              pool_bytes=pool_mib << 20, extent_bytes=1 << 20, timeout=30.0)
        tx = omnilink.connect("nixl", channel=ch, role="sender", endpoint=rx.endpoint, timeout=30.0)
        try:
            asked.clear()
            held = None
            for i in range(12):
                if i == 3:
                    warm = len(asked)
                tx.put(f"k{i}", {"t": torch.full((1 << 20,), float(i))})  # 4 MiB
                got = rx.get(f"k{i}")
                assert got["t"][0] == i and got["t"][-1] == i
                held = got  # the previous payload is let go only now
            del held, got
            if want_asks_after_warmup is not None:
                assert len(asked) - warm == want_asks_after_warmup, asked
                assert 1 <= warm <= 3, asked
        finally:
            tx.close()
            rx.close()


def test_grant_ahead_only_when_the_sender_is_out_of_room_and_nobody_waits_for_room():
    """The receiver grants a sender its next extent with an ack only when none of its
    extents has room for another payload of that size, and never while a sender waits
    for room (that room is for the one that asked)."""
    from types import SimpleNamespace

    from omnilink.connectors.nixl import wire
    from omnilink.connectors.nixl.connector import _Receiver
    from omnilink.connectors.nixl.pool import Blocks

    def receiver_and_session(used):
        r = object.__new__(_Receiver)
        r.pool = SimpleNamespace(nbytes=64 << 20, extents=Blocks(64 << 20))
        r.extent_bytes = 1 << 20
        r.releaser = SimpleNamespace(eager=False)
        r.sent = []
        r._send = lambda s, msg: r.sent.append(msg)
        off = r.pool.extents.alloc(4 << 20)
        mirror = Blocks(4 << 20)
        assert mirror.reserve(0, used)
        return r, SimpleNamespace(parked=None, lost=False, extents={off: mirror}, frees=[])

    r, s = receiver_and_session(4 << 20)  # the extent is full: grant the next one
    r._grant_ahead(s, 3 << 20)
    (g,) = r.sent
    assert isinstance(g, wire.Granted) and g.length >= 3 << 20 and g.offset in s.extents and len(s.extents) == 2
    r, s = receiver_and_session(1 << 20)  # 3 MiB left: room for the next one
    r._grant_ahead(s, 3 << 20)
    assert r.sent == [] and len(s.extents) == 1
    r, s = receiver_and_session(4 << 20)
    r.releaser.eager = True  # another sender waits for room
    r._grant_ahead(s, 3 << 20)
    assert r.sent == [] and len(s.extents) == 1
    r, s = receiver_and_session(4 << 20)
    s.parked = 1 << 20  # this one asked already
    r._grant_ahead(s, 3 << 20)
    assert r.sent == []


@needs_nixl
def test_only_the_receiver_runs_a_progress_thread(monkeypatch):
    """A sender progresses its UCX worker itself as it writes: its agent starts no
    progress thread (one native thread fewer than the receiver's kind of agent)."""
    monkeypatch.setenv("UCX_TLS", ucx_tls("tcp"))

    def tasks() -> int:
        return len(os.listdir("/proc/self/task"))

    first = nixl_agent.Agent(f"first-{os.getpid()}", progress_thread=False)  # UCX's process-wide thread
    before = tasks()
    quiet = nixl_agent.Agent(f"quiet-{os.getpid()}", progress_thread=False)
    mid = tasks()
    busy = nixl_agent.Agent(f"busy-{os.getpid()}")
    after = tasks()
    try:
        assert (mid - before, after - mid) == (0, 1), (before, mid, after)
    finally:
        for a in (first, quiet, busy):
            a.close()
    made = []
    real = nixl_agent.Agent

    def recording(name, progress_thread=True):
        made.append((name.split("-")[1], progress_thread))
        return real(name, progress_thread)

    from omnilink.connectors.nixl import connector as nx

    monkeypatch.setattr(nx, "Agent", recording)
    rx = omnilink.connect("nixl", channel=f"olnx/prog-{os.getpid()}", role="receiver", endpoint="tcp://127.0.0.1:*",
                          pool_bytes=1 << 20, timeout=30.0)
    tx = omnilink.connect("nixl", channel=rx.channel, role="sender", endpoint=rx.endpoint, timeout=30.0)
    try:
        tx.put("k", {"t": torch.arange(3)})
        assert torch.equal(rx.get("k")["t"], torch.arange(3))
    finally:
        tx.close()
        rx.close()
    assert sorted(made) == [("rx", True), ("tx", False)], made


@needs_nixl
def test_a_put_does_not_wait_for_the_receivers_answer_and_at_most_so_many_go_unanswered(monkeypatch):
    """A put returns once its payload is published, not once the receiver answered (a
    receiving process busy in Python answers late: its threads wait for its GIL); the
    answers come with later puts. At most ``_UNACKED_MAX`` payloads go unanswered: the
    next put waits, and gives up at its timeout having published nothing."""
    import threading

    from omnilink.connectors.nixl import connector as nixl_connector

    gate = threading.Event()
    real_ack = nixl_connector._Receiver._ack

    def held_ack(self, s, seq, status, text=""):
        assert gate.wait(30)
        return real_ack(self, s, seq, status, text)

    monkeypatch.setattr(nixl_connector, "_UNACKED_MAX", 5)
    with nixl_pair(monkeypatch, f"olnx/unacked-{os.getpid()}") as (tx, rx):
        tx.put("warm", {"t": torch.arange(4)})
        answered(tx)
        monkeypatch.setattr(nixl_connector._Receiver, "_ack", held_ack)
        try:
            for i in range(5):
                tx.put(f"u{i}", {"t": torch.arange(4) + i}, timeout=30.0)  # no answer can come
            assert sorted(tx._tx.unacked.values()) == [f"u{i}" for i in range(5)]
            with pytest.raises(omnilink.TransferTimeout, match="answers to its earlier payloads"):
                tx.put("u5", {"t": torch.arange(4)}, timeout=0.5)
        finally:
            gate.set()
        answered(tx)
        for i in range(5):
            assert torch.equal(rx.get(f"u{i}", timeout=30.0)["t"], torch.arange(4) + i)
        with pytest.raises(omnilink.WouldBlock):
            rx.get_nowait("u5")  # its put gave up before publishing it
        tx.put("u5", {"t": torch.arange(4) + 5}, timeout=30.0)
        assert torch.equal(rx.get("u5", timeout=30.0)["t"], torch.arange(4) + 5)


@needs_nixl
@pytest.mark.parametrize("after", [True, False])
def test_a_put_takes_the_answers_after_it_published(monkeypatch, after):
    """A put takes the receiver's answers to earlier payloads (blocks freed, extents
    granted) once its own payload is published, so that the receiver gets it sooner;
    ``ANSWERS_AFTER_PUBLISH`` false takes them first, as before."""
    from omnilink.connectors.nixl import connector as nixl_connector

    monkeypatch.setattr(nixl_connector, "ANSWERS_AFTER_PUBLISH", after)
    with nixl_pair(monkeypatch, f"olnx/after-{os.getpid()}-{after}") as (tx, rx):
        for i in range(3):
            tx.put(f"w{i}", {"t": torch.arange(4) + i})
            assert torch.equal(rx.get(f"w{i}", timeout=30.0)["t"], torch.arange(4) + i)
        s = tx._tx
        order: list[str] = []
        real_look, real_bell = nixl_connector._Sender._look, nixl_connector._Sender._send_bell

        def look(self, sock, what):
            order.append("look")
            return real_look(self, sock, what)

        def bell(self, msg, deadline, key):
            order.append(type(msg).__name__)
            return real_bell(self, msg, deadline, key)

        monkeypatch.setattr(nixl_connector._Sender, "_look", look)
        monkeypatch.setattr(nixl_connector._Sender, "_send_bell", bell)
        if not after:
            assert s.unacked  # the last payload's answer, taken at the next put's start
        tx.put("k", {"t": torch.arange(4)})
        assert order == (["Publish", "look"] if after else ["look", "Publish"])
        assert torch.equal(rx.get("k", timeout=30.0)["t"], torch.arange(4))


@needs_nixl
def test_what_taking_the_answers_after_a_put_meets_is_the_next_puts_to_raise(monkeypatch):
    """A malformed answer taken after a put has published its payload does not make that
    put fail (its payload was put: a caller that put it again would duplicate it); the
    next put raises it, as it did when the answers were taken at its start."""
    from omnilink.connectors.nixl import connector as nixl_connector

    with nixl_pair(monkeypatch, f"olnx/deferred-{os.getpid()}") as (tx, rx):
        tx.put("w", {"t": torch.arange(4)})
        assert torch.equal(rx.get("w", timeout=30.0)["t"], torch.arange(4))
        s = tx._tx
        real_look = nixl_connector._Sender._look
        broken = {"on": True}

        def look(self, sock, what):
            if broken["on"]:
                broken["on"] = False
                raise omnilink.BlobDecodeError("nixl: malformed control message from the receiver: (test)")
            return real_look(self, sock, what)

        monkeypatch.setattr(nixl_connector._Sender, "_look", look)
        assert tx.put("k", {"t": torch.arange(4) + 1}) > 0  # published: no error here
        assert s.deferred is not None
        assert torch.equal(rx.get("k", timeout=30.0)["t"], torch.arange(4) + 1)
        with pytest.raises(omnilink.BlobDecodeError, match="malformed control message"):
            tx.put("k2", {"t": torch.arange(4)})
        with pytest.raises(omnilink.WouldBlock):
            rx.get_nowait("k2")  # that put raised before publishing anything
        tx.put("k3", {"t": torch.arange(4) + 3})
        assert torch.equal(rx.get("k3", timeout=30.0)["t"], torch.arange(4) + 3)
