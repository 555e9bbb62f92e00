"""``Completer``: callbacks after events, on its thread or reaped by the submitter (CPU)."""

from __future__ import annotations

import threading
import time

from omnilink.cuda import Completer


class FakeEvent:
    """Stands in for a CUDA event: completes when the test says so."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.synchronized = 0

    def complete(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self.synchronized += 1
        self._done.wait()


def _recorder():
    ran: list[tuple[str, str]] = []
    flag = threading.Event()

    def make(tag: str):
        def cb() -> None:
            ran.append((tag, threading.current_thread().name))
            flag.set()

        return cb

    return ran, flag, make


def test_without_lag_the_thread_runs_callbacks_once_events_complete():
    ran, flag, make = _recorder()
    c = Completer("t-nolag")
    try:
        ev = FakeEvent()
        c.submit(ev, make("a"))
        assert not flag.wait(0.05)  # the event has not completed: nothing runs
        ev.complete()
        assert flag.wait(5)
        assert ran == [("a", "t-nolag")]
        assert c.drain(5) and c.pending == 0
    finally:
        c.close()


def test_with_a_lag_the_submitter_reaps_completed_work_itself():
    ran, _, make = _recorder()
    c = Completer("t-lag", lag=30.0)  # the thread would not look for 30 s
    try:
        evs = [FakeEvent() for _ in range(3)]
        for i, ev in enumerate(evs):
            c.submit(ev, make(str(i)))
        assert c.reap() == 0  # head not complete: reap does not wait
        evs[1].complete()
        assert c.reap() == 0  # a later one done, the head not: order is kept
        evs[0].complete()
        assert c.reap() == 2
        me = threading.current_thread().name
        assert ran == [("0", me), ("1", me)]
        assert c.pending == 1
        assert all(ev.synchronized == 0 for ev in evs)  # nobody blocked on an event
    finally:
        evs[2].complete()
        c.close()
    assert [t for t, _ in ran] == ["0", "1", "2"]  # close ran what was left


def test_with_a_lag_the_thread_still_finishes_what_nobody_reaps():
    ran, flag, make = _recorder()
    c = Completer("t-lag-thread", lag=0.01)
    try:
        ev = FakeEvent()
        c.submit(ev, make("x"))
        ev.complete()
        assert flag.wait(5)
        assert ran == [("x", "t-lag-thread")]
        assert c.drain(5)
    finally:
        c.close()


def test_with_a_lag_the_thread_keeps_off_while_the_submitter_keeps_reaping():
    # A stream of messages: the submitter reaps and submits every 10 ms, for 3 lags.
    # The thread must leave every callback to it (taking work while the submitter is
    # busy makes both threads fight for the GIL on each CUDA call); the last one, not
    # reaped, is the thread's once the submitter has been quiet for a lag.
    ran, flag, make = _recorder()
    c = Completer("t-quiet", lag=0.5)
    me = threading.current_thread().name
    try:
        t_end = time.monotonic() + 1.5
        i = 0
        while time.monotonic() < t_end:
            c.reap()
            c.submit(None, make(str(i)))
            i += 1
            time.sleep(0.01)
        assert [t for _, t in ran] == [me] * (i - 1)  # all but the last, reaped here
        assert flag.wait(5) and c.drain(5)
        assert ran[-1] == (str(i - 1), "t-quiet")
    finally:
        c.close()


def test_drain_waits_for_everything_and_a_failing_callback_does_not_stop_the_thread():
    ran, _, make = _recorder()
    c = Completer("t-drain", lag=0.005)
    try:
        evs = [FakeEvent() for _ in range(50)]

        def boom() -> None:
            raise RuntimeError("callback failure (expected by the test)")

        c.submit(None, boom)
        for i, ev in enumerate(evs):
            c.submit(ev, make(str(i)))
        assert not c.drain(0.05)
        for ev in evs:
            ev.complete()
        assert c.drain(5)
        assert [t for t, _ in ran] == [str(i) for i in range(50)]
    finally:
        c.close()
