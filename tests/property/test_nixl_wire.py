"""Hypothesis against the nixl backend's control-channel decoder and block check: any
bytes decode to a valid message or raise ``BlobDecodeError`` (never anything else);
``check_block`` accepts a block only inside one extent of the sender, and valid
messages round-trip."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnilink._errors import BlobDecodeError
from omnilink.connectors.nixl import wire

_INT = st.one_of(st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1), st.sampled_from([0, 1, -1, 1 << 48, 1 << 63]))
_ITEM = st.one_of(_INT, st.text(max_size=40), st.binary(max_size=64), st.none(), st.booleans(), st.floats())
_TAGS = st.sampled_from(["hello", "extent", "publish", "written", "return", "bye", "welcome", "granted", "ack",
                         "refused", "HELLO", "", "x"])


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_only_blob_decode_error(raw):
    for decode in (wire.decode_from_sender, wire.decode_from_receiver):
        try:
            decode(raw)
        except BlobDecodeError:
            pass


@settings(max_examples=400, deadline=None)
@given(_TAGS, st.lists(_ITEM, max_size=8))
def test_structured_garbage_only_blob_decode_error(tag, items):
    raw = msgspec.msgpack.encode([tag, *items])
    for decode in (wire.decode_from_sender, wire.decode_from_receiver):
        try:
            msg = decode(raw)
        except BlobDecodeError:
            continue
        # Accepted: every bound holds.
        for name in ("offset", "length", "need"):
            v = getattr(msg, name, 0)
            assert 0 <= v <= wire.MAX_OFFSET
        if isinstance(msg, wire.Publish):
            assert 1 <= len(msg.key) <= 512 and isinstance(msg.written, bool)
        if isinstance(msg, wire.Written):
            assert 0 <= msg.seq <= 1 << 62 and msg.status in (wire.WRITTEN_OK, wire.WRITTEN_FAILED,
                                                              wire.WRITTEN_STUCK)


def test_oversized_fields_refused():
    md = b"x" * (wire.MAX_METADATA_BYTES + 1)
    raw = msgspec.msgpack.encode(["hello", 1, "0" * 32, 1, md])
    with pytest.raises(BlobDecodeError):
        wire.decode_from_sender(raw)
    raw = msgspec.msgpack.encode(["granted", 0, 0, list(range(wire.MAX_FREES + 1))])
    with pytest.raises(BlobDecodeError):
        wire.decode_from_receiver(raw)
    with pytest.raises(BlobDecodeError):  # invalid UTF-8 in a str (msgspec: UnicodeDecodeError)
        wire.decode_from_sender(b"\x92\xa5hell\x80")
    with pytest.raises(BlobDecodeError):  # an extra field
        wire.decode_from_sender(msgspec.msgpack.encode(["return", 0, 1]))


@settings(max_examples=300, deadline=None)
@given(st.integers(-(1 << 50), 1 << 50), st.integers(-(1 << 50), 1 << 50),
       st.dictionaries(st.integers(0, 1 << 30).map(lambda x: x * 256), st.integers(256, 1 << 24), max_size=6))
def test_check_block_only_inside_one_extent(offset, length, extents):
    pool = 1 << 31
    extents = {o: s for o, s in extents.items() if o + s <= pool}
    ext = wire.check_block(offset, length, extents, pool)
    if ext is None:
        assert length <= 0 or offset < 0 or offset + length > pool or not any(
            o <= offset and offset + length <= o + s for o, s in extents.items())
    else:
        assert ext in extents and ext <= offset and offset + length <= ext + extents[ext]
        assert length > 0 and 0 <= offset and offset + length <= pool


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 1 << 40), st.text(min_size=1, max_size=100), st.integers(0, wire.MAX_OFFSET),
       st.integers(0, wire.MAX_OFFSET), st.binary(min_size=24, max_size=200), st.booleans(),
       st.sampled_from([wire.WRITTEN_OK, wire.WRITTEN_FAILED, wire.WRITTEN_STUCK]), st.binary(max_size=300))
def test_publish_and_written_round_trip(seq, key, offset, length, meta, written, status, data):
    msg = wire.Publish(seq=seq, key=key, offset=offset, length=length, meta=meta, written=written, data=data)
    assert wire.decode_from_sender(wire.encode(msg)) == msg
    done = wire.Written(seq=seq, status=status)
    assert wire.decode_from_sender(wire.encode(done)) == done


def test_written_out_of_range_refused():
    for items in (["written", 1, 3], ["written", -1, 0], ["written", 1], ["written", 1, 0, 0], ["written", "1", 0]):
        with pytest.raises(BlobDecodeError):
            wire.decode_from_sender(msgspec.msgpack.encode(items))
    # A publish from a sender of protocol 2 (no ``written``) reads as published once written.
    old = wire.decode_from_sender(msgspec.msgpack.encode(["publish", 1, "k", 0, 0, b"x" * 24]))
    assert isinstance(old, wire.Publish) and old.written is True and old.data == b""
    # Inline data is bounded before anything is built.
    too_much = msgspec.msgpack.encode(["publish", 1, "k", 0, 0, b"x" * 24, True, b"d" * (wire.INLINE_MAX_BYTES + 1)])
    with pytest.raises(BlobDecodeError):
        wire.decode_from_sender(too_much)
