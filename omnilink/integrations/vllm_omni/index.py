"""The per-request index behind ``cleanup``: which keys belong to which request.

A key ``{request_id}_{from_stage}_{chunk}`` whose stage is the edge's sender names its
request; any other key is its own request (see ``request_of``).
"""

from __future__ import annotations

from omnilink._errors import ConfigurationError
from omnilink.chunking import parse_chunk_key

_Entry = tuple[str, str, str]  # (side, channel, key)


class _Tracked:
    """Index record of one key: which request, which chunk, since when."""

    __slots__ = ("rid", "stage", "chunk", "since", "settled")

    def __init__(self, rid: str, stage: str | None, chunk: int | None, since: float) -> None:
        self.rid = rid
        self.stage = stage
        self.chunk = chunk
        self.since = since
        #: when the put of this key returned (None while it runs: not published yet)
        self.settled: float | None = since


def _request_of(key: str, from_stage: str) -> tuple[str, str | None, int | None]:
    """(request id, stage, chunk id) of ``key`` sent by ``from_stage``.

    A chunk key whose stage is the edge's sender names its request; any other key (a
    whole-request payload keyed by the request id, say) is its own request.
    """
    try:
        rid, stage, chunk = parse_chunk_key(key)
    except ConfigurationError:
        return key, None, None
    if str(stage) != from_stage:
        return key, None, None
    return rid, from_stage, chunk


def _stage_of(key: str) -> str | None:
    """The sending stage a chunk key names, or ``None`` for any other key."""
    try:
        return str(parse_chunk_key(key)[1])
    except ConfigurationError:
        return None
