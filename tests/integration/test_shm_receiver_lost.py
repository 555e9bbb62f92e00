"""A sender whose receiver was SIGKILLed: ``put`` reports ``PeerLostError`` instead of
waiting out its timeout, ``reclaim_unread`` gives the arena back, and a receiver started
afterwards carries on."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import omnilink
from tests.integration import _shm_workers as W
from tests.procs import CTX, start_process

WAIT = 30.0


def test_put_reports_a_killed_receiver_and_a_new_one_carries_on(procs):
    channel = f"itest/lost-receiver-{os.getpid()}"
    # One queue per child: killing a child can leave a queue's shared write lock taken.
    q_dead, q = CTX.Queue(), CTX.Queue()
    n = 64 << 10
    with omnilink.connect("shm", channel=channel, role="sender", arena_bytes=1 << 20, max_inflight=16,
                          timeout=WAIT) as tx:
        for i in range(2):
            tx.put(f"k{i}", W.make_payload(i, n // 4))
        rx = start_process(procs, W.holding_receiver, channel, 2, q_dead, n // 4)
        tag, value = q_dead.get(timeout=WAIT)
        assert tag == "holding", value
        os.kill(rx.pid, signal.SIGKILL)
        rx.join(WAIT)
        big = {"x": np.zeros(300 << 10, dtype=np.uint8)}
        with pytest.raises(omnilink.PeerLostError, match=rf"receiver pid\(s\) \[{rx.pid}\]"):
            for i in range(100):  # fills the arena with payloads nobody reads, then waits
                tx.put(f"orphan{i}", big)
        assert tx.stats().timeouts == 0
        dropped = tx.reclaim_unread(0)
        assert dropped and all(k.startswith("orphan") for k, _ in dropped)
        assert tx.stats().blocks_in_use == 0  # the dead receiver's claimed blocks came back too
        rx2 = start_process(procs, W.receiver, channel, 3, q, n // 4, 0.0, 100)
        for i in range(100, 103):
            tx.put(f"k{i}", W.make_payload(i, n // 4))
        assert q.get(timeout=WAIT)[0] == "ready"
        tag, value = q.get(timeout=WAIT)
        assert (tag, value) == ("got", 3), value
        rx2.join(WAIT)
        assert rx2.exitcode == 0
