"""The control channel's messages and the checks every received one passes.

One zmq frame per message: a msgspec msgpack array whose first item is the message's
tag. Nothing is pickled. The decoder is typed (an unknown tag, a missing or extra
field, a wrong type or a value out of range is refused) and bounded (``MAX_*`` below),
so a hostile frame costs at most its own size to reject::

    sender -> receiver                          receiver -> sender
    ------------------                          ------------------
    ["hello", version, session, pid, md]        ["welcome", version, session, md,
                                                 pool_addr, pool_bytes, mem, dev, bell]
    ["extent", need]                            ["granted", offset, length, frees]
    ["publish", seq, key, offset, length, meta, ["ack", seq, status, text, frees]
     written, data]
    ["written", seq, status]                    ["refused", text]
    ["return", offset]
    ["bye"]

- A sender's ``session`` (32 hex digits, fresh per connection) is also its zmq routing
  id; ``md`` is its NIXL agent metadata.
- ``bell`` (in ``welcome``): the receiver's doorbell (``omnilink.connectors.bell``), a
  plain stream socket with no I/O thread: ``unix:@NAME`` (an ipc endpoint) or
  ``tcp:PORT`` (on the control endpoint's host). The sender connects, sends its
  ``session`` as the first message, then its ``publish`` messages go there and their
  ``ack`` come back on it, as do ``granted`` answers and ``written`` goes there too;
  everything else stays on the control channel.
- ``extent``: the sender asks for a part of the receiver's pool of at least ``need``
  bytes. ``granted`` gives one (``length`` 0: none now; the receiver answers again
  when blocks come free) and hands back ``frees``, the offsets of blocks whose last
  view died since the last answer. The sender allocates its blocks inside its extents.
- ``publish``: the sender WROTE ``length`` bytes (the frame's data region) at pool
  offset ``offset`` and publishes them under ``key``; ``meta`` is the frame's prefix
  and header (the bytes ``omnilink.decode`` validates), sent here so that nothing the
  receiver parses lies in memory a peer can write to. ``check_block`` is the pool-side
  validation: the block must lie in one of *this* sender's extents and overlap none
  of its live blocks, before anything is read. ``written`` false: the WRITE is still
  on its way (the payload is published *ahead* so that the receiver validates and
  decodes it meanwhile); the payload becomes gettable only with its ``written``
  message: ``WRITTEN_OK`` (then it is acknowledged; a refusal is answered at once), or
  ``WRITTEN_FAILED`` (the receiver drops it, its block comes free as any other) or
  ``WRITTEN_STUCK`` (the WRITE could not be cancelled and may still land: the block
  stays taken while the receiver lives); neither failure is answered. ``data``: the
  data region itself, for a payload of at most ``INLINE_MAX_BYTES`` sent *inline*
  instead of written (no WRITE: the receiver copies it into the block); it must be
  exactly the frame's data region and comes only with ``written`` true.
- ``ack`` status: ``ACK_OK``, ``ACK_DUPLICATE_KEY``, ``ACK_DECODE_ERROR`` (``text``
  says why), ``ACK_BAD_BLOCK`` (the descriptor failed ``check_block``).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec

from omnilink._errors import BlobDecodeError
from omnilink.blob import MAX_HEADER_BYTES, PREFIX_SIZE

__all__ = [
    "ACK_BAD_BLOCK",
    "ACK_DECODE_ERROR",
    "ACK_DUPLICATE_KEY",
    "ACK_OK",
    "INLINE_MAX_BYTES",
    "MAX_FRAME_BYTES",
    "VERSION",
    "WRITTEN_FAILED",
    "WRITTEN_OK",
    "WRITTEN_STUCK",
    "Ack",
    "Bye",
    "Extent",
    "Granted",
    "Hello",
    "Publish",
    "Refused",
    "Return",
    "Welcome",
    "Written",
    "check_block",
    "decode_from_receiver",
    "decode_from_sender",
    "encode",
]

VERSION = 4
ACK_OK = 0
ACK_DUPLICATE_KEY = 1
ACK_DECODE_ERROR = 2
ACK_BAD_BLOCK = 3
WRITTEN_OK = 0
WRITTEN_FAILED = 1
WRITTEN_STUCK = 2

#: Largest NIXL agent metadata accepted (a UCX agent's is a few KiB).
MAX_METADATA_BYTES = 1 << 20
#: Largest pool offset or length (2**48: far above any memory, far below int64).
MAX_OFFSET = 1 << 48
#: Most block offsets one answer hands back.
MAX_FREES = 1 << 16
MAX_TEXT = 4096
#: Largest data region a ``publish`` carries inline (a payload's whole data region).
INLINE_MAX_BYTES = 64 << 10
#: Largest frame the receiver's socket takes (zmq drops the connection above it).
MAX_FRAME_BYTES = PREFIX_SIZE + MAX_HEADER_BYTES + INLINE_MAX_BYTES + 4096

_Off = Annotated[int, msgspec.Meta(ge=0, le=MAX_OFFSET)]
_Session = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}$")]
_Md = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_METADATA_BYTES)]
_Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
_Frees = Annotated[list[_Off], msgspec.Meta(max_length=MAX_FREES)]


class _Msg(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True, tag=str.lower):
    pass


class Hello(_Msg):
    version: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
    session: _Session
    pid: Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]
    md: _Md


class Extent(_Msg):
    need: Annotated[int, msgspec.Meta(ge=1, le=MAX_OFFSET)]


class Publish(_Msg):
    seq: Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
    # validate_key applies the key rules; this bounds what the decoder builds.
    key: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    offset: _Off
    length: _Off
    meta: Annotated[bytes, msgspec.Meta(min_length=PREFIX_SIZE, max_length=PREFIX_SIZE + MAX_HEADER_BYTES)]
    written: bool = True
    data: Annotated[bytes, msgspec.Meta(max_length=INLINE_MAX_BYTES)] = b""


class Written(_Msg):
    seq: Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
    status: Annotated[int, msgspec.Meta(ge=WRITTEN_OK, le=WRITTEN_STUCK)]


class Return(_Msg):
    offset: _Off


class Bye(_Msg):
    pass


class Welcome(_Msg):
    version: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
    session: _Session
    md: _Md
    pool_addr: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    pool_bytes: _Off
    mem: Literal["DRAM", "VRAM"]
    dev: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
    bell: Annotated[str, msgspec.Meta(max_length=256, pattern=r"^(|unix:@[0-9A-Za-z._-]{1,200}|tcp:[0-9]{1,5})$")]


class Granted(_Msg):
    offset: _Off
    length: _Off
    frees: _Frees


class Ack(_Msg):
    seq: Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
    status: Annotated[int, msgspec.Meta(ge=0, le=255)]
    text: _Text
    frees: _Frees


class Refused(_Msg):
    text: _Text


FromSender = Union[Hello, Extent, Publish, Written, Return, Bye]
FromReceiver = Union[Welcome, Granted, Ack, Refused]

_encoder = msgspec.msgpack.Encoder()
_from_sender = msgspec.msgpack.Decoder(FromSender)
_from_receiver = msgspec.msgpack.Decoder(FromReceiver)


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode_from_sender(raw: bytes | memoryview) -> FromSender:
    """A sender's message, validated as far as its own bytes go.

    Raises
    ------
    BlobDecodeError
        Not a well-formed message of a sender (the message says what is wrong).
    """
    try:
        return _from_sender.decode(raw)
    # msgspec reports invalid UTF-8 in a str as UnicodeDecodeError, not MsgspecError.
    except (msgspec.MsgspecError, UnicodeDecodeError) as exc:
        raise BlobDecodeError(f"nixl: malformed control message from a sender: {exc}") from exc


def decode_from_receiver(raw: bytes | memoryview) -> FromReceiver:
    """A receiver's message (see ``decode_from_sender``).

    Raises
    ------
    BlobDecodeError
        Not a well-formed message of a receiver.
    """
    try:
        return _from_receiver.decode(raw)
    # msgspec reports invalid UTF-8 in a str as UnicodeDecodeError, not MsgspecError.
    except (msgspec.MsgspecError, UnicodeDecodeError) as exc:
        raise BlobDecodeError(f"nixl: malformed control message from the receiver: {exc}") from exc


def check_block(offset: int, length: int, extents: dict[int, int], pool_bytes: int) -> int | None:
    """The extent (its offset) that holds ``[offset, offset + length)`` whole, or ``None``.

    ``extents`` maps the offsets of the extents granted to the publishing sender to
    their lengths; every extent lies in the pool. Pure arithmetic on Python ints: no
    overflow, nothing read. A zero-length block is never in an extent (a payload
    without tensor bytes publishes no block).
    """
    if length <= 0 or offset < 0 or offset + length > pool_bytes:
        return None
    for start, size in extents.items():
        if start <= offset and offset + length <= start + size:
            return start
    return None
