"""The device pool's lane (``omnilink.connectors.devpool.lane``): its record format
(round trips, what it refuses), hostile records, the claim table (a sender's withdrawal
against the receiver's claim, a second put of a pending key), and the transports that
use it, over the host-memory double of the device operations (``tests.cuda_ipc_double``):
a message the lane cannot take still arrives, by the channel's general way."""

from __future__ import annotations

import struct
import uuid

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnilink import DuplicateKeyError, KeyConsumedError, TransferTimeout, WouldBlock
from omnilink.connectors.devpool import lane as lane_mod
from omnilink.connectors.devpool.directory import LANE_PUB, LANE_READ
from omnilink.connectors.devpool.lane import BadRecord, NotPlain, decode_record, encode_record
from tests.cuda_ipc_double import HostCudaIpc, host_pair


def _chan() -> str:
    return f"t/lane-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def pair():
    with host_pair(_chan()) as tx_rx:
        yield tx_rx


def _lane(rx):
    return rx._receiver.lane


def _records(rx) -> int:
    d = rx._receiver.pool.dir
    return d.get(LANE_PUB)


# ------------------------------------------------------------------ format
_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                  st.floats(allow_nan=False), st.text(max_size=20))
_tensor = st.builds(
    lambda shape, dt: (torch.arange(int(torch.tensor(shape).prod().item()) if shape else 1) % 7).to(dt).reshape(shape),
    st.lists(st.integers(0, 4), max_size=3),
    st.sampled_from([torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.uint8, torch.float16]),
)
_plain = st.recursive(st.one_of(_leaf, _tensor),
                      lambda kids: st.one_of(st.lists(kids, max_size=4),
                                             st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                      max_leaves=12)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return type(b) is list and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=200, deadline=None)
@given(_plain)
def test_a_plain_message_round_trips(msg):
    key, back = decode_record(encode_record("k", msg))
    assert key == "k" and _same(msg, back)


def test_tensors_come_back_as_their_own_writable_copies():
    src = torch.arange(16, dtype=torch.int64)
    _, back = decode_record(encode_record("k", {"ids": src, "flag": torch.tensor(False)}))
    assert torch.equal(back["ids"], src) and back["ids"].data_ptr() != src.data_ptr()
    assert back["flag"].shape == () and back["flag"].dtype == torch.bool and not bool(back["flag"])
    back["ids"][0] = 5  # writable: not a view of a read-only buffer
    assert back["ids"].data_ptr() % 8 == 0


@pytest.mark.parametrize("msg", [(1, 2), {"t": (1,)}, b"raw", {1: "int key"}, [1 << 64], {"a": object()},
                                 torch.zeros(2048, dtype=torch.int64),  # past a record
                                 torch.zeros(4)[::2].to_sparse()])
def test_what_the_lane_refuses(msg):
    with pytest.raises(NotPlain):
        encode_record("k", msg)


def test_a_deep_message_is_refused_not_a_recursion_error():
    msg: list = []
    for _ in range(lane_mod.MAX_DEPTH + 2):
        msg = [msg]
    with pytest.raises(NotPlain):
        encode_record("k", msg)


def _ext(code: int, ndim: int, shape: tuple, data: bytes) -> bytes:
    head = struct.pack("<BB", code, ndim) + struct.pack(f"<{len(shape)}q", *shape)
    return msgspec.msgpack.encode(["k", msgspec.msgpack.Ext(lane_mod.EXT_TENSOR, head + data)])


@pytest.mark.parametrize("body", [
    b"", b"\xc1", msgspec.msgpack.encode({"k": 1}), msgspec.msgpack.encode(["k"]),
    msgspec.msgpack.encode([1, 2]), msgspec.msgpack.encode(["", 2]),
    msgspec.msgpack.encode(["k", msgspec.msgpack.Ext(9, b"x")]),
    _ext(250, 1, (2,), b"\0" * 8),  # no such dtype code
    _ext(6, 1, (3,), b"\0" * 8),  # int64 x 3 is 24 bytes, not 8
    _ext(6, 1, (-1,), b""),  # negative dimension
    _ext(6, 40, (), b""),  # too many dimensions
    _ext(6, 2, (1,), b""),  # ndim past the bytes given
])
def test_hostile_records_are_named_errors(body):
    with pytest.raises(BadRecord):
        decode_record(body)


# ------------------------------------------------------------------ the ring, through cuda_ipc
def test_payloads_ride_the_lane_and_arrive_zero_copy(pair):
    tx, rx = pair
    for i in range(200):  # past the ring's slots and the event slots
        tx.put(f"k{i}", {"x": torch.full((8,), i, dtype=torch.float32), "i": i}, timeout=5)
        got = rx.get(f"k{i}", timeout=5)
        assert got["i"] == i and torch.equal(got["x"], torch.full((8,), float(i)))
        lo, hi = rx._receiver.pool.ptr, rx._receiver.pool.ptr + rx._receiver.pool.nbytes
        assert lo <= got["x"].data_ptr() < hi  # a view of the pool
    assert _records(rx) == 200  # every message went by the lane
    assert rx._inner.stats().gets == 200 and tx._inner.stats().puts == 0  # none by the inner arena


def test_a_full_ring_and_unplain_messages_take_the_general_way(pair):
    tx, rx = pair
    n = lane_mod.LANE_SLOTS + 10
    for i in range(n):  # nobody reads meanwhile: the ring fills, the rest goes by the arena
        tx.put(f"k{i}", {"x": torch.ones(4), "i": i}, timeout=5)
    tx.put("tuple", {"x": torch.ones(4), "t": (1, "two")}, timeout=5)
    assert _records(rx) == lane_mod.LANE_SLOTS
    assert tx._inner.stats().puts == n - lane_mod.LANE_SLOTS + 1
    for i in reversed(range(n)):  # any order: the key contract
        assert rx.get(f"k{i}", timeout=5)["i"] == i
    assert rx.get("tuple", timeout=5)["t"] == (1, "two")  # the tuple kept: it went by the arena


def test_second_put_of_a_pending_lane_key_and_its_withdrawal(pair):
    tx, rx = pair
    tx.put("a", {"x": torch.ones(8)}, timeout=5)
    with pytest.raises(DuplicateKeyError):
        tx.put("a", {"x": torch.ones(8)}, timeout=5)
    assert tx.stats().blocks_in_use == 1
    # The receiver has read the record into its index (a get of another key scans)...
    with pytest.raises(WouldBlock):
        rx.get_nowait("other")
    assert "a" in rx._inner._lane_index
    # ...but not claimed it: the sender may still withdraw it, and its block is free.
    assert tx.discard("a") is True and tx.stats().blocks_in_use == 0
    with pytest.raises(TransferTimeout):
        rx.get("a", timeout=0.2)
    assert "a" not in rx._inner._lane_index
    # Claimed first: the withdrawal fails, the payload is the receiver's.
    tx.put("b", {"x": torch.ones(8)}, timeout=5)
    got = rx.get("b", timeout=5)
    assert tx.discard("b") is False and torch.equal(got["x"], torch.ones(8))
    with pytest.raises(KeyConsumedError):
        rx.get("b", timeout=1)
    # A key may be put again once its earlier payload was claimed.
    tx.put("b2", {"x": torch.ones(8)}, timeout=5)
    rx.get("b2", timeout=5)


def test_receiver_discard_of_a_lane_key_frees_its_block(pair):
    tx, rx = pair
    tx.put("d", {"x": torch.ones(8)}, timeout=5)
    assert rx.discard("d") is True and rx.discard("d") is False
    with pytest.raises(KeyConsumedError):
        rx.get("d", timeout=1)
    assert rx.stats().blocks_in_use == 0
    assert tx.discard("d") is False  # claimed by the receiver's discard


def test_bad_records_are_skipped_and_the_next_arrive(pair, caplog):
    tx, rx = pair
    tx.put("good1", {"x": torch.ones(2)}, timeout=5)
    lane = _lane(rx)
    d = rx._receiver.pool.dir
    # A record the sender never wrote: garbage after a valid length, then a length past
    # the record, published by bumping the counter as a sender would.
    for body_len, body in ((5, b"\xc1\xc1\xc1\xc1\xc1"), (1 << 30, b"")):
        pub = d.get(LANE_PUB)
        o = d.lane_offset + (pub % d.lane_slots) * d.lane_record
        struct.pack_into("<I", d.mm, o, body_len)
        d.mm[o + 4:o + 4 + len(body)] = body
        d.set(LANE_PUB, pub + 1)
    tx.put("good2", {"x": torch.ones(2)}, timeout=5)
    assert torch.equal(rx.get("good2", timeout=5)["x"], torch.ones(2))
    assert torch.equal(rx.get("good1", timeout=5)["x"], torch.ones(2))
    assert lane.bad == 2


def test_corrupt_counters_are_skipped_not_looped_on(pair):
    tx, rx = pair
    d = rx._receiver.pool.dir
    d.set(LANE_PUB, d.get(LANE_READ) + 10 * lane_mod.LANE_SLOTS)  # more than the ring holds
    with pytest.raises(WouldBlock):
        rx.get_nowait("x")
    assert _lane(rx).bad == 1 and d.get(LANE_READ) == d.get(LANE_PUB)


def test_the_claim_table_never_forgets_an_unread_message(monkeypatch):
    monkeypatch.setattr(lane_mod, "TABLE", 8)  # before the directory is made: its layout too
    ch = _chan()
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=4 << 20) as rx, \
            HostCudaIpc(channel=ch, role="sender", linger=0) as tx:
        tx.put("old", {"x": torch.ones(2)}, timeout=5)  # lane seq 0, never read
        for i in range(20):  # its table entry comes round again at 8 and 16
            tx.put(f"k{i}", {"x": torch.ones(2), "i": i}, timeout=5)
            assert rx.get(f"k{i}", timeout=5)["i"] == i
        # From lane seq 8 on, the entry to write was old's: every later message went the
        # general way (k7 .. k19) until old is claimed...
        assert tx._inner.stats().puts == 13 and _records(rx) == 8
        assert torch.equal(rx.get("old", timeout=5)["x"], torch.ones(2))
        tx.put("after", {"x": torch.ones(2)}, timeout=5)  # ...then the lane takes them again
        assert rx.get("after", timeout=5)["x"].shape == (2,)
        assert tx._inner.stats().puts == 13 and _records(rx) == 9


# ------------------------------------------------------------------ the shm route
def test_the_shm_route_uses_the_lane():
    import omnilink
    from tests.cuda_ipc_double import host_route, route_put

    ch = _chan()
    with omnilink.connect("shm", channel=ch, role="receiver", device_ipc="off") as rx, \
            omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="off") as tx:
        host_route(rx)
        host_route(tx)
        for i in range(5):
            assert route_put(tx, f"k{i}", {"x": torch.full((4,), i), "i": i}) is not None
        assert sorted(tx.pending_keys()) == [f"k{i}" for i in range(5)]
        assert tx.discard("k4") is True  # withdrawn from the lane: its block is free
        assert tx._ipc._tx.in_use()[0] == 4
        for i in range(4):
            got = rx.get(f"k{i}", timeout=5)
            assert got["i"] == i and torch.equal(got["x"], torch.full((4,), i))
        assert rx._ipc._rx.pool.dir.get(LANE_PUB) == 5  # all five went by the lane
        assert tx.stats().ipc_puts == 5 and rx.stats().ipc_gets == 4 and rx.stats().gets == 4
        assert tx.pending_keys() == []
        with pytest.raises(TransferTimeout):
            rx.get("k4", timeout=0.2)


def test_a_lane_looked_at_after_its_pool_closed_says_so_without_raising():
    ch = _chan()
    rx = HostCudaIpc(channel=ch, role="receiver", pool_bytes=4 << 20)
    lane = _lane(rx)
    assert lane.unread() is False
    rx.close()  # unmaps the directory: a racing get's lock-free look must not raise
    assert lane.unread() is True


def test_reclaim_unread_withdraws_old_lane_records_and_frees_their_blocks():
    import omnilink
    from tests.cuda_ipc_double import host_route, route_put

    ch = _chan()
    with omnilink.connect("shm", channel=ch, role="receiver", device_ipc="off") as rx, \
            omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="off") as tx:
        host_route(rx)
        host_route(tx)
        for k in ("read", "old1", "old2"):
            assert route_put(tx, k, {"x": torch.ones(64)}) is not None
        got = rx.get("read", timeout=5)
        assert tx._ipc._tx.in_use()[0] == 3
        dropped = tx.reclaim_unread(0)
        assert [k for k, _ in dropped] == ["old1", "old2"]  # oldest first; the claimed one kept
        assert tx.stats().reclaimed == 2
        assert tx._ipc._tx.in_use()[0] == 1  # only the block the receiver holds
        assert tx.pending_keys() == [] and tx.reclaim_unread(0) == []
        with pytest.raises(TransferTimeout):
            rx.get("old1", timeout=0.2)
        assert torch.equal(got["x"], torch.ones(64))


def test_a_pool_message_has_only_its_host_part_walked():
    ids = torch.arange(4)
    msg = {"d": [1, 2, 0, 256, 512, [[6, 0, 32, [4], ["x", 0]]]], "h": {"x": [None], "ids": ids}, "n": 999}
    for wrapped in (msg, {"__omnilink_device_ipc__": msg}):
        key, back = decode_record(encode_record("k", wrapped))
        inner = back if wrapped is msg else back["__omnilink_device_ipc__"]
        assert inner["d"] == msg["d"] and inner["n"] == 999 and torch.equal(inner["h"]["ids"], ids)
    with pytest.raises(NotPlain):  # the host part is still checked
        encode_record("k", {"d": None, "h": {"t": (1, 2)}, "n": 1})
    with pytest.raises(NotPlain):  # a wrapper key must be a str
        encode_record("k", {7: msg})
    with pytest.raises(NotPlain):  # a manifest msgpack cannot carry
        encode_record("k", {"d": [object()], "h": None, "n": 1})
