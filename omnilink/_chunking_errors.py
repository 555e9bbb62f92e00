"""Errors of chunk framing, defined with every other error in ``omnilink._errors``
(re-exported by ``omnilink.chunking``)."""

from __future__ import annotations

from omnilink._errors import (
    ChunkGapError,
    ChunkInvariantError,
    ChunkSequenceError,
    DuplicateChunkError,
    StreamFinishedError,
)

__all__ = [
    "ChunkGapError",
    "ChunkInvariantError",
    "ChunkSequenceError",
    "DuplicateChunkError",
    "StreamFinishedError",
]
