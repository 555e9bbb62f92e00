"""Hypothesis fuzzing of the decoder: garbage, flipped, cut and hostile frames.

Whatever the bytes, ``decode`` either returns a payload whose every view lies inside the
buffer, or raises a ``BlobDecodeError``: never another exception, a crash or a hang. The
device path of the decoder (``_device_views``: one copy of the data region, every tensor
a view of it) copies only from inside the frame and, when it decodes a frame, makes of
it what the general decoder makes. Together these tests run 8,000 examples in CI
(counts on each test); the seeds are
the hostile inputs an audit found (issue 16). ``benchmarks/fuzz_hostile.py`` runs
100,000+ generated inputs against the decoder and every receiver.
"""

from __future__ import annotations

import struct
import zlib

import msgspec
import numpy as np
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import omnilink
from omnilink import BlobDecodeError, blob
from tests.blob_frames import frame, tensor_ref, tree
from tests.payload_equal import tensors_in
from tests.property.strategies import payloads

def fuzz(n: int):
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode_checked(buf):
    """Decode ``buf``; any success must only hold views inside ``buf``."""
    try:
        out = omnilink.decode(buf)
    except BlobDecodeError:
        return None
    lo = np.frombuffer(buf, dtype=np.uint8).ctypes.data if len(buf) else 0
    for v in tensors_in(out):
        if isinstance(v, torch.Tensor):
            if v.numel():
                start, n = v.data_ptr(), v.numel() * v.element_size()
                assert lo <= start and start + n <= lo + len(buf), "view outside the buffer"
        elif v.size:
            assert lo <= v.ctypes.data and v.ctypes.data + v.nbytes <= lo + len(buf), "array outside the buffer"
    return out


@fuzz(1500)
@given(st.binary(max_size=512))
def test_random_bytes(data):
    decode_checked(bytearray(data))


@fuzz(1500)
@given(st.binary(max_size=200))
def test_random_bytes_behind_a_valid_prefix(data):
    decode_checked(bytearray(blob.MAGIC + b"\x01\x00\x00\x00" + data))


@fuzz(1000)
@given(payloads, st.data())
def test_byte_flips(p, data):
    buf = bytearray(omnilink.encode(p))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] ^= data.draw(st.integers(1, 255))
    decode_checked(buf)


@fuzz(800)
@given(payloads, st.data())
def test_truncations_and_extensions(p, data):
    buf = omnilink.encode(p)
    cut = data.draw(st.integers(0, len(buf)))
    extra = data.draw(st.binary(max_size=100))
    truncated = bytearray(buf[:cut])
    if cut < len(buf):
        try:
            omnilink.decode(truncated)
        except BlobDecodeError:
            pass
        else:
            raise AssertionError("a truncated frame decoded")
    decode_checked(bytearray(buf + extra))


# Dims reach the overflow cases of the audit: an empty tensor with huge other dims.
dims = (
    st.integers(-(1 << 40), 1 << 40)
    | st.integers(-2, 8)
    | st.sampled_from([0, 1 << 31, 1 << 40, 1 << 62, 1 << 63, (1 << 64) - 1])
)
descriptors = st.lists(
    st.tuples(
        st.integers(-1, 3),                              # kind
        st.integers(-5, 30) | st.integers(0, 1 << 32),   # dtype code
        st.lists(dims, max_size=6),                      # shape
        st.integers(-64, 1 << 20) | st.sampled_from([0, 64, 128, (1 << 64) - 64]),  # offset
        st.integers(-8, 1 << 20) | st.sampled_from([0, 4, 8, 64, (1 << 63)]),      # nbytes
    ).map(list),
    max_size=4,
)


@fuzz(1200)
@given(descriptors, st.lists(st.integers(0, 6), max_size=4), st.binary(max_size=256),
       st.one_of(st.none(), st.integers(0, (1 << 64) - 1)))
@example([[0, 9, [0, 1 << 40, 1 << 40], 0, 0]], [0], b"", None)
@example([[0, 9, [0, 1 << 63], 0, 0]], [0], b"", None)
@example([[1, 9, [0, 1 << 40, 1 << 40], 0, 0]], [0], b"", None)
@example([[1, 9, [0, 1 << 63], 0, 0]], [0], b"", None)
@example([[0, 9, [0, 1 << 40, 1 << 40], 0, 0, 0]], [0], b"", None)
def test_hostile_headers(descs, refs, data, data_len):
    try:
        buf = frame(descs, tree({"r": [tensor_ref(i) for i in refs]}), data, data_len=data_len)
    except (OverflowError, msgspec.EncodeError):
        return
    decode_checked(bytearray(buf))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.lists(st.binary(max_size=64), max_size=3))
def test_decode_parts_garbage(meta, regions):
    try:
        blob.decode_parts(meta, regions)
    except BlobDecodeError:
        pass


# A grammar of payload trees a hostile sender could write: any msgpack key type, tuple
# extensions holding anything, tensor references in and out of range, deep nesting.
_keys = st.one_of(st.text(max_size=4), st.integers(-3, 3), st.binary(max_size=3), st.floats(allow_nan=False),
                  st.booleans(), st.none())
_leaves = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
                    st.text(max_size=8), st.binary(max_size=8),
                    st.integers(0, 3).map(tensor_ref),
                    st.binary(max_size=6).map(lambda b: msgspec.msgpack.Ext(2, b)))


def _extend(children):
    return st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(_keys, children, max_size=3),
        st.lists(children, max_size=3).map(lambda v: msgspec.msgpack.Ext(2, tree(v))),
        st.dictionaries(_keys, children, max_size=2).map(lambda v: msgspec.msgpack.Ext(2, tree(v))),
    )


hostile_trees = st.recursive(_leaves, _extend, max_leaves=12)


def _keys_are_str(obj):
    if isinstance(obj, dict):
        return all(type(k) is str and _keys_are_str(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_keys_are_str(v) for v in obj)
    return True


@fuzz(600)
@given(hostile_trees, st.integers(0, 2), st.sampled_from([0, 1, 2]))
@example({1: 2}, 0, 0)
@example({"a": [{"b": {2: 3}}]}, 0, 0)
def test_hostile_trees(obj, n_tensors, extra):
    descs = [[0, 9, [1], 64 * i, 4] for i in range(n_tensors)]
    try:
        tree_bytes = tree(obj)
        buf = frame(descs, tree_bytes, bytes(64 * n_tensors))
    except (OverflowError, msgspec.EncodeError):
        return
    out = decode_checked(bytearray(buf))
    if out is not None:
        assert _keys_are_str(out), "a non-str dict key was decoded"
    if extra:
        # The same frame with extra header elements: the spec says readers reject it.
        header = msgspec.msgpack.encode([descs, msgspec.Raw(tree_bytes)] + [0] * extra)
        pad = (-(blob.PREFIX_SIZE + len(header))) % blob.FRAME_ALIGN
        raw = struct.pack("<4sHHIIQ", blob.MAGIC, 1, 0, len(header), zlib.crc32(header), 64 * n_tensors)
        try:
            omnilink.decode(bytearray(raw + header + bytes(pad) + bytes(64 * n_tensors)))
        except BlobDecodeError:
            pass
        else:
            raise AssertionError("a header with extra elements decoded")


def _device_decode_checked(buf):
    """Decode ``buf`` the way a device get does (``_device_views``), the "device" being a
    CPU buffer filled by ``fetch``: the one copy must stay inside the frame, and the result
    must be what the general decoder makes of the same bytes (or a clean refusal)."""
    fetched = []

    def fetch(start, n):
        assert 0 <= start and start + n <= len(buf), f"fetch of [{start}, {start + n}) from a {len(buf)}-byte frame"
        fetched.append((start, n))
        return torch.frombuffer(bytearray(buf[start:start + n]) + bytes(-n % 64), dtype=torch.uint8)

    def views(b, plan, base):
        return blob._device_views(b, plan, base, fetch, lambda shape, dt: torch.empty(shape, dtype=dt))

    try:
        out = blob._decode_fast(memoryview(buf), len(buf), views)
    except BlobDecodeError:
        return None
    assert len(fetched) <= 1
    if out is blob._MISS:
        return None
    ref = omnilink.decode(bytearray(buf))  # a frame the fast path took is valid for the general one
    _assert_same(out, ref)
    return out


def _bytes_of(t):
    """A tensor's bytes as a uint8 tensor (bit-exact: NaNs and every dtype compare)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_same(a, b):
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        if b.numel():
            assert torch.equal(_bytes_of(a), _bytes_of(b))
    elif isinstance(b, float):
        assert type(a) is float and (a == b or (a != a and b != b))  # NaN == NaN here
    elif isinstance(b, dict):
        assert type(a) is dict and list(a) == list(b)
        for k in b:
            _assert_same(a[k], b[k])
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert type(a) is type(b) and a == b


@fuzz(500)
@given(payloads, st.data())
def test_device_views_of_valid_and_flipped_frames(p, data):
    buf = bytearray(omnilink.encode(p))
    for _ in range(2):  # learn path, then (when the head repeats) the cached head
        _device_decode_checked(buf)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] ^= data.draw(st.integers(1, 255))
    _device_decode_checked(buf)


@fuzz(600)
@given(descriptors, st.lists(st.integers(0, 6), max_size=4), st.binary(max_size=256),
       st.one_of(st.none(), st.integers(0, (1 << 64) - 1)))
def test_device_views_of_hostile_headers(descs, refs, data, data_len):
    try:
        buf = frame(descs, tree({"r": [tensor_ref(i) for i in refs]}), data, data_len=data_len)
    except (OverflowError, msgspec.EncodeError):
        return
    _device_decode_checked(bytearray(buf))


def test_device_views_check_the_examples_hypothesis_found():
    # Found by CI's random seed on the first version of this check: a NaN in the tree
    # and an empty complex32 tensor (torch.equal has no ComplexHalf kernel).
    for payload in (float("nan"), torch.tensor([], dtype=torch.complex32),
                    {"z": torch.zeros(3, dtype=torch.complex32), "x": [float("nan"), 1.5]}):
        buf = bytearray(omnilink.encode(payload))
        for _ in range(2):
            _device_decode_checked(buf)
