"""The omnilink exception tree.

Every error a public omnilink call raises is one of these; foreign exceptions (msgspec,
zmq, posix_ipc, torch) are translated where they occur, always with ``raise ... from``.
Leaves also inherit the builtin they mean, so ``except TimeoutError`` still works::

    OmnilinkError
     +-- BlobEncodeError                       payload cannot be put on the wire
     +-- BlobDecodeError                       malformed or hostile tensor_blob
     |    +-- BlobVersionError                 well-formed frame of another version
     +-- ConfigurationError (ValueError)       bad option, name, key or channel
     |    +-- DuplicateKeyError                put of a key still pending on the channel
     +-- KeyConsumedError (LookupError)        get of a key this receiver already consumed
     +-- TransportError                        moving the bytes failed
     |    +-- TransferTimeout (TimeoutError)   a blocking call ran past its timeout
     |    +-- PeerLostError (ConnectionError)  the process on the other end died
     |    +-- ClosedError                      use after close()
     +-- WouldBlock                            *_nowait call with nothing ready
     +-- CapacityError                         payload or arena too large for the resource
     +-- CudaError (RuntimeError)              a CUDA call failed or CUDA is unavailable
     +-- ChunkSequenceError                    a chunk stream broke its ordering contract
     |    +-- ChunkGapError                    a chunk id was skipped (later one present)
     |    +-- DuplicateChunkError              a chunk id was sent or seen twice
     |    +-- StreamFinishedError              something was sent or read after the finish
     +-- ChunkInvariantError (AssertionError)  a chunking ``check_*`` helper found a broken invariant
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BlobDecodeError",
    "BlobEncodeError",
    "BlobVersionError",
    "CapacityError",
    "ChunkGapError",
    "ChunkInvariantError",
    "ChunkSequenceError",
    "ClosedError",
    "ConfigurationError",
    "CudaError",
    "DuplicateChunkError",
    "DuplicateKeyError",
    "KeyConsumedError",
    "OmnilinkError",
    "PeerLostError",
    "StreamFinishedError",
    "TransferTimeout",
    "TransportError",
    "WouldBlock",
]


class OmnilinkError(Exception):
    """Root of every error omnilink raises.

    An error a batch call raised says how far the batch got: ``put_many`` sets ``sent``
    (the keys it published before the error, in order: they stay published) and
    ``unsent`` (the others, the failed one first); a ``get_many`` that took payloads
    before its error (the generic version, see ``BaseConnector.get_many``) hands them
    over as ``got`` (key -> payload). They are ``None`` on every other error.
    """

    sent: list[str] | None = None
    unsent: list[str] | None = None
    got: dict[str, Any] | None = None


class BlobEncodeError(OmnilinkError):
    """A payload holds something tensor_blob cannot carry (the message names its path)."""


class BlobDecodeError(OmnilinkError):
    """A buffer is not a valid tensor_blob frame (the message says what is wrong)."""


class BlobVersionError(BlobDecodeError):
    """A tensor_blob frame of a version this omnilink does not read."""


class ConfigurationError(OmnilinkError, ValueError):
    """An option, backend name, channel name or key is invalid."""


class DuplicateKeyError(ConfigurationError):
    """``put`` of a key that is still pending on the channel (put, not yet consumed or
    discarded). Every backend raises it for a second put from the same sender; the first
    payload stays deliverable. ``key`` and ``channel`` say which."""

    def __init__(self, message: str, *, channel: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.channel = channel
        self.key = key


class KeyConsumedError(OmnilinkError, LookupError):
    """``get`` of a key this receiver consumed (or discarded) recently, instead of a wait
    that could only time out. Receivers remember the last ``CONSUMED_KEYS_REMEMBERED``
    (65,536) keys they consumed; putting the key again makes it receivable again.
    ``key`` and ``channel`` say which."""

    def __init__(self, message: str, *, channel: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.channel = channel
        self.key = key


class TransportError(OmnilinkError):
    """Moving a payload between processes failed."""


class TransferTimeout(TransportError, TimeoutError):
    """A blocking call waited past its timeout.

    The message names the channel, the key and the peer waited for; the same facts are
    kept as the attributes ``channel``, ``key`` and ``peer`` (``None`` when unknown).
    A ``get_many`` that timed out names every key it still waited for as ``missing``
    (``key`` is the first of them; ``None`` for other calls).
    """

    missing: list[str] | None = None

    def __init__(
        self,
        message: str,
        *,
        channel: str | None = None,
        key: str | None = None,
        peer: str | None = None,
    ) -> None:
        super().__init__(message)
        self.channel = channel
        self.key = key
        self.peer = peer


class PeerLostError(TransportError, ConnectionError):
    """The process at the other end of a channel died or went away."""


class ClosedError(TransportError):
    """A connector or resource was used after ``close()``."""


class WouldBlock(OmnilinkError):
    """A ``*_nowait`` call found nothing ready; the blocking sibling would have waited."""


class CapacityError(OmnilinkError):
    """A payload is larger than the resource can ever hold, or a resource is exhausted."""


class CudaError(OmnilinkError, RuntimeError):
    """A CUDA call failed, or a CUDA path was asked for where CUDA is unavailable."""


class ChunkSequenceError(OmnilinkError):
    """A chunk stream of one (request, edge) broke its ordering contract.

    The attributes ``request_id``, ``from_stage`` and ``chunk_id`` (the id that was
    expected or offended; ``None`` when unknown) say where.
    """

    def __init__(
        self,
        message: str,
        *,
        request_id: str | None = None,
        from_stage: int | str | None = None,
        chunk_id: int | None = None,
    ) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.from_stage = from_stage
        self.chunk_id = chunk_id


class ChunkGapError(ChunkSequenceError):
    """Chunk ``chunk_id`` is missing while a later chunk of the same stream is there."""


class DuplicateChunkError(ChunkSequenceError):
    """A chunk id was sent twice, or a receiver saw a chunk id it had already consumed."""


class StreamFinishedError(ChunkSequenceError):
    """A chunk was sent or asked for after the chunk carrying ``meta.finished``."""


class ChunkInvariantError(OmnilinkError, AssertionError):
    """A chunk-framing invariant does not hold for a list of windows.

    Raised by the ``omnilink.chunking.check_*`` helpers, which verify a chunker's output
    (ours, or a third party's) against the frames that were pushed. ``invariant`` is
    the number of the invariant as ``omnilink.chunking`` lists them (1 to 7, also on the
    documentation's streaming page), or a short name for the key and prefill checks.
    """

    def __init__(self, invariant: int | str, message: str) -> None:
        super().__init__(f"chunk invariant {invariant} violated: {message}")
        self.invariant = invariant
