"""The device pool grows: a payload larger than the pool, and a pool full of payloads its
receiver still views, go device to device through a segment the receiver adds (up to its
``pool_max_bytes``); a growth past the bound is a ``CapacityError`` naming the sizes (the
shm route counts it as a fallback, with that reason); SIGKILL of either end of a grown
pool leaves nothing behind. On the CPU, over the host-memory double
(``tests.cuda_ipc_double``); ``tests/gpu/test_devpool_growth_gpu.py`` does the same on
CUDA."""

from __future__ import annotations

import gc
import os
import signal
import time
import uuid

import pytest
import torch

from omnilink import CapacityError, PeerLostError
from omnilink.connectors.devpool.directory import SEG_SHIFT, find_directories
from omnilink.connectors.shm import collect_garbage, read_prefix
from tests.cuda_ipc_double import HostCudaIpc, HostDeviceOps
from tests.procs import start_process, wait_file

MIB = 1 << 20


def _chan() -> str:
    return f"t/grow-{uuid.uuid4().hex[:8]}"


def _big(n_mib: int, fill: int) -> torch.Tensor:
    return torch.full((n_mib * MIB,), fill, dtype=torch.uint8)


def test_a_payload_larger_than_the_pool_goes_device_to_device_through_a_new_segment():
    ch = _chan()
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=MIB) as rx, \
            HostCudaIpc(channel=ch, role="sender", linger=0) as tx:
        assert (rx.stats().pool_segments, rx.stats().pool_bytes_now) == (1, MIB)
        tx.put("big", {"x": _big(3, 5), "meta": 1}, timeout=10)
        got = rx.get("big", timeout=10)
        assert torch.equal(got["x"], _big(3, 5)) and got["meta"] == 1
        st = rx.stats()
        assert st.pool_segments == 2 and st.pool_bytes_now >= 4 * MIB and st.device_gets == 1
        assert tx.stats().device_puts == 1
        seg, = (s for s in rx._receiver.pool.segs[1:] if s is not None)
        assert seg[0] <= got["x"].data_ptr() < seg[0] + seg[1]  # a view of the new segment
        del got
        tx.put("small", {"x": torch.ones(4)}, timeout=10)  # the common case: segment 0
        assert tx._sender.tx.sent["small"][0] >> SEG_SHIFT == 0
        assert torch.equal(rx.get("small", timeout=10)["x"], torch.ones(4))


def test_the_pool_grows_while_its_receiver_holds_three_times_its_size():
    ch = _chan()
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=2 * MIB, event_slots=4) as rx, \
            HostCudaIpc(channel=ch, role="sender", linger=0) as tx:
        held = []
        for i in range(6):  # 6 x 1 MiB held: three times the pool
            tx.put(f"k{i}", {"x": _big(1, i)}, timeout=10)
            held.append(rx.get(f"k{i}", timeout=10))
        st = rx.stats()
        assert st.pool_segments >= 2 and st.pool_bytes_now >= 6 * MIB
        assert st.blocks_in_use == 6 and st.bytes_in_use >= 6 * MIB
        for i, got in enumerate(held):
            assert torch.equal(got["x"], _big(1, i))
        rx._receiver.idle_s = 0.05  # (default 2 s)
        del held, got
        gc.collect()
        assert rx.stats().blocks_in_use == 0
        # ...and gives the grown segments back once nothing holds them
        _until(lambda: rx.stats().pool_segments == 1)
        assert rx.stats().pool_bytes_now == 2 * MIB
        assert len(tx._sender.tx.live) == 1 and not tx._sender.tx.retiring
        tx.put("again", {"x": _big(3, 9)}, timeout=10)  # and grows again
        assert torch.equal(rx.get("again", timeout=10)["x"], _big(3, 9))


def _until(cond, seconds: float = 30.0) -> None:
    """Wait for ``cond()`` (the heartbeats of both ends run it); fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "condition never came"
        time.sleep(0.02)


def test_growth_past_pool_max_bytes_is_a_capacity_error_naming_the_sizes():
    ch = _chan()
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=MIB, pool_max_bytes=2 * MIB) as rx, \
            HostCudaIpc(channel=ch, role="sender", linger=0) as tx:
        with pytest.raises(CapacityError, match=r"pool_max_bytes") as info:
            tx.put("huge", {"x": _big(3, 1)}, timeout=10)
        assert str(2 * MIB) in str(info.value) and str(3 * MIB) in str(info.value)
        assert rx.stats().pool_segments == 1
        tx.put("fits", {"x": _big(1, 2)}, timeout=10)  # growth within the bound still works
        held = rx.get("fits", timeout=10)
        tx.put("fits2", {"x": _big(1, 3)}, timeout=10)
        assert torch.equal(rx.get("fits2", timeout=10)["x"], _big(1, 3))
        assert torch.equal(held["x"], _big(1, 2))
        assert rx.stats().pool_bytes_now <= 2 * MIB


def test_the_shm_route_counts_a_growth_past_ipc_pool_max_bytes_as_a_fallback():
    from tests.cuda_ipc_double import host_route, route_put

    import omnilink

    ch = _chan()
    rx = omnilink.connect("shm", channel=ch, role="receiver", device_ipc="off", ipc_pool_max_bytes=2 * MIB)
    tx = omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="off")
    try:
        host_route(rx, pool_bytes=MIB, pool_max_bytes=2 * MIB)
        host_route(tx, pool_bytes=MIB)
        assert route_put(tx, "huge", {"x": _big(3, 4)}, timeout=10) is None  # the host road...
        st = tx.stats()
        assert st.ipc_fallbacks == 1 and st.ipc_puts == 0  # ...counted, and why:
        assert "CapacityError" in st.ipc_fallback_reason and "ipc_pool_max_bytes" in st.ipc_fallback_reason
        assert str(2 * MIB) in st.ipc_fallback_reason
        tx.put("huge", {"x": _big(3, 4)}, timeout=10)  # as shm's put does then
        assert torch.equal(rx.get("huge", timeout=10)["x"], _big(3, 4))
        assert route_put(tx, "fits", {"x": _big(1, 5)}, timeout=10) is not None  # grows within the bound
        assert torch.equal(rx.get("fits", timeout=10)["x"], _big(1, 5))
        assert tx.stats().ipc_puts == 1 and rx.stats().pool_segments == 1  # (segment 0 was free)
    finally:
        tx.close()
        rx.close()


def test_the_default_bound_comes_from_free_device_memory(monkeypatch):
    monkeypatch.setattr(HostDeviceOps, "FREE_BYTES", 4 * MIB)
    with HostCudaIpc(channel=_chan(), role="receiver", pool_bytes=MIB) as rx:
        assert rx._receiver.pool_max_bytes == MIB + 3 * MIB


def test_the_shm_route_sends_a_payload_larger_than_the_pool_by_device_ipc():
    from tests.cuda_ipc_double import host_route, route_put

    import omnilink

    ch = _chan()
    rx = omnilink.connect("shm", channel=ch, role="receiver", device_ipc="off")
    tx = omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="off")
    try:
        host_route(rx, pool_bytes=MIB)
        host_route(tx, pool_bytes=MIB)
        assert route_put(tx, "big", {"x": _big(3, 4)}, timeout=10) is not None
        st = tx.stats()
        assert st.ipc_puts == 1 and st.ipc_fallbacks == 0 and st.ipc_fallback_reason == ""
        got = rx.get("big", timeout=10)
        assert torch.equal(got["x"], _big(3, 4))
        assert rx.stats().pool_segments == 2
        del got
    finally:
        tx.close()
        rx.close()


# ------------------------------------------------------------------ other processes
def _child_receiver(channel: str, ready: str) -> None:
    from tests.cuda_ipc_double import HostCudaIpc

    rx = HostCudaIpc(channel=channel, role="receiver", pool_bytes=MIB)
    got = rx.get("big", timeout=60)
    assert torch.equal(got["x"], _big(3, 7))
    assert rx.stats().pool_segments == 2
    with open(ready, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)  # killed by the test


def _child_receiver_drops(channel: str, ready: str) -> None:
    from tests.cuda_ipc_double import HostCudaIpc

    rx = HostCudaIpc(channel=channel, role="receiver", pool_bytes=MIB)
    rx._receiver.idle_s = 0.05
    got = rx.get("big", timeout=60)
    assert torch.equal(got["x"], _big(3, 6))
    del got
    with open(ready, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)  # killed by the test


def _child_sender(channel: str, ready: str) -> None:
    from tests.cuda_ipc_double import HostCudaIpc

    tx = HostCudaIpc(channel=channel, role="sender", linger=0)
    tx.put("big", {"x": _big(3, 8)}, timeout=60)
    tx.put("unread", {"x": torch.arange(5)}, timeout=60)
    with open(ready, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)  # killed by the test


def test_sigkill_of_the_receiver_of_a_grown_pool(procs, tmp_path):
    ch = _chan()
    ready = str(tmp_path / "ready")
    p = start_process(procs, _child_receiver, ch, ready)
    with HostCudaIpc(channel=ch, role="sender", linger=0) as tx:
        tx.put("big", {"x": _big(3, 7)}, timeout=60)  # larger than the child's pool
        wait_file(ready, p)
        ops: HostDeviceOps = tx._ops
        assert len(ops.opened) == 2  # segment 0 and the new one, mapped from the child
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        deadline = time.monotonic() + 10  # the heartbeat closes the handles by itself
        while tx._sender.tx is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tx._sender.tx is None and ops.opened == {}
        with pytest.raises(PeerLostError, match="died"):
            tx.put("k2", {"x": torch.arange(3)}, timeout=30)
    collect_garbage()
    assert not find_directories(read_prefix(), ch)
    assert not [e for e in os.listdir("/dev/shm") if "-a%d-" % p.pid in e]


def test_sigkill_of_the_sender_of_a_grown_pool_keeps_its_segments(procs, tmp_path):
    ch = _chan()
    ready = str(tmp_path / "ready")
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=MIB) as rx:
        p = start_process(procs, _child_sender, ch, ready)
        got = rx.get("big", timeout=60)
        wait_file(ready, p)
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert rx.stats().pool_segments == 2
        assert torch.equal(got["x"], _big(3, 8))  # views of the receiver's own segment
        with pytest.raises(PeerLostError):
            rx.get("unread", timeout=10)
        with HostCudaIpc(channel=ch, role="sender", linger=0) as tx:  # a new sender attaches...
            tx.put("k2", {"x": torch.arange(9)}, timeout=10)
            assert len(tx._sender.tx.live) == 2  # ...to every live segment
            assert torch.equal(rx.get("k2", timeout=10)["x"], torch.arange(9))
            tx.put("k3", {"x": _big(2, 9)}, timeout=10)  # not over the block still viewed
            k3 = rx.get("k3", timeout=10)
            assert torch.equal(k3["x"], _big(2, 9)) and torch.equal(got["x"], _big(3, 8))
            del k3
        del got
    collect_garbage()
    assert not [e for e in os.listdir("/dev/shm") if "%d-" % p.pid in e]


def test_hostile_blocks_of_a_grown_pool_are_refused_before_use():
    from omnilink import BlobDecodeError
    from omnilink.connectors.shm import ShmConnector

    ch = _chan()
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=MIB, event_slots=4) as rx, \
            HostCudaIpc(channel=ch, role="sender", linger=0) as tx:
        tx.put("big", {"x": _big(2, 1)}, timeout=10)
        del rx.get("big", timeout=10)["x"]
        seg1 = rx._receiver.pool.segs[1][1]
        x = [9, 0, 16, [4], ["x"]]
        with ShmConnector(channel=f"{ch}/cuda-ipc", role="sender", arena_bytes=MIB, linger=0) as raw:
            for i, block in enumerate([(1 << SEG_SHIFT) + seg1, (1 << SEG_SHIFT) + seg1 - 256 + (1 << 40),
                                       2 << SEG_SHIFT, 16 << SEG_SHIFT]):
                raw.put(f"bad{i}", {"d": [1, 1, 0, block, 512, [x]], "h": {"x": None}, "n": 1}, timeout=5)
                with pytest.raises(BlobDecodeError, match="live segment"):
                    rx.get(f"bad{i}", timeout=5)
        gc.collect()
        assert rx.stats().blocks_in_use == 0


def test_the_sender_unmaps_a_segment_its_receiver_gives_back(procs, tmp_path):
    from omnilink.connectors.devpool.directory import SEG_NONE

    ch = _chan()
    ready = str(tmp_path / "ready")
    p = start_process(procs, _child_receiver_drops, ch, ready)
    with HostCudaIpc(channel=ch, role="sender", linger=0) as tx:
        tx.put("big", {"x": _big(3, 6)}, timeout=60)
        ops: HostDeviceOps = tx._ops
        assert len(ops.opened) == 2
        wait_file(ready, p)
        _until(lambda: len(ops.opened) == 1)  # the sender closed its mapping of segment 1...
        d = tx._sender.tx.dir
        _until(lambda: d.segment(1)[0] == SEG_NONE)  # ...and the receiver freed it
        tx.put("small", {"x": torch.ones(4)}, timeout=10)
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
    collect_garbage()
    assert not find_directories(read_prefix(), ch)


def test_payloads_nobody_has_read_never_grow_the_pool():
    from omnilink import TransferTimeout

    ch = _chan()
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=2 * MIB) as rx, \
            HostCudaIpc(channel=ch, role="sender", linger=0) as tx:
        tx.put("a", {"x": _big(1, 1)}, timeout=10)
        tx.put("b", {"x": _big(1, 2)}, timeout=10)
        with pytest.raises(TransferTimeout, match="pool is full"):  # a slow reader: backpressure
            tx.put("c", {"x": _big(1, 3)}, timeout=0.3)
        assert rx.stats().pool_segments == 1
        held = rx.get("a", timeout=10)  # now the receiver holds one: the pool grows for it
        tx.put("c", {"x": _big(1, 3)}, timeout=10)
        assert rx.stats().pool_segments == 2
        assert torch.equal(rx.get("b", timeout=10)["x"], _big(1, 2))
        assert torch.equal(rx.get("c", timeout=10)["x"], _big(1, 3))
        assert torch.equal(held["x"], _big(1, 1))


def test_hostile_segment_table_and_growth_requests_are_checked():
    from omnilink.connectors.devpool.directory import (
        GROW_ACK,
        GROW_BYTES,
        GROW_ERR,
        GROW_PAST_BOUND,
        GROW_REQ,
        SEG_GEN,
        SEG_LIVE,
    )

    ch = _chan()
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=MIB, pool_max_bytes=4 * MIB) as rx:
        d = rx._receiver.pool.dir
        # a growth request past the bound (or past any segment's size) is refused
        for wanted in ((1 << 63) - 1, 8 * MIB):
            req = d.get(GROW_REQ) + 1
            d.set(GROW_BYTES, wanted)
            d.set(GROW_REQ, req)
            _until(lambda: d.get(GROW_ACK) == req)
            assert d.get(GROW_ERR) == GROW_PAST_BOUND
        assert rx.stats().pool_segments == 1
        # entries of the segment table a sender cannot map are skipped, not used
        d.set_segment(14, SEG_LIVE, 123, b"x")
        d.set_segment(15, SEG_LIVE, 1 << 60, b"y")
        d.set(SEG_GEN, d.get(SEG_GEN) + 1)
        with HostCudaIpc(channel=ch, role="sender", linger=0) as tx:
            tx.put("k", {"x": torch.ones(4)}, timeout=10)
            assert [seg.index for seg in tx._sender.tx.live] == [0]
            assert torch.equal(rx.get("k", timeout=10)["x"], torch.ones(4))
        d.set_segment(14, 0)
        d.set_segment(15, 0)


def test_the_shm_route_finds_a_pool_opened_after_its_first_payload_at_the_next_one(monkeypatch):
    """A receiver opens its pool at its first device get, often after the sender's
    first payload went by the host: the next payload large enough for the route takes
    it, with no quiet period on the host road, and a look for the pool lists nothing
    (one stat per receiver of the channel)."""
    from tests.cuda_ipc_double import host_route, route_put

    import omnilink
    from omnilink.connectors.devpool import directory

    ch = _chan()
    rx = omnilink.connect("shm", channel=ch, role="receiver", device_ipc="off")
    tx = omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="off")
    try:
        host_route(rx, mode="auto", pool_bytes=MIB)
        host_route(tx, mode="auto", pool_bytes=MIB)

        def no_listing(*a, **k):
            raise AssertionError("a look for the pool listed /dev/shm")

        with monkeypatch.context() as m:  # the sender's looks only
            m.setattr(directory.os, "listdir", no_listing)
            assert route_put(tx, "before", {"x": _big(1, 1)}) is None  # no pool yet: the host road
        rx._ipc.open_pool(None)  # the receiver's first device get
        assert rx._ipc._rx is not None
        from omnilink.connectors.shm.ipc import PROBE_EVERY_S

        time.sleep(2 * PROBE_EVERY_S)  # looks are at most this often (a put right after the
        # last look would have gone by the host: flaky when the machine is fast)
        assert route_put(tx, "after", {"x": _big(1, 2)}) is not None  # at once (the attach lists, once)
        st = tx.stats()
        assert st.ipc_puts == 1 and st.ipc_fallbacks == 0
        assert torch.equal(rx.get("after", timeout=10)["x"], _big(1, 2))
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("mps", [False, True])
def test_auto_routes_every_size_only_under_mps(monkeypatch, tmp_path, mps):
    """``ipc_min_bytes=None`` (the default): under an MPS server (its pid file in the
    pipe directory) a payload of any size takes the route, without one the 16 MiB
    threshold holds; a threshold given is kept either way."""
    from tests.cuda_ipc_double import host_route, route_put

    import omnilink
    from omnilink.connectors.shm import ipc

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    if mps:
        (tmp_path / "nvidia-cuda-mps-control.pid").write_text("4242")
    assert ipc.mps_serving() is mps
    ch = _chan()
    rx = omnilink.connect("shm", channel=ch, role="receiver", device_ipc="off")
    tx = omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="off")
    try:
        host_route(rx, mode="on", pool_bytes=MIB)
        route = host_route(tx, mode="auto", pool_bytes=MIB, min_bytes=None)
        small = {"x": torch.arange(16)}
        # (the double's tensors live on the host: a payload of 0 CUDA bytes is the smallest)
        assert route.min_bytes_for(omnilink.blob.prepare(small)) == (0 if mps else ipc.IPC_MIN_BYTES)
        sent = route_put(tx, "k", small)
        assert (sent is not None) is mps
        if mps:
            assert torch.equal(rx.get("k", timeout=10)["x"], torch.arange(16))
        route.min_bytes = 1 << 10  # given: kept
        assert route.min_bytes_for(omnilink.blob.prepare(small)) == 1 << 10
    finally:
        tx.close()
        rx.close()
