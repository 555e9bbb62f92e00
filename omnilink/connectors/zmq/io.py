"""The zmq backend's two socket owners: ``ReceiverLoop`` (ROUTER) and ``SenderLoop`` (DEALER).

ZMQ sockets are not thread-safe, so each socket has one owner at a time. The ROUTER is
owned by the receiver's loop thread; callers of ``get`` wait on its
``threading.Condition``. The DEALER has no thread: the ``put`` callers take turns
driving it (leader/follower, see ``SenderLoop``), which saves two thread hand-offs per
``put``. Nothing sleeps: a driver sleeps in ``poll()`` until its socket, its monitor
or its eventfd is ready, and every other waiter sleeps in ``Condition.wait`` until
notified (or its deadline passes).

Sender message states (guarded by ``SenderLoop.cond``)::

              send()             driver: send_multipart ok
    (new) ---------------> QUEUED ----------------------> SENT ------ ack --> ACKED
                             ^  |  \\ Again (no peer / HWM)   |                  |
                             |  |   +-> stays QUEUED          |                  v
                             |  |                             |          put returns
                             |  +-- put gives up ------------------> CANCELLED
                             |       (QUEUED: zmq never saw it;  |   (SENT: zmq may still
                             |        nothing more to do)        |    hold the tensors'
                             +------------ reconnect (new handshake) or socket reset:
                                           resend; the receiver drops the duplicate by
                                           (sender id, seq) and acks it again
    A SENT message is reset out of zmq (close with linger 0, new socket) before ``put``
    gives up, and ``put`` waits on the zmq.MessageTracker of its zero-copy frames, so
    the caller's memory is never read after ``put`` returned or raised. A by-reference
    message (``cma``) has no frames to wait for: its token is invalidated instead.
    An ack RESEND_AS_FRAMES turns a by-reference message back into QUEUED frames.

Receiver: the loop reads whole multipart messages, validates and decodes each one into
zero-copy views of its frames (or, by reference, copies its regions out of the sender
into a pooled buffer and decodes views of that), acks it, then indexes it by key. When the index holds
``max_buffered_bytes`` or more, the loop stops reading the ROUTER (it polls only its
eventfd and monitor) so ZMQ's high-water marks and the kernel's socket buffers push back
on the senders; ``get`` wakes it once the index drains below the limit.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from omnilink import blob as _blob
from omnilink._errors import (
    BlobDecodeError,
    ClosedError,
    OmnilinkError,
    PeerLostError,
    TransportError,
    WouldBlock,
)
from omnilink._util import ConsumedKeys, Deadline
from omnilink.connectors.zmq import cma
from omnilink.connectors.zmq import wire
from omnilink.connectors.zmq.support import zmq_error

__all__ = ["ReceiverLoop", "SenderLoop"]

logger = logging.getLogger(__name__)

# Indirection so tests can observe the exact frame buffers handed to the decoder.
decode_parts = _blob.decode_parts
decode_parts_counted = _blob.decode_parts_counted

#: How many (sender, seq) pairs a receiver remembers to drop resent duplicates.
SEEN_WINDOW = 1 << 16
#: Longest a give-up path waits for zmq to let go of the caller's buffers.
RELEASE_GRACE_S = 5.0
#: Milliseconds a closing receiver lets zmq flush queued acks.
ACK_LINGER_MS = 200
#: Messages read per poll wake-up before re-checking the pause and stop flags.
READ_BATCH = 64
#: Most seconds a ``get`` about to report every sender lost waits for the receiver loop
#: to take in what already reached its socket (``ReceiverLoop._sync``): one pass of the
#: loop, so normally microseconds; bounded for a loop busy with a large message.
SYNC_S = 1.0
#: Bytes a malformed message's error entry counts against ``max_buffered_bytes``: it
#: holds no frames, but a flood of them must still push back on the sender.
ERROR_ENTRY_BYTES = 4096
#: Most error entries (malformed messages nobody asked for yet) the index keeps; past
#: it the oldest is dropped (logged), so bad messages cannot grow memory without bound.
MAX_ERROR_ENTRIES = 1024

_MON_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
#: The sender also watches for failed connection attempts (nobody listening): its
#: ``wait_connected`` stops waiting at the first.
_SENDER_MON_EVENTS = _MON_EVENTS | zmq.EVENT_CONNECT_RETRIED
_HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication refused",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
}




class _Waker:
    """An eventfd a loop polls next to its sockets: callers write it to wake the loop."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def wake(self) -> None:
        try:
            os.eventfd_write(self.fd, 1)
        except (BlockingIOError, OSError):  # counter saturated or closed: already awake
            pass

    def drain(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class _Loop:
    """Thread + poller + waker shared by both loops."""

    name = "loop"

    def __init__(self, *, ctx: zmq.Context, channel: str, endpoint: str) -> None:
        self.ctx = ctx
        self.channel = channel
        self.endpoint = endpoint
        self.cond = threading.Condition()
        self.waker = _Waker()
        self.stopping = False
        self.closed = False
        self.failure: BaseException | None = None
        self.thread: threading.Thread | None = None

    def _start(self) -> None:
        self.thread = threading.Thread(
            target=self._run_guarded, name=f"omnilink-zmq-{self.name}-{self.channel}", daemon=True
        )
        self.thread.start()

    def _run_guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter, then logged
            logger.exception("zmq %s loop of channel %r failed", self.name, self.channel)
            with self.cond:
                self.failure = exc
                self.cond.notify_all()

    def _run(self) -> None:
        raise NotImplementedError

    def _check_failed(self) -> None:
        if self.failure is not None:
            raise TransportError(
                f"zmq: the {self.name} loop of channel {self.channel!r} failed: {self.failure!r}"
            ) from self.failure

    def _drain_monitor(self, mon: zmq.Socket, handle: Callable[[int, int, str], None]) -> None:
        while True:
            try:
                msg = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                ev = parse_monitor_message(msg)
            except Exception:  # noqa: BLE001 - a malformed monitor message is not fatal
                logger.debug("zmq: unparsable monitor message %r", msg)
                continue
            addr = ev["endpoint"].decode("utf-8", "replace") if isinstance(ev["endpoint"], bytes) else str(ev["endpoint"])
            handle(ev["event"], ev["value"], addr)

    def stop(self) -> None:
        """Stop the loop thread (bounded wait); the caller then closes the sockets."""
        with self.cond:
            self.stopping = True
            self.closed = True
            self.cond.notify_all()
        self.waker.wake()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10.0)
            if self.thread.is_alive():
                logger.error("zmq %s loop of channel %r did not stop within 10 s", self.name, self.channel)


# =========================================================================== receiver
class _Entry:
    # nbytes: memory held (meta + frames); size: the payload's tensor_blob size.
    __slots__ = ("payload", "error", "nbytes", "size")

    def __init__(self, payload: Any, error: OmnilinkError | None, nbytes: int, size: int) -> None:
        self.payload = payload
        self.error = error
        self.nbytes = nbytes
        self.size = size


class ReceiverLoop(_Loop):
    """Owns the bound ROUTER socket; indexes arrived payloads by key.

    Parameters
    ----------
    sock : zmq.Socket
        A bound ROUTER socket (the loop thread owns it from now on).
    max_buffered_bytes : int
        Bytes of unconsumed payloads after which the loop stops reading the socket.
    peer_timeout : float
        Seconds with no sender connected (after one was) before ``get`` raises
        ``PeerLostError``.
    """

    name = "receiver"

    def __init__(
        self,
        *,
        ctx: zmq.Context,
        sock: zmq.Socket,
        channel: str,
        endpoint: str,
        max_buffered_bytes: int,
        peer_timeout: float,
        max_frame_bytes: int | None = None,
    ) -> None:
        super().__init__(ctx=ctx, channel=channel, endpoint=endpoint)
        self.sock = sock
        # By-reference messages are read from the sending process's memory: only peers
        # on this host can be such a process, and only ipc peers are known to be local.
        self.accept_reference = endpoint.startswith("ipc://")
        self.max_frame_bytes = max_frame_bytes
        self.by_reference = 0
        self.pool = cma.BufferPool(max_buffers=4, max_bytes=min(256 << 20, max_buffered_bytes))
        # Second copy thread for large by-reference messages (created on first use).
        self.helper: concurrent.futures.ThreadPoolExecutor | None = None
        self.mon = sock.get_monitor_socket(_MON_EVENTS)
        self.max_buffered_bytes = max_buffered_bytes
        self.peer_timeout = peer_timeout
        self.index: dict[str, _Entry] = {}
        self.error_keys: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.consumed = ConsumedKeys()
        self.buffered = 0
        self.paused = False
        self.seen: collections.OrderedDict[tuple[bytes, int], tuple[int, str]] = collections.OrderedDict()
        # Peer liveness, from the ROUTER's monitor (see ``get``).
        self.live_fds: set[int] = set()
        self.had_peer = False
        self.no_peer_since: float | None = None
        self.last_peer = endpoint
        # A caller about to report every sender lost first has the loop take in what
        # already reached the socket (``_sync``): requests made, and the latest served.
        self.sync_req = 0
        self.sync_done = 0
        self.malformed = 0
        self.auth_failures = 0
        self.fallbacks = 0
        # Frames still referenced by payload views (index or user): stats' blocks_in_use.
        self._use_lock = threading.Lock()
        self.frames_live = 0
        self.frames_bytes = 0
        self._start()

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.waker.fd, zmq.POLLIN)
        poller.register(self.mon, zmq.POLLIN)
        reading = False
        while True:
            with self.cond:
                if self.stopping:
                    return
                want = not self.paused
            if want != reading:
                if want:
                    poller.register(self.sock, zmq.POLLIN)
                else:
                    poller.unregister(self.sock)
                reading = want
            events = dict(poller.poll())
            if self.waker.fd in events:
                self.waker.drain()
            with self.cond:
                # Read after the waker was drained: a request made before its wake-up is
                # served by this pass, one made after it finds the waker set again.
                sync = self.sync_req
            syncing = sync != self.sync_done
            if syncing or self.mon in events:
                self._drain_monitor(self.mon, self._on_event)
            if reading and (syncing or self.sock in events):
                self._drain_socket()
            if syncing:
                with self.cond:
                    self.sync_done = sync
                    self.cond.notify_all()

    def _drain_socket(self) -> None:
        for _ in range(READ_BATCH):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                raise zmq_error(exc, "receiving", channel=self.channel, endpoint=self.endpoint) from exc
            self._handle(frames)
            del frames
            with self.cond:
                if self.paused or self.stopping:
                    return
            # Ask zmq instead of raising Again (an exception per wake-up is not free).
            if not self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return

    def _handle(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 3:
            self.malformed += 1
            logger.warning(
                "zmq: channel %r dropped a message of %d frames (need routing + meta)", self.channel, len(frames) - 1
            )
            return
        identity = frames[0].bytes
        try:
            routing = wire.unpack_routing(frames[1].buffer)
        except BlobDecodeError as exc:
            # Without a valid routing frame there is no key to report the error under.
            self.malformed += 1
            logger.warning("zmq: channel %r dropped a message with a bad routing frame: %s", self.channel, exc)
            return
        seen_key = (routing.sender, routing.seq)
        prev = self.seen.get(seen_key)
        if prev is not None:
            # A resend after a reconnect: delivered already, ack again, deliver once.
            self._ack(identity, routing.seq, *prev)
            return
        key = routing.key
        if routing.flags & wire.FLAG_BY_REFERENCE:
            try:
                payload, error, nbytes, size = self._decode_reference(key, routing.n_regions, frames)
            except cma.CannotReference as exc:
                # Not remembered as seen: the sender resends the same seq as frames.
                logger.info("zmq: channel %r reads no sender memory, asking for frames: %s", self.channel, exc)
                frames.clear()
                self._ack(identity, routing.seq, wire.ACK_RESEND_AS_FRAMES, str(exc))
                return
            except cma.Withdrawn as exc:
                # The sender gave up on it (its put raised) or died: nobody waits for an ack.
                logger.debug("zmq: channel %r dropped key %r: %s", self.channel, key, exc)
                return
        else:
            payload, error, nbytes, size = self._decode(key, routing.n_regions, frames)
        # Drop this thread's references to the frames before the payload is published,
        # so a consumer that drops its views frees the frames at once.
        frames.clear()
        # Only this thread adds keys (consumers only remove them), so a key absent now
        # is still absent when we insert below. The ack goes out *before* the payload
        # is published: a consumer woken by it cannot finish, close the connector and
        # drop the queued ack (which would leave an already delivered put in doubt),
        # and the ack does not wait behind the consumer for the GIL.
        with self.cond:
            duplicate = key in self.index
            if not duplicate:
                # Before the ack: a get that follows the put's return must not find the
                # key still remembered as consumed (from an earlier use of it).
                self.consumed.forget(key)
        if duplicate:
            text = (
                f"key {key!r} is already waiting on the receiver of channel {self.channel!r}; "
                "a key can be reused only after it was consumed or discarded"
            )
            # Not remembered as seen: the same message resent later may then be accepted.
            logger.warning("zmq: %s", text)
            self._ack(identity, routing.seq, wire.ACK_DUPLICATE_KEY, text)
            return
        status = wire.ACK_OK if error is None else wire.ACK_DECODE_ERROR
        text = "" if error is None else str(error)
        self.seen[seen_key] = (status, text)
        if len(self.seen) > SEEN_WINDOW:
            self.seen.popitem(last=False)
        self._ack(identity, routing.seq, status, text)
        if error is not None:
            nbytes = ERROR_ENTRY_BYTES
        with self.cond:
            self.index[key] = _Entry(payload, error, nbytes, size)
            payload = None  # the index holds it now (see frames.clear() above)
            if error is not None:
                self._add_error_key(key)
            self.buffered += nbytes
            if self.buffered >= self.max_buffered_bytes:
                self.paused = True
            self.cond.notify_all()

    def _add_error_key(self, key: str) -> None:
        """Under ``cond``: remember an error entry; drop the oldest past the cap."""
        errs = self.error_keys
        errs[key] = None
        while len(errs) > MAX_ERROR_ENTRIES:
            old, _ = errs.popitem(last=False)
            entry = self.index.get(old)
            if entry is not None and entry.error is not None:
                del self.index[old]
                self._consumed(entry)
                logger.warning(
                    "zmq: channel %r dropped the error entry of key %r (more than %d malformed "
                    "messages waiting)", self.channel, old, MAX_ERROR_ENTRIES,
                )

    def _decode(
        self, key: str, n_regions: int, frames: list[zmq.Frame]
    ) -> tuple[Any, OmnilinkError | None, int, int]:
        """(payload, error, bytes held, encoded size) of one message's frames."""
        regions = frames[3:]
        if len(regions) != n_regions:
            return None, BlobDecodeError(
                f"zmq: message for key {key!r} on channel {self.channel!r} has {len(regions)} tensor "
                f"frames but its routing frame announces {n_regions}"
            ), 0, 0
        meta = frames[2].buffer
        buffers = [f.buffer for f in regions]
        try:
            # Frames sit at any address; blob copies a region misaligned for its dtype.
            payload, copied = decode_parts_counted(meta, buffers, copy=False, view_readonly=True)
            self.fallbacks += copied
        except Exception as exc:  # noqa: BLE001 - hostile input must not kill the loop
            # No traceback: it would keep the frames alive through decode's locals.
            cause = exc.with_traceback(None)
            kind = type(exc) if isinstance(exc, BlobDecodeError) else BlobDecodeError
            error = kind(f"zmq: payload of key {key!r} on channel {self.channel!r} is malformed: {exc}")
            error.__cause__ = cause
            return None, error, 0, 0
        for frame, buf in zip(regions, buffers):
            self._track(frame, buf.nbytes)
        nbytes = meta.nbytes + sum(buf.nbytes for buf in buffers)
        return payload, None, nbytes, _blob.peek_header(meta)[2]

    def _decode_reference(
        self, key: str, n_regions: int, frames: list[zmq.Frame]
    ) -> tuple[Any, OmnilinkError | None, int, int]:
        """Like ``_decode`` for a by-reference message: copy its regions out of the
        sender with ``process_vm_readv`` into one aligned buffer, then decode views of it.

        Raises ``cma.CannotReference`` (ask for frames) or ``cma.Withdrawn`` (drop).
        """
        where = f"zmq: by-reference message for key {key!r} on channel {self.channel!r}"
        if not self.accept_reference:
            raise cma.CannotReference(f"{self.endpoint} is not an ipc endpoint")
        if len(frames) != 4:
            return None, BlobDecodeError(f"{where} has {len(frames) - 3} frames after its meta, expected 1"), 0, 0
        meta = frames[2].buffer
        try:
            ref = wire.unpack_reference(frames[3].buffer, n_regions)
            data_len = _blob.peek_header(meta)[1]
        except BlobDecodeError as exc:
            return None, BlobDecodeError(f"{where} is malformed: {exc}"), 0, 0
        lengths = [n for _, n in ref.regions]
        if sum(lengths) > data_len:
            return None, BlobDecodeError(
                f"{where} lists {sum(lengths)} region bytes, its header holds {data_len}"
            ), 0, 0
        if self.max_frame_bytes is not None and max(lengths, default=0) > self.max_frame_bytes:
            return None, BlobDecodeError(
                f"{where} has a region of {max(lengths)} bytes, more than max_frame_bytes={self.max_frame_bytes}"
            ), 0, 0
        try:
            buf, views = cma.read_regions(
                ref.pid, ref.token_addr, ref.nonce, ref.regions, self.pool, self._helper(sum(lengths))
            )
        except MemoryError as exc:
            return None, BlobDecodeError(f"{where}: cannot allocate {sum(lengths)} bytes: {exc}"), 0, 0
        try:
            payload = decode_parts(meta, views, copy=False, view_readonly=True)
        except Exception as exc:  # noqa: BLE001 - hostile input must not kill the loop
            cause = exc.with_traceback(None)
            kind = type(exc) if isinstance(exc, BlobDecodeError) else BlobDecodeError
            error = kind(f"{where} is malformed: {exc}")
            error.__cause__ = cause
            return None, error, 0, 0
        nbytes = sum(lengths)
        self._track(buf, nbytes)
        self.by_reference += 1
        return payload, None, meta.nbytes + nbytes, _blob.peek_header(meta)[2]

    def _helper(self, nbytes: int) -> concurrent.futures.ThreadPoolExecutor | None:
        if nbytes < cma.PARALLEL_MIN_BYTES or (os.cpu_count() or 1) < 2:
            return None
        if self.helper is None:
            self.helper = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"omnilink-zmq-copy-{self.channel}"
            )
        return self.helper

    def _track(self, frame: Any, nbytes: int) -> None:
        with self._use_lock:
            self.frames_live += 1
            self.frames_bytes += nbytes
        weakref.finalize(frame, self._untrack, nbytes)

    def _untrack(self, nbytes: int) -> None:
        with self._use_lock:
            self.frames_live -= 1
            self.frames_bytes -= nbytes

    def _ack(self, identity: bytes, seq: int, status: int, text: str) -> None:
        try:
            self.sock.send_multipart([identity, wire.pack_ack(seq, status, text)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # The sender went away (or its ack pipe is full): it resends on reconnect and
            # the resend is acked again, so a lost ack loses no payload.
            logger.debug("zmq: ack of seq %d on channel %r not sent: %s", seq, self.channel, exc)

    def _on_event(self, event: int, value: int, addr: str) -> None:
        with self.cond:
            if event == zmq.EVENT_ACCEPTED:
                self.live_fds.add(value)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.had_peer = True
                self.no_peer_since = None
            elif event == zmq.EVENT_DISCONNECTED:
                self.live_fds.discard(value)
                if not self.live_fds and self.had_peer and self.no_peer_since is None:
                    self.no_peer_since = time.monotonic()
            elif event in _HANDSHAKE_FAILED:
                self.auth_failures += 1
                logger.warning(
                    "zmq: channel %r refused a connection on %s: %s", self.channel, addr, _HANDSHAKE_FAILED[event]
                )
            self.cond.notify_all()

    # --------------------------------------------------------------- callers
    def _lost_at(self) -> float | None:
        """Under ``cond``: when every sender counts as lost (``no_peer_since`` +
        ``peer_timeout``), or ``None``. A connection accepted and not yet through its
        handshake is a sender coming (a replacement of the one that left): not lost
        while it is open; if its handshake fails, zmq closes it and the clock that was
        running goes on."""
        if self.no_peer_since is None or self.live_fds:
            return None
        return self.no_peer_since + self.peer_timeout

    def _sync(self, deadline: Deadline) -> None:
        """Under ``cond``: have the loop read the monitor and the socket once now, and
        wait for it (at most ``SYNC_S``, within ``deadline``). Connection events and
        messages reach the loop thread asynchronously: a ``get`` made just after a new
        sender connected and sent would otherwise see only the old sender's loss, and
        report it (the shm backend looks at its senders table under the mutex in each
        ``get`` for the same reason)."""
        self.sync_req += 1
        req = self.sync_req
        self.waker.wake()
        limit = Deadline(SYNC_S)
        while self.sync_done < req and not self.closed and self.failure is None:
            wait = limit.remaining()
            left = deadline.remaining()
            if left is not None:
                wait = min(wait, left)
            if wait <= 0:
                return
            self.cond.wait(wait)

    def take(
        self, key: str, deadline: Deadline, block: bool, on_timeout: Callable[[float | None], OmnilinkError]
    ) -> tuple[Any, int]:
        """Pop ``key``'s payload and its encoded size, waiting until it arrives, the
        deadline passes, or every sender is lost."""
        synced = False
        with self.cond:
            while True:
                if self.closed:
                    raise ClosedError(f"zmq connector on channel {self.channel!r} is closed")
                entry = self.index.pop(key, None)
                if entry is not None:
                    self._consumed(entry)
                    self.consumed.add(key)
                    if entry.error is not None:
                        self.error_keys.pop(key, None)
                        raise entry.error
                    return entry.payload, entry.size
                if key in self.consumed:
                    raise self.consumed.error("zmq", self.channel, key)
                self._check_failed()
                if not block:
                    raise WouldBlock(f"zmq: key {key!r} has not arrived on channel {self.channel!r}")
                now = time.monotonic()
                lost_at = self._lost_at()
                if lost_at is not None and now >= lost_at:
                    if not synced:
                        synced = True
                        self._sync(deadline)
                        continue  # look at the index and the peers again
                    raise PeerLostError(
                        f"zmq: every sender of channel {self.channel!r} ({self.endpoint}) disconnected "
                        f"{now - self.no_peer_since:.1f} s ago and none came back within "
                        f"peer_timeout={self.peer_timeout} s; key {key!r} never arrived"
                    )
                remaining = deadline.remaining()
                if remaining is not None and remaining <= 0:
                    raise on_timeout(deadline.timeout)
                wait = remaining
                if lost_at is not None:
                    wait = lost_at - now if wait is None else min(wait, lost_at - now)
                self.cond.wait(wait)

    def arrivals(self, known: set[str], timeout: float) -> set[str]:
        """Keys ready to ``take`` now, taking none (for ``aget``): returns as soon as one
        is not in ``known``, or after ``timeout``; raises when nothing can come any more."""
        deadline = Deadline(timeout)
        synced = False
        with self.cond:
            while True:
                if self.closed:
                    raise ClosedError(f"zmq connector on channel {self.channel!r} is closed")
                avail = set(self.index)
                if not avail <= known:
                    return avail
                self._check_failed()
                now = time.monotonic()
                lost_at = self._lost_at()
                if lost_at is not None and now >= lost_at:
                    if not synced:
                        synced = True
                        self._sync(deadline)
                        continue
                    raise PeerLostError(
                        f"zmq: every sender of channel {self.channel!r} ({self.endpoint}) disconnected "
                        f"{now - self.no_peer_since:.1f} s ago and none came back within "
                        f"peer_timeout={self.peer_timeout} s"
                    )
                remaining = deadline.remaining()
                if not remaining:
                    return avail
                self.cond.wait(remaining if lost_at is None else min(remaining, lost_at - now))

    def _consumed(self, entry: _Entry) -> None:
        self.buffered -= entry.nbytes
        if self.paused and self.buffered < self.max_buffered_bytes:
            self.paused = False
            self.waker.wake()

    def discard(self, key: str) -> bool:
        with self.cond:
            entry = self.index.pop(key, None)
            if entry is None:
                return False
            self._consumed(entry)
            self.consumed.add(key, "discarded")
            self.error_keys.pop(key, None)
            return True

    def in_use(self) -> tuple[int, int]:
        with self._use_lock:
            return self.frames_live, self.frames_bytes

    def close(self) -> None:
        self.stop()
        with self.cond:
            self.index.clear()
            self.error_keys.clear()
            self.buffered = 0
        self.pool.clear()
        helper, self.helper = self.helper, None
        if helper is not None:
            helper.shutdown(wait=True)
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.mon.close(linger=0)
        # A short linger lets acks already queued reach their senders (a put whose ack
        # is dropped here would be in doubt although delivered); bounded, so a dead
        # sender cannot hold close() up.
        self.sock.close(linger=ACK_LINGER_MS)
        self.waker.close()


# ============================================================================= sender
QUEUED, SENDING, SENT, ACKED, CANCELLED = "queued", "sending", "sent", "acked", "cancelled"


class _Pending:
    __slots__ = ("seq", "key", "parts", "tracker", "state", "status", "text", "epoch", "token", "regions")

    def __init__(
        self,
        seq: int,
        key: str,
        parts: list[Any],
        tracker: zmq.MessageTracker | None,
        token: cma.Token | None,
        regions: list[memoryview],
    ) -> None:
        self.seq = seq
        self.key = key
        self.parts: list[Any] | None = parts
        self.tracker = tracker
        # By reference: the token the receiver checks; regions kept for a frame resend.
        self.token = token
        self.regions: list[memoryview] | None = regions
        self.state = QUEUED
        self.status = -1
        self.text = ""
        self.epoch = -1


class SenderLoop:
    """Owns the DEALER socket connected to the receiver; sends, resends, collects acks.

    There is no sender thread: the threads blocked in ``send`` drive the socket
    themselves, one at a time (leader/follower). Whoever finds the socket free becomes
    the *driver*: it sends everything queued, then sleeps in ``zmq.Poller.poll`` on the
    socket, its monitor and an eventfd until an ack, a connection event or a new message
    arrives, and records every ack it reads (its own or another thread's) under
    ``cond``. The others wait on ``cond``; when the driver's own ack arrives it hands
    the socket back and wakes them, and one of them takes over. Compared with a loop
    thread this saves two thread hand-offs per ``put`` (caller -> loop to send, loop ->
    caller for the ack), about a third of the 4 KiB latency.

    ::

        put A (driver)        put B (follower)         zmq socket
        ------------------    --------------------     ----------
        queue A, take socket
        send A  --------------------------------------> A
        poll ...              queue B, wake driver
        send B  --------------------------------------> B
        poll ... ack B <------------------------------- ack B
        mark B acked, notify  wakes: B acked, returns
        poll ... ack A <------------------------------- ack A
        return; socket free   (next put drives)

    While no ``put`` waits nobody reads the socket: connection events queue up in the
    monitor and are handled when the next ``put`` drives (the ack direction carries
    nothing unsolicited). ZMQ's I/O thread keeps connecting, reconnecting and exchanging
    heartbeats on its own.

    Parameters
    ----------
    make_socket : callable
        Returns a new connected DEALER socket (called again after a reset).
    copy_threshold : int
        Regions of at least this many bytes go as zero-copy tracked frames; smaller
        ones are copied into the message (cheaper than tracking them).
    peer_timeout : float
        Seconds the receiver may stay disconnected (after a first connection) before a
        waiting ``put`` raises ``PeerLostError``.
    reference_threshold : int or None
        Messages whose regions total at least this many bytes are sent by reference
        (``cma``); ``None``: never (tcp endpoints, or switched off).
    """

    name = "sender"

    def __init__(
        self,
        *,
        ctx: zmq.Context,
        make_socket: Callable[[], zmq.Socket],
        channel: str,
        endpoint: str,
        copy_threshold: int,
        peer_timeout: float,
        reference_threshold: int | None = None,
    ) -> None:
        self.ctx = ctx
        self.reference_threshold = reference_threshold if cma.available() else None
        self.channel = channel
        self.endpoint = endpoint
        self.cond = threading.Condition()
        self.waker = _Waker()
        self.closed = False
        self.failure: BaseException | None = None
        self.make_socket = make_socket
        self.copy_threshold = copy_threshold
        self.peer_timeout = peer_timeout
        self.sender_id = os.urandom(wire.SENDER_ID_BYTES)
        self.next_seq = 0
        self.pending: dict[int, _Pending] = {}
        self.outbox: collections.deque[int] = collections.deque()
        self.epoch = 0
        self.connected = False
        self.ever_connected = False
        self.disconnected_since: float | None = None
        self.refused: str | None = None
        self.reset_requested = 0
        self.reset_done = 0
        # True while one thread owns the socket (see the class docstring).
        self.driving = False
        self.sock_closed = False
        self._poller: zmq.Poller | None = None
        self._polled: zmq.Socket | None = None
        self.connect_retries = 0
        self.sock = make_socket()
        self.mon = self.sock.get_monitor_socket(_SENDER_MON_EVENTS)

    def wait_connected(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the connection to the receiver to be up (its
        handshake done), before any ``put``: called once, by the thread that made the
        loop, while no other thread can use the sockets. Returns early, ``False``, when
        the receiver refused the connection or nobody listens at the endpoint (a sender
        may start before its receiver: that is not waited for).

        A sender whose constructor returned is then a live peer to a receiver that is
        up, as an shm sender is once it joined the channel: a ``get`` made at once, as
        this sender's first ``put`` starts, cannot find every sender lost because the
        connection was still being made (the receiver learns of it with
        ``ReceiverLoop._sync``)."""
        deadline = Deadline(timeout)
        while True:
            self._drain_monitor()
            with self.cond:
                if self.connected:
                    return True
                if self.refused is not None or self.connect_retries:
                    return False
            left = deadline.remaining()
            if not left or not self.mon.poll(max(1, int(left * 1000))):
                with self.cond:
                    return self.connected

    # ------------------------------------------------------------ driving
    def _take_socket(self) -> bool:
        """Under ``cond``: become the driver if nobody is; else ask the driver to look
        at the outbox / reset request (it sleeps in poll)."""
        if self.driving:
            self.waker.wake()
            return False
        self.driving = True
        return True

    def _release_socket(self) -> None:
        with self.cond:
            self.driving = False
            self.cond.notify_all()

    def _drive(self, timeout: float | None) -> None:
        """One turn of the driver: reset if asked, send, wait up to ``timeout`` s, read.

        Called without ``cond`` by the thread that took the socket. Any zmq failure is
        recorded as ``failure`` for every waiter.
        """
        try:
            with self.cond:
                reset = self.reset_requested > self.reset_done
            if reset:
                self._reset_socket()
            # Connection events that queued while nobody drove come first: a handshake
            # seen only after sending would requeue (and resend) what was just sent.
            if self.mon.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._drain_monitor()
                # They may have started the peer_timeout clock: let the caller work out
                # its wait again before sleeping.
                return
            self._send_queued()
            with self.cond:
                want_out = bool(self.outbox)
            events = self._poll(timeout, want_out)
            if events.get(self.waker.fd):
                self.waker.drain()
            if events.get(self.mon):
                self._drain_monitor()
            ev = events.get(self.sock, 0)
            if ev & zmq.POLLIN:
                self._drain_acks()
            if ev & zmq.POLLOUT:
                self._send_queued()
        except Exception as exc:  # noqa: BLE001 - reported to every waiter, then logged
            logger.exception("zmq sender of channel %r failed", self.channel)
            with self.cond:
                self.failure = exc
                self.cond.notify_all()

    def _poll(self, timeout: float | None, want_out: bool) -> dict[Any, int]:
        poller = self._poller
        if poller is None or self._polled is not self.sock:
            # First turn, or the socket was reset: a poller for the current sockets.
            poller = self._poller = zmq.Poller()
            poller.register(self.waker.fd, zmq.POLLIN)
            poller.register(self.mon, zmq.POLLIN)
            self._polled = self.sock
        poller.register(self.sock, zmq.POLLIN | (zmq.POLLOUT if want_out else 0))
        return dict(poller.poll(None if timeout is None else max(0.0, timeout * 1000.0)))

    def _drain_monitor(self) -> None:
        _Loop._drain_monitor(self, self.mon, self._on_event)  # type: ignore[arg-type]

    def _send_queued(self) -> None:
        while True:
            with self.cond:
                while self.outbox and self.pending.get(self.outbox[0], None) is None:
                    self.outbox.popleft()
                if not self.outbox:
                    return
                p = self.pending[self.outbox[0]]
                if p.state != QUEUED:
                    self.outbox.popleft()
                    continue
                p.state = SENDING
                parts = p.parts
                # Only tracked frames need copy=False; plain bytes parts are cheaper copied.
                zero_copy = p.tracker is not None
            try:
                self.sock.send_multipart(parts, zmq.NOBLOCK, copy=not zero_copy)
            except zmq.Again:
                with self.cond:
                    p.state = QUEUED
                    self.cond.notify_all()
                return
            except zmq.ZMQError as exc:
                with self.cond:
                    p.state = QUEUED
                raise zmq_error(exc, "sending", channel=self.channel, endpoint=self.endpoint) from exc
            with self.cond:
                self.outbox.popleft()
                p.state = SENT
                p.epoch = self.epoch
                self.cond.notify_all()

    def _drain_acks(self) -> None:
        while True:
            if not self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                raise zmq_error(exc, "receiving acks", channel=self.channel, endpoint=self.endpoint) from exc
            try:
                if len(frames) != 1:
                    raise BlobDecodeError(f"ack of {len(frames)} frames")
                seq, status, text = wire.unpack_ack(frames[0])
            except BlobDecodeError as exc:
                logger.warning("zmq: channel %r ignored a malformed ack: %s", self.channel, exc)
                continue
            with self.cond:
                p = self.pending.get(seq)
                if status == wire.ACK_RESEND_AS_FRAMES:
                    # A second answer to a by-reference copy that was sent twice (a
                    # requeue after the handshake) is stale once frames were queued.
                    if p is not None and p.state in (QUEUED, SENT) and p.token is not None:
                        self._resend_as_frames(p, text)
                    continue
                if p is not None and p.state in (QUEUED, SENT):
                    p.state = ACKED
                    p.status = status
                    p.text = text
                    self.cond.notify_all()

    def _resend_as_frames(self, p: _Pending, why: str) -> None:
        """Under ``cond``: the receiver cannot read our memory; send ``p`` again as frames."""
        if self.reference_threshold is not None:
            logger.info(
                "zmq: channel %r: the receiver at %s cannot read this process's memory (%s); "
                "sending frames from now on",
                self.channel,
                self.endpoint,
                why,
            )
            self.reference_threshold = None
        p.token.invalidate()
        p.token = None
        parts, p.tracker = self._frame_parts(p.parts[1], p.regions)
        parts[0] = wire.pack_routing(p.key, self.sender_id, p.seq, len(p.regions))
        p.parts = parts
        p.state = QUEUED
        self.outbox.append(p.seq)

    def _on_event(self, event: int, value: int, addr: str) -> None:
        with self.cond:
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
                self.ever_connected = True
                self.disconnected_since = None
                self.refused = None
                self.epoch += 1
                self._requeue_sent()
            elif event == zmq.EVENT_DISCONNECTED:
                if self.connected and self.disconnected_since is None:
                    self.disconnected_since = time.monotonic()
                self.connected = False
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.connect_retries += 1
            elif event in _HANDSHAKE_FAILED:
                self.refused = _HANDSHAKE_FAILED[event]
                logger.warning(
                    "zmq: channel %r: receiver at %s refused the connection: %s",
                    self.channel,
                    self.endpoint,
                    self.refused,
                )
            self.cond.notify_all()

    def _requeue_sent(self) -> None:
        # Messages sent before this (re)connection may have died with the old one; the
        # receiver drops the ones it already has and acks them again.
        for seq in sorted(self.pending):
            p = self.pending[seq]
            if p.state == SENT and p.epoch < self.epoch:
                p.state = QUEUED
                self.outbox.append(seq)

    def _reset_socket(self) -> None:
        """Drop everything zmq queued for the receiver: close with linger 0, reconnect."""
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.mon.close(linger=0)
        self.sock.close(linger=0)
        self.sock = self.make_socket()
        self.mon = self.sock.get_monitor_socket(_SENDER_MON_EVENTS)
        with self.cond:
            self.connected = False
            self.epoch += 1
            self._requeue_sent()
            self.reset_done = self.reset_requested
            self.cond.notify_all()

    # --------------------------------------------------------------- callers
    def _frame_parts(self, meta: bytes, regions: list[memoryview]) -> tuple[list[Any], zmq.MessageTracker | None]:
        """``[None (routing, filled in later), meta, region frames...]`` and the tracker
        of the zero-copy frames."""
        tracked: list[zmq.Frame] = []
        parts: list[Any] = [None, meta]
        for r in regions:
            if r.nbytes >= self.copy_threshold:
                f = zmq.Frame(r, copy=False, track=True)
                tracked.append(f)
                parts.append(f)
            else:
                parts.append(bytes(r))
        tracker = zmq.MessageTracker(*tracked) if tracked else None
        return parts, tracker

    def send(
        self,
        key: str,
        meta: bytes,
        regions: list[memoryview],
        deadline: Deadline,
        on_timeout: Callable[[float | None, str], OmnilinkError],
    ) -> tuple[int, str]:
        """Queue one message and wait for its ack; return ``(status, text)``."""
        threshold = self.reference_threshold
        token: cma.Token | None = None
        if threshold is not None and sum(r.nbytes for r in regions) >= threshold:
            token = cma.Token()
            ref = wire.pack_reference(
                os.getpid(), token.address, token.nonce, [(cma.address_of(r), r.nbytes) for r in regions]
            )
            parts, tracker = [None, meta, ref], None
        else:
            parts, tracker = self._frame_parts(meta, regions)
        with self.cond:
            if self.closed:
                raise ClosedError(f"zmq connector on channel {self.channel!r} is closed")
            if self.failure is not None:
                raise TransportError(
                    f"zmq: the sender of channel {self.channel!r} failed: {self.failure!r}"
                ) from self.failure
            seq = self.next_seq
            self.next_seq += 1
            flags = 0 if token is None else wire.FLAG_BY_REFERENCE
            parts[0] = wire.pack_routing(key, self.sender_id, seq, len(regions), flags)
            p = _Pending(seq, key, parts, tracker, token, regions)
            self.pending[seq] = p
            self.outbox.append(seq)
        del parts
        # The peer_timeout clock of this put starts no earlier than the put itself: a
        # receiver that went away while no put was waiting (and restarted since, or is
        # restarting) gets a full peer_timeout to be connected to again, and connection
        # events queued meanwhile are read before the clock can run out.
        started = time.monotonic()
        error: OmnilinkError | None = None
        while True:
            with self.cond:
                if p.state == ACKED:
                    del self.pending[seq]
                    if p.token is not None:
                        p.token.invalidate()  # the receiver has read it: see cma.py
                    p.parts = p.regions = None
                    return p.status, p.text
                if self.closed:
                    error = ClosedError(f"zmq connector on channel {self.channel!r} was closed during put")
                    break
                if self.failure is not None:
                    error = TransportError(
                        f"zmq: the sender of channel {self.channel!r} failed: {self.failure!r}"
                    )
                    break
                now = time.monotonic()
                lost_at = (
                    None
                    if self.disconnected_since is None
                    else max(self.disconnected_since, started) + self.peer_timeout
                )
                if lost_at is not None and now >= lost_at:
                    error = PeerLostError(
                        f"zmq: the receiver of channel {self.channel!r} at {self.endpoint} disconnected "
                        f"{now - self.disconnected_since:.1f} s ago and did not come back within "
                        f"peer_timeout={self.peer_timeout} s of this put; put of key {key!r} not "
                        "acknowledged (zmq keeps reconnecting: a later put waits for the receiver again)"
                    )
                    break
                remaining = deadline.remaining()
                if remaining is not None and remaining <= 0:
                    if self.refused:
                        why = f"the receiver refused the connection ({self.refused})"
                    elif not self.ever_connected:
                        why = "the receiver never connected"
                    elif p.state == QUEUED:
                        why = "the message could not be handed to zmq (receiver absent or high-water mark reached)"
                    else:
                        why = "the receiver did not acknowledge it (its buffer may be full)"
                    error = on_timeout(deadline.timeout, why)
                    break
                wait = remaining
                if lost_at is not None:
                    wait = lost_at - now if wait is None else min(wait, lost_at - now)
                drive = self._take_socket()
                if not drive:
                    self.cond.wait(wait)
                    continue
            try:
                self._drive(wait)
            finally:
                self._release_socket()
        self._abandon(p)
        raise error

    def _abandon(self, p: _Pending) -> None:
        """Take ``p`` back from zmq so the caller's tensors are free when put raises."""
        with self.cond:
            self.pending.pop(p.seq, None)
            if p.token is not None:
                # A receiver reading it now finds the token gone and drops the copy.
                p.token.invalidate()
            handed = p.state in (SENDING, SENT)
            p.state = CANCELLED
            p.parts = p.regions = None
            tracker, p.tracker = p.tracker, None
            if tracker is None or not handed:
                return
        # Fast path: zmq already wrote the message out and let go of the buffers.
        try:
            tracker.wait(0.05)
            return
        except zmq.NotDone:
            pass
        with self.cond:
            if not self.closed:
                self.reset_requested += 1
                target = self.reset_requested
                end = time.monotonic() + RELEASE_GRACE_S
                while self.reset_done < target and not self.closed and self.failure is None:
                    if self._take_socket():
                        # Nobody drives: reset it ourselves (outside cond).
                        self.cond.release()
                        try:
                            try:
                                self._reset_socket()
                            except Exception as exc:  # noqa: BLE001 - like _drive
                                logger.exception("zmq sender of channel %r failed", self.channel)
                                with self.cond:
                                    self.failure = exc
                        finally:
                            self.cond.acquire()
                            self.driving = False
                            self.cond.notify_all()
                        continue
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self.cond.wait(left)
        try:
            tracker.wait(RELEASE_GRACE_S)
        except zmq.NotDone:
            logger.error(
                "zmq: channel %r: zmq still holds the buffers of key %r %.0f s after the socket "
                "was reset; do not modify its tensors yet",
                self.channel,
                p.key,
                RELEASE_GRACE_S,
            )

    def status(self) -> dict[str, Any]:
        with self.cond:
            return {
                "connected": self.connected,
                "pending": len(self.pending),
                "refused": self.refused,
                "by_reference": self.reference_threshold is not None,
            }

    def close(self) -> None:
        """Wake every waiting ``put`` (they raise ``ClosedError``), wait for the driver to
        hand the socket back (bounded), then close it."""
        with self.cond:
            if self.sock_closed:
                return
            self.closed = True
            self.cond.notify_all()
            self.waker.wake()
            end = time.monotonic() + 10.0
            while self.driving:
                left = end - time.monotonic()
                if left <= 0:
                    logger.error("zmq sender of channel %r: a put did not release the socket within 10 s", self.channel)
                    return
                self.cond.wait(left)
            self.driving = True  # nobody may take it again
            self.sock_closed = True
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.mon.close(linger=0)
        self.sock.close(linger=0)
        self.waker.close()
