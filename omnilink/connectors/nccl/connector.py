"""The ``nccl`` backend: payloads between two processes through ``torch.distributed``.

Everything of a payload travels by point-to-point ``send``/``recv`` on the same NCCL
streams as its data (gloo between CPUs, so CI runs the same code): a fixed-size *slot*
holding the header (its tensor_blob meta, see ``omnilink.connectors.nccl.wire``) and
the small tensors, then the larger buffers. A doorbell socket (ZeroMQ) announces each
payload once its sends are queued; credits come back, batched, on a second one. The
torch.distributed store (a ``TCPStore``) both ends share serves the rendezvous only:
hellos, rank claims, the process groups' own setup and the two sockets' addresses,
exchanged once. Nothing is pickled.

One channel links exactly two ranks. Each connector builds its own process groups over
the store (``ProcessGroupNCCL`` / ``ProcessGroupGloo`` objects, never the global default
group), so it never disturbs the application's own torch.distributed setup: per
direction a *slot* group and a *bulk* group (two communicators, each in its own order),
plus one gloo group for the goodbye::

    rank 0 (e.g. sender, cuda:0)                      rank 1 (e.g. receiver, cuda:1)
    ----------------------------                      ------------------------------
    put(key, payload)                                 poster thread (nothing posted
      header + small host data -> pinned -> slot        while nothing is announced)
      slot: send (send stream) ==== slot group ====>
      pack, big tensors: one coalesced group of
      sends (caller's stream waits) === bulk ====>
      all queued: doorbell ---------- zmq PAIR ---->  bell: post that payload's slot
                                                        receive (+ D2H copy, event)
                                                      slot lands: read header, post
                                                        its bulk recvs (bulk stream,
                                                        into new buffers), views + tree
                                                        -> inbox[key]
                                                      get(key): Condition wait, then the
                                                        bulk event (no polling, no hand-off)
                                                      completer thread
                                                        waits for each bulk to land
      credit socket (read lazily) <---- zmq PAIR ----   credit "0..seq received" (batched)

A payload costs at most one slot send and one coalesced group of bulk sends (the pack
of small device tensors, then each large tensor), and a payload that fits its slot is
ONE operation. No host round trip per message on either side: the sender waits for
nothing (credits are read only near the window's end), the receiver's host learns a
header from memory its GPU already copied. Several payloads may be in flight: the
poster keeps up to ``recv_depth`` announced slots posted and reads them in order, and
a slot of header bytes only is sent from a stream of its own, so it is not queued
behind the previous payload's bulk data on the caller's stream: the receiver reads
header i+1 and posts its bulk receives while payload i's bytes are still moving.

No receive waits for a send that was not made (why receives are not posted ahead): a
posted NCCL receive is a kernel resident on the GPU until its sender sends, and with
CUDA's lazy module loading (``CUDA_MODULE_LOADING=LAZY``, the default since CUDA 12.2)
the first launch of a kernel from a module not yet loaded (a first ``torch.randn``,
a new dtype) waits for the kernels resident on the device. A receive posted ahead of
its payload thus made the receiving process's next first-time launch wait for the
sender's next put, forever if none came; and a process that both sends and receives
(``role="dual"``) deadlocked its own first put (found on 2x H100, NCCL 2.28, CUDA 13).
So the sender rings the doorbell only after the payload's sends are queued on its GPU,
and the receiver posts a payload's receives only on its bell: every receive posted
matches sends already queued, and a link that carries nothing keeps nothing posted, in
either direction. What remains, for users: a first-time kernel launch in the receiving
process waits until the payloads already on the way have landed, and one in the sending
process until the receiver has posted their receives, which its poster thread does at
once, unless the receiver holds ``max_pending_bytes`` unread (then until its
application reads some). Where even that matters, start the processes with
``CUDA_MODULE_LOADING=EAGER`` or run each kernel the stage uses once before the first
``put``/``get`` (a warm-up).

Life of one payload (``seq`` counts the sender's puts on this link)::

     put: slot + bulk sent    poster: slot read, receives posted    bytes landed
    ---------------------> ANNOUNCED -------------------> IN FLIGHT ---------------> READY
                                                   (listed at once when its views   |
                                                    need none of its bytes: get     |
                                                    then waits for them; else built |
                                                    by the completer once landed)   |
                                                                  get / discard     |
                                                               (consumed) <---------+

Semantics, chosen and tested:

- ``put`` returns once the caller may reuse its tensors. CUDA tensors on the link's
  device are sent from the caller's own memory with no copy: the sends are ordered after
  the caller's current stream, the caller's stream is made to wait for them, and the
  process group keeps the tensors alive until they are sent (the CUDA stream contract,
  as for ``tensor.to(..., non_blocking=True)``). Host data on a gloo link is snapshotted
  (one memcpy) because gloo reads it whenever the receiver is ready. Host tensors on an
  NCCL link ride inside the envelope when small (``inline_bytes``) and are otherwise
  staged through the device (copied up, sent, copied back to host on the receiver).
- Small tensors travel together: in the slot when they fit (device tensors on NCCL only
  when the payload has no bulk buffer, see ``wire``), else those of at most
  ``pack_bytes`` in one pack buffer when there are two or more. On the receiver they are
  views of the slot or the pack (the buffer lives as long as any of them). Large
  tensors keep their own zero-copy transfer.
- The receiver reads slots eagerly from its own thread, so a ``put`` followed by a
  ``get`` in one thread never deadlocks and out-of-order ``get`` works. A payload whose
  tensors can be built without its bulk bytes (device data on NCCL; on gloo anything but
  bool data, whose bytes are checked; never host data staged through the device) is
  listed as soon as its receives are posted, and ``get`` waits for its bytes itself (a
  CUDA event recorded after them): ``get`` still returns once they have landed,
  ``get_nowait`` says ``WouldBlock`` until then, but no thread hand-off stands between
  the arrival and the caller. The completer only confirms arrivals and credits them.
- Flow control by credits, not acknowledgements: at most ``send_window`` payloads (and
  ``max_inflight_bytes``) are announced and not yet fully received. Send/recv pairs are
  matched in order, so no payload needs an answer of its own: the receiver sends
  "payloads 0..seq received" after a batch (an eighth of the window or of the in-flight
  bytes) or when it has nothing more in hand, and the sender reads the credits only
  when it gets within half of a limit. A ``put`` that finds no room waits for credits
  (woken by the socket) up to its timeout, then raises ``TransferTimeout`` having sent
  nothing. The receiver stops taking new payloads while the ones it holds unread exceed
  ``max_pending_bytes`` (backpressure, as a full shm arena); one payload larger than
  that is still taken when nothing else is held.
- Peer death: a third, gloo process group carries only a "goodbye" message; its one
  outstanding receive fails at once when the peer's process dies (the TCP connection
  drops), so waiters get ``PeerLostError`` instead of hanging (on NCCL the data groups
  are then aborted: their kernels would wait forever). A clean ``close`` of the peer is
  told apart: payloads already received stay readable, later ``get`` of keys that can
  no longer come raise ``PeerLostError`` at once. A peer that hangs without dying is
  reported by the timeouts (``TransferTimeout``). ``close`` ends any receive still
  pending (an NCCL abort; on gloo, a wait that times out closes the group's connection)
  after the goodbye, so nothing stays blocked.
- The key contract of every backend: a second ``put`` of a key still unread on the
  receiver raises ``DuplicateKeyError`` and the first payload stays deliverable. The
  sender remembers the last 65,536 keys it put; a ``put`` of one of them (only those:
  nothing to wait for on fresh keys) flags its header REPEAT and waits for the
  receiver's credit of that very payload, whose verdict says whether the key was still
  pending (the receiver then drops the second payload). A ``get`` of a key this
  receiver consumed or discarded raises ``KeyConsumedError``.
- Hostile or broken slots: the receiver validates each slot's head (magic, an envelope
  of at most ``max_header_bytes``, inside the slot or as the first bulk buffer), each
  envelope (tensor_blob limits, plan against descriptors, SLOT tensors inside the slot)
  and checks the payload's size against ``max_message_bytes`` before it allocates
  anything; the sender refuses larger payloads itself (``CapacityError``, from the
  limits the receiver published). A payload whose tensors arrived but whose tree is
  malformed becomes a ``BlobDecodeError`` for its key and the link keeps serving; a slot
  the receiver cannot size (so the byte stream would lose step) or a credit out of
  sequence fails the link with that named error, never with an allocation.
- A peer restart needs both ends to reopen the channel (the process groups are built
  once); the zmq backend is the one that reconnects.
"""

from __future__ import annotations

import collections
import datetime
import logging
import math
import os
import queue
import secrets
import socket
import threading
from typing import Any, cast

import zmq

from omnilink import blob
from omnilink._errors import (
    BlobDecodeError,
    CapacityError,
    ClosedError,
    ConfigurationError,
    CudaError,
    OmnilinkError,
    PeerLostError,
    TransportError,
    WouldBlock,
)
from omnilink._util import CONSUMED_KEYS_REMEMBERED, ConsumedKeys, Deadline, duplicate_key, pid_alive
from omnilink.connectors.nccl import wire
from omnilink.connectors.base import BaseConnector, Role, check_constructor_options

__all__ = ["NcclConnector"]

logger = logging.getLogger(__name__)

_FOREVER = datetime.timedelta(days=3650)
#: Value written to a store key only to wake a thread blocked waiting for it.
_WAKE = b"-"
_CTL_BYE = 1
_CTL_BYE_REPLY = 2
#: Gloo tag of the receive that is never matched (``_break_group``).
_BREAK_TAG = 0x6F6C
#: Room in an envelope beyond the tensor_blob header and the inline bytes: the
#: key, the plan and msgpack's framing of up to ``blob.MAX_TENSORS`` inline parts.
_HEADER_SLACK = 1 << 20
#: Largest slot a link may use (every payload sends a whole slot).
_MAX_SLOT_BYTES = 1 << 20
#: Envelopes whose parsed tensor_blob header is kept for the next payload of the same
#: structure (a stage sends the same tree, shapes and dtypes chunk after chunk).
_META_CACHE = 256


def _td(seconds: float | None) -> datetime.timedelta:
    return _FOREVER if seconds is None else datetime.timedelta(seconds=max(seconds, 0.001))


def _is_timeout(exc: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(exc, dist.DistStoreError) and "timeout" in str(exc).lower()


def _gloo_wait(work: Any) -> None:
    """Wait for a gloo send/recv with no time limit.

    ``wait()`` without a timeout uses the process group's own (``connect_timeout``) and
    fails the pair when it expires: the goodbye receive, open for the life of the link,
    and a send held up by the receiver's backpressure would take an idle or a busy link
    down after ``connect_timeout``. A dead peer still fails the wait at once (its TCP
    connection drops). (NCCL waits take no timeout: with one, ``wait`` blocks the host.)
    """
    work.wait(_FOREVER)


def _tcp_store_client(dist: Any, addr: str, port: int, timeout: float, channel: str) -> Any:
    """A ``TCPStore`` client of rank 0's store, built within ``timeout`` seconds.

    The client's constructor retries a refused connection after a random back-off and
    tries once more for a whole ``timeout``, so by itself it returns after 2 to 3.3
    times ``timeout`` when no store answers. It runs in a thread of its own here and the
    caller stops waiting at ``timeout``; the thread ends by itself once its own retries
    are spent (a store that answers late is dropped with it). Waiting for a server to
    start listening has no wake-up to wait on: the retries are torch's, not ours.

    Raises
    ------
    RuntimeError, ValueError
        The constructor's own error (no store answered in time: a ``RuntimeError`` too).
    """
    result: list[Any] = []
    done = threading.Event()

    def attempt() -> None:
        try:
            result.append(dist.TCPStore(addr, port, None, False, _td(timeout), wait_for_workers=False))
        except BaseException as exc:  # handed to the caller below
            result.append(exc)
        finally:
            done.set()

    # Not a daemon: a process that exits meanwhile waits for the thread (bounded by the
    # client's own retries) instead of killing it inside torch's C++ code, which aborts.
    threading.Thread(target=attempt, daemon=False, name=f"omnilink-nccl-store-{channel}").start()
    if not done.wait(timeout):
        raise RuntimeError(f"the client socket has timed out after {timeout} s")
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _poll_ms(seconds: float | None) -> int:
    return -1 if seconds is None else max(0, math.ceil(seconds * 1000))


class _Waker:
    """An in-process socket pair that wakes one thread blocked in a zmq poll.

    ``wake`` may be called from any thread (and after ``close``); ``rx`` is polled and
    drained by the one thread that waits on it at a time.
    """

    def __init__(self, ctx: Any, name: str) -> None:
        self._lock = threading.Lock()
        self.rx = ctx.socket(zmq.PAIR)
        self.rx.setsockopt(zmq.LINGER, 0)
        self.rx.bind(f"inproc://{name}")
        self._tx = ctx.socket(zmq.PAIR)
        self._tx.setsockopt(zmq.LINGER, 0)
        self._tx.connect(f"inproc://{name}")
        self._closed = False

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self._tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a wake-up is already queued

    def drain(self) -> None:
        try:
            while True:
                self.rx.recv(zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._tx.close(0)
            self.rx.close(0)


class _Landed:
    """When the receives of a gloo payload have landed, with a CUDA event's two methods.

    Set by the completer, the one thread that waits on the gloo works (a gloo receive's
    ``wait`` may not be called twice).
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def query(self) -> bool:
        return self._event.is_set()

    def synchronize(self) -> None:
        self._event.wait()


class _Arrived:
    """A payload the receiver holds: ready (``payload`` set) or still in flight."""

    __slots__ = (
        "seq", "key", "nbytes", "frame_bytes", "done", "payload", "device_tensors", "error", "duplicate", "event",
    )

    def __init__(self, seq: int, key: str, nbytes: int, frame_bytes: int) -> None:
        self.seq = seq
        self.key = key
        self.nbytes = nbytes
        self.frame_bytes = frame_bytes
        self.done = False
        self.payload: Any = None
        #: The device buffers the payload's tensors are views of.
        self.device_tensors: list[Any] = []
        self.error: BaseException | None = None
        #: Its key was still pending: received (to keep the stream in step), then dropped.
        self.duplicate = False
        #: Set when the payload was ready as soon as its receives were posted
        #: (``wire.early_ready``): a CUDA event recorded after them, or ``_WorksDone``;
        #: ``get`` waits for it.
        self.event: Any = None


def _check_values(
    *,
    role: Any,
    backend: Any,
    rank: Any,
    world_size: Any,
    device: Any,
    store: Any,
    master_port: Any,
    connect_timeout: Any,
    send_window: Any,
    max_inflight_bytes: Any,
    max_pending_bytes: Any,
    inline_bytes: Any,
    max_inline_bytes: Any,
    max_message_bytes: Any,
    pack_bytes: Any,
    header_addr: Any,
    slot_bytes: Any = 16 << 10,
    recv_depth: Any = 4,
) -> None:
    """The value checks of ``NcclConnector``'s options (its constructor and its
    ``check_options`` both call this): what holds on any machine, opening nothing.

    Whether CUDA, NCCL or gloo are there, whether ``device`` exists, and whether the
    store answers are the constructor's to find out.

    Raises
    ------
    ConfigurationError
        The first option out of its range, of the wrong type or in a combination that
        cannot work (``role="dual"`` without ``rank``, ``backend="gloo"`` with a CUDA
        device, no ``store`` and no ``master_port``), named.
    """
    if world_size != 2 or isinstance(world_size, bool):
        raise ConfigurationError(
            f"nccl: world_size must be 2 (a channel links exactly two ranks), got {world_size!r}; "
            "open one channel per pair of stages"
        )
    if rank is None:
        if role == "dual":
            raise ConfigurationError("nccl: role='dual' needs an explicit rank (0 or 1)")
        rank = 0 if role == "sender" else 1
    if isinstance(rank, bool) or rank not in (0, 1):
        raise ConfigurationError(f"nccl: rank must be 0 or 1, got {rank!r}")
    for name, value, low in (
        ("send_window", send_window, 1),
        ("max_inflight_bytes", max_inflight_bytes, 1),
        ("max_pending_bytes", max_pending_bytes, 1),
        ("max_inline_bytes", max_inline_bytes, 0),
        ("max_message_bytes", max_message_bytes, 1),
        ("pack_bytes", pack_bytes, 0),
        ("recv_depth", recv_depth, 1),
        ("slot_bytes", slot_bytes, wire.MIN_SLOT_BYTES),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigurationError(f"nccl: {name} must be an int >= {low}, got {value!r}")
    if slot_bytes % blob.FRAME_ALIGN or slot_bytes > _MAX_SLOT_BYTES:
        raise ConfigurationError(
            f"nccl: slot_bytes must be a multiple of {blob.FRAME_ALIGN} and at most {_MAX_SLOT_BYTES}, "
            f"got {slot_bytes!r}"
        )
    if isinstance(connect_timeout, bool) or not isinstance(connect_timeout, (int, float)) or not connect_timeout >= 0:
        raise ConfigurationError(f"nccl: connect_timeout must be a number of seconds >= 0, got {connect_timeout!r}")
    if header_addr is not None and (not isinstance(header_addr, str) or not header_addr):
        raise ConfigurationError(f"nccl: header_addr must be a host name or IP address, got {header_addr!r}")
    if backend not in ("auto", "nccl", "gloo"):
        raise ConfigurationError(f"nccl: backend must be 'auto', 'nccl' or 'gloo', got {backend!r}")
    if device is not None:
        import torch  # parsing a device string initialises no CUDA

        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigurationError(f"nccl: invalid device {device!r}: {exc}") from exc
        # "auto" with a device is NCCL for a CUDA one, gloo for any other ("meta" too).
        transport = backend if backend != "auto" else ("nccl" if dev.type == "cuda" else "gloo")
        if transport == "nccl" and dev.type != "cuda":
            raise ConfigurationError(f"nccl: backend 'nccl' needs a CUDA device, got {dev}")
        if transport == "gloo" and dev.type != "cpu":
            raise ConfigurationError(f"nccl: backend 'gloo' moves host tensors only; device must be 'cpu', got {dev}")
    if inline_bytes is not None and (
        isinstance(inline_bytes, bool) or not isinstance(inline_bytes, int) or inline_bytes < 0
    ):
        raise ConfigurationError(f"nccl: inline_bytes must be an int >= 0, got {inline_bytes!r}")
    if store is None:
        if master_port is None or isinstance(master_port, bool) or not isinstance(master_port, int):
            raise ConfigurationError(
                "nccl: give either store= (a torch.distributed Store both ends share) or "
                "master_port= (rank 0 hosts a TCPStore there)"
            )
        # Port 0 lets the OS pick one: only the end that hosts the store (rank 0) can.
        if not 0 <= master_port < 65536 or (master_port == 0 and rank != 0):
            raise ConfigurationError(f"nccl: invalid master_port {master_port!r}")


class NcclConnector(BaseConnector):
    """A point-to-point connector over ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

    Two connectors, one per process (or two in one process, e.g. for tests), open the
    same ``channel`` with complementary ranks and a shared store; the connector returns
    at once and builds the link in the background; the first ``put``/``get`` waits for it
    (bounded by that call's timeout). ``wait_connected`` waits explicitly.

    Parameters
    ----------
    channel : str
        Channel name; namespaces every key this connector writes in the store.
    role : {"sender", "receiver", "dual"}
        ``"sender"`` only puts, ``"receiver"`` only gets (``ConfigurationError``
        otherwise), ``"dual"`` does both (one process group per direction, so traffic
        both ways never deadlocks on NCCL's ordered streams).
    timeout : float, optional
        Default seconds for blocking calls; ``None`` waits without limit.
    backend : {"auto", "nccl", "gloo"}
        Data path. ``"auto"``: NCCL when ``device`` is (or defaults to) a CUDA device,
        else gloo.
    rank : int, optional
        This end's rank, 0 or 1. Defaults: sender 0, receiver 1; required for ``"dual"``.
    world_size : int
        Must be 2: a channel links exactly two ranks (open one channel per pair of
        stages). Both ends must say the same.
    device : str or torch.device, optional
        Where received tensors are allocated and sent tensors must live: a CUDA device
        for NCCL (default: the current CUDA device), ``"cpu"`` for gloo.
    store : torch.distributed.Store, optional
        A store both ends share (the application's rendezvous store, a ``TCPStore``...).
        If omitted, rank 0 hosts a ``TCPStore`` at ``master_addr:master_port`` and rank 1
        connects to it.
    master_addr : str
        Host of the ``TCPStore`` when ``store`` is omitted (default ``"127.0.0.1"``).
    master_port : int, optional
        Its port; required when ``store`` is omitted (rank 0 may pass 0 to let the OS
        pick one, then read ``connector.master_port``).
    connect_timeout : float
        Seconds the link setup waits for the peer (default 60).
    send_window : int
        Most payloads announced and not yet fully received (default 64). Also
        published to the peer, which batches its credits by an eighth of it.
    max_inflight_bytes : int
        Most bytes announced and not yet fully received (default 4 GiB); one payload
        larger than this still goes when nothing else is in flight.
    max_pending_bytes : int
        Most bytes the receiver holds unread before it stops taking new payloads
        (default 8 GiB).
    inline_bytes : int, optional
        Host tensors and arrays up to this size travel inside the header. Default 64 KiB
        on NCCL links (saves a staged round trip for tiny metadata tensors), 0 on gloo.
    max_inline_bytes : int
        Bound on the inline bytes of one payload (default 1 MiB).
    max_message_bytes : int
        Largest payload (tensor and inline bytes) this end accepts as a receiver
        (default 4 GiB); published to the peer, whose ``put`` refuses larger ones with
        ``CapacityError``. A header declaring more is rejected before any allocation.
    coalesce : bool
        Post the bulk sends/receives of one payload as one NCCL group (default True).
    pack_bytes : int
        Tensors of at most this size that would each need a bulk buffer of their own
        (device tensors on NCCL, host ones on gloo) travel together, copied into one
        buffer and sent by one send, when a payload has two or more (default 1 MiB;
        0 turns packing off). On the receiver they are views of one buffer.
    header_addr : str, optional
        Address (IP or host name) a sending end binds its credit socket on when the peer
        is on another host. Default: the local address that routes to the
        ``TCPStore``'s host, else this host name's address. Unused on one host
        (``ipc://`` then).
    slot_bytes : int
        Size of the slot of every payload this end receives (default 16 KiB, a multiple
        of 64 between 1 KiB and 1 MiB); published to the peer. The header and the small
        tensors that fit travel in it: a payload that fits is one operation.
    recv_depth : int
        Most slot receives this end keeps posted at once (default 4), each for a
        payload the sender has announced (its sends queued): how many payloads may land
        before the receiver's host has read any. Nothing is ever posted for a payload
        not yet put (see the module docstring: lazy module loading).

    Raises
    ------
    ConfigurationError
        Invalid options; the rank already claimed on this channel by a live process.
    CudaError
        NCCL requested where CUDA or NCCL is unavailable.

    Notes
    -----
    Errors that need the peer (its world size, backend or role disagree with ours) are
    raised by ``wait_connected`` and by the first ``put``/``get``.
    """

    backend = "nccl"

    @classmethod
    def check_options(cls, options: dict[str, Any], /) -> None:
        """Refuse, opening nothing, the option values the constructor would refuse.

        The hook ``omnilink.connectors.check_backend_options`` calls (so does the
        vLLM-Omni adapter at construction, for either role). Whether this process has
        CUDA, NCCL or gloo, whether ``device`` exists and whether the store answers are
        left to the constructor and to ``omnilink check``.

        Parameters
        ----------
        options : dict
            Keyword options as ``connect`` would receive them.

        Raises
        ------
        ConfigurationError
            ``role`` or ``timeout`` invalid; ``world_size`` not 2; ``rank`` not 0 or 1,
            or missing for ``role="dual"``; ``send_window``, ``max_inflight_bytes``,
            ``max_pending_bytes`` or ``max_message_bytes`` below 1, ``max_inline_bytes``,
            ``pack_bytes`` or ``inline_bytes`` below 0; ``connect_timeout`` not a number
            >= 0; an empty ``header_addr``; ``backend`` not ``"auto"``, ``"nccl"`` or
            ``"gloo"``; a ``device`` torch cannot parse or of the wrong kind for
            ``backend``; no ``store`` and ``master_port`` missing, outside [0, 65535],
            or 0 on rank 1.
        """
        check_constructor_options(cls, _check_values, options)

    def __init__(
        self,
        *,
        channel: str,
        role: Role = "dual",
        timeout: float | None = None,
        backend: str = "auto",
        rank: int | None = None,
        world_size: int = 2,
        device: Any = None,
        store: Any = None,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        connect_timeout: float = 60.0,
        send_window: int = 64,
        max_inflight_bytes: int = 4 << 30,
        max_pending_bytes: int = 8 << 30,
        inline_bytes: int | None = None,
        max_inline_bytes: int = 1 << 20,
        max_message_bytes: int = 4 << 30,
        coalesce: bool = True,
        pack_bytes: int = 1 << 20,
        header_addr: str | None = None,
        slot_bytes: int = 16 << 10,
        recv_depth: int = 4,
    ) -> None:
        super().__init__(channel=channel, role=role, timeout=timeout)
        _check_values(
            role=role, backend=backend, rank=rank, world_size=world_size, device=device, store=store,
            master_port=master_port, connect_timeout=connect_timeout, send_window=send_window,
            max_inflight_bytes=max_inflight_bytes, max_pending_bytes=max_pending_bytes,
            inline_bytes=inline_bytes, max_inline_bytes=max_inline_bytes, max_message_bytes=max_message_bytes,
            pack_bytes=pack_bytes, header_addr=header_addr, slot_bytes=slot_bytes, recv_depth=recv_depth,
        )
        import torch
        import torch.distributed as dist

        if not dist.is_available():
            raise ConfigurationError("torch.distributed is not available in this torch build")
        self._torch = torch
        self._dist = dist
        if rank is None:  # _check_values: "dual" names its rank
            rank = 0 if role == "sender" else 1
        self.rank = rank
        self.peer_rank = 1 - rank
        self.connect_timeout = float(connect_timeout)
        self.send_window = send_window
        self.max_inflight_bytes = max_inflight_bytes
        self.max_pending_bytes = max_pending_bytes
        self.max_inline_bytes = max_inline_bytes
        self.max_message_bytes = max_message_bytes
        self.coalesce = bool(coalesce)
        self.pack_bytes = pack_bytes
        self.slot_bytes = slot_bytes
        self.recv_depth = recv_depth
        self.header_addr = header_addr
        #: Largest envelope accepted (a slot announcing more fails the link unallocated).
        self.max_header_bytes = blob.PREFIX_SIZE + blob.MAX_HEADER_BYTES + max_inline_bytes + _HEADER_SLACK
        # Sender: keys put recently (a repeat waits for its ack: DuplicateKeyError).
        self._sent_keys: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Receiver: keys consumed or discarded (KeyConsumedError).
        self._consumed = ConsumedKeys()

        # ---------------------------------------------------------- backend / device
        dev = torch.device(device) if device is not None else None  # parsed by _check_values
        if backend == "auto":
            if dev is not None:
                backend = "nccl" if dev.type == "cuda" else "gloo"
            else:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise CudaError("nccl: backend 'nccl' needs CUDA, which is not available in this process")
            if not dist.is_nccl_available():
                raise CudaError("nccl: this torch build has no NCCL; use backend='gloo'")
            if dev is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            if dev.index >= torch.cuda.device_count():
                raise ConfigurationError(
                    f"nccl: device {dev} does not exist (this process sees {torch.cuda.device_count()} GPUs)"
                )
        else:
            if not dist.is_gloo_available():
                raise ConfigurationError("nccl: this torch build has no gloo backend")
            if dev is None:
                dev = torch.device("cpu")
        self.transport = backend
        self.device = dev
        self._is_nccl = backend == "nccl"
        if inline_bytes is None:
            inline_bytes = (64 << 10) if self._is_nccl else 0
        self.inline_bytes = min(inline_bytes, max_inline_bytes)
        # Zero bytes between packed tensors, ready before any stream reads them.
        self._pad = torch.zeros(blob.FRAME_ALIGN, dtype=torch.uint8, device=dev)
        if self._is_nccl:
            torch.cuda.synchronize(dev)

        # ----------------------------------------------------------------- store
        self._owned_store = None
        self.master_port = master_port
        if store is None:  # _check_values: master_port is then a port rank may use
            try:
                if rank == 0:
                    store = dist.TCPStore(
                        master_addr, master_port, None, True, _td(self.connect_timeout),
                        wait_for_workers=False,
                    )
                else:
                    store = _tcp_store_client(dist, master_addr, master_port, self.connect_timeout, channel)
            except (RuntimeError, ValueError) as exc:
                if rank == 0:
                    raise ConfigurationError(
                        f"nccl: cannot host a TCPStore on {master_addr}:{master_port}: {exc}"
                    ) from exc
                raise PeerLostError(
                    f"nccl: no TCPStore answered on {master_addr}:{master_port} within "
                    f"{self.connect_timeout} s (is rank 0 of channel {self.channel!r} running?): {exc}"
                ) from exc
            self._owned_store = store
            self.master_port = store.port
        elif not isinstance(store, dist.Store):
            raise ConfigurationError(f"nccl: store must be a torch.distributed.Store, got {type(store).__name__}")
        self._base_store = store
        self._prefix = f"omnilink/nccl/{self.channel}"  # PrefixStore adds the "/"
        self._token = secrets.token_hex(8)
        self._host = socket.gethostname()
        self._st_main = self._store()

        # ------------------------------------------------------------ shared state
        self._cond = threading.Condition()  # inbox, link state, budget
        self._ready = threading.Event()
        self._link_error: BaseException | None = None
        self._peer_state: str | None = None  # None, "closed", "lost"
        self._peer_reason = ""
        self._closing = False
        self._inbox: dict[str, collections.deque[_Arrived]] = {}
        self._pending_bytes = 0  # held by the receiver: in flight or unread
        self._ready_count = 0
        self._recv_total: int | None = None  # payloads the peer said it sent (goodbye)
        self._recv_done = 0  # payloads fully received
        self._send_lock = threading.Lock()
        self._send_seq = 0
        self._inflight: collections.deque[tuple[int, int]] = collections.deque()
        self._inflight_bytes = 0
        self._acked_upto = -1  # payloads 0.._acked_upto credited by the receiver
        # Repeated keys waiting for the receiver's verdict: seq -> duplicate (or None).
        self._verdicts: dict[int, bool | None] = {}
        self._credit_authed = False
        self._lazy_count = send_window // 2  # below these, put reads no credits
        self._lazy_bytes = max_inflight_bytes // 2
        self._posted = 0  # payloads whose receives were posted
        self._bye_lock = threading.Lock()
        self._bye_sent = False
        self._threads: list[threading.Thread] = []
        self._pgs: dict[str, Any] = {}  # direction -> bulk group
        self._slot_pgs: dict[str, Any] = {}  # direction -> slot group
        self._send_stream: Any = None  # NCCL: slots without device data go from here
        self._recv_streams: Any = None  # NCCL: (slot stream, bulk stream) of the receiver
        self._pump_seq = 0  # the slot the poster waits for or handles
        self._ring: collections.deque[tuple[Any, Any, Any]] = collections.deque()  # posted slots
        # Receiver: payloads the sender announced on the doorbell (their sends are
        # queued on its side), and slot receives this end posted; never more posted
        # than announced (the module docstring: no receive waits for a send not made).
        self._announced = 0
        self._slots_posted = 0
        self._bell_out: Any = None  # under _send_lock
        self._bell_in: Any = None  # poster thread
        self._pump_waker: _Waker | None = None
        self._bell_poller: Any = None
        self._bell_authed = False
        self._meta_cache: dict[Any, tuple[Any, list[int], int, int]] = {}
        self._ctl_pg: Any = None
        self._sid = ""
        self._out = f"{rank}to{1 - rank}"
        self._in = f"{1 - rank}to{rank}"
        self._reap_q: queue.Queue[Any] = queue.Queue()
        self._done_q: queue.Queue[Any] = queue.Queue()
        # ZeroMQ: the credits coming back; each socket is used by one thread at a time.
        self._zctx: Any = None
        self._credit_in: Any = None  # under _send_lock
        self._credit_out: Any = None  # completer thread
        self._credit_waker: _Waker | None = None
        self._credit_poller: Any = None
        self._peer_header_limit: int | None = None

        self._claim()
        hello = wire.Hello(
            protocol=wire.PROTOCOL, rank=rank, world_size=world_size, role=role, backend=backend,
            device_type=dev.type, host=self._host, pid=os.getpid(), token=self._token,
            send_window=send_window, max_message_bytes=max_message_bytes,
            max_header_bytes=self.max_header_bytes, max_inflight_bytes=max_inflight_bytes,
            slot_bytes=slot_bytes, recv_depth=recv_depth,
        )
        try:
            self._st_main.set(f"hello/{rank}", wire.encode_hello(hello))
        except RuntimeError as exc:
            self._release_claim()
            raise PeerLostError(f"nccl: the store of channel {self.channel!r} failed: {exc}") from exc
        self._hello = hello
        self._spawn(self._setup, "setup")

    # ============================================================== store helpers
    def _store(self) -> Any:
        """A store client of our own (TCPStore serialises calls per client), prefixed."""
        base = self._base_store
        try:
            base = base.clone()
        except (AttributeError, RuntimeError):
            pass  # HashStore and friends are thread-safe without a clone
        return self._dist.PrefixStore(self._prefix, base)

    def _claim(self) -> None:
        st = self._st_main
        me = f"{self._host}:{os.getpid()}:{self._token}"
        key = f"claim/{self.rank}"
        try:
            got = st.compare_set(key, "", me).decode()
            if got != me:
                host, _, rest = got.partition(":")
                pid_s = rest.partition(":")[0]
                if host == self._host and pid_s.isdigit() and not pid_alive(int(pid_s)):
                    got = st.compare_set(key, got, me).decode()
                if got != me:
                    raise ConfigurationError(
                        f"nccl: rank {self.rank} of channel {self.channel!r} is already claimed by "
                        f"process {pid_s} on {host}; both ends claim the same rank (give the other "
                        "end the other rank, or close the first connector)"
                    )
        except RuntimeError as exc:
            raise PeerLostError(f"nccl: the store of channel {self.channel!r} failed: {exc}") from exc

    def _release_claim(self) -> None:
        me = f"{self._host}:{os.getpid()}:{self._token}"
        try:
            self._st_main.compare_set(f"claim/{self.rank}", me, "")
            self._st_main.delete_key(f"hello/{self.rank}")
            if self._sid:
                self._st_main.delete_key(f"{self._sid}zmq/{self.rank}")
        except RuntimeError:
            pass  # the store went away with the peer that hosted it

    def _spawn(self, fn: Any, what: str) -> None:
        t = threading.Thread(
            target=self._guard, args=(fn, what), daemon=True,
            name=f"omnilink-nccl-{what}-{self.channel}",
        )
        self._threads.append(t)
        t.start()

    def _guard(self, fn: Any, what: str) -> None:
        try:
            fn()
        except BaseException as exc:  # recorded for the callers, never lost
            if not self._closing:
                logger.debug("nccl %s thread of %r ended: %r", what, self.channel, exc)
                self._fail_link(exc, what)

    def _fail_link(self, exc: BaseException, what: str) -> None:
        if isinstance(exc, OmnilinkError):
            err: BaseException = exc
        else:
            err = PeerLostError(f"nccl: {what} of channel {self.channel!r} failed: {exc}")
            err.__cause__ = exc
        with self._cond:
            if self._link_error is None:
                self._link_error = err
            self._cond.notify_all()
        self._ready.set()
        self._wake_all()

    # ================================================================ link setup
    def _setup(self) -> None:
        # A store client of our own for the blocking waits of the setup (a TCPStore
        # client serialises its calls); everything that never blocks shares ``_st_main``.
        st = self._st_post = self._store()
        deadline = Deadline(self.connect_timeout)
        peer_key = f"hello/{self.peer_rank}"
        while True:
            try:
                st.wait([peer_key], _td(deadline.remaining()))
            except RuntimeError as exc:
                if self._closing:
                    return
                if _is_timeout(exc):
                    raise PeerLostError(
                        f"nccl: rank {self.peer_rank} of channel {self.channel!r} did not show up "
                        f"within connect_timeout={self.connect_timeout} s"
                    ) from exc
                raise
            raw = st.get(peer_key)
            if raw == _WAKE:
                if self._closing:
                    return
                # Left by an earlier connector of our rank that closed before its peer
                # came: not a hello.
                st.delete_key(peer_key)
                continue
            try:
                peer = wire.decode_hello(raw)
            except BlobDecodeError as exc:
                raise ConfigurationError(
                    f"nccl: the peer's hello on channel {self.channel!r} is not readable: {exc}"
                ) from exc
            if peer.host == self._host and not pid_alive(peer.pid):
                # A hello left behind by a process that died: wait for a fresh one.
                st.delete_key(peer_key)
                continue
            break
        self._check_peer(peer)
        self._peer = peer
        self._peer_header_limit = peer.max_header_bytes
        tokens = sorted((self._hello.token, peer.token))
        self._sid = f"s/{tokens[0]}-{tokens[1]}/"
        same_host = peer.host == self._host
        # Directions: a -> b exists when a may send and b may receive.
        roles = {self.rank: self.role, self.peer_rank: peer.role}
        dirs = [
            f"{src}to{1 - src}"
            for src in (0, 1)
            if roles[src] in ("sender", "dual") and roles[1 - src] in ("receiver", "dual")
        ]
        if not dirs:
            raise ConfigurationError(
                f"nccl: channel {self.channel!r} has no direction: this end is a {self.role}, the peer a {peer.role}"
            )
        self._dirs = dirs
        # From here on both ends take the same steps (each waits for the other): they
        # run to the end even if close() was called meanwhile, so the peer is never left
        # waiting, and close() then says goodbye on the control group.
        self._open_sockets(st, deadline, same_host)
        self._ctl_pg = self._make_gloo(f"{self._sid}ctl/", same_host)
        for d in dirs:
            # Two groups per direction: slots (posted on each bell) and bulk
            # buffers (posted once a slot was read); each keeps its own order.
            for groups, name in ((self._slot_pgs, "slot"), (self._pgs, "bulk")):
                if self._is_nccl:
                    groups[d] = self._make_nccl(f"{self._sid}pg/{d}/{name}/")
                else:
                    groups[d] = self._make_gloo(f"{self._sid}pg/{d}/{name}/", same_host)
        torch = self._torch
        if self._is_nccl:
            # Create the NCCL communicators now (a tiny exchange per group) rather than
            # inside the first put, whose wait could not then be bounded. A group has two:
            # torch gives an unbatched send/recv a 2-rank communicator of its own and a
            # coalesced group of them the group's main one, each created at first use by
            # both ranks together. Left to the first coalesced put (several bulk
            # tensors), the sender would block creating it while the receiver, not yet
            # rung, could not join: a deadlock (2x H200, 64 MiB + 16 small tensors).
            with torch.cuda.device(self.device):
                self._send_stream = torch.cuda.Stream(self.device)
                self._recv_streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
                for d in dirs:
                    for pg in (self._slot_pgs[d], self._pgs[d]):
                        t = torch.zeros(1, dtype=torch.uint8, device=self.device)
                        w = pg.send([t], self.peer_rank, 0) if d == self._out else pg.recv([t], self.peer_rank, 0)
                        w.wait()
                        if self.coalesce:
                            pair = [torch.zeros(1, dtype=torch.uint8, device=self.device) for _ in range(2)]
                            for w in self._post(pg, pair, send=d == self._out):
                                w.wait()
                torch.cuda.current_stream(self.device).synchronize()
        self._spawn(self._watch, "watcher")
        if self._in in self._pgs:
            self._spawn(self._post_loop, "poster")
            self._spawn(self._done_loop, "completer")
        if self._out in self._pgs and not self._is_nccl:
            self._spawn(self._reap_loop, "reaper")
        self._ready.set()

    def _open_sockets(self, st: Any, deadline: Deadline, same_host: bool) -> None:
        """Bind the sockets this end reads (a sender: credits; a receiver: the doorbell),
        trade addresses through the store (once), connect the peer's, and send the
        session id first on each."""
        ctx = self._zctx = zmq.Context()
        sending = self._out in self._dirs
        receiving = self._in in self._dirs
        sid = self._sid.encode()

        def bind(name: str) -> tuple[Any, str]:
            s = ctx.socket(zmq.PAIR)
            s.setsockopt(zmq.LINGER, 0)
            # Unbounded queues: the send window bounds what is ever queued.
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.MAXMSGSIZE, max(wire.CREDIT_SIZE, len(sid)))
            if same_host:
                s.bind(f"ipc://@omnilink-nccl-{self._token}-{self.rank}-{name}")
            else:
                s.bind(f"tcp://{self._bind_address()}:*")
            return s, s.getsockopt_string(zmq.LAST_ENDPOINT)

        mine = {"c": "", "d": ""}
        if sending:
            self._credit_in, mine["c"] = bind("c")
            self._credit_waker = _Waker(ctx, f"omnilink-nccl-{self._token}-credit")
            self._credit_poller = zmq.Poller()
            self._credit_poller.register(self._credit_in, zmq.POLLIN)
            self._credit_poller.register(self._credit_waker.rx, zmq.POLLIN)
        if receiving:
            self._bell_in, mine["d"] = bind("d")
            self._pump_waker = _Waker(ctx, f"omnilink-nccl-{self._token}-pump")
            self._bell_poller = zmq.Poller()
            self._bell_poller.register(self._bell_in, zmq.POLLIN)
            self._bell_poller.register(self._pump_waker.rx, zmq.POLLIN)
        st.set(f"{self._sid}zmq/{self.rank}", wire.encode_endpoints(mine))
        peer_key = f"{self._sid}zmq/{self.peer_rank}"
        try:
            st.wait([peer_key], _td(deadline.remaining()))
        except RuntimeError as exc:
            if _is_timeout(exc):
                raise PeerLostError(
                    f"nccl: rank {self.peer_rank} of channel {self.channel!r} did not publish its "
                    f"sockets within connect_timeout={self.connect_timeout} s"
                ) from exc
            raise
        theirs = wire.decode_endpoints(st.get(peer_key))

        def connect(endpoint: str, what: str) -> Any:
            if not endpoint.startswith(("ipc://@omnilink-nccl-", "tcp://")):
                raise ConfigurationError(
                    f"nccl: rank {self.peer_rank} of channel {self.channel!r} published no usable "
                    f"{what} socket ({endpoint!r})"
                )
            s = ctx.socket(zmq.PAIR)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            s.connect(endpoint)
            s.send(sid)
            return s

        if receiving:
            self._credit_out = connect(theirs["c"], "credit")
        if sending:
            self._bell_out = connect(theirs["d"], "doorbell")

    def _bind_address(self) -> str:
        """The local address the peer on another host can reach (see ``header_addr``)."""
        if self.header_addr is not None:
            return self.header_addr
        store = self._base_store
        host = getattr(store, "host", None)
        port = getattr(store, "port", None)
        if isinstance(host, str) and isinstance(port, int):
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                    probe.connect((host, port))  # no packet: just the route's source address
                    return probe.getsockname()[0]
            except OSError:
                pass
        try:
            return socket.gethostbyname(self._host)
        except OSError as exc:
            raise ConfigurationError(
                f"nccl: cannot tell which address of this host the peer of channel {self.channel!r} "
                f"can reach ({exc}); pass header_addr="
            ) from exc

    def _check_peer(self, peer: wire.Hello) -> None:
        me = self._hello
        problems = []
        if peer.protocol != me.protocol:
            problems.append(f"side-channel protocol {peer.protocol} vs ours {me.protocol}")
        if peer.world_size != me.world_size:
            problems.append(f"world sizes disagree: the peer says {peer.world_size}, we say {me.world_size}")
        if peer.rank != self.peer_rank:
            problems.append(f"both ends claim rank {peer.rank}")
        if peer.backend != me.backend:
            problems.append(f"the peer uses backend {peer.backend!r}, we use {me.backend!r}")
        if peer.role == me.role and me.role != "dual":
            problems.append(f"both ends are {me.role}s")
        if problems:
            raise ConfigurationError(
                f"nccl: the two ends of channel {self.channel!r} do not match: " + "; ".join(problems)
            )

    def _make_gloo(self, prefix: str, same_host: bool) -> Any:
        dist = self._dist
        opts = dist.ProcessGroupGloo._Options()
        if same_host:
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        else:
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        opts._timeout = _td(self.connect_timeout)
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self._st_main), self.rank, 2, opts)
        # Operations wait only for data that is known to be coming, and a gloo wait that
        # times out breaks the connection: no op timeout (peer death still fails fast).
        pg.set_timeout(_FOREVER)
        return pg

    def _make_nccl(self, prefix: str) -> Any:
        dist = self._dist
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _FOREVER
        return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, self._st_main), self.rank, 2, opts)

    def wait_connected(self, timeout: float | None = None) -> None:
        """Wait until the link to the peer is built.

        Raises
        ------
        TransferTimeout
            The peer did not connect in time.
        ConfigurationError
            The two ends disagree (ranks, world size, backend, roles).
        PeerLostError, ClosedError
            The peer went away; this connector was closed.
        """
        self._check_open()
        self._wait_ready(self._deadline(timeout), None)

    def _wait_ready(self, deadline: Deadline, key: str | None) -> None:
        if not self._ready.is_set():
            if not self._ready.wait(deadline.remaining()):
                raise self._timeout("connect", key, f"rank {self.peer_rank} to connect", deadline.timeout)
        if self._closing:
            raise ClosedError(f"nccl connector on channel {self.channel!r} is closed")
        if self._link_error is not None:
            raise self._link_error

    # =================================================================== watcher
    def _watch(self) -> None:
        """Waits for the peer's goodbye on the control group; fails fast on death."""
        torch = self._torch
        buf = torch.zeros(2, dtype=torch.int64)
        work = self._ctl_pg.recv([buf], self.peer_rank, 0)
        try:
            _gloo_wait(work)
        except RuntimeError as exc:
            if self._closing:
                return
            self._peer_gone("lost", f"the process of rank {self.peer_rank} died or dropped the connection ({exc})")
            return
        kind, count = int(buf[0]), int(buf[1])
        with self._cond:
            self._recv_total = count
        # Closed before the reply: once the peer has its reply it may break the links,
        # and what then fails here must read as a clean close, not a death.
        self._peer_gone("closed", f"rank {self.peer_rank} closed channel {self.channel!r}")
        if kind == _CTL_BYE:
            self._send_bye(_CTL_BYE_REPLY)
        self._stop_poster_if_done()

    def _stop_poster_if_done(self) -> None:
        """After the peer's goodbye: wake a poster that waits for a slot that will never
        come (it read every payload the peer sent). It publishes ``_pump_seq`` before it
        reads ``_recv_total`` and we the reverse, so one of us sees the other's write."""
        total = self._recv_total
        if total is None or self._in not in self._slot_pgs or self._pump_seq < total:
            return
        self._break_group(self._slot_pgs[self._in])

    def _send_bye(self, kind: int, wait: float | None = None) -> None:
        with self._bye_lock:
            if self._bye_sent or self._ctl_pg is None:
                return
            self._bye_sent = True
        torch = self._torch
        msg = torch.tensor([kind, self._send_seq], dtype=torch.int64)
        try:
            w = self._ctl_pg.send([msg], self.peer_rank, 0)
            if wait is not None:
                w.wait(_td(wait))
        except RuntimeError as exc:
            logger.debug("nccl: goodbye on %r not delivered: %r", self.channel, exc)

    def _peer_gone(self, state: str, reason: str) -> None:
        with self._cond:
            if self._peer_state != "lost":
                self._peer_state = state
                self._peer_reason = reason
            self._cond.notify_all()
        if state == "lost" and self._is_nccl:
            for pg in self._data_groups():
                self._break_group(pg)  # NCCL kernels waiting for a dead peer would never end
        self._wake_all()

    def _data_groups(self) -> list[Any]:
        return [*self._slot_pgs.values(), *self._pgs.values()]

    def _break_group(self, pg: Any) -> None:
        """End every operation pending on ``pg`` with an error, now.

        NCCL: abort the communicator (its kernels exit). Gloo has no abort that wakes a
        waiting receive, but a wait that times out closes the group's connection to the
        peer, which fails every pending operation on both ends: a receive that nobody
        will ever match is waited for 1 ms.
        """
        if self._is_nccl:
            try:
                pg.abort()
            except RuntimeError as exc:
                logger.debug("nccl: aborting a process group of %r: %r", self.channel, exc)
            return
        torch = self._torch
        try:
            w = pg.recv([torch.empty(1, dtype=torch.uint8)], self.peer_rank, _BREAK_TAG)
            w.wait(datetime.timedelta(milliseconds=1))
        except RuntimeError:
            pass  # the connection is closed now (or was already)

    def _wake_all(self) -> None:
        """Wake threads blocked on a socket (puts waiting for credits, a disarmed poster)."""
        for waker in (self._credit_waker, self._pump_waker):
            if waker is not None:
                waker.wake()

    def _wake(self) -> None:
        self._wake_all()

    def _peer_error(self, key: str | None) -> PeerLostError:
        what = f" (key {key!r} can no longer arrive)" if key is not None else ""
        return PeerLostError(f"nccl: {self._peer_reason}{what}")


    # ==================================================================== sending
    def _put(self, key: str, payload: Any, deadline: Deadline) -> int:
        if self.role == "receiver":
            raise ConfigurationError(
                f"nccl connector on channel {self.channel!r} was opened with role='receiver' and cannot put"
            )
        self._wait_ready(deadline, key)
        peer = self._peer
        slot_bytes = peer.slot_bytes
        sp = wire.plan_send(
            payload, device=self.device, nccl=self._is_nccl, inline_bytes=self.inline_bytes,
            max_inline_total=self.max_inline_bytes, key=key, pack_bytes=self.pack_bytes, pad=self._pad,
            slot_bytes=slot_bytes,
        )
        limit = peer.max_message_bytes
        if limit is not None and sp.nbytes > limit:
            raise CapacityError(
                f"nccl: payload of key {key!r} is {sp.nbytes} bytes, more than the "
                f"max_message_bytes={limit} rank {self.peer_rank} accepts on channel {self.channel!r}"
            )
        with self._send_lock:
            self._check_send_state(key)
            repeat = key in self._sent_keys
            seq = self._send_seq
            raw = wire.encode_envelope(
                wire.Envelope(seq, key, sp.meta, sp.plan, sp.inline, wire.FLAG_REPEAT if repeat else 0)
            )
            hlimit = self._peer_header_limit
            if hlimit is not None and len(raw) > hlimit:
                raise CapacityError(
                    f"nccl: the header of key {key!r} is {len(raw)} bytes, more than the "
                    f"{hlimit} rank {self.peer_rank} accepts on channel {self.channel!r} "
                    "(a huge tree or too much inline data; lower inline_bytes)"
                )
            in_slot = wire.SLOT_HEAD + len(raw) <= slot_bytes
            if sp.slot and not (in_slot and wire.slot_start(len(raw)) + self._slot_end(sp.slot) <= slot_bytes):
                # The room was estimated from an upper bound of the envelope's size.
                raise CapacityError(f"nccl: the slot tensors of key {key!r} do not fit the slot")  # pragma: no cover
            wire_bytes = sp.p2p_bytes + (0 if in_slot else len(raw))
            self._wait_window(wire_bytes, deadline, key)
            if repeat:
                self._verdicts[seq] = None
            try:
                if self._is_nccl:
                    torch = self._torch
                    with torch.cuda.device(self.device):
                        self._send_nccl(raw, in_slot, sp, slot_bytes)
                else:
                    self._send_gloo(raw, in_slot, sp, slot_bytes)
            except BaseException:
                self._verdicts.pop(seq, None)
                raise
            # Rung after the sends are queued, never before: the receiver posts this
            # payload's receives on the bell, so none of them waits for a send not made.
            self._ring_bell(key)
            self._send_seq = seq + 1
            self._inflight.append((seq, wire_bytes))
            self._inflight_bytes += wire_bytes
            sent = self._sent_keys
            sent[key] = None
            sent.move_to_end(key)
            if len(sent) > CONSUMED_KEYS_REMEMBERED:
                sent.popitem(last=False)
            if repeat:
                # Under the send lock: the credits are read here only.
                self._check_repeat(key, seq, deadline)
        return sp.nbytes

    def _ring_bell(self, key: str | None) -> None:
        """Announce one payload whose slot and bulk sends are queued: the receiver posts
        its slot receive on this (one ZeroMQ message; the put waits for nothing). Under
        ``_send_lock``, so bells come in the order of the slots."""
        try:
            self._bell_out.send(b"\x01", zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise self._translate(exc, key) from exc

    @staticmethod
    def _slot_end(flats: list[Any]) -> int:
        end = 0
        for t in flats:
            end = wire._align(end) + int(t.numel())
        return end

    def _send_nccl(self, raw: bytes, in_slot: bool, sp: wire.SendPlan, slot_bytes: int) -> None:
        """Post one payload's slot and bulk buffers (the link's device is current).

        A slot with device tensors is filled and sent on the caller's stream, which then
        waits for it (the caller may reuse its tensors: the stream contract). A slot of
        host bytes only goes from the connector's send stream, so it does not queue
        behind the bulk data of earlier payloads on the caller's stream: the receiver
        reads it and posts this payload's bulk receives while those are still moving.
        """
        torch = self._torch
        uint8 = torch.uint8
        dev = self.device
        head = wire.slot_head(len(raw), in_slot)
        n = wire.SLOT_HEAD + (len(raw) if in_slot else 0)
        # Pinned staging from torch's caching host allocator: the copy records its
        # stream, so the block is not reused before the copy has read it.
        staging = torch.empty(n, dtype=uint8, pin_memory=True)
        view = staging.numpy()
        view[: wire.SLOT_HEAD] = memoryview(head)
        if in_slot:
            view[wire.SLOT_HEAD:] = memoryview(raw)
        peer = self.peer_rank
        slot_pg = self._slot_pgs[self._out]
        try:
            if sp.slot:
                slot = torch.empty(slot_bytes, dtype=uint8, device=dev)
                slot[:n].copy_(staging, non_blocking=True)
                start = wire.slot_start(len(raw))
                parts: list[Any] = []
                end = 0
                for flat in sp.slot:
                    at = wire._align(end)
                    if at > end:
                        parts.append(self._pad[: at - end])
                    parts.append(flat)
                    end = at + int(flat.numel())
                torch.cat(parts, out=slot[start: start + end])
                slot_pg.send([slot], peer, 0).wait()
                return
            with torch.cuda.stream(self._send_stream):
                slot = torch.empty(slot_bytes, dtype=uint8, device=dev)
                slot[:n].copy_(staging, non_blocking=True)
                slot_pg.send([slot], peer, 0)
            bulk = sp.p2p
            if not in_slot:
                env = torch.empty(len(raw), dtype=uint8, pin_memory=True)
                env.numpy()[:] = memoryview(raw)
                bulk = [env.to(dev, non_blocking=True), *bulk]
            if bulk:
                for w in self._post(self._pgs[self._out], bulk, send=True):
                    w.wait()  # the caller's stream waits for the sends: reuse is safe
        except RuntimeError as exc:
            raise self._translate(exc, None) from exc

    def _send_gloo(self, raw: bytes, in_slot: bool, sp: wire.SendPlan, slot_bytes: int) -> None:
        """Post one payload's slot and bulk buffers on gloo; the reaper keeps them alive
        until sent (gloo reads them when the receiver is ready)."""
        import numpy as np

        torch = self._torch
        slot = np.zeros(slot_bytes, dtype=np.uint8)
        slot[: wire.SLOT_HEAD] = memoryview(wire.slot_head(len(raw), in_slot))
        if in_slot:
            slot[wire.SLOT_HEAD: wire.SLOT_HEAD + len(raw)] = memoryview(raw)
        if sp.slot:
            at = wire.slot_start(len(raw))
            end = 0
            for flat in sp.slot:
                start = wire._align(end)
                n = int(flat.numel())
                slot[at + start: at + start + n] = flat.numpy()
                end = start + n
        bulk = sp.p2p if in_slot else [torch.frombuffer(bytearray(raw), dtype=torch.uint8), *sp.p2p]
        st = torch.from_numpy(slot)
        try:
            works = [self._slot_pgs[self._out].send([st], self.peer_rank, 0)]
        except RuntimeError as exc:
            raise self._translate(exc, None) from exc
        works += self._post(self._pgs[self._out], bulk, send=True) if bulk else []
        self._reap_q.put((works, [st, *bulk]))

    def _check_repeat(self, key: str, seq: int, deadline: Deadline) -> None:
        """Wait for the credit of a repeated key's payload; raise DuplicateKeyError if the
        receiver still held the earlier payload under it (it dropped this one)."""
        try:
            while self._acked_upto < seq:
                remaining = deadline.remaining()
                if remaining == 0.0:
                    raise self._timeout(
                        "put", key, f"rank {self.peer_rank} to acknowledge a repeated key", deadline.timeout
                    )
                self._await_credits(remaining, key)
            duplicate = self._verdicts.get(seq)
        finally:
            self._verdicts.pop(seq, None)
        if duplicate:
            raise duplicate_key(self.backend, self.channel, key)

    def _check_send_state(self, key: str | None) -> None:
        if self._closing:
            raise ClosedError(f"nccl connector on channel {self.channel!r} is closed")
        if self._link_error is not None:
            raise self._link_error
        if self._peer_state is not None:
            raise self._peer_error(None)

    def _wait_window(self, nbytes: int, deadline: Deadline, key: str) -> None:
        """Block until the payload fits the send window (credits come on the socket)."""
        inflight = self._inflight
        if len(inflight) < self._lazy_count and self._inflight_bytes + nbytes <= self._lazy_bytes:
            return  # far from the limits: the credits can wait in the socket
        self._read_credits(key)
        while inflight and (
            len(inflight) >= self.send_window or self._inflight_bytes + nbytes > self.max_inflight_bytes
        ):
            remaining = deadline.remaining()
            if remaining == 0.0:
                raise self._timeout("put", key, f"rank {self.peer_rank} to receive earlier payloads", deadline.timeout)
            self._await_credits(remaining, key)

    def _await_credits(self, timeout: float | None, key: str | None) -> None:
        """Wait (up to ``timeout``) for a credit or a wake-up, then read what came."""
        waker = cast(_Waker, self._credit_waker)
        try:
            events = dict(self._credit_poller.poll(_poll_ms(timeout)))
        except zmq.ZMQError as exc:
            raise self._translate(exc, key) from exc
        if waker.rx in events:
            waker.drain()
        self._read_credits(key)
        self._check_send_state(key)

    def _read_credits(self, key: str | None) -> None:
        """Take every credit waiting on the socket (never blocks; under ``_send_lock``)."""
        sock = self._credit_in
        inflight = self._inflight
        while True:
            try:
                raw = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                raise self._translate(exc, key) from exc
            try:
                if not self._credit_authed:
                    if raw != self._sid.encode():
                        raise BlobDecodeError(
                            f"nccl: the first message on the credit socket of channel {self.channel!r} "
                            "is not this session's id (another process connected to it)"
                        )
                    self._credit_authed = True
                    continue
                seq, duplicate = wire.decode_credit(raw)
                if not self._acked_upto < seq < self._send_seq:
                    raise BlobDecodeError(
                        f"nccl: credit for payload {seq} on channel {self.channel!r}, expected one in "
                        f"{self._acked_upto + 1}..{self._send_seq - 1}"
                    )
            except BlobDecodeError as exc:
                self._fail_link(exc, "credit")
                raise
            self._acked_upto = seq
            if seq in self._verdicts:
                self._verdicts[seq] = duplicate
            while inflight and inflight[0][0] <= seq:
                self._inflight_bytes -= inflight.popleft()[1]

    def _post(self, pg: Any, tensors: list[Any], *, send: bool) -> list[Any]:
        """Post one send/recv per tensor, as one NCCL group where the backend can (the
        caller has made the link's device current)."""
        op = pg.send if send else pg.recv
        peer = self.peer_rank
        try:
            if self._is_nccl and self.coalesce and len(tensors) > 1:
                pg._start_coalescing()
                try:
                    for t in tensors:
                        op([t], peer, 0)
                finally:
                    work = pg._end_coalescing()
                return [work]
            return [op([t], peer, 0) for t in tensors]
        except RuntimeError as exc:
            raise self._translate(exc, None) from exc

    def _reap_loop(self) -> None:
        """Gloo sends complete when the receiver takes them; keep snapshots alive till then."""
        while True:
            item = self._reap_q.get()
            if item is None:
                return
            works, _keep = item
            for w in works:
                try:
                    _gloo_wait(w)
                except RuntimeError as exc:
                    if self._closing or self._peer_state is not None:
                        return
                    self._peer_gone("lost", f"sending to rank {self.peer_rank} failed ({exc})")
                    return

    def _translate(self, exc: BaseException, key: str | None) -> TransportError:
        if self._closing:
            return ClosedError(f"nccl connector on channel {self.channel!r} is closed")
        if self._peer_state is not None:
            return self._peer_error(key)
        return PeerLostError(f"nccl: channel {self.channel!r}: {exc}")

    # ================================================================== receiving
    def _post_loop(self) -> None:
        """Post a slot receive for each payload the sender announced on the doorbell (at
        most ``recv_depth`` at once), read each slot in sequence order as it lands and
        post its payload's bulk receives (eagerly: a put followed by a get in one thread
        never deadlocks, and keys may be got in any order). Nothing is posted before the
        bell of its payload: every receive this thread posts matches sends already
        queued on the sender's side."""
        torch = self._torch
        slot_pg = self._slot_pgs[self._in]
        peer = self.peer_rank
        dev = self.device
        uint8 = torch.uint8
        slot_bytes = self.slot_bytes
        nccl = self._is_nccl
        if nccl:
            # This thread's own device and stream (thread-local in torch), set once: the
            # slot buffers come from the slot stream, which waits for their receives.
            torch.cuda.set_device(dev)
            torch.cuda.set_stream(self._recv_streams[0])
        ring = self._ring
        depth = self.recv_depth

        def post_slot() -> None:
            if nccl:
                buf = torch.empty(slot_bytes, dtype=uint8, device=dev)
                slot_pg.recv([buf], peer, 0).wait()
                # The slot's bytes reach the host behind its receive, queued now: when
                # the slot lands, no host round trip stands between it and its reader.
                host = torch.empty(slot_bytes, dtype=uint8, pin_memory=True)
                host.copy_(buf, non_blocking=True)
                # CUDA's default wait spins (the fastest wake-up); it is short: the
                # slot's send was queued before its bell rang.
                landed = torch.cuda.Event()
                landed.record()
                ring.append((buf, host, landed))
            else:
                buf = torch.empty(slot_bytes, dtype=uint8)
                ring.append((buf, buf, slot_pg.recv([buf], peer, 0)))
            self._slots_posted += 1

        seq = 0
        while True:
            self._pump_seq = seq
            total = self._recv_total
            if self._closing or self._peer_state == "lost" or (total is not None and seq >= total):
                return
            # Bells that came meanwhile (never blocks): post their slots, up to the depth.
            if not self._take_bells(block=False):
                return
            while self._slots_posted < self._announced and len(ring) < depth:
                post_slot()
            if not ring:
                # Nothing announced: wait for the next bell with no receive posted.
                if not self._take_bells(block=True):
                    return
                continue
            buf, host, landed = ring[0]
            try:
                if nccl:
                    landed.synchronize()
                else:
                    _gloo_wait(landed)
            except RuntimeError as exc:
                if self._closing or self._peer_state is not None:
                    return
                self._peer_gone("lost", f"the process of rank {peer} died or dropped the connection ({exc})")
                return
            total = self._recv_total
            if self._closing or self._peer_state == "lost" or (total is not None and seq >= total):
                return  # woken by close or by the goodbye, not by a slot
            ring.popleft()
            self._take(seq, buf, host)
            seq += 1
            self._posted = seq

    def _take_bells(self, *, block: bool) -> bool:
        """Count the doorbells waiting on the socket into ``_announced``; with ``block``,
        wait (woken by the socket or the waker) until at least one came. ``False`` when
        the link ended meanwhile. The first message must be the session id, and a bell
        beyond the send window is a forgery that fails the link."""
        sock = self._bell_in
        waker = cast(_Waker, self._pump_waker)
        poller = self._bell_poller
        got = 0
        while True:
            total = self._recv_total
            if self._closing or self._peer_state == "lost" or (total is not None and self._pump_seq >= total):
                return False
            try:
                raw = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                if got or not block:
                    return True
                try:
                    if waker.rx in dict(poller.poll()):
                        waker.drain()
                except zmq.ZMQError:
                    if self._closing:
                        return False
                    raise
                continue
            except zmq.ZMQError as exc:
                if self._closing:
                    return False
                self._peer_gone("lost", f"the doorbell socket of channel {self.channel!r} failed ({exc})")
                return False
            if not self._bell_authed:
                if raw != self._sid.encode():
                    raise BlobDecodeError(
                        f"nccl: the first message on the doorbell socket of channel {self.channel!r} is "
                        "not this session's id (another process connected to it)"
                    )
                self._bell_authed = True
                continue
            if raw != b"\x01" or self._announced - self._pump_seq >= self._peer.send_window:
                # More announced and unread than the sender's window allows: posting
                # receives for them could leave one waiting for a send never made.
                raise BlobDecodeError(
                    f"nccl: unexpected doorbell message on channel {self.channel!r} "
                    f"({len(raw)} bytes, {self._announced - self._pump_seq} payloads already announced)"
                )
            self._announced += 1
            got += 1

    def _parse(self, env: wire.Envelope) -> tuple[Any, list[int], int, int]:
        """``(header, bulk sizes, frame size, SLOT bytes)`` of an envelope, validated.

        What a stage sends chunk after chunk has the same meta, plan and inline sizes:
        the result of the last ``_META_CACHE`` distinct ones is kept, keyed by all three
        (the meta bytes fix the descriptors; the plan and inline sizes are what
        ``wire.parse_meta`` checks against them)."""
        key = (env.meta, tuple(env.plan), tuple(len(part) for part in env.inline))
        hit = self._meta_cache.get(key)
        if hit is not None:
            return hit
        header = wire.parse_meta(env)
        sizes = wire.check_sizes(header, env.plan)
        frame = blob.peek_header(env.meta)[2]
        used = wire.slot_layout(header, env.plan)[1]
        if len(self._meta_cache) >= _META_CACHE:
            self._meta_cache.clear()
        hit = self._meta_cache[key] = (header, sizes, frame, used)
        return hit

    def _take(self, seq: int, slot: Any, host: Any) -> None:
        """Read the landed slot ``seq`` and post its payload's bulk receives.

        Everything the slot declares is validated, and the payload's size checked
        against ``max_message_bytes``, before anything is allocated. A slot that cannot
        be sized leaves no way to stay in step with the sends: it fails the link with
        its named error (raised to ``_guard``), never with an allocation.
        """
        torch = self._torch
        raw = host.numpy()
        env_len, in_slot = wire.read_slot_head(raw, self.slot_bytes, self.max_header_bytes)
        env_raw = raw[wire.SLOT_HEAD: wire.SLOT_HEAD + env_len] if in_slot else self._recv_envelope(env_len)
        env = wire.decode_envelope(env_raw)
        if env.seq != seq:
            raise BlobDecodeError(f"nccl: slot {seq} of channel {self.channel!r} says seq {env.seq}")
        header, sizes, frame, used = self._parse(env)
        if frame > self.max_message_bytes:
            raise CapacityError(
                f"nccl: rank {self.peer_rank} announced key {env.key!r} of {frame} bytes on channel "
                f"{self.channel!r}, more than max_message_bytes={self.max_message_bytes}; nothing "
                "was allocated, and the link cannot continue (the sender ignored the limit)"
            )
        sstart = wire.slot_start(env_len)
        if used:
            if not in_slot or sstart + used > self.slot_bytes:
                raise BlobDecodeError(
                    f"nccl: key {env.key!r} plans {used} bytes of SLOT tensors at {sstart}, beyond its "
                    f"{self.slot_bytes}-byte slot"
                )
        nbytes = sum(sizes)
        item = _Arrived(seq, env.key, nbytes, frame)
        with self._cond:
            # Backpressure: hold off while unread payloads fill the budget.
            while (
                self._pending_bytes
                and self._pending_bytes + nbytes > self.max_pending_bytes
                and not self._closing
            ):
                self._cond.wait()
            if self._closing:
                return
            if self._inbox.get(env.key):
                item.duplicate = True  # received below, then dropped with its verdict
            else:
                self._pending_bytes += nbytes
                self._inbox.setdefault(env.key, collections.deque()).append(item)
                self._consumed.forget(env.key)
        event = None
        works: list[Any] = []
        uint8 = torch.uint8
        if self._is_nccl:
            bufs: list[Any] = []
            if sizes:
                with torch.cuda.stream(self._recv_streams[1]):
                    bufs = [torch.empty(n, dtype=uint8, device=self.device) for n in sizes]
                    works = self._post(self._pgs[self._in], bufs, send=False)
                    for w in works:
                        w.wait()  # the bulk stream waits for the receives
                    if wire.STAGED in env.plan:
                        # Host data staged through the device: back to (pinned) host
                        # memory on the bulk stream, after the receives.
                        host_bufs = []
                        for buf, staged in zip(bufs, wire.staged_transfers(env.plan)):
                            if staged:
                                h = torch.empty(buf.numel(), dtype=uint8, pin_memory=True)
                                h.copy_(buf, non_blocking=True)
                                buf = h
                            host_bufs.append(buf)
                        bufs = host_bufs
                    event = torch.cuda.Event()
                    event.record()
            item.device_tensors = [b for b in bufs if b.is_cuda]
            if wire.SLOT in env.plan:
                item.device_tensors.append(slot)
        else:
            bufs = [torch.empty(n, dtype=uint8) for n in sizes]
            works = self._post(self._pgs[self._in], bufs, send=False) if bufs else []
        if not item.duplicate and wire.early_ready(header, env.plan, nccl=self._is_nccl):
            # Building the payload's views and tree needs none of its bulk bytes: it is
            # ready now, and get waits for them itself (the completer, which credits
            # the sender, is not in the way). Without bulk buffers it has landed.
            landed = event if event is not None else (_Landed() if works else None)
            self._ready_early(item, env, header, bufs, landed, slot, sstart)
        self._done_q.put((item, env, header, bufs, works, event, slot, sstart))

    def _recv_envelope(self, n: int) -> Any:
        """The envelope that did not fit its slot: the payload's first bulk buffer (rare:
        a huge tree or much inline data), received and brought to the host now."""
        torch = self._torch
        pg = self._pgs[self._in]
        if not self._is_nccl:
            buf = torch.empty(n, dtype=torch.uint8)
            for w in self._post(pg, [buf], send=False):
                _gloo_wait(w)
            return buf.numpy()
        with torch.cuda.stream(self._recv_streams[1]):
            buf = torch.empty(n, dtype=torch.uint8, device=self.device)
            for w in self._post(pg, [buf], send=False):
                w.wait()
            host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            host.copy_(buf, non_blocking=True)
            landed = torch.cuda.Event(blocking=True)
            landed.record()
        landed.synchronize()
        if self._closing or self._peer_state == "lost":
            raise ClosedError(f"nccl connector on channel {self.channel!r} is closed")
        return host.numpy()

    def _ready_early(
        self, item: _Arrived, env: wire.Envelope, header: Any, bufs: list[Any], landed: Any, slot: Any,
        sstart: int,
    ) -> None:
        try:
            views = wire.build_views(
                header, env.plan, env.inline, bufs, device=self.device, slot=slot, slot_start=sstart,
            )
            payload = wire.decode_tree(header, views)
        except OmnilinkError as exc:
            logger.warning("nccl: channel %r: key %r is malformed: %s", self.channel, env.key, exc)
            with self._cond:
                item.error = exc
                item.device_tensors = []
                self._cond.notify_all()
            return
        with self._cond:
            item.event = landed
            item.payload = payload
            item.done = True
            self._ready_count += 1
            self._cond.notify_all()

    def _done_loop(self) -> None:
        """Wait for each payload's data in order, build it (unless the poster did), credit it."""
        sock = self._credit_out
        peer = self._peer
        # Credits go in batches: an eighth of the sender's window (count and bytes), at
        # once for a repeated key's verdict, and whenever nothing more is in hand.
        every = max(1, peer.send_window // 8)
        every_bytes = max(1, (peer.max_inflight_bytes or self.max_inflight_bytes) // 8)
        owed = owed_bytes = 0
        gloo = not self._is_nccl
        if not gloo:
            self._torch.cuda.set_device(self.device)
        while True:
            entry = self._done_q.get()
            if entry is None:
                return
            item, env, header, bufs, works, event, slot, sstart = entry
            early = item.done or item.error is not None
            try:
                try:
                    if event is not None:
                        event.synchronize()
                    for w in works:
                        if gloo:
                            _gloo_wait(w)  # the data is here
                        else:
                            w.wait()  # already complete: raises if NCCL aborted it
                finally:
                    if isinstance(item.event, _Landed):
                        with self._cond:
                            item.event.set()  # a get waiting for it checks the link state
                            self._cond.notify_all()
                if not early:
                    views = wire.build_views(
                        header, env.plan, env.inline, bufs, device=self.device, slot=slot, slot_start=sstart,
                    )
                    payload = wire.decode_tree(header, views)
            except BaseException as exc:
                if self._closing:
                    return
                with self._cond:
                    if not early:
                        item.error = exc if isinstance(exc, OmnilinkError) else PeerLostError(
                            f"nccl: receiving key {env.key!r} on channel {self.channel!r} failed: {exc}"
                        )
                        item.device_tensors = []
                    self._recv_done = item.seq + 1
                    self._cond.notify_all()
                if not isinstance(exc, OmnilinkError):
                    self._peer_gone("lost", f"receiving from rank {self.peer_rank} failed ({exc})")
                    return
                # Its bytes were all received: the stream is in step, so this bad
                # payload is an error for its key only and the link keeps serving.
                logger.warning("nccl: channel %r: key %r is malformed: %s", self.channel, env.key, exc)
            else:
                if early:
                    self._recv_done = item.seq + 1
                    if self._peer_state is not None:
                        with self._cond:
                            self._cond.notify_all()  # a get may wait for what the peer sent
                else:
                    with self._cond:
                        if item.duplicate:
                            logger.warning(
                                "nccl: channel %r dropped a second payload under key %r (still pending)",
                                self.channel, item.key,
                            )
                            item.device_tensors = []
                        else:
                            item.payload = payload
                            item.done = True
                            self._ready_count += 1
                        self._recv_done = item.seq + 1
                        self._cond.notify_all()
            # Drop this thread's references: the payload lives as long as its reader wants.
            payload = entry = slot = None
            views = bufs = []
            owed += 1
            owed_bytes += item.nbytes
            if (
                item.duplicate
                or env.flags & wire.FLAG_REPEAT
                or owed >= every
                or owed_bytes >= every_bytes
                or self._done_q.empty()
            ):
                try:
                    sock.send(wire.encode_credit(item.seq, item.duplicate), zmq.NOBLOCK)
                except zmq.ZMQError as exc:
                    if not self._closing and self._peer_state is None:
                        self._peer_gone("lost", f"the credit socket of channel {self.channel!r} failed ({exc})")
                    return
                owed = owed_bytes = 0

    def _get(self, key: str, deadline: Deadline, block: bool) -> Any:
        if self.role == "sender":
            raise ConfigurationError(
                f"nccl connector on channel {self.channel!r} was opened with role='sender' and cannot get"
            )
        if block:
            self._wait_ready(deadline, key)
        elif not self._ready.is_set():
            raise WouldBlock(f"nccl: channel {self.channel!r} is not connected yet")
        else:
            self._wait_ready(deadline, key)
        with self._cond:
            while True:
                if self._closing:
                    raise ClosedError(f"nccl connector on channel {self.channel!r} is closed")
                q = self._inbox.get(key)
                item = q[0] if q else None
                landed: Any = None if item is None else item.event
                landing = landed is not None and not landed.query()
                if landing and not block:
                    raise WouldBlock(f"nccl: key {key!r} is still arriving on channel {self.channel!r}")
                if landing and not isinstance(landed, _Landed):
                    # A CUDA event: wait for the bytes outside the lock, then look again.
                    self._cond.release()
                    try:
                        landed.synchronize()
                    except RuntimeError as exc:
                        raise PeerLostError(
                            f"nccl: receiving key {key!r} on channel {self.channel!r} failed: {exc}"
                        ) from exc
                    finally:
                        self._cond.acquire()
                    continue
                if q and item is not None and not landing and (item.done or item.error is not None):
                    q.popleft()
                    if not q:
                        del self._inbox[key]
                    self._pending_bytes -= item.nbytes
                    if item.done:
                        self._ready_count -= 1
                    self._consumed.add(key)
                    self._cond.notify_all()
                    break
                if item is None and key in self._consumed:
                    raise self._consumed.error(self.backend, self.channel, key)
                # (A gloo payload landing: the completer notifies when it has.)
                if item is None and self._peer_state is not None and not self._more_may_come():
                    raise self._peer_error(key)
                if self._link_error is not None:
                    raise self._link_error
                if not block:
                    raise WouldBlock(f"nccl: key {key!r} has not arrived on channel {self.channel!r}")
                remaining = deadline.remaining()
                if remaining == 0.0:
                    raise self._timeout("get", key, f"rank {self.peer_rank}", deadline.timeout)
                self._cond.wait(remaining)
        if item.error is not None:
            raise item.error
        if item.event is not None and self._peer_state == "lost" and item.seq >= self._recv_done:
            # Its receives ended because the link was aborted, not because its bytes came.
            raise self._peer_error(key)
        self._count(bytes_got=item.frame_bytes)
        if item.device_tensors:
            torch = self._torch
            stream = torch.cuda.current_stream(self.device)
            for t in item.device_tensors:
                # Allocated on our side stream: keep the allocator from reusing the
                # memory while the caller's stream may still use it.
                t.record_stream(stream)
        return item.payload

    def _arrivals(self, known: set[str], timeout: float) -> set[str]:
        if self.role == "sender":
            raise ConfigurationError(
                f"nccl connector on channel {self.channel!r} was opened with role='sender' and cannot get"
            )
        deadline = Deadline(timeout)
        while True:
            arriving = None
            with self._cond:
                if self._closing:
                    raise ClosedError(f"nccl connector on channel {self.channel!r} is closed")
                avail = set()
                for k, q in self._inbox.items():
                    item = q[0] if q else None
                    if item is None or not (item.done or item.error is not None):
                        continue
                    if item.event is not None and not item.event.query():
                        if k not in known and (arriving is None or item.seq < arriving.seq):
                            arriving = item
                        continue
                    avail.add(k)
                if not avail <= known:
                    return avail
                if self._link_error is not None:
                    raise self._link_error
                if self._peer_state is not None and not self._more_may_come() and arriving is None:
                    raise self._peer_error(None)
                remaining = deadline.remaining()
                if not remaining:
                    return avail
                if arriving is None:
                    self._cond.wait(remaining)
                    continue
            # A payload whose bytes are still on the wire: its event says when (this is
            # the waiter thread, which may block; later payloads land after it).
            try:
                arriving.event.synchronize()
            except RuntimeError:
                pass  # the link failed: the state says so on the next turn

    def _more_may_come(self) -> bool:
        """After the peer closed: whether payloads it sent are still being received."""
        if self._peer_state == "lost":
            return False
        total = self._recv_total
        return total is not None and self._recv_done < total

    def _discard(self, key: str) -> bool:
        with self._cond:
            q = self._inbox.get(key)
            if not q or not q[0].done:
                return False
            item = q.popleft()
            if not q:
                del self._inbox[key]
            self._pending_bytes -= item.nbytes
            self._ready_count -= 1
            self._consumed.add(key, "discarded")
            self._cond.notify_all()
        return True

    def _in_use(self) -> tuple[int, int]:
        with self._cond:
            return (self._ready_count, self._pending_bytes)


    # ==================================================================== closing
    def close(self) -> None:
        """Close the link; idempotent.

        A sender first waits (up to ``connect_timeout``) for the payloads it announced to
        be received, then says goodbye so the peer can tell a clean close from a crash.
        Calls blocked in this connector raise ``ClosedError``.
        """
        if self._closed:
            return
        if self._ready.is_set() and self._link_error is None and self._out in self._pgs:
            self._linger(Deadline(self.connect_timeout))
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        super().close()

    def _linger(self, deadline: Deadline) -> None:
        remaining = deadline.remaining()
        if not self._send_lock.acquire(timeout=-1 if remaining is None else remaining):
            logger.warning("nccl: closing channel %r while a put still waits", self.channel)
            return
        try:
            last = self._send_seq - 1
            self._read_credits(None)
            while last > self._acked_upto and self._peer_state is None:
                remaining = deadline.remaining()
                if remaining == 0.0:
                    logger.warning("nccl: closing channel %r with payloads not yet received", self.channel)
                    return
                self._await_credits(remaining, None)
        except OmnilinkError as exc:
            logger.debug("nccl: closing channel %r: %r", self.channel, exc)
        finally:
            self._send_lock.release()

    def _close(self) -> None:
        setup = self._threads[0]
        if setup.is_alive():
            # Still looking for the peer: wake its hello wait (an empty hello is created
            # only where none exists, so a real one is never clobbered), then let it
            # finish the step it is in.
            try:
                self._st_main.compare_set(f"hello/{self.peer_rank}", "", _WAKE)
            except RuntimeError:
                pass
            setup.join(self.connect_timeout)
        self._wake_all()
        if self._ctl_pg is not None and self._peer_state is None:
            wait = min(self.connect_timeout, 10.0)
            self._send_bye(_CTL_BYE, wait=wait)
            # The reply says the peer has marked us closed: only then break the links,
            # so that what fails on its side reads as a clean close.
            watcher = next((t for t in self._threads if "-watcher-" in t.name), None)
            if watcher is not None:
                watcher.join(wait)
        # Receives still pending (a payload whose sender died mid-way, a poster in a
        # slot wait) would never end: end them (an NCCL abort, a gloo connection
        # closed), which also wakes every thread blocked in one.
        for pg in self._data_groups():
            self._break_group(pg)
        self._reap_q.put(None)
        self._done_q.put(None)
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(2.0)
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            logger.debug("nccl: threads still blocked at close of %r: %s", self.channel, stuck)
        with self._cond:
            self._inbox.clear()
            self._pending_bytes = 0
            self._ready_count = 0
        self._close_sockets(stuck)
        self._release_claim()
        if not stuck:
            self._pgs.clear()
            self._slot_pgs.clear()
            self._ctl_pg = None

    def _close_sockets(self, stuck: list[str]) -> None:
        """Close the ZeroMQ sockets whose users are done, then the context if all are."""
        if self._zctx is None:
            return
        left = []
        if self._send_lock.acquire(timeout=2.0):
            try:
                for s in (self._credit_in, self._credit_waker, self._bell_out):
                    if s is not None:
                        s.close()
            finally:
                self._send_lock.release()
        else:
            left.append("sender")
        for thread, parts in (("completer", (self._credit_out,)), ("poster", (self._bell_in, self._pump_waker))):
            if any(f"-{thread}-" in name for name in stuck):
                left.append(thread)
                continue
            for s in parts:
                if s is not None:
                    s.close()
        if left:
            logger.debug("nccl: sockets of %r left to the garbage collector (still in use: %s)", self.channel, left)
            return
        self._zctx.term()
        self._zctx = None
