"""tensor_blob v1: layout, round trips, zero copy, lifetimes and every decode check."""

from __future__ import annotations

import ctypes
import enum
import gc
import mmap
import struct
import subprocess
import sys
import weakref
import zlib

import msgspec
import numpy as np
import pytest
import torch

import omnilink
from omnilink import BlobDecodeError, BlobEncodeError, BlobVersionError, blob
from tests.blob_frames import frame, tensor_ref, tree
from tests.payload_equal import assert_same


def vllm_payload():
    return {
        "hidden_states.output": torch.randn(7, 16).bfloat16(),
        "hidden_states.output_shape": [7, 16],
        "embed.prefill": torch.randn(3, 16),
        "ids.prompt": torch.arange(5),
        "codes.audio": torch.arange(48, dtype=torch.int64),
        "meta": {"finished": torch.tensor(True), "left_context_size": 25},
        "speaker": "Ethan",
        "language": None,
        "shape": (7, 16),
        "raw": b"\x00\x01",
        "np": np.linspace(0, 1, 9, dtype=np.float16),
    }


def test_layout_matches_the_spec():
    payload = {"a": torch.arange(3, dtype=torch.int32), "b": np.ones(5, dtype=np.float64), "m": {"x": 1}}
    buf = omnilink.encode(payload)
    magic, version, flags, header_len, crc, data_len = struct.unpack_from("<4sHHIIQ", buf, 0)
    assert (magic, version, flags) == (b"OLB1", 1, 0)
    header = buf[24 : 24 + header_len]
    assert zlib.crc32(header) == crc
    d = (24 + header_len + 63) // 64 * 64
    assert len(buf) == d + data_len == omnilink.encoded_size(payload)
    assert buf[24 + header_len : d] == bytes(d - 24 - header_len)
    tensors, _tree = msgspec.msgpack.decode(header)
    assert [t[0] for t in tensors] == [blob.KIND_TORCH, blob.KIND_NUMPY]
    assert [t[1] for t in tensors] == [blob.DTYPE_CODES["int32"][0], blob.DTYPE_CODES["float64"][0]]
    for kind, code, shape, offset, nbytes in tensors:
        assert offset % 64 == 0
    (_, _, _, off_a, n_a), (_, _, _, off_b, n_b) = tensors
    assert buf[d + off_a : d + off_a + n_a] == payload["a"].numpy().tobytes()
    assert buf[d + off_b : d + off_b + n_b] == payload["b"].tobytes()


def test_round_trip_vllm_shaped_payload():
    p = vllm_payload()
    out = omnilink.decode(omnilink.encode(p))
    assert_same(out, p)
    assert isinstance(out["shape"], tuple) and isinstance(out["np"], np.ndarray)


@pytest.mark.parametrize("make", [
    lambda: torch.tensor(3.5),                                   # 0-d
    lambda: torch.empty(0, 4, dtype=torch.bfloat16),             # empty
    lambda: torch.arange(24.).view(2, 3, 4).permute(2, 0, 1),    # non-contiguous
    lambda: torch.arange(10)[::3],                               # strided slice
    lambda: torch.ones(1, 4).expand(5, 4),                       # stride 0
    lambda: torch.randn(4, requires_grad=True),                  # autograd leaf
    lambda: torch.randn(3, dtype=torch.complex64).conj(),        # conj bit
    lambda: torch.tensor([True, False, True]),
    lambda: torch.randn(6).to(torch.float8_e5m2),
    lambda: np.array([1 + 2j, 3 - 4j], dtype=np.complex64),
    lambda: np.zeros((0, 3), dtype=np.bool_),
    lambda: np.float32(1.25),
    lambda: np.arange(12, dtype=np.int16).reshape(3, 4).T,
])
def test_round_trip_edge_tensors(make):
    x = make()
    out = omnilink.decode(omnilink.encode({"x": x}))["x"]
    expect = x.detach().resolve_conj() if isinstance(x, torch.Tensor) else x
    assert_same(out, expect)


def test_encode_into_any_writable_buffer():
    p = vllm_payload()
    ref = omnilink.encode(p)
    n = omnilink.encoded_size(p)
    targets = [bytearray(n), mmap.mmap(-1, n), memoryview(bytearray(n + 100)), np.zeros(n, dtype=np.uint8),
               np.zeros((n + 63) // 64 * 8, dtype=np.float64)]
    for target in targets:
        assert omnilink.encode_into(p, target) == n
        assert bytes(memoryview(target).cast("B")[:n]) == ref
        assert_same(omnilink.decode(target), p)


def test_encode_into_rejects_small_or_readonly_buffers():
    p = {"x": torch.ones(100)}
    n = omnilink.encoded_size(p)
    with pytest.raises(BlobEncodeError, match="too small"):
        omnilink.encode_into(p, bytearray(n - 1))
    with pytest.raises(BlobEncodeError, match="read-only"):
        omnilink.encode_into(p, bytes(n))
    with pytest.raises(BlobEncodeError, match="bytes-like buffer"):
        omnilink.encode_into(p, object())


def test_decoded_tensors_are_views_of_the_buffer():
    p = {"h": torch.randn(64, 64).bfloat16(), "a": np.arange(100, dtype=np.int64)}
    buf = bytearray(omnilink.encoded_size(p))
    omnilink.encode_into(p, buf)
    lo = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    hi = lo + len(buf)
    out = omnilink.decode(buf)
    assert lo <= out["h"].data_ptr() and out["h"].data_ptr() + out["h"].nbytes <= hi
    assert lo <= out["a"].ctypes.data < hi
    # A write through the buffer shows through the view: same memory, no copy.
    out["h"].zero_()
    assert not any(buf[(out["h"].data_ptr() - lo):(out["h"].data_ptr() - lo) + 16])


def test_copy_true_owns_its_memory():
    p = {"h": torch.randn(32), "a": np.arange(10)}
    buf = bytearray(omnilink.encode(p))
    out = omnilink.decode(buf, copy=True)
    lo = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    assert not (lo <= out["h"].data_ptr() < lo + len(buf))
    assert not (lo <= out["a"].ctypes.data < lo + len(buf))
    buf[:] = bytes(len(buf))
    assert torch.equal(out["h"], p["h"]) and np.array_equal(out["a"], p["a"])


@pytest.mark.parametrize("which", ["torch", "numpy"])
def test_buffer_owner_lives_as_long_as_any_view(which):
    p = {"t": torch.arange(1000, dtype=torch.float32), "n": np.arange(10.0)}
    area = mmap.mmap(-1, omnilink.encoded_size(p))
    omnilink.encode_into(p, area)
    lease = (ctypes.c_char * len(area)).from_buffer(area)
    released = []
    weakref.finalize(lease, released.append, True)
    out = omnilink.decode(lease)
    keep = out["t"] if which == "torch" else out["n"]
    del out, lease
    gc.collect()
    assert released == []
    assert float(keep[5]) == 5.0
    del keep
    gc.collect()
    assert released == [True]
    area.close()


def test_readonly_bytes_decode_without_warning(recwarn):
    out = omnilink.decode(omnilink.encode({"x": torch.arange(4)}))
    assert out["x"].tolist() == [0, 1, 2, 3]
    assert not [w for w in recwarn.list if "writable" in str(w.message)]


def test_same_tensor_twice_is_written_once():
    t = torch.arange(1000)
    one = omnilink.encoded_size({"a": t})
    two = omnilink.encoded_size({"a": t, "b": t})
    assert two - one < 64
    out = omnilink.decode(omnilink.encode({"a": t, "b": t}))
    assert out["a"].data_ptr() == out["b"].data_ptr()


class Color(enum.IntEnum):
    RED = 1


class Foo:
    pass


@pytest.mark.parametrize("payload, where", [
    ({"meta": {"x": Foo()}}, "payload['meta']['x']: type tests.unit.test_blob.Foo"),
    ({"l": [1, 2, {3.0}]}, "payload['l'][2]: type builtins.set"),
    ({1: "int key"}, "payload[1]: dict key of type int"),
    ({"big": 1 << 70}, "payload['big']: int"),
    ({"e": Color.RED}, "payload['e']: type tests.unit.test_blob.Color"),
    ({"t": torch.zeros(2).to_sparse()}, "payload['t']: torch layout"),
    ({"s": np.array(["a", "b"])}, "payload['s']: numpy dtype <U1"),
    ({"o": np.array([1, "x"], dtype=object)}, "payload['o']: numpy dtype object"),
    ({"be": np.arange(3, dtype=">i4")}, "payload['be']: numpy array of non-native byte order"),
])
def test_unsupported_objects_name_their_path(payload, where):
    with pytest.raises(BlobEncodeError) as info:
        omnilink.encode(payload)
    assert where in str(info.value)


def test_deep_nesting_is_an_encode_error():
    p: list = []
    for _ in range(100_000):
        p = [p]
    with pytest.raises(BlobEncodeError, match="nested too deeply"):
        omnilink.encode(p)


def test_nothing_is_pickled(monkeypatch):
    import pickle

    def boom(*a, **k):
        raise AssertionError("pickle was called")

    monkeypatch.setattr(pickle, "dumps", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "Pickler", boom)
    monkeypatch.setattr(pickle, "Unpickler", boom)
    p = vllm_payload()
    assert_same(omnilink.decode(omnilink.encode(p)), p)


# --------------------------------------------------------------------- decode checks
F32 = blob.DTYPE_CODES["float32"][0]
BOOL = blob.DTYPE_CODES["bool"][0]


@pytest.mark.parametrize("buf, message", [
    (b"", "shorter than the 24-byte prefix"),
    (b"OLB1" + bytes(10), "shorter than the 24-byte prefix"),
    (frame([], tree(None), magic=b"PK\x03\x04"), "bad magic"),
    (frame([], tree(None), flags=2), "unknown flags"),
    (frame([], tree(None), header_len=(64 << 20) + 1), "exceeds the limit"),
    (frame([], tree(None), header_len=10_000), "truncated"),
    (frame([], tree(None), crc=1), "checksum mismatch"),
    (frame([], tree(None), data_len=1 << 62), "truncated"),
    (frame([[0, 999, [2], 0, 8]], tree(tensor_ref(0)), bytes(8)), "unknown dtype code 999"),
    (frame([[7, F32, [2], 0, 8]], tree(tensor_ref(0)), bytes(8)), "unknown kind 7"),
    (frame([[0, F32, [-2], 0, 8]], tree(tensor_ref(0)), bytes(8)), "negative dimension"),
    (frame([[0, F32, [3], 0, 8]], tree(tensor_ref(0)), bytes(8)), "nbytes 8 != numel 3"),
    (frame([[0, F32, [1 << 40, 1 << 40], 0, 8]], tree(tensor_ref(0)), bytes(8)), "overflows int64"),
    # Empty tensors whose other dims overflow torch's and numpy's stride arithmetic.
    (frame([[0, F32, [0, 1 << 40, 1 << 40], 0, 0]], tree(tensor_ref(0))), "overflows int64"),
    (frame([[1, F32, [0, 1 << 40, 1 << 40], 0, 0]], tree(tensor_ref(0))), "overflows int64"),
    (frame([[0, F32, [0, 1 << 63], 0, 0]], tree(tensor_ref(0))), "field shape[1]"),
    (frame([[0, F32, [0, (1 << 64) - 1], 0, 0]], tree(tensor_ref(0))), "field shape[1]"),
    (frame([[0, F32, [2], -64, 8]], tree(tensor_ref(0)), bytes(8)), "negative offset"),
    (frame([[0, F32, [2], 0, 8, 0]], tree(tensor_ref(0)), bytes(8)), "tensor 0 descriptor"),
    (frame([], tree({1: 2})), "dict key 1 of type int"),
    (frame([], tree({"a": [{"b": {2.5: 3}}]})), "dict key 2.5 of type float"),
    (frame([], tree(msgspec.msgpack.Ext(2, tree([{b"k": 1}])))), "dict key b'k' of type bytes"),
    (frame([], tree(msgspec.msgpack.Ext(2, tree({"a": 1})))), "tuple extension holds a dict"),
    (frame([[0, F32, [2], 8, 8]], tree(tensor_ref(0)), bytes(16)), "not a multiple of 64"),
    (frame([[0, F32, [2], 64, 8]], tree(tensor_ref(0)), bytes(16)), "outside data_len"),
    (frame([[0, F32, [1 << 40], 0, 4 << 40]], tree(tensor_ref(0)), bytes(16)), "outside data_len"),
    (frame([[0, F32, [16], 0, 64], [0, F32, [2], 0, 8]], tree([tensor_ref(0), tensor_ref(1)]), bytes(72)),
     "overlaps"),
    (frame([[0, F32, [1] * 65, 0, 4]], tree(tensor_ref(0)), bytes(4)), "limit MAX_NDIM"),
    (frame([[2, F32, [2], 0, 8]], tree(tensor_ref(0)), bytes(8)), "numpy scalar must have shape"),
    (frame([[0, F32, [2], 0, 8]], tree(tensor_ref(1)), bytes(8)), "references tensor 1"),
    (frame([], tree(msgspec.msgpack.Ext(9, b"")), b""), "unknown extension type 9"),
    (frame([], tree(msgspec.msgpack.Ext(1, b"\x00")), b""), "tensor reference of 1 bytes"),
    (frame([[0, BOOL, [2], 0, 2]], tree(tensor_ref(0)), b"\x01\x07"), "bool data holds bytes"),
    (frame([[1, blob.DTYPE_CODES["bfloat16"][0], [2], 0, 4]], tree(tensor_ref(0)), bytes(4)), "not a numpy dtype"),
    (frame("not a list", tree(None)), "malformed header"),
    (frame([], b"\xc1"), "malformed header"),
    (frame([], tree(msgspec.msgpack.Ext(2, b"\xc1"))), "malformed payload tree"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_malformed_frames_are_named_errors(buf, message):
    with pytest.raises(BlobDecodeError) as info:
        omnilink.decode(buf)
    assert message in str(info.value)


def test_hand_built_valid_frame_decodes():
    data = np.arange(4, dtype=np.float32).tobytes()
    out = omnilink.decode(frame([[0, F32, [2, 2], 0, 16]], tree({"x": tensor_ref(0)}), data))
    assert out["x"].tolist() == [[0.0, 1.0], [2.0, 3.0]]


def test_other_version_is_a_version_error():
    with pytest.raises(BlobVersionError, match="version 2"):
        omnilink.decode(frame([], tree(None), version=2))
    assert issubclass(BlobVersionError, BlobDecodeError)


def test_decode_rejects_non_buffers():
    with pytest.raises(BlobDecodeError, match="bytes-like"):
        omnilink.decode(12345)


def test_peek_header():
    p = {"x": torch.ones(10)}
    buf = omnilink.encode(p)
    hl, dl, total = blob.peek_header(buf)
    assert total == len(buf) and dl == 40 and 24 + hl <= total - dl


# --------------------------------------------------------------------- multi-frame
def test_parts_round_trip_and_zero_copy():
    p = vllm_payload()
    meta, regions = blob.encode_parts(p)
    # contiguous CPU tensors are sent from their own memory
    assert np.frombuffer(regions[1], np.uint8).ctypes.data == p["embed.prefill"].data_ptr()
    frames = [bytearray(r) for r in regions]
    out = blob.decode_parts(meta, frames)
    assert_same(out, p)
    lo = np.frombuffer(frames[0], np.uint8).ctypes.data
    assert out["hidden_states.output"].data_ptr() == lo


def test_parts_disagreeing_with_header_are_decode_errors():
    meta, regions = blob.encode_parts({"a": torch.ones(4), "b": torch.zeros(2)})
    with pytest.raises(BlobDecodeError, match="2 region frames|1 region frames"):
        blob.decode_parts(meta, regions[:1])
    with pytest.raises(BlobDecodeError, match="region 1 is 4 bytes, the header says 8"):
        blob.decode_parts(meta, [regions[0], bytes(4)])
    with pytest.raises(BlobDecodeError, match="meta frame is"):
        blob.decode_parts(meta + b"x", regions)


def test_misaligned_region_is_copied_not_misread():
    meta, regions = blob.encode_parts({"a": torch.arange(4, dtype=torch.float64)})
    backing = bytearray(len(regions[0]) + 1)
    view = memoryview(backing)[1:]
    view[:] = regions[0]
    out = blob.decode_parts(meta, [view])
    assert out["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert out["a"].data_ptr() % 8 == 0


# --------------------------------------------------------------------- import hygiene
def test_import_is_cheap_and_never_initialises_cuda():
    code = (
        "import sys, omnilink\n"
        "assert 'torch' not in sys.modules, 'import omnilink imported torch'\n"
        "import torch\n"
        "omnilink.decode(omnilink.encode({'x': torch.ones(3)}))\n"
        "assert not torch.cuda.is_initialized(), 'CUDA was initialised'\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_numpy_only_payload_does_not_import_torch():
    code = (
        "import sys, numpy as np, omnilink\n"
        "out = omnilink.decode(omnilink.encode({'a': np.arange(3)}))\n"
        "assert out['a'].tolist() == [0, 1, 2]\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.parametrize("dtype", [torch.complex128, torch.float64, torch.int32, torch.bfloat16])
def test_misaligned_region_of_every_width(dtype):
    t = torch.arange(15).to(dtype)
    meta, regions = blob.encode_parts({"a": t})
    backing = bytearray(len(regions[0]) + 8)
    view = memoryview(backing)[8:]  # 8 mod 16: misaligned for complex128
    view[:] = regions[0]
    out = blob.decode_parts(meta, [view])["a"]
    assert out.dtype == dtype and torch.equal(out, t)


# ------------------------------------------------------------------ hardening (issue 16)
def _raw_frame(header: bytes, data: bytes = b"") -> bytes:
    prefix = struct.pack("<4sHHIIQ", blob.MAGIC, blob.VERSION, 0, len(header), zlib.crc32(header), len(data))
    pad = (-(blob.PREFIX_SIZE + len(header))) % blob.FRAME_ALIGN
    return prefix + header + bytes(pad) + data


def test_header_with_extra_elements_is_rejected():
    header = msgspec.msgpack.encode([[], msgspec.Raw(tree(None)), 5])
    with pytest.raises(BlobDecodeError, match="at most length 2"):
        omnilink.decode(_raw_frame(header))


def test_huge_descriptor_count_is_rejected_before_it_is_built():
    # The audit's frame: millions of empty descriptors (9.5 M made +5.4 GiB). Rejected
    # from the msgpack array head: the decode takes no time and builds nothing.
    n = 2_000_000
    header = b"\x92\xdd" + n.to_bytes(4, "big") + b"\x95\x00\x09\x90\x00\x00" * n + tree(None)
    buf = _raw_frame(header)
    import tracemalloc as tracemalloc_start
    tracemalloc_start.start()
    try:
        with pytest.raises(BlobDecodeError, match="limit MAX_TENSORS"):
            omnilink.decode(buf)
        _, peak = tracemalloc_start.get_traced_memory()
    finally:
        tracemalloc_start.stop()
    assert peak < 1 << 20, f"decoder allocated {peak} bytes for a rejected frame"


def test_max_tensors_and_max_tree_items_can_be_lowered_per_call():
    p = {"a": [torch.zeros(1) for _ in range(5)], "b": list(range(20))}
    buf = omnilink.encode(p)
    assert len(omnilink.decode(buf, max_tensors=5)["a"]) == 5
    with pytest.raises(BlobDecodeError, match=r"more than max_tensors \(4\)"):
        omnilink.decode(buf, max_tensors=4)
    with pytest.raises(BlobDecodeError, match="more than 10 items"):
        omnilink.decode(buf, max_tree_items=10)
    meta, regions = blob.encode_parts(p)
    with pytest.raises(BlobDecodeError, match=r"more than max_tensors \(4\)"):
        blob.decode_parts(meta, regions, max_tensors=4)
    for bad in (-1, blob.MAX_TENSORS + 1, 2.0):
        with pytest.raises(omnilink.ConfigurationError, match="max_tensors"):
            omnilink.decode(buf, max_tensors=bad)


def test_tree_item_scan_counts_tuple_items():
    nested = tuple([()] * 3000)
    buf = omnilink.encode({"t": nested})
    assert omnilink.decode(buf)["t"] == nested
    with pytest.raises(BlobDecodeError, match="more than 2000 items"):
        omnilink.decode(buf, max_tree_items=2000)


def test_encoder_refuses_what_a_default_decoder_would_refuse():
    with pytest.raises(BlobEncodeError, match="MAX_TENSORS"):
        omnilink.encode([np.zeros(0) for _ in range(blob.MAX_TENSORS + 1)])
    with pytest.raises(BlobEncodeError, match="MAX_TREE_ITEMS"):
        omnilink.encode([[]] * blob.MAX_TREE_ITEMS)
    # At the limits both sides agree.
    big = [0] * (blob.MAX_TREE_ITEMS - 1)  # the list itself is the last item
    assert len(omnilink.decode(omnilink.encode(big))) == len(big)


def test_decode_of_bytes_never_writes_into_the_bytes():
    frame_bytes = omnilink.encode({"t": torch.arange(4), "a": np.arange(4)})
    before = bytes(frame_bytes)
    out = omnilink.decode(frame_bytes)
    out["t"][0] = 99  # a copy: the immutable bytes are untouched
    assert not out["a"].flags.writeable
    with pytest.raises(ValueError):
        out["a"][0] = 99
    assert frame_bytes == before
    base = np.frombuffer(frame_bytes, dtype=np.uint8).ctypes.data
    shared = omnilink.decode(frame_bytes, view_readonly=True)
    assert base <= shared["t"].data_ptr() < base + len(frame_bytes)  # opt-in: a view
    writable = bytearray(frame_bytes)
    view = omnilink.decode(writable)["t"]
    wbase = np.frombuffer(writable, dtype=np.uint8).ctypes.data
    assert wbase <= view.data_ptr() < wbase + len(writable)  # writable buffer: a view


def test_default_limits_reject_frames_just_above_them():
    with pytest.raises(BlobDecodeError, match="limit MAX_TENSORS"):
        omnilink.decode(frame([[0, F32, [0], 0, 0]] * (blob.MAX_TENSORS + 1), tree(None)))
    assert omnilink.decode(frame([[0, F32, [0], 0, 0]] * blob.MAX_TENSORS, tree(None))) is None
    with pytest.raises(BlobDecodeError, match="MAX_TREE_ITEMS"):
        omnilink.decode(frame([], tree([[]] * blob.MAX_TREE_ITEMS)))
