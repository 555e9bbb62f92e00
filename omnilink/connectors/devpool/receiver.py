"""``PoolReceiver``: the receiver's end of a device pool (see the package docstring)."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from typing import Any

from omnilink._errors import BlobDecodeError, ClosedError, ConfigurationError, PeerLostError, TransportError
from omnilink._util import PeerWatch, timed_out
from omnilink.blob import MAX_TREE_DEPTH, MAX_TREE_ITEMS, _contiguous_strides, encoded_size
from omnilink.connectors.devpool.blocks import ALIGN, round_up
from omnilink.connectors.devpool.directory import (
    ACK_GEN,
    CLEAN_GEN,
    COPY_FAILED,
    EVENTS_GEN,
    GEN,
    GROW_ACK,
    GROW_ALLOC_FAILED,
    GROW_BYTES,
    GROW_ERR,
    GROW_NO_ENTRY,
    GROW_OK,
    GROW_PAST_BOUND,
    GROW_REQ,
    HELD_BYTES,
    LANDS,
    MAX_SEGMENTS,
    POOL_NOW,
    RING_HEAD,
    SENDER_PID,
    SNAP_HEAD,
    STATE,
    SEG_GEN,
    SEG_LIVE,
    SEG_MASK,
    SEG_NONE,
    SEG_RETIRING,
    SEG_SHIFT,
    STATE_CLOSED,
    WANT_GEN,
    Directory,
    find_directories,
)
from omnilink.connectors.devpool.lane import LANE_RECORD, LANE_SLOTS, LaneReader
from omnilink.connectors.devpool.manifest import (
    INT64_MAX,
    ITEMSIZE,
    MAX_NDIM,
    MAX_TENSORS,
    BadPath,
    dtypes,
    place,
)
from omnilink.connectors.devpool.process import LOCAL_EVENTS, LOCAL_POOLS, local_lock, start_heartbeat
from omnilink.connectors.shmem import HostLock, pid_alive, read_prefix, unlink_segment

__all__ = ["PoolReceiver"]

logger = logging.getLogger(__name__)

#: Seconds between looks for a new sender asking what this receiver holds.
ANSWER_EVERY_S = 0.02
#: Seconds a reader waits at least for the sender to queue the copy of a message it
#: claimed (the sender publishes first and queues the copy right after; only a sender
#: stuck while alive takes this long: a dead one is noticed at once).
RECORD_GRACE_S = 10.0
#: How many looks (``sched_yield`` between them) a reader takes for the size its sender
#: stores after recording the copy before it computes the size itself: the sender
#: stores it microseconds after the record the reader waited for.
SIZE_LOOKS = 200
#: Blocks of the last landings ``prebuild`` looks at, and the longest cycle of blocks it
#: finds in them.
PREDICT_FROM = 18
#: Whether ``prebuild`` makes views ahead (off: every landing makes its own).
PREBUILD = True
PREDICT_PERIOD = 8
#: Most ``(block, bytes) -> next block`` successions ``prebuild`` remembers (forgotten
#: all at once past it).
SUCCESSORS_KEPT = 256
#: Looks at a slot's ``rec_seq`` between two checks of the sender's liveness while a
#: reader waits for the sender to queue its copy.
RECORD_LOOKS = 16
#: Valid tensor lists ``parse`` remembers (a sender's few layouts, sent in turn).
PARSED_KEPT = 4
#: Seconds a grown segment stays without a block this receiver holds before it is
#: given back (``PoolReceiver.idle_s``).
IDLE_S = 2.0


class _Finalizer:
    """What the pool needs of ``weakref.finalize``, at a fifth of its cost per landing:
    ``fn(*args)`` once, when ``obj`` dies or when called, whichever comes first
    (``alive`` until then). The pool keeps it (``by_key``) until it has run: a weakref
    whose owner is gone never calls back."""

    __slots__ = ("_ref", "_call")

    def __init__(self, obj: Any, fn: Any, *args: Any) -> None:
        self._call = [(fn, args)]
        self._ref = weakref.ref(obj, self._fire)

    def _fire(self, _ref: Any) -> None:
        self()

    @property
    def alive(self) -> bool:
        return bool(self._call)

    def __call__(self) -> Any:
        try:
            fn, args = self._call.pop()  # once, whichever thread comes first
        except IndexError:
            return None
        return fn(*args)


def _is_int(x: Any, lo: int = 0, hi: int = INT64_MAX) -> bool:
    return type(x) is int and lo <= x <= hi


def next_block(blocks: Any) -> int | None:
    """The block the next payload most likely takes, from the blocks of the last ones
    (oldest first): the sender's allocator, given the same sizes and the same pattern of
    frees, hands out the same blocks in the same order, so the last ones repeat with some
    period ``p`` (2 when each payload is dropped before the next get, ``k + 1`` when the
    consumer keeps ``k``); the shortest ``p`` up to ``PREDICT_PERIOD`` under which the
    last ``2p`` blocks repeat says the next is the one ``p`` payloads ago. ``None`` when
    none does."""
    n = len(blocks)
    for p in range(1, min(PREDICT_PERIOD, n // 2) + 1):
        if all(blocks[n - 1 - i] == blocks[n - 1 - i - p] for i in range(p)):
            return blocks[n - p]
    return None


class _Pool:
    """The receiver's pool: its memory, its directory, and the blocks live views hold.

    Shared by the leases of one receiver; it holds only what a free takes (not the
    receiver), so views may outlive ``close()``: the pool memory is freed when the
    receiver is closed and the last view is gone, whichever comes last.
    """

    def __init__(self, ops: Any, directory: Directory, index: int, ptr: int, nbytes: int) -> None:
        self.ops = ops
        self.dir = directory
        self.index = index
        self.ptr = ptr
        self.nbytes = nbytes
        #: ``(pointer, bytes)`` of each live segment by index (``None``: no such segment);
        #: entries are replaced whole, so a landing reads one without the lock
        self.segs: list[tuple[int, int] | None] = [None] * MAX_SEGMENTS
        self.segs[0] = (ptr, nbytes)
        #: per segment: since when no block of it is held; the segment generation at
        #: which it was marked retiring
        self.idle_since = [0.0] * MAX_SEGMENTS
        self.retire_gen = [0] * MAX_SEGMENTS
        # Reentrant: a lease may die (and its finalizer run) in a thread that holds it.
        self.lock = threading.RLock()
        #: offset -> length of blocks this process holds (views alive, or their last
        #: reader's stream not yet past them)
        self.held: dict[int, int] = {}
        self.by_key: dict[str, list[Any]] = {}
        #: bytes of ``held``, published in the directory (the sender grows the pool
        #: only for blocks the receiver holds, not for payloads nobody has read yet)
        self.held_bytes = 0
        self.closed = False
        self.freed = False

    def track(self, lease: Any, key: str, offset: int, length: int) -> Any:
        fin = _Finalizer(lease, self.release, key, offset, length)
        with self.lock:
            self.held[offset] = length
            self.by_key.setdefault(key, []).append(fin)  # (keeps it, and its weakref, alive)
        return fin

    def hold(self, offset: int, length: int) -> None:
        with self.lock:
            if offset not in self.held:
                self.held_bytes += length
                if not self.closed:
                    self.dir.set(HELD_BYTES, self.held_bytes)
            self.held[offset] = length

    def release(self, key: str | None, offset: int, length: int) -> None:
        """The last view of a block died (or ``release(key)``): hand it back once the
        work queued on this thread's stream (its last reader) is past it."""
        if key is not None:
            with self.lock:
                fins = self.by_key.get(key)
                if fins is not None:
                    fins[:] = [f for f in fins if f.alive]
                    if not fins:
                        del self.by_key[key]
        try:
            self.ops.after_use(self.index, lambda: self.push(offset, length))
        except Exception:  # pragma: no cover - interpreter teardown
            logger.debug("cuda_ipc: deferred free failed; freeing now", exc_info=True)
            self.push(offset, length)

    def push(self, offset: int, length: int) -> None:
        with self.lock:
            popped = self.held.pop(offset, None)
            if popped is None:
                return
            self.held_bytes -= popped
            if not self.closed:
                self.dir.set(HELD_BYTES, self.held_bytes)  # before the free: never too low
                if not self.dir.push_free(offset, length):  # pragma: no cover - bounded by the sender
                    logger.error("cuda_ipc: released ring full; block at %d lost until the sender restarts", offset)
            elif not self.held:
                self._free_locked()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            if not self.held:
                self._free_locked()

    def bytes_now(self) -> int:
        return sum(seg[1] for seg in self.segs if seg is not None)

    def _free_locked(self) -> None:
        if self.freed:
            return
        self.freed = True
        for i, seg in enumerate(self.segs):
            if seg is None:
                continue
            self.segs[i] = None
            try:
                self.ops.free_pool(self.index, seg[0])
            except Exception:  # pragma: no cover - driver teardown
                logger.warning("cuda_ipc: freeing the device pool failed", exc_info=True)
        self.dir.close()


class PoolReceiver:
    """The receiver's end of a device pool on ``channel``: allocates the pool on
    ``device`` (through ``ops``), exports it once through its directory, and turns
    messages of the pool's sender into views of it.

    Parameters
    ----------
    ops : CudaDeviceOps
        The device operations (or a test double of them).
    channel : str
        The channel the pool serves (its directory's name derives from it).
    device : str or torch.device, optional
        The pool's device (default: the current CUDA device).
    pool_bytes, event_slots, max_blocks : int
        Size of the pool (rounded up to 256 bytes), interprocess events the sender
        creates, most blocks out at once (the released ring's size). Checked by the
        caller.
    pool_max_bytes : int, optional
        The most bytes the pool may grow to, all segments together (``None``: the
        pool's size plus three quarters of the device memory free once it is
        allocated; never less than ``pool_bytes``).

    Raises
    ------
    ConfigurationError
        The channel already has a live receiver.
    CudaError
        The pool could not be allocated or exported.
    """

    def __init__(self, ops: Any, channel: str, *, device: Any, pool_bytes: int, event_slots: int,
                 max_blocks: int, pool_max_bytes: int | None = None) -> None:
        self.ops = ops
        self.channel = channel
        self._prefix = read_prefix()
        self._pid = os.getpid()
        #: the sender's liveness, looked up on every landing (a pidfd poll)
        self._peers = PeerWatch()
        #: (gen, events, opened) of the sender generation whose events are open
        self._events: tuple[int, list[Any], bool] | None = None
        self._events_lock = threading.Lock()
        #: (tensor entries, their end, parsed) of the last few valid manifests
        #: (``parse``; ``PARSED_KEPT``, most recently used first)
        self._recent: list[tuple[list[Any], int, list[Any]]] = []
        #: whether this receiver's gets land payloads on its device (``set_landing``)
        self.landing = False
        #: the blocks of the last payloads landed, and the last one's (block bytes,
        #: parsed tensors): what ``prebuild`` predicts the next block from
        self._blocks: collections.deque[int] = collections.deque(maxlen=PREDICT_FROM)
        self._layout: tuple[int, list[Any]] | None = None
        #: ``(block, bytes) -> block`` of the landing that followed it last time: a
        #: stage's payloads come in phases of layouts (prefill chunks, then decode
        #: ones), and each phase takes the same blocks in the same order as the last
        #: one did, where no period has settled yet
        self._successor: dict[tuple[int, int], int] = {}
        #: views ``prebuild`` made of the block it expects next: ``(block, bytes, parsed
        #: tensors, segment pointer, lease, views)``, taken by the landing that finds them
        self._pre: tuple[Any, ...] | None = None
        #: landings that found their views made (``prebuild``)
        self.prebuilt_hits = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pool: _Pool | None = None
        try:
            self._open_pool(device, round_up(pool_bytes), event_slots, max_blocks, pool_max_bytes)
        except BaseException:
            self._peers.close()
            raise

    def _open_pool(self, device: Any, pool_bytes: int, event_slots: int, max_blocks: int,
                   pool_max_bytes: int | None) -> None:
        ops = self.ops
        index = ops.device_index(device)
        with HostLock():
            for pid, name in find_directories(self._prefix, self.channel):
                if pid_alive(pid):
                    raise ConfigurationError(
                        f"cuda_ipc: channel {self.channel!r} already has a receiver (pid {pid}); "
                        "one receiver per channel"
                    )
                unlink_segment(name)
            ptr, handle = ops.alloc_pool(index, pool_bytes)
            try:
                if pool_max_bytes is None:
                    pool_max_bytes = pool_bytes + ops.free_bytes(index) * 3 // 4
                bound = max(round_up(pool_max_bytes), pool_bytes)
                d = Directory.create(self._prefix, self.channel, device=index, uuid=ops.device_uuid(index),
                                     pool_bytes=pool_bytes, nslots=event_slots, ring_cap=max_blocks,
                                     mem_handle=handle, pool_max=bound, lane_slots=LANE_SLOTS,
                                     lane_record=LANE_RECORD)
            except BaseException:
                ops.free_pool(index, ptr)
                raise
        with local_lock:
            LOCAL_POOLS[(d.name, 0)] = ptr
        self.pool = _Pool(ops, d, index, ptr, pool_bytes)
        #: the receiving end of the pool's lane (its transport reads it)
        self.lane = LaneReader(d)
        self.pool_max_bytes = bound
        #: seconds a grown segment stays unheld before it is given back
        self.idle_s = IDLE_S
        self._thread = start_heartbeat(self, self._stop, f"omnilink-cuda-ipc-rx-{self.channel}", ANSWER_EVERY_S,
                                       "_beat")

    @property
    def index(self) -> int | None:
        """The CUDA device index of the pool (``None`` once closed)."""
        pool = self.pool
        return None if pool is None else pool.index

    def _open(self) -> _Pool:
        pool = self.pool
        if pool is None:
            raise ClosedError(f"cuda_ipc connector on channel {self.channel!r} is closed")
        return pool

    def _beat(self) -> None:
        self._answer_attach()
        self._answer_grow()
        self._retire_idle()

    def _retire_idle(self) -> None:
        """Give back grown segments idle for ``idle_s``: mark one retiring (the sender
        allocates there no more, and unmaps it once it has no block there: its
        ``released`` flag), then free it once released (or its sender died). Segment 0
        stays. Runs on the receiver's heartbeat thread."""
        pool = self.pool
        if pool is None or all(seg is None for seg in pool.segs[1:]):
            return
        d = pool.dir
        now = time.monotonic()
        sp = d.get(SENDER_PID)
        sender_dead = sp != 0 and sp != self._pid and not pid_alive(sp)
        freed = []
        with pool.lock:
            busy = {addr >> SEG_SHIFT for addr in pool.held}
            for i in range(1, MAX_SEGMENTS):
                seg = pool.segs[i]
                if seg is None:
                    continue
                if i in busy:
                    pool.idle_since[i] = now
                    continue
                state = d.segment(i)[0]
                if state == SEG_LIVE:
                    if now - pool.idle_since[i] >= self.idle_s:
                        # The generation before the bump: any the sender reads once it
                        # has seen the state is at least this.
                        g0 = d.get(SEG_GEN)
                        pool.retire_gen[i] = g0
                        d.set_segment(i, SEG_RETIRING, seg[1])
                        d.set(SEG_GEN, g0 + 1)
                elif d.released(i) >= pool.retire_gen[i] or sender_dead:
                    pool.segs[i] = None
                    d.set_segment(i, SEG_NONE)
                    d.set(POOL_NOW, pool.bytes_now())
                    d.set(SEG_GEN, d.get(SEG_GEN) + 1)
                    with local_lock:
                        LOCAL_POOLS.pop((d.name, i), None)
                    freed.append((i, seg))
        for i, (ptr, nbytes) in freed:
            try:
                self.ops.free_pool(pool.index, ptr)
            except Exception:  # pragma: no cover - driver teardown
                logger.warning("cuda_ipc: freeing segment %d of the device pool failed", i, exc_info=True)
            logger.info("cuda_ipc: device pool of channel %r gave back segment %d (%d bytes; %d bytes now)",
                        self.channel, i, nbytes, pool.bytes_now())

    def _answer_grow(self) -> None:
        """The sender asked for a new segment (``grow request`` ahead of ``grow
        answered``): allocate it within the bound and publish it in the segment table,
        or say why not; runs on the receiver's heartbeat thread."""
        pool = self.pool
        if pool is None:
            return
        d = pool.dir
        req = d.get(GROW_REQ)
        if req == d.get(GROW_ACK):
            return
        want = round_up(max(d.get(GROW_BYTES), 1))
        now = pool.bytes_now()
        err = GROW_OK
        free = [i for i in range(1, MAX_SEGMENTS) if pool.segs[i] is None]
        if now + want > self.pool_max_bytes or want > SEG_MASK:
            err = GROW_PAST_BOUND
        elif not free:
            err = GROW_NO_ENTRY
        else:
            i = free[0]
            try:
                ptr, handle = self.ops.alloc_pool(pool.index, want)
            except Exception as exc:
                logger.warning("cuda_ipc: growing the device pool of channel %r by %d bytes failed: %s",
                               self.channel, want, exc)
                err = GROW_ALLOC_FAILED
            else:
                with local_lock:
                    LOCAL_POOLS[(d.name, i)] = ptr
                with pool.lock:
                    pool.segs[i] = (ptr, want)
                    pool.idle_since[i] = time.monotonic()
                d.set_segment(i, SEG_LIVE, want, handle)
                d.set(POOL_NOW, now + want)
                d.set(SEG_GEN, d.get(SEG_GEN) + 1)
                logger.info("cuda_ipc: device pool of channel %r grew by %d bytes (segment %d, %d bytes now)",
                            self.channel, want, i, now + want)
        d.set(GROW_ERR, err)
        d.set(GROW_ACK, req)  # last: the answer is complete

    def _answer_attach(self) -> None:
        """A new sender asked what this receiver still holds (its allocator starts from
        that); runs on the receiver's heartbeat thread."""
        pool = self.pool
        if pool is None:
            return
        d = pool.dir
        want = d.get(WANT_GEN)
        if want == d.get(ACK_GEN):
            return
        with pool.lock:
            d.write_held(sorted(pool.held.items()))
            d.set(SNAP_HEAD, d.get(RING_HEAD))
        d.set(ACK_GEN, want)

    @property
    def parsed(self) -> tuple[list[Any], int, list[Any]] | None:
        """``(tensor entries, their end, parsed)`` of the valid manifest ``parse`` used
        last (``None``: none yet)."""
        return self._recent[0] if self._recent else None

    def _slot_events(self, gen: int) -> list[Any]:
        cached = self._events  # (replaced whole: read without the lock while it holds)
        if cached is not None and cached[0] == gen and self.pool is not None:
            return cached[1]
        pool = self._open()
        with self._events_lock:
            cached = self._events
            if cached is not None and cached[0] == gen:
                return cached[1]
            if cached is not None and cached[2]:
                self.ops.destroy_events(pool.index, cached[1])
            self._events = None
            d = pool.dir
            if d.get(EVENTS_GEN) != gen:
                raise PeerLostError(f"cuda_ipc: the sender on channel {self.channel!r} has not published "
                                    "its events")
            with local_lock:
                local = LOCAL_EVENTS.get((d.name, gen))
            if local is not None:
                events, opened = local, False
            else:
                events = self.ops.open_events(pool.index, [d.slot_handle(i) for i in range(d.nslots)])
                opened = True
            self._events = (gen, events, opened)
            return events

    def parse(self, key: str, m: Any) -> tuple[int, int, int, int, int, list[tuple[Any, ...]]]:
        """Validate a manifest before anything of it is used (a hostile sender cannot
        make the receiver read outside its pool or build a view that lies about its size).

        ``m`` is ``[gen, seq, slot, block, total, tensors]`` (or with a seventh item
        ``1``: every tensor of the payload is in the block), each tensor ``[dtype code,
        offset in block, nbytes, shape, path]``, or with a sixth item ``1`` for a host
        tensor the sender carried in the block. Returns ``(gen, seq, slot, block, total,
        tensors)``, each tensor ``(dtype, offset, nbytes, shape, contiguous strides,
        offset in elements, path, host)``. The tensor list of the last valid manifest is
        remembered: a stream of same-shaped payloads checks only its extent again.

        Raises
        ------
        BlobDecodeError
            The manifest is malformed or names anything outside the pool.
        ClosedError
            The receiver was closed.
        """
        pool = self._open()

        def bad(why: str) -> BlobDecodeError:
            return BlobDecodeError(f"cuda_ipc: key {key!r}: invalid device manifest: {why}")

        is_int = _is_int
        if type(m) is not list or not 6 <= len(m) <= 7:
            raise bad("not [generation, sequence, slot, block, size, tensors(, all in block)]")
        gen, seq, slot, block, total, entries = m[:6]
        if len(m) == 7 and (type(m[6]) is not int or m[6] != 1):
            raise bad(f"the all-in-block mark {m[6]!r} is not 1")
        if not (is_int(gen, 1) and is_int(seq, 1) and is_int(slot, 0, pool.dir.nslots - 1)):
            raise bad("generation, sequence or event slot out of range")
        if not (is_int(block) and is_int(total, 1) and block % ALIGN == 0):
            raise bad(f"block [{block!r}, +{total!r}) is not an aligned block of the pool")
        seg_index = block >> SEG_SHIFT
        seg = pool.segs[seg_index] if seg_index < MAX_SEGMENTS else None
        if seg is None or (block & SEG_MASK) + total > seg[1]:
            raise bad(f"block [{block!r}, +{total!r}) (segment {seg_index}, offset {block & SEG_MASK}) is not "
                      "inside a live segment of the pool")
        if total % ALIGN:
            raise bad(f"block size {total} is not a multiple of {ALIGN}")
        if type(entries) is not list or not 1 <= len(entries) <= MAX_TENSORS:
            raise bad("tensor list missing or too long")
        recent = self._recent
        last = None
        for i, r in enumerate(recent):  # (a sender sends a few layouts in turn: its send plans)
            if entries == r[0]:
                last = r
                if i:
                    recent.insert(0, recent.pop(i))  # most recently used first
                break
        if last is not None:
            # The tensors of the last valid manifest (a stream repeats them): only their
            # extent against this block's size is new. ``==`` may also match floats or
            # bools equal to those ints; what is used is the validated copy.
            if last[1] > total:
                raise bad(f"tensors end at {last[1]}, past the block's {total} bytes")
            return gen, seq, slot, block, total, last[2]
        _, by_code = dtypes()
        out = []
        end = 0
        for i, e in enumerate(entries):
            if type(e) is not list or not 5 <= len(e) <= 6:
                raise bad(f"tensor {i} is not [dtype, offset, nbytes, shape, path(, host)]")
            code, off, nbytes, shape, path = e[:5]
            hosted = len(e) == 6
            if hosted and (type(e[5]) is not int or e[5] != 1):
                raise bad(f"tensor {i}: host mark {e[5]!r} is not 1")
            dt = by_code.get(code) if type(code) is int else None
            if dt is None:
                raise bad(f"tensor {i}: unknown dtype code {code!r}")
            if type(shape) is not list or len(shape) > MAX_NDIM or not all(is_int(x) for x in shape):
                raise bad(f"tensor {i}: shape {shape!r} is not a list of at most {MAX_NDIM} dims >= 0")
            if (type(path) is not list or len(path) > MAX_TREE_DEPTH
                    or not all(type(x) is str or is_int(x, 0, MAX_TREE_ITEMS) for x in path)):
                raise bad(f"tensor {i}: path {path!r} is not a list of at most {MAX_TREE_DEPTH} keys or indices")
            if not (is_int(off) and is_int(nbytes) and off + nbytes <= total):
                raise bad(f"tensor {i}: region [{off!r}, +{nbytes!r}) is not inside the block")
            shape = tuple(shape)
            itemsize = ITEMSIZE[code]
            numel = 1
            # Bytes the non-zero dims address: every contiguous stride is a product of
            # later dims (a 0 counts as 1) and every extent stride * (dim - 1), so all
            # of them fit in int64 when this does, and torch counts numel over these
            # dims before any 0 can zero it. An empty tensor with a 2**40 x 2**40 rest
            # would otherwise reach as_strided (TypeError, or numel overflow).
            span = itemsize
            for x in shape:
                numel *= x
                if x:
                    span *= x
            if span > INT64_MAX:
                raise bad(f"tensor {i}: shape {shape} overflows int64 (its non-zero dims "
                          f"times itemsize {itemsize} exceed 2**63 - 1 bytes)")
            if numel * itemsize != nbytes:
                raise bad(f"tensor {i}: {nbytes} bytes for shape {shape} of {dt}")
            if off % itemsize:
                raise bad(f"tensor {i}: offset {off} not aligned to its dtype")
            out.append((dt, off, nbytes, shape, _contiguous_strides(shape), off // itemsize, tuple(path), hosted))
            end = max(end, off + nbytes)
        if len(out) > 1 and any(not t[6] for t in out):
            raise bad("the payload itself is a tensor, yet the manifest names more than one")
        recent.insert(0, (entries, end, out))
        del recent[PARSED_KEPT:]
        return gen, seq, slot, block, total, out

    def land(self, key: str, obj: Any, *, to_host: bool = False, deadline: Any = None,
             pooled: list[Any] | None = None, sized: bool = True) -> Any:
        """The payload of a message the pool's sender made (``PoolSender.send``),
        received under ``key``: views of the pool put where the manifest's paths say, the
        current stream ordered after the sender's copy (host not blocked). ``to_host``:
        the host tensors the sender carried in the block come back as host tensors
        (copied after the stream's wait), as they were sent; otherwise they stay views
        of the pool like the device tensors. ``pooled``: a list of two whose first item is
        set to whether every tensor of the payload is a view of the pool (the sender's
        mark; not with ``to_host``), so that a caller landing on the pool's device has
        nothing left to move, and whose second to the payload's tensor_blob size (not
        looked for when the message left it to the slot and ``sized`` is false: -1).

        Raises
        ------
        BlobDecodeError
            ``obj`` is not such a message, or its manifest is invalid.
        PeerLostError
            The sender died before its copy could be confirmed.
        ClosedError
            The receiver was closed.
        """
        if type(obj) is not dict or len(obj) != 3 or type(obj.get("n")) is not int or "d" not in obj or "h" not in obj:
            raise BlobDecodeError(f"cuda_ipc: key {key!r}: not a cuda_ipc message")
        m, out, n = obj["d"], obj["h"], obj["n"]
        if n < 0 and (n != -1 or m is None):
            raise BlobDecodeError(f"cuda_ipc: key {key!r}: invalid payload size {n}")
        if m is None:
            if pooled is not None:
                pooled[1] = n
            return out
        pool = self._open()
        gen, seq, slot, blk, total, entries = self.parse(key, m)
        blocks, last = self._blocks, self._layout
        if blocks and last is not None and last[0] == total:  # (prebuild makes the last layout's)
            follows = self._successor
            if len(follows) >= SUCCESSORS_KEPT:
                follows.clear()
            follows[(blocks[-1], total)] = blk
        blocks.append(blk)
        self._layout = (total, entries)
        if pooled is not None:
            pooled[0] = len(m) == 7 and not to_host
        pool.hold(blk, total)
        try:
            # Held now: its segment cannot be given back meanwhile; check it again (it may
            # have gone between ``parse`` and ``hold``).
            seg = pool.segs[blk >> SEG_SHIFT]
            if seg is None or (blk & SEG_MASK) + total > seg[1]:
                raise BlobDecodeError(f"cuda_ipc: key {key!r}: its pool segment is gone")
            pre, self._pre = self._pre, None
            if pre is not None and pre[0] == blk and pre[1] == total and pre[2] is entries and pre[3] == seg[0]:
                lease, views = pre[4], pre[5]  # made while this receiver waited (``prebuild``)
                self.prebuilt_hits += 1
            else:
                lease, views = self._views(seg[0] + (blk & SEG_MASK), total, pool.index, entries)
            del pre
            fin = pool.track(lease, key, blk, total)
            del lease
        except BaseException:
            views = []
            pool.release(None, blk, total)
            raise
        try:
            ordered = to_host and any(e[7] for e in entries)
            if ordered:
                # The host copies read the block after the stream's wait for the sender's copy.
                self._order_after_copy(key, pool, gen, seq, slot, deadline)
                convert = self.ops.to_host
                views = [convert(v) if e[7] else v for e, v in zip(entries, views)]
            try:
                for (*_, path, _), v in zip(entries, views):
                    if not path:
                        if out is not None:
                            raise BadPath
                        out = v
                    else:
                        out = place(out, path, 0, v)
            except BadPath:
                raise BlobDecodeError(f"cuda_ipc: key {key!r}: a manifest path does not lead to a free "
                                      "place of the payload") from None
            finally:
                del views
            if not ordered:
                self._order_after_copy(key, pool, gen, seq, slot, deadline)
            if pooled is not None:
                pooled[1] = n if n >= 0 or not sized else self._recorded_size(pool.dir, seq, slot, out)
        except BaseException:
            out = None
            fin()  # no view was handed out: free the block now (after this stream)
            raise
        return out

    def _views(self, ptr: int, total: int, index: int, entries: list[Any]) -> tuple[Any, list[Any]]:
        """The lease of the block ``[ptr, ptr + total)`` of device ``index`` (its death
        means no view is left) and a view of it per parsed tensor of ``entries``."""
        base, lease = self.ops.view(ptr, total, index)
        views = []
        typed: dict[Any, Any] = {}
        for dt, off, nbytes, shape, stride, first, path, _ in entries:
            # One view of the block per dtype, one as_strided per tensor (a slice and
            # two views per tensor cost twice as much).
            tv = typed.get(dt)
            if tv is None:
                t = base.view(dt)  # the block's size is a multiple of ALIGN (parse)
                tv = typed[dt] = (t, t.storage_offset())
            views.append(tv[0].as_strided(shape, stride, tv[1] + first))
        return lease, views

    def prebuild(self) -> bool:
        """While this receiver waits for a payload: make the views of the block the next
        one will most likely take (the one that followed the last one's block the last
        time it was landed in that layout, else ``next_block`` of the last ones; the last
        one's layout), so that a landing that finds its block and layout made only puts
        them in place (a stream of same-shaped payloads: the views were half of a
        landing's time on an H200). Nothing is held or tracked until a landing takes
        them; views of a block the next payload does not take are dropped. Whether it
        made any; never raises (a speculative step: the landing makes its own views)."""
        pool = self.pool
        layout = self._layout
        if not PREBUILD or self._pre is not None or pool is None or layout is None or pool.closed:
            return False
        total, entries = layout
        blocks = self._blocks
        if not blocks:
            return False
        for blk in (self._successor.get((blocks[-1], total)), next_block(blocks)):
            if blk is None or blk in pool.held:
                continue
            seg = pool.segs[blk >> SEG_SHIFT]
            if seg is None or (blk & SEG_MASK) + total > seg[1]:
                continue  # (a segment given back since)
            try:
                lease, views = self._views(seg[0] + (blk & SEG_MASK), total, pool.index, entries)
            except Exception:  # pragma: no cover - a device error: the landing meets it itself
                logger.debug("cuda_ipc: making views ahead failed", exc_info=True)
                return False
            self._pre = (blk, total, entries, seg[0], lease, views)
            return True
        return False

    def _order_after_copy(self, key: str, pool: Any, gen: int, seq: int, slot: int, deadline: Any) -> None:
        """Order the current stream after the sender's copy of sequence ``seq`` (once it
        is recorded: ``_wait_event``) and let the sender record the slot again."""
        d = pool.dir
        ev = self._wait_event(key, d, gen, seq, slot, deadline)
        if ev is not None:
            self.ops.wait(pool.index, ev)
            if seq > d.done_seq(slot):  # the wait is queued: the sender may record the slot again
                d.set_done_seq(slot, seq)

    @staticmethod
    def _recorded_size(d: Any, seq: int, slot: int, out: Any) -> int:
        """The tensor_blob size of the payload ``out`` of sequence ``seq`` whose message
        said ``-1``: the one its sender stores in the slot's ``rec_size`` right after
        recording the copy (``PoolSender.send``), looked for while ``SIZE_LOOKS`` last,
        else (the slot recorded again since, or the sender late or gone) computed here."""
        for _ in range(SIZE_LOOKS):
            n = d.rec_size(slot, seq)
            if n >= 0:
                return n
            if d.rec_seq(slot) != seq:  # recorded again (its size with it) or failed
                break
            os.sched_yield()
        return encoded_size(out)

    def _wait_event(self, key: str, d: Any, gen: int, seq: int, slot: int, deadline: Any = None) -> Any:
        """The event of ``slot`` that a reader of sequence ``seq`` waits for, once the
        sender has recorded it (it publishes first), or ``None`` when the sender's close
        already waited for every copy of ``gen``.

        Raises
        ------
        PeerLostError
            The sender died before its copy could be confirmed.
        TransportError
            The sender could not queue the copy (``COPY_FAILED``).
        TransferTimeout
            The copy was not queued within ``RECORD_GRACE_S`` (or before ``deadline``,
            if that is later) while the sender lived on.

        The message is claimed already (consumed): a get that cannot wait any more (a
        ``get_nowait``, a deadline just past) still waits the moment the sender needs
        to queue the copy, which it does right after publishing, rather than lose it.
        """
        if d.get(CLEAN_GEN) == gen:
            return None
        rounds = 0
        grace = RECORD_GRACE_S
        if deadline is not None:
            left = deadline.remaining()
            grace = None if left is None else max(grace, left)
        until = None if grace is None else time.monotonic() + grace
        rec_seq = d.rec_seq
        while True:
            # The sender publishes a message before it queues its copy, then stores the
            # sequence in the slot's ``rec_seq``: that store (or a later one) means the
            # event follows this copy. Looked at alone while the sender queues its copy
            # (a few microseconds: each look at its liveness between would delay seeing
            # the store by as much); then, or every ``RECORD_LOOKS`` looks, the full
            # round. Read before the sender's liveness: a sender that gave the pool up
            # after a failed copy marked the slot first.
            for _ in range(RECORD_LOOKS):
                rec = rec_seq(slot)
                if rec >= seq:
                    break
            if rec & COPY_FAILED and rec & ~COPY_FAILED == seq:
                raise TransportError(f"cuda_ipc: the sender could not copy key {key!r} on channel "
                                     f"{self.channel!r} into the pool; the payload is lost")
            sp = d.get(SENDER_PID)
            if d.get(GEN) != gen or (sp != self._pid and (sp == 0 or not self._peers.alive(sp))):
                raise PeerLostError(
                    f"cuda_ipc: the sender that put key {key!r} on channel {self.channel!r} died before "
                    "its device copy could be confirmed; the payload is lost"
                )
            if not rec & COPY_FAILED and rec >= seq:
                return self._slot_events(gen)[slot]
            rounds += 1
            if until is not None and rounds > 2000 and time.monotonic() > until:
                raise timed_out("cuda_ipc", self.channel, "get (waiting for the sender to queue its copy)", key,
                                "the sender", grace)
            if rounds < 2000:
                os.sched_yield()  # queued within microseconds of the message: spin
            else:
                time.sleep(0.0001)

    def set_landing(self, on: bool) -> None:
        """Tell the sender whether this receiver's gets land payloads on its device
        (it may then carry small host tensors in the pool block)."""
        pool = self.pool
        if pool is not None:
            pool.dir.set(LANDS, 1 if on else 0)
        self.landing = on

    def drop(self, key: str, obj: Any) -> None:
        """A message of the pool's sender, received under ``key``, discarded unread: its
        block goes back (nothing viewed it)."""
        m = obj.get("d") if isinstance(obj, dict) else None
        pool = self.pool
        if m is not None and pool is not None:
            try:
                gen, seq, slot, blk, total, _ = self.parse(key, m)
            except BlobDecodeError:
                logger.warning("cuda_ipc: discarded key %r carried an invalid manifest", key)
                return
            pool.hold(blk, total)
            if pool.dir.get(GEN) == gen and seq > pool.dir.done_seq(slot):
                pool.dir.set_done_seq(slot, seq)
            pool.push(blk, total)  # never viewed: no reader to wait for

    def release(self, key: str) -> bool:
        """Hand the pool blocks of the payload received under ``key`` back now (its
        views must not be used afterwards); whether any was still held."""
        pool = self.pool
        if pool is None:
            return False
        with pool.lock:
            fins = pool.by_key.pop(key, [])
        done = False
        for fin in fins:
            if fin.alive:
                fin()
                done = True
        return done

    def in_use(self) -> tuple[int, int]:
        """(blocks, bytes) of the pool this process's views hold."""
        pool = self.pool
        if pool is None:
            return 0, 0
        with pool.lock:
            return len(pool.held), sum(pool.held.values())

    def segments(self) -> tuple[int, int]:
        """(segments, bytes) of the pool now (it grows when its sender asks)."""
        pool = self.pool
        if pool is None:
            return 0, 0
        segs = [seg for seg in pool.segs if seg is not None]
        return len(segs), sum(seg[1] for seg in segs)

    def wake(self) -> None:
        """Stop the heartbeat (``close`` does the rest)."""
        self._stop.set()

    def close(self) -> None:
        """Close the pool to its sender (it raises ``PeerLostError``) and remove the
        directory; the pool memory goes once the last view is gone too. Idempotent."""
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(5)
        self._pre = None  # views made ahead: nothing holds them, nobody will land them
        pool, self.pool = self.pool, None
        if pool is not None:
            d = pool.dir
            d.set(STATE, STATE_CLOSED)
            unlink_segment(d.name)
            with local_lock:
                for i in range(MAX_SEGMENTS):
                    LOCAL_POOLS.pop((d.name, i), None)
            with self._events_lock:
                cached, self._events = self._events, None
            if cached is not None and cached[2]:
                self.ops.destroy_events(pool.index, cached[1])
            pool.close()
        self._peers.close()
