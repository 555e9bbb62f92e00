"""asyncio support shared by every backend: one waiter thread per connector.

``await conn.aget(key)`` must not block the event loop, must not cost a thread per
call (a server awaits thousands of keys at once), and must lose nothing when the task is
cancelled. The design::

    event loop thread                         the connector's waiter thread (one)
    -----------------                         -----------------------------------
    aget(key):                                loop while someone waits:
      ticket = waiter.subscribe(key)  ----->    avail = conn._arrivals(known, slice)
      try get_nowait(key) -> done                 (blocks in the backend until a key
      await ticket  <-------------------------     not in ``known`` is available)
      try get_nowait(key) -> done                for each ticket of a key in avail:
      (WouldBlock: another reader won,             loop.call_soon_threadsafe(wake)
       subscribe again)

The payload is only ever taken by ``get_nowait`` on the event loop thread, after the
await, with no await between taking it and returning it: a task cancelled while it
waits has taken nothing, so the payload stays for the next ``get`` / ``aget``. The
waiter thread only looks (``_arrivals`` never consumes) and wakes the tasks whose key
came; subscribing before the first ``get_nowait`` closes the window in which a key
could arrive unseen.

Backends provide ``_arrivals(known, timeout) -> set[str]``: the keys available now,
returned as soon as that set has a key not in ``known`` (or after ``timeout``), waking
on the backend's own signal (a condition, the channel semaphore of shm), never by
sleep-polling. It raises the backend's error (``PeerLostError``, ``ClosedError``) when
no key can come; the waiter hands that error to every waiting task, which raises it
unless its key is there after all.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from omnilink.connectors.base import BaseConnector

__all__ = ["ArrivalWaiter"]

logger = logging.getLogger(__name__)

#: Longest single wait in the backend, so the thread notices close() and new keys'
#: owners going away; arrivals wake it at once regardless.
WAIT_SLICE_S = 0.25
#: A thread with nobody waiting for this long exits (and drops its reference to the
#: connector); the next ``aget`` starts another.
IDLE_EXIT_S = 5.0
#: Pause after the backend raised (its error is handed to the waiting tasks, which
#: leave); keeps a persistent error from spinning the thread while new tasks arrive.
_ERROR_PAUSE_S = 0.05


def _wake(fut: asyncio.Future[BaseException | None], exc: BaseException | None) -> None:
    if not fut.done():
        fut.set_result(exc)


class ArrivalWaiter:
    """The waiter thread of one connector and the tickets of the tasks waiting on it."""

    def __init__(self, conn: BaseConnector) -> None:
        self._conn = conn
        self._cond = threading.Condition(threading.Lock())
        self._tickets: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[BaseException | None]]]] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    def subscribe(self, key: str, loop: asyncio.AbstractEventLoop) -> asyncio.Future[BaseException | None]:
        """A future the thread resolves when ``key`` may be there (result ``None``) or the
        backend failed (result: the error)."""
        fut: asyncio.Future[BaseException | None] = loop.create_future()
        with self._cond:
            if self._closed:
                fut.set_result(None)  # the caller's get_nowait raises ClosedError
                return fut
            self._tickets.setdefault(key, []).append((loop, fut))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"omnilink-{self._conn.backend}-aget", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        return fut

    def unsubscribe(self, key: str, fut: asyncio.Future[BaseException | None]) -> None:
        with self._cond:
            tickets = self._tickets.get(key)
            if not tickets:
                return
            tickets[:] = [t for t in tickets if t[1] is not fut]
            if not tickets:
                del self._tickets[key]

    def close(self) -> None:
        """Wake every waiting task and stop the thread; returns once the thread is out of
        the backend (so the backend may free what ``_arrivals`` reads)."""
        with self._cond:
            self._closed = True
            tickets, self._tickets = self._tickets, {}
            thread = self._thread
            self._cond.notify_all()
        self._resolve([t for ts in tickets.values() for t in ts], None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    @staticmethod
    def _resolve(
        tickets: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[BaseException | None]]],
        exc: BaseException | None,
    ) -> None:
        for loop, fut in tickets:
            try:
                loop.call_soon_threadsafe(_wake, fut, exc)
            except RuntimeError:  # that loop is closed: nobody is waiting any more
                pass

    def _run(self) -> None:
        known: set[str] = set()
        while True:
            with self._cond:
                while not self._tickets and not self._closed:
                    if not self._cond.wait(IDLE_EXIT_S) and not self._tickets:
                        self._thread = None  # the next subscribe starts a new one
                        return
                if self._closed:
                    return
            error: BaseException | None = None
            try:
                avail = self._conn._arrivals(known, WAIT_SLICE_S)
            except BaseException as exc:  # handed to the waiting tasks
                error = exc
                avail = set()
            with self._cond:
                if self._closed:
                    return
                if error is not None:
                    woken = [t for ts in self._tickets.values() for t in ts]
                    self._tickets.clear()
                else:
                    woken = []
                    for key in avail.intersection(self._tickets):
                        woken.extend(self._tickets.pop(key))
            self._resolve(woken, error)
            if error is not None:
                logger.debug("%s: waiting for arrivals failed: %s", self._conn.backend, error)
                with self._cond:
                    if not self._closed:
                        self._cond.wait(_ERROR_PAUSE_S)
            else:
                known = avail


async def await_ticket(fut: asyncio.Future[BaseException | None], timeout: float | None) -> Any:
    """Wait for a ticket; ``TimeoutError`` when ``timeout`` passes first."""
    if timeout is None:
        return await fut
    return await asyncio.wait_for(fut, timeout)
