"""The device pool grows on real GPUs, two processes: a payload larger than the pool goes
device to device through a segment the receiver adds; the pool grows while its receiver
holds three times its size and gives the extra segments back once idle; growth past
``pool_max_bytes`` is a ``CapacityError``; the shm route sends a payload larger than its
pool by device IPC, not by the host; SIGKILL
of either end of a grown pool frees its memory and leaves ``/dev/shm`` clean. Skipped
with a reason on a machine without CUDA (or without cuda-python)."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

import omnilink
from omnilink.connectors import backend_unavailable
from omnilink.connectors.shm import collect_garbage
from tests.gpu._devpool_growth_workers import MIB, big, growth_receiver, growth_sender
from tests.procs import start_process, wait_json

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

_REASON = backend_unavailable("cuda_ipc")
needs_backend = pytest.mark.skipif(_REASON is not None, reason=f"the cuda_ipc backend is unavailable: {_REASON}")


def _chan() -> str:
    return f"t/grow-gpu-{uuid.uuid4().hex[:8]}"


def _in_segment(rx, t) -> bool:
    return any(seg is not None and seg[0] <= t.data_ptr() < seg[0] + seg[1] for seg in rx._receiver.pool.segs)


@needs_backend
def test_a_payload_larger_than_the_pool_and_three_times_the_pool_held(procs, tmp_path):
    ch, out = _chan(), str(tmp_path / "out.json")
    with omnilink.connect("cuda_ipc", channel=ch, role="receiver", device="cuda:0", pool_bytes=8 * MIB) as rx:
        p = start_process(procs, growth_sender, ch, out, 3, 8)  # 3 x 8 MiB
        held = [rx.get(f"k{i}", timeout=120) for i in range(3)]  # three times the pool, held
        rx._receiver.idle_s = 0.5  # (default 2 s)
        for i, got in enumerate(held):
            assert got["x"].is_cuda and _in_segment(rx, got["x"])
            assert torch.equal(got["x"], big(8, i + 1, "cuda:0"))
        st = rx.stats()
        assert st.pool_segments >= 2 and st.pool_bytes_now >= 24 * MIB and st.device_gets == 3
        rec = wait_json(out, p)
        assert rec["stats"] == 4
        rx.get("unread", timeout=60)
        del held, got
        open(out + ".done", "w").close()
        p.join(60)
        assert p.exitcode == 0
        torch.cuda.synchronize()
        deadline = time.monotonic() + 30  # idle segments are given back
        while rx.stats().pool_segments > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (rx.stats().pool_segments, rx.stats().pool_bytes_now) == (1, 8 * MIB)
    collect_garbage()
    assert not [e for e in os.listdir("/dev/shm") if f"{p.pid}-" in e]


@needs_backend
def test_growth_past_pool_max_bytes_is_a_capacity_error(tmp_path):
    ch = _chan()
    with omnilink.connect("cuda_ipc", channel=ch, role="receiver", device="cuda:0", pool_bytes=2 * MIB,
                          pool_max_bytes=4 * MIB) as rx, \
            omnilink.connect("cuda_ipc", channel=ch, role="sender", linger=0) as tx:
        with pytest.raises(omnilink.CapacityError, match="pool_max_bytes"):
            tx.put("huge", {"x": big(8, 1, "cuda:0")}, timeout=30)
        tx.put("fits", {"x": big(2, 2, "cuda:0")}, timeout=30)
        assert torch.equal(rx.get("fits", timeout=30)["x"], big(2, 2, "cuda:0"))


@needs_backend
def test_shm_device_ipc_sends_a_payload_larger_than_its_pool_by_device_ipc(tmp_path):
    ch = _chan()
    with omnilink.connect("shm", channel=ch, role="receiver", device_ipc="on", ipc_pool_bytes=2 * MIB) as rx, \
            omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="auto",
                             ipc_min_bytes=0) as tx:
        deadline = time.monotonic() + 30
        while True:  # the route finds the pool within its probe period
            tx.put("big", {"x": big(8, 3, "cuda:0")}, timeout=30)
            got = rx.get("big", timeout=30, device="cuda:0")
            assert torch.equal(got["x"], big(8, 3, "cuda:0"))
            if tx.stats().ipc_puts:
                break
            assert time.monotonic() < deadline
            time.sleep(0.3)
        assert rx.stats().pool_segments >= 2 and tx.stats().ipc_fallbacks == 0
        del got


@needs_backend
def test_sigkill_of_the_receiver_of_a_grown_pool(procs, tmp_path):
    ch, out = _chan(), str(tmp_path / "out.json")
    free0 = torch.cuda.mem_get_info(0)[0]
    p = start_process(procs, growth_receiver, ch, out, 4 * MIB, 16)
    with omnilink.connect("cuda_ipc", channel=ch, role="sender", linger=0) as tx:
        tx.put("k0", {"x": big(16, 1, "cuda:0")}, timeout=120)
        rec = wait_json(out, p)
        assert rec["ok"] and rec["segments"] == 2
        assert len(tx._sender.tx.live) == 2
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        with pytest.raises(omnilink.PeerLostError):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                tx.put("after", {"x": torch.ones(4, device="cuda:0")}, timeout=5)
                time.sleep(0.1)
        assert tx._sender.tx is None
    deadline = time.monotonic() + 30
    while torch.cuda.mem_get_info(0)[0] < free0 - (64 << 20) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert torch.cuda.mem_get_info(0)[0] >= free0 - (64 << 20), "the dead receiver's segments were not freed"
    removed = collect_garbage()
    assert any(f"-a{p.pid}-" in e for e in removed), removed
    assert not [e for e in os.listdir("/dev/shm") if f"{p.pid}-" in e]


@needs_backend
def test_sigkill_of_the_sender_of_a_grown_pool(procs, tmp_path):
    ch, out = _chan(), str(tmp_path / "out.json")
    with omnilink.connect("cuda_ipc", channel=ch, role="receiver", device="cuda:0", pool_bytes=4 * MIB) as rx:
        p = start_process(procs, growth_sender, ch, out, 1, 16)
        got = rx.get("k0", timeout=120)
        wait_json(out, p)
        torch.cuda.synchronize()
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert rx.stats().pool_segments == 2
        assert torch.equal(got["x"], big(16, 1, "cuda:0"))  # our own segment stays valid
        with omnilink.connect("cuda_ipc", channel=ch, role="sender", linger=0) as tx:
            deadline = time.monotonic() + 60
            while True:
                try:
                    tx.put("again", {"x": big(2, 5, "cuda:0")}, timeout=30)
                    break
                except omnilink.PeerLostError:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
            assert torch.equal(rx.get("again", timeout=30)["x"], big(2, 5, "cuda:0"))
        assert torch.equal(got["x"], big(16, 1, "cuda:0"))
        del got
    collect_garbage()
    assert not [e for e in os.listdir("/dev/shm") if f"{p.pid}-" in e]
