"""The nixl backend with GPU memory: the receiver's pool on its GPU, payloads of GPU
tensors (and a CPU tensor beside them) from another process, received as views of
the pool on that GPU, bit for bit. With two GPUs the sender's tensors are on cuda:0 and
the pool on cuda:1. Skipped without a GPU or without NIXL."""

from __future__ import annotations

import os
import queue

import pytest

import omnilink
from omnilink.connectors import backend_unavailable
from tests.gpu import _nixl_gpu_workers as workers
from tests.nixl_pair import count_creates, record_bell
from tests.procs import CTX, start_process

torch = pytest.importorskip("torch")
_REASON = backend_unavailable("nixl")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_REASON is not None, reason=f"nixl backend unavailable: {_REASON}")]
WAIT = 120.0


def _devices() -> tuple[str, str]:
    n = torch.cuda.device_count()
    return ("cuda:0", "cuda:1") if n >= 2 else ("cuda:0", "cuda:0")


@pytest.fixture
def on_dst():
    """The receiving GPU current for the test, the former one back after it."""
    src, dst = _devices()
    with torch.cuda.device(torch.device(dst)):
        yield src, dst


def test_gpu_payloads_land_in_the_device_pool(procs, on_dst):
    src, dst = on_dst
    channel = f"olnx/gpu-{os.getpid()}"
    with omnilink.connect("nixl", channel=channel, role="receiver", endpoint="tcp://127.0.0.1:*", device=dst,
                          pool_bytes=64 << 20, timeout=WAIT) as rx:
        q = CTX.Queue()
        start_process(procs, workers.sender, channel, rx.endpoint, src, 3, q)
        try:
            msg = q.get(timeout=WAIT)
        except queue.Empty:
            pytest.fail("no report from the sender")
        assert msg == ("sent", 3), msg
        pool = rx._rx.pool
        for i in range(3):
            got = rx.get(f"g{i}")
            want = workers.gpu_payload(i, "cpu")
            for name in ("hidden_states.output", "ids.output", "codes.audio"):
                t = got[name]
                assert t.device == torch.device(dst), (name, t.device)
                assert pool.addr <= t.data_ptr() < pool.addr + pool.nbytes, name  # a view of the pool
                assert t.dtype == want[name].dtype and torch.equal(t.cpu(), want[name]), name
            assert bool(got["meta"]["finished"]) == (i == 2) and got["speaker"] == "Ethan"
            del got, t
        torch.cuda.synchronize()
        assert rx.stats().blocks_in_use == 0


def test_host_tensors_into_a_device_pool_in_one_process():
    dev = _devices()[1]
    channel = f"olnx/gpu1-{os.getpid()}"
    with omnilink.connect("nixl", channel=channel, role="receiver", endpoint="tcp://127.0.0.1:*", device=dev,
                          pool_bytes=16 << 20, timeout=WAIT) as rx, \
         omnilink.connect("nixl", channel=channel, role="sender", endpoint=rx.endpoint, timeout=WAIT) as tx:
        a = torch.arange(4096, dtype=torch.float32)
        tx.put("h", {"a": a, "b": torch.ones(5, dtype=torch.bool, device=dev)})
        got = rx.get("h")
        assert got["a"].device == torch.device(dev) and torch.equal(got["a"].cpu(), a)
        assert bool(got["b"].all())


def test_direct_writes_register_each_allocation_once(monkeypatch):
    """Tensors of one CUDA allocation are written from their own memory under one
    registration of that allocation (made by the first WRITE, kept); an allocation made
    after the first was freed (``empty_cache``) gets its own, and every payload arrives
    bit for bit."""
    from omnilink.connectors.nixl import connector as nx

    monkeypatch.setattr(nx, "DIRECT_CACHED_MIN_BYTES", 1 << 20)  # the 4 MiB parts go direct
    src, dst = _devices()
    channel = f"olnx/regs-{os.getpid()}"
    with omnilink.connect("nixl", channel=channel, role="receiver", endpoint="tcp://127.0.0.1:*", device=dst,
                          pool_bytes=64 << 20, timeout=WAIT) as rx, \
         omnilink.connect("nixl", channel=channel, role="sender", endpoint=rx.endpoint, timeout=WAIT) as tx:
        whole = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, device=src)
        for i in range(4):
            part = whole[i * (4 << 20):(i + 1) * (4 << 20)]
            tx.put(f"r{i}", {"t": part, "i": i})
            got = rx.get(f"r{i}")
            assert got["t"].device == torch.device(dst) and torch.equal(got["t"].cpu(), part.cpu()) and got["i"] == i
            del got
        regs = tx._tx.regs
        assert regs is not None and (regs.misses, regs.hits) == (1, 3)
        del whole, part
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        fresh = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, device=src)
        tx.put("fresh", {"t": fresh})
        got = rx.get("fresh")
        assert torch.equal(got["t"].cpu(), fresh.cpu())
        assert regs.misses == 2 and len(regs) <= 2
        del got


def test_direct_writes_of_the_same_memory_post_their_kept_request_again(monkeypatch):
    """One payload at a time from one CUDA tensor (written from its own memory, its
    block freed before the next): the WRITE's transfer request is made once and posted
    again (``agent.KEPT_REQUESTS``), and each payload carries the bytes the tensor held
    at its put."""
    from omnilink.connectors.nixl import agent as nixl_agent
    from omnilink.connectors.nixl import connector as nx

    monkeypatch.setattr(nx, "DIRECT_CACHED_MIN_BYTES", 1 << 20)  # 4 MiB goes direct
    assert nixl_agent.KEPT_REQUESTS > 0
    src, dst = _devices()
    channel = f"olnx/keep-{os.getpid()}"
    with omnilink.connect("nixl", channel=channel, role="receiver", endpoint="tcp://127.0.0.1:*", device=dst,
                          pool_bytes=64 << 20, timeout=WAIT) as rx, \
         omnilink.connect("nixl", channel=channel, role="sender", endpoint=rx.endpoint, timeout=WAIT) as tx:
        t = torch.zeros(4 << 20, dtype=torch.uint8, device=src)
        tx.put("warm", {"t": t})
        del rx.get("warm")["t"]
        agent = tx._tx.agent
        made = count_creates(agent)
        for i in range(6):
            t.fill_(i + 1)
            tx.put(f"k{i}", {"t": t, "i": i})
            got = rx.get(f"k{i}")
            assert got["i"] == i and torch.equal(got["t"].cpu(), torch.full((4 << 20,), i + 1, dtype=torch.uint8))
            del got  # its block comes free: the next payload takes it again
        assert len(made) <= 2, len(made)
        assert agent._kept and not agent._posted
    assert not agent._kept  # released with the agent


def test_large_cuda_tensors_are_written_from_their_own_memory(monkeypatch):
    """A CUDA tensor of at least DIRECT_MIN_BYTES goes from its own memory (registered
    for the WRITE): the staging buffer holds only the rest; a tensor held twice, small
    GPU and CPU tensors and a strided large one (staged) arrive bit for bit, and the
    next payload of the same shape too (the registrations were dropped)."""
    from omnilink.connectors.nixl import connector as nx

    monkeypatch.setattr(nx, "DIRECT_MIN_BYTES", 1 << 20)
    monkeypatch.setattr(nx, "DIRECT_CACHED_MIN_BYTES", 1 << 20)
    src, dst = _devices()
    channel = f"olnx/direct-{os.getpid()}"
    with omnilink.connect("nixl", channel=channel, role="receiver", endpoint="tcp://127.0.0.1:*", device=dst,
                          pool_bytes=64 << 20, timeout=WAIT) as rx, \
         omnilink.connect("nixl", channel=channel, role="sender", endpoint=rx.endpoint, timeout=WAIT) as tx:
        for i in range(3):
            big = torch.randn(1 << 20, device=src) + i  # 4 MiB
            strided = torch.randn(1024, 1024, device=src).t()  # 4 MiB, not contiguous: staged
            payload = {"big": big, "again": big, "small": torch.arange(300, device=src) + i,
                       "ids": torch.arange(16) + i, "strided": strided, "meta": {"i": i}}
            tx.put(f"d{i}", payload)
            got = rx.get(f"d{i}")
            for name in ("big", "again", "small", "strided"):
                assert got[name].device == torch.device(dst), name
                assert torch.equal(got[name].cpu(), payload[name].cpu()), name
            assert torch.equal(got["ids"].cpu(), payload["ids"]) and got["meta"] == {"i": i}
            del got
        staging = tx._tx.dev_staging[torch.device(src).index]
        assert staging.nbytes < 3 * big.nbytes  # only the small, strided and padding bytes
        assert not tx._tx._kept_regs


def test_gpu_payloads_are_published_ahead_of_their_write():
    """A payload is published before its WRITE (the receiver decodes views of its device
    pool meanwhile) and made gettable by a ``written`` message: every payload arrives
    bit for bit, staged or written from its own memory (a small one too: nothing goes
    inline to a device pool by default)."""
    from omnilink.connectors.nixl import wire

    src, dst = _devices()
    channel = f"olnx/ahead-{os.getpid()}"
    with omnilink.connect("nixl", channel=channel, role="receiver", endpoint="tcp://127.0.0.1:*", device=dst,
                          pool_bytes=128 << 20, timeout=WAIT) as rx, \
         omnilink.connect("nixl", channel=channel, role="sender", endpoint=rx.endpoint, timeout=WAIT) as tx:
        sent = record_bell(tx)
        for i, n in enumerate((4096, 1 << 20, 32 << 20)):
            sent.clear()
            hidden = torch.randint(0, 256, (n,), dtype=torch.uint8, device=src)
            small = torch.arange(16, device=src)  # staged beside it
            tx.put(f"a{i}", {"hidden": hidden, "small": small, "i": i})
            got = rx.get(f"a{i}")
            assert got["hidden"].device == torch.device(dst) and got["i"] == i
            assert torch.equal(got["hidden"].cpu(), hidden.cpu()) and torch.equal(got["small"].cpu(), small.cpu())
            assert [type(m).__name__ for m in sent] == ["Publish", "Written"], sent
            assert sent[0].written is False and sent[1].status == wire.WRITTEN_OK and not sent[0].data
            del got
        assert not rx._rx.ahead_keys


@pytest.mark.parametrize("pool_on", ["device", "host"])
def test_small_gpu_payloads_go_inline(monkeypatch, pool_on):
    """A payload of at most ``INLINE_MAX_BYTES`` of data travels in its publish (no
    WRITE: the sender's agent refuses any here) to a receiver with a host pool, or with
    a device pool under ``INLINE_TO_DEVICE`` (off by default), which copies it into its
    pool: GPU tensors (produced on a stream of the caller's, not the default one),
    strided ones, a bool and a CPU tensor beside them land as views of that pool, bit
    for bit."""
    from omnilink.connectors.nixl import connector as nx

    src, dst = _devices()
    if pool_on == "device":
        monkeypatch.setattr(nx, "INLINE_TO_DEVICE", True)
    channel = f"olnx/inline-{pool_on}-{os.getpid()}"
    with omnilink.connect("nixl", channel=channel, role="receiver", endpoint="tcp://127.0.0.1:*",
                          device=dst if pool_on == "device" else None, pool_bytes=16 << 20, timeout=WAIT) as rx, \
         omnilink.connect("nixl", channel=channel, role="sender", endpoint=rx.endpoint, timeout=WAIT) as tx:
        tx.put("warm", {"t": torch.arange(4, device=src)})
        rx.get("warm")

        def no_write(*_a, **_k):
            raise AssertionError("a small payload was written")

        tx._tx.agent.write = no_write
        pool = rx._rx.pool
        landed_on = torch.device(dst) if pool_on == "device" else torch.device("cpu")
        side = torch.cuda.Stream(torch.device(src))
        for i in range(3):
            with torch.cuda.stream(side):
                payload = {"h": torch.randint(0, 256, (8192,), dtype=torch.uint8, device=src) + i,
                           "strided": (torch.arange(64 * 32, device=src, dtype=torch.float32) + i).view(64, 32).t(),
                           "b": torch.arange(9, device=src) % 2 == 0, "ids": torch.arange(7) + i, "i": i}
                tx.put(f"s{i}", payload)
            got = rx.get(f"s{i}")
            for name in ("h", "strided", "b", "ids"):
                t = got[name]
                assert t.device == landed_on, name
                assert pool.addr <= t.data_ptr() < pool.addr + pool.nbytes, name
                assert torch.equal(t.cpu(), payload[name].cpu()), name
            assert got["i"] == i
            del got, t


def test_small_gpu_payloads_published_once_written_below_ahead_device_min_bytes(monkeypatch):
    """Below ``AHEAD_DEVICE_MIN_BYTES`` a payload with device memory is published once
    its WRITE completed, in one message (a 4 KiB one here), and arrives bit for bit;
    from ``AHEAD_MIN_BYTES`` it is published ahead all the same."""
    from omnilink.connectors.nixl import connector as nx
    from omnilink.connectors.nixl import wire

    monkeypatch.setattr(nx, "AHEAD_DEVICE_MIN_BYTES", 64 << 10)
    src, dst = _devices()
    channel = f"olnx/after-{os.getpid()}"
    with omnilink.connect("nixl", channel=channel, role="receiver", endpoint="tcp://127.0.0.1:*", device=dst,
                          pool_bytes=32 << 20, timeout=WAIT) as rx, \
         omnilink.connect("nixl", channel=channel, role="sender", endpoint=rx.endpoint, timeout=WAIT) as tx:
        sent = record_bell(tx)
        for i, (n, names) in enumerate(((4096, ["Publish"]), (2 << 20, ["Publish", "Written"]))):
            sent.clear()
            hidden = torch.randint(0, 256, (n,), dtype=torch.uint8, device=src)
            tx.put(f"w{i}", {"hidden": hidden, "i": i})
            got = rx.get(f"w{i}")
            assert got["hidden"].device == torch.device(dst) and torch.equal(got["hidden"].cpu(), hidden.cpu())
            assert [type(m).__name__ for m in sent] == names, sent
            assert sent[0].written is (names == ["Publish"]) and not sent[0].data
            if len(sent) > 1:
                assert sent[1].status == wire.WRITTEN_OK
            del got
