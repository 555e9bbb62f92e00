"""Small payloads inline (nixl): a payload of at most ``wire.INLINE_MAX_BYTES`` of data
travels in its ``publish`` (no WRITE; the receiver copies the bytes into the block the
sender chose), lands as views of the pool like any other, and a hostile or failed
inline publish is refused without losing the block or the session."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

import omnilink
from omnilink._util import Deadline
from omnilink.connectors import backend_unavailable
from omnilink.connectors.nixl import wire
from tests.nixl_pair import answered, nixl_pair, record_bell

_REASON = backend_unavailable("nixl")
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"nixl backend unavailable: {_REASON}")


@pytest.fixture(params=["tcp", "cma,tcp"])
def pair(request, monkeypatch):
    with nixl_pair(monkeypatch, f"olnx/inline-{os.getpid()}", tls=request.param, pool_bytes=16 << 20,
                   extent_bytes=4 << 20) as p:
        yield p


def _record(tx):
    """``(bell messages, WRITEs posted)`` of the sender, recorded from now on."""
    agent = tx._tx.agent
    writes = []
    real_write = agent.write

    def write(*args, **kwargs):
        writes.append(args)
        return real_write(*args, **kwargs)

    agent.write = write
    return record_bell(tx), writes


def _in_pool(rx, t):
    pool = rx._rx.pool
    return pool.addr <= t.data_ptr() < pool.addr + pool.nbytes


def test_small_payloads_go_inline_and_land_in_the_pool(pair):
    tx, rx = pair
    sent, writes = _record(tx)
    g = torch.Generator().manual_seed(1)
    payload = {"h": torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g),
               "strided": torch.arange(64 * 32, dtype=torch.float32).view(64, 32).t(),
               "arr": np.arange(100, dtype=np.int16), "b": torch.tensor([True, False, True]), "meta": {"k": [1, 2]}}
    for i in range(3):
        tx.put(f"k{i}", payload)
        got = rx.get(f"k{i}")
        assert torch.equal(got["h"], payload["h"]) and torch.equal(got["strided"], payload["strided"])
        assert np.array_equal(got["arr"], payload["arr"]) and torch.equal(got["b"], payload["b"])
        assert got["meta"] == {"k": [1, 2]}
        assert _in_pool(rx, got["h"]) and _in_pool(rx, got["strided"])  # views of the pool, as written ones
        del got
    assert not writes
    assert [type(m).__name__ for m in sent] == ["Publish"] * 3
    data_len = omnilink.blob.prepare(payload).data_len
    assert all(m.written and len(m.data) == data_len == m.length for m in sent)


def test_the_inline_bound_is_exact(pair):
    tx, rx = pair
    sent, writes = _record(tx)
    for n, inline in ((wire.INLINE_MAX_BYTES, True), (wire.INLINE_MAX_BYTES + 64, False)):
        sent.clear()
        writes.clear()
        t = torch.arange(n, dtype=torch.int64).to(torch.uint8)
        assert omnilink.blob.prepare({"t": t}).data_len == n
        tx.put(f"n{n}", {"t": t})
        got = rx.get(f"n{n}")
        assert torch.equal(got["t"], t)
        del got
        assert bool(sent[-1].data) is inline and bool(writes) is not inline, n


def _publish_raw(tx, msg):
    s = tx._tx
    s.seq = msg.seq
    s._send_bell(msg, Deadline(10), msg.key)
    s._receive(Deadline(10), lambda m: isinstance(m, wire.Ack) and m.seq == msg.seq, None, "ack")
    return s.acks.pop(msg.seq)


def test_hostile_inline_publishes_are_refused_and_free_their_block(pair):
    tx, rx = pair
    tx.put("warm", {"t": torch.arange(4)})
    rx.get("warm")
    s = tx._tx
    prepared = omnilink.blob.prepare({"t": torch.arange(16, dtype=torch.uint8)})
    meta, n = prepared.meta, prepared.data_len
    cases = [
        ("ahead", dict(length=n, data=bytes(n), written=False)),  # inline data on a payload not written
        ("short", dict(length=n, data=bytes(n - 1))),  # not the whole data region
        ("long", dict(length=n + 64, data=bytes(n + 64))),
        ("noblock", dict(length=0, data=bytes(n))),
    ]
    for key, fields in cases:
        off = s._alloc(fields["length"], Deadline(10), key) if fields["length"] else 0
        ack = _publish_raw(tx, wire.Publish(seq=s.seq + 1, key=key, offset=off, meta=meta, **fields))
        assert ack.status in (wire.ACK_DECODE_ERROR, wire.ACK_BAD_BLOCK), (key, ack)
        with pytest.raises(omnilink.WouldBlock):
            rx.get_nowait(key)
    # A bool tensor whose inline bytes are not 0 and 1 is refused like a written one.
    bools = omnilink.blob.prepare({"b": torch.ones(8, dtype=torch.bool)})
    off = s._alloc(bools.data_len, Deadline(10), "bad")
    ack = _publish_raw(tx, wire.Publish(seq=s.seq + 1, key="bad", offset=off, length=bools.data_len,
                                        meta=bools.meta, data=b"\x02" * bools.data_len))
    assert ack.status == wire.ACK_DECODE_ERROR and "bool" in ack.text
    # The session goes on and every refused block came back: the pool is as empty.
    for i in range(40):
        tx.put(f"g{i}", {"t": torch.arange(512) + i})
        assert torch.equal(rx.get(f"g{i}")["t"], torch.arange(512) + i)
    assert rx.stats().blocks_in_use == 0


def test_a_failed_pool_copy_is_refused_and_the_link_goes_on(pair, monkeypatch, caplog):
    """The receiver refuses a payload whose inline data it cannot copy into its pool; the
    sender, whose put returned once the payload was published, logs the refusal with the
    answer; the key was never taken and the link goes on."""
    tx, rx = pair
    tx.put("warm", {"t": torch.arange(4)})
    rx.get("warm")
    pool = rx._rx.pool
    real = pool.write

    def broken(offset, data):
        raise omnilink.CudaError("copy failed (test)")

    monkeypatch.setattr(pool, "write", broken)
    with caplog.at_level(logging.WARNING, logger="omnilink.connectors.nixl.connector"):
        tx.put("lost", {"t": torch.arange(8)})
        answered(tx)
    assert any("refused key 'lost'" in r.getMessage() and "copy failed" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    with pytest.raises(omnilink.WouldBlock):
        rx.get_nowait("lost")
    monkeypatch.setattr(pool, "write", real)
    tx.put("lost", {"t": torch.arange(8)})  # the key was never taken
    assert torch.equal(rx.get("lost")["t"], torch.arange(8))
    assert rx.stats().blocks_in_use == 0
