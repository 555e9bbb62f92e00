"""The in-process reference backend ``"memory"`` (httpcore's ``MockBackend`` in spirit).

Every connector opened on the same channel name in one process shares one
``_Channel``: a dict of pending frames guarded by a ``threading.Condition``. Nothing
crosses a process boundary, but payloads still travel as real tensor_blob frames, so
the memory backend fails exactly where the real ones do (``BlobEncodeError`` for an
object the format cannot carry) and hands out the same zero-copy views. Tests and the
documentation use it; ``omnilink.testing`` checks it like any other backend.

Life of one key on a channel::

                put(key) encodes            get(key) / get_nowait(key)
     (absent) ------------------> PENDING ----------------------------> (absent)
        ^                            |        frame handed to decode:
        |         discard(key)       |        exactly one caller wins
        +----------------------------+
                                     |  last connector on the channel closes:
                                     +----> dropped with the channel

A frame is stored as a ``bytearray`` written in place by the blob encoder (the
``omnilink.encode_into`` path). ``get``
removes it from the channel and decodes it in place, so every tensor and array of the
result is a writable view of that ``bytearray``; it is freed when the last view dies.

Backpressure: with ``capacity_bytes`` set, the pending frames of a channel never hold
more than that many bytes in total. ``put`` waits (up to its timeout) for a ``get`` or
``discard`` to make room, and a frame larger than the whole capacity is refused at once
with ``CapacityError``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from omnilink._errors import (
    CapacityError,
    ClosedError,
    ConfigurationError,
    WouldBlock,
)
from omnilink._util import ConsumedKeys, Deadline, duplicate_key
from omnilink.blob import decode, prepare
from omnilink.connectors.base import BaseConnector, Role, check_constructor_options

__all__ = ["MemoryConnector"]

logger = logging.getLogger(__name__)


class _Channel:
    """Shared state of one channel name: pending frames and their byte count."""

    __slots__ = ("name", "capacity", "cond", "frames", "nbytes", "users", "consumed")

    def __init__(self, name: str, capacity: int | None) -> None:
        self.name = name
        self.capacity = capacity
        self.cond = threading.Condition(threading.Lock())
        self.frames: dict[str, bytearray] = {}
        self.nbytes = 0
        self.users = 0
        self.consumed = ConsumedKeys()


# Channel name -> shared state. A channel exists while at least one connector on it is
# open; ``_registry_lock`` orders opening and closing against each other.
_channels: dict[str, _Channel] = {}
_registry_lock = threading.Lock()


def _attach(name: str, capacity: int | None) -> _Channel:
    with _registry_lock:
        chan = _channels.get(name)
        if chan is None:
            chan = _channels[name] = _Channel(name, capacity)
        elif chan.capacity is None and capacity is not None:
            # Nobody on the channel named a capacity yet: the first one named applies,
            # whichever end opened first (usually the sender configures it).
            with chan.cond:
                chan.capacity = capacity
        elif capacity is not None and chan.capacity != capacity:
            raise ConfigurationError(
                f"memory channel {name!r} is already open with capacity_bytes="
                f"{chan.capacity!r}; a connector cannot open it with capacity_bytes={capacity!r}"
            )
        chan.users += 1
        return chan


def _detach(chan: _Channel) -> None:
    with _registry_lock:
        chan.users -= 1
        if chan.users > 0:
            return
        if _channels.get(chan.name) is chan:
            del _channels[chan.name]
    with chan.cond:
        dropped = len(chan.frames)
        chan.frames.clear()
        chan.nbytes = 0
    if dropped:
        logger.debug(
            "memory channel %r closed by its last connector; dropped %d unread payload(s)",
            chan.name,
            dropped,
        )


def _check_values(*, capacity_bytes: Any) -> None:
    """The value checks of ``MemoryConnector``'s options (its constructor and its
    ``check_options`` both call this).

    Raises
    ------
    ConfigurationError
        ``capacity_bytes`` is neither ``None`` nor a positive int.
    """
    if capacity_bytes is not None and (
        isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0
    ):
        raise ConfigurationError(
            f"capacity_bytes must be a positive int or None, got {capacity_bytes!r}"
        )


class MemoryConnector(BaseConnector):
    """A connector whose channel lives in this process's memory.

    Connectors opened with the same ``channel`` in one process talk to each other; any
    number of senders and receivers may share a channel, and each key is consumed by
    exactly one ``get``. Closing the last connector on a channel drops the channel and
    any payload nobody read.

    Parameters
    ----------
    channel : str
        Channel name (see ``omnilink._util.validate_channel``).
    role : {"sender", "receiver", "dual"}
        A ``"sender"`` may not ``get`` and a ``"receiver"`` may not ``put`` (both are a
        ``ConfigurationError``); ``"dual"`` does both. Either role may ``discard``.
    timeout : float, optional
        Default seconds for blocking calls; ``None`` waits without limit.
    capacity_bytes : int, optional
        Most bytes the channel's pending frames may hold together. ``None`` (default)
        names none: the channel is unbounded until a connector on it names one. Every
        connector that names a capacity for an open channel must name the same one.

    Raises
    ------
    ConfigurationError
        Invalid channel, role, timeout or ``capacity_bytes``, or a ``capacity_bytes``
        that differs from the one the channel was opened with.

    Notes
    -----
    Reusing a key that is still pending on the channel (put, not yet consumed or
    discarded) is a ``DuplicateKeyError`` (a ``ConfigurationError``): the second payload
    would otherwise replace or shadow the first, and one of them would be lost. Once the
    key has been consumed or discarded it may be used again. A ``get`` of a key consumed
    or discarded recently (the channel remembers the last 65,536) raises
    ``KeyConsumedError`` at once instead of waiting, until the key is put again.

    Both ends live in one process, so there is no peer to lose: this backend never
    raises ``PeerLostError``. A ``get`` waits for a sender on the channel until its
    timeout, even if every sender has closed.
    """

    backend = "memory"

    @classmethod
    def check_options(cls, options: dict[str, Any], /) -> None:
        """Refuse, opening nothing, the option values the constructor would refuse.

        The hook ``omnilink.connectors.check_backend_options`` calls.

        Parameters
        ----------
        options : dict
            Keyword options as ``connect`` would receive them.

        Raises
        ------
        ConfigurationError
            ``role`` or ``timeout`` invalid, or ``capacity_bytes`` neither ``None`` nor
            a positive int.
        """
        check_constructor_options(cls, _check_values, options)

    def __init__(
        self,
        *,
        channel: str,
        role: Role = "dual",
        timeout: float | None = None,
        capacity_bytes: int | None = None,
    ) -> None:
        super().__init__(channel=channel, role=role, timeout=timeout)
        _check_values(capacity_bytes=capacity_bytes)
        self.capacity_bytes = capacity_bytes
        # Set (under the channel's condition) before BaseConnector.close waits for the
        # put_async executor, so a put blocked on backpressure wakes and gives up instead
        # of holding close() until its own timeout.
        self._closing = False
        self._chan = _attach(self.channel, capacity_bytes)

    # ----------------------------------------------------------------- hooks
    def _put(self, key: str, payload: Any, deadline: Deadline) -> int:
        self._check_can_put()
        with self._chan.cond:
            # Cheap early refusal; the authoritative check is repeated under the lock in _store_frames.
            self._check_key_free(key)
        frame = self._encode_frame(key, payload)
        self._store_frames([key], [frame], deadline, [])
        return len(frame)

    def _put_many(self, keys: list[str], payloads: list[Any], deadline: Deadline) -> list[int]:
        """Every frame is encoded first; then one hold of the channel's lock stores them
        all and wakes the readers once (and again before each wait for room)."""
        stored: list[str] = []
        sizes: list[int] = []
        try:
            self._check_can_put()
            with self._chan.cond:
                for key in keys:
                    self._check_key_free(key)
            frames = [self._encode_frame(key, payload) for key, payload in zip(keys, payloads)]
            sizes = [len(f) for f in frames]
            self._store_frames(keys, frames, deadline, stored)
        except Exception as exc:
            if stored:
                self._count(puts=len(stored), bytes_put=sum(sizes[: len(stored)]))
            self._raise_put_many(exc, keys, len(stored))
        self._count(puts=len(sizes), bytes_put=sum(sizes))
        return sizes

    def _encode_frame(self, key: str, payload: Any) -> bytearray:
        """``payload`` encoded into a frame of its own."""
        # One walk of the payload sizes and writes the frame (prepare == encoded_size +
        # encode_into without walking twice).
        prepared = prepare(payload)
        n = prepared.nbytes
        self._check_fits(key, n)  # before allocating a frame that could never be stored
        frame = bytearray(n)
        prepared.write_into(frame)
        return frame

    def _store_frames(self, keys: list[str], frames: list[bytearray], deadline: Deadline, stored: list[str]) -> None:
        """Put ``frames`` on the channel in order, each waiting (up to ``deadline``) for
        room; ``stored`` collects the keys stored. One notification at the end, and one
        before each wait (the frames stored so far may be what frees the room)."""
        chan = self._chan
        with chan.cond:
            for key, frame in zip(keys, frames):
                n = len(frame)
                while True:
                    self._raise_if_closing()
                    self._check_key_free(key)
                    # Re-read: a connector opened meanwhile may have named the capacity.
                    capacity = self._check_fits(key, n)
                    if capacity is None or chan.nbytes + n <= capacity:
                        break
                    remaining = deadline.remaining()
                    if remaining == 0.0:
                        raise self._timeout("put", key, "a receiver to make room", deadline.timeout)
                    if stored:
                        chan.cond.notify_all()
                    chan.cond.wait(remaining)
                chan.frames[key] = frame
                chan.nbytes += n
                chan.consumed.forget(key)
                stored.append(key)
            chan.cond.notify_all()

    def _get(self, key: str, deadline: Deadline, block: bool) -> Any:
        (frame,) = self._take_frames([key], deadline, block)
        self._count(bytes_got=len(frame))
        # Decoded outside the lock: views of ``frame``, which only they now reference.
        # The frame was popped: only these views reference it, so they may be writable.
        return decode(frame, view_readonly=True)

    def _get_many(self, keys: list[str], deadline: Deadline, device: Any) -> dict[str, Any]:
        frames = self._take_frames(keys, deadline, True)
        self._count(gets=len(frames), bytes_got=sum(map(len, frames)))
        out = {key: decode(frame, view_readonly=True) for key, frame in zip(keys, frames)}
        if device is not None:
            from omnilink.cuda import payload_to_device

            out = {key: payload_to_device(obj, device) for key, obj in out.items()}
        return out

    def _take_frames(self, keys: list[str], deadline: Deadline, block: bool) -> list[bytearray]:
        """Pop the frames of ``keys`` once all are on the channel (waiting up to
        ``deadline`` when ``block``); all or none."""
        if self.role == "sender":
            raise ConfigurationError(
                f"memory connector on channel {self.channel!r} was opened with role='sender' "
                "and cannot get; open it with role='receiver' or 'dual'"
            )
        chan = self._chan
        frames = chan.frames
        with chan.cond:
            while True:
                self._raise_if_closing()
                missing = [k for k in keys if k not in frames]
                if not missing:
                    taken = [frames.pop(k) for k in keys]
                    for k, frame in zip(keys, taken):
                        chan.consumed.add(k)
                        chan.nbytes -= len(frame)
                    # Room appeared: wake puts blocked on backpressure.
                    chan.cond.notify_all()
                    return taken
                for k in missing:
                    if k in chan.consumed:
                        raise chan.consumed.error(self.backend, self.channel, k, by="a receiver of the channel")
                if not block:
                    raise WouldBlock(f"memory: key {keys[0]!r} is not on channel {self.channel!r} yet")
                remaining = deadline.remaining()
                if remaining == 0.0:
                    if len(keys) == 1:
                        raise self._timeout("get", keys[0], "a sender", deadline.timeout)
                    raise self._many_timeout(keys, missing, "a sender", deadline.timeout)
                chan.cond.wait(remaining)

    def _arrivals(self, known: set[str], timeout: float) -> set[str]:
        if self.role == "sender":
            raise ConfigurationError(
                f"memory connector on channel {self.channel!r} was opened with role='sender' and cannot get"
            )
        chan = self._chan
        deadline = Deadline(timeout)
        with chan.cond:
            while True:
                self._raise_if_closing()
                avail = set(chan.frames)
                remaining = deadline.remaining()
                if not avail <= known or not remaining:
                    return avail
                chan.cond.wait(remaining)

    def _discard(self, key: str) -> bool:
        chan = self._chan
        with chan.cond:
            frame = chan.frames.pop(key, None)
            if frame is None:
                return False
            chan.consumed.add(key, "discarded")
            chan.nbytes -= len(frame)
            chan.cond.notify_all()
            return True

    def _close(self) -> None:
        _detach(self._chan)

    def _in_use(self) -> tuple[int, int]:
        """Pending frames and bytes of the whole channel (it all lives in this process)."""
        chan = self._chan
        with chan.cond:
            return (len(chan.frames), chan.nbytes)

    # ---------------------------------------------------------------- helpers
    def _check_can_put(self) -> None:
        if self.role == "receiver":
            raise ConfigurationError(
                f"memory connector on channel {self.channel!r} was opened with role='receiver' "
                "and cannot put; open it with role='sender' or 'dual'"
            )

    def _check_key_free(self, key: str) -> None:
        if key in self._chan.frames:
            raise duplicate_key(self.backend, self.channel, key)

    def _check_fits(self, key: str, n: int) -> int | None:
        capacity = self._chan.capacity
        if capacity is not None and n > capacity:
            raise CapacityError(
                f"memory: payload for key {key!r} is {n} bytes, larger than the "
                f"capacity_bytes={capacity} of channel {self.channel!r}"
            )
        return capacity

    def _raise_if_closing(self) -> None:
        if self._closing or self._closed:
            raise ClosedError(f"memory connector on channel {self.channel!r} is closed")

    def close(self) -> None:
        """Release this connector; the last one on a channel drops it. Idempotent.

        Calls blocked in ``get`` or ``put`` on this connector (from other threads, or a
        pending ``put_async``) wake up and raise ``ClosedError``.
        """
        chan = self._chan
        with chan.cond:
            self._closing = True
            chan.cond.notify_all()
        super().close()
