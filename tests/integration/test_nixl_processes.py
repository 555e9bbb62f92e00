"""The nixl backend across processes over UCX on loopback (``tcp`` and ``cma,tcp``):
payloads from another process, zero-copy views of the receiver's pool, a sender or a
receiver killed with SIGKILL (``PeerLostError``, no hang, the channel taken back), and
nothing left behind (``/dev/shm`` is checked by the suite's fixture, the ipc directory
here). Skipped with the reason where NIXL is not installed."""

from __future__ import annotations

import os
import queue
import signal

import pytest
import torch

import omnilink
from omnilink.connectors import backend_unavailable
from tests.integration import _nixl_workers as workers
from tests.procs import CTX, start_process

_REASON = backend_unavailable("nixl")
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"nixl backend unavailable: {_REASON}")

TLS = ["tcp", "cma,tcp"]


@pytest.fixture(autouse=True)
def _private_ipc_dir(tmp_path_factory, monkeypatch):
    import tempfile

    path = tempfile.mkdtemp(prefix="olnx-")
    monkeypatch.setenv("OMNILINK_ZMQ_DIR", path)
    old = os.environ.get("UCX_TLS")
    yield path
    left = os.listdir(path)
    os.rmdir(path) if not left else None
    if old is None:
        os.environ.pop("UCX_TLS", None)
    else:
        os.environ["UCX_TLS"] = old
    assert not left, f"the nixl control channel left files behind: {left}"


def _in_pool(rx, t) -> bool:
    pool = rx._rx.pool
    return pool.addr <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= pool.addr + pool.nbytes


@pytest.mark.parametrize("tls", TLS)
def test_sender_process_zero_copy_then_killed(tls, procs):
    """Payloads from another process are views of the pool (data_ptr inside it); a
    SIGKILLed sender: what it published stays deliverable, then ``get`` raises
    ``PeerLostError``; its extents come back once the views die."""
    os.environ["UCX_TLS"] = tls
    channel = f"olnx/kill-tx-{os.getpid()}-{tls.replace(',', '')}"
    with omnilink.connect("nixl", channel=channel, role="receiver", pool_bytes=32 << 20, peer_timeout=0.5,
                          timeout=60.0) as rx:
        q = CTX.Queue()
        p = start_process(procs, workers.sender, tls, channel, None, 6, 1 << 20, q)
        assert q.get(timeout=60) == ("sent", 6)
        held = [rx.get(f"k{i}") for i in range(3)]
        for i, got in enumerate(held):
            want = workers.payload(i, 1 << 20)
            assert torch.equal(got["hidden"], want["hidden"]) and torch.equal(got["ids"], want["ids"])
            assert bool(got["meta"]["finished"]) == (i % 2 == 0) and got["meta"]["i"] == i
            assert _in_pool(rx, got["hidden"]) and _in_pool(rx, got["ids"])
        assert rx.stats().blocks_in_use >= 3
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        # Published before the kill: still here (the bytes are in our pool).
        for i in range(3, 6):
            assert torch.equal(rx.get(f"k{i}")["hidden"], workers.payload(i, 1 << 20)["hidden"])
        with pytest.raises(omnilink.PeerLostError):
            rx.get("never", timeout=30.0)
        del held, got
        st = rx.stats()
        assert st.blocks_in_use == 0 and st.bytes_held == 0


@pytest.mark.parametrize("size", [4096, 2 << 20], ids=["inline", "written"])
@pytest.mark.parametrize("tls", TLS)
def test_a_sender_killed_as_its_last_put_returns_loses_none(tls, size, procs):
    """A put returns once its payload is published, before the receiver answers: a
    sender SIGKILLed the moment its last put returned loses none of its payloads (the
    receiver handles what the sender's doorbell still holds before it ends the
    session), then ``get`` raises ``PeerLostError``."""
    os.environ["UCX_TLS"] = tls
    channel = f"olnx/kill-last-{os.getpid()}-{tls.replace(',', '')}-{size}"
    count = 12
    with omnilink.connect("nixl", channel=channel, role="receiver", pool_bytes=64 << 20, peer_timeout=0.5,
                          timeout=60.0) as rx:
        p = start_process(procs, workers.sender_then_killed, tls, channel, count, size)
        p.join(60)
        assert p.exitcode == -signal.SIGKILL
        for i in range(count):
            got = rx.get(f"d{i}", timeout=30.0)
            want = workers.payload(i, size)
            assert torch.equal(got["hidden"], want["hidden"]) and torch.equal(got["ids"], want["ids"]), i
            del got
        with pytest.raises(omnilink.PeerLostError):
            rx.get("never", timeout=30.0)
        st = rx.stats()
        assert st.blocks_in_use == 0 and st.bytes_held == 0


@pytest.mark.parametrize("tls", TLS)
def test_sender_killed_while_streaming_payloads_published_ahead(tls, procs):
    """A sender SIGKILLed while it streams payloads published ahead of their WRITE (one
    may be published and not written): every payload the receiver can get is whole, a
    payload never written is never gettable, nothing stays held aside, and every block
    comes back once the views die."""
    os.environ["UCX_TLS"] = tls
    channel = f"olnx/kill-ahead-{os.getpid()}-{tls.replace(',', '')}"
    size = 2 << 20
    with omnilink.connect("nixl", channel=channel, role="receiver", pool_bytes=64 << 20, peer_timeout=0.5,
                          timeout=60.0) as rx:
        q = CTX.Queue()
        p = start_process(procs, workers.streamer, tls, channel, size, q)
        assert q.get(timeout=60) == ("streaming", 0)
        got_keys = 0
        held = []
        while got_keys < 4:  # let it stream (the receiver holds a few)
            held.append(rx.get(f"s{got_keys}", timeout=30.0))
            got_keys += 1
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        # Whatever was written before the kill is whole; then PeerLostError, no hang.
        while True:
            try:
                got = rx.get(f"s{got_keys}", timeout=30.0)
            except omnilink.PeerLostError:
                break
            want = workers.payload(got_keys, size)
            assert torch.equal(got["hidden"], want["hidden"]) and torch.equal(got["ids"], want["ids"])
            got_keys += 1
            del got
        for i, got in enumerate(held):
            assert torch.equal(got["hidden"], workers.payload(i, size)["hidden"])
        r = rx._rx
        assert not r.ahead_keys and all(not s.ahead for s in r.sessions.values())
        del held, got
        st = rx.stats()
        assert st.blocks_in_use == 0 and st.bytes_held == 0


@pytest.mark.parametrize("tls", TLS)
def test_receiver_killed_then_restarted(tls, procs):
    """A SIGKILLed receiver: the sender's put raises ``PeerLostError`` (no hang); a new
    receiver on the same endpoint is taken back by the next put."""
    os.environ["UCX_TLS"] = tls
    channel = f"olnx/kill-rx-{os.getpid()}-{tls.replace(',', '')}"
    # One queue per child: the first is SIGKILLed right after we read its ("got", 1), which
    # can be before its queue feeder thread released the queue's shared write lock; a
    # second writer on that queue would then block forever (seen: the restarted receiver's
    # ("ready", ...) never arrived, its feeder thread stuck in the lock's acquire).
    q, stop = CTX.Queue(), CTX.Event()
    p = start_process(procs, workers.receiver, tls, channel, q, stop)
    tag, endpoint = q.get(timeout=60)
    assert tag == "ready", endpoint
    with omnilink.connect("nixl", channel=channel, role="sender", timeout=30.0, heartbeat_interval=0.2) as tx:
        tx.put("first", workers.payload(1))
        assert q.get(timeout=60) == ("got", 1)
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        with pytest.raises(omnilink.PeerLostError):
            for i in range(50):  # the loss is seen at the latest by the put waiting for its answer
                tx.put(f"lost{i}", workers.payload(i), timeout=20.0)
        # A receiver restarted on the same (ipc) endpoint is taken back.
        q2, stop2 = CTX.Queue(), CTX.Event()
        p2 = start_process(procs, workers.receiver, tls, channel, q2, stop2)
        tag, endpoint2 = q2.get(timeout=60)
        assert tag == "ready", endpoint2
        assert endpoint2 == endpoint
        deadline = 30.0
        while True:
            try:
                tx.put("first", workers.payload(2), timeout=deadline)
                break
            except omnilink.PeerLostError:  # the old connection's loss, seen once more
                continue
        try:
            assert q2.get(timeout=60) == ("got", 2)
        except queue.Empty:
            pytest.fail("the restarted receiver never got the payload")
        stop2.set()
        p2.join(30)
        assert p2.exitcode == 0


def _fd_target(fd: int) -> str | None:
    """What this process's descriptor ``fd`` is (``socket:[inode]``), ``None`` if closed."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:
        return None


def test_a_sender_connecting_again_on_its_lost_connections_descriptor_keeps_its_session(procs):
    """A sender whose session ended says hello again at once; the receiver's new
    connection may get the file descriptor of the one just closed (the kernel hands out
    the lowest free one) while the control socket's monitor still holds that
    descriptor's "disconnected" event. Handled after the new hello, that event ended the
    new session: the sender's next put raised ``PeerLostError`` once in a while. Made
    certain here: the receiver's loop is held while the old connection closes and the
    hello comes (once the old connection's "disconnected" is queued), this thread
    handles the hello first, and the new connection is given the old one's descriptor
    (what the kernel does when the race bites)."""
    import time

    import zmq

    os.environ["UCX_TLS"] = "tcp"
    channel = f"olnx/again-{os.getpid()}"
    with omnilink.connect("nixl", channel=channel, role="receiver", endpoint="tcp://127.0.0.1:*",
                          timeout=60.0) as rx:
        q, go1, go2 = CTX.Queue(), CTX.Event(), CTX.Event()
        start_process(procs, workers.sender_reconnects, "tcp", channel, rx.endpoint, q, go1, go2)
        assert q.get(timeout=60) == ("a", "ok")
        assert rx.get("a")["t"].tolist() == [0, 1, 2, 3]
        r = rx._rx
        (old,) = r.sessions.values()
        old_target = _fd_target(old.fd)
        assert old_target is not None and old_target.startswith("socket:")
        real_hello = r._hello

        class _SameDescriptor:
            def get(self, option):
                assert option == zmq.SRCFD
                return old.fd

        r._hello = lambda ident, msg, frame: real_hello(ident, msg, _SameDescriptor())
        with r.handling:  # the receiver's loop waits meanwhile
            go1.set()
            assert q.get(timeout=60) == ("b", "lost")
            # zmq queues a connection's "disconnected" before it closes its descriptor:
            # once the descriptor is closed, the event waits in the monitor.
            end = time.monotonic() + 60
            while _fd_target(old.fd) == old_target:
                assert time.monotonic() < end, "the receiver never closed the old connection"
                time.sleep(0.001)
            go2.set()
            end = time.monotonic() + 60
            while not any(s is not old for s in r.sessions.values()):
                assert time.monotonic() < end, "the sender never said hello again"
                if r.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    r._pump(16)
                else:
                    time.sleep(0.001)
        assert q.get(timeout=60) == ("c", "ok")
        assert rx.get("c")["t"].tolist() == list(range(6))
