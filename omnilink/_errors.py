"""The omnilink exception tree.

Every error a public omnilink call raises is one of these; foreign exceptions (msgspec,
zmq, posix_ipc, torch) are translated where they occur, always with ``raise ... from``.
Leaves also inherit the builtin they mean, so ``except TimeoutError`` still works::

    OmnilinkError
     +-- BlobEncodeError                       payload cannot be put on the wire
     +-- BlobDecodeError                       malformed or hostile tensor_blob
     |    +-- BlobVersionError                 well-formed frame of another version
     +-- ConfigurationError (ValueError)       bad option, name, key or channel
     +-- TransportError                        moving the bytes failed
     |    +-- TransferTimeout (TimeoutError)   a blocking call ran past its timeout
     |    +-- PeerLostError (ConnectionError)  the process on the other end died
     |    +-- ClosedError                      use after close()
     +-- WouldBlock                            *_nowait call with nothing ready
     +-- CapacityError                         payload or arena too large for the resource
     +-- CudaError (RuntimeError)              a CUDA call failed or CUDA is unavailable
"""

from __future__ import annotations

__all__ = [
    "BlobDecodeError",
    "BlobEncodeError",
    "BlobVersionError",
    "CapacityError",
    "ClosedError",
    "ConfigurationError",
    "CudaError",
    "OmnilinkError",
    "PeerLostError",
    "TransferTimeout",
    "TransportError",
    "WouldBlock",
]


class OmnilinkError(Exception):
    """Root of every error omnilink raises."""


class BlobEncodeError(OmnilinkError):
    """A payload holds something tensor_blob cannot carry (the message names its path)."""


class BlobDecodeError(OmnilinkError):
    """A buffer is not a valid tensor_blob frame (the message says what is wrong)."""


class BlobVersionError(BlobDecodeError):
    """A tensor_blob frame of a version this omnilink does not read."""


class ConfigurationError(OmnilinkError, ValueError):
    """An option, backend name, channel name or key is invalid."""


class TransportError(OmnilinkError):
    """Moving a payload between processes failed."""


class TransferTimeout(TransportError, TimeoutError):
    """A blocking call waited past its timeout.

    The message names the channel, the key and the peer waited for; the same facts are
    kept as the attributes ``channel``, ``key`` and ``peer`` (``None`` when unknown).
    """

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
