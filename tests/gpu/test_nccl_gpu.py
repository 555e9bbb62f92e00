"""The nccl backend over real NCCL, on a machine with two GPUs.

Two processes, one per GPU, move payloads of several bf16 tensors; the receiver's copy
lives on cuda:1 and equals the sender's bit for bit. In one process, two connectors
(cuda:0 and cuda:1) check the stream contract of ``put``, staging of host data, the
packing of small device tensors into one transfer, many payloads through a small credit
window got in any order, and the device-mismatch errors.
"""

from __future__ import annotations

import multiprocessing as mp
import queue

import pytest

import omnilink
from omnilink import ConfigurationError
from tests.integration import _nccl_workers as workers

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

WAIT = 120.0
CTX = mp.get_context("spawn")


def _next(q):
    try:
        msg = q.get(timeout=WAIT)
    except queue.Empty:
        pytest.fail(f"no report from the workers within {WAIT} s")
    if msg[0] == "error":
        pytest.fail(f"a worker failed: {msg[1]}: {msg[2]}")
    return msg


@pytest.mark.multigpu
def test_two_processes_nccl_bf16_bit_exact(procs):
    port = workers.free_port()
    q = CTX.Queue()
    count = 5
    keys = [f"req{i}_0_0" for i in range(count)]
    for target, args in (
        (workers.sender, (port, "gpu/nccl", "nccl", "cuda:0", count, 8 << 20, q)),
        (workers.receiver, (port, "gpu/nccl", "nccl", "cuda:1", keys[::-1], q)),
    ):
        p = CTX.Process(target=target, args=args, daemon=True)
        p.start()
        procs.append(p)
    sent, got = {}, {}
    while len(sent) < count or len(got) < count:
        msg = _next(q)
        if msg[0] == "sent":
            sent[msg[1]] = msg[2]
        elif msg[0] == "got":
            got[msg[1]] = msg[2]
            assert msg[3] == "cuda:1", f"device tensors must arrive on cuda:1, got {msg[3]}"
            assert msg[4] == "cpu", f"host tensors must stay on the host, got {msg[4]}"
    assert got == sent
    for p in procs:
        p.join(WAIT)
        assert p.exitcode == 0


def _bits(t):
    """The raw bytes of ``t`` on the host (compares NaNs and -0.0 bit for bit)."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8)


@pytest.fixture
def gpu_pair():
    store = dist.HashStore()
    tx = omnilink.connect("nccl", channel="gpu/pair", role="sender", device="cuda:0", store=store)
    rx = omnilink.connect("nccl", channel="gpu/pair", role="receiver", device="cuda:1", store=store)
    try:
        yield tx, rx
    finally:
        tx.close()
        rx.close()


@pytest.mark.multigpu
def test_in_process_device_payload(gpu_pair):
    tx, rx = gpu_pair
    g = torch.Generator(device="cuda:0").manual_seed(3)
    hidden = torch.randn(512, 4096, device="cuda:0", generator=g).to(torch.bfloat16)
    strided = torch.randn(64, 96, device="cuda:0", generator=g).to(torch.bfloat16).t()
    ids = torch.arange(100, device="cuda:0")
    expected = {
        "hidden": hidden.cpu(), "strided": strided.cpu(), "ids": ids.cpu(),
        "host_small": torch.tensor([1.5, 2.5]), "host_big": torch.arange(1 << 20, dtype=torch.int32),
    }
    n = tx.put("k", {"hidden": hidden, "strided": strided, "ids": ids, "meta": {"x": 1},
                     "host_small": expected["host_small"].clone(), "host_big": expected["host_big"].clone()})
    assert n == omnilink.encoded_size(expected | {"meta": {"x": 1}})
    # The stream contract: work queued after put on the caller's stream may overwrite.
    hidden.fill_(0)
    ids.fill_(-1)
    got = rx.get("k", timeout=WAIT)
    for name in ("hidden", "strided", "ids"):
        assert got[name].device == torch.device("cuda:1")
        assert got[name].dtype == expected[name].dtype and got[name].shape == expected[name].shape
        assert torch.equal(_bits(got[name]), _bits(expected[name])), name
    for name in ("host_small", "host_big"):
        assert got[name].device.type == "cpu"
        assert torch.equal(got[name], expected[name])
    assert got["meta"] == {"x": 1}


@pytest.mark.multigpu
def test_device_mismatch_is_configuration_error(gpu_pair):
    tx, rx = gpu_pair
    with pytest.raises(ConfigurationError, match="cuda:1"):
        tx.put("wrong", {"t": torch.ones(3, device="cuda:1")}, timeout=WAIT)
    # Nothing was sent: the channel still works.
    tx.put("right", {"t": torch.ones(3, device="cuda:0")}, timeout=WAIT)
    assert torch.equal(rx.get("right", timeout=WAIT)["t"].cpu(), torch.ones(3))


@pytest.mark.gpu
def test_gloo_link_refuses_cuda_tensors():
    store = dist.HashStore()
    with omnilink.connect("nccl", channel="gpu/gloo", role="sender", backend="gloo", store=store) as tx, \
         omnilink.connect("nccl", channel="gpu/gloo", role="receiver", backend="gloo", store=store) as rx:
        with pytest.raises(ConfigurationError, match="host tensors only"):
            tx.put("k", {"t": torch.ones(2, device="cuda:0")}, timeout=WAIT)
        tx.put("k", {"t": torch.ones(2)}, timeout=WAIT)
        assert torch.equal(rx.get("k", timeout=WAIT)["t"], torch.ones(2))


@pytest.mark.multigpu
def test_small_device_tensors_arrive_packed(gpu_pair):
    """Small device tensors travel in one pack: on cuda:1 they are views of one buffer
    at 64-byte aligned offsets, bit-exact, and the sender may overwrite its tensors on
    its stream right after put; a large tensor keeps its own buffer."""
    tx, rx = gpu_pair
    g = torch.Generator(device="cuda:0").manual_seed(5)
    small = {
        "pos": torch.arange(37, device="cuda:0"),
        "mask": torch.rand(3, 5, device="cuda:0", generator=g) > 0.5,
        "emb": torch.randn(7, 33, device="cuda:0", generator=g).to(torch.bfloat16),
        "strided": torch.randn(40, 24, device="cuda:0", generator=g).t(),
        "scalar": torch.tensor(2.5, device="cuda:0"),
    }
    big = torch.randn(1 << 20, device="cuda:0", generator=g)  # 4 MiB: a transfer of its own
    expected = {name: t.cpu() for name, t in small.items()} | {"big": big.cpu()}
    tx.put("packed", dict(small, big=big, meta={"n": 1}), timeout=WAIT)
    for t in small.values():
        t.zero_()
    got = rx.get("packed", timeout=WAIT)
    base = got["pos"].untyped_storage().data_ptr()
    for name in small:
        t = got[name]
        assert t.device == torch.device("cuda:1") and t.dtype == expected[name].dtype
        assert t.shape == expected[name].shape
        assert torch.equal(_bits(t), _bits(expected[name])), name
        assert t.untyped_storage().data_ptr() == base, f"{name} is not in the pack"
        assert (t.data_ptr() - base) % 64 == 0
    assert torch.equal(_bits(got["big"]), _bits(expected["big"]))
    assert got["big"].untyped_storage().data_ptr() != base
    assert got["meta"] == {"n": 1}


@pytest.mark.multigpu
def test_many_payloads_small_window_any_order():
    """Hundreds of payloads through a window of 4 (credits keep flowing), got in
    reverse order, each bit-exact; repeated unread key refused, consumed key refused."""
    store = dist.HashStore()
    with omnilink.connect("nccl", channel="gpu/window", role="sender", device="cuda:0", store=store,
                          send_window=4) as tx, \
         omnilink.connect("nccl", channel="gpu/window", role="receiver", device="cuda:1", store=store) as rx:
        sizes = [4096, 1 << 20, 64, 3 << 20]
        count = 200
        for i in range(count):
            n = sizes[i % len(sizes)] // 4
            tx.put(f"k{i}", {"t": torch.full((n,), float(i), device="cuda:0"),
                             "ids": torch.arange(i % 9 + 1, device="cuda:0")}, timeout=WAIT)
        with pytest.raises(omnilink.DuplicateKeyError):
            tx.put("k5", {"t": torch.zeros(1, device="cuda:0")}, timeout=WAIT)
        for i in reversed(range(count)):
            got = rx.get(f"k{i}", timeout=WAIT)
            n = sizes[i % len(sizes)] // 4
            assert got["t"].device == torch.device("cuda:1") and got["t"].shape == (n,)
            assert bool((got["t"] == float(i)).all()), i
            assert torch.equal(got["ids"].cpu(), torch.arange(i % 9 + 1))
        with pytest.raises(omnilink.KeyConsumedError):
            rx.get("k5", timeout=WAIT)


@pytest.fixture
def bell_pair():
    """A pair whose small device payloads ride the doorbell (``bell_bytes`` set; the
    default, 0, sends them by NCCL)."""
    store = dist.HashStore()
    tx = omnilink.connect("nccl", channel="gpu/bell-pair", role="sender", device="cuda:0", store=store,
                          bell_bytes=1 << 16)
    rx = omnilink.connect("nccl", channel="gpu/bell-pair", role="receiver", device="cuda:1", store=store,
                          bell_bytes=1 << 16)
    try:
        yield tx, rx
    finally:
        tx.close()
        rx.close()


@pytest.mark.multigpu
def test_small_device_payload_by_nccl_by_default(gpu_pair):
    """By default (``bell_bytes=0``) a small device payload goes by NCCL, one send and
    one receive, bit-exact, and ``put`` returns without waiting for its stream."""
    tx, rx = gpu_pair
    assert tx.bell_bytes == 0
    tx.wait_connected(WAIT)
    rx.wait_connected(WAIT)
    hidden = torch.randn(2048, device="cuda:0").to(torch.bfloat16)  # 4 KiB
    ops = (tx._p2p_ops, rx._p2p_ops)
    for i in range(10):
        tx.put(f"small{i}", {"hidden_states.output": hidden, "meta": {"finished": i == 9}}, timeout=WAIT)
        got = rx.get(f"small{i}", timeout=WAIT)
        assert got["meta"] == {"finished": i == 9}
        assert torch.equal(_bits(got["hidden_states.output"]), _bits(hidden.cpu()))
    assert (tx._p2p_ops - ops[0], rx._p2p_ops - ops[1]) == (10, 10)


@pytest.mark.multigpu
def test_a_send_that_fails_after_its_bell_fails_the_link(gpu_pair, monkeypatch):
    """The bell is rung before the sends: a send that fails after it leaves a receive
    no send will match, so the put raises and the link is failed (the next put says so)
    instead of going on."""
    from omnilink.connectors.nccl import connector as nccl_connector

    tx, rx = gpu_pair
    tx.wait_connected(WAIT)
    rx.wait_connected(WAIT)
    assert nccl_connector.BELL_BEFORE_SENDS
    t = torch.ones(1024, device="cuda:0")
    tx.put("before", {"t": t}, timeout=WAIT)
    assert rx.get("before", timeout=WAIT)["t"].sum().item() == 1024.0

    def broken(bulk):
        raise omnilink.CudaError("injected: ncclSend failed")

    monkeypatch.setattr(tx, "_send_nccl", broken)
    with pytest.raises(omnilink.CudaError, match="injected"):
        tx.put("lost", {"t": t}, timeout=WAIT)
    monkeypatch.undo()
    with pytest.raises(omnilink.TransportError):
        tx.put("after", {"t": t}, timeout=WAIT)


@pytest.mark.multigpu
def test_small_device_payload_rides_the_doorbell(bell_pair):
    """With ``bell_bytes`` set, a payload whose device tensors are small (at most
    bell_bytes) and that has nothing else for NCCL costs no NCCL operation: put copies
    them to host (its stream reaches the copy first), the doorbell carries them, and on
    cuda:1 they are views of one region buffer, bit-exact, ordered on the getter's
    stream; the sender may overwrite them on its stream right after put."""
    from omnilink.connectors.nccl import wire

    tx, rx = bell_pair
    tx.wait_connected(WAIT)
    rx.wait_connected(WAIT)
    g = torch.Generator(device="cuda:0").manual_seed(9)
    hidden = torch.randn(2048, device="cuda:0", generator=g).to(torch.bfloat16)  # 4 KiB
    ids = torch.arange(17, device="cuda:0")
    payload = {"hidden_states.output": hidden, "ids.output": ids, "meta": {"finished": False},
               "host": torch.tensor([1.5, 2.5])}
    sp = wire.plan_send(payload, device=tx.device, nccl=True, inline_bytes=tx.inline_bytes,
                        max_inline_total=tx.max_inline_bytes, key="k", pack_bytes=tx.pack_bytes, pad=tx._pad,
                        bell_bytes=tx.bell_bytes)
    assert sp.plan == [wire.BELL, wire.BELL, wire.INLINE] and sp.p2p == []
    expected = {"hidden_states.output": hidden.cpu(), "ids.output": ids.cpu()}
    ops = (tx._p2p_ops, rx._p2p_ops)
    for i in range(20):
        tx.put(f"one{i}", payload, timeout=WAIT)
        hidden.add_(1)  # queued on the sender's stream after put: must not reach cuda:1
        got = rx.get(f"one{i}", timeout=WAIT)
        base = got["hidden_states.output"].untyped_storage().data_ptr()
        for name, want in expected.items():
            t = got[name]
            assert t.device == torch.device("cuda:1")
            assert t.untyped_storage().data_ptr() == base, f"{name} is not in the region"
            assert torch.equal(_bits(t), _bits(want)), (i, name)
        assert got["host"].device.type == "cpu" and got["host"].tolist() == [1.5, 2.5]
        expected["hidden_states.output"] = hidden.cpu()
    assert (tx._p2p_ops, rx._p2p_ops) == ops


@pytest.mark.multigpu
def test_large_tree_and_packed_small_tensors(gpu_pair):
    """A large tree rides the doorbell like any header; small device tensors beside a
    large one travel in the pack (one coalesced group with it): one operation per
    tensor buffer on each end, the pack's tensors views of one buffer."""
    tx, rx = gpu_pair
    tx.wait_connected(WAIT)
    rx.wait_connected(WAIT)
    names = [f"speaker-{i:05d}" * 8 for i in range(400)]
    big = torch.randn(1 << 20, device="cuda:0")
    small = [torch.full((1024,), float(i), device="cuda:0") for i in range(16)]
    ops = (tx._p2p_ops, rx._p2p_ops)
    tx.put("tree", {"names": names, "big": big, "small": small}, timeout=WAIT)
    got = rx.get("tree", timeout=WAIT)
    assert got["names"] == names
    assert torch.equal(got["big"].cpu(), big.cpu())
    base = got["small"][0].untyped_storage()
    for i, t in enumerate(got["small"]):
        assert t.device == torch.device("cuda:1") and bool((t == float(i)).all())
        assert t.untyped_storage().data_ptr() == base.data_ptr()
    assert (tx._p2p_ops - ops[0], rx._p2p_ops - ops[1]) == (2, 2)  # the pack and the big one


@pytest.mark.multigpu
def test_small_receive_buffers_are_rows_of_a_slab_that_is_released_with_its_last_row(gpu_pair):
    """Small receive buffers (here one pack: a 4 KiB tensor and three small ones) are
    rows of slabs allocated ahead: payloads one after the other are consecutive rows of
    one slab's memory until it is used up; payloads held while slabs are used up and
    replaced stay intact (nothing reuses a row still held), a consumer stream's late
    reads see their own bytes, and the slabs' memory goes back to the allocator once
    their rows are dropped."""
    tx, rx = gpu_pair
    tx.wait_connected(WAIT)
    rx.wait_connected(WAIT)
    dev = torch.device("cuda:1")
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    held = []
    count = 600  # three slabs or more of this pack's rows (1 MiB of ~4.9 KiB rows each)
    for i in range(count):
        hidden = torch.full((2048,), float(i % 256), device="cuda:0").to(torch.bfloat16)
        small = [torch.full((64,), float(i * 10 + j), device="cuda:0") for j in range(3)]
        tx.put(f"s{i}", {"hidden_states.output": hidden, "small": small, "i": i}, timeout=WAIT)
        got = rx.get(f"s{i}", timeout=WAIT)
        assert got["i"] == i
        held.append((got["hidden_states.output"], got["small"]))
    slabs = {h.untyped_storage().data_ptr() for h, _ in held}
    assert len(slabs) >= 3
    assert rx._slabs and all(s.rows.is_cuda for s in rx._slabs.values())
    rows = next(iter(rx._slabs.values())).rows
    stride = rows.stride(0) * rows.element_size()
    steps = [b.data_ptr() - a.data_ptr() for (a, _), (b, _) in zip(held, held[1:])
             if a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()]
    assert len(steps) >= count - len(slabs) - 2 and set(steps) == {stride}
    # A late reader on a side stream of the consumer sees each payload's own bytes.
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        sums = [(h.float().sum(), torch.stack([x.sum() for x in small])) for h, small in held]
    torch.cuda.synchronize(dev)
    for i, (total, smalls) in enumerate(sums):
        assert total.item() == float(i % 256) * 2048, i
        assert smalls.tolist() == [float(i * 10 + j) * 64 for j in range(3)], i
    del held, sums, got, total, smalls, rows
    rx._slabs.clear()  # the open slabs too (as a receiver's close does)
    torch.cuda.synchronize(dev)
    assert torch.cuda.memory_allocated(dev) <= base


@pytest.mark.multigpu
def test_get_orders_the_callers_stream_not_the_host(gpu_pair):
    """get returns with the caller's current stream ordered after the payload's bytes:
    work queued on that stream (and on a side stream made to wait for it) sees them, for
    payloads that need NCCL, back to back, read in reverse."""
    tx, rx = gpu_pair
    n = 1 << 22  # 16 MiB each: a transfer of its own
    for i in range(6):
        tx.put(f"s{i}", {"t": torch.full((n,), float(i), device="cuda:0")}, timeout=WAIT)
    side = torch.cuda.Stream(device="cuda:1")
    sums = []
    for i in reversed(range(6)):
        t = rx.get(f"s{i}", timeout=WAIT)["t"]
        side.wait_stream(torch.cuda.current_stream("cuda:1"))
        with torch.cuda.stream(side):
            sums.append((i, t.sum()))
    torch.cuda.synchronize("cuda:1")
    for i, s in sums:
        assert s.item() == float(i) * n, i


@pytest.mark.multigpu
def test_sender_stream_goes_on_while_the_receiver_does_not_get():
    """The keeper: the receiving application calls nothing for a while; the sender's
    sends (resident on cuda:0 until their receives are posted) complete anyway, so its
    stream, which waits for them, goes on, and all its puts return."""
    store = dist.HashStore()
    with omnilink.connect("nccl", channel="gpu/keeper", role="sender", device="cuda:0", store=store,
                          send_window=4) as tx, \
         omnilink.connect("nccl", channel="gpu/keeper", role="receiver", device="cuda:1", store=store) as rx:
        tx.wait_connected(WAIT)
        rx.wait_connected(WAIT)
        for i in range(12):
            tx.put(f"k{i}", {"t": torch.full((1 << 20,), float(i), device="cuda:0")}, timeout=WAIT)
        import threading

        done = threading.Event()
        threading.Thread(target=lambda: (torch.cuda.synchronize("cuda:0"), done.set()), daemon=True).start()
        assert done.wait(60), "cuda:0's stream still waits for sends whose receives nobody posted"
        for i in range(12):
            assert rx.get(f"k{i}", timeout=WAIT)["t"][0].item() == float(i)


@pytest.mark.multigpu
def test_receives_posted_ahead_do_not_stall_other_streams(gpu_pair):
    """Right after a payload no receive stays posted (the receiver posts one only for a
    payload whose doorbell it read, sent once the sends are queued). Work on cuda:1's
    other streams (more streams than CUDA's default 8 hardware queues) must complete."""
    import threading

    tx, rx = gpu_pair
    tx.put("k", {"t": torch.ones(4, device="cuda:0")}, timeout=WAIT)
    assert rx.get("k", timeout=WAIT)["t"].sum().item() == 4.0
    done = threading.Event()

    def work() -> None:
        streams = [torch.cuda.Stream(device="cuda:1") for _ in range(40)]
        outs = []
        for s in streams:
            with torch.cuda.stream(s):
                a = torch.randn(256, 256, device="cuda:1")
                outs.append((a @ a).sum())
        outs.append(torch.ones(8, device="cuda:1").sum())  # the current (default) stream
        torch.cuda.synchronize("cuda:1")
        done.set()

    t = threading.Thread(target=work, daemon=True)
    t.start()
    assert done.wait(60), "work on cuda:1 did not finish beside the link"
    # And the link still works after it.
    tx.put("k2", {"t": torch.full((3,), 2.0, device="cuda:0")}, timeout=WAIT)
    assert rx.get("k2", timeout=WAIT)["t"].tolist() == [2.0, 2.0, 2.0]


_ONE_QUEUE_SCRIPT = r"""
import threading, torch, torch.distributed as dist, omnilink
store = dist.HashStore()
tx = omnilink.connect("nccl", channel="gpu/one-queue", role="sender", device="cuda:0", store=store)
rx = omnilink.connect("nccl", channel="gpu/one-queue", role="receiver", device="cuda:1", store=store)
for i in range(3):
    tx.put(f"k{i}", {"t": torch.full((1 << 18,), float(i), device="cuda:0"), "s": torch.ones(3, device="cuda:0")})
    assert rx.get(f"k{i}", timeout=60)["t"][0].item() == float(i)
a = torch.randn(512, 512, device="cuda:1")
s = torch.cuda.Stream(device="cuda:1")
with torch.cuda.stream(s):
    b = (a @ a).sum()
c = (a @ a).sum()
torch.cuda.synchronize("cuda:1")
tx.put("last", {"t": torch.ones(1 << 18, device="cuda:0")})
assert rx.get("last", timeout=60)["t"].sum().item() == float(1 << 18)
tx.close(); rx.close()
print("OK")
"""


@pytest.mark.multigpu
def test_posted_receives_with_one_hardware_queue():
    """CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream of the process in one hardware
    queue, so a wait queued behind a receive that has not landed would hold all later
    work until it lands: payloads, compute on two streams of cuda:1 and a last payload
    all complete (in a child, bounded), since no receive is posted before its payload
    was sent."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1")
    try:
        proc = subprocess.run([sys.executable, "-c", _ONE_QUEUE_SCRIPT], env=env, capture_output=True,
                              text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("with one hardware queue, work on cuda:1 hung behind a receive of the link")
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


_LAZY_WORKER = r"""
import faulthandler, sys, torch, omnilink
faulthandler.dump_traceback_later(float(sys.argv[4]), exit=True)  # a hang prints every thread
rank, port, role = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dev = torch.device("cuda", rank)
torch.cuda.set_device(dev)
kw = {"rank": rank} if role == "dual" else {}
conn = omnilink.connect("nccl", channel="gpu/lazy", role=role if role == "dual" else ("sender", "receiver")[rank],
                        device=str(dev), master_port=port, connect_timeout=60, timeout=60, **kw)
conn.wait_connected(60)
# Kernels this process never launched (each its own module under lazy loading).
first_time = [
    lambda: torch.cumsum(torch.arange(1000, device=dev, dtype=torch.int16), 0),
    lambda: torch.randn(1000, device=dev, dtype=torch.float64).sum(),
    lambda: torch.sort(torch.rand(1000, device=dev).half())[0],
    lambda: torch.special.erfinv(torch.rand(64, device=dev, dtype=torch.float64)),
]
if rank == 0:
    import time
    time.sleep(0.5)  # the receiver had time to post receives ahead, were it to
    first_time[0]()  # before the first put: a receive posted by this process would hold it
    torch.cuda.synchronize(dev)
    for i in range(3):
        conn.put(f"k{i}", {"t": torch.full((1 << 16,), float(i), device=dev), "s": torch.ones(3, device=dev)})
else:
    for i in range(3):
        got = conn.get(f"k{i}")
        first_time[i + 1]()  # right after a get, with the link idle
        torch.cuda.synchronize(dev)
        assert got["t"][0].item() == float(i) and got["s"].sum().item() == 3.0
conn.close()
print("OK", rank, flush=True)
"""


@pytest.mark.multigpu
@pytest.mark.parametrize("role", ["sender/receiver", "dual"])
def test_first_time_kernels_beside_a_link_never_hang(role, tmp_path):
    """The hang of receives posted ahead (2x H100, CUDA 13, NCCL 2.28): under lazy module
    loading a first-time kernel launch waits for the kernels resident on the device, and
    a posted receive is one until its sender sends. The sending process launches a new
    kernel after connecting and before its first put; the receiving one a new kernel
    right after each get. Both must finish: each worker dumps its threads' stacks and
    exits after 45 s (faulthandler), and the test kills what is left after 60 s."""
    import os
    import subprocess
    import sys

    script = tmp_path / "lazy_worker.py"
    script.write_text(_LAZY_WORKER)
    env = dict(os.environ, CUDA_MODULE_LOADING="LAZY", PYTHONUNBUFFERED="1")
    port = workers.free_port()
    kind = "dual" if role == "dual" else "split"
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(port), kind, "45"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in (0, 1)
    ]
    outs = []
    try:
        for p in procs:
            try:
                outs.append(p.communicate(timeout=60)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(p.communicate()[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"OK {rank}" in out, f"rank {rank} (exit {p.returncode}):\n{out[-6000:]}"


def _plan_fields(sp):
    return (sp.meta, list(sp.plan), list(sp.inline), sp.region_bytes, sp.nbytes,
            [(at, t.data_ptr(), n) for at, t, n in sp.bell],
            [bytes(t.cpu().numpy()) for t in sp.p2p])


@pytest.mark.gpu
def test_a_payload_shape_is_planned_once_and_replayed_exactly():
    """On an NCCL link the sender replays its plan for a payload of a shape it planned
    before (``_SEND_PLANS``): the replay equals planning afresh (plan, inline bytes,
    region layout, bulk buffers byte for byte), and a tensor that moved (another GPU,
    the host) makes it plan afresh, so the device checks still hold."""
    from omnilink import blob
    from omnilink.connectors.nccl import wire

    dev = torch.device("cuda", 0)
    pad = torch.zeros(64, dtype=torch.uint8, device=dev)
    opts = dict(device=dev, nccl=True, inline_bytes=256, max_inline_total=1 << 20, key="k", pack_bytes=1 << 20,
                pad=pad)
    for bell_bytes in (0, 1 << 16):
        wire._SEND_PLANS.clear()
        for step in range(3):
            g = torch.Generator(device=dev).manual_seed(step)
            payload = {
                "hidden": torch.randn(64, 1024, device=dev, generator=g).to(torch.bfloat16),
                "ids": torch.arange(10) + step,  # host, inline
                "small": [torch.randn(7 + i, device=dev, generator=g) for i in range(5)],
                "t": torch.randn(3, 4, device=dev, generator=g).t(),  # not contiguous
                "meta": {"step": step},  # values differ from payload to payload: one plan still
            }
            if bell_bytes:
                del payload["hidden"]  # small enough for the region
            got = wire.plan_send(payload, bell_bytes=bell_bytes, **opts)
            assert len(wire._SEND_PLANS) == 1
            fresh = wire._plan_fresh(torch, blob.prepare(payload), bell_bytes=bell_bytes, **opts)
            assert (wire.BELL in got.plan) == bool(bell_bytes)
            if not bell_bytes:
                assert _plan_fields(got) == _plan_fields(fresh)
            else:
                assert _plan_fields(got)[:5] == _plan_fields(fresh)[:5]
                for (a, ta, na), (b, tb, nb) in zip(got.bell, fresh.bell):
                    assert (a, na) == (b, nb) and torch.equal(ta, tb)
        moved = {**payload, "ids": payload["ids"].to(dev)}  # the same meta, a tensor elsewhere
        assert blob.prepare(moved).meta == blob.prepare(payload).meta
        sp = wire.plan_send(moved, bell_bytes=bell_bytes, **opts)
        assert sp.plan != got.plan  # the ids planned as a device tensor now, not inline
        if torch.cuda.device_count() > 1:
            other = {**payload, "ids": payload["ids"].to("cuda:1")}
            with pytest.raises(ConfigurationError, match="cuda:1"):
                wire.plan_send(other, bell_bytes=bell_bytes, **opts)


@pytest.mark.multigpu
def test_a_receiver_killed_with_a_send_in_flight_frees_the_senders_stream(procs):
    """The receiver is frozen (SIGSTOP) so it cannot post its receive, the sender puts a
    64 MiB payload (its NCCL send queued on cuda:0's stream, waiting), then the receiver
    is killed (SIGKILL). The sender's next put raises ``PeerLostError`` and, once closed,
    cuda:0's stream finishes: the link's abort ended the send no peer will match."""
    import os
    import signal

    port = workers.free_port()
    q, go = CTX.Queue(), CTX.Queue()
    tx = CTX.Process(target=workers.stuck_send_sender, args=(port, "gpu/killed", q, go), daemon=True)
    rx = CTX.Process(target=workers.frozen_receiver, args=(port, "gpu/killed", q), daemon=True)
    for p in (tx, rx):
        p.start()
        procs.append(p)
    pids = {_next(q)[1] for _ in range(2)}
    assert rx.pid in pids and tx.pid in pids
    os.kill(rx.pid, signal.SIGSTOP)
    go.put("frozen")
    assert _next(q)[:2] == ("put", "big")
    os.kill(rx.pid, signal.SIGKILL)
    rx.join(WAIT)
    go.put("dead")
    msg = _next(q)
    assert msg[0] == "result", msg
    assert msg[1] is not None, "no PeerLostError within 30 s of the receiver's death"
    assert msg[2], "cuda:0's stream still waits for a send to a dead receiver after close"
    tx.join(WAIT)
    assert tx.exitcode == 0
