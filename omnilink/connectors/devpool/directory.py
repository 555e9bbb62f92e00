"""The pool directory: one small shared-memory segment per channel, created by the receiver.

Byte layout (little-endian, every field 8-byte aligned)::

    0    magic "OLCIPC05"
    8    receiver pid                      receiver writes once
    16   state (1 open, 2 closed)          receiver
    24   pool device index (receiver's numbering)
    32   pool bytes
    40   event slots                       (nslots)
    48   ring capacity                     (max blocks in flight)
    56   sender generation                 sender (each attaching sender: previous + 1)
    64   sender pid                        sender
    72   want_gen                          sender: "tell me what you hold" (attach)
    80   ack_gen                           receiver: the held list below is for want_gen
    88   snap_head                         receiver: ring head when the held list was taken
    96   held count                        receiver
    104  clean_gen                         sender: its close() waited for every copy
    112  ring head                         receiver (frees pushed)
    120  ring tail                         sender (frees drained)
    128  pool IPC memory handle (64 bytes) receiver
    192  events_gen                        sender: the event handles are those of this gen
    200  pool device UUID (16 bytes)       receiver (the sender maps it to its numbering)
    216  segment generation                receiver: + 1 each time the segment table changes
    224  grow request                      sender: + 1 per request for a new segment
    232  grow bytes                        sender: the size it asks for
    240  grow answered                     receiver: the request answered (= grow request)
    248  grow error                        receiver: 0 granted, else GROW_* (why refused)
    256  pool bound                        receiver: pool_max_bytes, the most all segments hold
    264  pool bytes now                    receiver: bytes of the live segments
    272  held bytes                        receiver: bytes of the blocks it holds (views alive)
    280  lane published                    sender: records written to the lane
    288  lane read                         receiver: records read from the lane
    296  lane slots                        receiver writes once (0: no lane)
    304  lane record bytes                 receiver writes once
    312  lands on device                   receiver: 1 while its gets land payloads on its
                                       device (the sender may then carry small host
                                       tensors in the pool block), else 0
    320  segments: MAX_SEGMENTS x [state u64 | bytes u64 | IPC handle 64 | released u64]
         state, bytes, handle: receiver (0 none, 1 live, 2 retiring); released: sender
    ...  slots: nslots x [event IPC handle 64 | rec_seq u64 | done_seq u64 | rec_size u64]
         (rec_size: the tensor_blob size of a payload recorded in the slot, in its low
         SIZE_BITS bits, the low bits of that payload's sequence above them; stored
         after its rec_seq)
    ...  released ring: capacity x [offset u64 | length u64]
    ...  held list:     capacity x [offset u64 | length u64]
    ...  lane: lane slots x lane record bytes (``lane``: the pool's messages), then its
         claim table (``lane.TABLE`` x u64)

Segment 0 is the pool the receiver opens with (also at ``pool bytes`` and ``pool IPC
memory handle`` above); the others are allocated by the receiver when its sender asks
(see the package docstring, "Growth"). A block's address is ``segment << SEG_SHIFT |
offset``: one int in the manifest, the released ring and the held list.

One writer per field (noted above), so no field needs a lock across processes: x86-64
stores are seen in program order, and each entry of the ring is written before the head
that publishes it. The segment is named like an arena of the receiver
(``<prefix>-a<pid>-<token>``, token derived from the channel name), so the shm backend's
garbage collector (``omnilink gc``, every connector's start-up) removes it once the
receiver's pid is dead, and a sender finds it by listing ``/dev/shm``.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from typing import Any

from omnilink._errors import ConfigurationError
from omnilink.connectors.shmem import SHM_DIR, arena_name, create_segment, open_segment, pid_alive, read_prefix

__all__ = ["Directory", "directory_token", "find_directories", "live_pool_owner"]

MAGIC = b"OLCIPC05"
HANDLE_BYTES = 64
_U64 = struct.Struct("<Q")
_PAIR = struct.Struct("<QQ")
#: Most segments one pool has (segment 0 included).
MAX_SEGMENTS = 16
#: A block's address: ``segment << SEG_SHIFT | offset`` (a segment holds < 2**48 bytes).
SEG_SHIFT = 48
SEG_MASK = (1 << SEG_SHIFT) - 1
_SEGS = 320
_SEG = 16 + HANDLE_BYTES + 8
_HEADER = _SEGS + MAX_SEGMENTS * _SEG
_SLOT = HANDLE_BYTES + 24

SEG_NONE = 0
SEG_LIVE = 1
SEG_RETIRING = 2
#: ``released`` of a segment the closed sender had no block of
RELEASED_ALL = (1 << 63) - 1

#: Why the receiver refused a segment (the grow error field).
GROW_OK = 0
GROW_PAST_BOUND = 1
GROW_ALLOC_FAILED = 2
GROW_NO_ENTRY = 3

STATE_OPEN = 1
STATE_CLOSED = 2
#: A slot's ``rec_seq`` with this bit: the copy of that sequence failed after its message
#: was published (the sender gave the pool up; its reader raises).
COPY_FAILED = 1 << 63
#: A slot's ``rec_size``: the size in its low ``SIZE_BITS`` bits, the low bits of the
#: sequence it belongs to above them (the sender stores it after ``rec_seq``).
SIZE_BITS = 44
_SIZE_MASK = (1 << SIZE_BITS) - 1
_SIZE_TAG = (1 << (64 - SIZE_BITS)) - 1

# field offsets
RECV_PID, STATE, DEVICE, POOL_BYTES, NSLOTS, RING_CAP = 8, 16, 24, 32, 40, 48
GEN, SENDER_PID, WANT_GEN, ACK_GEN, SNAP_HEAD, HELD_COUNT, CLEAN_GEN = 56, 64, 72, 80, 88, 96, 104
RING_HEAD, RING_TAIL, MEM_HANDLE, EVENTS_GEN, UUID = 112, 120, 128, 192, 200
SEG_GEN, GROW_REQ, GROW_BYTES, GROW_ACK, GROW_ERR, POOL_MAX, POOL_NOW = 216, 224, 232, 240, 248, 256, 264
HELD_BYTES = 272
LANE_PUB, LANE_READ, LANE_SLOTS, LANE_REC = 280, 288, 296, 304
LANDS = 312
#: Bounds of a lane a directory may declare (checked when it is opened).
MAX_LANE_SLOTS = 4096
MAX_LANE_RECORD = 1 << 16

#: Bounds checked when a directory is opened (a hostile or corrupt segment cannot make a
#: sender map or index past its end).
MAX_SLOTS = 4096
MAX_RING = 1 << 20


def directory_token(channel: str) -> str:
    """The 16 hex digits that name ``channel``'s directory (from its SHA-256)."""
    return hashlib.sha256(("cuda_ipc:" + channel).encode("utf-8")).hexdigest()[:16]


def find_directories(prefix: str, channel: str) -> list[tuple[int, str]]:
    """``[(receiver pid, posix name)]`` of the directories of ``channel`` in ``/dev/shm``."""
    token = directory_token(channel)
    pattern = re.compile(re.escape(prefix) + r"-a([0-9]+)-" + token + "$")
    out = []
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    for entry in entries:
        m = pattern.fullmatch(entry)
        if m is not None:
            out.append((int(m.group(1)), "/" + entry))
    return out


def _size(nslots: int, ring_cap: int, lane_slots: int = 0, lane_record: int = 0) -> int:
    from omnilink.connectors.devpool.lane import TABLE

    n = _HEADER + nslots * _SLOT + 2 * ring_cap * _PAIR.size + lane_slots * lane_record + TABLE * 8
    return (n + 4095) // 4096 * 4096


class Directory:
    """A mapped pool directory (see the module docstring for the layout)."""

    __slots__ = ("mm", "name", "nslots", "ring_cap", "_slots", "_ring", "_held", "_q", "lane_offset",
                 "lane_slots", "lane_record")

    def __init__(self, mm: Any, name: str) -> None:
        self.mm = mm
        self.name = name
        if len(mm) < _HEADER or bytes(mm[0:8]) != MAGIC:
            raise ConfigurationError(f"cuda_ipc: {name} is not a pool directory")
        #: the segment as native u64 words: each field read and written by one 8-byte
        #: access. ``struct.pack_into`` zero-fills its target before it writes the value,
        #: so a process reading the field meanwhile could see 0 (a ring head of 0: the
        #: sender's "corrupt released ring", about one run in six of a long stream).
        self._q = memoryview(mm).cast("B")[: len(mm) & ~7].cast("Q")
        self.nslots = self.get(NSLOTS)
        self.ring_cap = self.get(RING_CAP)
        self.lane_slots = self.get(LANE_SLOTS)
        self.lane_record = self.get(LANE_REC)
        if not (1 <= self.nslots <= MAX_SLOTS and 1 <= self.ring_cap <= MAX_RING) or not (
            0 <= self.lane_slots <= MAX_LANE_SLOTS and (not self.lane_slots or 64 <= self.lane_record <= MAX_LANE_RECORD)
            and self.lane_record % 8 == 0
        ) or len(mm) < _size(self.nslots, self.ring_cap, self.lane_slots, self.lane_record):
            raise ConfigurationError(f"cuda_ipc: pool directory {name} has an invalid layout")
        self._slots = _HEADER
        self._ring = _HEADER + self.nslots * _SLOT
        self._held = self._ring + self.ring_cap * _PAIR.size
        self.lane_offset = self._held + self.ring_cap * _PAIR.size

    @classmethod
    def create(
        cls, prefix: str, channel: str, *, device: int, uuid: bytes, pool_bytes: int,
        nslots: int, ring_cap: int, mem_handle: bytes, pool_max: int, lane_slots: int = 0,
        lane_record: int = 0,
    ) -> Directory:
        name = arena_name(prefix, os.getpid(), directory_token(channel))
        mm = create_segment(name, _size(nslots, ring_cap, lane_slots, lane_record), "the cuda_ipc pool directory")
        for off, value in ((RECV_PID, os.getpid()), (DEVICE, device), (POOL_BYTES, pool_bytes),
                           (NSLOTS, nslots), (RING_CAP, ring_cap), (POOL_MAX, pool_max),
                           (POOL_NOW, pool_bytes), (LANE_SLOTS, lane_slots), (LANE_REC, lane_record)):
            _U64.pack_into(mm, off, value)
        mm[MEM_HANDLE:MEM_HANDLE + HANDLE_BYTES] = mem_handle.ljust(HANDLE_BYTES, b"\0")[:HANDLE_BYTES]
        o = _SEGS
        _PAIR.pack_into(mm, o, SEG_LIVE, pool_bytes)
        mm[o + 16:o + 16 + HANDLE_BYTES] = mem_handle.ljust(HANDLE_BYTES, b"\0")[:HANDLE_BYTES]
        mm[UUID:UUID + 16] = uuid.ljust(16, b"\0")[:16]
        _U64.pack_into(mm, STATE, STATE_OPEN)
        mm[0:8] = MAGIC  # last: a directory is valid once its magic is there
        return cls(mm, name)

    @classmethod
    def open(cls, name: str) -> Directory:
        return cls(open_segment(name), name)

    # ------------------------------------------------------------------ fields
    def get(self, off: int) -> int:
        return self._q[off >> 3]

    def set(self, off: int, value: int) -> None:
        # One native 8-byte store (never struct.pack_into: see ``_q``).
        self._q[off >> 3] = value

    def mem_handle(self) -> bytes:
        return bytes(self.mm[MEM_HANDLE:MEM_HANDLE + HANDLE_BYTES])

    def uuid(self) -> bytes:
        return bytes(self.mm[UUID:UUID + 16])

    # ---------------------------------------------------------------- segments
    def segment(self, i: int) -> tuple[int, int]:
        """``(state, bytes)`` of segment ``i``."""
        o = (_SEGS + i * _SEG) >> 3
        return self._q[o], self._q[o + 1]

    def segment_handle(self, i: int) -> bytes:
        o = _SEGS + i * _SEG + 16
        return bytes(self.mm[o:o + HANDLE_BYTES])

    def set_segment(self, i: int, state: int, nbytes: int = 0, handle: bytes | None = None) -> None:
        """Receiver: write entry ``i``, its state last (what publishes it)."""
        o = _SEGS + i * _SEG
        if handle is not None:
            self.mm[o + 16:o + 16 + HANDLE_BYTES] = handle.ljust(HANDLE_BYTES, b"\0")[:HANDLE_BYTES]
        self._q[(o >> 3) + 1] = nbytes
        self._q[o >> 3] = state

    def released(self, i: int) -> int:
        return self._q[(_SEGS + i * _SEG + 16 + HANDLE_BYTES) >> 3]

    def set_released(self, i: int, value: int) -> None:
        """Sender: it holds no block of (and no mapping to) retiring segment ``i`` as of
        segment generation ``value`` (``RELEASED_ALL``: a sender that closed with no
        block there; 0: mapped again)."""
        self._q[(_SEGS + i * _SEG + 16 + HANDLE_BYTES) >> 3] = value

    # ------------------------------------------------------------------- slots
    def slot_handle(self, i: int) -> bytes:
        o = self._slots + i * _SLOT
        return bytes(self.mm[o:o + HANDLE_BYTES])

    def set_slot_handle(self, i: int, handle: bytes) -> None:
        o = self._slots + i * _SLOT
        self.mm[o:o + HANDLE_BYTES] = handle.ljust(HANDLE_BYTES, b"\0")[:HANDLE_BYTES]

    def rec_seq(self, i: int) -> int:
        return self._q[(self._slots + i * _SLOT + HANDLE_BYTES) >> 3]

    def set_rec_seq(self, i: int, seq: int) -> None:
        self._q[(self._slots + i * _SLOT + HANDLE_BYTES) >> 3] = seq

    def rec_size(self, i: int, seq: int) -> int:
        """The size stored for sequence ``seq`` in slot ``i``; -1 while none is (not yet,
        or the slot was recorded again since, or too large to store)."""
        w = self._q[(self._slots + i * _SLOT + HANDLE_BYTES + 16) >> 3]
        n = w & _SIZE_MASK
        return n if w >> SIZE_BITS == seq & _SIZE_TAG and n != _SIZE_MASK else -1

    def set_rec_size(self, i: int, seq: int, size: int) -> None:
        """Store ``size`` for sequence ``seq`` in slot ``i`` (a size past ``SIZE_BITS``
        bits, or a negative one, is stored as unknown)."""
        n = size if 0 <= size < _SIZE_MASK else _SIZE_MASK
        self._q[(self._slots + i * _SLOT + HANDLE_BYTES + 16) >> 3] = (seq & _SIZE_TAG) << SIZE_BITS | n

    def done_seq(self, i: int) -> int:
        return self._q[(self._slots + i * _SLOT + HANDLE_BYTES + 8) >> 3]

    def set_done_seq(self, i: int, seq: int) -> None:
        self._q[(self._slots + i * _SLOT + HANDLE_BYTES + 8) >> 3] = seq

    # -------------------------------------------------------------------- ring
    def push_free(self, offset: int, length: int) -> bool:
        """Receiver: publish a freed block; ``False`` when the ring is full (cannot happen
        while the sender keeps at most ``ring_cap`` blocks out)."""
        head, tail = self.get(RING_HEAD), self.get(RING_TAIL)
        if head - tail >= self.ring_cap:
            return False
        _PAIR.pack_into(self.mm, self._ring + (head % self.ring_cap) * _PAIR.size, offset, length)
        self.set(RING_HEAD, head + 1)  # after the entry: publishes it
        return True

    def drain_frees(self) -> list[tuple[int, int]]:
        """Sender: every freed block published since the last drain."""
        head, tail = self.get(RING_HEAD), self.get(RING_TAIL)
        if head == tail:
            return []
        if head - tail > self.ring_cap or head < tail:
            raise ConfigurationError(
                f"cuda_ipc: pool directory {self.name}: corrupt released ring (head {head}, tail {tail}, "
                f"capacity {self.ring_cap})"
            )
        out = [_PAIR.unpack_from(self.mm, self._ring + (i % self.ring_cap) * _PAIR.size)
               for i in range(tail, head)]
        self.set(RING_TAIL, head)
        return out

    # -------------------------------------------------------------------- held
    def write_held(self, blocks: list[tuple[int, int]]) -> None:
        n = min(len(blocks), self.ring_cap)
        for i, (off, length) in enumerate(blocks[:n]):
            _PAIR.pack_into(self.mm, self._held + i * _PAIR.size, off, length)
        self.set(HELD_COUNT, n)

    def read_held(self) -> list[tuple[int, int]]:
        n = self.get(HELD_COUNT)
        if n > self.ring_cap:
            raise ConfigurationError(f"cuda_ipc: pool directory {self.name}: corrupt held list")
        return [_PAIR.unpack_from(self.mm, self._held + i * _PAIR.size) for i in range(n)]

    def close(self) -> None:
        self._q.release()
        try:
            self.mm.close()
        except (BufferError, ValueError):  # pragma: no cover - a view still exported
            pass


def live_pool_owner(channel: str, among: Any = None) -> int | None:
    """The pid of the live receiver whose open device pool serves ``channel``, or ``None``.

    A cheap look at ``/dev/shm`` (no CUDA call): what a transport that may send by device
    IPC checks before it opens a sender. ``among``: the pids that may own it (the
    channel's receivers, as the transport knows them): then one ``stat`` per pid instead
    of a listing of ``/dev/shm``, cheap enough to look before every payload.
    """
    prefix = read_prefix()
    if among is None:
        found = find_directories(prefix, channel)
    else:
        token = directory_token(channel)
        found = []
        for pid in among:
            name = arena_name(prefix, pid, token)
            if os.path.exists(SHM_DIR + name):
                found.append((pid, name))
    for pid, name in found:
        if not pid_alive(pid):
            continue
        try:
            d = Directory.open(name)
        except Exception:  # gone meanwhile, or not complete yet
            continue
        try:
            if d.get(STATE) == STATE_OPEN:
                return pid
        finally:
            d.close()
    return None
