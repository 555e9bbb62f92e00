"""Shared-memory layouts of the ``shm`` backend: the channel control segment (with its
mutex and wake-up semaphores) and a sender's arena (descriptors, publication log,
released ring, data area).

Synchronisation
---------------
Python has no atomic compare-and-swap on shared memory, so every cross-process state
change (publish, claim, release, reclaim, join, leave) happens while holding the
channel's mutex, a named POSIX semaphore used as a binary lock. ``sem_wait``/``sem_post``
are full barriers, so a reader that takes the mutex after a writer released it sees all
of the writer's stores, block bytes included: publication order is made safe by the
semaphore, never by the CPU's memory model. The critical sections are a few struct
reads and writes; block bytes are encoded and decoded outside the mutex.

Waiting uses the condition-variable pattern on semaphores: a waiter registers itself
(``waiters += 1``, remembering ``wake_gen``) under the mutex, releases it and sleeps on
the wake semaphore; whoever publishes posts the wake semaphore once per registered
waiter and bumps ``wake_gen``, so every receiver waiting for any key wakes, rescans and
sleeps again if its key is not there. A waiter whose wait timed out withdraws its
registration unless a broadcast already counted it (then one token is left over and
costs one spurious rescan later, never a lost wake-up). A sender waiting for space uses
the same idea with a flag in its arena header and its own semaphore.

A mutex holder that dies would wedge the channel, so the holder writes its pid into the
control segment; a waiter that cannot get the mutex for a while and finds that pid dead
takes the lock over (under the host lock, so only one waiter does).

Control segment ``<prefix>-c<hash>`` (4096 bytes, little-endian)::

    offset size field
    0      8    magic b"OLCTRL01"
    8      4    layout version (1)
    12     4    pid of the mutex holder (0 = free or unknown)
    16     4    waiters registered on the wake semaphore
    20     4    wake generation (bumped by every broadcast)
    24     8    participants generation (bumped when any participant joins, leaves or
                is reaped; receivers remap senders' arenas when it moves)
    32     4    senders found dead so far (receivers turn this into PeerLostError)
    36     4    length of the channel name
    40     4    1 if the last sender to leave died, 0 if it closed
    64     128  channel name (UTF-8), to detect hash collisions
    256    64 x 32  participants:
                 0  4  pid (0 = free entry)
                 4  1  role bits (1 = sends, 2 = receives)
                 5  3  reserved
                 8  16 token (hex) naming the sender's arena <prefix>-a<pid>-<token>
                 24 8  reserved

Arena ``<prefix>-a<pid>-<token>`` (one per sender and channel, pre-faulted)::

    0                 header (page 0)
                        0  8 magic b"OLARENA1"     32 8 data_bytes
                        8  4 layout version (1)    40 4 n_desc
                        12 4 owner pid             44 4 log_len
                        16 8 total size            48 8 pub_seq (last published)
                        24 8 data_offset           56 8 rel_head (receivers push)
                                                   64 8 rel_tail (sender pops)
                                                   72 4 sender_waiting
                                                   76 4 closed
                                                   80 8 ext_gen (bumped when the
                                                        extension table changes)
                        256 32 x 32 extension table, one entry per extension segment:
                              0 4 live (1) or free (0)   8 8 size
                              4 4 reserved              16 16 token (hex)
    4096              descriptors, n_desc x 576 bytes:
                        0  4 state               32 8 reserved bytes of the block
                        4  4 claimer pid         40 2 key length
                        8  8 seq                 42 2 flags (1 = overflow segment,
                        16 8 block offset              2 = extension segment)
                                                 48 16 token (hex) of that segment
                        24 8 frame length        64 512 key (UTF-8)
    log_offset        publication log: log_len x u32, entry seq % log_len = descriptor
    rel_offset        released ring:   n_desc x u32 descriptor indices
    data_offset       data area (page aligned): blocks, each 64-byte aligned, holding
                      one tensor_blob frame encoded in place

Descriptor state machine (every arrow taken under the channel mutex)::

               publish (sender)                 claim (one receiver wins)
      FREE -----------------------> WRITTEN -----------------------------> CLAIMED
       ^ ^                             |                                      |
       | |   discard by the sender     |              last view died,         |
       | +-----------------------------+              release(key), discard   |
       |                                                                      v
       +------------- reclaimed by the sender (drains the ring) ---------- RELEASED
       +------------- or CLAIMED by a pid that is dead (abandoned) ----------+

A receiver learns of new payloads by reading the publication log from its cursor up to
``pub_seq`` (falling back to a full descriptor scan if it fell more than ``log_len``
behind); a log entry is valid only while the descriptor's ``seq`` still equals it.
``pub_seq`` is also what makes a miss free: a receiver that has read the log up to
``pub_seq`` and does not have the key knows it is not there without taking the mutex
(``published``; an aligned 8-byte load, and a stale value only delays the news to its
next look).

Fields other processes write
----------------------------
Every process of the user can write both segments, so whatever this module reads from
them is checked against what the reader itself knows before it is used: a receiver
maps an arena only if its header describes exactly the layout ``arena_layout`` gives
for its descriptor count and fits its mapping (so ``n_desc`` and ``log_len`` bound
every later offset), takes a ``pub_seq`` that went backwards as a reason to rescan,
and pushes on the released ring only while ``tail <= head < tail + n_desc``. The sender
drains at most ``n_desc`` entries, each only if it names an outstanding descriptor of
its own that is RELEASED; a ring found inconsistent is rebuilt from the descriptors
themselves (every RELEASED one of ours is taken back, ``head = tail = 0``), so a forged
head costs one scan of ``n_desc`` descriptors, never a loop of ``head - tail`` passes
under the mutex. Counters are incremented modulo their width and the wake-ups posted
per broadcast are capped. Nothing another process writes can make a call loop longer
than its own bounds, or raise anything but an omnilink error; it can still make
payloads go missing, which a same-user process can do anyway.

Extension segments (the elastic arena)
--------------------------------------
Receivers may keep their payloads' views for a request's lifetime, so the blocks they
hold can fill the arena although nothing is waiting to be read. When the arena is full
and the payloads nobody has claimed yet would still fit in it (so a slow reader is
still met with backpressure), the sender adds an *extension segment*
``<prefix>-e<pid>-<token>``: data only, no header, created 0600 and pre-faulted like the
arena, up to ``max_bytes`` for the arena and its extensions together. A descriptor of a
block in one has flag 2 and the segment's token; a receiver maps the segment the first
time it claims such a block (under the mutex, so it still exists) and keeps the mapping
while the segment is listed live in the extension table. An extension that has been
empty for ``shrink_after`` seconds is given back: its table entry is cleared and
``ext_gen`` bumped under the mutex, and its name unlinked; receivers drop their mapping
when they next see ``ext_gen`` move. The names carry the owner's pid like the arena's,
so ``collect_garbage`` and the reaping of a dead sender remove them too.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import struct
import time
from threading import get_ident
from time import perf_counter_ns
from typing import Any, Callable

import posix_ipc

from omnilink._errors import CapacityError, ConfigurationError, TransportError
from omnilink._util import MAX_KEY_BYTES, Deadline
from omnilink.connectors.shmem import (
    ALIGN,
    MODE,
    PAGE,
    PROT,
    Allocator,
    HostLock,
    arena_name,
    channel_names,
    create_segment,
    extension_name,
    new_token,
    open_segment,
    overflow_name,
    pid_alive,
    shm_error,
    unlink_segment,
    unlink_semaphore,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ArenaReader",
    "ArenaWriter",
    "Channel",
    "Space",
    "FREE",
    "WRITTEN",
    "CLAIMED",
    "RELEASED",
    "ROLE_SEND",
    "ROLE_RECV",
]


FREE, WRITTEN, CLAIMED, RELEASED = 0, 1, 2, 3
ROLE_SEND, ROLE_RECV = 1, 2
FLAG_OVERFLOW = 1
FLAG_EXTENSION = 2

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_II = struct.Struct("<II")

# ---------------------------------------------------------------- control segment
CTRL_MAGIC = b"OLCTRL01"
CTRL_VERSION = 1
CTRL_SIZE = 4096
_C_OWNER, _C_WAITERS, _C_WAKE_GEN, _C_SENDERS_GEN, _C_LOST, _C_CHANLEN, _C_EXIT = 12, 16, 20, 24, 32, 36, 40
_C_CHANNEL, _C_PART = 64, 256
MAX_PARTICIPANTS = 64
_PART = struct.Struct("<IB3x16s8x")  # pid, role, token

# ----------------------------------------------------------------------- arena
ARENA_MAGIC = b"OLARENA1"
ARENA_VERSION = 2
_A_HDR = struct.Struct("<8sIIQQQII")  # magic, version, pid, total, data_off, data_bytes, n_desc, log_len
_A_PUB, _A_REL_HEAD, _A_REL_TAIL, _A_WAITING, _A_CLOSED, _A_EXT_GEN = 48, 56, 64, 72, 76, 80


def _word(mm: Any, off: int) -> memoryview:
    """The 8 bytes of ``mm`` at ``off`` (8-aligned) as one native u64: ``w[0]`` reads and
    ``w[0] = v`` writes the field with a single 8-byte access. Fields another process
    reads without the mutex are written this way, never with ``struct.pack_into``: it
    zero-fills its target before writing the value, so a concurrent reader could see 0.
    The view must be released before ``mm`` is closed."""
    return memoryview(mm)[off : off + 8].cast("Q")
_A_EXT_TABLE = 256
#: Most extension segments one arena may have at a time.
MAX_EXTENSIONS = 32
_EXT_ENTRY = struct.Struct("<I4xQ16s")  # live, size, token
DESC_SIZE = 576
MAX_KEY = 512
_DESC = struct.Struct("<IIQQQQHH4x16s")  # state, claimer, seq, off, len, reserved, klen, flags, token
_D_STATE_CLAIMER = _II
_DESC_OFFSET = PAGE
#: The same offsets in u32 / u64 words (``ArenaWriter.drain`` indexes word views).
_DESC_WORD, _DESC_WORDS = _DESC_OFFSET // 4, DESC_SIZE // 4
_Q_REL_HEAD, _Q_REL_TAIL = _A_REL_HEAD // 8, _A_REL_TAIL // 8

#: a mutex holder that shows pid 0 this long is assumed to have died in the few
#: instructions between taking the semaphore and writing its pid
_STUCK_UNKNOWN_S = 5.0
_LOCK_SLICE_S = 0.2
#: The channel mutex is held for microseconds; ``lock_within`` waits for it at least this
#: long even when the call's own timeout is shorter (a loaded host can deschedule a
#: holder for a while; a dead holder is detected and taken over regardless).
MUTEX_GRACE_S = 5.0
_MUTEX_SPIN_NS = 20_000
#: Most wake-ups one broadcast posts: one per waiting thread, and no host runs this many
#: receiver threads on one channel; a larger ``waiters`` count was written by someone
#: else (a waiter not woken wakes on its heartbeat anyway).
MAX_WAKE_POSTS = 4096
#: Released-ring positions at or past this were not counted up to by receivers (2**62
#: releases is centuries at 10**8 per second): a forged head or tail.
_RING_LIMIT = 1 << 62
_U32_MASK = 0xFFFFFFFF
_U64_MASK = 0xFFFFFFFFFFFFFFFF
_sched_yield = getattr(os, "sched_yield", lambda: None)


def unlink_sender_objects(prefix: str, pid: int, token: str) -> None:
    """Remove a dead sender's arena, semaphore, overflow and extension segments."""
    name = arena_name(prefix, pid, token)
    unlink_segment(name)
    unlink_semaphore(name + "-s")
    starts = (f"{prefix}-o{pid}-", f"{prefix}-e{pid}-")
    try:
        entries = os.listdir("/dev/shm")
    except OSError:
        return
    for entry in entries:
        if entry.startswith(starts):
            unlink_segment("/" + entry)


# ============================================================== the channel
class Channel:
    """The control segment, mutex and wake semaphore of one channel, as one process sees
    them. Opened (and created by the first comer) by ``join``; removed by the last
    participant's ``leave``, both under the host lock so the two cannot interleave."""

    def __init__(self, prefix: str, channel: str) -> None:
        self.prefix = prefix
        self.channel = channel
        self.pid = os.getpid()
        self.ctrl_name, self.mutex_name, self.wake_name = channel_names(prefix, channel)
        self._mutex: Any = None
        self._wake: Any = None
        self._mm: mmap.mmap | None = None
        #: ``threading.get_ident()`` of the thread of this process holding the mutex, 0
        #: when none does. Set right after the semaphore is taken and cleared right before
        #: it is given back, with no allocation in between that could start the garbage
        #: collector (whose finalizers may release blocks and so need to know).
        self.owner_tid = 0
        self._deferred: list[Callable[[], None]] = []
        #: wake-ups to post once the mutex is released (a woken waiter's first act is to
        #: take the mutex: posting while holding it would wake it only to sleep again)
        self._wake_posts = 0
        self.slot = -1

    # ------------------------------------------------------------ join / leave
    def join(self, role: int, token: str) -> None:
        """Open or create the channel's objects and register this process."""
        with HostLock():
            self._open_objects()
            with self.locked():
                reaped = self._reap_locked()
                for i in range(MAX_PARTICIPANTS):
                    off = _C_PART + i * _PART.size
                    if _PART.unpack_from(self._mm, off)[0] == 0:
                        _PART.pack_into(self._mm, off, self.pid, role, token.encode("ascii"))
                        self.slot = i
                        break
                else:
                    raise CapacityError(
                        f"shm: channel {self.channel!r} already has {MAX_PARTICIPANTS} "
                        "participants; close some or use another channel"
                    )
                self._bump_senders_locked()  # any participant: the device-IPC route's owner check
                self.lost_baseline = self.lost_senders()
            self._remove_reaped(reaped)

    def _open_objects(self) -> None:
        try:
            self._mutex = posix_ipc.Semaphore(self.mutex_name, posix_ipc.O_CREAT, MODE, 1)
            self._wake = posix_ipc.Semaphore(self.wake_name, posix_ipc.O_CREAT, MODE, 0)
            try:
                shm = posix_ipc.SharedMemory(self.ctrl_name, posix_ipc.O_CREX, MODE, CTRL_SIZE)
            except posix_ipc.ExistentialError:
                shm = posix_ipc.SharedMemory(self.ctrl_name)
                if shm.size < CTRL_SIZE:
                    os.ftruncate(shm.fd, CTRL_SIZE)
            try:
                self._mm = mmap.mmap(shm.fd, CTRL_SIZE, flags=mmap.MAP_SHARED, prot=PROT)
            finally:
                shm.close_fd()
        except posix_ipc.Error as exc:
            raise shm_error(f"opening channel {self.channel!r}", exc) from exc
        mm = self._mm
        #: ``senders_gen``, read without the mutex by receivers (``_word``); the mapping
        #: is never closed explicitly (finalizers of views may still lock the mutex)
        self._gen = _word(mm, _C_SENDERS_GEN)
        magic = bytes(mm[0:8])
        name = self.channel.encode("utf-8")
        if magic == b"\0" * 8:
            mm[_C_CHANNEL : _C_CHANNEL + len(name)] = name
            _U32.pack_into(mm, _C_CHANLEN, len(name))
            _U32.pack_into(mm, 8, CTRL_VERSION)
            mm[0:8] = CTRL_MAGIC
        elif magic != CTRL_MAGIC or _U32.unpack_from(mm, 8)[0] != CTRL_VERSION:
            raise ConfigurationError(
                f"shm: {self.ctrl_name} is not an omnilink v{CTRL_VERSION} control segment "
                "(another omnilink version uses this channel); run `omnilink gc` or pick "
                "another channel or OMNILINK_SHM_PREFIX"
            )
        else:
            n = _U32.unpack_from(mm, _C_CHANLEN)[0]
            if bytes(mm[_C_CHANNEL : _C_CHANNEL + n]) != name:
                raise ConfigurationError(
                    f"shm: channel {self.channel!r} collides with channel "
                    f"{bytes(mm[_C_CHANNEL:_C_CHANNEL + n]).decode('utf-8', 'replace')!r} "
                    "in its hashed name; rename one of them"
                )

    def leave(self) -> None:
        """Unregister; the last live participant removes the channel's objects."""
        if self._mm is None or self.slot < 0:
            return
        with HostLock():
            with self.locked():
                off = _C_PART + self.slot * _PART.size
                role = _PART.unpack_from(self._mm, off)[1]
                _PART.pack_into(self._mm, off, 0, 0, b"")
                self.slot = -1
                if role & ROLE_SEND:
                    _U32.pack_into(self._mm, _C_EXIT, 0)
                self._bump_senders_locked()
                reaped = self._reap_locked()
                last = not self._participants_locked()
                if last:
                    unlink_segment(self.ctrl_name)
                    unlink_semaphore(self.mutex_name)
                    unlink_semaphore(self.wake_name)
            self._remove_reaped(reaped)
        # The handles stay open until this object is garbage: finalizers of views still
        # alive after close() lock the mutex to hand their blocks back.

    # ------------------------------------------------------------------ mutex
    def lock(self, deadline: Any = None) -> bool:
        """Take the channel mutex; ``False`` if ``deadline`` passed first.

        ``deadline`` is a ``Deadline`` or ``None`` (wait as long as it takes; a dead
        holder is still detected and its lock taken over).
        """
        try:
            self._mutex.acquire(0)
        except posix_ipc.BusyError:
            if not self._lock_slow(deadline):
                return False
        self.owner_tid = get_ident()
        _U32.pack_into(self._mm, _C_OWNER, self.pid)
        return True

    def try_lock(self) -> bool:
        """Take the channel mutex if it is free now (one ``sem_trywait``); ``False``
        if it is not (then ``lock``/``lock_within`` wait for it)."""
        try:
            self._mutex.acquire(0)
        except posix_ipc.BusyError:
            return False
        self.owner_tid = get_ident()
        _U32.pack_into(self._mm, _C_OWNER, self.pid)
        return True

    def lock_within(self, deadline: Any) -> bool:
        """``lock`` for a call bounded by ``deadline`` (a ``Deadline``): the wait for the
        mutex is bounded by the larger of the call's remaining time and
        ``MUTEX_GRACE_S``, so that ordinary contention never turns a short timeout (or a
        ``get_nowait``) into an error while a stuck holder still cannot hang the call.
        The uncontended case costs one ``sem_trywait``."""
        try:
            self._mutex.acquire(0)
        except posix_ipc.BusyError:
            left = deadline.remaining()
            if not self._lock_slow(None if left is None else Deadline(max(left, MUTEX_GRACE_S))):
                return False
        self.owner_tid = get_ident()
        _U32.pack_into(self._mm, _C_OWNER, self.pid)
        return True

    def _lock_slow(self, deadline: Any) -> bool:
        sem = self._mutex
        # The mutex is held for a few microseconds: watch it that long before sleeping
        # (a sleeping waiter is slow to wake, see ``wait``).
        end = perf_counter_ns() + _MUTEX_SPIN_NS
        while perf_counter_ns() < end:
            if sem.value > 0:
                try:
                    sem.acquire(0)
                    return True
                except posix_ipc.BusyError:
                    pass
        unknown_since: float | None = None
        while True:
            step = _LOCK_SLICE_S if deadline is None else deadline.slice(_LOCK_SLICE_S)
            try:
                sem.acquire(step)
                return True
            except posix_ipc.BusyError:
                pass
            if deadline is not None and deadline.expired():
                return False
            owner = _U32.unpack_from(self._mm, _C_OWNER)[0]
            if owner == self.pid:
                if self.owner_tid == get_ident():
                    # This very thread holds it: waiting would deadlock. Only a bug (a
                    # re-entrant call) gets here; fail loudly instead of hanging.
                    raise TransportError(
                        f"shm channel {self.channel!r}: re-entrant use of the channel mutex"
                    )
                if self.owner_tid:
                    unknown_since = None  # another thread of ours; it will let go
                    continue
                # The segment names us but no thread of ours holds it: a holder of ours
                # died between taking and naming (impossible short of a crash); treat it
                # like an unknown holder below.
                owner = 0
            if owner:
                unknown_since = None
                if pid_alive(owner):
                    continue
            else:
                now = time.monotonic()
                if unknown_since is None:
                    unknown_since = now
                if now - unknown_since < _STUCK_UNKNOWN_S:
                    continue
            with HostLock():
                current = _U32.unpack_from(self._mm, _C_OWNER)[0]
                if current != owner and not (current == self.pid and not self.owner_tid):
                    continue
                # Take over the token the dead holder never gave back.
                _U32.pack_into(self._mm, _C_OWNER, self.pid)
            logger.warning(
                "shm channel %r: mutex holder pid %s is gone; taking the lock over",
                self.channel,
                owner or "(unknown)",
            )
            return True

    def unlock(self) -> None:
        """Give the mutex back, after running deferred releases; then post the wake-ups
        ``notify_all`` counted."""
        if not self._wake_posts and not self._deferred:  # the common case
            _U32.pack_into(self._mm, _C_OWNER, 0)
            self.owner_tid = 0
            self._mutex.release()
            return
        deferred = self._deferred
        while deferred:
            fn = deferred.pop()
            try:
                fn()
            except Exception:  # a deferred release must not break the caller's unlock
                logger.exception("shm: deferred block release failed")
        posts = self._wake_posts
        self._wake_posts = 0
        _U32.pack_into(self._mm, _C_OWNER, 0)
        self.owner_tid = 0
        self._mutex.release()
        if posts:
            release = self._wake.release
            for _ in range(posts):
                release()

    def held_by_me(self) -> bool:
        """Whether the calling thread holds the mutex."""
        return self.owner_tid == get_ident()

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (under the mutex) just before this thread's ``unlock``."""
        self._deferred.append(fn)

    def locked(self, deadline: Any = None) -> _Locked:
        return _Locked(self, deadline)

    # --------------------------------------------------------- wake semaphore
    def register_waiter(self) -> int:
        mm = self._mm
        _U32.pack_into(mm, _C_WAITERS, (_U32.unpack_from(mm, _C_WAITERS)[0] + 1) & _U32_MASK)
        return _U32.unpack_from(mm, _C_WAKE_GEN)[0]

    def withdraw_waiter(self, gen: int) -> None:
        mm = self._mm
        if _U32.unpack_from(mm, _C_WAKE_GEN)[0] == gen:
            n = _U32.unpack_from(mm, _C_WAITERS)[0]
            if n:
                _U32.pack_into(mm, _C_WAITERS, n - 1)

    def notify_all(self) -> None:
        """Wake every registered waiter (mutex held). The count is taken and the
        generation bumped now; the semaphore is posted by ``unlock`` once the mutex is
        free. A waiter that times out in between sees the new generation, does not
        withdraw, and finds the token later (one spurious rescan, never a lost wake)."""
        mm = self._mm
        n, gen = _II.unpack_from(mm, _C_WAITERS)
        if n:
            _II.pack_into(mm, _C_WAITERS, 0, (gen + 1) & _U32_MASK)
            self._wake_posts = min(self._wake_posts + n, MAX_WAKE_POSTS)

    def wait(self, timeout: float, spin_ns: int = 0, yield_after_ns: int | None = None) -> bool:
        """Wait for a token of the wake semaphore (mutex not held); ``False`` on timeout.

        With ``spin_ns`` the first ``spin_ns`` nanoseconds are spent watching the
        semaphore's value and taking a token the moment one is posted, and only then
        does the caller sleep in ``sem_timedwait``. Waking a sleeping process costs
        tens to hundreds of microseconds on a virtual machine (its idle vCPU halts);
        a payload published within the spin is picked up in about a microsecond. The
        semaphore is still what hands the wake-up over: nothing here sleeps or reads
        the data without the mutex.

        ``yield_after_ns``: past this much of the spin, the spinning thread yields the
        CPU at every look (``sched_yield``), so a long spin only takes time no other
        runnable thread of this CPU wants. Before it, it does not: on a busy host a
        yield can hand the CPU away for a whole scheduler slice, longer than the wait.
        """
        sem = self._wake
        if spin_ns > 0:
            now = perf_counter_ns()
            end = now + spin_ns
            polite = end if yield_after_ns is None else now + yield_after_ns
            while True:
                if sem.value > 0:
                    try:
                        sem.acquire(0)
                        return True
                    except posix_ipc.BusyError:  # another waiter took it first
                        pass
                now = perf_counter_ns()
                if now >= end:
                    break
                if now >= polite:
                    _sched_yield()
            timeout = max(0.0, timeout - spin_ns / 1e9)
        try:
            sem.acquire(timeout)
            return True
        except posix_ipc.BusyError:
            return False

    # ----------------------------------------------------------- participants
    def senders_gen(self) -> int:
        """The participants generation: moves whenever a participant (a sender or a
        receiver) joins, leaves or is reaped; read without the mutex."""
        return self._gen[0]

    def lost_senders(self) -> int:
        return _U32.unpack_from(self._mm, _C_LOST)[0]

    def last_sender_exit_dead(self) -> bool:
        return bool(_U32.unpack_from(self._mm, _C_EXIT)[0])

    def _bump_senders_locked(self) -> None:
        self._gen[0] = (self._gen[0] + 1) & _U64_MASK  # one 8-byte store: read without the mutex
        self.notify_all()

    def _participants_locked(self) -> list[tuple[int, int, str]]:
        out = []
        for i in range(MAX_PARTICIPANTS):
            pid, role, token = _PART.unpack_from(self._mm, _C_PART + i * _PART.size)
            if pid:
                out.append((pid, role, token.rstrip(b"\0").decode("ascii", "replace")))
        return out

    def participants(self) -> list[tuple[int, int, str]]:
        """(pid, role bits, token) of every registered participant (mutex held)."""
        return self._participants_locked()

    def _reap_locked(self) -> list[tuple[int, int, str]]:
        """Drop participants whose process died; count dead senders. Mutex held."""
        reaped = []
        for i in range(MAX_PARTICIPANTS):
            off = _C_PART + i * _PART.size
            pid, role, token = _PART.unpack_from(self._mm, off)
            if pid and pid != self.pid and not pid_alive(pid):
                _PART.pack_into(self._mm, off, 0, 0, b"")
                reaped.append((pid, role, token.rstrip(b"\0").decode("ascii", "replace")))
                if role & ROLE_SEND:
                    _U32.pack_into(self._mm, _C_LOST, (self.lost_senders() + 1) & _U32_MASK)
                    _U32.pack_into(self._mm, _C_EXIT, 1)
                self._bump_senders_locked()
                logger.info("shm channel %r: reaped dead participant pid %d", self.channel, pid)
        return reaped

    def reap(self) -> list[tuple[int, int, str]]:
        """Reap dead participants (mutex held by the caller); see ``remove_reaped``."""
        return self._reap_locked()

    def _remove_reaped(self, reaped: list[tuple[int, int, str]]) -> None:
        for pid, role, token in reaped:
            if role & ROLE_SEND:
                unlink_sender_objects(self.prefix, pid, token)

    remove_reaped = _remove_reaped


class _Locked:
    __slots__ = ("_chan", "_deadline")

    def __init__(self, chan: Channel, deadline: Any) -> None:
        self._chan = chan
        self._deadline = deadline

    def __enter__(self) -> Channel:
        if not self._chan.lock(self._deadline):
            raise _LockTimeout()
        return self._chan

    def __exit__(self, *exc_info: object) -> None:
        self._chan.unlock()


class _LockTimeout(Exception):
    """Internal: the channel mutex was not free before the deadline."""


# ================================================================== arenas
class _Layout:
    __slots__ = ("total", "n_desc", "log_len", "log_offset", "rel_offset", "data_offset", "data_bytes")

    def __init__(self, total: int, n_desc: int, log_len: int) -> None:
        self.total = total
        self.n_desc = n_desc
        self.log_len = log_len
        self.log_offset = _DESC_OFFSET + n_desc * DESC_SIZE
        self.rel_offset = self.log_offset + 4 * log_len
        meta = self.rel_offset + 4 * n_desc
        self.data_offset = (meta + PAGE - 1) // PAGE * PAGE
        self.data_bytes = (total - self.data_offset) // ALIGN * ALIGN


def arena_layout(arena_bytes: int, n_desc: int) -> _Layout:
    total = (arena_bytes + PAGE - 1) // PAGE * PAGE
    return _Layout(total, n_desc, 4 * n_desc)


class Space:
    """One place a sender allocates blocks in: the arena's data area or an extension
    segment. ``view[base + off : base + off + n]`` is the block at ``off``; ``flags`` and
    ``token`` are what its descriptors say about where it lives."""

    __slots__ = ("view", "base", "alloc", "flags", "token", "name", "mm", "slot", "size", "empty_since", "addr")

    def __init__(self, mm: mmap.mmap, base: int, data_bytes: int, flags: int, token: bytes, name: str,
                 slot: int) -> None:
        self.mm = mm
        self.view = memoryview(mm)
        #: address of the mapping's first byte, looked up once (``PreparedBlob.write_at``);
        #: the ctypes probe is dropped at once so the mapping can still be closed
        probe = ctypes.c_char.from_buffer(mm)
        self.addr = ctypes.addressof(probe)
        del probe
        self.base = base
        self.alloc = Allocator(data_bytes)
        self.flags = flags
        self.token = token
        self.name = name
        self.slot = slot
        self.size = len(mm)
        #: ``time.monotonic()`` when its last block came back (extensions only)
        self.empty_since: float | None = None

    def unmap(self) -> None:
        self.view.release()
        try:
            self.mm.close()
        except BufferError:  # pragma: no cover - an encode still running in another thread
            logger.warning("shm segment %s: mapping still exported at close; left to the GC", self.name)


class _OutRec:
    """A sender's record of one descriptor it owns (process-local)."""

    __slots__ = ("seq", "key", "offset", "reserved", "overflow", "space", "published")

    def __init__(self, seq: int, key: str, offset: int, reserved: int, overflow: str | None,
                 space: Space | None = None) -> None:
        self.seq = seq
        self.key = key
        self.offset = offset
        self.reserved = reserved
        self.overflow = overflow
        #: the ``Space`` holding the block (``None`` for an overflow segment)
        self.space = space
        #: ``time.monotonic()`` at publication (set by ``ArenaWriter.publish``)
        self.published = 0.0


_new = object.__new__


def out_rec(key: str, offset: int, reserved: int, space: Space) -> _OutRec:
    """``_OutRec(0, key, offset, reserved, None, space)`` without the cost of calling a
    class (once per put)."""
    rec = _new(_OutRec)
    rec.seq = 0
    rec.key = key
    rec.offset = offset
    rec.reserved = reserved
    rec.overflow = None
    rec.space = space
    rec.published = 0.0
    return rec


#: A sender that waits for room looks for blocks held by dead receivers at most this
#: often (and at every heartbeat of a wait that timed out). The scan walks every
#: outstanding descriptor under the channel mutex: done on each put that found the
#: arena full, it held the mutex ~60 us per put of a receiver-bound 1 MiB stream on an
#: H100 host, and the receiver's release waited for it on every payload.
ABANDONED_EVERY_S = 0.1


class ArenaWriter:
    """A sender's own arena: it alone allocates, publishes and reclaims in it.

    ``spaces[0]`` is the arena's data area; ``spaces[1:]`` are its extension segments
    (see the module docstring), added by ``grow`` and given back by ``trim``.
    """

    def __init__(
        self, prefix: str, pid: int, token: str, arena_bytes: int, n_desc: int, *, channel: str | None = None
    ) -> None:
        lay = arena_layout(arena_bytes, n_desc)
        self.layout = lay
        self.data_bytes = lay.data_bytes
        self.prefix = prefix
        self.pid = pid
        self.token = token
        self.name = arena_name(prefix, pid, token)
        self.sem_name = self.name + "-s"
        on = f" on channel {channel!r}" if channel is not None else ""
        self.mm = create_segment(self.name, lay.total, f"the arena of sender pid {pid}{on}")
        try:
            _A_HDR.pack_into(
                self.mm, 0, ARENA_MAGIC, ARENA_VERSION, pid, lay.total, lay.data_offset,
                lay.data_bytes, n_desc, lay.log_len,
            )
            self.sem = posix_ipc.Semaphore(self.sem_name, posix_ipc.O_CREX, MODE, 0)
        except BaseException:
            self.mm.close()
            unlink_segment(self.name)
            raise
        self.primary = Space(self.mm, lay.data_offset, lay.data_bytes, 0, b"", self.name, -1)
        #: ``pub_seq`` of the mapping (receivers read it without the mutex: ``_word``)
        self._pub = _word(self.mm, _A_PUB)
        #: the header page as u64 words and the descriptors, log and ring as u32 words:
        #: ``drain`` reads and writes its fields by index (cheaper than struct calls,
        #: and each access is one aligned load or store). Released before the unmap.
        self._q = memoryview(self.mm)[:PAGE].cast("Q")
        self._u32 = memoryview(self.mm)[: lay.data_offset].cast("I")
        self.spaces: list[Space] = [self.primary]
        self.view = self.primary.view
        self.data_offset = lay.data_offset
        self._log_offset = lay.log_offset
        self._log_len = lay.log_len
        self._rel_offset = lay.rel_offset
        self._n_desc = n_desc
        self.alloc = self.primary.alloc
        self.free_desc = list(range(n_desc - 1, -1, -1))
        self.out: dict[int, _OutRec] = {}
        self.pub_seq = 0
        self.overflow_bytes = 0
        self.closed = False
        #: publication time of the newest payload known to have been claimed: how far
        #: the receivers have read (see ``reclaim_unread``)
        self.frontier = 0.0
        #: ``time.monotonic()`` of the last ``reclaim_abandoned`` (``abandoned_check_due``)
        self.abandoned_at = -ABANDONED_EVERY_S

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the arena and its extension segments."""
        return sum(sp.size for sp in self.spaces)

    def alloc_any(self, n: int) -> tuple[Space, int] | None:
        """A block of ``n`` bytes in the arena or, if it is full, in an extension."""
        for sp in self.spaces:
            off = sp.alloc.alloc(n)
            if off is not None:
                if sp.empty_since is not None:
                    sp.empty_since = None
                return sp, off
        return None

    # ------------------------------------------------------------ under mutex
    def publish(self, idx: int, key_bytes: bytes, rec: _OutRec, length: int, flags: int, otoken: bytes) -> None:
        mm = self.mm
        seq = self.pub_seq + 1
        self.pub_seq = seq
        rec.seq = seq
        d = _DESC_OFFSET + idx * DESC_SIZE
        klen = len(key_bytes)
        _DESC.pack_into(mm, d, WRITTEN, 0, seq, rec.offset, length, rec.reserved, klen, flags, otoken)
        mm[d + 64 : d + 64 + klen] = key_bytes
        _U32.pack_into(mm, self._log_offset + 4 * (seq % self._log_len), idx)
        self._pub[0] = seq  # one 8-byte store: receivers read it without the mutex
        rec.published = time.monotonic()
        # Insertion order of ``out`` is publication order (a reused descriptor is popped
        # when reclaimed and re-inserted here): ``reclaim_unread`` relies on it.
        self.out[idx] = rec

    def drain(self) -> int:
        """Reclaim every descriptor receivers pushed on the released ring.

        The ring's head and tail and its entries are written by other processes: at most
        ``n_desc`` entries are read (no descriptor is on the ring twice), and an entry is
        taken back only if it names a descriptor of ours that is RELEASED. A ring that
        breaks either rule is rebuilt by ``_resync_ring``."""
        q = self._q
        head = q[_Q_REL_HEAD]
        tail = q[_Q_REL_TAIL]
        if head == tail and head < _RING_LIMIT:
            return 0
        n_desc = self._n_desc
        if not tail < head <= tail + n_desc or head >= _RING_LIMIT:
            return self._resync_ring(f"head {head} and tail {tail} of a ring of {n_desc}")
        n = 0
        u32 = self._u32
        ring = self._rel_offset >> 2
        out = self.out
        frontier = self.frontier
        bad = 0
        while tail < head:
            idx = u32[ring + tail % n_desc]
            tail += 1
            rec = out.get(idx)
            if rec is None:
                bad += 1
                continue
            d = _DESC_WORD + idx * _DESC_WORDS
            # Only a RELEASED descriptor is ours to take back: an entry naming one still
            # WRITTEN (unread) or CLAIMED (in use) was not pushed by its reader.
            if u32[d] != RELEASED:
                bad += 1
                continue
            if rec.published > frontier:
                frontier = rec.published
            sp = rec.space
            if sp is not None and sp.slot < 0 and rec.overflow is None:
                # ``_reclaim`` of a block of the arena itself, inline
                del out[idx]
                u32[d] = FREE
                sp.alloc.free(rec.offset)
                self.free_desc.append(idx)
                n += 1
                continue
            if self._reclaim(idx):
                n += 1
        self.frontier = frontier
        q[_Q_REL_TAIL] = tail
        if bad:
            # A forged entry may have overwritten an honest one: find its descriptor too.
            n += self._resync_ring(f"{bad} entr{'y' if bad == 1 else 'ies'} naming no descriptor released to us")
        return n

    def _resync_ring(self, what: str) -> int:
        """Rebuild the released ring after another process corrupted it (mutex held):
        take back every descriptor of ours that is RELEASED, then empty the ring.
        Returns how many were taken back."""
        logger.warning("shm arena %s: released ring corrupted (%s); rescanning the descriptors", self.name, what)
        mm = self.mm
        n = 0
        for idx, rec in list(self.out.items()):
            state, _claimer, seq = _DESC_HEAD.unpack_from(mm, _DESC_OFFSET + idx * DESC_SIZE)
            if state == RELEASED and seq == rec.seq:
                if rec.published > self.frontier:
                    self.frontier = rec.published
                if self._reclaim(idx):
                    n += 1
        _QQ.pack_into(mm, _A_REL_HEAD, 0, 0)
        return n

    def _reclaim(self, idx: int) -> bool:
        rec = self.out.pop(idx, None)
        if rec is None:  # pragma: no cover - a receiver bug; never double free
            logger.error("shm arena %s: released descriptor %d is not outstanding", self.name, idx)
            return False
        _U32.pack_into(self.mm, _DESC_OFFSET + idx * DESC_SIZE, FREE)
        if rec.overflow is not None:
            unlink_segment(rec.overflow)
            self.overflow_bytes -= rec.reserved
        else:
            sp = rec.space if rec.space is not None else self.primary
            sp.alloc.free(rec.offset)
            if sp.slot >= 0 and not sp.alloc.used_bytes:
                sp.empty_since = time.monotonic()
        self.free_desc.append(idx)
        return True

    def abandoned_check_due(self) -> bool:
        """Whether ``ABANDONED_EVERY_S`` has passed since the last ``reclaim_abandoned``."""
        return time.monotonic() - self.abandoned_at >= ABANDONED_EVERY_S

    def reclaim_abandoned(self) -> int:
        """Reclaim blocks CLAIMED by processes that died holding them (a scan of every
        outstanding descriptor, a liveness look-up per claimer: callers on a busy path
        ask ``abandoned_check_due`` first), and RELEASED ones missing from the released
        ring (a receiver found the ring corrupted and could not push them): the ring is
        drained first, under the same hold of the mutex, so none is on it."""
        n = self.drain()
        self.abandoned_at = time.monotonic()
        mm = self.mm
        alive: dict[int, bool] = {}
        for idx in list(self.out):
            state, claimer, seq = _DESC_HEAD.unpack_from(mm, _DESC_OFFSET + idx * DESC_SIZE)
            if state == RELEASED and seq == self.out[idx].seq:
                logger.info("shm arena %s: reclaiming released block %d that missed the ring", self.name, idx)
                self._reclaim(idx)
                n += 1
            elif state == CLAIMED:
                ok = alive.get(claimer)
                if ok is None:
                    ok = alive[claimer] = pid_alive(claimer)
                if not ok:
                    logger.info("shm arena %s: reclaiming block held by dead pid %d", self.name, claimer)
                    rec = self.out[idx]
                    if rec.published > self.frontier:
                        self.frontier = rec.published
                    self._reclaim(idx)
                    n += 1
        return n

    def held_bytes(self) -> tuple[int, int]:
        """(bytes of blocks receivers claimed and still hold, bytes nobody claimed yet),
        reserved sizes of the outstanding arena and extension blocks."""
        mm = self.mm
        held = unread = 0
        for idx, rec in list(self.out.items()):
            if rec.overflow is not None:
                continue
            state = _U32.unpack_from(mm, _DESC_OFFSET + idx * DESC_SIZE)[0]
            if state == CLAIMED:
                held += rec.reserved
            elif state == WRITTEN:
                unread += rec.reserved
        return held, unread

    def add_extension(self, sp: Space) -> None:
        """List a new extension segment in the table (mutex held)."""
        _EXT_ENTRY.pack_into(self.mm, _A_EXT_TABLE + sp.slot * _EXT_ENTRY.size, 1, sp.size, sp.token)
        _U64.pack_into(self.mm, _A_EXT_GEN, (_U64.unpack_from(self.mm, _A_EXT_GEN)[0] + 1) & _U64_MASK)
        self.spaces.append(sp)

    def retire_idle(self, idle_s: float, now: float) -> list[Space]:
        """Unlist the extensions empty for at least ``idle_s`` seconds (mutex held); the
        caller unlinks and unmaps the returned ones (``drop_extension``) after unlocking."""
        gone = [sp for sp in self.spaces[1:] if sp.empty_since is not None and now - sp.empty_since >= idle_s
                and not sp.alloc.used_bytes]
        if gone:
            for sp in gone:
                _EXT_ENTRY.pack_into(self.mm, _A_EXT_TABLE + sp.slot * _EXT_ENTRY.size, 0, 0, b"")
                self.spaces.remove(sp)
            _U64.pack_into(self.mm, _A_EXT_GEN, (_U64.unpack_from(self.mm, _A_EXT_GEN)[0] + 1) & _U64_MASK)
        return gone

    def free_slot(self) -> int:
        """A free entry of the extension table, or -1."""
        used = {sp.slot for sp in self.spaces}
        for i in range(MAX_EXTENSIONS):
            if i not in used:
                return i
        return -1

    def discard(self, key: str) -> bool:
        """Drop an unclaimed (WRITTEN) payload of ours under ``key``."""
        mm = self.mm
        for idx, rec in self.out.items():
            if rec.key == key:
                state, _claimer, seq = _DESC_HEAD.unpack_from(mm, _DESC_OFFSET + idx * DESC_SIZE)
                if state == WRITTEN and seq == rec.seq:
                    self._reclaim(idx)
                    return True
        return False

    def pending(self, idx: int, key: str) -> bool:
        """Whether descriptor ``idx`` still holds an unclaimed (WRITTEN) payload of ours
        under ``key``. Reads one word; no mutex needed (a racing claim only makes the
        answer a moment old, on the safe side)."""
        rec = self.out.get(idx)
        if rec is None or rec.key != key:
            return False
        state, _claimer, seq = _DESC_HEAD.unpack_from(self.mm, _DESC_OFFSET + idx * DESC_SIZE)
        return state == WRITTEN and seq == rec.seq

    def reclaim_unread(
        self,
        older_than: float,
        now: float,
        enough: Callable[[], bool] | None = None,
        *,
        overtaken_only: bool = False,
    ) -> list[tuple[str, float, int]]:
        """Drop unclaimed (WRITTEN) payloads published more than ``older_than`` seconds
        before ``now``, oldest first, until ``enough()`` says so (``None``: all of them).

        With ``overtaken_only``, only payloads published before the newest one a receiver
        has claimed (``frontier``): the receivers read past them. A receiver that is only
        behind, or stalled, reading in publication order, has read past none of what it
        still has to read, however old.

        Returns ``(key, age in seconds, bytes reserved)`` of each payload dropped. A
        payload a receiver has claimed is never touched.
        """
        mm = self.mm
        cutoff = now - older_than
        items = list(self.out.items())
        states = [_DESC_HEAD.unpack_from(mm, _DESC_OFFSET + idx * DESC_SIZE) for idx, _ in items]
        if overtaken_only:
            for (_idx, rec), (state, _claimer, seq) in zip(items, states):
                if state in (CLAIMED, RELEASED) and seq == rec.seq and rec.published > self.frontier:
                    self.frontier = rec.published
            cutoff = min(cutoff, self.frontier)
        dropped: list[tuple[str, float, int]] = []
        for (idx, rec), (state, _claimer, seq) in zip(items, states):
            if rec.published >= cutoff:
                break  # publication order: every later one is younger
            if state != WRITTEN or seq != rec.seq:
                continue
            self._reclaim(idx)
            dropped.append((rec.key, now - rec.published, rec.reserved))
            if enough is not None and enough():
                break
        return dropped

    def unread_keys(self) -> list[str]:
        """Keys of our payloads no receiver has claimed yet."""
        mm = self.mm
        out = []
        for idx, rec in list(self.out.items()):
            state, _claimer, seq = _DESC_HEAD.unpack_from(mm, _DESC_OFFSET + idx * DESC_SIZE)
            if state == WRITTEN and seq == rec.seq:
                out.append(rec.key)
        return out

    def unclaimed(self) -> int:
        mm = self.mm
        return sum(
            1 for idx in self.out if _U32.unpack_from(mm, _DESC_OFFSET + idx * DESC_SIZE)[0] == WRITTEN
        )

    def set_waiting(self) -> None:
        _U32.pack_into(self.mm, _A_WAITING, 1)

    def mark_closed(self) -> None:
        _U32.pack_into(self.mm, _A_CLOSED, 1)
        for rec in self.out.values():
            if rec.overflow is not None:
                unlink_segment(rec.overflow)

    # -------------------------------------------------------------- no mutex
    def new_extension(self, size: int, slot: int) -> Space:
        """Create and pre-fault an extension segment of ``size`` bytes (not yet listed:
        ``add_extension`` does that under the mutex)."""
        token = new_token()
        name = extension_name(self.prefix, self.pid, token)
        mm = create_segment(name, size, f"an extension of the arena of sender pid {self.pid}")
        return Space(mm, 0, size // ALIGN * ALIGN, FLAG_EXTENSION, token.encode("ascii"), name, slot)

    @staticmethod
    def drop_extension(sp: Space) -> None:
        unlink_segment(sp.name)
        sp.unmap()

    def wait_space(self, timeout: float) -> bool:
        try:
            self.sem.acquire(timeout)
            return True
        except posix_ipc.BusyError:
            return False

    def close(self) -> None:
        """Unlink everything this arena created; the mappings go too."""
        for rec in self.out.values():
            if rec.overflow is not None:
                unlink_segment(rec.overflow)
        for sp in self.spaces[1:]:
            unlink_segment(sp.name)
            sp.unmap()
        del self.spaces[1:]
        unlink_segment(self.name)
        unlink_semaphore(self.sem_name)
        self._pub.release()
        self._q.release()
        self._u32.release()
        self.primary.unmap()


def _check_header(mm: Any) -> _Layout:
    """The layout an arena's header describes, checked against the mapping it is read
    from (its length is the one thing another process cannot change after the map):
    exactly what ``arena_layout`` gives for its own descriptor count, inside the
    mapping. Raises ``ConfigurationError`` (its message completes "shm: <name> ...")."""
    if len(mm) < _DESC_OFFSET:
        raise ConfigurationError(f"is {len(mm)} bytes, too small for an arena")
    magic, version, _owner, total, data_off, data_bytes, n_desc, log_len = _A_HDR.unpack_from(mm, 0)
    if magic != ARENA_MAGIC or version != ARENA_VERSION:
        raise ConfigurationError(f"is not an omnilink v{ARENA_VERSION} arena")
    # A first bound (each descriptor takes 596 bytes before the data area, with its log
    # and ring entries); the layout check below is the exact one.
    if not 0 < n_desc <= len(mm) // DESC_SIZE or log_len != 4 * n_desc or total > len(mm):
        raise ConfigurationError(
            f"has an invalid header: {n_desc} descriptors, a log of {log_len}, {total} bytes "
            f"in a mapping of {len(mm)} (corrupted by another process?)"
        )
    lay = _Layout(total, n_desc, log_len)
    if lay.data_offset != data_off or lay.data_bytes != data_bytes or lay.data_bytes <= 0:
        raise ConfigurationError(
            f"has an inconsistent layout: data at {data_off} (+{data_bytes}), expected "
            f"{lay.data_offset} (+{lay.data_bytes}) (corrupted by another process?)"
        )
    return lay


class ArenaReader:
    """A receiver's mapping of one sender's arena (mapped once, scanned incrementally).

    The layout is read and checked once, at the map (``_check_header``); later writes
    to the header's geometry are never looked at."""

    def __init__(self, prefix: str, pid: int, token: str) -> None:
        self.prefix = prefix
        self.pid = pid
        self.token = token
        self.name = arena_name(prefix, pid, token)
        self.mm = open_segment(self.name)  # ExistentialError propagates: sender is gone
        try:
            lay = _check_header(self.mm)
        except ConfigurationError as exc:
            self.mm.close()
            raise ConfigurationError(f"shm: {self.name} {exc}") from None
        n_desc = lay.n_desc
        self.layout = lay
        self.data_offset = lay.data_offset
        #: the sender's ``pub_seq``, read without the mutex by one 8-byte load (``_word``)
        self.pub = _word(self.mm, _A_PUB)
        self._log_offset = lay.log_offset
        self._log_len = lay.log_len
        self._rel_offset = lay.rel_offset
        self._n_desc = n_desc
        self.cursor = 0
        #: descriptor -> the key this reader last indexed for it: when the descriptor is
        #: published again, that entry is stale (claimed elsewhere, discarded or
        #: reclaimed) and goes, so the receiver's index stays as small as the arena
        self.indexed: dict[int, str] = {}
        #: a numpy uint8 view of the whole mapping, made on first use: a slice of it is
        #: the cheapest per-message exporter object (see ``lease``)
        self._bytes: Any = None
        self._data_addr: int | None = None
        #: extension segments mapped so far: token -> numpy uint8 view of the mapping
        self.extensions: dict[bytes, Any] = {}
        self._ext_gen = 0
        try:
            self.sem = posix_ipc.Semaphore(self.name + "-s")
        except posix_ipc.ExistentialError:
            self.sem = None

    def lease(self, offset: int, length: int) -> Any:
        """A fresh exporter object over ``length`` bytes of the data area at ``offset``.

        It is a numpy array (a slice of one view of the whole mapping): decoded views
        keep it alive, and it supports weak references, so the receiver learns when the
        last view of a payload is gone."""
        whole = self._bytes
        if whole is None:
            import numpy as np

            whole = self._bytes = np.frombuffer(self.mm, dtype=np.uint8)
        start = self.data_offset + offset
        return whole[start : start + length]

    def published(self) -> int:
        """The sender's publication counter, read without the mutex (see the module
        docstring: a miss needs no lock)."""
        return self.pub[0]

    def map_extension(self, token: bytes) -> None:
        """Map extension segment ``token`` if not mapped yet (mutex held: a descriptor
        this process just claimed lives in it, so the sender cannot have retired it)."""
        if token in self.extensions:
            return
        import numpy as np

        name = extension_name(self.prefix, self.pid, token.rstrip(b"\0").decode("ascii"))
        mm = open_segment(name)
        self.extensions[token] = np.frombuffer(mm, dtype=np.uint8)

    def lease_extension(self, token: bytes, offset: int, length: int) -> Any:
        """Like ``lease``, for a block of extension segment ``token`` (mapped by
        ``map_extension``)."""
        return self.extensions[token][offset : offset + length]

    def _prune_extensions(self) -> None:
        """Drop the mappings of extensions the sender gave back (mutex held). The memory
        goes once no view of it is left: none is, since a segment is given back only
        after every block in it was released."""
        gen = _U64.unpack_from(self.mm, _A_EXT_GEN)[0]
        if gen == self._ext_gen:
            return
        self._ext_gen = gen
        live = set()
        for i in range(MAX_EXTENSIONS):
            ok, _size, token = _EXT_ENTRY.unpack_from(self.mm, _A_EXT_TABLE + i * _EXT_ENTRY.size)
            if ok:
                live.add(token)
        for token in [t for t in self.extensions if t not in live]:
            del self.extensions[token]

    def close(self) -> None:
        """Unmap (for tests; a connector leaves its mappings to the garbage collector,
        since payload views may still use them)."""
        self._bytes = None
        self.extensions.clear()
        self.pub.release()
        self.mm.close()

    def mappings(self) -> list[tuple[str, int, int]]:
        """(name, start address, length) of the arena's and its mapped extensions'
        mappings in this process (for tests and diagnostics)."""
        start, length = self.address()
        out = [(self.name, start, length)]
        for token, whole in list(self.extensions.items()):
            name = extension_name(self.prefix, self.pid, token.rstrip(b"\0").decode("ascii"))
            out.append((name, whole.ctypes.data, whole.nbytes))
        return out

    def data_address(self) -> int:
        """Address in this process of the first byte of the arena's data area (looked up
        once: a transport copies straight out of the mapping, by DMA)."""
        addr = self._data_addr
        if addr is None:
            addr = self._data_addr = self.address()[0] + self.data_offset
        return addr

    def address(self) -> tuple[int, int]:
        """(start address, length) of this mapping in this process (for tests)."""
        import ctypes

        probe = (ctypes.c_char * 1).from_buffer(self.mm)
        try:
            return ctypes.addressof(probe), len(self.mm)
        finally:
            del probe

    # ------------------------------------------------------------ under mutex
    def scan(self, index: dict[str, list[Any]]) -> None:
        """Add payloads published since the last scan to ``index`` (key -> refs)."""
        mm = self.mm
        if self.extensions:
            self._prune_extensions()
        pub = self.pub[0]
        cur = self.cursor
        if pub == cur:
            return
        self.cursor = pub
        log_len = self._log_len
        if pub - cur > log_len or pub < cur:
            # Fell behind the log: read every descriptor once. So also when the counter
            # went back (only another process's write does that; the publications the
            # sender made since then may be anywhere behind the forged value).
            for idx in range(self._n_desc):
                d = _DESC_OFFSET + idx * DESC_SIZE
                state, seq, klen = _DESC_SCAN.unpack_from(mm, d)
                if state == WRITTEN and seq <= pub:
                    key = self._key_at(d, klen)
                    if key is not None:
                        self._index_add(index, key, idx, seq)
            return
        log_off = self._log_offset
        n_desc = self._n_desc
        indexed = self.indexed
        u32, scan = _U32.unpack_from, _DESC_SCAN.unpack_from
        for s in range(cur + 1, pub + 1):
            idx = u32(mm, log_off + 4 * (s % log_len))[0]
            if idx >= n_desc:
                self._corrupt(f"publish log entry {s} names descriptor {idx} of {n_desc}")
                continue
            d = _DESC_OFFSET + idx * DESC_SIZE
            state, seq, klen = scan(mm, d)
            # A log entry is valid only while its descriptor still holds that publication.
            if state == WRITTEN and seq == s:
                if 0 < klen <= MAX_KEY_BYTES:
                    try:
                        key = str(mm[d + 64 : d + 64 + klen], "utf-8")
                    except UnicodeDecodeError:
                        key = self._key_at(d, klen)  # logs it
                else:
                    key = self._key_at(d, klen)
                if key is None:
                    continue
                old = indexed.get(idx)
                if old is not None and old in index:
                    self._index_add(index, key, idx, seq)  # drops the stale entry first
                    continue
                indexed[idx] = key
                refs = index.get(key)
                if refs is None:
                    index[key] = [(self, idx, seq)]
                else:
                    refs.append((self, idx, seq))

    def _key_at(self, d: int, klen: int) -> str | None:
        """The key of the descriptor at ``d``, or None (logged) if its bytes are not a
        valid key: the arena is writable by any process of the user, so a corrupted
        descriptor is skipped rather than allowed to break every receive."""
        if not 0 < klen <= MAX_KEY_BYTES:
            self._corrupt(f"descriptor at {d} has a key of {klen} bytes")
            return None
        try:
            return str(self.mm[d + 64 : d + 64 + klen], "utf-8")
        except UnicodeDecodeError:
            self._corrupt(f"descriptor at {d} has a key that is not UTF-8")
            return None

    def _corrupt(self, what: str) -> None:
        logger.warning("shm: arena %s: %s; skipped (corrupted by another process?)", self.name, what)

    def _index_add(self, index: dict[str, list[Any]], key: str, idx: int, seq: int) -> None:
        old = self.indexed.get(idx)
        if old is not None:
            refs = index.get(old)
            if refs:
                kept = [r for r in refs if r[0] is not self or r[1] != idx]
                if not kept:
                    del index[old]
                elif len(kept) != len(refs):
                    refs[:] = kept
        self.indexed[idx] = key
        _index_add(index, key, (self, idx, seq))

    def claim(self, idx: int, seq: int, pid: int) -> tuple[int, int, int, bytes] | None:
        """WRITTEN -> CLAIMED if the descriptor still holds publication ``seq``."""
        mm = self.mm
        d = _DESC_OFFSET + idx * DESC_SIZE
        state, _claimer, dseq, off, length, _res, _klen, flags, otoken = _DESC.unpack_from(mm, d)
        if state != WRITTEN or dseq != seq:
            return None
        _II.pack_into(mm, d, CLAIMED, pid)
        if mm[_A_WAITING]:  # the flag is 0 or 1: its low byte says it
            self._notify_sender()
        return off, length, flags, otoken

    def still_written(self, idx: int, seq: int) -> bool:
        state, _c, dseq = _DESC_HEAD.unpack_from(self.mm, _DESC_OFFSET + idx * DESC_SIZE)
        return state == WRITTEN and dseq == seq

    def mark_released(self, idx: int, seq: int, pid: int) -> None:
        """CLAIMED (by ``pid``) -> RELEASED, pushed on the released ring."""
        mm = self.mm
        d = _DESC_OFFSET + idx * DESC_SIZE
        state, claimer, dseq = _DESC_HEAD.unpack_from(mm, d)
        if state != CLAIMED or claimer != pid or dseq != seq:
            return  # already reclaimed (e.g. the sender saw us as dead); nothing to do
        _U32.pack_into(mm, d, RELEASED)
        head, tail = _QQ.unpack_from(mm, _A_REL_HEAD)
        n_desc = self._n_desc
        if not tail <= head < tail + n_desc or head >= _RING_LIMIT:
            # Not a ring a receiver can push on: leave the descriptor RELEASED; the
            # sender takes it back when it finds the ring corrupted (``_resync_ring``)
            # or misses it on the ring (``reclaim_abandoned``).
            self._corrupt(f"released ring has head {head} and tail {tail} for {n_desc} descriptors")
        else:
            _U32.pack_into(mm, self._rel_offset + 4 * (head % n_desc), idx)
            _U64.pack_into(mm, _A_REL_HEAD, head + 1)
        if mm[_A_WAITING]:  # the flag is 0 or 1: its low byte says it
            self._notify_sender()

    def _notify_sender(self) -> None:
        if _U32.unpack_from(self.mm, _A_WAITING)[0]:
            _U32.pack_into(self.mm, _A_WAITING, 0)
            if self.sem is not None:
                self.sem.release()

    def open_overflow(self, otoken: bytes) -> mmap.mmap:
        """Map the overflow segment of a claimed descriptor and unlink its name (the
        mapping keeps the memory; nothing is left in /dev/shm once the views die)."""
        name = overflow_name(self.prefix, self.pid, otoken.rstrip(b"\0").decode("ascii"))
        mm = open_segment(name)
        unlink_segment(name)
        return mm


def _index_add(index: dict[str, list[Any]], key: str, ref: tuple[Any, int, int]) -> None:
    refs = index.get(key)
    if refs is None:
        index[key] = [ref]
    else:
        refs.append(ref)


_DESC_HEAD = struct.Struct("<IIQ")
_DESC_SCAN = struct.Struct("<I4xQ24xH")  # state, seq, key length
_U16 = struct.Struct("<H")
_QQ = struct.Struct("<QQ")
