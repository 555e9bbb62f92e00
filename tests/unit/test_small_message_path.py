"""The per-message fast paths (issue 15): each shortcut gives the same result as the
general path it skips, and the adaptive spin of a waiting ``get`` stays in its bounds."""

from __future__ import annotations

import ctypes
import os
import time

import msgspec
import numpy as np
import pytest
import torch

import omnilink
from omnilink import blob
from omnilink._errors import BlobEncodeError, ConfigurationError
from omnilink._util import NO_WAIT, Deadline
from omnilink.connectors.shm.connector import SPIN_GROWTH


def _chan(name: str) -> str:
    return f"unit/{name}-{os.getpid()}"


def _payload(i: int = 0, rows: int = 1) -> dict:
    return {
        "hidden": torch.arange(rows * 2048, dtype=torch.float32).to(torch.bfloat16).view(rows, 2048) + i,
        "ids": torch.arange(16, dtype=torch.int64) + i,
        "shape": [rows, 2048],
        "meta": {"finished": False, "sent_ns": i},
        "speaker": "Ethan",
        "pair": (1, "x"),
        "scalar": torch.tensor(3.5),
        "arr": np.arange(5, dtype=np.int32),
    }


@pytest.mark.parametrize("start", [0, 64, 4096])
def test_write_at_writes_the_bytes_write_into_writes(start):
    prep = blob.prepare(_payload(3))
    expected = bytearray(prep.nbytes)
    prep.write_into(expected)
    buf = bytearray(b"\xee" * (start + prep.nbytes + 64))
    view = memoryview(buf)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert prep.write_at(view, start, addr) == prep.nbytes
    assert buf[start : start + prep.nbytes] == expected
    assert buf[:start] == b"\xee" * start and buf[start + prep.nbytes :] == b"\xee" * 64  # nothing outside
    out = blob.decode(np.frombuffer(buf, dtype=np.uint8)[start:])
    assert torch.equal(out["hidden"], _payload(3)["hidden"]) and out["pair"] == (1, "x")
    del view


def test_write_at_refuses_what_does_not_fit_or_is_read_only():
    prep = blob.prepare(_payload())
    buf = bytearray(prep.nbytes + 10)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    with pytest.raises(BlobEncodeError):
        prep.write_at(memoryview(buf), 11, addr)
    with pytest.raises(BlobEncodeError):
        prep.write_at(memoryview(buf), -1, addr)
    with pytest.raises(BlobEncodeError):
        prep.write_at(memoryview(bytes(prep.nbytes)), 0, addr)


def test_cached_descriptors_follow_shape_dtype_and_position():
    # The same (dtype, shape, offset) reuses a descriptor; anything else gets its own.
    frames = []
    for rows, dtype in ((1, torch.bfloat16), (2, torch.bfloat16), (1, torch.float16), (1, torch.bfloat16)):
        t = torch.ones(rows, 2048, dtype=dtype)
        frames.append(blob.encode({"a": torch.zeros(3, dtype=torch.int64), "t": t}))
        out = blob.decode(bytearray(frames[-1]))
        assert out["t"].shape == (rows, 2048) and out["t"].dtype == dtype and torch.equal(out["t"], t)
    assert frames[0] == frames[3]
    # A tensor whose shape changed in place is described by its shape now.
    t = torch.zeros(4, 2048, dtype=torch.bfloat16)
    blob.encode({"t": t})
    t.resize_(2, 2048)
    assert blob.decode(bytearray(blob.encode({"t": t})))["t"].shape == (2, 2048)


def test_device_bytes_is_zero_for_host_payloads_without_a_scan():
    prep = blob.prepare(_payload())
    assert prep.device_bytes() == 0 and prep._on_device is False
    meta = torch.empty(4, device="meta")
    with pytest.raises(BlobEncodeError, match="meta tensors"):
        blob.prepare({"m": meta})


def test_zero_dim_and_one_dim_tensors_keep_their_shapes_through_the_plan():
    payload = {"s": torch.tensor(2.5, dtype=torch.float64), "v": torch.arange(7), "m": torch.ones(2, 3, 4)}
    frame = blob.encode(payload)
    for _ in range(3):  # the second decode onwards takes the cached plan
        out = blob.decode(bytearray(frame))
        assert out["s"].shape == () and out["s"].item() == 2.5
        assert out["v"].shape == (7,) and out["m"].shape == (2, 3, 4)


def test_tree_check_still_rejects_a_non_str_key_at_any_depth():
    def tree(obj):
        return blob._resolve(blob._PLAIN_DECODER.decode(blob._ENCODER.encode(obj)), [], None)

    with pytest.raises(omnilink.BlobDecodeError, match="dict key 1"):
        tree({"a": [{"b": {1: 2}}]})
    with pytest.raises(omnilink.BlobDecodeError, match="dict key"):
        tree([msgspec.msgpack.Ext(2, blob._ENCODER.encode([1, {b"k": 1}]))])
    assert tree({"a": [{"b": {"c": msgspec.msgpack.Ext(2, blob._ENCODER.encode([1, [2]]))}}]}) == {
        "a": [{"b": {"c": (1, [2])}}]}


def test_shared_deadlines():
    assert NO_WAIT.remaining() == 0 and NO_WAIT.expired()
    assert Deadline.after(None) is Deadline.after(None) and Deadline.after(None).remaining() is None
    d = Deadline.after(5.0)
    assert d.timeout == 5.0 and 4.0 < d.remaining() <= 5.0
    with pytest.raises(ConfigurationError):
        Deadline(-1.0)


def test_shm_fast_path_counts_and_keeps_zero_copy():
    ch = _chan("fastpath")
    with omnilink.connect("shm", channel=ch, role="dual", arena_bytes=2 << 20, max_bytes=2 << 20) as c:
        for i in range(50):
            c.put(f"k{i}", _payload(i))
            got = c.get_nowait(f"k{i}") if i % 2 else c.get(f"k{i}", timeout=5)
            assert torch.equal(got["hidden"], _payload(i)["hidden"]) and got["pair"] == (1, "x")
            assert c.mapping_of(got["hidden"].data_ptr()) is not None  # a view of the arena
            del got
        st = c.stats()
        assert (st.puts, st.gets) == (50, 50) and st.bytes_put == st.bytes_got > 0
        assert c.held() == []  # every view is gone, so every block went back


def test_adaptive_spin_grows_for_near_misses_and_falls_back_for_late_arrivals():
    ch = _chan("spin")
    with omnilink.connect("shm", channel=ch, role="dual", spin_us=100) as c:
        lo, hi = 100_000, 100_000 * SPIN_GROWTH
        assert c._spin_ns == lo
        for _ in range(20):  # payloads keep arriving ~300 us into the wait
            c._adapt_spin(300_000)
        assert lo < c._spin_ns <= hi and c._spin_ns >= 500_000
        for _ in range(20):  # then they come much later than the ceiling
            c._adapt_spin(50_000_000)
        assert c._spin_ns == lo
        for _ in range(20):  # or right away: no reason to spin longer than spin_us
            c._adapt_spin(1_000)
        assert c._spin_ns == lo
    with omnilink.connect("shm", channel=ch + "0", role="dual", spin_us=0) as c:
        t0 = time.monotonic()
        with pytest.raises(omnilink.TransferTimeout):
            c.get("nothing", timeout=0.05)
        assert c._spin_ns == 0 and time.monotonic() - t0 < 5


@pytest.mark.parametrize("keep", ["hidden", "ids", "arr"])
def test_any_one_view_of_a_received_payload_holds_its_block(keep):
    # Views are made through a memoryview of the per-message lease: whichever view
    # survives (torch 2-D, torch 1-D, numpy), the block stays out until it dies.
    ch = _chan(f"hold-{keep}")
    with omnilink.connect("shm", channel=ch, role="dual", arena_bytes=2 << 20, max_bytes=2 << 20) as c:
        for i in range(3):  # the second and third frames take the cached head
            c.put(f"k{i}", _payload(i))
            view = c.get_nowait(f"k{i}")[keep]
            import gc

            gc.collect()
            assert c.stats().blocks_in_use >= 1 and len(c.held()) == 1
            expected = _payload(i)[keep]
            assert (torch.equal(view, expected) if isinstance(view, torch.Tensor)
                    else np.array_equal(view, expected))
            del view
            gc.collect()
            assert c.held() == []
