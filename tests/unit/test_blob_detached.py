"""Frames whose head and data region travel apart (``decode_detached``, and its two steps
``parse_detached`` / ``decode_parsed``): round trips that view the data region in place,
every check of the head before the data is looked at, and ``reads_data`` /
``PreparedBlob.holds_bool``, which say whether decoding reads the data's bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnilink import BlobDecodeError, BlobVersionError, blob
from tests.payload_equal import assert_same, tensors_in


def _split(payload):
    """``(prepared, meta, data)``: the frame's head, and its data region in a buffer of
    its own (as the nixl backend's pool block holds it)."""
    prepared = blob.prepare(payload)
    frame = bytearray(prepared.nbytes)
    prepared.write_into(frame)
    data = bytearray(frame[prepared.data_offset : prepared.data_offset + prepared.data_len])
    return prepared, prepared.meta, data


def _payload():
    return {"hidden": torch.randn(5, 8).bfloat16(), "ids": torch.arange(7), "np": np.arange(6, dtype=np.float32),
            "flag": torch.tensor([True, False]), "meta": {"finished": False, "step": 3}, "t": (1, "x")}


def test_round_trip_views_the_data_region():
    payload = _payload()
    prepared, meta, data = _split(payload)
    got = blob.decode_detached(meta, data)
    assert_same(got, payload)
    header = blob.parse_detached(meta)
    again = blob.decode_parsed(header, data)
    assert_same(again, payload)
    base = np.frombuffer(data, dtype=np.uint8).ctypes.data
    for t in (got["hidden"], got["ids"], again["flag"]):
        assert base <= t.data_ptr() < base + len(data)  # a view of the region, no copy
    data[: len(data)] = bytes(len(data))  # the views see the region's bytes
    assert not got["ids"].any()


def test_the_head_is_checked_before_the_data():
    _prepared, meta, data = _split(_payload())
    for bad in (meta[:10], b"XXXX" + meta[4:], meta + b"\x00", bytes(len(meta))):
        with pytest.raises(BlobDecodeError):
            blob.parse_detached(bad)
    corrupt = bytearray(meta)
    corrupt[-1] ^= 0xFF  # the header's checksum
    with pytest.raises(BlobDecodeError):
        blob.decode_detached(bytes(corrupt), data)
    other = bytearray(meta)
    other[4] = 9  # version
    with pytest.raises(BlobVersionError):
        blob.parse_detached(bytes(other))
    header = blob.parse_detached(meta)
    with pytest.raises(BlobDecodeError, match="data region"):
        blob.decode_parsed(header, data[:-1])
    with pytest.raises(BlobDecodeError, match="writable"):
        blob.decode_parsed(header, bytes(data))


def test_bool_bytes_other_than_0_and_1_are_refused():
    raw = torch.zeros(16, dtype=torch.uint8)
    raw[3] = 2
    _prepared, meta, data = _split({"b": raw.view(torch.bool)})
    with pytest.raises(BlobDecodeError, match="bool"):
        blob.decode_detached(meta, data)


def test_device_view_and_numpy():
    payload = {"a": torch.arange(4.0), "b": {"c": torch.ones(2, 3)}}
    _prepared, meta, data = _split(payload)
    seen = []

    def view(d):
        seen.append((d.offset, d.nbytes))
        return torch.full(tuple(d.shape), 7.0)

    got = blob.decode_detached(meta, None, device_view=view)
    assert torch.equal(got["a"], torch.full((4,), 7.0)) and got["b"]["c"].shape == (2, 3)
    assert len(seen) == 2
    _prepared, meta, _data = _split({"n": np.arange(3)})
    with pytest.raises(BlobDecodeError, match="numpy"):
        blob.decode_detached(meta, None, device_view=view)


@pytest.mark.parametrize(
    ("payload", "host", "device", "holds_bool"),
    [
        ({"t": torch.arange(3.0)}, False, False, False),
        ({"t": torch.arange(3.0), "b": torch.ones(2, dtype=torch.bool)}, True, True, True),
        ({"b": torch.ones(0, dtype=torch.bool)}, False, False, False),  # no bytes to check
        ({"n": np.arange(3)}, False, True, False),  # numpy: viewed on the host, copied for a device
        ({"x": [1, 2]}, False, False, False),
    ],
)
def test_reads_data_and_holds_bool(payload, host, device, holds_bool):
    prepared, meta, _data = _split(payload)
    header = blob.parse_detached(meta)
    assert blob.reads_data(header, device=False) is host
    assert blob.reads_data(header, device=True) is device
    assert prepared.holds_bool is holds_bool


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_meta_parses_or_raises_a_decode_error(raw):
    try:
        blob.parse_detached(raw)
    except (BlobDecodeError, BlobVersionError):
        pass


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 200), st.integers(0, 255))
def test_a_flipped_head_byte_never_decodes_past_the_data(at, value):
    _prepared, meta, data = _split(_payload())
    bad = bytearray(meta)
    bad[at % len(bad)] = value
    try:
        header = blob.parse_detached(bytes(bad))
    except (BlobDecodeError, BlobVersionError):
        return
    try:
        got = blob.decode_parsed(header, data)
    except BlobDecodeError:
        return
    base = np.frombuffer(data, dtype=np.uint8).ctypes.data
    for d, t in zip(header.tensors, tensors_in(got)):
        assert d.offset + d.nbytes <= len(data)
        if isinstance(t, torch.Tensor) and t.numel():
            assert base <= t.data_ptr() < base + len(data)

