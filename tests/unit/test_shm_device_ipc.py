"""The shm backend's device-IPC options where there is no GPU: validation, the "on"
receiver's clear error, and that nothing changes for host payloads; and the route
itself over the host-memory double of the device operations (``tests/cuda_ipc_double.py``:
every torch tensor counts as a device tensor there, so the route is driven directly, as
shm's ``put`` drives it for CUDA payloads)."""

from __future__ import annotations

import os
import types
import uuid

import pytest

import omnilink
from omnilink.connectors.cuda_ipc import cuda_ipc_unavailable
from omnilink.connectors.devpool.directory import directory_token
from omnilink.connectors.shmem import channel_names
from tests.conftest import SHM_PREFIX, shm_entries


def _chan() -> str:
    return f"t/ipcu-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("options", [{"device_ipc": "yes"}, {"device_ipc": True}, {"ipc_pool_bytes": 1024},
                                     {"ipc_pool_bytes": 2.5}, {"ipc_min_bytes": -1}, {"ipc_min_bytes": True},
                                     {"ipc_pool_max_bytes": 1024}, {"ipc_pool_max_bytes": True}])
def test_bad_device_ipc_options(options):
    with pytest.raises(omnilink.ConfigurationError):
        omnilink.connect("shm", channel=_chan(), role="receiver", **options)


@pytest.mark.skipif(cuda_ipc_unavailable() is None, reason="this machine can open a device pool")
def test_on_receiver_without_cuda_says_why():
    with pytest.raises(omnilink.CudaError, match="device_ipc='on'"):
        omnilink.connect("shm", channel=_chan(), role="receiver", device_ipc="on")


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_host_payloads_are_untouched_by_the_mode(mode):
    torch = pytest.importorskip("torch")
    ch = _chan()
    with omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc=mode) as tx, \
            omnilink.connect("shm", channel=ch, role="receiver", device_ipc="auto") as rx:
        tx.put("k", {"x": torch.arange(10), "m": "meta"}, timeout=5)
        got = rx.get("k", timeout=5)
        assert torch.equal(got["x"], torch.arange(10)) and got["m"] == "meta"
        assert tx.stats().ipc_puts == 0 and rx.stats().ipc_gets == 0


# ------------------------------------------------------------- the route, on the double
def _routed(ch: str, pool_bytes: int = 4 << 20):
    """A shm receiver and sender on ``ch`` whose device-IPC routes run on the double."""
    from tests.cuda_ipc_double import host_route

    rx = omnilink.connect("shm", channel=ch, role="receiver", device_ipc="off")
    try:
        tx = omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="off")
    except BaseException:
        rx.close()
        raise
    try:
        host_route(rx, pool_bytes=pool_bytes)
        host_route(tx)
    except BaseException:
        tx.close()
        rx.close()
        raise
    return tx, rx


def _names(entries: set[str]) -> set[str]:
    """/dev/shm entries as posix names without the slash (``sem.`` dropped)."""
    return {e[4:] if e.startswith("sem.") else e for e in entries}


def test_device_ipc_route_opens_no_inner_channel():
    torch = pytest.importorskip("torch")
    from tests.cuda_ipc_double import HostCudaIpc, route_put

    ch = _chan()
    before = shm_entries()
    tx, rx = _routed(ch)
    try:
        payload = {"h": torch.arange(1000, dtype=torch.float32).reshape(10, 100), "meta": {"n": 1}, "ids": [torch.arange(3)]}
        assert route_put(tx, "k", payload) == omnilink.encoded_size(payload)
        made = _names(shm_entries() - before)
        got = rx.get("k", timeout=5)
        assert torch.equal(got["h"], payload["h"]) and torch.equal(got["ids"][0], torch.arange(3))
        assert got["meta"] == {"n": 1}
        pool = rx._ipc._rx.pool
        assert pool.ptr <= got["h"].data_ptr() < pool.ptr + pool.nbytes  # a view of the device pool
        assert tx.stats().ipc_puts == 1 and rx.stats().ipc_gets == 1 and tx.stats().ipc_fallbacks == 0
        del got
    finally:
        tx.close()
        rx.close()
    inner = {n.lstrip("/") for n in channel_names(SHM_PREFIX, f"{ch}/cuda-ipc")}
    chan = {n.lstrip("/") for n in channel_names(SHM_PREFIX, ch)}
    directory = f"{SHM_PREFIX}-a{os.getpid()}-{directory_token(ch)}"
    assert not made & inner, "the route opened a cuda_ipc inner channel"
    assert chan <= made and directory in made
    arenas = {n for n in made - chan - {directory} if not n.endswith("-s")}
    assert len(arenas) == 1, arenas  # the shm sender's own arena, and no inner sender's
    # The check can see an inner channel: a cuda_ipc connector pair does open one.
    ch2 = _chan()
    before = shm_entries()
    with HostCudaIpc(channel=ch2, role="receiver", pool_bytes=2 << 20), HostCudaIpc(channel=ch2, role="sender",
                                                                                     linger=0):
        made = _names(shm_entries() - before)
    assert {n.lstrip("/") for n in channel_names(SHM_PREFIX, f"{ch2}/cuda-ipc")} <= made


def test_device_ipc_route_discard_gives_pool_blocks_back():
    torch = pytest.importorskip("torch")
    from tests.cuda_ipc_double import route_put

    tx, rx = _routed(_chan())
    try:
        receiver = rx._ipc._rx
        assert route_put(tx, "a", {"x": torch.ones(100)}) is not None
        sender = tx._ipc._tx  # attached at the first put
        assert receiver.in_use() == (0, 0)
        assert rx.discard("a")  # the receiver drops it unread: its block goes back
        assert receiver.in_use() == (0, 0) and rx.stats().ipc_gets == 0
        assert route_put(tx, "b", {"x": torch.ones(100)}) is not None  # drains the free of "a"
        assert sender.in_use()[0] == 1
        assert tx.discard("b")  # withdrawn unread by the sender: its block is free again
        assert sender.in_use() == (0, 0)
        assert route_put(tx, "c", {"x": torch.full((4,), 7.0)}) is not None
        got = rx.get("c", timeout=5)
        assert torch.equal(got["x"], torch.full((4,), 7.0)) and receiver.in_use()[0] == 1
        del got  # the last view: the block goes back
        assert receiver.in_use() == (0, 0)
    finally:
        tx.close()
        rx.close()


def test_device_ipc_route_falls_back_and_says_why(monkeypatch):
    torch = pytest.importorskip("torch")
    from tests.cuda_ipc_double import HostDeviceOps, route_put

    monkeypatch.setattr(HostDeviceOps, "FREE_BYTES", 0)  # the pool may not grow
    tx, rx = _routed(_chan(), pool_bytes=1 << 20)
    try:
        assert route_put(tx, "big", {"x": torch.zeros(1 << 19)}) is None  # 2 MiB > the 1 MiB pool
        st = tx.stats()
        assert st.ipc_fallbacks == 1 and st.ipc_puts == 0 and "CapacityError" in st.ipc_fallback_reason
        assert "pool_max_bytes" in st.ipc_fallback_reason and "1048576" in st.ipc_fallback_reason
        assert route_put(tx, "small", {"x": torch.ones(8)}) is not None and tx.stats().ipc_puts == 1
        assert torch.equal(rx.get("small", timeout=5)["x"], torch.ones(8))
        rx._ipc.close()  # the pool's receiver goes: the sender drops its end, host path
        assert route_put(tx, "after", {"x": torch.ones(8)}) is None
        st = tx.stats()
        assert st.ipc_fallbacks == 2 and "PeerLostError" in st.ipc_fallback_reason and tx._ipc._tx is None
    finally:
        tx.close()
        rx.close()



def _warm(tx, rx):
    """Attach the sender's end of the route (one payload sent by it and read)."""
    torch = pytest.importorskip("torch")
    from tests.cuda_ipc_double import route_put

    assert route_put(tx, "warm", {"x": torch.ones(8)}) is not None
    rx.get("warm", timeout=5)


def test_a_put_takes_the_route_before_preparing_the_payload(monkeypatch):
    # Where every size goes by device IPC (ipc_min_bytes 0, or MPS), put offers the
    # payload to the route first: one walk picks the block's tensors, the size comes
    # after the copy is queued, and no tensor_blob walk runs unless the route declines.
    torch = pytest.importorskip("torch")
    from omnilink.connectors.shm import connector as shm_connector

    tx, rx = _routed(_chan())
    try:
        assert not tx._ipc.routes_first()  # no pool sender attached yet
        _warm(tx, rx)
        assert tx._ipc.routes_first()
        prepared = []
        real = shm_connector._prepare
        monkeypatch.setattr(shm_connector, "_prepare", lambda p: prepared.append(p) or real(p))
        payload = {"hidden": torch.randn(300), "ids": torch.arange(16), "meta": {"s": "x", "i": 3}}
        assert tx.put("k", payload, timeout=5) == omnilink.encoded_size(payload)
        assert prepared == [] and tx.stats().ipc_puts == 2
        got = rx.get("k", timeout=5)
        assert torch.equal(got["hidden"], payload["hidden"]) and torch.equal(got["ids"], payload["ids"])
        assert got["meta"] == payload["meta"] and rx.stats().ipc_gets == 2
        # No tensor at all: not the route's; the arena, as before.
        assert tx.put("plain", {"m": 1}, timeout=5) > 0
        assert len(prepared) == 1 and tx.stats().ipc_puts == 2
        assert rx.get("plain", timeout=5) == {"m": 1}
    finally:
        tx.close()
        rx.close()


def _six_put_and_got(tx, rx, monkeypatch) -> list:
    """Six same-shaped payloads put on ``tx`` and got back on ``rx`` (compared); returns
    those put prepared as a tensor_blob on the way (the general way's walk)."""
    torch = pytest.importorskip("torch")
    from omnilink.connectors.shm import connector as shm_connector

    prepared: list = []
    real = shm_connector._prepare
    monkeypatch.setattr(shm_connector, "_prepare", lambda p: prepared.append(p) or real(p))
    for i in range(6):
        payload = {"hidden": torch.randn(300), "ids": torch.arange(16) + i, "meta": {"i": i}}
        assert tx.put(f"k{i}", payload, timeout=5) == omnilink.encoded_size(payload)
        got = rx.get(f"k{i}", timeout=5)
        assert torch.equal(got["hidden"], payload["hidden"]) and got["meta"] == {"i": i}
        assert torch.equal(got["ids"], payload["ids"])
    return prepared


@pytest.mark.parametrize("peer", [True, False])
def test_a_payload_on_another_gpu_takes_the_route_first_when_it_reaches_the_pool(monkeypatch, peer):
    # Tensors all on one GPU other than the pool's: the route takes them first (peer
    # copies, then by a send plan) when that GPU reaches the pool's by peer access;
    # otherwise the general way, which prepares the payload.
    pytest.importorskip("torch")
    from tests.cuda_ipc_double import HostDeviceOps

    tx, rx = _routed(_chan())
    try:
        _warm(tx, rx)
        monkeypatch.setattr(HostDeviceOps, "tensor_device", staticmethod(lambda t: 1))  # pool: device 0
        tx._ipc._peer_ok[(1, 0)] = peer
        prepared = _six_put_and_got(tx, rx, monkeypatch)
        sender = tx._ipc._tx
        if peer:
            assert prepared == [] and tx.stats().ipc_puts == 7
            assert sender.planned_puts >= 3 and sender.ops.peer_copies == sender.planned_puts
        else:
            assert len(prepared) == 6 and sender.ops.peer_copies == 0
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("across", [False, True])
def test_without_mps_a_sender_on_another_gpu_routes_every_size_first(monkeypatch, tmp_path, across):
    # No MPS server, ipc_min_bytes left to the route: a sender whose current GPU is not
    # the pool's takes its payloads (all on that GPU) by device IPC at every size, first,
    # then by a send plan; on the pool's GPU the threshold holds (the host path below it).
    torch = pytest.importorskip("torch")
    from omnilink.connectors.shm import ipc
    from tests.cuda_ipc_double import HostDeviceOps, host_route

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))  # no MPS server's pid file there
    ch = _chan()
    rx = omnilink.connect("shm", channel=ch, role="receiver", device_ipc="off")
    tx = omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="off")
    try:
        host_route(rx)
        route = host_route(tx, mode="auto", min_bytes=None)
        where = 1 if across else 0  # the pool is on device 0
        monkeypatch.setattr(HostDeviceOps, "device_index", lambda self, device: where)
        monkeypatch.setattr(HostDeviceOps, "tensor_device", staticmethod(lambda t: where))
        route._peer_ok[(1, 0)] = True
        assert not route.routes_first()  # not attached yet
        # The general way's threshold, for a payload on that GPU, attaches the route's
        # sender (its probe) to learn the pool's device: 0 from another GPU.
        on_gpu = types.SimpleNamespace(devices=lambda: [torch.device("cuda", where)])
        assert route.min_bytes_for(on_gpu) == (0 if across else ipc.IPC_MIN_BYTES)
        assert route._tx is not None
        prepared = _six_put_and_got(tx, rx, monkeypatch)
        sender = route._tx
        assert route.routes_first() is across
        if across:
            assert prepared == [] and tx.stats().ipc_puts == 6
            assert sender.planned_puts >= 3 and sender.ops.peer_copies == sender.planned_puts
            # A payload on the pool's own GPU from that sender: not below the threshold.
            monkeypatch.setattr(HostDeviceOps, "tensor_device", staticmethod(lambda t: 0))
            payload = {"hidden": torch.randn(100), "meta": {"i": 9}}
            assert tx.put("own", payload, timeout=5) == omnilink.encoded_size(payload)
            assert torch.equal(rx.get("own", timeout=5)["hidden"], payload["hidden"])
            assert len(prepared) == 1 and tx.stats().ipc_puts == 6
        else:
            assert len(prepared) == 6 and tx.stats().ipc_puts == 0
    finally:
        tx.close()
        rx.close()


def test_a_payload_the_route_cannot_take_first_goes_by_the_host_path_once(monkeypatch):
    torch = pytest.importorskip("torch")
    from tests.cuda_ipc_double import HostDeviceOps

    monkeypatch.setattr(HostDeviceOps, "FREE_BYTES", 0)  # the pool may not grow
    tx, rx = _routed(_chan(), pool_bytes=1 << 20)
    try:
        _warm(tx, rx)
        big = {"x": torch.arange(1 << 19, dtype=torch.float32)}  # 2 MiB > the 1 MiB pool
        assert tx.put("big", big, timeout=5) == omnilink.encoded_size(big)
        st = tx.stats()
        assert st.ipc_fallbacks == 1 and st.ipc_puts == 1 and "CapacityError" in st.ipc_fallback_reason
        assert torch.equal(rx.get("big", timeout=5)["x"], big["x"])
    finally:
        tx.close()
        rx.close()


def test_a_payload_tensor_blob_cannot_carry_is_named_by_its_own_path_when_routed_first():
    torch = pytest.importorskip("torch")

    tx, rx = _routed(_chan())
    try:
        _warm(tx, rx)
        with pytest.raises(omnilink.BlobEncodeError) as err:
            tx.put("bad", {"hidden": torch.ones(4), "meta": {"tags": {1, 2}}}, timeout=5)
        assert str(err.value).startswith("payload['meta']['tags']: type builtins.set")
        assert tx._ipc._tx.in_use() == (0, 0)  # its block went back; nothing was published
        tx.put("bad", {"hidden": torch.ones(4), "meta": {"tags": [1, 2]}}, timeout=5)  # the key is free
        assert rx.get("bad", timeout=5)["meta"] == {"tags": [1, 2]}
    finally:
        tx.close()
        rx.close()
