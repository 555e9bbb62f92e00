"""``Completer``: runs callbacks once CUDA events complete, off the caller's thread.

The controllers never make the caller's thread wait for a copy. What must happen after
a copy (handing an arena block back, resolving a future, dropping the sources) is queued
here with the copy's event; one thread per controller waits on the events in order
(``cudaEventSynchronize`` releases the GIL) and runs each callback. Events of one
controller complete in order, because they are recorded on one stream, so waiting in
FIFO order never waits longer than needed.

Without CUDA (``event`` is ``None``) callbacks run in the same order on that thread,
so the CPU-only logic is the same code path.

A completer made with a ``lag`` (the receiver's H2D controller) leaves the work to the
thread that submits it: each ``submit`` first ``reap``s what has completed, and the
completer thread only steps in once nobody has submitted or reaped for ``lag`` seconds,
so a stream of messages costs no thread hand-off per message. The quiet period counts
from the last ``submit`` / ``reap``, not from when the thread found work: a thread that
woke while messages still stream would take the queue from the submitter, and both
threads would then contend for the GIL on the CUDA calls they make (each releases it).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

__all__ = ["Completer"]

_now = time.monotonic

logger = logging.getLogger(__name__)


class Completer:
    """A thread that waits on events in FIFO order and runs their callbacks.

    Parameters
    ----------
    name : str
        Thread name (``omnilink-d2h-cuda:0``).
    lag : float
        Seconds without a ``submit`` or ``reap`` the thread lets pass before it takes
        work off the queue (default 0: at once). With a lag, the submitting thread is expected to call
        ``reap()`` as it goes: callbacks of copies that completed meanwhile then run in
        that thread, at no thread hand-off, and the completer thread only picks up what
        is left (a receiver that stopped calling, the tail of a burst). A hand-off
        between threads costs tens of microseconds on a busy host (a wake-up plus
        the GIL going back and forth); per message, that was most of a small copy's
        cost.
    """

    def __init__(self, name: str, *, lag: float = 0.0) -> None:
        self._queue: collections.deque[tuple[Any, Callable[[], None]] | None] = collections.deque()
        self._cv = threading.Condition()
        self._pending = 0
        self._closed = False
        self._idle = False
        self._lag = float(lag)
        self._closing = threading.Event()  # cuts a lag short at close
        #: ``time.monotonic()`` of the last submit or reap (the quiet period's start)
        self._touched = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, event: Any, callback: Callable[[], None]) -> None:
        """Run ``callback()`` once ``event`` (or at once: None) has completed: on the
        completer thread, or in a thread that calls ``reap()`` first."""
        self._touched = _now()
        with self._cv:
            if self._closed:
                raise RuntimeError("completer is closed")
            self._queue.append((event, callback))
            self._pending += 1
            if self._idle:
                self._idle = False
                self._cv.notify()

    @property
    def pending(self) -> int:
        """Callbacks queued or running."""
        return self._pending

    def reap(self) -> int:
        """Run here, now, the callbacks at the head of the queue whose events have
        completed (never waits on one); return how many ran."""
        self._touched = _now()
        return self._step(block=False) or 0

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every callback queued so far has run; return whether it did."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Run what is queued, then stop the thread (idempotent)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._closing.set()
            self._queue.append(None)
            self._idle = False
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _step(self, *, block: bool) -> int | None:
        """Pop and run callbacks whose events completed, in order; with ``block``, wait
        on the head's event if nothing had completed. ``None``: the close marker."""
        ran = 0
        while True:
            with self._cv:
                if not self._queue:
                    return ran
                item = self._queue[0]
                if item is None:
                    if not block:
                        return ran
                    self._queue.popleft()
                    return None
                event, callback = item
                wait = event is not None and not event.query()
                if wait and not (block and ran == 0):
                    return ran
                self._queue.popleft()
            try:
                if wait:
                    event.synchronize()
                callback()
            except BaseException:  # a callback must not kill the thread
                logger.exception("omnilink: a copy-completion callback failed")
            finally:
                with self._cv:
                    self._pending -= 1
                    if self._pending == 0:
                        self._cv.notify_all()
            ran += 1

    def _quiet(self) -> None:
        """Sleep (GIL released) until nobody has submitted or reaped for ``lag`` seconds,
        or the completer closes: while messages stream, their submitter reaps."""
        closing = self._closing
        while not closing.is_set():
            left = self._touched + self._lag - _now()
            if left <= 0:
                return
            closing.wait(left)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._idle = True
                    self._cv.wait()
                self._idle = False
                closing = self._queue[0] is None
            if self._lag and not closing:
                self._quiet()
            if self._step(block=True) is None:
                return
