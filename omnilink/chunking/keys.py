"""Chunk keys: ``f"{request_id}_{from_stage}_{chunk_id}"`` and its exact inverse.

Layout of a key (parsed from the right, because request ids may contain ``_``)::

    chatcmpl_ab_12 _ 1 _ 7
    '------------'   '-'   '-'
     request_id      stage chunk_id
     (anything but   (no   (canonical decimal,
      NUL; may hold   '_')  0, 1, 2, ...)
      '_')

Nothing is ever truncated: a key longer than ``omnilink._util.MAX_KEY_BYTES`` is refused
(engines that cut ids to 25 characters and keys to 56 bytes saw keys collide, and
``None`` ids made ``None_1_0`` keys shared by every request).
"""

from __future__ import annotations

import re

from omnilink._errors import ConfigurationError
from omnilink._util import validate_key

__all__ = ["chunk_key", "parse_chunk_key", "validate_request_id", "validate_stage"]

_STAGE_RE = re.compile(r"[A-Za-z0-9.\-]+")
_DECIMAL_RE = re.compile(r"0|[1-9][0-9]*")


def validate_request_id(request_id: object) -> str:
    """Return ``request_id`` if it can name a request in a key, else raise.

    Raises
    ------
    ConfigurationError
        ``request_id`` is ``None``, not a ``str``, empty, or holds NUL.
    """
    if request_id is None:
        raise ConfigurationError(
            "request_id is None: every request needs its own id (a None id would make "
            "keys such as 'None_1_0' that every request shares)"
        )
    if not isinstance(request_id, str):
        raise ConfigurationError(
            f"request_id must be a str, got {type(request_id).__name__}: {request_id!r}"
        )
    if not request_id:
        raise ConfigurationError("request_id must not be empty")
    if "\x00" in request_id:
        raise ConfigurationError(f"request_id must not contain NUL: {request_id!r}")
    return request_id


def validate_stage(from_stage: object) -> str:
    """Return the key text of a stage id (an ``int >= 0`` or a name without ``_``).

    Raises
    ------
    ConfigurationError
        Negative, boolean or non-int/str stage, or a name that is empty or holds
        anything outside ``[A-Za-z0-9.-]`` (``_`` would make keys ambiguous).
    """
    if isinstance(from_stage, bool) or not isinstance(from_stage, (int, str)):
        raise ConfigurationError(
            f"from_stage must be an int >= 0 or a str, got {type(from_stage).__name__}: {from_stage!r}"
        )
    if isinstance(from_stage, int):
        if from_stage < 0:
            raise ConfigurationError(f"from_stage must be >= 0, got {from_stage}")
        return str(from_stage)
    if not _STAGE_RE.fullmatch(from_stage):
        raise ConfigurationError(
            f"invalid from_stage {from_stage!r}: use 1 or more characters of [A-Za-z0-9.-] "
            "('_' separates the parts of a chunk key)"
        )
    return from_stage


def _validate_chunk_id(chunk_id: object) -> int:
    if isinstance(chunk_id, bool) or not isinstance(chunk_id, int):
        raise ConfigurationError(
            f"chunk_id must be an int >= 0, got {type(chunk_id).__name__}: {chunk_id!r}"
        )
    if chunk_id < 0:
        raise ConfigurationError(f"chunk_id must be >= 0, got {chunk_id}")
    return chunk_id


def chunk_key(request_id: str, from_stage: int | str, chunk_id: int, /) -> str:
    """The transport key of chunk ``chunk_id`` of ``request_id`` sent by ``from_stage``.

    Parameters
    ----------
    request_id : str
        The request's external id, used whole (it may contain ``_``).
    from_stage : int or str
        The sending stage: an ``int >= 0`` or a name of ``[A-Za-z0-9.-]``.
    chunk_id : int
        0, 1, 2, ... per request and edge; a full (unchunked) payload is chunk 0.

    Returns
    -------
    str
        ``f"{request_id}_{from_stage}_{chunk_id}"``.

    Raises
    ------
    ConfigurationError
        ``None``, empty or non-str request id; bad stage; negative or non-int chunk id;
        a key longer than ``MAX_KEY_BYTES`` (keys are never truncated).
    """
    rid = validate_request_id(request_id)
    stage = validate_stage(from_stage)
    cid = _validate_chunk_id(chunk_id)
    return validate_key(f"{rid}_{stage}_{cid}")


def parse_chunk_key(key: str, /) -> tuple[str, int | str, int]:
    """Split a chunk key into ``(request_id, from_stage, chunk_id)``; the exact inverse.

    The key is split at its last two ``_``, so request ids holding ``_`` come back
    whole. A stage written as a canonical decimal (``0``, ``17``) comes back as an
    ``int``, any other stage name as a ``str``; either way
    ``chunk_key(*parse_chunk_key(k)) == k``.

    Raises
    ------
    ConfigurationError
        ``key`` is not a str, or not of the form ``{request_id}_{stage}_{chunk_id}``
        with a non-empty request id, a valid stage and a canonical decimal chunk id.
    """
    validate_key(key)
    parts = key.rsplit("_", 2)
    if len(parts) != 3:
        raise ConfigurationError(
            f"malformed chunk key {key!r}: expected '{{request_id}}_{{from_stage}}_{{chunk_id}}'"
        )
    rid, stage, cid = parts
    if not rid:
        raise ConfigurationError(f"malformed chunk key {key!r}: empty request id")
    if not _DECIMAL_RE.fullmatch(cid):
        raise ConfigurationError(
            f"malformed chunk key {key!r}: chunk id {cid!r} is not a canonical decimal"
        )
    if not _STAGE_RE.fullmatch(stage):
        raise ConfigurationError(f"malformed chunk key {key!r}: invalid stage {stage!r}")
    from_stage: int | str = int(stage) if _DECIMAL_RE.fullmatch(stage) else stage
    return rid, from_stage, int(cid)
