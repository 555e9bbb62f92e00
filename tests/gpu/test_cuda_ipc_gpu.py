"""The ``cuda_ipc`` backend on real GPUs, two processes: bytes equal (bf16, mixed
CPU/CUDA/metadata), zero-copy by address, sources overwritten right after ``put``, the
host blocking in neither ``put`` nor ``get``, the conformance suite, SIGKILL of either
side (pool memory given back, ``/dev/shm`` clean) and cuda:0 <- cuda:1 with peer access
both ways. Skipped with a reason on a machine without CUDA (or without cuda-python)."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest

import omnilink
from omnilink.connectors import backend_unavailable
from omnilink.connectors.shm import collect_garbage
from omnilink.testing import CHECKS, check_connector
from tests.gpu._cuda_ipc_workers import mixed_payload, receiver_holding, sender
from tests.procs import start_process, wait_json

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

#: None where the backend works; else its own reason (no CUDA device, no cuda-python)
_REASON = backend_unavailable("cuda_ipc")
needs_backend = pytest.mark.skipif(_REASON is not None, reason=f"the cuda_ipc backend is unavailable: {_REASON}")


def _chan() -> str:
    return f"t/cipc-gpu-{uuid.uuid4().hex[:8]}"


def _expect_mixed(got: dict, seed: int, device: str, pool: tuple[int, int]) -> None:
    want = mixed_payload(seed, device)
    lo, hi = pool
    for name in ("hidden", "ids", "strided", "scalar", "empty"):
        t = got[name]
        assert t.device == torch.device(device) and t.dtype == want[name].dtype, name
        assert tuple(t.shape) == tuple(want[name].shape), name
        assert torch.equal(t, want[name]), f"{name}: bytes differ"
        if t.numel():
            assert lo <= t.data_ptr() < hi, f"{name} is not a view of the receiver's pool"
    assert torch.equal(got["cpu"], want["cpu"]) and not got["cpu"].is_cuda
    assert got["meta"] == want["meta"]


def _pool(rx) -> tuple[int, int]:
    return rx._receiver.pool.ptr, rx._receiver.pool.ptr + rx._receiver.pool.nbytes


@needs_backend
def test_two_processes_round_trip_bf16_mixed_zero_copy(procs, tmp_path):
    ch, out = _chan(), str(tmp_path / "out.json")
    with omnilink.connect("cuda_ipc", channel=ch, role="receiver", device="cuda:0", pool_bytes=64 << 20) as rx:
        p = start_process(procs, sender, ch, "mixed", "cuda:0", out)
        for seed in (1, 2, 3):
            got = rx.get(f"mixed-{seed}", timeout=120)
            _expect_mixed(got, seed, "cuda:0", _pool(rx))
            del got
        wait_json(out, p)
        p.join(60)
        assert p.exitcode == 0
        assert rx.stats().device_gets == 3
        torch.cuda.synchronize()
        deadline = time.monotonic() + 10  # frees run on the completion thread once the stream is past
        while rx.stats().blocks_in_use and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rx.stats().blocks_in_use == 0


@needs_backend
@pytest.mark.parametrize("src", ["cuda:0", pytest.param("cuda:1", marks=pytest.mark.multigpu)])
def test_put_and_get_do_not_block_the_host_and_sources_may_be_overwritten(procs, tmp_path, src):
    # src cuda:1: the copies are pulled by the pool's GPU after the producer's stream,
    # which then waits for them (the fill after put must not reach the copy).
    ch, out = _chan(), str(tmp_path / "out.json")
    with omnilink.connect("cuda_ipc", channel=ch, role="receiver", device="cuda:0", pool_bytes=64 << 20) as rx:
        p = start_process(procs, sender, ch, "overwrite", src, out)
        rx.get("warm", timeout=120)
        torch.cuda.synchronize()
        got = rx.get("ow", timeout=120)
        # The sender's producer kernel (~1 s) still runs: our stream waits on the copy's
        # event, the host did not.
        busy = not torch.cuda.current_stream().query()
        rec = wait_json(out, p)
        assert rec["stream_busy_after_put"], "put blocked the host until the producer's kernel ended"
        assert busy, "get blocked the host until the copy was done"
        assert torch.equal(got["x"], torch.full((1 << 20,), 7.0, device="cuda:0")), \
            "the source was overwritten after put returned, and the copy saw it"
        p.join(60)
        assert p.exitcode == 0


@needs_backend
def test_many_payloads_reuse_pool_blocks_and_slots(procs, tmp_path):
    ch, out = _chan(), str(tmp_path / "out.json")
    with omnilink.connect("cuda_ipc", channel=ch, role="receiver", device="cuda:0", pool_bytes=4 << 20,
                          event_slots=8) as rx:
        p = start_process(procs, sender, ch, "many", "cuda:0", out)
        for i in range(64):
            got = rx.get(f"many-{i}", timeout=120)
            n = 1 + (i * 7919) % (1 << 20)
            assert got["x"].shape == (n,) and bool((got["x"] == i % 100).all()), i
            del got
        wait_json(out, p)
        p.join(60)
        assert p.exitcode == 0


@needs_backend
def test_in_process_pair_with_cuda_tensors():
    ch = _chan()
    with omnilink.connect("cuda_ipc", channel=ch, role="receiver", pool_bytes=32 << 20) as rx, \
            omnilink.connect("cuda_ipc", channel=ch, role="sender") as tx:
        payload = mixed_payload(5, "cuda:0")
        assert tx.put("k", payload) == omnilink.encoded_size(payload)
        _expect_mixed(rx.get("k", timeout=30), 5, "cuda:0", _pool(rx))


@needs_backend
def test_put_async_copies_after_what_the_caller_queued():
    from tests.gpu._cuda_ipc_workers import LONG_SLEEP_CYCLES

    ch = _chan()
    with omnilink.connect("cuda_ipc", channel=ch, role="receiver", pool_bytes=32 << 20) as rx, \
            omnilink.connect("cuda_ipc", channel=ch, role="sender") as tx:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # the put thread's current stream is the default one
            x = torch.empty(1 << 20, device="cuda:0")
            torch.cuda._sleep(LONG_SLEEP_CYCLES // 4)
            x.fill_(3.0)
            fut = tx.put_async("pa", {"x": x})
        fut.result(timeout=60)
        got = rx.get("pa", timeout=60)
        assert torch.equal(got["x"], torch.full((1 << 20,), 3.0, device="cuda:0"))


def _pair(channel: str):
    rx = omnilink.connect("cuda_ipc", channel=channel, role="receiver", pool_bytes=96 << 20)
    try:
        tx = omnilink.connect("cuda_ipc", channel=channel, role="sender", linger=0)
    except BaseException:
        rx.close()
        raise
    return tx, rx


@needs_backend
@pytest.mark.parametrize("check", list(CHECKS))
def test_conformance_on_the_device(check):
    assert check_connector(_pair, only=[check], huge_bytes=64 << 20) == [check]


@needs_backend
def test_sigkill_of_the_receiver_frees_its_pool(procs, tmp_path):
    ch, out = _chan(), str(tmp_path / "out.json")
    pool_bytes = 1 << 30
    torch.cuda.init()
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info(0)
    p = start_process(procs, receiver_holding, ch, "cuda:0", pool_bytes, out)
    with omnilink.connect("cuda_ipc", channel=ch, role="sender", timeout=120.0, linger=0) as tx:
        tx.put("mixed-1", mixed_payload(1, "cuda:0"))
        rec = wait_json(out, p)
        assert rec["ok"]
        assert torch.cuda.mem_get_info(0)[0] < free0 - pool_bytes // 2  # the pool is there
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        with pytest.raises(omnilink.PeerLostError):
            tx.put("after", {"x": torch.ones(4, device="cuda:0")}, timeout=5)
        assert tx._sender.tx is None  # handles closed
        deadline = time.monotonic() + 30
        while torch.cuda.mem_get_info(0)[0] < free0 - (64 << 20) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert torch.cuda.mem_get_info(0)[0] >= free0 - (64 << 20), "the dead receiver's pool was not freed"
    removed = collect_garbage()
    assert any(f"-a{p.pid}-" in e for e in removed), removed  # its pool directory
    assert not [e for e in os.listdir("/dev/shm") if f"{p.pid}-" in e]


@needs_backend
def test_sigkill_of_the_sender_leaves_the_pool_intact(procs, tmp_path):
    ch, out = _chan(), str(tmp_path / "out.json")
    with omnilink.connect("cuda_ipc", channel=ch, role="receiver", device="cuda:0", pool_bytes=64 << 20) as rx:
        p = start_process(procs, sender, ch, "kill_me", "cuda:0", out)
        rec = wait_json(out, p)
        got = rx.get("mixed-1", timeout=60)
        torch.cuda.synchronize()
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        _expect_mixed(got, 1, "cuda:0", _pool(rx))  # views of our own pool stay valid
        for k in ("mixed-2", "mixed-3"):  # published before the death: read, or lost, never garbage
            try:
                _expect_mixed(rx.get(k, timeout=10), int(k[-1]), "cuda:0", _pool(rx))
            except omnilink.PeerLostError:
                pass
        out2 = str(tmp_path / "out2.json")
        p2 = start_process(procs, sender, ch, "again", "cuda:0", out2)  # a new sender attaches
        deadline = time.monotonic() + 120
        for seed in (1, 2, 3):
            while True:
                try:
                    again = rx.get(f"again-{seed}", timeout=10)
                    break
                except omnilink.PeerLostError:
                    # No live sender on the channel until the new one has joined (the shm
                    # contract: a key nobody alive can still send is lost); it starts now.
                    assert time.monotonic() < deadline and p2.is_alive()
                    time.sleep(0.2)
            _expect_mixed(again, seed, "cuda:0", _pool(rx))
            del again
        _expect_mixed(got, 1, "cuda:0", _pool(rx))  # the new sender did not write over held blocks
        wait_json(out2, p2)
        p2.join(60)
        assert rec["pid"] == p.pid
    collect_garbage()
    assert not [e for e in os.listdir("/dev/shm") if f"{p.pid}-" in e]


@needs_backend
@pytest.mark.multigpu
@pytest.mark.parametrize("current", [0, 1], ids=["cuda0-current", "cuda1-current"])
def test_cuda1_to_cuda0_with_peer_access_both_ways(procs, tmp_path, current):
    # current=1: the receiving thread has the other GPU current while it gets into
    # cuda:0 (its default stream, handle 0, is then CUDA's stream of cuda:1): the wait
    # for the sender's copy must still go to cuda:0's stream (it crashed in the driver).
    ch, out = _chan(), str(tmp_path / "out.json")
    with omnilink.connect("cuda_ipc", channel=ch, role="receiver", device="cuda:0", pool_bytes=64 << 20) as rx:
        p = start_process(procs, sender, ch, "peer", "cuda:1", out)
        torch.cuda.set_device(current)
        try:
            got = rx.get("mixed-1", timeout=120)
            assert torch.cuda.current_device() == current
        finally:
            torch.cuda.set_device(0)
        want = mixed_payload(1, "cuda:1")
        assert got["hidden"].device == torch.device("cuda:0")
        assert torch.equal(got["hidden"].cpu(), want["hidden"].cpu())
        lo, hi = _pool(rx)
        assert lo <= got["hidden"].data_ptr() < hi
        rec = wait_json(out, p)
        if torch.cuda.can_device_access_peer(0, 1):
            assert rec["peers"] == [[0, 1], [1, 0]]
        p.join(60)
        assert p.exitcode == 0


@needs_backend
def test_benchmark_quick_configuration(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    # The same-GPU case only: the cross-GPU road has its own test above, and the full
    # benchmark measures it (a 2x H200 run of every GPU test overran its limit here).
    r = subprocess.run([sys.executable, "benchmarks/bench_cuda_ipc.py", "--quick", "--cases", "same",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(out.read_text())
    assert rec["results"] and all(row["gbps"] > 0 for row in rec["results"] if "gbps" in row)
    lat = {row["what"]: row["p50_us"] for row in rec["latency"]}
    assert set(lat) == {"raw IPC floor", "cuda_ipc", "shm", "shm, host tensors"}, lat
    assert all(v > 0 for v in lat.values()), lat
