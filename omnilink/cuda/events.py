"""``Completer``: runs callbacks once CUDA events complete, off the caller's thread.

The controllers never make the caller's thread wait for a copy. What must happen after
a copy (handing an arena block back, resolving a future, dropping the sources) is queued
here with the copy's event; one thread per controller waits on the events in order
(``cudaEventSynchronize`` releases the GIL) and runs each callback. Events of one
controller complete in order, because they are recorded on one stream, so waiting in
FIFO order never waits longer than needed.

Without CUDA (``event`` is ``None``) callbacks run in the same order on that thread,
so the CPU-only logic is the same code path.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable

__all__ = ["Completer"]

logger = logging.getLogger(__name__)


class Completer:
    """A thread that waits on events in FIFO order and runs their callbacks.

    Parameters
    ----------
    name : str
        Thread name (``omnilink-d2h-cuda:0``).
    """

    def __init__(self, name: str) -> None:
        self._queue: collections.deque[tuple[Any, Callable[[], None]] | None] = collections.deque()
        self._cv = threading.Condition()
        self._pending = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, event: Any, callback: Callable[[], None]) -> None:
        """Run ``callback()`` on the completer thread once ``event`` (or at once: None)
        has completed."""
        with self._cv:
            if self._closed:
                raise RuntimeError("completer is closed")
            self._queue.append((event, callback))
            self._pending += 1
            self._cv.notify()

    @property
    def pending(self) -> int:
        """Callbacks queued or running."""
        return self._pending

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
            self._queue.append(None)
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                item = self._queue.popleft()
            if item is None:
                return
            event, callback = item
            try:
                if event is not None:
                    event.synchronize()
                callback()
            except BaseException:  # a callback must not kill the thread
                logger.exception("omnilink: a copy-completion callback failed")
            finally:
                with self._cv:
                    self._pending -= 1
                    if self._pending == 0:
                        self._cv.notify_all()
