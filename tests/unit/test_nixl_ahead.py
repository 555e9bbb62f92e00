"""Payloads published ahead of their WRITE (nixl: every payload with tensor bytes and
no bool tensor): the receiver checks and decodes while the bytes are staged and move,
the payload becomes gettable only once its ``written`` message came, and a WRITE that
failed, or may still land, never publishes it nor frees its block too early."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import pytest
import torch

import omnilink
from omnilink._util import Deadline
from omnilink.connectors import backend_unavailable
from omnilink.connectors.nixl import connector as nixl_connector
from omnilink.connectors.nixl import wire
from tests.nixl_pair import nixl_pair, record_bell

_REASON = backend_unavailable("nixl")
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"nixl backend unavailable: {_REASON}")

BIG = 2 << 20


@pytest.fixture
def pair(monkeypatch):
    # tcp: a WRITE that is still on its way when posted
    with nixl_pair(monkeypatch, f"olnx/ahead-{os.getpid()}", pool_bytes=32 << 20, extent_bytes=8 << 20) as p:
        yield p


_DONE = object()


@pytest.fixture(autouse=True)
def _posted_writes_in_progress(pair):
    """A WRITE over loopback TCP may complete as it is posted (then it is not waited
    for): here every posted WRITE reports itself in progress, so that the tests' wrapped
    waits see each, and its wait ends at once when it was in fact complete."""
    tx, _rx = pair
    agent = tx._tx.agent
    real_write, real_wait = agent.write, agent.wait

    def write(*args, **kwargs):
        req = real_write(*args, **kwargs)
        return _DONE if req is None else req

    def wait(req, deadline, lost):
        return None if req is _DONE else real_wait(req, deadline, lost)

    agent.write, agent.wait = write, wait


def _wait_for(cond, what, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _payload(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"hidden": torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g), "finished": False}


def test_large_payload_is_published_ahead_then_written(pair):
    tx, rx = pair
    sent = record_bell(tx)
    p = _payload(BIG)
    tx.put("big", p)
    got = rx.get("big")
    assert torch.equal(got["hidden"], p["hidden"]) and got["finished"] is False
    pool = rx._rx.pool
    assert pool.addr <= got["hidden"].data_ptr() < pool.addr + pool.nbytes  # a view of the pool
    kinds = [(type(m).__name__, getattr(m, "written", None), getattr(m, "status", None)) for m in sent]
    assert kinds == [("Publish", False, None), ("Written", None, wire.WRITTEN_OK)], kinds
    # A small host payload (its WRITE ends as it is posted), one with a bool tensor (its
    # bytes are checked) or without tensor bytes is published once written: one message.
    for key, payload, names in (("small", {"t": torch.arange(10)}, ["Publish"]),
                                ("bool", {"b": torch.ones(5, dtype=torch.bool)}, ["Publish"]),
                                ("plain", {"x": [1, "2"]}, ["Publish"])):
        sent.clear()
        tx.put(key, payload)
        got = rx.get(key)
        assert list(got) == list(payload) and [type(m).__name__ for m in sent] == names, (key, sent)
        assert sent[0].written is (names == ["Publish"])
    assert not rx._rx.ahead_keys and all(not s.ahead for s in rx._rx.sessions.values())


def test_not_gettable_before_written_and_pending_for_duplicates(pair, monkeypatch, caplog):
    tx, rx = pair
    agent = tx._tx.agent
    real_wait = agent.wait
    gate = threading.Event()

    def held_wait(req, deadline, lost):
        assert gate.wait(20)
        return real_wait(req, deadline, lost)

    monkeypatch.setattr(agent, "wait", held_wait)
    p = _payload(BIG, 1)
    errors = []

    def put():
        try:
            tx.put("k", p)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=put)
    t.start()
    try:
        _wait_for(lambda: "k" in rx._rx.ahead_keys, "the publish ahead")
        with pytest.raises(omnilink.WouldBlock):
            rx.get_nowait("k")
        assert rx.stats().blocks_in_use == 1  # its block is reserved
        # Another sender's put of that key is a duplicate while the first is on its way:
        # the receiver refuses it, which that sender logs once the answer comes (a put
        # waits for the receiver's verdict only for a key its connector put before; its
        # close takes the last answers).
        other = omnilink.connect("nixl", channel=rx.channel, role="sender", endpoint=rx.endpoint, timeout=30.0)
        try:
            with caplog.at_level(logging.WARNING, logger="omnilink.connectors.nixl.connector"):
                other.put("k", {"t": torch.arange(3)})
                other.close()
            assert any("refused key 'k'" in r.getMessage() and "still pending" in r.getMessage()
                       for r in caplog.records), [r.getMessage() for r in caplog.records]
        finally:
            other.close()
    finally:
        gate.set()
        t.join(30)
    assert not errors, errors
    got = rx.get("k")
    assert torch.equal(got["hidden"], p["hidden"])
    assert not rx._rx.ahead_keys


@contextlib.contextmanager
def _wait_then(monkeypatch, agent, after):
    """Within it, each WRITE is waited for, then ``after(why)`` says what the wait
    returns (a failure the test makes up once the bytes did land)."""
    real_wait = agent.wait
    with monkeypatch.context() as m:
        m.setattr(agent, "wait", lambda req, deadline, lost: after(real_wait(req, deadline, lost)))
        yield


@pytest.mark.parametrize("stuck", [False, True], ids=["failed", "stuck"])
def test_a_write_that_fails_after_the_publish_is_never_gettable(pair, stuck, monkeypatch):
    tx, rx = pair
    agent = tx._tx.agent

    def timed_out(why):
        assert why is None  # the WRITE really ended first
        if stuck:
            agent._stuck.append(object())  # NIXL kept a request it could not release
        return "timeout"

    with _wait_then(monkeypatch, agent, timed_out), pytest.raises(omnilink.TransferTimeout):
        tx.put("lost", _payload(BIG, 2))
    r = rx._rx
    _wait_for(lambda: not r.ahead_keys, "the written message")
    with pytest.raises(omnilink.WouldBlock):
        rx.get_nowait("lost")
    assert len(r.stuck) == (1 if stuck else 0)
    # The key is free again, the channel works.
    p = _payload(BIG, 3)
    tx.put("lost", p)
    assert torch.equal(rx.get("lost")["hidden"], p["hidden"])
    # The block a WRITE may still land in stays taken (its lease is kept); a failed
    # one's came free.
    assert rx.stats().blocks_in_use == (1 if stuck else 0)
    agent._stuck.clear()


def test_sender_lost_before_written_drops_the_payload_and_frees_its_block(pair, monkeypatch):
    tx, rx = pair
    tx.put("warm", {"t": torch.arange(4)})
    assert torch.equal(rx.get("warm")["t"], torch.arange(4))
    s = tx._tx

    def vanished(_why):
        s._drop_session()  # the connection goes before the written message
        s.lost = "gone (test)"
        return "lost"

    with _wait_then(monkeypatch, s.agent, vanished), pytest.raises(omnilink.PeerLostError):
        tx.put("orphan", _payload(BIG, 4))
    r = rx._rx
    _wait_for(lambda: not r.ahead_keys and not any(x.ahead for x in r.sessions.values()), "the session's end")
    with pytest.raises(omnilink.WouldBlock):
        rx.get_nowait("orphan")
    _wait_for(lambda: rx.stats().blocks_in_use == 0, "the orphan's block back")
    p = _payload(BIG, 5)
    tx.put("next", p)  # a new session
    assert torch.equal(rx.get("next")["hidden"], p["hidden"])


def _publish_raw(tx, msg):
    s = tx._tx
    s._send_bell(msg, Deadline(10), msg.key if isinstance(msg, wire.Publish) else None)


def test_bool_data_published_ahead_is_checked_once_written(pair):
    tx, rx = pair
    tx.put("warm", _payload(BIG, 6))  # a session and an extent of room
    rx.get("warm")
    s = tx._tx
    for key, byte in (("ok", 1), ("bad", 2)):
        data = torch.zeros(BIG, dtype=torch.uint8)
        data[7] = byte
        prepared = omnilink.blob.prepare({"b": data.view(torch.bool)})
        off = s._alloc(prepared.data_len, Deadline(10), key)
        s.seq += 1
        seq = s.seq
        _publish_raw(tx, wire.Publish(seq=seq, key=key, offset=off, length=prepared.data_len, meta=prepared.meta,
                                      written=False))
        assert s._write(prepared, s.welcome, off, Deadline(10)) is None
        assert key in rx._rx.ahead_keys or not _acked(s, seq)  # held aside, not answered yet
        _publish_raw(tx, wire.Written(seq=seq, status=wire.WRITTEN_OK))
        s._receive(Deadline(10), lambda m, seq=seq: isinstance(m, wire.Ack) and m.seq == seq, key, "ack")
        ack = s.acks.pop(seq)
        assert ack.status == (wire.ACK_OK if byte == 1 else wire.ACK_DECODE_ERROR), ack
        if byte == 2:
            assert "bool" in ack.text
    got = rx.get("ok")
    assert got["b"].dtype == torch.bool and int(got["b"].view(torch.uint8).sum()) == 1
    with pytest.raises(omnilink.WouldBlock):
        rx.get_nowait("bad")  # refused: never gettable
    del got
    _wait_for(lambda: rx.stats().blocks_in_use == 0, "the refused block back")


def _acked(s, seq):
    """Whether the ack of ``seq`` has come (read what the doorbell holds, no wait)."""
    try:
        s._receive(Deadline(0), lambda m: isinstance(m, wire.Ack) and m.seq == seq, None, "ack")
    except omnilink.TransferTimeout:
        return seq in s.acks
    return True


def test_hostile_ahead_messages_are_refused(pair):
    tx, rx = pair
    tx.put("warm", {"t": torch.arange(4)})
    rx.get("warm")
    s = tx._tx
    meta = omnilink.blob.prepare({"t": torch.zeros(16, dtype=torch.uint8)}).meta
    # Ahead with no block, then a written for a seq never published, then too many ahead.
    s.seq += 1
    seq = s.seq
    _publish_raw(tx, wire.Publish(seq=seq, key="nothing", offset=0, length=0, meta=meta, written=False))
    s._receive(Deadline(10), lambda m: isinstance(m, wire.Ack) and m.seq == seq, None, "ack")
    assert s.acks.pop(seq).status == wire.ACK_DECODE_ERROR
    _publish_raw(tx, wire.Written(seq=10**9, status=wire.WRITTEN_OK))
    seqs = []
    for i in range(nixl_connector._MAX_AHEAD + 1):
        off = s._alloc(256, Deadline(10), f"a{i}")
        s.seq += 1
        seqs.append(s.seq)
        _publish_raw(tx, wire.Publish(seq=s.seq, key=f"a{i}", offset=off, length=256, meta=meta, written=False))
    # The one too many is refused at once; the others wait for their written message.
    s._receive(Deadline(10), lambda m: isinstance(m, wire.Ack) and m.seq == seqs[-1], None, "ack")
    assert s.acks.pop(seqs[-1]).status == wire.ACK_DECODE_ERROR
    assert not any(q in s.acks for q in seqs[:-1])
    for i in range(nixl_connector._MAX_AHEAD):
        with pytest.raises(omnilink.WouldBlock):
            rx.get_nowait(f"a{i}")
    # Their WRITEs "failed": dropped, their blocks free again; the session goes on.
    for seq in seqs[:-1]:
        _publish_raw(tx, wire.Written(seq=seq, status=wire.WRITTEN_FAILED))
    _wait_for(lambda: not rx._rx.ahead_keys, "the written messages")
    tx.put("good", {"t": torch.arange(9)})
    assert torch.equal(rx.get("good")["t"], torch.arange(9))


def test_parsed_headers_kept_are_bounded(pair):
    tx, rx = pair
    r = rx._rx
    big_tree = {f"k{i}": "x" * 64 for i in range(80)}  # a header of several KiB: parsed, not kept
    for i in range(3):
        tx.put(f"h{i}", {"t": torch.arange(4) + i, "tree": big_tree})
        got = rx.get(f"h{i}")
        assert torch.equal(got["t"], torch.arange(4) + i) and got["tree"] == big_tree
    assert all(len(m) <= nixl_connector._HEADER_KEPT_BYTES for m in r.headers)
    for i in range(nixl_connector._HEADERS_KEPT + 5):  # distinct small headers: at most the bound
        tx.put(f"s{i}", {"t": torch.arange(i % 7 + 1), "i": i})
        rx.get(f"s{i}")
    assert 0 < len(r.headers) <= nixl_connector._HEADERS_KEPT


def test_a_sender_that_closes_right_after_its_put_loses_nothing(pair):
    """A put returns once its payload is published, before the receiver answers; the
    answer to a payload published ahead comes once it is indexed, and a sender that
    closes right after its put (its goodbye and its ``written`` travel on different
    sockets) waits for that answer first: it loses nothing."""
    tx, rx = pair
    for i in range(12):
        other = omnilink.connect("nixl", channel=rx.channel, role="sender", endpoint=rx.endpoint, timeout=30.0)
        p = _payload(BIG, 100 + i)
        other.put(f"c{i}", p)
        other.close()
        got = rx.get(f"c{i}", timeout=10.0)
        assert torch.equal(got["hidden"], p["hidden"])
        del got
