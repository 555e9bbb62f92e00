"""The nccl backend across two processes (spawn), over gloo so it runs on CPU CI.

Every wait is bounded (queue reads, joins, connector timeouts) and every child is killed
if a test fails, so a bug cannot hang CI.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import pytest

import omnilink
from omnilink import PeerLostError, TransferTimeout
from tests.procs import start_process as _start
from tests.integration import _nccl_workers as workers

WAIT = 60.0
CTX = mp.get_context("spawn")


def _next(q, what):
    try:
        msg = q.get(timeout=WAIT)
    except queue.Empty:
        pytest.fail(f"no {what} within {WAIT} s")
    if msg[0] == "error":
        pytest.fail(f"a worker failed while waiting for {what}: {msg[1]}: {msg[2]}")
    return msg


def test_two_processes_over_gloo(procs):
    port = workers.free_port()
    q = CTX.Queue()
    count = 6
    keys = [f"req{i}_0_0" for i in range(count)]
    # Read out of order: the receiver's thread takes every payload as it comes.
    order = [keys[i] for i in (3, 0, 5, 1, 4, 2)]
    _start(procs, workers.sender, port, "it/gloo", "gloo", "cpu", count, 1 << 20, q)
    _start(procs, workers.receiver, port, "it/gloo", "gloo", "cpu", order, q)
    sent, got = {}, {}
    while len(sent) < count or len(got) < count:
        msg = _next(q, "payload reports")
        if msg[0] == "sent":
            sent[msg[1]] = msg[2]
        elif msg[0] == "got":
            got[msg[1]] = msg[2]
            assert msg[3] == "cpu" and msg[4] == "cpu"
    assert got == sent
    for p in procs:
        p.join(WAIT)
        assert p.exitcode == 0


def test_sender_killed_receiver_gets_peer_lost(procs):
    """A sender that dies is PeerLostError on the receiver, promptly, never a hang;
    what it delivered before dying stays readable."""
    port = workers.free_port()
    q = CTX.Queue()
    p = _start(procs, workers.doomed_sender, port, "it/doomed-tx", 4096, q)
    # The child hosts the store; the TCPStore client retries until it is up.
    with omnilink.connect("nccl", channel="it/doomed-tx", role="receiver", backend="gloo",
                          master_port=port, connect_timeout=WAIT) as rx:
        _next(q, "the first put")
        first = rx.get("first", timeout=WAIT)
        assert workers.digest(first) == workers.digest(workers.make_payload(0, 4096))
        p.kill()
        p.join(WAIT)
        start = time.monotonic()
        with pytest.raises((PeerLostError, TransferTimeout)) as info:
            rx.get("second", timeout=20.0)
        assert isinstance(info.value, PeerLostError), f"expected PeerLostError, got {info.value!r}"
        assert time.monotonic() - start < 15.0
        assert rx.stats().gets == 1


def test_sender_killed_mid_stream_receiver_gets_peer_lost(procs):
    """A sender killed with SIGKILL while it streams (payloads in flight, doorbells
    queued, sends posted): what it delivered is intact (a payload that came whole in
    its doorbell stays readable, one whose bytes had not landed is PeerLostError), and
    the receiver's gets end in PeerLostError, never a hang or a timeout."""
    import os
    import signal

    port = workers.free_port()
    q = CTX.Queue()
    p = _start(procs, workers.streaming_sender, port, "it/stream-kill", q)
    sent = 0
    # The receiver holds at most 4 MiB unread: the sender soon waits for room, with
    # doorbells unread and sends posted that nobody receives yet.
    with omnilink.connect("nccl", channel="it/stream-kill", role="receiver", backend="gloo",
                          master_port=port, connect_timeout=WAIT, max_pending_bytes=4 << 20) as rx:
        got = {}
        for i in range(12):
            got[f"s{i}"] = workers.digest(rx.get(f"s{i}", timeout=WAIT))
        while sent < 16:  # the sender is ahead: its window is in flight
            _next(q, "the sender's puts")
            sent += 1
        os.kill(p.pid, signal.SIGKILL)
        p.join(WAIT)
        assert p.exitcode == -signal.SIGKILL
        # A hang would show as TransferTimeout after 20 s (each get's timeout), not as
        # PeerLostError: the error's type is the check, no clock is.
        i = 12
        with pytest.raises((PeerLostError, TransferTimeout)) as info:
            while True:  # what landed before the kill may still be read, then the error
                key = f"s{i}"
                got[key] = workers.digest(rx.get(key, timeout=20.0))
                i += 1
        assert isinstance(info.value, PeerLostError), f"expected PeerLostError, got {info.value!r}"
        for key, d in got.items():  # every payload got is the one put (deterministic)
            n = int(key[1:])
            assert d == workers.digest(workers.make_payload(n, (256 << 10) if n % 2 else 1024)), key
        with pytest.raises(PeerLostError):  # a key that can no longer come, at once
            rx.get(f"s{i + 1000}", timeout=20.0)


def test_receiver_killed_sender_gets_peer_lost(procs):
    """A receiver that dies makes the sender's put fail with PeerLostError (or time out)
    instead of blocking forever."""
    port = workers.free_port()
    q = CTX.Queue()
    with omnilink.connect("nccl", channel="it/doomed-rx", role="sender", backend="gloo",
                          master_port=port, connect_timeout=WAIT, send_window=2) as tx:
        p = _start(procs, workers.doomed_receiver, port, "it/doomed-rx", q)
        _next(q, "the receiver to connect")
        tx.put("a", workers.make_payload(0, 1024), timeout=WAIT)
        p.kill()
        p.join(WAIT)
        with pytest.raises((PeerLostError, TransferTimeout)):
            for i in range(10):
                tx.put(f"b{i}", workers.make_payload(i, 1024), timeout=10.0)
