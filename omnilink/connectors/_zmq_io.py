"""The zmq backend's two I/O loops: ``ReceiverLoop`` (ROUTER) and ``SenderLoop`` (DEALER).

ZMQ sockets are not thread-safe, so each socket is owned by one thread, its loop; the
callers' threads talk to a loop through a ``threading.Condition`` (results, index) and an
eventfd that wakes the loop's ``zmq.Poller``. Nothing sleeps: a loop sleeps in
``poll()`` until its socket, its monitor or its eventfd is ready, and a caller sleeps in
``Condition.wait`` until a loop notifies it (or its deadline passes).

Sender message states (guarded by ``SenderLoop.cond``)::

              submit()             loop: send_multipart ok
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
    the caller's memory is never read after ``put`` returned or raised.

Receiver: the loop reads whole multipart messages, validates and decodes each one into
zero-copy views of its frames, indexes it by key and acks it. When the index holds
``max_buffered_bytes`` or more, the loop stops reading the ROUTER (it polls only its
eventfd and monitor) so ZMQ's high-water marks and the kernel's socket buffers push back
on the senders; ``get`` wakes it once the index drains below the limit.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

import msgspec
import numpy as np
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
from omnilink._util import Deadline
from omnilink.connectors import _zmq_wire as wire
from omnilink.connectors._zmq_support import zmq_error

__all__ = ["ReceiverLoop", "SenderLoop"]

logger = logging.getLogger(__name__)

# Indirection so tests can observe the exact frame buffers handed to the decoder.
decode_parts = _blob.decode_parts

#: How many (sender, seq) pairs a receiver remembers to drop resent duplicates.
SEEN_WINDOW = 1 << 16
#: Longest a give-up path waits for zmq to let go of the caller's buffers.
RELEASE_GRACE_S = 5.0
#: Messages read per poll wake-up before re-checking the pause and stop flags.
READ_BATCH = 64

_MON_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication refused",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
}


_ITEMSIZE = {code: size for code, size in _blob.DTYPE_CODES.values()}
_HEADER = msgspec.msgpack.Decoder(_blob.BlobHeader)


def _aligned(meta: memoryview, buffers: list[memoryview]) -> tuple[list[memoryview], int]:
    """Copy, into 64-byte aligned memory, each region whose address does not suit its dtype.

    libzmq hands out frames at any address: small ones live inside a shared receive
    buffer, large ones are 8-byte aligned, so a complex128 view may be misaligned. A
    typed view of misaligned memory is undefined behaviour (torch crashes cloning some),
    so such a region is copied here, once, and counted as a fallback. Anything malformed
    is left for ``decode_parts`` to report.
    """
    try:
        header_len = _blob.peek_header(meta)[0]
        header = _HEADER.decode(meta[_blob.PREFIX_SIZE : _blob.PREFIX_SIZE + header_len])
    except (BlobDecodeError, msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return buffers, 0
    if len(header.tensors) != len(buffers):
        return buffers, 0
    out = buffers
    copied = 0
    for i, (desc, buf) in enumerate(zip(header.tensors, buffers)):
        size = _ITEMSIZE.get(desc.dtype, 1)
        if size <= 1 or not buf.nbytes:
            continue
        addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        if addr % size == 0:
            continue
        raw = np.empty(buf.nbytes + _blob.FRAME_ALIGN, dtype=np.uint8)
        start = -raw.ctypes.data % _blob.FRAME_ALIGN
        dst = raw[start : start + buf.nbytes]
        dst[:] = np.frombuffer(buf, dtype=np.uint8)
        if out is buffers:
            out = list(buffers)
        out[i] = memoryview(dst)
        copied += 1
    return out, copied


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
    ) -> None:
        super().__init__(ctx=ctx, channel=channel, endpoint=endpoint)
        self.sock = sock
        self.mon = sock.get_monitor_socket(_MON_EVENTS)
        self.max_buffered_bytes = max_buffered_bytes
        self.peer_timeout = peer_timeout
        self.index: dict[str, _Entry] = {}
        self.buffered = 0
        self.paused = False
        self.seen: collections.OrderedDict[tuple[bytes, int], tuple[int, str]] = collections.OrderedDict()
        # Peer liveness, from the ROUTER's monitor (see ``get``).
        self.live_fds: set[int] = set()
        self.had_peer = False
        self.no_peer_since: float | None = None
        self.last_peer = endpoint
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
            if self.mon in events:
                self._drain_monitor(self.mon, self._on_event)
            if reading and self.sock in events:
                self._drain_socket()

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
        payload, error, nbytes, size = self._decode(key, routing.n_regions, frames)
        # Drop this thread's references to the frames before the payload is published,
        # so a consumer that drops its views frees the frames at once.
        frames.clear()
        text = ""
        with self.cond:
            if key in self.index:
                status = wire.ACK_DUPLICATE_KEY
                text = (
                    f"key {key!r} is already waiting on the receiver of channel {self.channel!r}; "
                    "a key can be reused only after it was consumed or discarded"
                )
            else:
                self.index[key] = _Entry(payload, error, nbytes, size)
                payload = None  # the index holds it now (see frames.clear() above)
                self.buffered += nbytes
                if self.buffered >= self.max_buffered_bytes:
                    self.paused = True
                self.cond.notify_all()
                status = wire.ACK_OK if error is None else wire.ACK_DECODE_ERROR
                text = "" if error is None else str(error)
        if status == wire.ACK_DUPLICATE_KEY:
            # Not remembered as seen: the same message resent later may then be accepted.
            logger.warning("zmq: %s", text)
        else:
            self.seen[seen_key] = (status, text)
            if len(self.seen) > SEEN_WINDOW:
                self.seen.popitem(last=False)
        self._ack(identity, routing.seq, status, text)

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
            buffers, copied = _aligned(meta, buffers)
            self.fallbacks += copied
            payload = decode_parts(meta, buffers, copy=False)
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

    def _track(self, frame: zmq.Frame, nbytes: int) -> None:
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
    def take(
        self, key: str, deadline: Deadline, block: bool, on_timeout: Callable[[float | None], OmnilinkError]
    ) -> tuple[Any, int]:
        """Pop ``key``'s payload and its encoded size, waiting until it arrives, the
        deadline passes, or every sender is lost."""
        with self.cond:
            while True:
                if self.closed:
                    raise ClosedError(f"zmq connector on channel {self.channel!r} is closed")
                entry = self.index.pop(key, None)
                if entry is not None:
                    self._consumed(entry)
                    if entry.error is not None:
                        raise entry.error
                    return entry.payload, entry.size
                self._check_failed()
                if not block:
                    raise WouldBlock(f"zmq: key {key!r} has not arrived on channel {self.channel!r}")
                now = time.monotonic()
                lost_at = None if self.no_peer_since is None else self.no_peer_since + self.peer_timeout
                if lost_at is not None and now >= lost_at:
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
            return True

    def in_use(self) -> tuple[int, int]:
        with self._use_lock:
            return self.frames_live, self.frames_bytes

    def close(self) -> None:
        self.stop()
        with self.cond:
            self.index.clear()
            self.buffered = 0
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.mon.close(linger=0)
        self.sock.close(linger=0)
        self.waker.close()


# ============================================================================= sender
QUEUED, SENDING, SENT, ACKED, CANCELLED = "queued", "sending", "sent", "acked", "cancelled"


class _Pending:
    __slots__ = ("seq", "key", "parts", "tracker", "state", "status", "text", "epoch")

    def __init__(self, seq: int, key: str, parts: list[Any], tracker: zmq.MessageTracker | None) -> None:
        self.seq = seq
        self.key = key
        self.parts: list[Any] | None = parts
        self.tracker = tracker
        self.state = QUEUED
        self.status = -1
        self.text = ""
        self.epoch = -1


class SenderLoop(_Loop):
    """Owns the DEALER socket connected to the receiver; sends, resends, collects acks.

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
    ) -> None:
        super().__init__(ctx=ctx, channel=channel, endpoint=endpoint)
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
        self.sock = make_socket()
        self.mon = self.sock.get_monitor_socket(_MON_EVENTS)
        self._start()

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.waker.fd, zmq.POLLIN)
        poller.register(self.mon, zmq.POLLIN)
        poller.register(self.sock, zmq.POLLIN)
        while True:
            with self.cond:
                if self.stopping:
                    return
                reset = self.reset_requested > self.reset_done
                want_out = bool(self.outbox)
            if reset:
                poller.unregister(self.sock)
                poller.unregister(self.mon)
                self._reset_socket()
                poller.register(self.mon, zmq.POLLIN)
                poller.register(self.sock, zmq.POLLIN)
                continue
            poller.modify(self.sock, zmq.POLLIN | (zmq.POLLOUT if want_out else 0))
            events = dict(poller.poll())
            if self.waker.fd in events:
                self.waker.drain()
            if self.mon in events:
                self._drain_monitor(self.mon, self._on_event)
            ev = events.get(self.sock, 0)
            if ev & zmq.POLLIN:
                self._drain_acks()
            if ev & zmq.POLLOUT:
                self._send_queued()

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
            try:
                self.sock.send_multipart(parts, zmq.NOBLOCK, copy=False)
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
                if p is not None and p.state in (QUEUED, SENT):
                    p.state = ACKED
                    p.status = status
                    p.text = text
                    self.cond.notify_all()

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
        self.mon = self.sock.get_monitor_socket(_MON_EVENTS)
        with self.cond:
            self.connected = False
            self.epoch += 1
            self._requeue_sent()
            self.reset_done = self.reset_requested
            self.cond.notify_all()

    # --------------------------------------------------------------- callers
    def build_parts(self, key: str, meta: bytes, regions: list[memoryview]) -> tuple[list[Any], zmq.MessageTracker | None]:
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
        parts, tracker = self.build_parts(key, meta, regions)
        with self.cond:
            if self.closed:
                raise ClosedError(f"zmq connector on channel {self.channel!r} is closed")
            self._check_failed()
            seq = self.next_seq
            self.next_seq += 1
            parts[0] = wire.pack_routing(key, self.sender_id, seq, len(regions))
            p = _Pending(seq, key, parts, tracker)
            self.pending[seq] = p
            self.outbox.append(seq)
        del parts
        self.waker.wake()
        error: OmnilinkError | None = None
        with self.cond:
            while True:
                if p.state == ACKED:
                    del self.pending[seq]
                    p.parts = None
                    return p.status, p.text
                if self.closed:
                    error = ClosedError(f"zmq connector on channel {self.channel!r} was closed during put")
                    break
                if self.failure is not None:
                    error = TransportError(
                        f"zmq: the sender loop of channel {self.channel!r} failed: {self.failure!r}"
                    )
                    break
                now = time.monotonic()
                lost_at = None if self.disconnected_since is None else self.disconnected_since + self.peer_timeout
                if lost_at is not None and now >= lost_at:
                    error = PeerLostError(
                        f"zmq: the receiver of channel {self.channel!r} at {self.endpoint} disconnected "
                        f"{now - self.disconnected_since:.1f} s ago and did not come back within "
                        f"peer_timeout={self.peer_timeout} s; put of key {key!r} not acknowledged"
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
                self.cond.wait(wait)
        self._abandon(p)
        raise error

    def _abandon(self, p: _Pending) -> None:
        """Take ``p`` back from zmq so the caller's tensors are free when put raises."""
        with self.cond:
            self.pending.pop(p.seq, None)
            handed = p.state in (SENDING, SENT)
            p.state = CANCELLED
            p.parts = None
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
                self.waker.wake()
                end = time.monotonic() + RELEASE_GRACE_S
                while self.reset_done < target and not self.closed and self.failure is None:
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
            }

    def close(self) -> None:
        self.stop()
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.mon.close(linger=0)
        self.sock.close(linger=0)
        self.waker.close()
