"""Frames of the zmq backend's protocol: the routing frame of a data message and the ack.

A data message is one ZMQ multipart message, delivered whole or not at all (ZMQ
multipart messages are atomic: a peer that dies mid-message leaves nothing behind)::

    DEALER (sender) sends            ROUTER (receiver) receives
    --------------------             ----------------------------------------------
                                     frame 0   peer identity (added by the ROUTER)
    frame 0   routing frame          frame 1   routing frame (layout below)
    frame 1   blob meta              frame 2   tensor_blob prefix + header
    frame 2+i tensor region i        frame 3+i raw bytes of tensor i (sent copy=False)

or, with flag BY_REFERENCE (ipc only: the receiver copies the regions straight out of
the sender's memory with ``process_vm_readv``, one copy instead of two; see
``io``)::

    frame 0   routing frame          frame 1   routing frame
    frame 1   blob meta              frame 2   tensor_blob prefix + header
    frame 2   reference frame        frame 3   reference frame (layout below)

Routing frame (little-endian)::

    offset  size  field
    0       4     magic b"OLZ1"
    4       1     kind: 1 = DATA
    5       1     flags: 0, or 1 = BY_REFERENCE (anything else is refused)
    6       2     key_len (u16)
    8       16    sender id: random per sending connector, stable across reconnects
    24      8     seq (u64): per-sender message number, for de-duplicating resends
    32      4     n_regions (u32): number of tensor frames that follow the meta frame
    36      4     reserved, 0
    40      K     key, UTF-8, exactly key_len bytes (no padding, no NUL)

Reference frame (little-endian), one entry per tensor region::

    offset     size  field
    0          4     magic b"OLZR"
    4          4     pid (u32) of the sending process
    8          8     token address (u64) in the sender: 16 bytes equal to the nonce
                     while the sender still waits for this message's ack
    16         16    nonce: random per message
    32         4     n_regions (u32), equal to the routing frame's
    36         4     reserved, 0
    40 + 16*i  8     address (u64) of region i in the sender
    48 + 16*i  8     length (u64) of region i

Ack frame, ROUTER -> DEALER, one per data message (resends are acked again)::

    offset  size  field
    0       4     magic b"OLZA"
    4       1     status: 0 OK, 1 DUPLICATE_KEY, 2 DECODE_ERROR,
                  3 RESEND_AS_FRAMES (the receiver cannot read this sender's memory:
                    send the message again, same seq, as frames)
    5       1     reserved, 0
    6       2     text_len (u16)
    8       8     seq (u64) of the acknowledged message
    16      T     UTF-8 text explaining a non-OK status
"""

from __future__ import annotations

import struct

from omnilink._errors import BlobDecodeError, ConfigurationError
from omnilink._util import validate_key

__all__ = [
    "ACK_DECODE_ERROR",
    "ACK_DUPLICATE_KEY",
    "ACK_OK",
    "ACK_RESEND_AS_FRAMES",
    "FLAG_BY_REFERENCE",
    "Reference",
    "pack_reference",
    "unpack_reference",
    "KIND_DATA",
    "ROUTING_MAGIC",
    "ACK_MAGIC",
    "Routing",
    "pack_ack",
    "pack_routing",
    "unpack_ack",
    "unpack_routing",
]

ROUTING_MAGIC = b"OLZ1"
ACK_MAGIC = b"OLZA"
KIND_DATA = 1
ACK_OK = 0
ACK_DUPLICATE_KEY = 1
ACK_DECODE_ERROR = 2
ACK_RESEND_AS_FRAMES = 3
FLAG_BY_REFERENCE = 1
REFERENCE_MAGIC = b"OLZR"
NONCE_BYTES = 16
SENDER_ID_BYTES = 16

_ROUTING = struct.Struct("<4sBBH16sQII")
_ACK = struct.Struct("<4sBBHQ")
_REFERENCE = struct.Struct("<4sIQ16sII")
_REGION = struct.Struct("<QQ")
_MAX_TEXT = 0xFFFF


class Routing:
    """A parsed routing frame."""

    __slots__ = ("key", "sender", "seq", "n_regions", "flags")

    def __init__(self, key: str, sender: bytes, seq: int, n_regions: int, flags: int = 0) -> None:
        self.key = key
        self.sender = sender
        self.seq = seq
        self.n_regions = n_regions
        self.flags = flags


def pack_routing(key: str, sender: bytes, seq: int, n_regions: int, flags: int = 0) -> bytes:
    raw = key.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ConfigurationError(f"key of {len(raw)} bytes does not fit a routing frame")
    return _ROUTING.pack(ROUTING_MAGIC, KIND_DATA, flags, len(raw), sender, seq, n_regions, 0) + raw


def unpack_routing(buf: memoryview | bytes) -> Routing:
    """Parse and validate a routing frame.

    Raises
    ------
    BlobDecodeError
        Wrong size, magic, kind, flags, or a key that is not valid UTF-8 / not a valid key.
    """
    mv = memoryview(buf)
    if mv.nbytes < _ROUTING.size:
        raise BlobDecodeError(f"routing frame is {mv.nbytes} bytes, shorter than {_ROUTING.size}")
    magic, kind, flags, key_len, sender, seq, n_regions, reserved = _ROUTING.unpack_from(mv, 0)
    if magic != ROUTING_MAGIC:
        raise BlobDecodeError(f"routing frame has bad magic {bytes(magic)!r}, expected {ROUTING_MAGIC!r}")
    if kind != KIND_DATA or flags not in (0, FLAG_BY_REFERENCE) or reserved != 0:
        raise BlobDecodeError(f"routing frame has unknown kind/flags ({kind}, {flags}, {reserved})")
    if mv.nbytes != _ROUTING.size + key_len:
        raise BlobDecodeError(
            f"routing frame is {mv.nbytes} bytes, its key_len says {_ROUTING.size + key_len}"
        )
    try:
        key = validate_key(bytes(mv[_ROUTING.size :]).decode("utf-8"))
    except (UnicodeDecodeError, ConfigurationError) as exc:
        raise BlobDecodeError(f"routing frame carries an invalid key: {exc}") from exc
    return Routing(key, bytes(sender), seq, n_regions, flags)


class Reference:
    """A parsed reference frame: where the regions lie in the sender's memory."""

    __slots__ = ("pid", "token_addr", "nonce", "regions")

    def __init__(self, pid: int, token_addr: int, nonce: bytes, regions: list[tuple[int, int]]) -> None:
        self.pid = pid
        self.token_addr = token_addr
        self.nonce = nonce
        self.regions = regions


def pack_reference(pid: int, token_addr: int, nonce: bytes, regions: list[tuple[int, int]]) -> bytes:
    """Pack a reference frame; ``regions`` are ``(address, length)`` pairs."""
    out = bytearray(_REFERENCE.size + _REGION.size * len(regions))
    _REFERENCE.pack_into(out, 0, REFERENCE_MAGIC, pid, token_addr, nonce, len(regions), 0)
    for i, (addr, length) in enumerate(regions):
        _REGION.pack_into(out, _REFERENCE.size + _REGION.size * i, addr, length)
    return bytes(out)


def unpack_reference(buf: memoryview | bytes, n_regions: int) -> Reference:
    """Parse and validate a reference frame announced with ``n_regions`` regions.

    Raises
    ------
    BlobDecodeError
        Wrong size or magic, a region count that disagrees with the routing frame, a
        null token address.
    """
    mv = memoryview(buf)
    if mv.nbytes < _REFERENCE.size:
        raise BlobDecodeError(f"reference frame is {mv.nbytes} bytes, shorter than {_REFERENCE.size}")
    magic, pid, token_addr, nonce, n, reserved = _REFERENCE.unpack_from(mv, 0)
    if magic != REFERENCE_MAGIC or reserved != 0:
        raise BlobDecodeError(f"reference frame has bad magic {bytes(magic)!r} or reserved bits")
    if n != n_regions:
        raise BlobDecodeError(f"reference frame lists {n} regions but the routing frame announces {n_regions}")
    if mv.nbytes != _REFERENCE.size + _REGION.size * n:
        raise BlobDecodeError(f"reference frame is {mv.nbytes} bytes, {n} regions need {_REFERENCE.size + _REGION.size * n}")
    if not token_addr or not pid:
        raise BlobDecodeError("reference frame has a null pid or token address")
    regions = [_REGION.unpack_from(mv, _REFERENCE.size + _REGION.size * i) for i in range(n)]
    return Reference(pid, token_addr, bytes(nonce), regions)


def pack_ack(seq: int, status: int, text: str = "") -> bytes:
    raw = text.encode("utf-8", "replace")[:_MAX_TEXT]
    return _ACK.pack(ACK_MAGIC, status, 0, len(raw), seq) + raw


def unpack_ack(buf: memoryview | bytes) -> tuple[int, int, str]:
    """Return ``(seq, status, text)`` of an ack frame.

    Raises
    ------
    BlobDecodeError
        Not a well-formed ack frame.
    """
    mv = memoryview(buf)
    if mv.nbytes < _ACK.size:
        raise BlobDecodeError(f"ack frame is {mv.nbytes} bytes, shorter than {_ACK.size}")
    magic, status, _reserved, text_len, seq = _ACK.unpack_from(mv, 0)
    if magic != ACK_MAGIC or mv.nbytes != _ACK.size + text_len:
        raise BlobDecodeError("malformed ack frame")
    return seq, status, bytes(mv[_ACK.size :]).decode("utf-8", "replace")
