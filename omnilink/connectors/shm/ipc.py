"""The shm backend's device-IPC route: CUDA tensors GPU to GPU when both ends can.

When both ends of a channel are GPU processes of one host, a host bounce (device ->
page-locked arena -> device, about 50 GB/s over PCIe) is the wrong road: a device pool
the receiver owns (``omnilink.connectors.devpool``, what the ``cuda_ipc`` backend is
built on) takes a device-to-device copy (hundreds of GB/s). This route lets one
``ShmConnector`` use the pool's two ends itself, with no ``cuda_ipc`` connector and no
channel besides its own::

    receiver (device_ipc="auto")                 sender (device_ipc="auto")
    first get(device="cuda:k"), the channel's    put of a payload with >= ipc_min_bytes
    only receiver: open a PoolReceiver (its      of CUDA tensors: is there a live pool
    pool on cuda:k) for the channel              for this channel, owned by the channel's
                                                 only receiver? can our devices reach
                                                 its device? then: PoolSender.send (device
                                                 copy into the pool; a short wait for
                                                 room at most), whose message is
                                                 published on the shm channel under the
                                                 key, marked IPC_MARK
    get(key) claims the message on the shm <---  (otherwise, or on any failure of the
    channel; PoolReceiver.land: views of the     route: the host path, unchanged)
    pool on its current stream (host not
    blocked)

The shm channel stays the only place a receiver waits, and carries each routed
payload's one message (the pool's message: manifest and host part): keys, wake-ups,
timeouts and the key contract are the shm backend's, one claim and one decode per
payload. The message is published after the device copy is queued, so the receiver
finds it ready.

Modes (``device_ipc``): ``"auto"`` (default) as above; ``"on"``: the receiver opens
its pool when the connector opens (``ipc_device``, default the current device) and
the sender routes every CUDA payload that can go this way; ``"off"``: never.
``stats()`` counts ``ipc_puts`` / ``ipc_gets`` (device IPC) apart from
``device_puts`` / ``device_gets`` (the host-staged DMA path).

A payload the route could not take (no room in the pool in time, the pool's receiver
gone, ...) goes by the host path, counted in ``stats().ipc_fallbacks`` with the last
reason in ``ipc_fallback_reason``. ``discard`` gives a routed payload's pool block back
on either side.

Limits: one receiver per channel owns the pool (the pool's one-receiver, one-sender
rule): the sender checks, before each put by this route, that the shm channel's only
receiver is the pool's owner (cached until the channel's participants generation
moves); a second sender falls back to the host path.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from omnilink._errors import (
    BlobEncodeError,
    CapacityError,
    ConfigurationError,
    CudaError,
    OmnilinkError,
    PeerLostError,
    TransferTimeout,
    TransportError,
)
from omnilink._util import Deadline, duplicate_key
from omnilink.blob import prepare
from omnilink.cuda import mps_serving

if TYPE_CHECKING:  # the device pool loads at the route's first use: shm's import stays cheap
    from omnilink.connectors.devpool import PoolReceiver, PoolSender

__all__ = ["DeviceIpcRoute", "IPC_MARK", "MODES"]

logger = logging.getLogger(__name__)

#: The key under which a routed payload's pool message rides the shm channel.
IPC_MARK = "__omnilink_device_ipc__"
MODES = ("auto", "on", "off")
#: ``ipc_min_bytes`` of ``"auto"`` where device IPC is not faster at every size (see
#: ``DeviceIpcRoute.min_bytes_for``).
IPC_MIN_BYTES = 16 << 20
#: Seconds a route put waits for room in the receiver's pool before the host path.
ROOM_WAIT_S = 0.002
#: Seconds between looks for a receiver's pool while none was found. A look is one
#: ``stat`` per receiver of the channel (their pids cached until the channel's
#: participants change): a payload large enough for this route (``ipc_min_bytes``, 16
#: MiB by default) looks again, so none takes the host road once the pool is open.
PROBE_EVERY_S = 0.0005


class DeviceIpcRoute:
    """The device-IPC half of one ``ShmConnector`` (made when ``device_ipc`` is not "off").

    Parameters
    ----------
    conn : ShmConnector
        The connector it belongs to (its channel, roles, block primitives, counters).
    mode : {"auto", "on"}
    pool_bytes : int
        Size of the receiver's device pool.
    min_bytes : int or None
        In ``"auto"``, payloads with fewer bytes of CUDA tensors take the host path;
        ``None``: 0 while an MPS server serves this host (the payload's tensors on the
        pool's device or on another GPU that reaches it), else ``IPC_MIN_BYTES``
        (``min_bytes_for``).
    device : str, optional
        ``"on"``: the receiver's pool device (default: the current device).
    pool_max_bytes : int, optional
        The most the receiver's pool may grow to (``None``: from the free device memory).
    """

    def __init__(self, conn: Any, mode: str, pool_bytes: int, min_bytes: int | None, device: Any, *,
                 pool_max_bytes: int | None = None) -> None:
        # A weak proxy: the connector holds the route, and an unclosed connector must
        # still be cleaned when its last reference goes (no cycle to wait for).
        self.conn = weakref.proxy(conn)
        self.mode = mode
        self.pool_bytes = pool_bytes
        self.pool_max_bytes = pool_max_bytes
        self.min_bytes = min_bytes if mode == "auto" else 0
        #: whether an MPS server serves this host (looked up at the first payload)
        self._mps: bool | None = None
        self._lock = threading.Lock()
        #: the device operations both ends use (made with the first end)
        self._ops: Any = None
        self._rx: PoolReceiver | None = None
        self._rx_tried = False
        self._tx: PoolSender | None = None
        self._tx_device: int | None = None
        #: ``(pool device, whether the sender's current device is another)`` (``_across``)
        self._across_for: tuple[int, bool] | None = None
        self._owner: int | None = None
        #: participants generation at which the pool's owner was the only receiver
        self._owner_ok_gen = -1
        #: why the last payload the route could not take went by the host path
        self.fallback_reason = ""
        self._next_probe = 0.0
        #: (participants generation, the channel's receiver pids then)
        self._recv_pids: tuple[int, frozenset[int]] | None = None
        self._peer_ok: dict[tuple[int, int], bool] = {}
        self._closed = False
        if mode == "on" and conn._recvs:
            self.open_pool(device, strict=True)

    # ================================================================ the ends
    @staticmethod
    def _unavailable() -> str | None:
        """Why this process cannot open a device pool's end, or ``None``; the test
        suite overrides it (with ``_make_ops``) to run the route over a host double."""
        from omnilink.connectors.devpool import cuda_ipc_unavailable

        return cuda_ipc_unavailable()

    @staticmethod
    def _make_ops() -> Any:
        """The device operations of the route's ends (``CudaDeviceOps``)."""
        from omnilink.connectors.devpool import CudaDeviceOps

        return CudaDeviceOps()

    def _device_ops(self) -> Any:
        """The one device-operations object of this route (holds ``_lock``)."""
        if self._ops is None:
            self._ops = self._make_ops()
        return self._ops

    # ================================================================ receiver
    def open_pool(self, device: Any, *, strict: bool = False) -> None:
        """Open this receiver's device pool on ``device`` once (``auto``: at the first
        device get, if this is the channel's only receiver; failures are logged once and
        leave the host path)."""
        if self._rx is not None or (self._rx_tried and not strict):
            return
        with self._lock:
            if self._rx is not None or (self._rx_tried and not strict):
                return
            self._rx_tried = True
            why = self._unavailable()
            if why is None and not strict and self.conn._live_receivers() != 0:
                why = "the channel has other receivers (one receiver owns a device pool)"
            if why is None:
                from omnilink.connectors.devpool import DEFAULT_EVENT_SLOTS, DEFAULT_MAX_BLOCKS, PoolReceiver

                try:
                    self._rx = PoolReceiver(self._device_ops(), self.conn.channel, device=device,
                                            pool_bytes=self.pool_bytes, event_slots=DEFAULT_EVENT_SLOTS,
                                            max_blocks=DEFAULT_MAX_BLOCKS, pool_max_bytes=self.pool_max_bytes)
                except (OmnilinkError, RuntimeError) as exc:
                    if strict:
                        raise
                    why = f"{type(exc).__name__}: {exc}"
            rx = self._rx
            if rx is not None:
                def drop(key: str | None, marker: Any) -> None:
                    if type(marker) is dict and IPC_MARK in marker:
                        rx.drop(key or "<lane>", marker[IPC_MARK])

                # The pool's sender puts each message in the pool's lane: this channel
                # takes them as its own (one claim, no arena block, no frame to decode);
                # a get that waits lets the pool's receiver prepare the next landing.
                self.conn.attach_lane(rx.lane, drop)
                self.conn._wait_hook = rx.prebuild
            if self._rx is None:
                if strict:
                    raise CudaError(f"shm: device_ipc='on' on channel {self.conn.channel!r}: {why}")
                logger.info("shm: channel %r receives CUDA payloads through the host (device IPC: %s)",
                            self.conn.channel, why)

    def wants_pool(self) -> bool:
        return self.mode == "auto" and not self._rx_tried and self.conn._recvs

    def take(self, key: str, marker: dict, device: Any, deadline: Any = None) -> Any:
        """The payload of the device-IPC message ``marker`` claimed under ``key``: views
        of the pool on its device (the current stream ordered after the sender's copy),
        moved to ``device`` (a ``torch.device`` with an index) if it is another one, and
        the payload's CPU tensors moved there too; host tensors when ``device`` is
        ``None``. ``deadline``: of the wait for the sender to queue its copy (it
        publishes first)."""
        rx = self._rx
        if rx is None:
            raise TransportError(
                f"shm: key {key!r} on channel {self.conn.channel!r} was sent by device IPC to the "
                "receiver that owns the channel's device pool; this receiver has none (one receiver "
                "per channel when senders use device_ipc)"
            )
        pooled: list[Any] = [False, 0]
        got = rx.land(key, marker[IPC_MARK], deadline=deadline, pooled=pooled, sized=False)
        if pooled[0] and device is not None and device.index == rx.index:
            return got  # every tensor a view of the pool, on that device already
        from omnilink.cuda import map_tensors, payload_to_device

        if device is None:
            return map_tensors(got, lambda t: t.cpu() if t.is_cuda else t)
        if device.index != rx.index:
            got = map_tensors(got, lambda t: t.to(device, non_blocking=True) if t.is_cuda else t)
        # The payload's CPU tensors go to ``device`` too, as on every road (``get``'s
        # contract); the pool's views, already there, stay as they are.
        return payload_to_device(got, device)

    # ================================================================ sender
    def min_bytes_for(self, blob: Any) -> int:
        """The least CUDA bytes of the prepared payload ``blob`` for this route: the
        ``min_bytes`` given, or (``None``) 0 while an MPS server serves this host, else
        ``IPC_MIN_BYTES``. Without MPS, two processes on one GPU take turns on it, and
        a device-IPC message makes both contexts take a turn: below 16 MiB the host path
        was faster there; under MPS device IPC is faster at every size (an H100: 4 KiB
        142 against 253 us one payload at a time; 2x H200, cuda:0 -> cuda:1 by a send
        plan: 4 KiB 94 against 311 us, `serial-gpu-cross-2xh200-mps-plans.json`).
        Without MPS, a payload from a sender whose current GPU is another than the
        pool's goes by device IPC at every size too (``_across``)."""
        if self.min_bytes is not None:
            return self.min_bytes
        if self._mps_on():
            return 0
        if self._sender() is not None and self._across():
            pool = self._tx_device
            if all(dev.index != pool for dev in blob.devices()):
                return 0  # from another GPU (``_across``)
        return IPC_MIN_BYTES

    def routes_first(self) -> bool:
        """Whether a put tries this route before it prepares the payload's tensor_blob:
        a pool sender is attached, and every size goes by device IPC (``min_bytes`` 0,
        or under MPS: ``min_bytes_for``; or this sender is on another GPU than the
        pool's: ``_across``), so the route needs no size to decide."""
        if self._tx is None or self._closed:
            return False
        if self.min_bytes is not None:
            return self.min_bytes == 0
        return self._mps_on() or self._across()

    def _across(self) -> bool:
        """Whether this thread's current CUDA device is another GPU than the pool's (a
        stage sending to the next stage's GPU; looked up once per pool device). Without
        an MPS server such a payload goes by device IPC at every size, first
        (``put_first``): on 2x H200 (cuda:0 -> cuda:1, one payload at a time) 217 against
        293 us by the general way at 16 MiB, 843 against 930 at 256 MiB, and as fast as
        the host path below; one on the pool's GPU keeps the threshold."""
        pool = self._tx_device
        if pool is None or self._tx is None:
            return False
        known = self._across_for
        if known is None or known[0] != pool:
            known = self._across_for = (pool, self._tx.ops.device_index(None) != pool)
        return known[1]

    def _mps_on(self) -> bool:
        """``mps_serving()``, looked up at the first payload."""
        if self._mps is None:
            self._mps = mps_serving()
        return self._mps

    def put_first(self, key: str, payload: Any, deadline: Any, events: Any) -> int | None:
        """``put`` before any tensor_blob walk (``routes_first``): one walk of the payload
        picks its tensors for the pool block, and the route takes it if it holds CUDA
        tensors, all on one device: another GPU that reaches the pool's by peer access
        (peer copies), or the pool's own while every size goes by the route (``min_bytes``
        0, or MPS); its size is computed after the copy is queued. ``None``:
        the payload is not for this route, try it the general way; ``FELL_BACK``: the
        route could not take it, send it by the host path."""
        tx = self._tx
        if tx is None or not self._only_receiver_owns_pool():
            return None
        if events is None and tx.plans:
            # A stream of same-shaped payloads: its send plan, before anything of the
            # general way is set up (same errors and fallbacks as ``_send``).
            try:
                sent = tx.send_planned(key, payload, deadline, lambda: _short(deadline))
            except (TransferTimeout, CapacityError, PeerLostError, ConfigurationError, CudaError) as exc:
                return self._failed(key, exc)
            if sent is not None:
                self.conn._count(ipc_puts=1)
                return sent
        from omnilink.connectors.devpool import one_device  # (loaded with the sender)

        pool = self._tx_device
        device_of = tx.ops.tensor_device

        same_ok = self.min_bytes == 0 or self._mps_on()

        def accept(chosen: list[Any]) -> bool:
            # All device tensors on one GPU (several: the general way); another GPU than
            # the pool's by peer copies, if it reaches the pool; the pool's own only
            # while every size takes the route (else the general way, by its size).
            where = one_device(chosen, device_of)
            if where is None:
                return False
            return self._peer(where, pool) if where != pool else same_ok

        try:
            sent = self._send(tx, key, payload, deadline, events, None, accept, planned=False)
        except BlobEncodeError:
            # Something in the payload tensor_blob cannot carry (its message went
            # nowhere): the error names its place in the payload, not in the route's
            # message.
            prepare(payload)
            raise
        if sent is FELL_BACK or sent is None:
            return sent
        self.conn._count(ipc_puts=1)
        return sent

    def put(self, key: str, payload: Any, blob: Any, deadline: Any, events: Any) -> int | None:
        """Send ``payload`` by device IPC; ``None`` when it must take the host path."""
        if self._closed or blob.device_bytes() < self.min_bytes_for(blob):
            return None
        tx = self._sender()
        if tx is None or not self._only_receiver_owns_pool():
            return None
        if not self._reachable(blob):
            return None
        sent = self._send(tx, key, payload, deadline, events, blob.nbytes, None)
        if sent is FELL_BACK:
            return None
        self.conn._count(ipc_puts=1)
        return blob.nbytes

    def _send(self, tx: Any, key: str, payload: Any, deadline: Any, events: Any, size: int | None,
              accept: Any, *, planned: bool = True) -> Any:
        """``PoolSender.send`` of ``payload`` with this route's publishing: its size, or
        ``None`` (not accepted), or ``FELL_BACK`` (the route could not take it; the
        reason is kept). ``planned`` false: the sender's send plan was asked already."""
        conn = self.conn

        def publish(msg: dict) -> None:
            # The device part's descriptor goes in the pool's lane, which the receiver's
            # channel reads as its own, and the channel's waiters are woken; one that
            # the lane cannot take rides the shm channel as a message of its own. Either
            # way: one claim, one wake-up and one decode per payload at the receiver.
            marker = {IPC_MARK: msg}
            try:
                if tx.lane_pending(key):
                    raise duplicate_key(conn.backend, conn.channel, key)
                if tx.lane_write(key, marker):
                    conn.wake_receivers(deadline)
                    return
                conn._put_arena(key, key.encode("utf-8"), prepare(marker), deadline)
            except BaseException as exc:
                raise _NotPublished(exc) from exc

        try:
            # The receiver of a routed payload lands it on its device: small host tensors
            # ride in the block (``send``'s default).
            return tx.send(key, payload, deadline, events, publish, size=size, room=_short(deadline),
                           accept=accept, planned=planned)
        except _NotPublished as exc:
            raise exc.error from None
        except (TransferTimeout, CapacityError, PeerLostError, ConfigurationError, CudaError) as exc:
            return self._failed(key, exc)

    def _failed(self, key: str, exc: BaseException) -> Any:
        """What a send the route could not make means: ``FELL_BACK`` (the host path takes
        the payload, the reason kept); a lost receiver or a broken device also drops the
        route's sender."""
        self._fell_back(key, f"{type(exc).__name__}: {exc}")
        if not isinstance(exc, (TransferTimeout, CapacityError)):
            self._drop_sender(f"{type(exc).__name__}: {exc}")
        return FELL_BACK

    def _fell_back(self, key: str, why: str) -> None:
        """Count a payload that the route could not take (``stats().ipc_fallbacks``)."""
        self.fallback_reason = why
        self.conn._count(ipc_fallbacks=1)
        logger.debug("shm: %r takes the host path (device IPC: %s)", key, why)

    def _sender(self) -> Any:
        tx = self._tx
        if tx is not None:
            return tx
        now = time.monotonic()
        if now < self._next_probe:
            return None
        self._next_probe = now + PROBE_EVERY_S
        from omnilink.connectors.devpool import PoolSender, live_pool_owner

        known = self._receivers()
        if known is None or not known[1]:
            return None
        owner = live_pool_owner(self.conn.channel, known[1])
        if owner is None or self._unavailable() is not None:
            return None
        with self._lock:
            if self._tx is not None:
                return self._tx
            tx = None
            try:
                tx = PoolSender(self._device_ops(), self.conn.channel)
                tx.withdraw = self._withdraw_lane
                # Its messages go in the pool's lane as ``publish`` below puts them, so a
                # stream of same-shaped payloads may go by a send plan.
                tx.lane_mark, tx.lane_wake = IPC_MARK, self.conn.wake_receivers
                index = tx.attach(Deadline(1.0))
            except (OmnilinkError, RuntimeError) as exc:
                if tx is not None:
                    tx.close()
                logger.info("shm: channel %r sends CUDA payloads through the host (device IPC: %s)",
                            self.conn.channel, exc)
                return None
            self._tx, self._tx_device, self._owner = tx, index, owner
            self._owner_ok_gen = -1
            logger.info("shm: channel %r sends CUDA payloads by device IPC to pid %d (cuda:%d)",
                        self.conn.channel, owner, index)
            return tx

    def _drop_sender(self, why: str) -> None:
        with self._lock:
            tx, self._tx = self._tx, None
            self._owner = None
            self._owner_ok_gen = -1
        if tx is not None:
            logger.info("shm: channel %r: device IPC dropped (%s); host path", self.conn.channel, why)
            try:
                tx.close()
            except Exception:  # pragma: no cover - best effort
                logger.debug("shm: closing the device-IPC sender failed", exc_info=True)

    def _receivers(self) -> tuple[int, frozenset[int]] | None:
        """``(participants generation, pids)`` of the shm channel's receivers (cached
        until the generation moves); ``None`` when the channel's lock was not had in a
        short while."""
        from omnilink.connectors.shm.segments import ROLE_RECV
        from omnilink.connectors.shm.segments import _LockTimeout

        chan = self.conn._chan
        gen = chan.senders_gen()  # moves whenever a participant joins, leaves or is reaped
        cached = self._recv_pids
        if cached is not None and cached[0] == gen:
            return cached
        try:
            with chan.locked(_short(None)):
                gen = chan.senders_gen()
                parts = chan.participants()
        except _LockTimeout:
            return None
        self._recv_pids = (gen, frozenset(pid for pid, role, _ in parts if role & ROLE_RECV))
        return self._recv_pids

    def _only_receiver_owns_pool(self) -> bool:
        """Whether the shm channel's receivers are exactly the pool's owner (a marker
        claimed by any other receiver could not be opened)."""
        gen = self.conn._chan.senders_gen()
        if gen == self._owner_ok_gen:
            return True
        known = self._receivers()
        if known is None:
            return False
        gen, recv = known
        if recv == {self._owner}:
            self._owner_ok_gen = gen
            return True
        if self._owner not in recv:
            self._drop_sender("the pool's owner left the channel")
        return False

    def _reachable(self, blob: Any) -> bool:
        """Whether every CUDA device of the prepared payload ``blob`` can reach the pool's
        device (peer access)."""
        pool = self._tx_device
        return all(dev.index == pool or self._peer(dev.index, pool) for dev in blob.devices())

    def _peer(self, src: int, pool: Any) -> bool:
        """Whether device ``src`` can reach the pool's device ``pool`` by peer access
        (asked once per pair)."""
        if pool is None:
            return False
        ok = self._peer_ok.get((src, pool))
        if ok is None:
            import torch

            ok = self._peer_ok[(src, pool)] = bool(torch.cuda.can_device_access_peer(src, pool))
        return ok

    def has_pool(self) -> bool:
        """Whether this receiver owns a device pool (device-IPC payloads may name it)."""
        return self._rx is not None

    def drop(self, key: str, marker: dict) -> None:
        """Receiver: the device-IPC message ``marker`` under ``key`` is discarded unread:
        its pool block goes back (nothing viewed it)."""
        rx = self._rx
        if rx is not None:
            rx.drop(key, marker[IPC_MARK])

    # ================================================================ sender
    def lane_withdraw(self, key: str) -> bool:
        """Sender: withdraw ``key``'s unclaimed record from the pool's lane and free its
        block (the caller holds the channel mutex); whether it was there unclaimed."""
        tx = self._tx
        return tx is not None and tx.lane_withdraw(key)

    def _withdraw_lane(self, key: str) -> bool:
        """The pool sender's hook: withdraw ``key``'s unclaimed lane record under the
        channel mutex (its block freed); whether it was there unclaimed."""
        with self.conn._chan.locked():
            return self.lane_withdraw(key)

    def lane_reclaim(self, older_than: float, now: float) -> list[tuple[str, float, int]]:
        """Sender: withdraw lane records unclaimed for more than ``older_than`` seconds
        (their blocks freed; the caller holds the channel mutex): ``(key, age, block
        bytes)`` each."""
        tx = self._tx
        return [] if tx is None else tx.lane_reclaim(older_than, now)

    def lane_pending_keys(self) -> list[str]:
        tx = self._tx
        return [] if tx is None else tx.lane_pending_keys()

    def discard(self, key: str) -> None:
        """Sender: ``key`` was withdrawn unread from the shm channel: free its pool block
        (if it went by device IPC)."""
        tx = self._tx
        if tx is not None:
            tx.withdrawn(key)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            parts, self._tx, self._rx = (self._tx, self._rx), None, None
        self.conn._wait_hook = None
        for part in parts:
            if part is not None:
                try:
                    part.close()
                except Exception:  # pragma: no cover - best effort at close
                    logger.debug("shm: closing a device-IPC part failed", exc_info=True)


#: ``put_first``: the route could not take the payload (send it by the host path).
FELL_BACK = object()


class _NotPublished(Exception):
    """The device part was copied but its message could not be published (the device
    part is taken back; ``error`` goes on to the caller, no host-path retry)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _short(deadline: Any) -> Any:
    if deadline is None:
        return Deadline(1.0)
    remaining = deadline.remaining()
    return Deadline(ROOM_WAIT_S if remaining is None else min(remaining, ROOM_WAIT_S))
