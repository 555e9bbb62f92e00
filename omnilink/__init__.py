"""omnilink: the data plane between the stages of multi-stage inference pipelines.

Importing omnilink is cheap: it never initialises CUDA, and torch is imported only when
a payload needs it. The documentation (``docs/``) describes the tensor_blob format and the connectors.
"""

from __future__ import annotations

from omnilink._errors import (
    BlobDecodeError,
    BlobEncodeError,
    BlobVersionError,
    CapacityError,
    ChunkGapError,
    ChunkInvariantError,
    ChunkSequenceError,
    ClosedError,
    ConfigurationError,
    CudaError,
    DuplicateChunkError,
    DuplicateKeyError,
    KeyConsumedError,
    OmnilinkError,
    PeerLostError,
    StreamFinishedError,
    TransferTimeout,
    TransportError,
    WouldBlock,
)
from omnilink.blob import decode, encode, encode_into, encoded_size
from omnilink.connectors import (
    Connector,
    ConnectorStats,
    available_backends,
    connect,
    connect_backend,
    register_backend,
)

__version__ = "0.1.0"

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
    "Connector",
    "ConnectorStats",
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
    "available_backends",
    "connect",
    "connect_backend",
    "decode",
    "encode",
    "encode_into",
    "encoded_size",
    "register_backend",
]
