"""cuda_ipc manifests whose shapes overflow int64 (issue 31, defect B): an empty tensor
whose other dims are huge passes the byte-count check (0 == 0) and used to reach
``as_strided`` with strides past int64 (``TypeError``) or a numel torch cannot count
(``RuntimeError``). Runs over the CPU double of the device ops."""

from __future__ import annotations

import gc
import uuid

import pytest
import torch

from omnilink import BlobDecodeError
from omnilink.connectors.shm import ShmConnector
from tests.cuda_ipc_double import HostCudaIpc

def _m(entries, total=256):
    return [1, 1, 0, 0, total, entries]


@pytest.fixture
def rx_raw():
    ch = f"t/cipc-{uuid.uuid4().hex[:8]}"
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=4 << 20, event_slots=4) as rx:
        with ShmConnector(channel=f"{ch}/cuda-ipc", role="sender", arena_bytes=1 << 20, linger=0) as raw:
            yield rx, raw


@pytest.mark.parametrize("shape", [
    [2**40, 2**40, 0],          # strides 2**80: as_strided's TypeError before the fix
    [0, 2**40, 2**40],
    [2**20, 2**63 - 1, 0],      # numel overflow: torch's RuntimeError before the fix
    [0, 2**20, 2**63 - 1],
    [2**62, 0, 3],              # fits in elements, not in bytes (float32)
    [2**31, 2**31, 2, 0],       # 2**63 elements exactly
])
def test_an_empty_tensor_whose_other_dims_overflow_int64_is_refused(rx_raw, shape):
    rx, raw = rx_raw
    raw.put("bad", {"d": _m([[9, 0, 0, shape, ["x"]]]), "h": {"x": None}, "n": 1}, timeout=5)
    with pytest.raises(BlobDecodeError, match="overflows int64"):
        rx.get("bad", timeout=5)
    gc.collect()
    assert rx.stats().blocks_in_use == 0 and not rx._ops.waits


def test_a_bad_entry_after_a_good_one_is_refused_and_nothing_is_remembered(rx_raw):
    rx, raw = rx_raw
    entries = [[9, 0, 16, [4], ["x"]], [9, 64, 0, [0, 2**40, 2**40], ["y"]]]
    raw.put("bad", {"d": _m(entries), "h": {"x": None, "y": None}, "n": 1}, timeout=5)
    with pytest.raises(BlobDecodeError, match="tensor 1: shape"):
        rx.get("bad", timeout=5)
    assert rx._receiver.parsed is None  # a refused manifest is never the remembered one
    gc.collect()
    assert rx.stats().blocks_in_use == 0


def test_the_largest_empty_shapes_that_fit_are_views(rx_raw):
    # The bound is int64 bytes, not the pool: an empty tensor addresses no memory, and
    # one whose non-zero dims fit in int64 is a valid (empty) view.
    rx, _raw = rx_raw
    for shape in ([0, 2**30, 2**30], [2**60, 0], [0]):
        out = rx._receiver.parse("ok", _m([[9, 0, 0, shape, ["x"]]]))
        (_dt, _off, _n, got_shape, stride, _first, _path, hosted) = out[5][0]
        assert hosted is False
        assert got_shape == tuple(shape) and all(0 <= s <= (1 << 63) - 1 for s in stride)
        t = torch.empty(64, dtype=torch.float32).as_strided(got_shape, stride, 0)
        assert t.numel() == 0 and tuple(t.shape) == tuple(shape)


@pytest.mark.parametrize("mark", [0, 2, True, "1", None])
def test_a_host_mark_other_than_1_is_refused(rx_raw, mark):
    rx, raw = rx_raw
    raw.put("bad", {"d": _m([[9, 0, 16, [4], ["x"], mark]]), "h": {"x": None}, "n": 1}, timeout=5)
    with pytest.raises(BlobDecodeError, match="host mark"):
        rx.get("bad", timeout=5)
    gc.collect()
    assert rx.stats().blocks_in_use == 0


@pytest.mark.parametrize("mark", [0, 2, True, "1", None])
def test_an_all_in_block_mark_other_than_1_is_refused(rx_raw, mark):
    rx, raw = rx_raw
    raw.put("bad", {"d": _m([[9, 0, 16, [4], ["x"]]]) + [mark], "h": {"x": None}, "n": 1}, timeout=5)
    with pytest.raises(BlobDecodeError, match="all-in-block mark"):
        rx.get("bad", timeout=5)
    gc.collect()
    assert rx.stats().blocks_in_use == 0
