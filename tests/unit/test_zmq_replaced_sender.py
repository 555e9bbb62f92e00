"""A zmq sender replaced after the receiver reported it lost (issue 31, defect F).

The receiver's ``get`` of the new sender's key, made as that sender's first ``put``
starts, used to raise ``PeerLostError`` (9 of 10 replacements here): the connection
was still being made, and connection events reach the receiver's loop thread
asynchronously. A sender's construction now returns connected when its receiver is up
(``SenderLoop.wait_connected``), and a receiver about to report every sender lost
first has its loop take in what already reached the socket (``ReceiverLoop._sync``).
"""

from __future__ import annotations

import threading
import time

import pytest

zmq = pytest.importorskip("zmq")

import omnilink  # noqa: E402
from omnilink.connectors.zmq import connector as zmq_connector  # noqa: E402

PEER_TIMEOUT = 0.2


def test_the_first_get_after_a_sender_is_replaced_gets_its_payload(ipc_dir):
    ch = "u/replaced"
    kw = {"channel": ch, "ipc_dir": ipc_dir, "peer_timeout": PEER_TIMEOUT}
    failures = []
    with omnilink.connect("zmq", role="receiver", **kw) as rx:
        for i in range(10):
            with omnilink.connect("zmq", role="sender", **kw) as tx:
                tx.put(f"a{i}", {"i": i}, timeout=10)
                assert rx.get(f"a{i}", timeout=10) == {"i": i}
            # The old sender is gone; a waiting get reports it once peer_timeout passed.
            with pytest.raises(omnilink.PeerLostError):
                rx.get(f"never{i}", timeout=10)
            with omnilink.connect("zmq", role="sender", **kw) as tx2:
                t = threading.Thread(target=tx2.put, args=(f"b{i}", {"i": i}), kwargs={"timeout": 10})
                t.start()
                try:
                    assert rx.get(f"b{i}", timeout=10) == {"i": i}
                except omnilink.PeerLostError as exc:
                    failures.append(f"replacement {i}: {exc}")
                finally:
                    t.join(20)
    assert not failures, failures


def test_a_sender_does_not_wait_for_a_receiver_that_is_not_there(ipc_dir, monkeypatch):
    # Nobody listens: the construction returns at the first failed connection attempt,
    # not after CONNECT_WAIT_S (made huge here, so a regression is plain to see).
    monkeypatch.setattr(zmq_connector, "CONNECT_WAIT_S", 60.0)
    t0 = time.monotonic()
    with omnilink.connect("zmq", channel="u/nobody", role="sender", ipc_dir=ipc_dir) as tx:
        assert time.monotonic() - t0 < 20.0
        assert not tx._res.sender.connected
        with pytest.raises(omnilink.TransferTimeout):
            tx.put("k", {"x": 1}, timeout=0.2)


def test_a_receiver_with_no_sender_left_still_reports_the_loss(ipc_dir):
    # The sync with the loop before reporting must not turn a real loss into a hang.
    kw = {"channel": "u/lost", "ipc_dir": ipc_dir, "peer_timeout": PEER_TIMEOUT}
    with omnilink.connect("zmq", role="receiver", **kw) as rx:
        with omnilink.connect("zmq", role="sender", **kw) as tx:
            tx.put("a", {"x": 1}, timeout=10)
        assert rx.get("a", timeout=10) == {"x": 1}
        t0 = time.monotonic()
        with pytest.raises(omnilink.PeerLostError):
            rx.get("b", timeout=30)
        assert time.monotonic() - t0 < 15.0  # peer_timeout plus one loop pass, not the get's 30 s
