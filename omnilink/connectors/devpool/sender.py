"""``PoolSender``: the sender's end of a device pool (see the package docstring)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import msgspec

from omnilink._errors import (
    BlobEncodeError,
    CapacityError,
    ClosedError,
    ConfigurationError,
    OmnilinkError,
    PeerLostError,
    TransferTimeout,
)
from omnilink._util import Deadline, PeerWatch, plain_tensor, timed_out
from omnilink.blob import MAX_TENSORS, encoded_size
from omnilink.connectors.devpool.blocks import ALIGN, BlockAllocator
from omnilink.connectors.devpool.directory import (
    ACK_GEN,
    CLEAN_GEN,
    COPY_FAILED,
    DEVICE,
    EVENTS_GEN,
    GEN,
    GROW_ACK,
    GROW_ALLOC_FAILED,
    GROW_BYTES,
    GROW_ERR,
    GROW_NO_ENTRY,
    GROW_REQ,
    HELD_BYTES,
    LANDS,
    MAX_SEGMENTS,
    POOL_MAX,
    POOL_NOW,
    RECV_PID,
    RING_HEAD,
    RING_TAIL,
    RELEASED_ALL,
    SEG_GEN,
    SEG_LIVE,
    SEG_MASK,
    SEG_RETIRING,
    SEG_SHIFT,
    SENDER_PID,
    SNAP_HEAD,
    STATE,
    STATE_OPEN,
    WANT_GEN,
    Directory,
    find_directories,
)
from omnilink.connectors.devpool.lane import LANE_RECORD, LaneWriter, NotPlain, encode_host
from omnilink.connectors.devpool.manifest import dtypes, one_device, split, tensor_type
from omnilink.connectors.devpool.plan import compile_plan
from omnilink.connectors.devpool.process import LOCAL_EVENTS, LOCAL_POOLS, LOCAL_SENDERS, local_lock, start_heartbeat
from omnilink.connectors.shmem import HostLock, pid_alive, read_prefix

__all__ = ["PoolSender"]

logger = logging.getLogger(__name__)

#: ``send``'s default ``host_to_pool``, what both transports use: host tensors of at most this
#: many bytes each ride in the pool block with the CUDA tensors (staged in page-locked
#: memory, copied with them) when the receiver lands its payloads on its device; moving
#: them there one by one after the landing cost it more than the rest of the landing (a
#: trace on an H200).
HOST_TO_POOL_BYTES = 64 << 10
#: Page-locked bytes per event slot for those host tensors: every slot's stage is a
#: slice of one buffer of ``event_slots`` x this, taken once; a payload whose host
#: tensors need more stages them in a buffer of its slot's own. 0: a buffer per slot.
STAGE_SLICE_BYTES = 16 << 10
_ENCODE = msgspec.msgpack.Encoder().encode
#: Payloads after which a layout that no send plan could be made for is tried again
#: (its tensors the same, the rest of a payload may have changed: a list gone).
PLAN_RETRY = 64
#: Send plans a sender keeps (most recently used first): a stage that sends a few
#: layouts in turn (a thinker's prefill and decode chunks, the requests of a batch at
#: different steps) keeps one for each instead of compiling them again at each change.
MAX_PLANS = 4
#: Whether a layout whose device tensors all live on one GPU other than the pool's gets
#: a send plan too (its copies peer to peer, ``copy_in_peer``), as one on the pool's
#: device does: a stage on cuda:0 sending to a pool on cuda:1 otherwise walks every
#: payload the general way.
PLAN_PEER = True
#: Whether small host tensors ride in the pool block (``HOST_TO_POOL_BYTES``) with device
#: tensors that live on another GPU than the pool's. ``None``: only under an MPS server.
#: Without one, two processes time-slice the pool's GPU, and on 2x H200 a cuda:0 ->
#: cuda:1 payload with its token ids and flag staged and copied up beside its hidden
#: state reached the receiver about 200 us later at 4 KiB than with them left in the
#: host part (wherever that copy was queued, on either GPU).
HOSTS_ACROSS_GPUS: bool | None = None
#: Planned payloads of at least this many bytes in the block queue their copy before
#: their message is published (the copy starts a lane write and a wake-up earlier; the
#: receiver, woken after, has nothing to wait for but the copy it would wait for anyway);
#: smaller ones publish first (the receiver lands them while the copy is queued).
#: ``None``: always publish first. On 2x H200 with an MPS server (alternated in one
#: process pair, ``benchmarks/gpu/ab_serial.py``), copying first from 16 MiB took
#: ``cuda_ipc`` cuda:0 -> cuda:1 from 862 to 794 us at 256 MiB and from 327 to 273 at
#: 64 MiB, and ``shm`` on one GPU from 225 to 211 us at 256 MiB but from 119 to 130 at
#: 64 MiB: so from 128 MiB.
COPY_FIRST_BYTES: int | None = 128 << 20
#: Seconds between liveness checks of the receiver.
HEARTBEAT_S = 0.25
#: Event slots a put looks at for one already waited on before it takes the next in turn.
SLOT_SCAN = 4
#: Seconds a put waits for room in the pool's segments before it asks the receiver for
#: a new one (shorter than the shm route's wait for room, so the route grows the pool
#: instead of falling back to the host path).
GROW_AFTER_S = 0.001


class _Segment:
    """One segment of the receiver's pool as this sender maps it."""

    __slots__ = ("index", "ptr", "opened", "alloc", "nbytes")

    def __init__(self, index: int, ptr: int, opened: bool, nbytes: int) -> None:
        self.index = index
        self.ptr = ptr
        self.opened = opened
        self.nbytes = nbytes
        self.alloc = BlockAllocator(nbytes)


class _Attachment:
    """A sender's view of one receiver's pool: the mapped memory, its events, the
    allocator, the slots in use."""

    __slots__ = ("dir", "gen", "segs", "live", "retiring", "seg_gen", "refused", "index", "events", "rec", "next_slot",
                 "seq", "sent", "by_block", "receiver_pid", "ring_cap", "lane", "stages", "stage_arena",
                 "plans", "seen", "no_plan", "settled")
    dir: Directory
    gen: int
    #: the mapped segments by index (``None``: not live), and the live ones in order
    segs: list[_Segment | None]
    live: list[_Segment]
    #: mapped segments the receiver is giving back: no new block there; unmapped (and
    #: ``released``) once the last block there is freed
    retiring: list[_Segment]
    #: the directory's segment generation ``segs`` reflects
    seg_gen: int
    #: (segment generation, bytes) of the last growth the receiver refused: no new
    #: request for as much until the segments change
    refused: tuple[int, int, str] | None
    index: int
    events: list[Any]
    rec: list[int]
    next_slot: int
    seq: int
    sent: dict[str, tuple[int, int, int]]
    by_block: dict[int, str]
    receiver_pid: int
    ring_cap: int
    #: the sending end of the pool's lane
    lane: LaneWriter

    def __init__(self) -> None:
        self.sent: dict[str, tuple[int, int, int]] = {}
        self.by_block: dict[int, str] = {}
        self.next_slot = 0
        self.seq = 0
        self.segs = [None] * MAX_SEGMENTS
        self.live = []
        self.retiring = []
        self.seg_gen = -1
        self.refused = None
        #: per event slot: the page-locked buffer its host tensors were staged in (``send``
        #: with ``host_to_pool``), reused once the slot's last copy is done
        self.stages: dict[int, Any] = {}
        #: the page-locked buffer the slots' stages of at most ``STAGE_SLICE_BYTES`` are
        #: slices of (taken at the first payload with host tensors for the block)
        self.stage_arena: Any = None
        #: the send plans this attachment keeps (``devpool.plan``; ``MAX_PLANS``, most
        #: recently used first), and the tensor lists of the last payloads the general
        #: way sent (a plan is compiled for a layout seen twice among them: two in a
        #: row, or two of a few layouts sent in turn)
        self.plans: list[Any] = []
        self.seen: list[Any] = []
        #: the tensor list of a layout no plan could be made for, and the sequence
        #: number before which it is not tried again
        self.no_plan: tuple[Any, int] = (None, 0)
        #: ``(slot, rec)``: the slot whose event was waited for after its record ``rec``
        #: (its stage free), at the end of the put before (``_send_planned``)
        self.settled = (-1, -1)

    @property
    def plan(self) -> Any:
        """The send plan used last (``None``: none yet)."""
        return self.plans[0] if self.plans else None

    def free(self, addr: int) -> None:
        """Give the block at address ``addr`` back to its segment's allocator."""
        seg = self.segs[addr >> SEG_SHIFT]
        if seg is None:
            raise KeyError(addr)
        seg.alloc.free(addr & SEG_MASK)


class PoolSender:
    """The sender's end of a device pool on ``channel``: finds the channel's receiver,
    maps its pool once (``attach``, or the first ``send``), and copies the device
    tensors of each payload into a block of it.

    Counts what a connector reports: ``device_puts`` (messages with a device part) and
    ``timeouts`` (``TransferTimeout`` raised here).

    Parameters
    ----------
    ops : CudaDeviceOps
        The device operations (or a test double of them).
    channel : str
        The channel whose receiver's pool it sends into.
    """

    #: whether ``send`` may send by a send plan (with ``lane_wake`` set)
    plans = True

    def __init__(self, ops: Any, channel: str) -> None:
        self.ops = ops
        self.channel = channel
        self._prefix = read_prefix()
        self._pid = os.getpid()
        #: the receiver's liveness, looked up on every put (a pidfd poll)
        self._peers = PeerWatch()
        #: the receiver's pool this sender is attached to (``None`` until it is, and
        #: once the receiver is gone)
        self.tx: _Attachment | None = None
        self.lock = threading.RLock()
        #: why the last receiver went away (until a new one is found): a put raises it
        #: instead of waiting for a receiver
        self.lost_reason: str | None = None
        self.closed = False
        self.device_puts = 0
        self.timeouts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: ``withdraw(key) -> bool``: the transport's withdrawal of a published, unclaimed
        #: message (it frees the block through ``withdrawn``); set by the connector
        self.withdraw: Any = None
        #: Send plans (``devpool.plan``), for a transport whose ``publish`` puts each
        #: message in the pool's lane (as ``{lane_mark: message}``, or as it is when
        #: ``lane_mark`` is ``None``) and then calls ``lane_wake(deadline)``: set
        #: ``lane_wake`` and ``send`` sends a stream of same-shaped payloads by a compiled
        #: plan (``plans`` False: never)
        self.lane_mark: str | None = None
        self.lane_wake: Any = None
        #: payloads sent by a plan
        self.planned_puts = 0
        #: ``HOSTS_ACROSS_GPUS`` resolved (at the first payload that asks)
        self._hosts_across: bool | None = None
        #: the last payload's host tensors stayed in the host part beside device tensors
        #: of another GPU than the pool's (``HOSTS_ACROSS_GPUS``): the next is walked so
        #: first
        self._left_across = False

    # ------------------------------------------------------------------ helpers
    def _hosts_across_gpus(self) -> bool:
        """``HOSTS_ACROSS_GPUS``, ``None`` resolved once: whether an MPS server runs."""
        got = self._hosts_across
        if got is None:
            got = HOSTS_ACROSS_GPUS
            if got is None:
                got = bool(self.ops.mps_serving())
            self._hosts_across = got
        return got

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError(f"cuda_ipc connector on channel {self.channel!r} is closed")

    def _timeout(self, op: str, key: str | None, peer: str, waited: float | None) -> TransferTimeout:
        """Build (and count) the ``TransferTimeout`` of a wait that ran out."""
        self.timeouts += 1
        return timed_out("cuda_ipc", self.channel, op, key, peer, waited)

    # --------------------------------------------------------------------- send
    def send(self, key: str, payload: Any, deadline: Deadline, ctx: Any, publish: Any, *,
             size: int | None = None, room: Deadline | None = None, host_to_pool: int | None = None,
             landing: bool = False, accept: Any = None, planned: bool = True) -> int | None:
        """Copy the device tensors of ``payload`` into a block of the receiver's pool and
        hand ``publish`` the message that describes it (``{"d": manifest, "h": host
        part, "n": size}``, what ``PoolReceiver.land`` opens; the host part is the
        payload with ``None`` where each device tensor was; ``n`` is -1 when the size is
        computed after the copy is recorded, and then stored in the slot's
        ``rec_size``). The
        message is published before the copy is queued; if ``publish`` raises, the
        block is taken back and the error goes on. ``ctx``: the
        producer's events of a ``put_async`` (``ops.producer_events``); ``size``: the
        payload's tensor_blob size when the caller knows it; ``room``: the deadline of
        the wait for room in the pool (default ``deadline``); ``host_to_pool``: host
        tensors of at most this many bytes each go into the block too (after the device
        tensors, staged in page-locked memory and copied with them, their manifest
        entries marked as host tensors), so that they arrive as views of the pool: for a
        receiver that lands its payloads on its device (the shm route; ``cuda_ipc`` while
        its receiver says so, ``landing``); 0 leaves them in the host part; ``None``:
        ``HOST_TO_POOL_BYTES``. ``landing``:
        only while the receiver's last get landed on its device. ``accept``: called with
        the ``[(path, tensor, kind)]`` the block would carry (``kind`` 2: a small host
        tensor; else a device one) before anything else is done; if
        it returns false, nothing is sent and ``send`` returns ``None`` (a transport that
        routes a payload by where its tensors are, without walking it twice).
        ``planned``: a send plan may take the payload (``send_planned``; false: the
        caller asked it already). Returns ``size``.

        Raises
        ------
        TransferTimeout
            No receiver opened its pool, or no room came (and the pool could not grow),
            in time.
        CapacityError
            The payload's device part is larger than every segment of the pool, and the
            receiver refused to grow it (past its ``pool_max_bytes``, or out of device
            memory); the message names the sizes.
        PeerLostError, ConfigurationError
            The receiver is gone; the channel already has a sender.
        BlobEncodeError
            A device tensor of a dtype omnilink cannot carry.
        ClosedError
            The sender was closed.
        """
        ops = self.ops
        if host_to_pool is None:
            host_to_pool = HOST_TO_POOL_BYTES
            if planned and ctx is None and size is None:
                sent = self.send_planned(key, payload, deadline, room, landing)
                if sent is not None:
                    return sent
        is_dev = ops.is_device_tensor
        if landing and host_to_pool:
            tx = self.tx
            if tx is None:  # the first send: the receiver's word is in its directory
                with self.lock:
                    self._check_open()
                    tx = self._attached(deadline)
            if not tx.dir.get(LANDS):
                host_to_pool = 0
        kept = [0]  # tensors left in the host part
        if host_to_pool:
            small = ops.is_small_host_tensor

            def pick(t: Any) -> int:
                # 1: a device tensor, 2: a small host tensor for the block, 0: neither
                # (asked once per tensor: the loop below reads the answer)
                return 1 if is_dev(t) else 2 if small(t, host_to_pool) else 0

            tx = self.tx
            if self._left_across and tx is not None:
                # The last payload's device tensors lived on another GPU than the pool's
                # and its host tensors stayed in the host part: this one's most likely
                # too (one walk; the other one if not).
                host, chosen = split(payload, is_dev, tensor_type(), kept)
                where = one_device(chosen, ops.tensor_device)
                if where is None or where == tx.index:
                    self._left_across = False
                    kept[0] = 0
                    host, chosen = split(payload, pick, tensor_type(), kept)
            else:
                host, chosen = split(payload, pick, tensor_type(), kept)
                if any(c[2] == 2 for c in chosen) and not self._hosts_across_gpus():
                    # Host tensors for the block beside device tensors of another GPU
                    # than the pool's, without an MPS server: they stay in the host part.
                    if tx is None:
                        with self.lock:
                            self._check_open()
                            tx = self._attached(deadline)
                    where = one_device(chosen, ops.tensor_device)
                    if where is not None and where != tx.index:
                        self._left_across = True
                        kept[0] = 0
                        host, chosen = split(payload, is_dev, tensor_type(), kept)
        else:
            host, chosen = split(payload, is_dev, tensor_type(), kept)
        if accept is not None and not accept(chosen):
            return None
        # What put returns (the Connector contract): the payload's tensor_blob size. With
        # a device part it is computed after the copy is recorded (the reader finds it in
        # the slot's ``rec_size``), off the reader's path, unless the payload holds more
        # tensors than a tensor_blob may (so that encoding cannot fail after publishing).
        if size is None and (not chosen or len(chosen) + kept[0] > MAX_TENSORS):
            size = encoded_size(payload)
        if not chosen:
            publish({"d": None, "h": host, "n": size})
            return size  # type: ignore[return-value]
        by_dtype, _ = dtypes()
        entries: list[list[Any]] = []
        items: list[tuple[int, Any]] = []
        hosted: list[tuple[int, Any]] = []  # host tensors for the block: after the device ones
        off = 0
        for path, t, picked in chosen:
            code = by_dtype.get(t.dtype)
            if code is None:
                raise BlobEncodeError(f"cuda_ipc: the tensor at {list(path)} has dtype {t.dtype}, which omnilink "
                                      "cannot carry")
            if picked == 2:
                hosted.append((len(entries), t))
                entries.append([code, 0, 0, list(t.shape), list(path), 1])
                continue
            t = plain_tensor(t)
            n = t.nbytes
            off = (off + ALIGN - 1) & -ALIGN
            entries.append([code, off, n, list(t.shape), list(path)])
            items.append((off, t))
            off += n
        host_items: list[tuple[int, Any]] = []
        for i, t in hosted:
            t = plain_tensor(t)
            n = t.nbytes
            off = (off + ALIGN - 1) & -ALIGN
            entries[i][1], entries[i][2] = off, n
            host_items.append((off, t))
            off += n
        total = max((off + ALIGN - 1) & -ALIGN, ALIGN)
        with self.lock:
            self._check_open()
            tx = self.tx
            if tx is None:
                tx = self._attach(deadline)  # (the receiver's liveness is checked below)
            blk = self._alloc(tx, key, total, room or deadline, deadline)
            slot = self._take_slot(tx)
            tx.seq += 1
            seq = tx.seq
            base = tx.segs[blk >> SEG_SHIFT].ptr + (blk & SEG_MASK)  # type: ignore[union-attr]
            # Published before the copy is queued: the receiver claims, checks and views
            # the block while this process queues the copy, and waits for the slot's
            # record (``rec_seq``) before its stream waits on the event.
            try:
                # A seventh item 1: every tensor is in the block (nothing left to move to
                # the receiver's device when the block is on it).
                manifest = [tx.gen, seq, slot, blk, total, entries]
                if not kept[0]:
                    manifest.append(1)
                publish({"d": manifest, "h": host, "n": -1 if size is None else size})
            except BaseException:
                # Never published: nobody will wait on the slot or read the block.
                tx.free(blk)
                raise
            tx.sent[key] = (blk, slot, seq)
            tx.by_block[blk] = key
            # (host tensors left in the host part: only those of a stream from another GPU
            # without MPS, which a plan keeps there too)
            keep_host = bool(kept[0]) and self._left_across
            if self.lane_wake is not None and self.plans and (not kept[0] or keep_host) and ctx is None \
                    and size is None and (host_to_pool == HOST_TO_POOL_BYTES or not host_items):
                # A layout the general way sent lately, again: the next ones go by a plan.
                if entries in tx.seen and not any(p.entries == entries for p in tx.plans) \
                        and (seq >= tx.no_plan[1] or entries != tx.no_plan[0]):
                    plan = None
                    # Every device tensor on one device: the pool's, or (``PLAN_PEER``)
                    # one other GPU, whose plan copies peer to peer.
                    where = one_device(chosen, ops.tensor_device)
                    if where is not None and (PLAN_PEER or where == tx.index):
                        plan = compile_plan(payload, entries, chosen, total, where, ops.plan_checks(), keep_host)
                        if plan is not None:
                            plan.calibrate(payload, host, encode_host if plan.kept else None)
                    if plan is None or plan.size_base is None:
                        # (a list in it, tensors on several GPUs): not again for a while
                        tx.no_plan = (entries, seq + PLAN_RETRY)
                    else:
                        tx.plans.insert(0, plan)
                        del tx.plans[MAX_PLANS:]
                if entries not in tx.seen:
                    tx.seen.insert(0, entries)
                    del tx.seen[MAX_PLANS:]
            why = self._lost(tx)  # before any copy into its pool
            if why is not None:
                raise self._peer_lost(why, key)
            try:
                hosted_arg = None
                if host_items:
                    first = host_items[0][0]
                    span = off - first
                    stage, _ = self._stage_for(tx, slot, span, False)
                    hosted_arg = (base + first, [(o - first, t) for o, t in host_items], span, stage)
                ops.copy_in(tx.index, [(base + o, t) for o, t in items], tx.events[slot], ctx, hosted=hosted_arg)
            except BaseException as exc:
                self._copy_failed(tx, key, slot, seq, exc)
                raise
            self._recorded(tx, slot, seq)
            if size is None:
                # Off the reader's path: it lands the payload meanwhile and reads the size
                # last (or sizes the payload itself if this store comes late).
                size = self._size_after(payload, key, total)
                tx.dir.set_rec_size(slot, seq, size)
            self._drain(tx)  # the blocks freed meanwhile, off the next put's path
        return size

    def send_planned(self, key: str, payload: Any, deadline: Deadline, room: Any = None,
                     landing: bool = False) -> int | None:
        """``send`` of ``payload`` by one of this sender's send plans, when it has one
        the payload is of (the one used last tried first; what ``send`` tries first; a
        transport's put may ask it before it sets up the general way); ``None``:
        nothing was sent, send it by ``send``. ``room``: as ``send``'s, or a function
        that makes it, called only if the put has to wait for room."""
        tx = self.tx
        plans = tx.plans if tx is not None and self.plans else None
        if not plans:
            return None
        plan = plans[0]
        got = plan.match(payload)
        if got is None:
            for i in range(1, len(plans)):
                got = plans[i].match(payload)
                if got is not None:
                    plan = plans.pop(i)
                    plans.insert(0, plan)  # most recently used first
                    break
            else:
                return None
        # (a plan carries small host tensors in the block: with ``landing``, only while
        # the receiver still lands on its device)
        if landing and plan.host_items and not tx.dir.get(LANDS):  # type: ignore[union-attr]
            return None
        return self._send_planned(tx, plan, got, key, payload, room or deadline, deadline)  # type: ignore[arg-type]

    def _send_planned(self, tx: _Attachment, plan: Any, got: tuple[Any, tuple[Any, ...], tuple[Any, ...]], key: str,
                      payload: Any, room: Deadline, deadline: Deadline) -> int | None:
        """``send`` of ``payload``, which ``plan`` matched (``got``: its host part, device
        tensors and host tensors): the same message the general way would publish, by the
        plan's layout, in the lane; ``None`` (nothing sent) when the lane cannot take it
        now, so that the general way does."""
        host, devs, hosts = got
        lane = tx.lane
        if key in tx.sent or not lane.has_room() or lane.pending(key) or plan.size_base is None:
            return None
        try:
            raw = encode_host(host) if plan.kept else _ENCODE(host)
        except (OverflowError, TypeError, ValueError, NotPlain):  # an int past 64 bits: the general way
            return None
        if len(raw) >= LANE_RECORD:
            return None  # not for the lane
        size = plan.size(len(raw))
        total = plan.total
        copy_first = COPY_FIRST_BYTES is not None and total >= COPY_FIRST_BYTES
        with self.lock:
            if self.closed or self.tx is not tx:
                return None
            blk = self._alloc(tx, key, total, room, deadline)
            slot = self._take_slot(tx)
            tx.seq += 1
            seq = tx.seq
            if copy_first:
                try:
                    self._check_lost(tx, key)
                    self._copy_planned(tx, plan, devs, hosts, blk, slot)
                except BaseException:
                    tx.free(blk)  # never published; a copy that failed to queue wrote nothing
                    raise
            try:
                # (a seventh item 1: every tensor is in the block; not with host tensors kept)
                manifest = [tx.gen, seq, slot, blk, total, plan.raw] if plan.kept else \
                    [tx.gen, seq, slot, blk, total, plan.raw, 1]
                msg = {"d": manifest, "h": msgspec.Raw(raw), "n": size}
                mark = self.lane_mark
                body = _ENCODE([key, msg if mark is None else {mark: msg}])
                written = lane.write_body(key, body)
            except BaseException:
                self._unpublished(tx, blk, slot, copy_first)
                raise
            if not written:
                self._unpublished(tx, blk, slot, copy_first)
                return None
            tx.sent[key] = (blk, slot, seq)
            tx.by_block[blk] = key
            if copy_first:
                self._recorded(tx, slot, seq)  # (stored once published: a slot never waits on a seq nobody reads)
            self.lane_wake(deadline)
            if not copy_first:
                self._check_lost(tx, key)
                try:
                    self._copy_planned(tx, plan, devs, hosts, blk, slot)
                except BaseException as exc:
                    self._copy_failed(tx, key, slot, seq, exc)
                    raise
                self._recorded(tx, slot, seq)
            self.planned_puts += 1
            self._drain(tx)
            self._settle_next(tx)
        return size

    def _check_lost(self, tx: _Attachment, key: str) -> None:
        """Raise ``PeerLostError`` if the receiver is gone (before any copy into its pool)."""
        why = self._lost(tx)
        if why is not None:
            raise self._peer_lost(why, key)

    def _copy_planned(self, tx: _Attachment, plan: Any, devs: tuple[Any, ...], hosts: tuple[Any, ...], blk: int,
                      slot: int) -> None:
        """Queue the copy of a planned payload into block ``blk`` and the record of
        ``slot``'s event (its device tensors ``devs``, host tensors ``hosts``)."""
        ops = self.ops
        base = tx.segs[blk >> SEG_SHIFT].ptr + (blk & SEG_MASK)  # type: ignore[union-attr]
        hosted_arg = None
        # The stage's last copy is known done when the put before waited for it (off
        # this put's path) or the stage is new.
        settled = tx.settled == (slot, tx.rec[slot])
        if hosts:
            first, span = plan.host_first, plan.host_span
            stage, settled = self._stage_for(tx, slot, span, settled)
            hosted_arg = (base + first, [(o - first, t) for (o, _n), t in zip(plan.host_items, hosts)], span, stage)
        items = [(base + o, t) for (o, _n), t in zip(plan.dev_items, devs)]
        if plan.device == tx.index:
            ops.copy_in_local(tx.index, items, tx.events[slot], hosted_arg, settled)
        else:
            ops.copy_in_peer(tx.index, plan.device, items, tx.events[slot], hosted_arg, settled)

    def _unpublished(self, tx: _Attachment, blk: int, slot: int, copied: bool) -> None:
        """Give back the block of a payload whose message was not published; one whose
        copy was queued (``copied``) once that copy is done, so that no later payload's
        copy into the block can race it."""
        if copied:
            try:
                self.ops.settle(tx.events[slot])
            except OmnilinkError:  # pragma: no cover - a device error: the block stays out
                logger.debug("cuda_ipc: waiting for an unpublished copy failed", exc_info=True)
                return
        tx.free(blk)

    def _recorded(self, tx: _Attachment, slot: int, seq: int) -> None:
        """The copy of sequence ``seq`` and the record of ``slot``'s event are queued:
        said in the slot (its readers wait for this store) and counted."""
        tx.rec[slot] = seq
        tx.dir.set_rec_seq(slot, seq)
        self.device_puts += 1

    def _settle_next(self, tx: _Attachment) -> None:
        """Wait now, off the next put's path, for the last copy out of the stage of the
        slot the next put will most likely take (the next in turn): that copy was queued
        an event-slot count of payloads ago and is done, but asking costs a CUDA call."""
        k = tx.next_slot
        if k in tx.stages and tx.settled != (k, tx.rec[k]):
            try:
                self.ops.settle(tx.events[k])
            except OmnilinkError:  # the next put waits itself (and sees the error)
                return
            tx.settled = (k, tx.rec[k])

    def _stage_for(self, tx: _Attachment, slot: int, span: int, settled: bool) -> tuple[Any, bool]:
        """The page-locked stage of ``slot`` for ``span`` bytes of host tensors, and
        whether its last copy is known done (``settled``, or the stage is new): the
        slot's own if large enough, else a new one (the old one's last copy waited for
        first: it goes back)."""
        stage = tx.stages.get(slot)
        if stage is not None and self.ops.stage_bytes(stage) >= span:
            return stage, settled
        if stage is not None and not settled:
            self.ops.settle(tx.events[slot])
        tx.stages[slot] = stage = self._new_stage(tx, slot, span)
        return stage, True

    def _new_stage(self, tx: _Attachment, slot: int, span: int) -> Any:
        """A page-locked stage of at least ``span`` bytes for ``slot``: its slice of the
        attachment's stage arena when ``span`` fits one (one page-locked allocation for
        every slot: a new one per slot cost each of the first payloads of a sender
        several microseconds), else a buffer of its own."""
        each = STAGE_SLICE_BYTES
        if each and span <= each:
            if tx.stage_arena is None:
                tx.stage_arena = self.ops.new_stage(len(tx.events) * each)
            return self.ops.stage_slice(tx.stage_arena, slot * each, each)
        return self.ops.new_stage(max(span, 64 << 10))

    @staticmethod
    def _size_after(payload: Any, key: str, total: int) -> int:
        """The tensor_blob size of ``payload``, already sent. Its published message
        passed the limits a tensor_blob header has (and ``send`` counted its tensors
        first), so encoding cannot fail here; if it does, the payload is delivered all
        the same, and ``put`` returns the bytes of its pool block instead."""
        try:
            return encoded_size(payload)
        except BlobEncodeError as exc:  # pragma: no cover - see above
            logger.warning("cuda_ipc: key %r was sent, but its tensor_blob size could not be computed "
                           "(%s); put returns its pool block's bytes", key, exc)
            return total

    def _copy_failed(self, tx: _Attachment, key: str, slot: int, seq: int, exc: BaseException) -> None:
        """The copy of ``key``, already published, could not be queued: withdraw its
        message if nobody claimed it yet; else tell its reader (the slot's ``rec_seq``
        marked ``COPY_FAILED``) and let the pool go (the next send attaches as a new
        sender generation, so no later record of the slot is taken for this one)."""
        withdrawn = False
        try:
            withdrawn = self.withdraw is not None and bool(self.withdraw(key))
        except Exception:  # pragma: no cover - a broken transport
            logger.debug("cuda_ipc: withdrawing %r after its copy failed", key, exc_info=True)
        if withdrawn:
            return
        tx.dir.set_rec_seq(slot, seq | COPY_FAILED)
        logger.error("cuda_ipc: the copy of key %r into the pool failed after its message was read (%s); "
                     "its reader gets a TransportError, this sender attaches again", key, exc)
        self.tx = None
        self._detach(tx, clean=False)

    def lane_write(self, key: str, message: Any) -> bool:
        """Put ``message`` (what ``send`` hands its ``publish``) in the pool's lane, for
        the receiver's transport to read (see ``devpool.lane``); ``False`` when the lane
        cannot take it (not plain, too large, full; no pool attached): the transport
        carries it its general way. Called from ``publish``, under this sender's lock."""
        tx = self.tx
        # A key whose earlier block is still out: the general way (which knows whether
        # that earlier payload is still unread), never a second record of the key.
        return tx is not None and key not in tx.sent and tx.lane.write(key, message)

    def lane_pending(self, key: str) -> bool:
        """Whether this sender's last lane record of ``key`` is still unclaimed."""
        tx = self.tx
        return tx is not None and tx.lane.pending(key)

    def lane_pending_keys(self) -> list[str]:
        """Keys of this sender's lane records not claimed yet."""
        tx = self.tx
        return [] if tx is None else tx.lane.pending_keys()

    def lane_withdraw(self, key: str) -> bool:
        """Withdraw the unclaimed lane record of ``key`` and free its block (the caller
        holds the transport's channel mutex, as the receiver's claim does); whether it
        was unclaimed."""
        with self.lock:
            tx = self.tx
            if tx is None or not tx.lane.withdraw(key):
                return False
        self.withdrawn(key)
        return True

    def lane_reclaim(self, older_than: float, now: float) -> list[tuple[str, float, int]]:
        """Withdraw this sender's lane records unclaimed for more than ``older_than``
        seconds and free their blocks (the caller holds the transport's channel mutex);
        ``(key, age, block bytes)`` of each, oldest first."""
        out = []
        with self.lock:
            tx = self.tx
            if tx is None:
                return []
            for k, age in tx.lane.unread_older_than(older_than, now):
                if not tx.lane.withdraw(k):
                    continue
                got = tx.sent.get(k)
                seg = tx.segs[got[0] >> SEG_SHIFT] if got is not None else None
                out.append((k, age, seg.alloc.size_of(got[0] & SEG_MASK) if seg is not None else 0))
        for k, _, _ in out:
            self.withdrawn(k)
        return out

    def withdrawn(self, key: str) -> None:
        """The message of ``key`` was withdrawn unread: its block is free again."""
        with self.lock:
            tx = self.tx
            got = tx.sent.pop(key, None) if tx is not None else None
            if tx is not None and got is not None:
                blk, slot, seq = got
                tx.by_block.pop(blk, None)
                tx.free(blk)
                tx.dir.set_done_seq(slot, seq)

    def in_use(self) -> tuple[int, int]:
        """(blocks, bytes) of the pool this sender has out (the receiver's frees drained
        first: a send drains them only after its copy)."""
        with self.lock:
            tx = self.tx
            if tx is None:
                return 0, 0
            try:
                self._drain(tx)
            except ConfigurationError:  # pragma: no cover - a corrupt ring: the next send says so
                pass
        segs = [seg for seg in tx.segs if seg is not None]
        return sum(seg.alloc.blocks for seg in segs), sum(seg.alloc.used_bytes for seg in segs)

    # ------------------------------------------------------------------- attach
    def attach(self, deadline: Deadline) -> int:
        """Find the channel's receiver and map its pool now (``send`` does it on first
        use); return the pool's device index in this process.

        Raises
        ------
        TransferTimeout
            No receiver opened its pool before ``deadline``.
        PeerLostError, ConfigurationError
            The receiver is gone; the channel already has a sender.
        """
        with self.lock:
            self._check_open()
            return self._attached(deadline).index

    def _lost(self, tx: _Attachment) -> str | None:
        d = tx.dir
        if d.get(STATE) != STATE_OPEN:
            return "closed"
        if tx.receiver_pid != self._pid and not self._peers.alive(tx.receiver_pid):
            return "died"
        return None

    def _peer_lost(self, why: str, key: str | None) -> PeerLostError:
        with self.lock:
            tx, self.tx = self.tx, None
            pid = tx.receiver_pid if tx is not None else 0
            if tx is not None:
                self._detach(tx, clean=False)
        msg = (f"cuda_ipc: the receiver (pid {pid}) on channel {self.channel!r} {why}; this sender closed "
               "its handles to its pool")
        self.lost_reason = msg
        return PeerLostError(msg)

    def _attached(self, deadline: Deadline) -> _Attachment:
        tx = self.tx
        if tx is not None:
            why = self._lost(tx)
            if why is None:
                return tx
            raise self._peer_lost(why, None)
        return self._attach(deadline)

    def _attach(self, deadline: Deadline) -> _Attachment:
        """Find the channel's receiver, map its pool, create and publish the events."""
        ops = self.ops
        delay = 0.001
        while True:
            found = [(pid, name) for pid, name in find_directories(self._prefix, self.channel)
                     if pid == self._pid or pid_alive(pid)]
            if found:
                try:
                    d = Directory.open(found[0][1])
                except Exception:  # gone meanwhile, or not yet complete
                    d = None
                if d is not None and d.get(STATE) == STATE_OPEN:
                    break
                if d is not None:
                    d.close()
            if self.lost_reason is not None:
                raise PeerLostError(self.lost_reason)
            if deadline.expired():
                raise self._timeout("put (waiting for a cuda_ipc receiver to open its pool)", None,
                                    "a receiver", deadline.timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        tx = _Attachment()
        try:
            with HostLock():
                sp = d.get(SENDER_PID)
                with local_lock:
                    mine = d.name in LOCAL_SENDERS
                if (sp and sp != self._pid and pid_alive(sp)) or (sp == self._pid and mine):
                    raise ConfigurationError(
                        f"cuda_ipc: channel {self.channel!r} already has a sender (pid {sp}); one sender per channel"
                    )
                with local_lock:
                    LOCAL_SENDERS.add(d.name)
                old = d.get(GEN)
                gen = old + 1
                d.set(SENDER_PID, self._pid)
                d.set(GEN, gen)
                if old:
                    d.set(WANT_GEN, gen)
            tx.dir, tx.gen = d, gen
            tx.lane = LaneWriter(d)
            tx.receiver_pid = d.get(RECV_PID)
            tx.ring_cap = d.ring_cap
            tx.index = ops.index_of_uuid(d.uuid(), d.get(DEVICE))
            self._sync_segments(tx)
            if tx.segs[0] is None:
                raise ConfigurationError(f"cuda_ipc: pool directory {d.name} has no segment 0")
            if old:  # a sender was here before: start from what the receiver still holds
                while d.get(ACK_GEN) != gen:
                    if self._lost(tx) is not None:
                        raise PeerLostError(f"cuda_ipc: the receiver on channel {self.channel!r} is gone")
                    if deadline.expired():
                        raise self._timeout("put (waiting for the receiver to list the blocks it holds)",
                                            None, "the receiver", deadline.timeout)
                    time.sleep(0.001)
                for addr, length in d.read_held():
                    seg = tx.segs[addr >> SEG_SHIFT] if addr >> SEG_SHIFT < MAX_SEGMENTS else None
                    if seg is None or not seg.alloc.reserve(addr & SEG_MASK, length):
                        logger.warning("cuda_ipc: receiver holds an invalid block [%d, +%d)", addr, length)
                d.set(RING_TAIL, d.get(SNAP_HEAD))
            else:
                d.set(RING_TAIL, d.get(RING_HEAD))
            created = ops.create_events(tx.index, d.nslots)
            tx.events = [ev for ev, _ in created]
            tx.rec = [0] * d.nslots
            for i, (_, handle) in enumerate(created):
                d.set_slot_handle(i, handle)
                d.set_done_seq(i, 0)
                d.set_rec_seq(i, 0)
            with local_lock:
                LOCAL_EVENTS[(d.name, gen)] = tx.events
            d.set(EVENTS_GEN, gen)
        except BaseException:
            for seg in tx.segs:
                if seg is not None and seg.opened:
                    try:
                        ops.close_pool(tx.index, seg.ptr)
                    except Exception:  # pragma: no cover
                        logger.debug("cuda_ipc: close_pool failed", exc_info=True)
            if d.get(SENDER_PID) == self._pid and d.get(GEN) == getattr(tx, "gen", -1):
                d.set(SENDER_PID, 0)
                with local_lock:
                    LOCAL_SENDERS.discard(d.name)
            d.close()
            raise
        self.tx = tx
        self.lost_reason = None
        if self._thread is None:
            self._thread = start_heartbeat(self, self._stop, f"omnilink-cuda-ipc-tx-{self.channel}", HEARTBEAT_S,
                                           "_watch_receiver")
        logger.debug("cuda_ipc: sender attached to %s (generation %d)", d.name, gen)
        return tx

    # ------------------------------------------------------------------- blocks
    def _drain(self, tx: _Attachment) -> None:
        for off, _length in tx.dir.drain_frees():
            key = tx.by_block.pop(off, None)
            if key is not None:
                tx.sent.pop(key, None)
            try:
                tx.free(off)
            except (KeyError, IndexError):
                logger.warning("cuda_ipc: the receiver freed an unknown block at %d", off)

    def _wait_room(self, tx: _Attachment, key: str, deadline: Deadline, what: str, rounds: int) -> None:
        """One round of waiting for the receiver to free pool blocks. The first rounds
        only yield (a free usually arrives within microseconds of the receiver's next
        get: a 0.5 ms sleep per round cost large payloads a third of their speed), then
        sleeps grow to 0.5 ms."""
        why = self._lost(tx)
        if why is not None:
            raise self._peer_lost(why, key)
        self._check_open()
        if deadline.expired():
            raise self._timeout(f"put ({what})", key, "the receiver", deadline.timeout)
        time.sleep(0 if rounds < 200 else min(0.0005, 0.00002 * (rounds - 199)))

    def _alloc(self, tx: _Attachment, key: str, total: int, room: Any, deadline: Deadline) -> int:
        """A block of ``total`` bytes (its address, ``segment << SEG_SHIFT | offset``):
        first fit in the live segments in order; when none has room after
        ``GROW_AFTER_S`` (at once if ``total`` is larger than every segment), a new
        segment from the receiver; else wait for frees until ``room``."""
        rounds = 0
        since = 0.0
        first = True
        while True:
            if not first:  # (the last send drained after its copy: try without a look first)
                self._drain(tx)
            live = tx.live
            if len(live) == 1:  # the common case: one segment, as before growth
                seg = live[0]
                if seg.alloc.blocks < tx.ring_cap:
                    off = seg.alloc.alloc(total)
                    if off is not None:
                        return seg.index << SEG_SHIFT | off
            elif sum(seg.alloc.blocks for seg in live) < tx.ring_cap:
                for seg in live:
                    off = seg.alloc.alloc(total)
                    if off is not None:
                        return seg.index << SEG_SHIFT | off
            if first:
                first = False
                continue  # frees the receiver pushed since: drained, then tried again
            too_large = all(seg.nbytes < total for seg in live)
            now = time.monotonic()
            if not since:
                since = now
            if (too_large or now - since >= GROW_AFTER_S) and self._may_grow(tx, total):
                if self._grow(tx, key, total, deadline):
                    continue
                if too_large:
                    raise CapacityError(
                        f"cuda_ipc: payload {key!r} holds {total} device bytes, more than any segment of the "
                        f"receiver's pool ({max(seg.nbytes for seg in live)} bytes), and the pool cannot grow: "
                        f"{tx.refused[2] if tx.refused else 'refused'}"
                    )
            if not isinstance(room, Deadline):  # made when first needed (``send_planned``)
                room = room()
            self._wait_room(tx, key, room, "the receiver's pool is full", rounds)
            rounds += 1

    def _may_grow(self, tx: _Attachment, total: int) -> bool:
        """Whether a pool with no room should grow for ``total`` bytes: only for blocks
        the receiver holds (as the shm arena). If the payloads nobody has read yet, with
        this one, would not fit in segment 0 (or this payload alone), a reader is slow
        and ``send`` waits (backpressure) instead."""
        d = tx.dir
        if d.get(POOL_NOW) + total > d.get(POOL_MAX):
            return True  # no growth could fit it: ask, so the receiver's refusal says why
        out = sum(seg.alloc.used_bytes for seg in tx.segs if seg is not None)
        unread = max(out - d.get(HELD_BYTES), 0)
        first = tx.segs[0]
        return unread + total <= max(first.nbytes if first is not None else 0, total)

    def _grow(self, tx: _Attachment, key: str, total: int, deadline: Deadline) -> bool:
        """Ask the receiver for a new segment able to hold ``total`` bytes (as large as
        the pool already is, within its bound: the pool doubles) and map it; ``False``
        when the receiver refused (``tx.refused`` says why) or refused as much before."""
        d = tx.dir
        self._sync_segments(tx)
        gen = tx.seg_gen
        now, bound = d.get(POOL_NOW), d.get(POOL_MAX)
        want = max(total, min(now, bound - now if bound > now else 0))
        if tx.refused is not None and tx.refused[0] == gen and want >= tx.refused[1]:
            return False
        req = d.get(GROW_REQ) + 1
        d.set(GROW_BYTES, want)
        d.set(GROW_REQ, req)  # after the size: publishes the request
        while d.get(GROW_ACK) != req:
            why = self._lost(tx)
            if why is not None:
                raise self._peer_lost(why, key)
            self._check_open()
            if deadline.expired():
                raise self._timeout("put (waiting for the receiver to grow its pool)", key, "the receiver",
                                    deadline.timeout)
            time.sleep(0.001)
        err = d.get(GROW_ERR)
        if err:
            if err == GROW_ALLOC_FAILED:
                why = f"the receiver could not allocate {want} more device bytes (out of device memory?)"
            elif err == GROW_NO_ENTRY:
                why = f"the pool already has its most segments ({MAX_SEGMENTS})"
            else:
                why = (f"growing the pool ({now} bytes now) by {want} bytes would pass its bound of {bound} "
                       "bytes (raise the receiver's pool_max_bytes; shm: ipc_pool_max_bytes)")
            tx.refused = (gen, want, why)
            logger.info("cuda_ipc: channel %r: %s", self.channel, why)
            return False
        self._sync_segments(tx)
        return True

    def _sync_segments(self, tx: _Attachment) -> None:
        """Map the segments the receiver published since ``tx.seg_gen``."""
        d = tx.dir
        gen = d.get(SEG_GEN)
        if gen == tx.seg_gen:
            return
        for i in range(MAX_SEGMENTS):
            state, nbytes = d.segment(i)
            known = tx.segs[i]
            if state != SEG_LIVE:
                if known is not None and known not in tx.retiring:
                    tx.retiring.append(known)
                elif known is None and state == SEG_RETIRING:
                    d.set_released(i, gen)  # never mapped here (a sender before us did)
                continue
            if known is not None:
                continue
            if not 0 < nbytes <= SEG_MASK or nbytes % ALIGN:
                logger.warning("cuda_ipc: pool directory %s: segment %d has an invalid size %d", d.name, i, nbytes)
                continue
            with local_lock:
                local = LOCAL_POOLS.get((d.name, i)) if tx.receiver_pid == self._pid else None
            if local is not None:
                seg = _Segment(i, local, False, nbytes)
            else:
                seg = _Segment(i, self.ops.open_pool(tx.index, d.segment_handle(i)), True, nbytes)
            tx.segs[i] = seg
            if i:
                d.set_released(i, 0)
        tx.live = [seg for seg in tx.segs if seg is not None and seg not in tx.retiring]
        tx.seg_gen = gen

    def _release_retiring(self, tx: _Attachment) -> None:
        """Unmap the retiring segments this sender has no block in any more, and tell
        the receiver (``released``), which then frees them."""
        d = tx.dir
        for seg in list(tx.retiring):
            if seg.alloc.blocks:
                continue
            tx.retiring.remove(seg)
            tx.segs[seg.index] = None
            if seg.opened:
                try:
                    self.ops.close_pool(tx.index, seg.ptr)
                except OmnilinkError:
                    logger.warning("cuda_ipc: closing the handle of a retired pool segment failed", exc_info=True)
            d.set_released(seg.index, d.get(SEG_GEN))

    def _take_slot(self, tx: _Attachment) -> int:
        """A slot whose last record the receiver has already waited on (or discarded);
        when every slot is still awaited, the next one in turn. Recording a slot again
        is always correct: all records are on one copy stream, so a receiver whose wait
        comes after the new record waits for a later point of that stream (its own copy
        is done by then); it may only wait longer. Free slots keep that from happening
        while fewer than ``event_slots`` payloads are unread.

        Slots are taken in turn, so the oldest record is the next one: only the next
        ``SLOT_SCAN`` are looked at (a sender far ahead of its receiver found every slot
        awaited after scanning all of them: 100 us per put on an H100 host)."""
        n = len(tx.events)
        d = tx.dir
        start = tx.next_slot
        for k in range(min(n, SLOT_SCAN)):
            i = (start + k) % n
            if d.done_seq(i) >= tx.rec[i]:
                tx.next_slot = (i + 1) % n
                return i
        tx.next_slot = (start + 1) % n
        return start

    # -------------------------------------------------------------- lifecycle
    def _detach(self, tx: _Attachment, *, clean: bool) -> None:
        ops = self.ops
        d = tx.dir
        try:
            if clean:
                ops.synchronize(tx.index)
                # Copies on the caller's stream (one GPU) or a peer's are not on the copy
                # stream: every slot's event follows the copies recorded before it.
                for ev in tx.events:
                    ops.settle(ev)
                if d.get(GEN) == tx.gen:
                    d.set(CLEAN_GEN, tx.gen)
            ops.drain()
            if clean:  # frees already pushed: segments with no block left may go at once
                try:
                    self._drain(tx)
                except ConfigurationError:  # pragma: no cover - a corrupt ring
                    pass
                for seg in tx.segs[1:]:
                    if seg is not None and not seg.alloc.blocks:
                        d.set_released(seg.index, RELEASED_ALL)
            for seg in tx.segs:
                if seg is not None and seg.opened:
                    ops.close_pool(tx.index, seg.ptr)
        except OmnilinkError:
            logger.warning("cuda_ipc: closing the pool handle failed", exc_info=True)
        finally:
            for slot in tx.stages:  # no copy may still read a stage that goes back
                try:
                    ops.settle(tx.events[slot])
                except OmnilinkError:  # pragma: no cover - a broken device
                    logger.warning("cuda_ipc: waiting for a staged copy failed", exc_info=True)
            tx.stages.clear()
            tx.stage_arena = None
            with local_lock:
                LOCAL_EVENTS.pop((d.name, tx.gen), None)
            ops.destroy_events(tx.index, tx.events)
            if d.get(SENDER_PID) == self._pid and d.get(GEN) == tx.gen:
                d.set(SENDER_PID, 0)
            with local_lock:
                LOCAL_SENDERS.discard(d.name)
            d.close()

    def _watch_receiver(self) -> None:
        """Heartbeat of a sender: a receiver that died takes its pool with it; close our
        handle to it now, not at the next put."""
        with self.lock:
            tx = self.tx
            if tx is None:
                return
            why = self._lost(tx)
            if why is None and (tx.retiring or tx.dir.get(SEG_GEN) != tx.seg_gen):
                self._drain(tx)
                self._sync_segments(tx)
                self._release_retiring(tx)
        if why is not None:
            logger.warning("cuda_ipc: receiver (pid %d) on channel %r %s; closing its pool handle",
                           tx.receiver_pid, self.channel, why)
            self._peer_lost(why, None)

    def wake(self) -> None:
        """Refuse new sends and end waits for room (``ClosedError``); ``close`` does the
        rest."""
        self.closed = True
        self._stop.set()

    def close(self) -> None:
        """Wait for this sender's copies, mark them done for the receiver and close the
        pool's handles. Idempotent."""
        self.wake()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(5)
        with self.lock:
            tx, self.tx = self.tx, None
        if tx is not None:
            self._detach(tx, clean=True)
        self._peers.close()
