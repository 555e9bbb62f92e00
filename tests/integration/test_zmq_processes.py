"""The zmq backend across processes (spawn): tcp loopback, a receiver restarted
mid-stream, a sender killed mid-message.

Every wait is bounded (queue reads, joins, connector timeouts) and every child is killed
if a test fails, so a bug cannot hang CI. ipc sockets live in a private directory that
must be empty at the end (a killed receiver's leftovers are cleaned by its successor).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading

import pytest

pytest.importorskip("zmq")

import omnilink  # noqa: E402
from omnilink import PeerLostError, TransferTimeout  # noqa: E402
from tests.procs import start_process as _start
from tests.integration import _zmq_workers as workers  # noqa: E402

WAIT = 60.0
CTX = mp.get_context("spawn")


def _next(q, what):
    try:
        return q.get(timeout=WAIT)
    except queue.Empty:
        pytest.fail(f"no report from the child within {WAIT} s while waiting for {what}")


def test_two_processes_over_tcp_loopback(procs):
    keys = [f"req{i}_0_0" for i in range(12)]
    out = CTX.Queue()
    with omnilink.connect("zmq", channel="i/tcp", role="receiver", endpoint="tcp://127.0.0.1:*") as rx:
        _start(procs, workers.sender, "i/tcp", rx.endpoint, None, keys, 300_000, out)
        # Read in reverse: out-of-order gets across processes.
        got = {key: workers.digest(rx.get(key, timeout=WAIT)) for key in reversed(keys)}
        sent = {}
        while len(sent) < len(keys):
            kind, key, dig = _next(out, "the sender's reports")
            assert kind == "sent", (kind, key, dig)
            sent[key] = dig
        assert _next(out, "the sender to finish")[0] == "done"
        assert got == sent
        assert rx.stats().gets == len(keys)
    procs[0].join(WAIT)
    assert procs[0].exitcode == 0


def test_receiver_restarted_mid_stream(ipc_dir, procs):
    channel = "i/restart"
    out = CTX.Queue()
    ready1 = CTX.Event()
    # The first receiver reads one message, then holds its index full and reads no more.
    rx1 = _start(procs, workers.receiver, channel, ipc_dir, [], out, ready1, {"max_buffered_bytes": 1})
    assert ready1.wait(WAIT)
    with omnilink.connect("zmq", channel=channel, role="sender", ipc_dir=ipc_dir, peer_timeout=WAIT) as tx:
        tx.put("before", workers.make_payload(0, 1000), timeout=WAIT)  # acked by rx1
        # Handed to zmq, never acknowledged: rx1 stopped reading.
        results: dict = {}
        t = threading.Thread(
            target=lambda: results.update(
                a1=_outcome(tx.put, "a1", workers.make_payload(1, 200_000), timeout=WAIT)
            )
        )
        t.start()
        rx1.kill()
        rx1.join(WAIT)
        ready2 = CTX.Event()
        _start(procs, workers.receiver, channel, ipc_dir, ["a1", "a2", "a3"], out, ready2, {})
        assert ready2.wait(WAIT)
        # put returns after the restart: each of these is delivered by the new receiver.
        tx.put("a2", workers.make_payload(2, 200_000), timeout=WAIT)
        tx.put("a3", workers.make_payload(3, 3000), timeout=WAIT)
        t.join(WAIT)
        assert not t.is_alive(), "put blocked across the restart was never released"
        assert isinstance(results["a1"], int), results["a1"]
        reports = [_next(out, f"the new receiver's report {i}") for i in range(3)]
    expected = {f"a{i}": workers.digest(workers.make_payload(i, n)) for i, n in ((1, 200_000), (2, 200_000), (3, 3000))}
    assert reports == [("got", k, expected[k]) for k in ("a1", "a2", "a3")]
    procs[1].join(WAIT)
    assert procs[1].exitcode == 0


def _can_read_children() -> bool:
    """Whether this kernel lets us process_vm_readv a process of ours (ourselves)."""
    from omnilink.connectors.zmq import cma as _zmq_cma

    tok = _zmq_cma.Token()
    try:
        _zmq_cma.read_regions(os.getpid(), tok.address, tok.nonce, [])
    except _zmq_cma.CannotReference:
        return False
    return True


def _outcome(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except Exception as exc:  # handed to the test thread
        return exc


@pytest.mark.parametrize("by_reference", [True, False], ids=["by-reference", "frames"])
def test_sender_killed_mid_message(ipc_dir, procs, by_reference):
    # By reference the receiver may be inside process_vm_readv of the dying sender's
    # memory; as frames, zmq may hold half of the multipart message. Either way: whole
    # payloads only.
    channel = "i/kill"
    nbytes = 48 << 20
    out = CTX.Queue()
    with omnilink.connect("zmq", channel=channel, role="receiver", ipc_dir=ipc_dir, peer_timeout=1.0) as rx:
        child = _start(
            procs, workers.endless_sender, channel, ipc_dir, nbytes, out, {"by_reference": by_reference}
        )
        digests = {}
        for i in range(2):
            kind, key, dig = _next(out, f"big-{i} to be put")
            digests[key] = dig
            got = rx.get(key, timeout=WAIT)
            assert workers.digest(got) == dig
            del got
        kind, key, dig = _next(out, "big-2 to be put")
        child.kill()  # somewhere in the middle of sending 48 MiB, or just before/after
        child.join(WAIT)
        # The child may have run ahead of our reads: learn the last key it started.
        started = {key: dig}
        while True:
            try:
                kind, key, dig = out.get(timeout=1.0)
            except queue.Empty:
                break
            started[key] = dig
        last = max(int(k.rpartition("-")[2]) for k in started)
        for i in range(2, last):
            # The child went on to the next key, so this put returned: it was acked.
            got = rx.get(f"big-{i}", timeout=WAIT)
            assert workers.digest(got) == started[f"big-{i}"]
            del got
        try:
            got = rx.get(f"big-{last}", timeout=WAIT)
        except (PeerLostError, TransferTimeout):
            pass  # the message died with its sender
        else:
            # It made it whole before the kill: then it must be exactly right.
            assert workers.digest(got) == started[f"big-{last}"]
            assert got["meta"] == {"i": last % 2, "finished": False}
            del got
        with pytest.raises(PeerLostError):
            rx.get(f"big-{last + 1}", timeout=WAIT)
        assert rx.stats().blocks_in_use == 0
        from omnilink.connectors.zmq import cma as _zmq_cma

        if by_reference and _zmq_cma.available():
            # The path under test was taken (unless this kernel forbids the read).
            assert rx.health()["receiver"]["by_reference"] >= 2 or not _can_read_children()
        elif not by_reference:
            assert rx.health()["receiver"]["by_reference"] == 0
