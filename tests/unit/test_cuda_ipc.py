"""The ``cuda_ipc`` backend's control plane on the CPU, over its host-memory test double
(``tests.cuda_ipc_double``): allocator, released ring, zero-copy views, frees and
backpressure, event slots, hostile manifests, the key contract, one receiver and one
sender per channel, and the faults of either side (in-process and with SIGKILL)."""

from __future__ import annotations

import gc
import os
import signal
import time
import uuid

import numpy as np
import pytest
import torch

import omnilink
from omnilink import (
    BlobDecodeError,
    CapacityError,
    ConfigurationError,
    CudaError,
    DuplicateKeyError,
    KeyConsumedError,
    PeerLostError,
    TransferTimeout,
)
from omnilink.connectors import backend_unavailable
from omnilink.connectors.devpool.blocks import BlockAllocator
from omnilink.connectors.devpool.directory import find_directories
from omnilink.connectors.shm import ShmConnector, collect_garbage, read_prefix, unlink_segment
from tests.cuda_ipc_double import HostCudaIpc, HostDeviceOps, host_pair
from tests.procs import start_process, wait_file


def _chan() -> str:
    return f"t/cipc-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def pair():
    with host_pair(_chan()) as tx_rx:
        yield tx_rx


def _pool_range(rx) -> tuple[int, int]:
    return rx._receiver.pool.ptr, rx._receiver.pool.ptr + rx._receiver.pool.nbytes


# ---------------------------------------------------------------- allocator, ring
def test_allocator_first_fit_reserve_and_coalesce():
    a = BlockAllocator(4096)
    x, y, z = a.alloc(1), a.alloc(300), a.alloc(256)
    assert (x, y, z) == (0, 256, 768)  # 256-aligned, rounded up
    assert a.alloc(4096) is None
    a.free(y)
    assert a.alloc(512) == 256  # first fit into the hole
    a.free(256)
    a.free(x)
    a.free(z)
    assert a.alloc(4096) == 0 and a.blocks == 1  # fully coalesced
    a.free(0)
    assert a.reserve(1024, 100) and not a.reserve(1024, 1) and not a.reserve(1000, 10)
    assert a.alloc(1024) == 0 and a.alloc(2048) == 1280
    with pytest.raises(KeyError):
        a.free(512)


def test_released_ring_round_trip_and_bound(pair):
    tx, rx = pair
    d = rx._receiver.pool.dir
    assert d.drain_frees() == []
    for i in range(d.ring_cap):
        assert d.push_free(i * 256, 256)
    assert not d.push_free(0, 256)  # full: never overwrites an undrained entry
    got = d.drain_frees()
    assert got == [(i * 256, 256) for i in range(d.ring_cap)] and d.drain_frees() == []


# -------------------------------------------------------------- the data path
def test_round_trip_zero_copy_views_and_free_on_last_view(pair):
    tx, rx = pair
    g = torch.Generator().manual_seed(3)
    payload = {"h": torch.randn(64, 33, generator=g).to(torch.bfloat16), "ids": torch.arange(7),
               "strided": torch.randn(8, 5, generator=g).t(), "meta": {"done": True, "n": [1, 2]},
               "empty": torch.empty(0, 4), "scalar": torch.tensor(2.5)}
    n = tx.put("k", payload, timeout=5)
    assert n == omnilink.encoded_size(payload)
    got = rx.get("k", timeout=5)
    lo, hi = _pool_range(rx)
    for name in ("h", "ids", "strided", "scalar"):
        assert torch.equal(got[name], payload[name]) and got[name].dtype == payload[name].dtype
        assert lo <= got[name].data_ptr() < hi, f"{name} is not a view of the pool"
        assert got[name].data_ptr() % 256 == 0
    assert got["meta"] == {"done": True, "n": [1, 2]} and got["empty"].shape == (0, 4)
    assert rx.stats().device_gets == 1 and tx.stats().device_puts == 1 and rx.stats().bytes_got == n
    keep = got["h"][3:5]  # a user slice keeps the block
    del got
    assert rx.stats().blocks_in_use == 1
    del keep
    assert rx.stats().blocks_in_use == 0
    tx.put("k2", {"x": torch.ones(3)}, timeout=5)  # the sender drains the free on its next put
    assert tx.stats().blocks_in_use == 1


def test_source_overwritten_after_put_arrives_intact(pair):
    tx, rx = pair
    src = torch.arange(1000, dtype=torch.int32)
    tx.put("k", {"x": src}, timeout=5)
    src.fill_(-1)
    assert torch.equal(rx.get("k", timeout=5)["x"], torch.arange(1000, dtype=torch.int32))


def test_a_sender_far_ahead_looks_at_a_few_slots_not_all(monkeypatch):
    from omnilink.connectors.devpool import sender as pool_sender
    from omnilink.connectors.devpool.directory import Directory

    ch = _chan()
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=4 << 20, event_slots=64) as rx, \
            HostCudaIpc(channel=ch, role="sender", linger=0) as tx:
        for i in range(64):  # every slot recorded, none waited on yet
            tx.put(f"k{i}", {"x": torch.full((2,), i)}, timeout=5)
        looked: list[int] = []
        real = Directory.done_seq
        monkeypatch.setattr(Directory, "done_seq", lambda self, i: looked.append(i) or real(self, i))
        tx.put("k64", {"x": torch.full((2,), 64)}, timeout=5)
        assert 0 < len(looked) <= pool_sender.SLOT_SCAN
        assert rx._receiver.pool.dir.rec_seq(0) == 65  # the next in turn (the oldest record) again
        monkeypatch.setattr(Directory, "done_seq", real)
        for i in range(65):
            assert torch.equal(rx.get(f"k{i}", timeout=5)["x"], torch.full((2,), i))


def test_receiver_waits_on_the_slot_event_and_marks_it_done(pair):
    tx, rx = pair
    for i in range(3):
        tx.put(f"k{i}", {"x": torch.full((4,), i)}, timeout=5)
    d = rx._receiver.pool.dir
    assert [d.rec_seq(s) for s in range(4)] == [1, 2, 3, 0]
    got = rx.get("k1", timeout=5)
    ops: HostDeviceOps = rx._ops
    assert ops.waits[-1].name == tx._sender.tx.events[1].name  # the wait is on k1's slot's event
    assert d.done_seq(1) == 2 and d.done_seq(0) == 0
    # slots free again are preferred: slot 1 is reused before 0 and 2 are recorded again
    tx.put("k3", {"x": torch.zeros(1)}, timeout=5)
    tx.put("k4", {"x": torch.zeros(1)}, timeout=5)
    assert [d.rec_seq(s) for s in range(4)] == [1, 5, 3, 4]
    # more unread payloads than slots: the next one in turn is recorded again, correct
    # (one copy stream) and nothing blocks
    tx.put("k5", {"x": torch.full((2,), 5)}, timeout=5)
    assert sum(d.rec_seq(s) == 6 for s in range(4)) == 1
    del got
    for k in ("k0", "k2", "k3", "k4", "k5"):
        rx.get(k, timeout=5)


def test_pool_full_is_backpressure_then_capacity_error():
    ch = _chan()
    # a pool that may not grow: a full pool is backpressure, a payload larger than it a
    # CapacityError naming the sizes and the option to raise
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=4 << 20, pool_max_bytes=4 << 20) as rx, \
            HostCudaIpc(channel=ch, role="sender", linger=0) as tx:
        _backpressure_then_capacity_error(tx, rx)


def _backpressure_then_capacity_error(tx, rx):
    blob = torch.zeros(3 << 20, dtype=torch.uint8)
    tx.put("a", {"x": blob}, timeout=5)
    with pytest.raises(TransferTimeout, match="pool is full"):
        tx.put("b", {"x": blob}, timeout=0.2)
    got = rx.get("a", timeout=5)
    del got
    tx.put("b", {"x": blob}, timeout=5)  # the free came back through the ring
    with pytest.raises(CapacityError, match="pool_max_bytes"):
        tx.put("huge", {"x": torch.zeros(5 << 20, dtype=torch.uint8)}, timeout=1)
    rx.get("b", timeout=5)


def test_key_contract_discard_and_release_free_pool_blocks(pair):
    tx, rx = pair
    tx.put("dup", {"x": torch.ones(8)}, timeout=5)
    with pytest.raises(DuplicateKeyError):
        tx.put("dup", {"x": torch.ones(8)}, timeout=5)
    assert tx.stats().blocks_in_use == 1  # the refused put gave its block back
    assert rx.discard("dup") is True and rx.discard("dup") is False
    with pytest.raises(KeyConsumedError):
        rx.get("dup", timeout=1)
    assert rx.stats().blocks_in_use == 0
    tx.put("rel", {"x": torch.ones(8)}, timeout=5)
    got = rx.get("rel", timeout=5)
    assert rx.release("rel") is True and rx.stats().blocks_in_use == 0
    del got
    tx.put("z", {"x": torch.ones(2)}, timeout=5)
    assert tx.stats().blocks_in_use == 1
    rx.get("z", timeout=5)


def test_sender_side_discard_frees_its_block(pair):
    tx, rx = pair
    tx.put("gone", {"x": torch.ones(8)}, timeout=5)
    assert tx.discard("gone") is True
    assert tx.stats().blocks_in_use == 0


def test_host_only_payloads_take_the_shm_path(pair):
    tx, rx = pair
    assert tx.put("m", {"a": 1, "b": "two"}, timeout=5) == omnilink.encoded_size({"a": 1, "b": "two"})
    assert rx.get("m", timeout=5) == {"a": 1, "b": "two"}
    assert tx.stats().device_puts == 0


# ---------------------------------------------------------------- hostile input
def _raw_sender(rx):
    return ShmConnector(channel=f"{rx.channel}/cuda-ipc", role="sender", arena_bytes=1 << 20, linger=0)


def _m(gen, seq, slot, block, total, entries):
    """A manifest as the sender writes it: [gen, seq, slot, block, size, tensors], each
    tensor [dtype code, offset, nbytes, shape, path]."""
    return [gen, seq, slot, block, total, entries]


_X = [9, 0, 16, [4], ["x"]]  # a float32 tensor of 4 at the payload's "x"
_GOOD = _m(1, 1, 0, 0, 256, [_X])


@pytest.mark.parametrize("manifest,host", [
    ("not a list", {"x": None}),
    ([1, 1, 0, 0, 256], {"x": None}),                                 # 5 fields
    ([1, 1, 0, 0, 256, [_X], 0], {"x": None}),                        # 7 fields
    ((1, 1, 0, 0, 256, [_X]), {"x": None}),                           # a tuple, not a list
    (_m(1, 1, 0, 0, 256.0, [_X]), {"x": None}),                       # a float size
    (_m(1, 1, 99, 0, 256, [_X]), {"x": None}),                        # slot out of range
    (_m(1, 1, 0, 4 << 20, 256, [_X]), {"x": None}),                   # block outside the pool
    (_m(1, 1, 0, 100, 256, [_X]), {"x": None}),                       # block misaligned
    (_m(1, 1, 0, 1 << 48, 256, [_X]), {"x": None}),                   # segment 1: not live
    (_m(1, 1, 0, 16 << 48, 256, [_X]), {"x": None}),                  # segment past the table
    (_m(1, 1, 0, (1 << 15) - 1 << 48, 256, [_X]), {"x": None}),       # the highest segment bits
    (_m(1, 1, 0, (4 << 20) - 256, 512, [_X]), {"x": None}),           # runs past segment 0
    (_m(1, 1, 0, 1 << 47, 256, [_X]), {"x": None}),                   # offset past segment 0
    (_m(1, 1, 0, 0, -256, [_X]), {"x": None}),                        # negative size
    (_m(1, 1, 0, 0, 257, [_X]), {"x": None}),                         # size not a multiple of ALIGN
    (_m(0, 1, 0, 0, 256, [_X]), {"x": None}),                         # generation 0
    (_m(1, 1, 0, 0, 256, [[9, 0, 12, [4], ["x"]]]), {"x": None}),     # nbytes != numel*itemsize
    (_m(1, 1, 0, 0, 256, [[9, 248, 16, [4], ["x"]]]), {"x": None}),   # region past the block
    (_m(1, 1, 0, 0, 256, [[99, 0, 16, [4], ["x"]]]), {"x": None}),    # unknown dtype
    (_m(1, 1, 0, 0, 256, [_X, _X]), {"x": None}),                     # two tensors, one place
    (_m(1, 1, 0, 0, 256, [[9, 2, 16, [4], ["x"]]]), {"x": None}),     # misaligned for the dtype
    (_m(1, 1, 0, 0, 256, [[9, 0, 16, [True], ["x"]]]), {"x": None}),  # bool is not a dim
    (_m(1, 1, 0, 0, 256, [[9, 0, 4, [1] * 65, ["x"]]]), {"x": None}), # too many dims
    (_m(1, 1, 0, 0, 256, [[9, 0, 16, 4, ["x"]]]), {"x": None}),       # shape not a list
    (_m(1, 1, 0, 0, 256, [[9, 0, 16, [4], ["y"]]]), {"x": None}),     # path to no key
    (_m(1, 1, 0, 0, 256, [[9, 0, 16, [4], ["x", 0]]]), {"x": None}),  # path through a None
    (_m(1, 1, 0, 0, 256, [[9, 0, 16, [4], [0]]]), {"x": None}),       # index into a dict
    (_m(1, 1, 0, 0, 256, [[9, 0, 16, [4], ["x", 3]]]), {"x": [None]}),  # index out of range
    (_m(1, 1, 0, 0, 256, [[9, 0, 16, [4], ["x", -1]]]), {"x": [None]}), # negative index
    (_m(1, 1, 0, 0, 256, [[9, 0, 16, [4], [1.5]]]), {"x": None}),     # a float step
    (_m(1, 1, 0, 0, 256, [[9, 0, 16, [4], ["x"] * 65]]), {"x": None}),  # path too deep
    (_m(1, 1, 0, 0, 256, [_X]), {"x": torch.ones(4)}),                # the place is taken
    (_m(1, 1, 0, 0, 256, [_X]), {"x": 0}),                            # the place is not None
    (_m(1, 1, 0, 0, 256, [[9, 0, 16, [4], []]]), {"x": None}),        # the payload is no place
    (_m(1, 1, 0, 0, 256, [[9, 0, 16, [4], []], [9, 64, 16, [4], []]]), None),  # two at the root
    (_m(1, 1, 0, 0, 256, [[9, 0, 16, [4], ["x"]], [9, 64, 16, [4], ["x", 0]]]), {"x": None}),  # nested
    (_m(1, 1, 0, 0, 256, [[9, 0, 16, [4], ["x"], 0]]), {"x": None}),  # six fields in a tensor
    (_m(1, 1, 0, 0, 256, []), {"x": None}),
])
def test_hostile_manifests_are_refused_before_use(manifest, host):
    ch = _chan()
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=4 << 20, event_slots=4) as rx:
        with _raw_sender(rx) as raw:
            raw.put("bad", {"d": manifest, "h": host, "n": 1}, timeout=5)
            with pytest.raises(BlobDecodeError, match="cuda_ipc"):
                rx.get("bad", timeout=5)
            raw.put("bad2", {"d": None, "h": 1}, timeout=5)  # missing size field
            with pytest.raises(BlobDecodeError):
                rx.get("bad2", timeout=5)
            raw.put("bad3", {"m": _GOOD, "h": {"x": None}, "n": 1}, timeout=5)  # the old key
            with pytest.raises(BlobDecodeError):
                rx.get("bad3", timeout=5)
            gc.collect()
            assert rx.stats().blocks_in_use == 0 and not rx._ops.waits


def test_repeated_tensor_entries_are_checked_against_each_block():
    # _parse remembers the tensors of the last valid manifest; one that repeats them
    # is still checked against its own block.
    ch = _chan()
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=4 << 20, event_slots=4) as rx:
        with _raw_sender(rx) as raw:
            x = [9, 0, 512, [128], ["x"]]
            raw.put("k", {"d": _m(1, 1, 0, 0, 512, [x]), "h": {"x": None}, "n": 1}, timeout=5)
            with pytest.raises(PeerLostError):  # parsed and remembered; no such sender
                rx.get("k", timeout=5)
            assert rx._receiver.parsed is not None and rx._receiver.parsed[1] == 512
            raw.put("bad", {"d": _m(1, 2, 0, 0, 256, [x]), "h": {"x": None}, "n": 1}, timeout=5)
            with pytest.raises(BlobDecodeError, match="past the block"):
                rx.get("bad", timeout=5)
            # Floats equal to the remembered ints compare equal: the checked ints are used.
            again = rx._receiver.parse("k2", _m(1, 3, 0, 0, 512, [[9.0, 0, 512.0, [128.0], ["x"]]]))
            assert again[5] is rx._receiver.parsed[2]
            dt, off, nbytes, shape, _stride, _first, path, _hosted = again[5][0]
            assert type(off) is int and type(nbytes) is int and all(type(s) is int for s in shape)
            assert path == ("x",)
            gc.collect()
            assert rx.stats().blocks_in_use == 0


def test_a_few_layouts_in_turn_are_each_parsed_once_and_checked_against_each_block():
    from omnilink.connectors.devpool import receiver as pool_receiver

    ch = _chan()
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=4 << 20, event_slots=4) as rx:
        r = rx._receiver
        r._open()
        layouts = [[[9, 0, 512, [128], ["x"]]], [[9, 0, 1024, [256], ["x"]]], [[5, 0, 64, [16], ["y"]]]]
        first = [r.parse(f"a{i}", _m(1, 1 + i, 0, 0, 1024, e))[5] for i, e in enumerate(layouts)]
        for i in range(6):  # in turn, as a sender's plans send them: the remembered copies
            got = r.parse(f"b{i}", _m(1, 10 + i, 0, 0, 1024, layouts[i % 3]))[5]
            assert got is first[i % 3] and r.parsed[2] is got
        with pytest.raises(BlobDecodeError, match="past the block"):  # still checked against its block
            r.parse("short", _m(1, 20, 0, 0, 512, layouts[1]))
        for i in range(pool_receiver.PARSED_KEPT + 1):  # more layouts than kept: the oldest goes
            r.parse(f"c{i}", _m(1, 30 + i, 0, 0, 1024, [[9, 0, 16 * (i + 1), [4 * (i + 1)], ["z"]]]))
        assert len(r._recent) == pool_receiver.PARSED_KEPT
        assert r.parse("d", _m(1, 40, 0, 0, 1024, layouts[0]))[5] is not first[0]  # parsed again


def test_a_payload_that_is_one_tensor_and_tensors_inside_tuples_come_back_whole(pair):
    tx, rx = pair
    t = torch.arange(10, dtype=torch.float32)
    tx.put("one", t, timeout=5)
    got = rx.get("one", timeout=5)
    assert torch.equal(got, t) and got.data_ptr() >= rx._receiver.pool.ptr
    payload = {"a": (torch.ones(3), "s", [1, (torch.arange(4), None)]), "b": [torch.zeros(2), {"c": torch.ones(1)}]}
    tx.put("tup", payload, timeout=5)
    got = rx.get("tup", timeout=5)
    assert type(got["a"]) is tuple and type(got["a"][2][1]) is tuple
    assert torch.equal(got["a"][0], torch.ones(3)) and got["a"][1] == "s" and got["a"][2][0] == 1
    assert torch.equal(got["a"][2][1][0], torch.arange(4)) and got["a"][2][1][1] is None
    assert torch.equal(got["b"][0], torch.zeros(2)) and torch.equal(got["b"][1]["c"], torch.ones(1))
    base, end = rx._receiver.pool.ptr, rx._receiver.pool.ptr + rx._receiver.pool.nbytes
    assert all(base <= v.data_ptr() < end for v in (got["a"][0], got["a"][2][1][0], got["b"][0], got["b"][1]["c"]))


def test_views_of_several_dtypes_and_shapes_are_the_tensors_sent(pair):
    tx, rx = pair
    payload = {"a": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4), "b": torch.arange(5, dtype=torch.int64),
               "c": [torch.ones(3, dtype=torch.bfloat16), torch.zeros(0, 2)], "d": torch.tensor(7, dtype=torch.int16),
               "e": torch.arange(6, dtype=torch.float64).reshape(3, 2).t()}
    tx.put("k", payload, timeout=5)
    got = rx.get("k", timeout=5)
    for name in ("a", "b", "d", "e"):
        assert got[name].dtype == payload[name].dtype and got[name].shape == payload[name].shape
        assert torch.equal(got[name], payload[name]) and got[name].is_contiguous()
    assert torch.equal(got["c"][0], payload["c"][0]) and got["c"][1].shape == (0, 2)
    base = rx._receiver.pool.ptr
    assert all(base <= got[n].data_ptr() < base + rx._receiver.pool.nbytes for n in ("a", "b", "d", "e"))


def test_valid_manifest_from_raw_sender_needs_its_events():
    # A well-formed manifest of a generation that never attached: refused as a lost
    # sender, and its block is handed back.
    ch = _chan()
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=4 << 20, event_slots=4) as rx:
        with _raw_sender(rx) as raw:
            raw.put("k", {"d": _GOOD, "h": {"x": None}, "n": 1}, timeout=5)
            with pytest.raises(PeerLostError):
                rx.get("k", timeout=5)
            assert rx.stats().blocks_in_use == 0


# ------------------------------------------------------------- one of each per channel
def test_one_receiver_and_one_sender_per_channel(pair):
    tx, rx = pair
    with pytest.raises(ConfigurationError, match="already has a receiver"):
        HostCudaIpc(channel=rx.channel, role="receiver")
    tx.put("k", {"x": torch.ones(1)}, timeout=5)
    with HostCudaIpc(channel=rx.channel, role="sender", linger=0) as tx2:
        with pytest.raises(ConfigurationError, match="already has a sender"):
            tx2.put("k2", {"x": torch.ones(1)}, timeout=5)
    rx.get("k", timeout=5)


def test_put_without_receiver_times_out_naming_it():
    with HostCudaIpc(channel=_chan(), role="sender", linger=0) as tx:
        with pytest.raises(TransferTimeout, match="receiver"):
            tx.put("k", {"x": torch.ones(1)}, timeout=0.2)


def test_receiver_close_makes_sender_fail_and_close_its_handles():
    ch = _chan()
    rx = HostCudaIpc(channel=ch, role="receiver", pool_bytes=2 << 20)
    tx = HostCudaIpc(channel=ch, role="sender", linger=0)
    try:
        tx.put("k", {"x": torch.ones(4)}, timeout=5)
        got = rx.get("k", timeout=5)
        ptr = rx._receiver.pool.ptr
        rx.close()
        assert torch.equal(got["x"], torch.ones(4))  # views outlive the receiver...
        assert ptr in HostDeviceOps.pools
        with pytest.raises(PeerLostError, match="closed"):
            tx.put("k2", {"x": torch.ones(4)}, timeout=5)
        assert tx._sender.tx is None
        del got
        assert ptr not in HostDeviceOps.pools  # ...and the pool goes with the last one
    finally:
        tx.close()
        rx.close()


def test_new_sender_respects_blocks_the_receiver_still_holds():
    ch = _chan()
    rx = HostCudaIpc(channel=ch, role="receiver", pool_bytes=2 << 20, event_slots=2, pool_max_bytes=2 << 20)
    try:
        tx = HostCudaIpc(channel=ch, role="sender", linger=0)
        tx.put("a", {"x": torch.full((256 * 1024,), 7, dtype=torch.int32)}, timeout=5)  # 1 MiB
        held = rx.get("a", timeout=5)
        tx.close()
        tx = HostCudaIpc(channel=ch, role="sender", linger=0)
        try:
            tx.put("b", {"x": torch.full((128 * 1024,), 9, dtype=torch.int32)}, timeout=5)
            got = rx.get("b", timeout=5)
            assert torch.equal(held["x"], torch.full((256 * 1024,), 7, dtype=torch.int32))
            assert torch.equal(got["x"], torch.full((128 * 1024,), 9, dtype=torch.int32))
            with pytest.raises(TransferTimeout):  # 1 MiB held + 0.5 MiB: no room for 1 MiB
                tx.put("c", {"x": torch.zeros(1 << 20, dtype=torch.uint8)}, timeout=0.2)
            del held
            tx.put("c", {"x": torch.zeros(1 << 20, dtype=torch.uint8)}, timeout=5)
            rx.get("c", timeout=5)
        finally:
            tx.close()
    finally:
        rx.close()


# ------------------------------------------------------------------ other processes
def _child_receiver(channel: str, ready: str) -> None:
    from tests.cuda_ipc_double import HostCudaIpc

    rx = HostCudaIpc(channel=channel, role="receiver", pool_bytes=2 << 20)
    got = rx.get("k", timeout=60)
    assert torch.equal(got["x"], torch.arange(100))
    with open(ready, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)  # killed by the test


def _child_sender(channel: str, ready: str) -> None:
    from tests.cuda_ipc_double import HostCudaIpc

    tx = HostCudaIpc(channel=channel, role="sender", linger=0)
    tx.put("k", {"x": torch.arange(100)}, timeout=60)
    tx.put("unread", {"x": torch.arange(5)}, timeout=60)
    with open(ready, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)  # killed by the test


def test_sigkill_of_the_receiver(procs, tmp_path):
    ch = _chan()
    ready = str(tmp_path / "ready")
    p = start_process(procs, _child_receiver, ch, ready)
    with HostCudaIpc(channel=ch, role="sender", linger=0) as tx:
        tx.put("k", {"x": torch.arange(100)}, timeout=60)
        wait_file(ready, p)
        assert tx._sender.tx is not None and tx._sender.tx.segs[0].opened
        ops: HostDeviceOps = tx._ops
        assert len(ops.opened) == 1
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        deadline = time.monotonic() + 10  # the heartbeat closes the handle by itself
        while tx._sender.tx is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tx._sender.tx is None and ops.opened == {}
        with pytest.raises(PeerLostError, match="died"):  # at once, not after the timeout
            tx.put("k2", {"x": torch.arange(3)}, timeout=30)
    removed = collect_garbage()
    assert any("-a%d-" % p.pid in r for r in removed)  # the dead receiver's directory
    assert not find_directories(read_prefix(), ch)


def test_sigkill_of_the_sender_leaves_the_pool_intact(procs, tmp_path):
    ch = _chan()
    ready = str(tmp_path / "ready")
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=2 << 20) as rx:
        p = start_process(procs, _child_sender, ch, ready)
        got = rx.get("k", timeout=60)
        wait_file(ready, p)
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert torch.equal(got["x"], torch.arange(100))  # views of the receiver's own pool
        with pytest.raises(PeerLostError):  # its copy cannot be confirmed any more
            rx.get("unread", timeout=10)
        with HostCudaIpc(channel=ch, role="sender", linger=0) as tx:  # a new sender attaches
            tx.put("k2", {"x": torch.arange(9)}, timeout=10)
            assert torch.equal(rx.get("k2", timeout=10)["x"], torch.arange(9))
        assert torch.equal(got["x"], torch.arange(100))
        del got
    collect_garbage()  # (a new connector's start-up gc may have done it already)
    assert not [e for e in os.listdir("/dev/shm") if "%d-" % p.pid in e]  # the dead sender's arena


# -------------------------------------------------------------- without CUDA
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the backend is available")
def test_unavailable_without_cuda_says_why():
    reason = backend_unavailable("cuda_ipc")
    assert reason is not None and "CUDA" in reason
    assert "cuda_ipc" in omnilink.available_backends()
    with pytest.raises(CudaError, match="CUDA is not available"):
        omnilink.connect("cuda_ipc", channel=_chan(), role="receiver")
    with pytest.raises(CudaError):
        omnilink.connect("cuda_ipc", channel=_chan(), role="sender")
    assert backend_unavailable("memory") is None


# ------------------------------------------------ directory fields across processes
def _hammer_ring_head(name: str, seconds: float) -> None:
    from omnilink.connectors.devpool.directory import RING_HEAD, Directory

    d = Directory.open(name)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(2000):
            d.set(RING_HEAD, 0x35C)
            d.set(RING_HEAD, 0x35D)
    d.close()


def test_a_field_being_written_never_reads_as_zero_in_another_process(procs):
    # struct.pack_into zero-fills its target before writing the value: a ring head
    # written that way read as 0 in the other process now and then (the sender then
    # raised "corrupt released ring"). Each field is one native 8-byte store now.
    from omnilink.connectors.devpool.directory import RING_HEAD, Directory

    d = Directory.create(read_prefix(), _chan(), device=0, uuid=b"u", pool_bytes=1 << 20,
                         nslots=4, ring_cap=16, mem_handle=b"h", pool_max=1 << 20)
    try:
        d.set(RING_HEAD, 0x35C)
        p = start_process(procs, _hammer_ring_head, d.name, 2.0)
        start = time.monotonic() + 120
        while d.get(RING_HEAD) != 0x35D:  # the writer has started
            assert time.monotonic() < start and p.is_alive(), "the writer never started"
        seen: dict[int, int] = {}
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            for _ in range(2000):
                v = d.get(RING_HEAD)
                seen[v] = seen.get(v, 0) + 1
        p.join(30)
        assert set(seen) <= {0x35C, 0x35D}, f"torn reads: {sorted(set(seen) - {0x35C, 0x35D})}"
        assert len(seen) == 2  # the writer really ran while we read
    finally:
        name = d.name
        d.close()
        unlink_segment(name)
