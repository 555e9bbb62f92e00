"""The lane: the pool's messages in a ring of the pool directory, sender to receiver.

A device pool has one sender and one receiver, so its messages need none of a shared
channel's machinery (descriptor claims under a mutex, an arena block per message, a
tensor_blob frame to prepare and decode). The lane is a single-producer,
single-consumer ring of fixed-size records at the end of the pool directory:

- the sender encodes ``[key, message]`` with msgspec (plain values only: ``dict`` with
  ``str`` keys, ``list``, ``str``, ``int``, ``float``, ``bool``, ``None``, and small CPU
  tensors as a msgpack extension), writes it into record ``pub % slots``, then stores
  ``pub + 1`` (one aligned 8-byte store: x86-64 keeps stores in order, so the record
  is complete once the counter says so);
- the receiver, under its transport's lock, reads every record up to ``pub`` into its
  index of arrived keys and stores ``read``; the sender never writes a record the
  receiver has not read (``pub - read < slots``).

A message that is not plain (a tuple, bytes, a numpy array, an object), larger than a
record, or sent while the ring is full goes the transport's general way instead
(``write`` returns ``False``): the lane only shortens the common case. The transport
wakes its receiver itself (the lane has no semaphore of its own: a receiver waits in one
place).

Claims: a message read into the receiver's index is not yet consumed; the sender may
still withdraw it (``discard``) or ask whether it is unread (a second put of its key,
``pending_keys``). Each record has an entry in the lane's claim table (``seq %
TABLE``, ``seq << 2 | state``: written, claimed, withdrawn) that the receiver's claim
and the sender's withdrawal change only under the transport's channel mutex, so one of
them wins. The sender does not write a record whose table entry still holds an
unclaimed older record (the general way takes it, and every message after it until that
one is claimed or withdrawn): the table never forgets an unread message.

The receiver trusts nothing it reads: the counters are bounded against the ring, a
record's length against the record size, the msgpack by msgspec, a tensor's dtype code,
shape and byte count against each other before anything is made of them. A bad record
is skipped and logged (its key, if it had one, never arrives: the same as a payload
the sender never published).
"""

from __future__ import annotations

import ctypes
import logging
import struct
import time
from typing import Any

import msgspec

from omnilink._treecode import PLAIN_LEAVES
from omnilink._util import plain_tensor
from omnilink.connectors.devpool.manifest import ITEMSIZE, dtypes

__all__ = ["LANE_RECORD", "LANE_SLOTS", "LaneReader", "LaneWriter", "decode_record", "encode_record"]

logger = logging.getLogger(__name__)

#: Records in a pool's lane, and bytes per record (a 4-byte length, then the msgpack).
LANE_SLOTS = 64
LANE_RECORD = 4096
#: Entries of the claim table (u64 each, after the records).
TABLE = 1024
WRITTEN, CLAIMED, WITHDRAWN = 1, 2, 3
#: The msgpack extension code of a CPU tensor: ``[dtype code u8, ndim u8, shape i64 x
#: ndim, data]``.
EXT_TENSOR = 1
#: Most nesting a plain message may have, and most dimensions of an inline tensor.
MAX_DEPTH = 32
MAX_NDIM = 16
_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<BB")


class NotPlain(Exception):
    """A message the lane cannot carry (the transport's general way takes it)."""


class BadRecord(ValueError):
    """A lane record that does not decode into what a sender writes."""


#: leaves msgspec encodes as they are and decodes to the same type (an int past 64 bits
#: makes the encoder raise OverflowError: not plain either)
_LEAVES = PLAIN_LEAVES


def _plain(x: Any, depth: int, torch: Any, by_dtype: dict[Any, int]) -> Any:
    t = type(x)
    if t in _LEAVES:
        return x
    if depth >= MAX_DEPTH:
        raise NotPlain
    if t is dict:
        out = {}
        for k, v in x.items():
            if type(k) is not str:
                raise NotPlain
            out[k] = v if type(v) in _LEAVES else _plain(v, depth + 1, torch, by_dtype)
        return out
    if t is list:
        return [v if type(v) in _LEAVES else _plain(v, depth + 1, torch, by_dtype) for v in x]
    if t is torch.Tensor:
        return _tensor_ext(x, torch, by_dtype)
    raise NotPlain


def _tensor_ext(x: Any, torch: Any, by_dtype: dict[Any, int]) -> msgspec.msgpack.Ext:
    if x.device.type != "cpu" or x.layout is not torch.strided:
        raise NotPlain
    code = by_dtype.get(x.dtype)
    if code is None or x.dim() > MAX_NDIM:
        raise NotPlain
    x = plain_tensor(x)
    nbytes = x.numel() * x.element_size()
    if nbytes > LANE_RECORD:
        raise NotPlain
    shape = x.shape
    head = _HEAD.pack(code, len(shape)) + struct.pack(f"<{len(shape)}q", *shape)
    return msgspec.msgpack.Ext(EXT_TENSOR, head + (ctypes.string_at(x.data_ptr(), nbytes) if nbytes else b""))


_ENCODER = msgspec.msgpack.Encoder()


def encode_record(key: str, message: Any) -> bytes:
    """The msgpack of ``[key, message]`` for a lane record; ``NotPlain`` when the message
    holds anything but plain values and small CPU tensors.

    A pool message (``{"d": manifest, "h": host part, "n": size}``, or one wrapped in a
    one-key dict, as the shm route marks it) has only its host part walked: the
    manifest and the size are the sender's own ints, strs and lists (a path's dict key
    msgpack cannot carry still makes it not plain)."""
    import torch

    by_dtype = dtypes()[0]
    m = message
    if type(m) is dict and len(m) == 1:
        (outer, m), = m.items()
    else:
        outer = None
    try:
        if type(m) is dict and len(m) == 3 and "h" in m and "d" in m and "n" in m and type(m["n"]) is int:
            body = {"d": m["d"], "h": _plain(m["h"], 1, torch, by_dtype), "n": m["n"]}
            if outer is not None:
                if type(outer) is not str:
                    raise NotPlain
                body = {outer: body}
        else:
            body = _plain(message, 0, torch, by_dtype)
        return _ENCODER.encode([key, body])
    except (OverflowError, TypeError, msgspec.EncodeError):  # an int past 64 bits, an odd key
        raise NotPlain from None


def encode_host(host: Any) -> bytes:
    """The msgpack of a pool message's host part as ``encode_record`` writes it (small
    CPU tensors as extensions: a send plan whose payloads keep host tensors there);
    ``NotPlain`` as there."""
    import torch

    try:
        return _ENCODER.encode(_plain(host, 1, torch, dtypes()[0]))
    except (OverflowError, TypeError, msgspec.EncodeError):
        raise NotPlain from None


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != EXT_TENSOR or len(data) < _HEAD.size:
        raise BadRecord(f"unknown msgpack extension {code} in a lane record")
    dcode, ndim = _HEAD.unpack_from(data)
    by_code = dtypes()[1]
    dtype = by_code.get(dcode)
    if dtype is None or ndim > MAX_NDIM or len(data) < _HEAD.size + 8 * ndim:
        raise BadRecord("a lane record's tensor has an invalid dtype or shape")
    shape = struct.unpack_from(f"<{ndim}q", data, _HEAD.size)
    numel = 1
    for s in shape:
        if s < 0:
            raise BadRecord("a lane record's tensor has a negative dimension")
        numel *= s
    start = _HEAD.size + 8 * ndim
    if numel * ITEMSIZE[dcode] != len(data) - start:
        raise BadRecord("a lane record's tensor bytes do not match its shape")
    import torch

    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    # A copy of its own (malloc-aligned, writable), not a view of the record.
    return torch.frombuffer(bytearray(data[start:]), dtype=dtype).reshape(shape)


_DECODER = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def decode_record(body: Any) -> tuple[str, Any]:
    """``(key, message)`` of a lane record's msgpack; ``BadRecord`` if it is not what a
    sender writes."""
    try:
        rec = _DECODER.decode(body)
    except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise BadRecord(f"undecodable lane record: {exc}") from None
    if type(rec) is not list or len(rec) != 2 or type(rec[0]) is not str or not rec[0]:
        raise BadRecord("a lane record is not [key, message]")
    return rec[0], rec[1]


class _LaneEnd:
    """What both ends of a lane read from the pool directory: its words, the ring, the
    two counters' and the claim table's places."""

    __slots__ = ("_q", "_mm", "_base", "_slots", "_rec", "_pub_i", "_read_i", "_table")

    def __init__(self, directory: Any) -> None:
        from omnilink.connectors.devpool.directory import LANE_PUB, LANE_READ

        self._q = directory._q
        self._mm = directory.mm
        self._base = directory.lane_offset
        self._slots = directory.lane_slots
        self._rec = directory.lane_record
        self._pub_i = LANE_PUB >> 3
        self._read_i = LANE_READ >> 3
        #: index in ``_q`` of the claim table's first entry
        self._table = (self._base + self._slots * self._rec) >> 3


class LaneWriter(_LaneEnd):
    """The sender's end of a pool's lane (see the module docstring)."""

    __slots__ = ("sent", "when")

    def __init__(self, directory: Any) -> None:
        super().__init__(directory)
        #: key -> lane sequence number of the records this sender wrote, in writing
        #: order (pruned of claimed ones when it outgrows the table), and when each was
        self.sent: dict[str, int] = {}
        self.when: dict[str, float] = {}

    def _entry(self, seq: int) -> int:
        return self._q[self._table + seq % TABLE]

    def pending(self, key: str) -> bool:
        """Whether the record of ``key`` this sender wrote last is still unclaimed."""
        seq = self.sent.get(key)
        return seq is not None and self._entry(seq) == (seq << 2 | WRITTEN)

    def pending_keys(self) -> list[str]:
        """Keys of records not yet claimed (their withdrawals included: gone)."""
        q, t = self._q, self._table
        return [k for k, seq in self.sent.items() if q[t + seq % TABLE] == (seq << 2 | WRITTEN)]

    def withdraw(self, key: str) -> bool:
        """Withdraw the unclaimed record of ``key`` (the caller holds the transport's
        channel mutex, as the receiver's claim does); whether it was unclaimed."""
        seq = self.sent.get(key)
        if seq is None:
            return False
        i = self._table + seq % TABLE
        if self._q[i] != (seq << 2 | WRITTEN):
            return False
        self._q[i] = seq << 2 | WITHDRAWN
        del self.sent[key]
        self.when.pop(key, None)
        return True

    def unread_older_than(self, older_than: float, now: float) -> list[tuple[str, float]]:
        """``(key, age)`` of the unclaimed records written more than ``older_than``
        seconds before ``now``, oldest first."""
        q, t, when = self._q, self._table, self.when
        out = []
        for k, seq in self.sent.items():  # writing order: oldest first
            age = now - when.get(k, now)
            if age >= older_than and q[t + seq % TABLE] == (seq << 2 | WRITTEN):
                out.append((k, age))
        return out

    def write(self, key: str, message: Any) -> bool:
        """Put ``[key, message]`` in the lane; ``False`` (nothing written) when it is not
        plain, larger than a record, or the ring is full."""
        if not self.has_room():
            return False
        try:
            body = encode_record(key, message)
        except NotPlain:
            return False
        return self.write_body(key, body)

    def has_room(self) -> bool:
        """Whether the next record may be written now (the ring has room and its claim
        table entry holds no unclaimed older record)."""
        if not self._slots:
            return False
        q = self._q
        pub = q[self._pub_i]
        if pub - q[self._read_i] >= self._slots:
            return False
        old = q[self._table + pub % TABLE]
        # an older record there still unclaimed: never forget it
        return not (old & 3 == WRITTEN and old >> 2 < pub)

    def write_body(self, key: str, body: bytes) -> bool:
        """Write ``body``, the msgpack of ``[key, message]`` (``encode_record``'s, or the
        same built by a caller that knows its message is plain), as the next record, once
        ``has_room`` said yes; ``False`` (nothing written) when it is larger than a
        record."""
        q = self._q
        pub = q[self._pub_i]
        e = self._table + pub % TABLE
        n = len(body)
        if n + 4 > self._rec:
            return False
        o = self._base + (pub % self._slots) * self._rec
        mm = self._mm
        _U32.pack_into(mm, o, n)
        mm[o + 4 : o + 4 + n] = body
        q[e] = pub << 2 | WRITTEN
        q[self._pub_i] = pub + 1  # after the record and its entry: publishes them
        sent = self.sent
        sent.pop(key, None)  # re-inserted: the dict stays in writing order
        sent[key] = pub
        self.when[key] = time.monotonic()
        if len(sent) > TABLE:
            for k in [k for k, s in sent.items() if q[self._table + s % TABLE] != (s << 2 | WRITTEN)]:
                del sent[k]
                self.when.pop(k, None)
        return True


class LaneReader(_LaneEnd):
    """The receiver's end of a pool's lane (see the module docstring)."""

    __slots__ = ("bad",)

    def __init__(self, directory: Any) -> None:
        super().__init__(directory)
        #: records skipped as bad since the lane opened
        self.bad = 0

    def unread(self) -> bool:
        """Whether the sender published records not read yet (no lock, one look; ``True``
        once the directory is unmapped, so a caller racing a close takes its slow path,
        which sees the close)."""
        q = self._q
        try:
            return q[self._pub_i] != q[self._read_i]
        except ValueError:  # released with the directory
            return True

    def claimable(self, seq: int) -> bool:
        """Whether the record ``seq`` is still there to claim (not withdrawn)."""
        return self._q[self._table + seq % TABLE] == (seq << 2 | WRITTEN)

    def claim(self, seq: int) -> bool:
        """Claim the record ``seq`` (the caller holds the transport's channel mutex, as
        the sender's withdrawal does); ``False``: the sender withdrew it."""
        i = self._table + seq % TABLE
        if self._q[i] != (seq << 2 | WRITTEN):
            return False
        self._q[i] = seq << 2 | CLAIMED
        return True

    def poll(self, into: dict[str, Any]) -> int:
        """Read every published record into ``into`` (``key -> (message, record bytes,
        seq)``); the number read. The caller serializes calls (its lock)."""
        q = self._q
        pub, read = q[self._pub_i], q[self._read_i]
        if pub == read:
            return 0
        slots = self._slots
        if pub < read or pub - read > slots:
            # A counter no sender writes: skip to it, reading nothing (never loop on it).
            logger.warning("devpool lane: corrupt counters (published %d, read %d, %d slots); skipped", pub,
                           read, slots)
            self.bad += 1
            q[self._read_i] = pub
            return 0
        mm, base, rec = self._mm, self._base, self._rec
        n_read = 0
        for s in range(read, pub):
            o = base + (s % slots) * rec
            n = _U32.unpack_from(mm, o)[0]
            try:
                if n + 4 > rec:
                    raise BadRecord(f"length {n} past the record's {rec - 4} bytes")
                # Decoded in place: what the message keeps is copied out by msgspec
                # (strings) and by the tensor hook (a bytearray of its own), once.
                view = memoryview(mm)[o + 4 : o + 4 + n]
                try:
                    key, message = decode_record(view)
                finally:
                    try:
                        view.release()
                    except BufferError:  # pragma: no cover - a sub-view still alive
                        pass
            except BadRecord as exc:
                self.bad += 1
                logger.warning("devpool lane: record %d skipped: %s", s, exc)
                continue
            if key in into:
                self.bad += 1
                logger.warning("devpool lane: key %r published twice while unread; the second kept", key)
            into[key] = (message, n, s)
            n_read += 1
        q[self._read_i] = pub
        return n_read
