"""Errors of chunk framing (re-exported by ``omnilink.chunking``).

They hang under the omnilink root like every other omnilink error::

    OmnilinkError
     +-- ChunkSequenceError                    a chunk stream broke its ordering contract
     |    +-- ChunkGapError                    a chunk id was skipped (later one present)
     |    +-- DuplicateChunkError              a chunk id was sent or seen twice
     |    +-- StreamFinishedError              something was sent or read after the finish
     +-- ChunkInvariantError (AssertionError)  a ``check_*`` helper found a broken invariant
"""

from __future__ import annotations

from omnilink._errors import OmnilinkError

__all__ = [
    "ChunkGapError",
    "ChunkInvariantError",
    "ChunkSequenceError",
    "DuplicateChunkError",
    "StreamFinishedError",
]


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
    """An invariant of DESIGN.md section 6 does not hold for a list of windows.

    Raised by the ``omnilink.chunking.check_*`` helpers, which verify a chunker's output
    (ours, or a third party's) against the frames that were pushed. ``invariant`` is
    the number of the invariant in DESIGN.md section 6 (or a short name for the key
    and prefill checks).
    """

    def __init__(self, invariant: int | str, message: str) -> None:
        super().__init__(f"chunk invariant {invariant} violated: {message}")
        self.invariant = invariant
