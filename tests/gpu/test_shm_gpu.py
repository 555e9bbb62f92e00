"""The shm backend's GPU path on a real GPU: DMA into the arena, device gets, slices,
the put/put_async source contracts, the controllers' non-blocking claims, and SIGKILL
of either side with registered memory."""

from __future__ import annotations

import os
import signal
import tempfile
import uuid

import pytest

import omnilink
from tests.procs import start_process

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


def _chan() -> str:
    return f"t/gpu-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def pair():
    ch = _chan()
    # The host-staged path (device_ipc="off"); tests/gpu/test_shm_device_ipc.py has the other.
    tx = omnilink.connect("shm", channel=ch, role="sender", arena_bytes=256 << 20, linger=0, device_ipc="off")
    rx = omnilink.connect("shm", channel=ch, role="receiver", device_ipc="off")
    yield tx, rx
    rx.close()
    tx.close()


def _busy(ms: float = 50.0) -> None:
    """Queue about ``ms`` of GPU work on the current stream."""
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    a @ a
    end.record()
    end.synchronize()
    reps = max(1, int(ms / max(start.elapsed_time(end), 0.01)))
    for _ in range(reps):
        a = a @ a / 4096.0


def test_cuda_payload_round_trip_by_dma(pair):
    tx, rx = pair
    g = torch.Generator(device="cuda").manual_seed(1)
    payload = {"hidden_states.output": torch.randn(512, 1024, device="cuda", generator=g).to(torch.bfloat16),
               "ids": torch.arange(17, device="cuda"), "cpu": torch.ones(3), "meta": {"finished": True},
               "strided": torch.randn(64, 32, device="cuda", generator=g).t(), "scalar": torch.tensor(2.5, device="cuda")}
    tx.put("k", payload, timeout=10)
    got = rx.get("k", timeout=10, device="cuda:0")
    for name in ("hidden_states.output", "ids", "strided", "scalar"):
        assert got[name].is_cuda and torch.equal(got[name], payload[name]), name
    assert torch.equal(got["cpu"].cpu(), payload["cpu"]) and got["meta"] == {"finished": True}
    assert tx.stats().device_puts == 1 and rx.stats().device_gets == 1
    # A receiver without device= gets host tensors: zero-copy views of the arena.
    tx.put("k2", payload, timeout=10)
    host = rx.get("k2", timeout=10)
    assert not host["ids"].is_cuda and torch.equal(host["ids"], payload["ids"].cpu())


def test_sliced_payload_larger_than_the_arena(pair):
    tx, rx = pair
    big = torch.randint(0, 255, (600 << 20,), dtype=torch.uint8, device="cuda")  # > 256 MiB arena
    fut = tx.put_async("big", {"x": big, "small": torch.ones(4, device="cuda")}, timeout=60)
    got = rx.get("big", timeout=60, device="cuda:0")
    assert fut.result(60) > big.numel()
    assert torch.equal(got["x"], big) and torch.equal(got["small"], torch.ones(4, device="cuda"))
    assert tx.stats().sliced == 1 and rx.stats().sliced == 1


def test_source_overwritten_after_put_arrives_as_it_was(pair):
    tx, rx = pair
    x = torch.full((8 << 20,), 7, dtype=torch.uint8, device="cuda")
    _busy()  # the copy has to wait for this: put must still return only once it is done
    tx.put("k", {"x": x}, timeout=30)
    x.fill_(9)
    got = rx.get("k", timeout=30, device="cuda:0")
    assert int(got["x"].min()) == 7 == int(got["x"].max())


def test_small_payloads_copy_on_the_current_stream_intact(pair):
    # Under SMALL_DEVICE_BYTES: one copy per tensor on the current stream (strided,
    # conj and neg views gathered by torch), after the producer's queued work.
    tx, rx = pair
    g = torch.Generator(device="cuda").manual_seed(3)
    z = torch.randn(16, 8, dtype=torch.complex64, device="cuda", generator=g)
    payload = {"h": torch.randn(1, 2048, device="cuda", generator=g).to(torch.bfloat16),
               "ids": torch.arange(16, device="cuda"), "t": torch.randn(32, 16, device="cuda", generator=g).t(),
               "conj": z.conj(), "neg": torch._neg_view(torch.randn(8, device="cuda", generator=g)),
               "empty": torch.empty(0, 4, device="cuda"), "cpu": torch.arange(5), "meta": {"n": 3}}
    want = {k: (v.resolve_conj().resolve_neg().clone() if isinstance(v, torch.Tensor) else v) for k, v in payload.items()}
    h = payload["h"]
    _busy()
    h.mul_(2)  # queued behind the busy work: put must copy the result, not the old bytes
    want["h"] = want["h"] * 2
    for i in range(3):
        tx.put(f"k{i}", payload, timeout=30)
        got = rx.get(f"k{i}", timeout=30, device="cuda:0")
        for name, v in want.items():
            if isinstance(v, torch.Tensor):
                assert got[name].is_cuda and got[name].dtype == v.dtype, name
                assert torch.equal(got[name].cpu(), v.cpu()), name
            else:
                assert got[name] == v, name
    futs = [tx.put_async(f"a{i}", payload, timeout=30) for i in range(4)]
    for i, fut in enumerate(futs):
        fut.result(30)
        got = rx.get_handle(f"a{i}", timeout=30, device="cuda:0").synchronize(timeout=30)
        assert torch.equal(got["h"].cpu(), want["h"].cpu()) and torch.equal(got["t"].cpu(), want["t"].cpu())
    assert tx.stats().device_puts == 7 and rx.stats().device_gets == 7


def test_a_device_get_lands_the_whole_payload_in_one_allocation_and_gives_the_block_back(pair):
    # The receiver copies the frame's data region once into one device buffer; every
    # tensor is a view of it (one allocation, one DMA per message). Small frames land on
    # the current stream, larger ones on the copy stream; either way the arena block
    # goes back once the copy has completed.
    import time

    import numpy as np

    tx, rx = pair
    g = torch.Generator(device="cuda").manual_seed(11)
    for rows in (1, 256):  # 4 KiB (current stream) and 1 MiB (copy stream) of hidden state
        payload = {"h": torch.randn(rows, 2048, device="cuda", generator=g).to(torch.bfloat16),
                   "shape": torch.tensor([rows, 2048]), "ids": torch.arange(16, device="cuda"),
                   "meta": {"finished": torch.tensor(rows == 256), "chunk": rows}}
        for i in range(3):
            tx.put(f"r{rows}-{i}", payload, timeout=30)
            got = rx.get(f"r{rows}-{i}", timeout=30, device="cuda:0")
            tensors = [got["h"], got["shape"], got["ids"], got["meta"]["finished"]]
            assert all(t.is_cuda for t in tensors)
            assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one allocation
            assert torch.equal(got["h"], payload["h"]) and torch.equal(got["ids"], payload["ids"])
            assert got["shape"].tolist() == [rows, 2048] and bool(got["meta"]["finished"]) == (rows == 256)
            assert got["meta"]["chunk"] == rows
    # numpy arrays stay on the host: such a frame takes the general path, intact
    tx.put("np", {"a": np.arange(6).reshape(2, 3), "t": torch.ones(4, device="cuda")}, timeout=30)
    got = rx.get("np", timeout=30, device="cuda:0")
    assert isinstance(got["a"], np.ndarray) and got["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert got["t"].is_cuda and got["t"].tolist() == [1.0] * 4
    del got, tensors
    torch.cuda.synchronize()
    end = time.monotonic() + 30
    while rx.stats().bytes_held and time.monotonic() < end:
        time.sleep(0.01)  # the completer gives the blocks back once their copies are done
    assert rx.stats().bytes_held == 0


def test_mid_size_payloads_put_direct_and_put_async_intact(pair):
    # Between SMALL_DEVICE_BYTES and pipeline_bytes: put copies on the current stream,
    # put_async on the copy stream after the producer's event; the receiver's copy
    # stream lands them.
    tx, rx = pair
    g = torch.Generator(device="cuda").manual_seed(5)
    h = torch.randn(1024, 1024, device="cuda", generator=g).to(torch.bfloat16)
    t = torch.randn(512, 512, device="cuda", generator=g).t()
    want_h, want_t = h.clone(), t.contiguous()
    _busy()
    tx.put("m0", {"h": h, "t": t}, timeout=30)
    h.fill_(0)  # after put returned: must not show at the receiver
    got = rx.get("m0", timeout=30, device="cuda:0")
    assert torch.equal(got["h"], want_h) and torch.equal(got["t"], want_t)
    h.copy_(want_h)
    _busy()
    h.mul_(3)  # queued behind the busy work, before put_async: must be what arrives
    fut = tx.put_async("m1", {"h": h, "t": t}, timeout=30)
    fut.result(30)
    got = rx.get("m1", timeout=30, device="cuda:0")
    assert torch.equal(got["h"], want_h * 3) and torch.equal(got["t"], want_t)


def test_put_async_source_freed_and_reused_still_arrives_intact(pair):
    tx, rx = pair
    _busy()
    x = torch.full((32 << 20,), 3, dtype=torch.uint8, device="cuda")
    fut = tx.put_async("k", {"x": x}, timeout=30)
    ptr = x.data_ptr()
    del x
    # The allocator must not hand the freed block out before the copy has read it.
    reused = [torch.full((32 << 20,), 5, dtype=torch.uint8, device="cuda") for _ in range(4)]
    fut.result(30)
    got = rx.get("k", timeout=30, device="cuda:0")
    assert int(got["x"].min()) == 3 == int(got["x"].max())
    assert reused and ptr  # kept alive until here


def test_device_get_does_not_block_the_host_and_orders_the_stream(pair):
    tx, rx = pair
    x = torch.randn(64 << 18, device="cuda")  # 64 MiB
    tx.put("k", {"x": x}, timeout=30)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _busy(200)  # the copy stream is free, but the consumer stream is busy
        handle = rx.get_handle("k", timeout=30, device="cuda:0")
        got = handle.wait()  # the consumer stream waits; the host returns at once
        total = got["x"].double().sum()
    assert torch.cuda.current_stream() != side
    side.synchronize()
    assert torch.allclose(total, x.double().sum())
    assert handle.done()


def test_d2h_controller_submit_returns_before_the_copy(pair):
    from omnilink.cuda import AsyncD2HController

    with AsyncD2HController("cuda:0", pool_bytes=64 << 20) as ctl:
        x = torch.randn(1 << 22, device="cuda")
        _busy(200)
        fut = ctl.submit({"x": x, "n": 1})
        assert not fut.done()  # the producer's stream is still busy: the host was not held
        out = fut.result(30)
        assert out["x"].is_pinned() and torch.equal(out["x"], x.cpu())
        fut.release()
        assert ctl.pool.slots_in_use == 0


def test_sigkill_with_registered_memory_leaves_dev_shm_clean(procs):
    from omnilink.connectors.shm import collect_garbage

    from tests.gpu import _gpu_workers as w

    ch = _chan()
    ready = tempfile.mktemp(prefix="olg-")
    # Receiver killed while holding a device copy made from its registered mapping.
    s = start_process(procs, w.sender, ch, "k", 16 << 20, 3, 60.0, 64 << 20)
    r = start_process(procs, w.receiver_holding, ch, "k", ready)
    import time

    end = time.monotonic() + 120
    while not os.path.exists(ready) and time.monotonic() < end:
        time.sleep(0.05)
    assert os.path.exists(ready), "receiver never got the payload"
    os.kill(r.pid, signal.SIGKILL)
    r.join(30)
    os.kill(s.pid, signal.SIGKILL)  # and the sender, with its registered arena
    s.join(30)
    os.unlink(ready)
    collect_garbage()


def test_many_put_async_in_flight_arrive_in_order_and_intact(pair):
    tx, rx = pair
    srcs = [torch.full((1 << 20,), i, dtype=torch.uint8, device="cuda") for i in range(32)]
    _busy(100)  # every copy waits for this; the futures must not resolve before their copy
    futs = [tx.put_async(f"m{i}", {"x": s, "i": i}, timeout=30) for i, s in enumerate(srcs)]
    assert not futs[-1].done()
    assert [f.result(30) for f in futs] == [futs[0].result()] * 32
    for i in range(32):
        got = rx.get(f"m{i}", timeout=30, device="cuda:0")
        assert got["i"] == i and int(got["x"].min()) == i == int(got["x"].max())
    assert tx.stats().puts == 32 and tx.stats().device_puts == 32


@pytest.mark.multigpu
def test_cuda0_to_cuda1_through_shm(pair):
    tx, rx = pair
    for n in (4096, 8 << 20, 40 << 20):  # small path, DMA path, sliced path
        x = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
        tx.put(f"k{n}", {"x": x}, timeout=30)
        got = rx.get(f"k{n}", timeout=30, device="cuda:1")
        assert got["x"].device == torch.device("cuda", 1)
        assert torch.equal(got["x"].cpu(), x.cpu())
    assert torch.cuda.current_device() == 0  # the caller's current device is left alone


def test_vllm_omni_adapter_sends_cuda_payloads_and_lands_them_on_its_device():
    import time

    from omnilink.integrations.vllm_omni import OmnilinkConnector

    ch = f"t/vo-{uuid.uuid4().hex[:8]}"
    tx = OmnilinkConnector({"backend": "shm", "channel": ch, "options": {"arena_bytes": 64 << 20, "linger": 0}})
    rx = OmnilinkConnector({"backend": "shm", "channel": ch, "device": "cuda:0"})
    try:
        hidden = torch.randn(256, 1024, device="cuda").to(torch.bfloat16)
        ok, size, _ = tx.put("0", "1", "req1_0_0", {"hidden_states.output": hidden, "meta": {"finished": True}})
        assert ok and size > hidden.numel() * 2
        end = time.monotonic() + 10
        got = None
        while got is None and time.monotonic() < end:
            got = rx.get("0", "1", "req1_0_0")
        assert got is not None
        data, _ = got
        assert data["hidden_states.output"].is_cuda and torch.equal(data["hidden_states.output"], hidden)
        assert data["meta"] == {"finished": True}
    finally:
        rx.close()
        tx.close()


def test_aget_lands_cuda_payloads_on_the_device(pair):
    import asyncio

    tx, rx = pair
    x = torch.randn(1 << 18, device="cuda")  # 1 MiB: the DMA path

    async def main():
        waiting = asyncio.ensure_future(rx.aget("k", timeout=30, device="cuda:0"))
        await asyncio.sleep(0.05)
        await tx.aput("k", {"x": x}, timeout=30)
        return await waiting

    got = asyncio.run(main())
    assert got["x"].is_cuda and torch.equal(got["x"], x)


def test_handle_synchronize_with_timeout_is_woken_not_polled(pair):
    tx, rx = pair
    x = torch.randn(1 << 20, device="cuda")  # 4 MiB: the copy-stream path
    tx.put("k", {"x": x}, timeout=30)
    _busy(100)
    handle = rx.get_handle("k", timeout=30, device="cuda:0")
    got = handle.synchronize(timeout=30)
    assert handle.done() and torch.equal(got["x"], x)
    tx.put("s", {"x": torch.ones(8, device="cuda")}, timeout=30)  # small path, shared waiter
    small = rx.get_handle("s", timeout=30, device="cuda:0")
    assert torch.equal(small.synchronize(timeout=30)["x"], torch.ones(8, device="cuda"))
