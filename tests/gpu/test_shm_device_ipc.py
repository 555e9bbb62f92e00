"""The shm backend's device-IPC route on a real GPU: which payloads take it (auto / on /
off), bytes, host gets of routed payloads, put_async, discard, and two processes."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import omnilink
from tests.gpu import _gpu_workers
from tests.procs import start_process

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _chan() -> str:
    return f"t/ipc-{uuid.uuid4().hex[:8]}"


def _wait_probe() -> None:
    from omnilink.connectors.shm.ipc import PROBE_EVERY_S

    time.sleep(PROBE_EVERY_S + 0.05)  # the sender looks for a pool at most this often


def test_auto_opens_a_pool_at_the_first_device_get_and_routes_large_payloads(monkeypatch):
    from omnilink.connectors.shm import ipc

    monkeypatch.setattr(ipc, "mps_serving", lambda: False)  # the 16 MiB threshold, MPS or not
    ch = _chan()
    with omnilink.connect("shm", channel=ch, role="receiver") as rx, \
            omnilink.connect("shm", channel=ch, role="sender", arena_bytes=128 * MiB, linger=0) as tx:
        from omnilink.connectors.shm.connector import DEFAULT_IPC_MIN_BYTES

        big = torch.randint(0, 255, (DEFAULT_IPC_MIN_BYTES,), dtype=torch.uint8, device="cuda")
        small = torch.arange(64, device="cuda")
        tx.put("k0", {"x": big}, timeout=30)  # no pool yet: the host path
        got = rx.get("k0", timeout=30, device="cuda:0")  # opens the pool
        assert torch.equal(got["x"], big)
        assert tx.stats().ipc_puts == 0 and tx.stats().device_puts == 1
        _wait_probe()
        payload = {"x": big, "ids": small, "cpu": torch.ones(3), "meta": {"step": 1}}
        tx.put("k1", payload, timeout=30)
        assert tx.stats().ipc_puts == 1, tx.stats()
        got = rx.get("k1", timeout=30, device="cuda:0")
        assert got["x"].is_cuda and torch.equal(got["x"], big) and torch.equal(got["ids"], small)
        assert torch.equal(got["cpu"].cpu(), torch.ones(3)) and got["meta"] == {"step": 1}
        assert rx.stats().ipc_gets == 1
        # Under ipc_min_bytes of CUDA tensors: the host path still.
        tx.put("k2", {"ids": small}, timeout=30)
        assert tx.stats().ipc_puts == 1
        assert torch.equal(rx.get("k2", timeout=30, device="cuda:0")["ids"], small)
        # A host get of a routed payload gets host tensors.
        tx.put("k3", {"x": big}, timeout=30)
        host = rx.get("k3", timeout=30)
        assert not host["x"].is_cuda and torch.equal(host["x"], big.cpu())
        assert tx.stats().ipc_puts == 2 and rx.stats().ipc_gets == 2


def test_routed_put_orders_after_the_producer_and_source_may_be_overwritten():
    ch = _chan()
    with omnilink.connect("shm", channel=ch, role="receiver", device_ipc="on") as rx, \
            omnilink.connect("shm", channel=ch, role="sender", arena_bytes=64 * MiB, linger=0, device_ipc="on") as tx:
        a = torch.randn(2048, 2048, device="cuda")
        x = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
        for _ in range(20):
            a = a @ a / 2048.0  # queue work ahead of the fill and the put
        x.fill_(7)
        tx.put("k", {"x": x, "s": torch.ones(4, device="cuda").t()}, timeout=30)
        x.fill_(9)  # after put returned: stream-ordered behind the copy
        got = rx.get_handle("k", timeout=30, device="cuda:0").synchronize(timeout=30)
        assert int(got["x"].min()) == 7 == int(got["x"].max())
        # put_async: the source freed at once, its memory reused, still intact.
        y = torch.full((8 * MiB,), 3, dtype=torch.uint8, device="cuda")
        fut = tx.put_async("a", {"x": y}, timeout=30)
        del y
        reused = [torch.full((8 * MiB,), 5, dtype=torch.uint8, device="cuda") for _ in range(4)]
        fut.result(30)
        got = rx.get("a", timeout=30, device="cuda:0")
        assert int(got["x"].min()) == 3 == int(got["x"].max()) and reused
        assert tx.stats().ipc_puts == 2 and rx.stats().ipc_gets == 2


def test_on_routes_small_payloads_and_off_never_routes():
    ch = _chan()
    with omnilink.connect("shm", channel=ch, role="receiver", device_ipc="on") as rx, \
            omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="on") as tx:
        v = torch.arange(16, device="cuda")
        tx.put("k", {"v": v}, timeout=30)
        assert tx.stats().ipc_puts == 1
        assert torch.equal(rx.get("k", timeout=30, device="cuda:0")["v"], v)
    ch = _chan()
    with omnilink.connect("shm", channel=ch, role="receiver", device_ipc="on") as rx, \
            omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="off") as tx:
        x = torch.ones(2 * MiB, dtype=torch.uint8, device="cuda")
        tx.put("k", {"x": x}, timeout=30)
        assert tx.stats().ipc_puts == 0 and tx.stats().device_puts == 1
        assert torch.equal(rx.get("k", timeout=30, device="cuda:0")["x"], x)


def test_discarded_routed_payload_frees_its_pool_block():
    ch = _chan()
    with omnilink.connect("shm", channel=ch, role="receiver", device_ipc="on", ipc_pool_bytes=8 * MiB) as rx, \
            omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="on") as tx:
        x = torch.ones(6 * MiB, dtype=torch.uint8, device="cuda")
        for i in range(4):  # 6 MiB each in an 8 MiB pool: only if each discard frees it
            tx.put(f"k{i}", {"x": x}, timeout=30)
            assert tx.stats().ipc_puts == i + 1
            assert rx.discard(f"k{i}")
        tx.put("last", {"x": x}, timeout=30)
        assert tx.stats().ipc_puts == 5
        assert torch.equal(rx.get("last", timeout=30, device="cuda:0")["x"], x)


def test_pool_full_falls_back_to_the_host_path_without_losing_anything():
    ch = _chan()
    # The pool may not grow past its 8 MiB: the second payload cannot fit beside the held one.
    with omnilink.connect("shm", channel=ch, role="receiver", device_ipc="on", ipc_pool_bytes=8 * MiB,
                          ipc_pool_max_bytes=8 * MiB) as rx, \
            omnilink.connect("shm", channel=ch, role="sender", arena_bytes=64 * MiB, linger=0,
                             device_ipc="on") as tx:
        x = torch.full((6 * MiB,), 1, dtype=torch.uint8, device="cuda")
        tx.put("a", {"x": x}, timeout=30)
        held = rx.get("a", timeout=30, device="cuda:0")  # holds the pool block
        tx.put("b", {"x": x * 2}, timeout=30)  # no room and no growth: host path at once
        s = tx.stats()
        assert s.ipc_puts == 1 and s.device_puts == 1
        # Counted, with the reason: a payload that took the slow road is never silent.
        # The growth it asked for is refused (CapacityError), or not answered within the
        # route's short wait for room (TransferTimeout): either way, named.
        assert s.ipc_fallbacks == 1 and s.ipc_fallback_reason.startswith(("CapacityError", "TransferTimeout")), s
        got = rx.get("b", timeout=30, device="cuda:0")
        assert int(got["x"].max()) == 2 and int(held["x"].max()) == 1


def test_two_processes_route_by_device_ipc(procs):
    ch = _chan()
    with omnilink.connect("shm", channel=ch, role="receiver", device_ipc="on") as rx:
        p = start_process(procs, _gpu_workers.ipc_sender, ch, 20, 3 * MiB)
        for i in range(20):
            got = rx.get(f"m{i}", timeout=60, device="cuda:0")
            assert got["i"] == i and got["x"].is_cuda
            assert int(got["x"].min()) == i % 251 == int(got["x"].max())
        p.join(60)
        assert p.exitcode == 0
        assert rx.stats().ipc_gets == 20


def test_vllm_omni_adapter_sends_large_cuda_payloads_by_device_ipc():
    from omnilink.connectors.shm.connector import DEFAULT_IPC_MIN_BYTES
    from omnilink.integrations.vllm_omni import OmnilinkConnector

    ch = _chan()
    rx = OmnilinkConnector({"backend": "shm", "channel": ch, "device": "cuda:0"})
    tx = OmnilinkConnector({"backend": "shm", "channel": ch, "options": {"arena_bytes": 64 << 20, "linger": 0}})
    try:
        assert rx.get("0", "1", "req1_0_0") is None  # opens the edge; its first device get opens the pool
        hidden = torch.randn(DEFAULT_IPC_MIN_BYTES // 2, device="cuda").to(torch.bfloat16).view(-1, 1024)
        ok, _, _ = tx.put("0", "1", "req1_0_0", {"hidden_states.output": hidden, "meta": {"finished": True}})
        assert ok
        end = time.monotonic() + 10
        got = None
        while got is None and time.monotonic() < end:
            got = rx.get("0", "1", "req1_0_0")
        assert got is not None
        data, _ = got
        assert data["hidden_states.output"].is_cuda and torch.equal(data["hidden_states.output"], hidden)
        assert data["meta"] == {"finished": True}
        assert sum(e["ipc_puts"] for e in tx.health()["edges"].values()) == 1
        assert sum(e["ipc_gets"] for e in rx.health()["edges"].values()) == 1
    finally:
        rx.close()
        tx.close()


def test_receiver_killed_while_holding_a_pool_view_sender_falls_back(procs):
    import os
    import signal
    import tempfile

    from omnilink.connectors.shm import collect_garbage

    ch = _chan()
    ready = tempfile.mktemp(prefix="oli-")
    r = start_process(procs, _gpu_workers.ipc_receiver_holding, ch, ready)
    from omnilink.connectors.cuda_ipc import live_pool_owner

    end = time.monotonic() + 60
    while live_pool_owner(ch) is None and time.monotonic() < end:
        time.sleep(0.02)
    with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=64 * MiB, linger=0, device_ipc="on") as tx:
        x = torch.full((4 * MiB,), 6, dtype=torch.uint8, device="cuda")
        tx.put("k0", {"x": x}, timeout=30)
        assert tx.stats().ipc_puts == 1
        while not os.path.exists(ready) and time.monotonic() < end:
            time.sleep(0.02)
        assert os.path.exists(ready), "receiver never got the payload"
        os.kill(r.pid, signal.SIGKILL)
        r.join(30)
        # The pool's owner is dead: the route drops its sender, the put takes the host path.
        tx.put("k1", {"x": x}, timeout=30)
        s = tx.stats()
        assert s.ipc_puts == 1 and s.device_puts == 1
    os.unlink(ready)
    collect_garbage()


def test_a_second_sender_takes_the_host_path_and_both_arrive():
    ch = _chan()
    with omnilink.connect("shm", channel=ch, role="receiver", device_ipc="on") as rx, \
            omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="on") as tx1, \
            omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="on") as tx2:
        x = torch.full((2 * MiB,), 4, dtype=torch.uint8, device="cuda")
        tx1.put("a", {"x": x}, timeout=30)
        tx2.put("b", {"x": x + 1}, timeout=30)  # cuda_ipc takes one sender per channel
        assert tx1.stats().ipc_puts == 1
        assert tx2.stats().ipc_puts == 0 and tx2.stats().device_puts == 1
        assert int(rx.get("a", timeout=30, device="cuda:0")["x"].max()) == 4
        assert int(rx.get("b", timeout=30, device="cuda:0")["x"].max()) == 5
        assert rx.stats().ipc_gets == 1 and rx.stats().device_gets == 1


def test_dual_connector_routes_to_its_own_pool():
    with omnilink.connect("shm", channel=_chan(), role="dual", linger=0, device_ipc="on") as c:
        x = torch.randn(1024, 1024, device="cuda")
        c.put("k", {"x": x}, timeout=30)
        got = c.get("k", timeout=30, device="cuda:0")
        assert torch.equal(got["x"], x)
        s = c.stats()
        assert s.ipc_puts == 1 and s.ipc_gets == 1


@contextlib.contextmanager
def _mps_pair(monkeypatch: Any, src: str, dst: str) -> Iterator[tuple[Any, Any]]:
    """A shm sender and receiver as under an MPS server (``mps_serving`` says so), the
    receiver's pool opened on ``dst`` by a first payload from ``src`` (the host path)
    and found by the sender's probe: ``(tx, rx)``."""
    from omnilink.connectors.devpool import ops as pool_ops
    from omnilink.connectors.shm import ipc

    monkeypatch.setattr(ipc, "mps_serving", lambda: True)
    monkeypatch.setattr(pool_ops, "mps_serving", lambda: True)  # (host tensors in the block across GPUs)
    ch = _chan()
    with omnilink.connect("shm", channel=ch, role="receiver") as rx, \
            omnilink.connect("shm", channel=ch, role="sender", linger=0) as tx:
        small = torch.arange(64, device=src)
        tx.put("k0", {"ids": small}, timeout=30)  # no pool yet: the host path
        assert torch.equal(rx.get("k0", timeout=30, device=dst)["ids"].cpu(), small.cpu())  # opens the pool
        _wait_probe()
        yield tx, rx


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_auto_routes_small_payloads_across_gpus_while_an_mps_server_serves_the_host(monkeypatch):
    # Under MPS a payload on cuda:0 for a pool on cuda:1 goes by device IPC at any size
    # (peer copies, then a send plan), its tensors arriving on cuda:1.
    with _mps_pair(monkeypatch, "cuda:0", "cuda:1") as (tx, rx):
        for i in range(1, 6):
            hidden = torch.randn(2048, device="cuda:0").to(torch.bfloat16)
            tx.put(f"k{i}", {"h": hidden, "cpu": torch.ones(3) * i, "meta": {"i": i}}, timeout=30)
            got = rx.get(f"k{i}", timeout=30, device="cuda:1")
            assert got["h"].device == torch.device("cuda:1") and torch.equal(got["h"].cpu(), hidden.cpu())
            assert torch.equal(got["cpu"].cpu(), torch.ones(3) * i) and got["meta"] == {"i": i}
        assert tx.stats().ipc_puts == 5, tx.stats()
        assert tx._ipc._tx.planned_puts >= 2


def test_auto_routes_small_payloads_while_an_mps_server_serves_the_host(monkeypatch):
    with _mps_pair(monkeypatch, "cuda:0", "cuda:0") as (tx, rx):
        small = torch.arange(64, device="cuda")
        tx.put("k1", {"ids": small, "cpu": torch.ones(3)}, timeout=30)
        assert tx.stats().ipc_puts == 1, tx.stats()
        got = rx.get("k1", timeout=30, device="cuda:0")
        assert torch.equal(got["ids"], small) and got["cpu"].is_cuda and torch.equal(got["cpu"].cpu(), torch.ones(3))
