"""The decoder's plan cache: a descriptor list seen before skips re-validation, never a
check. Every test decodes writable buffers (the path the transports take)."""

from __future__ import annotations

import struct
import zlib

import msgspec
import numpy as np
import pytest
import torch

import omnilink
from omnilink import blob
from omnilink._errors import BlobDecodeError


def _writable(frame: bytes) -> bytearray:
    return bytearray(frame)


def _reframe(frame: bytes, header: bytes) -> bytearray:
    """``frame`` with its header replaced by ``header`` (CRC recomputed: only the
    decoder's own checks can catch what is wrong)."""
    _magic, _v, _f, hlen, _crc, dlen = struct.unpack_from("<4sHHIIQ", frame, 0)
    data = frame[len(frame) - dlen:]
    prefix = struct.pack("<4sHHIIQ", blob.MAGIC, blob.VERSION, 0, len(header), zlib.crc32(header), dlen)
    pad = (-(blob.PREFIX_SIZE + len(header))) % blob.FRAME_ALIGN
    return bytearray(prefix + header + bytes(pad) + data)


def _header(frame: bytes) -> bytes:
    hlen = struct.unpack_from("<I", frame, 8)[0]
    return bytes(frame[blob.PREFIX_SIZE: blob.PREFIX_SIZE + hlen])


def test_same_shapes_reuse_one_plan_and_stay_zero_copy():
    blob._PLANS.clear()
    for i in range(20):
        payload = {"h": torch.full((2, 8), float(i), dtype=torch.bfloat16), "ids": torch.arange(4) + i,
                   "a": np.full((3,), i, dtype=np.int32), "meta": {"i": i, "t": (i, "x")}}
        buf = _writable(omnilink.encode(payload))
        out = omnilink.decode(buf)
        start = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        assert start <= out["h"].data_ptr() < start + len(buf)  # a view, not a copy
        assert out["h"].shape == (2, 8) and float(out["h"][1, 7]) == float(i)
        assert out["ids"].tolist() == [i, i + 1, i + 2, i + 3] and out["a"].tolist() == [i] * 3
        assert out["meta"] == {"i": i, "t": (i, "x")}
    assert len(blob._PLANS) == 1


def test_a_bad_descriptor_is_caught_after_a_good_plan_exists():
    blob._PLANS.clear()
    frame = omnilink.encode({"x": torch.arange(8, dtype=torch.float32)})
    omnilink.decode(_writable(frame))  # the good plan is cached
    tensors, tree = msgspec.msgpack.decode(_header(frame))
    kind, dtype, shape, offset, nbytes = tensors[0]
    bad = msgspec.msgpack.encode([[[kind, dtype, shape, offset, nbytes * 2]], msgspec.Raw(msgspec.msgpack.encode(tree))])
    with pytest.raises(BlobDecodeError):
        omnilink.decode(_reframe(frame, bad))
    extra = msgspec.msgpack.encode([[[kind, dtype, shape, offset, nbytes]], msgspec.Raw(msgspec.msgpack.encode(tree)), 1])
    with pytest.raises(BlobDecodeError):
        omnilink.decode(_reframe(frame, extra))


def test_tree_checks_run_for_every_frame():
    blob._PLANS.clear()
    good = omnilink.encode({"x": torch.ones(2)})
    omnilink.decode(_writable(good))
    tensors, _tree = msgspec.msgpack.decode(_header(good))
    int_keys = msgspec.msgpack.encode([tensors, msgspec.Raw(msgspec.msgpack.encode({1: msgspec.msgpack.Ext(1, struct.pack("<I", 0))}))])
    with pytest.raises(BlobDecodeError, match="keys must be str"):
        omnilink.decode(_reframe(good, int_keys))
    dangling = msgspec.msgpack.encode([tensors, msgspec.Raw(msgspec.msgpack.encode({"x": msgspec.msgpack.Ext(1, struct.pack("<I", 5))}))])
    with pytest.raises(BlobDecodeError, match="references tensor 5"):
        omnilink.decode(_reframe(good, dangling))


def test_misaligned_writable_buffer_falls_back_to_a_copy():
    t = torch.arange(15).to(torch.complex128)
    frame = omnilink.encode({"a": t})
    omnilink.decode(_writable(frame))
    backing = bytearray(len(frame) + 8)
    view = memoryview(backing)[8:]  # 8 mod 16: misaligned for complex128
    view[:] = frame
    out = omnilink.decode(view)["a"]
    assert torch.equal(out, t) and out.data_ptr() % 16 == 0


def test_bool_data_is_checked_every_time():
    frame = bytearray(omnilink.encode({"b": torch.tensor([True, False, True])}))
    assert omnilink.decode(frame)["b"].tolist() == [True, False, True]
    frame[-3] = 7  # a byte other than 0 / 1 in the bool region
    with pytest.raises(BlobDecodeError, match="bool"):
        omnilink.decode(frame)


@pytest.mark.parametrize("n", [3, 10_000])  # small: bytes check; large: numpy check
def test_planned_bool_is_a_zero_copy_view_and_checked_on_every_frame(n):
    blob._PLANS.clear()
    payload = {"h": torch.ones(4, dtype=torch.bfloat16), "meta": {"finished": torch.tensor(True)},
               "mask": torch.arange(n) % 2 == 0}
    for _ in range(3):  # the first frame makes the plan, the next ones use it
        frame = bytearray(omnilink.encode(payload))
        out = omnilink.decode(frame)
        start = np.frombuffer(frame, dtype=np.uint8).ctypes.data
        assert start <= out["mask"].data_ptr() < start + len(frame)  # a view, not a copy
        assert torch.equal(out["mask"], payload["mask"]) and out["meta"]["finished"].item() is True
        assert out["meta"]["finished"].shape == ()
        del out
    assert len(blob._PLANS) == 1 and next(iter(blob._PLANS.values())) is not None
    # A byte other than 0 / 1 anywhere in the mask, on a frame whose plan is cached.
    out = omnilink.decode(frame)
    at = out["mask"].data_ptr() - np.frombuffer(frame, dtype=np.uint8).ctypes.data
    del out
    frame[at + n - 1] = 2
    with pytest.raises(BlobDecodeError, match="bool"):
        omnilink.decode(frame)


def test_planned_empty_tensors_keep_shape_and_dtype():
    blob._PLANS.clear()
    payload = {"ids": torch.zeros(0, dtype=torch.int64), "grid": torch.empty(3, 0, 2, dtype=torch.bfloat16),
               "h": torch.arange(6, dtype=torch.float32)}
    for _ in range(3):
        out = omnilink.decode(bytearray(omnilink.encode(payload)))
        assert out["ids"].shape == (0,) and out["ids"].dtype == torch.int64
        assert out["grid"].shape == (3, 0, 2) and out["grid"].dtype == torch.bfloat16
        assert torch.equal(out["h"], payload["h"])
    assert len(blob._PLANS) == 1 and next(iter(blob._PLANS.values())) is not None


@pytest.mark.parametrize("make", [
    lambda: torch.arange(12, dtype=torch.float32).view(3, 4),
    lambda: torch.arange(12, dtype=torch.float32).view(3, 4).t(),  # non-contiguous
    lambda: torch.ones(3, requires_grad=True),
    lambda: torch.tensor([1 + 2j, 3 - 1j]).conj(),
    lambda: torch.arange(4.0)._neg_view(),
    lambda: torch.empty(0, 5, dtype=torch.bfloat16),
    lambda: torch.tensor(7, dtype=torch.int16),
])
def test_encoder_fast_tensor_path_writes_the_frame_the_general_walk_writes(make):
    t = make()
    payload = {"a": t, "b": [t, {"c": t}], "d": torch.arange(3)}
    walker = blob._Walker()
    tree = walker.walk(payload)  # the general (path-tracking) walk
    header = blob._ENCODER.encode((walker.descs, tree))
    general = blob.PreparedBlob(header, walker.descs, walker.sources).to_bytes()
    assert omnilink.encode(payload) == general
    out = omnilink.decode(bytearray(general))
    assert torch.equal(out["a"], t.detach().resolve_conj().resolve_neg()) and out["b"][0] is out["b"][1]["c"]


def test_a_repeated_head_is_decoded_from_the_cache_and_any_changed_byte_is_validated_again():
    blob._HEADS.clear()
    payload = {"h": torch.arange(8, dtype=torch.float32), "meta": {"k": "ab"}, "n": [1, 2]}
    frame = omnilink.encode(payload)
    first = omnilink.decode(_writable(frame))
    head = bytes(frame[: blob.PREFIX_SIZE + struct.unpack_from("<I", frame, 8)[0]])
    assert head in blob._HEADS  # cached under its whole head, prefix included
    again = omnilink.decode(_writable(frame))  # a hit: fresh objects, same values
    assert again is not first and again["meta"] is not first["meta"] and again == {**first, "h": again["h"]}
    assert torch.equal(again["h"], payload["h"])
    # The same header with one tree byte changed (a str key turned into an int key of
    # the same encoded length) misses the cache and is rejected by the full checks.
    tensors, tree = msgspec.msgpack.decode(_header(frame))
    bad_tree = msgspec.msgpack.encode({"h": msgspec.msgpack.Ext(1, struct.pack("<I", 0)), "meta": {7: "ab"}, "n": [1, 2]})
    with pytest.raises(BlobDecodeError, match="keys must be str"):
        omnilink.decode(_reframe(frame, msgspec.msgpack.encode([tensors, msgspec.Raw(bad_tree)])))
    # A dangling reference in an otherwise cached-looking frame is caught as well.
    dangling = msgspec.msgpack.encode({"h": msgspec.msgpack.Ext(1, struct.pack("<I", 3)), "meta": {"k": "ab"}, "n": [1, 2]})
    with pytest.raises(BlobDecodeError, match="references tensor 3"):
        omnilink.decode(_reframe(frame, msgspec.msgpack.encode([tensors, msgspec.Raw(dangling)])))
    # A corrupted CRC on a cached head's bytes is a different head: rejected.
    corrupt = bytearray(frame)
    corrupt[12] ^= 1
    with pytest.raises(BlobDecodeError, match="checksum"):
        omnilink.decode(corrupt)


def test_heads_that_change_every_frame_stop_being_cached():
    blob._HEADS.clear()
    blob._HEAD_MISSES.clear()
    for i in range(3 * blob._HEADS_LEARN):
        out = omnilink.decode(_writable(omnilink.encode({"x": torch.ones(4), "t": i})))
        assert out["t"] == i and out["x"].tolist() == [1.0] * 4
    assert len(blob._HEADS) <= blob._HEADS_LEARN


def _land_on_fake_device(frame: bytearray):
    """``_decode_fast`` with ``_device_views``, the "device" being a separate CPU
    buffer that ``fetch`` fills with the requested bytes: what the shm backend's GPU
    get does with one cudaMemcpyAsync. Returns (payload, fetch calls, device buffers)."""
    calls: list[tuple[int, int]] = []
    bufs: list[torch.Tensor] = []

    def fetch(start: int, n: int) -> torch.Tensor:
        # as submit_frame's: n bytes copied into a buffer rounded up to 64 bytes
        calls.append((start, n))
        d = torch.frombuffer(bytearray(frame[start:start + n]) + bytes(-n % 64), dtype=torch.uint8)
        bufs.append(d)
        return d

    def empty(shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def views(buf, plan, base):
        return blob._device_views(buf, plan, base, fetch, empty)

    raw = memoryview(frame)
    return blob._decode_fast(raw, len(frame), views), calls, bufs


@pytest.mark.parametrize("repeat", [1, 3])  # learn path, then the cached head
def test_device_views_land_every_tensor_from_one_copy_of_the_data_region(repeat):
    blob._HEADS.clear()
    payload = {
        "h": torch.arange(24, dtype=torch.float32).to(torch.bfloat16).reshape(2, 3, 4),
        "ids": torch.arange(5, dtype=torch.int64),
        "s": torch.tensor(2.5, dtype=torch.float64),
        "mask": torch.tensor([[True, False, True], [False, False, True]]),
        "none": torch.zeros(0, 4),
        "meta": {"k": [1, "x"], "t": (torch.ones(2, dtype=torch.int32), 3)},
    }
    frame = bytearray(omnilink.encode(payload))
    for _ in range(repeat):
        out, calls, bufs = _land_on_fake_device(frame)
    _magic, _v, _f, hlen, _crc, dlen = struct.unpack_from("<4sHHIIQ", frame, 0)
    # one fetch: exactly the data region, from its start to the end of the last tensor
    assert calls == [(len(frame) - dlen, dlen)]
    (d,) = bufs
    lo, hi = d.data_ptr(), d.data_ptr() + d.numel()
    tensors = [out["h"], out["ids"], out["s"], out["mask"], out["meta"]["t"][0]]
    for got, want in zip(tensors, [payload["h"], payload["ids"], payload["s"], payload["mask"], payload["meta"]["t"][0]]):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        assert lo <= got.data_ptr() < hi  # a view of the one landed buffer, not a copy
    assert out["none"].shape == (0, 4) and out["none"].dtype == torch.float32
    assert out["meta"]["k"] == [1, "x"] and out["meta"]["t"][1] == 3 and type(out["meta"]["t"]) is tuple


def test_device_views_leave_numpy_and_bad_bool_frames_to_the_general_path_before_any_copy():
    frame = bytearray(omnilink.encode({"a": np.arange(4), "t": torch.ones(3)}))
    out, calls, _ = _land_on_fake_device(frame)
    assert out is blob._MISS and calls == []
    good = bytearray(omnilink.encode({"b": torch.tensor([True, False, True]), "x": torch.ones(2)}))
    _land_on_fake_device(good)  # the plan is known now
    *_, dlen = struct.unpack_from("<4sHHIIQ", good, 0)
    bad = bytearray(good)
    bad[len(bad) - dlen] = 7  # a bool byte that is neither 0 nor 1
    out, calls, _ = _land_on_fake_device(bad)
    assert out is blob._MISS and calls == []
    with pytest.raises(BlobDecodeError):
        omnilink.decode(bad)  # the general path names it
