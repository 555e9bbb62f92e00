"""The ``nccl`` backend: payloads between two processes through ``torch.distributed``.

Protocol 6 (the device run, on two GPUs: ``benchmarks/gpu/run_nccl_device.sh``). Tensor bytes travel by point-to-point
send/recv: between GPUs through NCCL's own library (``omnilink.cuda.nccl``: ``ncclSend``
/ ``ncclRecv`` on the streams below, no process group and its per-operation cost),
between CPUs through a gloo process group (so CI runs the same protocol), received
straight into fresh tensors on the receiver's device. Each
payload's header (its envelope, see ``omnilink.connectors.nccl.wire``) travels on a
plain stream socket, the *doorbell* (``omnilink.connectors.bell``: no I/O thread
between the two ends), sent once the payload's sends are queued; small payloads travel
in that message whole. Credits come back, batched, on a ZeroMQ ``PAIR`` socket. The torch.distributed store (a ``TCPStore``) both ends share serves the
rendezvous only: hellos, rank claims, the NCCL unique ids, the gloo groups' own setup
and the two sockets' addresses, exchanged once. Nothing is pickled.

One channel links exactly two ranks. Each connector builds its own communicators over
the store (NCCL communicators of two ranks, or ``ProcessGroupGloo`` objects; never the
global default group), so it never disturbs the application's own torch.distributed
setup: per direction one *bulk* communicator (matched in issue order), plus one gloo
group for the goodbye::

    rank 0 (e.g. sender, cuda:0)                      rank 1 (e.g. receiver, cuda:1)
    ----------------------------                      ------------------------------
    put(key, payload)
      plan: small host data inline (with
        bell_bytes set, small device tensors
        when nothing else needs NCCL copied to
        pinned host, the put waiting for its
        stream to reach them: the region)
      the doorbell: envelope + inline data
        + region ----- stream socket ---------->     get(key) / get_nowait(key), itself:
      at once: ONE NCCL group of sends (pack,
        then large tensors) on the caller's
        stream
             ======= bulk communicator =========>     (posted on the bell, below)
                                                       poll the doorbell (deadline),
                                                       validate each message (bounds,
                                                       plan, sizes) BEFORE allocating,
                                                       post ITS bulk receives in bell
                                                       order (any key: others go to the
                                                       index of arrived payloads), event
                                                       on the receive stream; region ->
                                                       pinned -> device (same stream)
                                                     return: the caller's stream waits
                                                       for the event (the host does not)
      credit socket (read lazily) <---- zmq PAIR ---  credit "receives of 0..seq posted"
                                                       (batched; at once for a verdict)
                                                     keeper thread: reads the doorbell
                                                       only while no get does (after a
                                                       1 ms grace): liveness, see below

A payload costs ONE doorbell message plus, when it has device tensors (or host tensors
too large to ride inline), ONE coalesced set of NCCL operations; with ``bell_bytes``
set, a payload of small device tensors costs no NCCL operation at all.
The receiving host never waits for the GPU to learn a header, and no thread hand-off
stands between a doorbell and a ``get`` that waits for it: the getter reads the socket
itself. Payloads other than the one asked for are posted too as their doorbells come
(in order: NCCL matches a pair's operations in issue order), so keys may be got in any
order.

No receive waits for a send that was not made: a posted NCCL receive is a kernel
resident on the GPU until its sender sends, and with CUDA's lazy module loading
(``CUDA_MODULE_LOADING=LAZY``, the default since CUDA 12.2) the first launch of a kernel
from a module not yet loaded waits for the kernels resident on the device. A receive
posted ahead of its payload thus made the receiving process's next first-time launch
wait for the sender's next put, forever if none came; and a process that both sends and
receives (``role="dual"``) deadlocked its own first put (found on 2x H100, NCCL 2.28,
CUDA 13). So the receiver posts a payload's receives only once its doorbell was read,
and the sender rings the doorbell in the same ``put`` that queues the payload's sends,
just before queueing them (its pack copied before the bell; between the bell and the
sends only NCCL's host calls, which launch no kernel not yet loaded and wait for nothing
of the peer): every receive posted matches sends queued, or about to be queued by a
host that waits for nothing, and a link that carries nothing keeps nothing posted, in
either direction. (The bell first lets the receiver's host post while this host
queues; ``BELL_BEFORE_SENDS = False`` rings it after the sends. A send that fails after
its bell fails the link.)

The keeper thread, and why it exists: a send is resident on the SENDER's GPU until its
receive is posted, and the sender's stream waits for it (``put``'s stream contract). If
the receiving application did not call ``get`` for a while (it computes), nobody would
read the doorbell: the sender's stream would stall, its window would fill, and two
``dual`` ends that each sync on their stream before their next ``get`` would deadlock.
So a keeper thread reads the doorbell whenever no ``get`` has done so for 1 ms: it posts
the receives of what arrived (into the index) and sends the credits. A ``get`` that
finds the keeper reading wakes it, takes the doorbell over while it waits for its
payload (the hand-over overlaps that wait) and gives it back when it returns. What
remains for users: while a payload is on its way, a kernel a process launches for the
first time waits until the payload has landed (receiver) or until the receiver read
its doorbell (sender: at most ~1 ms after the receiving application stops calling
``get``, unless the receiver holds ``max_pending_bytes`` unread). Where even that
matters, start the processes with ``CUDA_MODULE_LOADING=EAGER`` or run each kernel the
stage uses once before the first ``put``/``get`` (a warm-up).

Life of one payload (``seq`` counts the sender's puts on this link)::

     put: sends queued, bell rung   a reader: validated, receives posted   bytes landed
    -------------------> ANNOUNCED ----------------------> IN THE INDEX -----------> (GPU)
                         (deferred while the receiver   get: the caller's stream waits
                          holds max_pending_bytes)       for them; host data staged
                                                         through the device, and gloo
                                                         data, are waited for by the host

Semantics, chosen and tested:

- ``put`` returns once the caller may reuse its tensors. CUDA tensors on the link's
  device are sent from the caller's own memory with no copy: the sends are ordered after
  the caller's current stream, which goes on only once they are sent: free a tensor
  after ``put`` as any tensor a stream still uses (the CUDA stream contract, as for
  ``tensor.to(..., non_blocking=True)``: memory the caching allocator hands out again
  on that stream is used after the sends; a tensor made on another stream needs
  ``record_stream`` or a reference kept). With ``bell_bytes`` set, a payload whose
  device tensors ride the doorbell (at most ``bell_bytes`` together, nothing else for
  NCCL) is copied to pinned host memory on the caller's stream and ``put`` waits for
  that copy: it returns once the caller's stream has reached it (the default, 0, keeps
  every device tensor on NCCL and ``put`` asynchronous). Host data on a gloo link is
  snapshotted (one memcpy) because gloo reads it whenever the receiver is ready. Host
  tensors ride inside the envelope when small (``inline_bytes``); larger ones go by
  gloo, or on an NCCL link are staged through the device (copied up, sent, copied back
  to host on the receiver).
- ``get`` returns the payload with the caller's current stream ordered after its bytes
  (``wait_event``: the host does not wait for the GPU; use the tensors on that stream,
  or synchronise as for any CUDA tensor). Host data that came through the device
  (staged) and gloo data are waited for on the host: ``get`` returns once they have
  landed, ``get_nowait`` says ``WouldBlock`` until then.
- Small tensors travel together: device tensors of at most ``pack_bytes`` that need
  NCCL are copied into one pack buffer and sent by one send when there are two or more
  (on gloo, host tensors likewise); on the receiver they are views of the pack (or of
  the region, for those that rode the doorbell). Large tensors keep their own
  zero-copy transfer.
- Flow control by credits, not acknowledgements: at most ``send_window`` payloads (and
  ``max_inflight_bytes``) are announced and not yet posted by the receiver. Send/recv
  pairs are matched in order, so no payload needs an answer of its own: the receiver
  sends "receives of 0..seq posted" after a batch (an eighth of the window or of the
  in-flight bytes), at once for a verdict, and once the doorbell has been quiet for a
  millisecond (nothing more in hand: a sender waiting for room gets what is owed); the
  sender reads credits only when it gets within half of a limit. A ``put`` that
  finds no room waits for credits (woken by the socket) up to its timeout, then raises
  ``TransferTimeout`` having sent nothing. The receiver posts no new payload while the
  ones it holds (posted, unread) exceed ``max_pending_bytes`` (backpressure, as a full
  shm arena); one payload larger than that is still taken when nothing else is held.
- Peer death: a third, gloo process group carries only a "goodbye" message; its one
  outstanding receive fails at once when the peer's process dies (the TCP connection
  drops), so waiters get ``PeerLostError`` instead of hanging (on NCCL the data groups
  are then aborted, and payloads of the index whose bytes had not landed become
  ``PeerLostError`` for their keys; one already handed out by ``get`` while its bytes
  were on the way holds what landed). A clean ``close`` of the peer is told apart:
  payloads already received stay readable, later ``get`` of keys that can no longer
  come raise ``PeerLostError`` at once. A peer that hangs without dying is reported by
  the timeouts (``TransferTimeout``). A sender's ``close`` waits (up to
  ``connect_timeout``) until its payloads are posted and its sends done, then says
  goodbye; ``close`` ends any receive still pending (an NCCL abort; on gloo, a wait that
  times out closes the group's connection) after the goodbye, so nothing stays blocked.
- The key contract of every backend: a second ``put`` of a key still unread on the
  receiver raises ``DuplicateKeyError`` and the first payload stays deliverable. The
  sender remembers the last 65,536 keys it put; a ``put`` of one of them (only those:
  nothing to wait for on fresh keys) flags its header REPEAT and waits for the
  receiver's credit of that very payload, whose verdict says whether the key was still
  pending (the receiver then drops the second payload, after receiving its bytes to
  stay in step). A ``get`` of a key this receiver consumed or discarded raises
  ``KeyConsumedError``.
- Hostile or broken doorbells: the doorbell socket refuses messages larger than the
  bound the receiver published (``max_header_bytes``, judged by the length before any
  allocation: the link fails; the sender refuses larger ones itself with
  ``CapacityError``), and the
  first message must be the session id. ``wire.read_bell`` validates each message (its
  size, the envelope's types and flags, its ``seq``, the key, the tensor_blob limits,
  the plan against the descriptors and the link, the inline parts and the region) and
  checks the payload's size against ``max_message_bytes`` before anything is
  allocated; more payloads announced and unposted than the sender's window is a
  forgery. A message the receiver cannot size (so the byte stream would lose step)
  fails the link with its named error, never with an allocation; a payload whose bytes
  arrived but whose tree is malformed becomes a ``BlobDecodeError`` for its key and the
  link keeps serving.
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
import time
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
    TransferTimeout,
    TransportError,
    WouldBlock,
)
from omnilink._util import (
    CONSUMED_KEYS_REMEMBERED,
    SPIN_GROWTH,
    ConsumedKeys,
    Deadline,
    duplicate_key,
    next_spin,
    pid_alive,
)
from omnilink.connectors import bell
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
#: Room in a doorbell message beyond the tensor_blob header and the inline bytes: the
#: key, the plan and msgpack's framing of up to ``blob.MAX_TENSORS`` inline parts.
_HEADER_SLACK = 1 << 20
#: Envelopes whose parsed tensor_blob header is kept for the next payload of the same
#: structure (a stage sends the same tree, shapes and dtypes chunk after chunk).
_META_CACHE = 256
#: Payload shapes (plan, dtypes, shapes) a sender with ``templates`` remembers having sent
#: whole lately (a shape sent whole again gets a template), and shapes it compiled a
#: template for once (not again: a stream whose trees change under the same tensors
#: would compile one per payload).
_TEMPLATE_SHAPES_SEEN = 16
_TEMPLATE_SHAPES_TRIED = 64
#: How long the doorbell stays unread after a ``get`` stopped reading it before the
#: keeper thread reads it (gets that follow each other closely never meet the keeper).
_KEEPER_GRACE_S = 0.001
#: How often a keeper that waits for a ``get`` to give the doorbell back looks again.
_KEEPER_LOOK_S = 0.002
#: NCCL: a payload's doorbell is rung just before its sends are queued (True), so that
#: the receiver's host posts the receives while this host queues the sends, instead of
#: after (False: one host call after the other on the path of every payload).
BELL_BEFORE_SENDS = True
#: ``_pumper`` while the keeper thread reads the doorbell.
_KEEPER = -1
#: NCCL receive buffers of at most this many bytes (a small tensor, a pack of small
#: ones) are rows of a slab, one slab per buffer shape, of about ``SLAB_BYTES``: one
#: allocation, one ``record_stream`` per consumer stream and one free per slab instead
#: of one each per payload (a receive pool; the caching allocator still owns the
#: memory). A row keeps its slab alive: a payload held keeps at most ``SLAB_BYTES`` per
#: such buffer. 0: every buffer allocated on its own.
SLAB_ITEM_MAX = 64 << 10
SLAB_BYTES = 1 << 20
#: Slabs (buffer shapes) a receiver keeps open at once; the oldest is let go past it.
_SLAB_KINDS = 16
#: Events of handed-out payloads a receiver keeps to record again.
_FREE_EVENTS = 64
#: How long a get reading the doorbell waits for more messages before it sends the
#: credits it owes (see ``_pump``).
_CREDIT_QUIET_S = 0.001


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


def _address(data: bytes) -> int:
    """The address of the first byte of ``data`` (kept alive by the caller)."""
    import numpy as np

    return int(np.frombuffer(data, dtype=np.uint8).ctypes.data)


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


class _Slab:
    """Rows of one shape and dtype allocated at once on the receive stream, each the
    receive buffer of one payload (``SLAB_ITEM_MAX``)."""

    __slots__ = ("rows", "size", "at", "streams")

    def __init__(self, rows: Any, size: int) -> None:
        self.rows = rows
        self.size = size  # its rows
        self.at = 0  # the next row to hand out
        #: consumer streams (ids) recorded on its memory (``record_stream``)
        self.streams: set[tuple[int, int, int]] = set()


class _Arrived:
    """A payload of the index: its receives are posted (its bytes may still be on the way)."""

    __slots__ = (
        "seq", "key", "nbytes", "frame_bytes", "payload", "device_tensors", "slabs", "error", "event",
        "host_wait", "landed", "build",
    )

    def __init__(self, seq: int, key: str, nbytes: int, frame_bytes: int) -> None:
        self.seq = seq
        self.key = key
        self.nbytes = nbytes
        self.frame_bytes = frame_bytes
        #: The payload, built as soon as its receives were posted (unless ``build``).
        self.payload: Any = None
        #: The device buffers the payload's tensors are views of (allocated alone).
        self.device_tensors: list[Any] = []
        #: The slabs its other device buffers are rows of.
        self.slabs: list[_Slab] = []
        self.error: BaseException | None = None
        #: NCCL: a CUDA event recorded after its receives (and copies) on the receive
        #: stream; ``get`` orders the caller's stream after it.
        self.event: Any = None
        #: NCCL: host data came through the device (STAGED): ``get`` waits for ``event``
        #: on the host before handing it out.
        self.host_wait = False
        #: Gloo: its bytes have landed (the completer confirmed its receives).
        self.landed = True
        #: ``(announced, buffers, region)`` when the views can only be built once the
        #: bytes landed (host bytes to check or read); built by the ``get`` that takes it.
        self.build: Any = None


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
    bell_bytes: Any = 0,
    spin_us: Any = 200,
    templates: Any = True,
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
        ("bell_bytes", bell_bytes, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigurationError(f"nccl: {name} must be an int >= {low}, got {value!r}")
    if isinstance(spin_us, bool) or not isinstance(spin_us, int) or not 0 <= spin_us <= 100_000:
        raise ConfigurationError(f"nccl: spin_us must be an int in [0, 100000], got {spin_us!r}")
    if not isinstance(templates, bool):
        raise ConfigurationError(f"nccl: templates must be True or False, got {templates!r}")
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
        Most payloads announced and whose receives the peer has not yet posted (default
        64). Also published to the peer, which batches its credits by an eighth of it.
    max_inflight_bytes : int
        Most bytes announced and not yet posted by the peer (default 4 GiB); one payload
        larger than this still goes when nothing else is in flight.
    max_pending_bytes : int
        Most bytes the receiver holds (posted, unread) before it posts no new payload
        (default 8 GiB).
    inline_bytes : int, optional
        Host tensors and arrays up to this size travel inside the doorbell message
        (default 64 KiB): a payload of such data only costs no process-group operation.
    max_inline_bytes : int
        Bound on the inline bytes of one payload, region included (default 1 MiB).
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
    bell_bytes : int
        NCCL: a payload whose device tensors take at most this many bytes together
        (64-byte aligned) and that has nothing else for NCCL sends them inside the
        doorbell message instead: no NCCL operation, but ``put`` copies them to host and
        waits for the caller's stream to reach that copy. 0 (the default) keeps every
        device tensor on NCCL (``put`` never waits for the stream; on 2x H200 a 4 KiB
        payload took 15 % less time one way by NCCL, its doorbell rung before its send,
        than inside the doorbell).
    spin_us : int
        Microseconds a waiting ``get`` watches the doorbell socket before sleeping in
        ``poll`` (default 200; 0 sleeps at once): waking a sleeping thread, and running
        the first code after it on a cold core, costs tens to hundreds of microseconds.
        The spin adapts as the ``shm`` backend's does: when payloads have lately come a
        little after it ended, it grows to twice their typical wait, up to
        ``SPIN_GROWTH`` (10) x ``spin_us``; past the first ``spin_us`` the thread yields
        the CPU at every look. The cost is up to the current spin of CPU per ``get``
        that has to wait.
    templates : bool
        Send a stream of payloads of one shape by a template (default True): once a
        shape (a dict of ``str`` keys holding tensors, scalars, and dicts and lists of
        the same) was sent twice, the second one also defines a template on the
        receiver, and the next ones are checked against it by one compiled function
        and sent without their tensor_blob header (the tree's scalars only); the
        receiver puts the received tensors in that tree. Any other payload is sent whole. Receivers take
        templated payloads whatever this is set to. False sends every payload whole.

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
            ``pack_bytes``, ``bell_bytes`` or ``inline_bytes`` below 0; ``spin_us`` outside
            [0, 100000]; ``templates`` not a bool; ``connect_timeout`` not a number
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
        bell_bytes: int = 0,
        spin_us: int = 200,
        templates: bool = True,
    ) -> None:
        super().__init__(channel=channel, role=role, timeout=timeout)
        _check_values(
            role=role, backend=backend, rank=rank, world_size=world_size, device=device, store=store,
            master_port=master_port, connect_timeout=connect_timeout, send_window=send_window,
            max_inflight_bytes=max_inflight_bytes, max_pending_bytes=max_pending_bytes,
            inline_bytes=inline_bytes, max_inline_bytes=max_inline_bytes, max_message_bytes=max_message_bytes,
            pack_bytes=pack_bytes, header_addr=header_addr, bell_bytes=bell_bytes, spin_us=spin_us,
            templates=templates,
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
        self.bell_bytes = bell_bytes
        self.spin_us = spin_us
        self.templates = templates
        self._spin_ns = spin_us * 1000  # the spin now (adaptive, see _adapt_spin)
        self._spin_min_ns = spin_us * 1000
        self._spin_max_ns = spin_us * 1000 * SPIN_GROWTH
        self._arrival_ns = spin_us * 1000  # typical wait for a doorbell message (EWMA)
        self.header_addr = header_addr
        #: Largest doorbell message accepted (a longer one fails the link unallocated).
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
            from omnilink.cuda import cuda_ops

            cuda_ops()  # the per-message CUDA calls: CudaError naming what to install
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
            inline_bytes = 64 << 10
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
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # index, link state, budget, the pump
        self._keeper_cond = threading.Condition(lock)  # the keeper waits here
        self._ready = threading.Event()
        self._link_error: BaseException | None = None
        self._peer_state: str | None = None  # None, "closed", "lost"
        self._peer_reason = ""
        self._closing = False
        self._inbox: dict[str, collections.deque[_Arrived]] = {}
        self._pending_bytes = 0  # held by the receiver: posted, unread
        self._held = 0  # payloads in the index
        self._recv_total: int | None = None  # payloads the peer said it sent (goodbye)
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
        self._sent_event: Any = None  # NCCL: recorded after the last put's sends (close)
        self._bell_host: Any = None  # NCCL: pinned staging of the region (under _send_lock)
        self._bell_view: Any = None  # its numpy view
        self._bell_ptr = 0
        self._bell_copied: Any = None  # a raw Event, reused (record then synchronize)
        self._bye_lock = threading.Lock()
        self._bye_sent = False
        self._threads: list[threading.Thread] = []
        self._pgs: dict[str, Any] = {}  # direction -> bulk group
        self._recv_stream: Any = None  # NCCL: receive buffers, their receives and copies
        self._recv_ids: tuple[int, int, int] = (0, 0, 0)  # its (stream_id, device_index, device_type)
        self._recv_raw = 0  # its raw handle
        self._region_stream: Any = None  # NCCL: the doorbell regions' copies to the device, nothing else
        self._region_ids: tuple[int, int, int] = (0, 0, 0)
        self._region_raw = 0
        self._ops: Any = None  # NCCL: omnilink.cuda.runtime.CudaOps (raw CUDA calls, no torch helpers)
        self._event_cls: Any = None  # NCCL: omnilink.cuda.runtime.Event
        self._dev_index = -1
        self._streams: dict[tuple[int, int, int], Any] = {}  # torch Stream objects by ids (record_stream)
        self._slabs: dict[tuple[Any, ...], _Slab] = {}  # NCCL receive buffers' slabs by shape; the pumper's
        # NCCL: events of payloads handed out, recorded again for later ones (a stream
        # wait already queued keeps the record it was queued after).
        self._free_events: list[Any] = []
        # Receiver, the doorbell: read by one thread at a time, the *pumper* (a get, an
        # aget's waiter or the keeper); the fields below are the pumper's own.
        self._pumper: int | None = None  # thread ident, or _KEEPER; under _cond
        self._pump_want = 0  # gets waiting for the keeper to give the doorbell back
        self._pump_idle_since = 0.0  # when a get last gave the doorbell back
        self._bell_seq = 0  # the seq the next doorbell message must carry
        self._deferred: collections.deque[wire.Announced] = collections.deque()  # unposted
        self._posted = 0  # payloads whose receives are posted (and credits owed for)
        self._owed = 0
        self._owed_bytes = 0
        self._credit_every = 1
        self._credit_every_bytes = 1
        self._bell_out: Any = None  # under _send_lock
        self._bell_in: Any = None  # the pumper's
        self._pump_waker: _Waker | None = None
        self._bell_poller: Any = None
        self._bell_authed = False
        self._bell_eof = False  # the doorbell's writer closed its end (the pumper's)
        self._meta_cache: dict[Any, Any] = {}
        # Templates (``templates``): the sender's, most recently used first, one per id
        # (under _send_lock; ``_tmpl_out`` is replaced, never changed, so that a put may
        # read it unlocked); shapes sent whole lately and shapes compiled once
        # (``_define``); the receiver's by id (the pumper's).
        self._tmpl_out: list[wire.SendTemplate] = []
        self._tmpl_seen: collections.OrderedDict[Any, None] = collections.OrderedDict()
        self._tmpl_tried: collections.OrderedDict[Any, None] = collections.OrderedDict()
        self._tmpl_in: dict[int, wire.RecvTemplate] = {}
        #: Point-to-point operations this end posted on its data groups (a test seam).
        self._p2p_ops = 0
        self._ctl_pg: Any = None
        self._sid = ""
        self._out = f"{rank}to{1 - rank}"
        self._in = f"{1 - rank}to{rank}"
        self._reap_q: queue.Queue[Any] = queue.Queue()
        self._done_q: queue.Queue[Any] = queue.Queue()
        # ZeroMQ: the credits coming back; each socket is used by one thread at a time.
        self._zctx: Any = None
        self._credit_in: Any = None  # under _send_lock
        self._credit_out: Any = None  # the pumper's
        self._credit_waker: _Waker | None = None
        self._credit_poller: Any = None
        self._peer_header_limit: int | None = None

        self._claim()
        hello = wire.Hello(
            protocol=wire.PROTOCOL, rank=rank, world_size=world_size, role=role, backend=backend,
            device_type=dev.type, host=self._host, pid=os.getpid(), token=self._token,
            send_window=send_window, max_message_bytes=max_message_bytes,
            max_header_bytes=self.max_header_bytes, max_inflight_bytes=max_inflight_bytes,
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
            # One bulk group per direction: its operations match in issue order.
            if self._is_nccl:
                with self._torch.cuda.device(self.device):
                    self._pgs[d] = self._make_nccl(f"{self._sid}pg/{d}/bulk/", d)
            else:
                self._pgs[d] = self._make_gloo(f"{self._sid}pg/{d}/bulk/", same_host)
        torch = self._torch
        if self._is_nccl:
            # Connect each communicator now (a tiny exchange, then a grouped pair: NCCL
            # connects a pair of ranks at its first operation, both ranks together)
            # rather than inside the first put, whose wait could not then be bounded
            # and where the receiver, not yet rung, could not join: a deadlock.
            from omnilink.cuda import Event, cuda_ops

            self._event_cls = Event
            self._ops = cuda_ops()  # CudaError naming what to install without cuda-python
            self._dev_index = int(self.device.index)
            with torch.cuda.device(self.device):
                self._recv_stream = torch.cuda.Stream(self.device)
                rs = self._recv_stream
                self._recv_ids = (rs.stream_id, rs.device_index, rs.device_type)
                self._recv_raw = int(rs.cuda_stream)
                self._region_stream = gs = torch.cuda.Stream(self.device)
                self._region_ids = (gs.stream_id, gs.device_index, gs.device_type)
                self._region_raw = int(gs.cuda_stream)
                self._sent_event = Event(self._dev_index)
                self._sent_event.record(self._recv_raw)  # recorded once before close may query it
                warm = [torch.zeros(1, dtype=torch.uint8, device=self.device) for _ in range(3)]
                stream = int(torch.cuda.current_stream(self.device).cuda_stream)
                for d in dirs:
                    self._post(self._pgs[d], warm[:1], send=d == self._out, stream=stream)
                    if self.coalesce:
                        self._post(self._pgs[d], warm[1:], send=d == self._out, stream=stream)
                torch.cuda.current_stream(self.device).synchronize()
            self._p2p_ops = 0
        peer_window = peer.send_window
        self._credit_every = max(1, peer_window // 8)
        self._credit_every_bytes = max(1, (peer.max_inflight_bytes or self.max_inflight_bytes) // 8)
        self._spawn(self._watch, "watcher")
        if self._in in self._pgs:
            self._spawn(self._keep_loop, "keeper")
            if not self._is_nccl:
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

        def bind(name: str, most: int) -> tuple[Any, str]:
            s = ctx.socket(zmq.PAIR)
            s.setsockopt(zmq.LINGER, 0)
            # Unbounded queues: the send window bounds what is ever queued.
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            # ZeroMQ drops (and disconnects) a larger message before allocating it.
            s.setsockopt(zmq.MAXMSGSIZE, max(most, len(sid)))
            if same_host:
                s.bind(f"ipc://@omnilink-nccl-{self._token}-{self.rank}-{name}")
            else:
                s.bind(f"tcp://{self._bind_address()}:*")
            return s, s.getsockopt_string(zmq.LAST_ENDPOINT)

        mine = {"c": "", "d": ""}
        if sending:
            self._credit_in, mine["c"] = bind("c", wire.CREDIT_SIZE)
            self._credit_waker = _Waker(ctx, f"omnilink-nccl-{self._token}-credit")
            self._credit_poller = zmq.Poller()
            self._credit_poller.register(self._credit_in, zmq.POLLIN)
            self._credit_poller.register(self._credit_waker.rx, zmq.POLLIN)
        listener = None
        if receiving:
            # The doorbell: a plain stream socket (see ``bell``), accepted below.
            listener = bell.BellListener(
                same_host, f"omnilink-nccl-{self._token}-{self.rank}-d",
                "" if same_host else self._bind_address(),
            )
            mine["d"] = listener.endpoint
            self._pump_waker = _Waker(ctx, f"omnilink-nccl-{self._token}-pump")
            self._bell_poller = zmq.Poller()
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

        try:
            if receiving:
                self._credit_out = connect(theirs["c"], "credit")
            if sending:
                # Connected before this end accepts (a dual end does both): the peer's
                # listener queues the connection until it accepts.
                endpoint = theirs["d"]
                if not endpoint.startswith((bell.UNIX_PREFIX + "omnilink-nccl-", "tcp://")):
                    raise ConfigurationError(
                        f"nccl: rank {self.peer_rank} of channel {self.channel!r} published no usable "
                        f"doorbell socket ({endpoint!r})"
                    )
                try:
                    self._bell_out = bell.BellWriter(bell.connect_bell(endpoint, deadline.remaining()))
                    self._bell_out.send(sid, deadline.remaining())
                except (OSError, ValueError) as exc:
                    raise PeerLostError(
                        f"nccl: connecting to the doorbell of rank {self.peer_rank} of channel "
                        f"{self.channel!r} failed ({exc})"
                    ) from exc
            if listener is not None:
                try:
                    conn = listener.accept(deadline.remaining())
                except TransferTimeout as exc:
                    raise PeerLostError(
                        f"nccl: rank {self.peer_rank} of channel {self.channel!r} did not connect to "
                        f"the doorbell within connect_timeout={self.connect_timeout} s"
                    ) from exc
                self._bell_in = bell.BellReader(conn, self.max_header_bytes)
                self._bell_poller.register(self._bell_in.fileno(), zmq.POLLIN)
        finally:
            if listener is not None:
                listener.close()

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

    def _make_nccl(self, prefix: str, direction: str) -> Any:
        """One NCCL communicator for ``direction`` (``NcclComm``: the library's own
        send/recv, no process group): the direction's sender draws the unique id and
        publishes it in the store, both ranks join (the caller has made the link's
        device current). Both ends create their communicators in the same order."""
        from omnilink.cuda import nccl_library

        lib = nccl_library()  # CudaError naming what to install
        key = f"{prefix}uid"
        try:
            if direction == self._out:
                uid = lib.unique_id()
                self._st_main.set(key, uid)
            else:
                uid = bytes(self._st_main.get(key))
        except RuntimeError as exc:
            raise PeerLostError(f"nccl: the store of channel {self.channel!r} failed: {exc}") from exc
        return lib.init_rank(uid, 2, self.rank)

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
        lost = PeerLostError(f"nccl: {reason}")
        with self._cond:
            if self._peer_state != "lost":
                self._peer_state = state
                self._peer_reason = reason
            if state == "lost":
                # Payloads of the index whose bytes have not landed never will: their
                # receives end with the abort below (NCCL) or failed (gloo).
                for q in self._inbox.values():
                    for item in q:
                        if item.error is None and (
                            not item.landed or (item.event is not None and not item.event.query())
                        ):
                            item.error = lost
                            item.device_tensors = []
            self._cond.notify_all()
            self._keeper_cond.notify_all()
        if state == "lost" and self._is_nccl:
            for pg in self._data_groups():
                self._break_group(pg)  # NCCL kernels waiting for a dead peer would never end
        self._wake_all()

    def _data_groups(self) -> list[Any]:
        return list(self._pgs.values())

    def _break_group(self, pg: Any) -> None:
        """End every operation pending on ``pg`` with an error, now.

        NCCL: abort the communicator (its kernels exit). Gloo has no abort that wakes a
        waiting receive, but a wait that times out closes the group's connection to the
        peer, which fails every pending operation on both ends: a receive that nobody
        will ever match is waited for 1 ms.
        """
        if self._is_nccl:
            pg.abort()  # an NcclComm
            return
        torch = self._torch
        try:
            w = pg.recv([torch.empty(1, dtype=torch.uint8)], self.peer_rank, _BREAK_TAG)
            w.wait(datetime.timedelta(milliseconds=1))
        except RuntimeError:
            pass  # the connection is closed now (or was already)

    def _wake_all(self) -> None:
        """Wake threads blocked on a socket (puts waiting for credits, the doorbell's
        reader) or on the condition."""
        for waker in (self._credit_waker, self._pump_waker):
            if waker is not None:
                waker.wake()
        with self._cond:
            self._cond.notify_all()
            self._keeper_cond.notify_all()

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
        used: wire.SendTemplate | None = None
        tree = b""
        for t in self._tmpl_out if self.templates else ():
            got = wire.send_by_template(
                t, payload, device=self.device, nccl=self._is_nccl, inline_bytes=self.inline_bytes,
                max_inline_total=self.max_inline_bytes, key=key, pack_bytes=self.pack_bytes, pad=self._pad,
                bell_bytes=self.bell_bytes,
            )
            if got is not None:
                sp, tree = got
                used = t
                break
        else:
            sp = self._plan(payload, key)
        limit = peer.max_message_bytes
        if limit is not None and sp.nbytes > limit:
            raise CapacityError(
                f"nccl: payload of key {key!r} is {sp.nbytes} bytes, more than the "
                f"max_message_bytes={limit} rank {self.peer_rank} accepts on channel {self.channel!r}"
            )
        with self._send_lock:
            self._check_send_state(key)
            if used is not None and used not in self._tmpl_out:
                # Its id was given to another shape meanwhile (another thread's put):
                # this one goes whole.
                used = None
                sp = self._plan(payload, key)
            # Small device tensors that ride the doorbell: to host now (the caller's
            # stream reaches the copy before put goes on).
            region: Any = self._stage_region(sp) if sp.bell else b""
            repeat = key in self._sent_keys
            seq = self._send_seq
            flags = wire.FLAG_REPEAT if repeat else 0
            defined = self._define(payload, sp) if self.templates and used is None else None
            if used is not None:
                env = wire.Envelope(seq, key, b"", [], sp.inline, flags, region, used.tid, tree)
            elif defined is not None:
                env = wire.Envelope(seq, key, sp.meta, sp.plan, sp.inline, flags | wire.FLAG_DEFINE, region,
                                    defined.tid)
            else:
                env = wire.Envelope(seq, key, sp.meta, sp.plan, sp.inline, flags, region)
            raw = wire.encode_envelope(env)
            hlimit = self._peer_header_limit
            if hlimit is not None and len(raw) > hlimit:
                raise CapacityError(
                    f"nccl: the header of key {key!r} is {len(raw)} bytes, more than the "
                    f"{hlimit} rank {self.peer_rank} accepts on channel {self.channel!r} "
                    "(a huge tree or too much inline data; lower inline_bytes or bell_bytes)"
                )
            wire_bytes = sp.p2p_bytes + len(raw)
            self._wait_window(wire_bytes, deadline, key)
            if repeat:
                self._verdicts[seq] = None
            try:
                if sp.p2p and self._is_nccl and BELL_BEFORE_SENDS:
                    # The bell first, then the sends at once (nothing between them but
                    # the NCCL host calls: the pack was copied before): the receiver
                    # posts its receives while this host queues the sends.
                    self._ring_bell(raw, key, deadline)
                    self._send_announced(sp.p2p, key)
                else:
                    if sp.p2p:
                        if self._is_nccl:
                            self._send_nccl(sp.p2p)
                        else:
                            self._send_gloo(sp.p2p)
                    self._ring_bell(raw, key, deadline)
            except BaseException:
                self._verdicts.pop(seq, None)
                raise
            self._send_seq = seq + 1
            if defined is not None:
                # Rung: the receiver has it before any payload sent by it (in place of
                # the one its id had).
                self._tried(defined.key)
                used = defined
            if used is not None and (not self._tmpl_out or self._tmpl_out[0] is not used):
                self._tmpl_out = [used, *(t for t in self._tmpl_out if t.tid != used.tid)]
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

    def _plan(self, payload: Any, key: str) -> wire.SendPlan:
        """``wire.plan_send`` of ``payload`` with this connector's options."""
        return wire.plan_send(
            payload, device=self.device, nccl=self._is_nccl, inline_bytes=self.inline_bytes,
            max_inline_total=self.max_inline_bytes, key=key, pack_bytes=self.pack_bytes, pad=self._pad,
            bell_bytes=self.bell_bytes,
        )

    def _define(self, payload: Any, sp: wire.SendPlan) -> wire.SendTemplate | None:
        """A template for ``payload``'s shape to define with its envelope (under
        ``_send_lock``; installed once the envelope is rung), or ``None``: the shape was
        not sent whole just before, a template of it was compiled once already, or the
        payload is not of a template's shape. Its id: a free one, else the least recently
        used template's."""
        prepared = sp.prepared
        if prepared is None:
            return None
        shape = (tuple(sp.plan), tuple((d.dtype, tuple(d.shape)) for d in prepared._descs))
        seen = self._tmpl_seen
        if shape not in seen:
            seen[shape] = None
            if len(seen) > _TEMPLATE_SHAPES_SEEN:
                seen.popitem(last=False)
            return None
        if shape in self._tmpl_tried:
            return None
        taken = {t.tid for t in self._tmpl_out}
        free = [i for i in range(wire.MAX_TEMPLATES) if i not in taken]
        tid = free[0] if free else self._tmpl_out[-1].tid
        t = wire.compile_template(payload, sp, tid, nccl=self._is_nccl, device=self.device)
        if t is None:
            self._tried(shape)  # not of a template's shape: not compiled again
        else:
            t.key = shape  # tried once it is defined (``_put``)
        return t

    @property
    def _tmpl_by_id(self) -> dict[int, wire.SendTemplate]:
        """The sender's templates by id."""
        return {t.tid: t for t in self._tmpl_out}

    def _tried(self, shape: Any) -> None:
        tried = self._tmpl_tried
        tried[shape] = None
        if len(tried) > _TEMPLATE_SHAPES_TRIED:
            tried.popitem(last=False)

    def _stage_region(self, sp: wire.SendPlan) -> Any:
        """The region of a payload's BELL tensors, in this end's pinned staging buffer
        (under ``_send_lock``; the envelope copies it before the next put may): copied
        on the caller's current stream, which put waits for (the copy, and what was
        queued before it). Raw CUDA calls (one ``cudaMemcpyAsync`` per tensor, one
        reused event): torch's stream and device helpers cost more than the copy."""
        ops = self._ops
        idx = self._dev_index
        try:
            view = self._bell_view
            if view is None:
                torch = self._torch
                from omnilink.cuda import Event

                with torch.cuda.device(self.device):
                    self._bell_host = torch.empty(self.bell_bytes, dtype=torch.uint8, pin_memory=True)
                view = self._bell_view = self._bell_host.numpy()
                self._bell_ptr = int(self._bell_host.data_ptr())
                self._bell_copied = Event(idx)
            base = self._bell_ptr
            stream = int(self._torch._C._cuda_getCurrentRawStream(idx))
            end = 0
            for at, t, n in sp.bell:
                if at > end:
                    view[end:at] = 0
                ops.memcpy(base + at, t.data_ptr(), n, stream)
                end = at + n
            self._bell_copied.record(stream).synchronize()
        except (RuntimeError, CudaError) as exc:
            raise CudaError(f"nccl: copying the small device tensors of a payload to host failed: {exc}") from exc
        return memoryview(view[: sp.region_bytes])

    def _ring_bell(self, raw: bytes, key: str | None, deadline: Deadline) -> None:
        """Announce one payload whose sends are queued: the doorbell message is its
        envelope. Under ``_send_lock``, so bells come in the order of the sends. The
        reader takes every message as it comes; if it takes none for ``deadline`` (its
        process stuck), part of a message may be written: the link fails."""
        try:
            self._bell_out.send(raw, deadline.remaining())
        except TransferTimeout as exc:
            self._fail_link(PeerLostError(
                f"nccl: the doorbell of channel {self.channel!r} was not read by rank {self.peer_rank} "
                f"for the timeout of key {key!r}"
            ), "doorbell")
            raise self._timeout("put", key, f"rank {self.peer_rank} to read its doorbell", deadline.timeout) from exc
        except PeerLostError as exc:
            raise self._translate(exc, key) from exc

    def _send_nccl(self, bulk: list[Any]) -> None:
        """Post one payload's bulk sends, one NCCL group, on the caller's current stream
        of the link's device: they follow what the caller queued there before, and what
        it queues after follows them (it may reuse its tensors: the stream contract)."""
        stream = int(self._torch._C._cuda_getCurrentRawStream(self._dev_index))
        self._post(self._pgs[self._out], bulk, send=True, stream=stream)
        try:
            self._sent_event.record(stream)  # close waits for the last sends with it
        except CudaError as exc:
            raise self._translate(exc, None) from exc

    def _send_announced(self, bulk: list[Any], key: str) -> None:
        """The sends of a payload whose bell was rung: the receiver posts (or has
        posted) their receives, so a send that fails here leaves a receive that no send
        will match: the link fails (the peer learns it from the goodbye)."""
        try:
            self._send_nccl(bulk)
        except BaseException as exc:
            err = exc if isinstance(exc, TransportError) else PeerLostError(
                f"nccl: the sends of key {key!r} on channel {self.channel!r} failed after its doorbell: {exc!r}"
            )
            self._fail_link(err, "send")
            raise

    def _send_gloo(self, bulk: list[Any]) -> None:
        """Post one payload's bulk sends on gloo; the reaper keeps them alive until sent
        (gloo reads them when the receiver is ready)."""
        works = self._post(self._pgs[self._out], bulk, send=True)
        self._reap_q.put((works, bulk))

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

    def _post(
        self, pg: Any, tensors: list[Any], *, send: bool, stream: int = 0, sizes: list[int] | None = None,
    ) -> list[Any]:
        """Post one send/recv per tensor, as one NCCL group where the backend can.

        NCCL: ``pg`` is the direction's ``NcclComm``; the operations are enqueued on the
        raw ``stream`` and nothing is returned (that stream's later work follows them);
        ``sizes``, when known, are the tensors' byte counts. Gloo: ``pg`` is a process
        group; its works are returned."""
        peer = self.peer_rank
        self._p2p_ops += len(tensors)
        if self._is_nccl:
            op = pg.send if send else pg.recv
            if sizes is None:
                sizes = [t.nbytes for t in tensors]
            try:
                if len(tensors) == 1:
                    op(tensors[0].data_ptr(), sizes[0], peer, stream)
                elif self.coalesce:
                    pg.group_start()
                    try:
                        for t, n in zip(tensors, sizes):
                            op(t.data_ptr(), n, peer, stream)
                    finally:
                        pg.group_end()
                else:
                    for t, n in zip(tensors, sizes):
                        op(t.data_ptr(), n, peer, stream)
            except TransportError as exc:
                raise self._translate(exc, None) from exc
            return []
        op = pg.send if send else pg.recv
        try:
            return [op([t], peer, 0) for t in tensors]
        except RuntimeError as exc:
            raise self._translate(exc, None) from exc

    def _reap_loop(self) -> None:
        """Gloo sends complete when the receiver takes them; keep snapshots alive till then."""
        while True:
            item = self._reap_q.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()  # close waits for the sends queued before it
                continue
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

    # ============================================================ the doorbell
    def _progress(self, deadline: Deadline, wanting: bool) -> bool:
        """Make or await progress for a waiting reader (a get, an aget's waiter); called
        with ``_cond`` held. If nobody reads the doorbell, read it (until something
        happened or ``deadline``); if the keeper reads it, ask for it back and wait to be
        woken; if another get reads it, wait for its news. Returns the new ``wanting``
        (whether this caller counts in ``_pump_want``; it must take itself out)."""
        if self._pumper is None:
            if wanting:
                self._pump_want -= 1
                wanting = False
            self._pumper = threading.get_ident()
            self._cond.release()
            try:
                self._pump(deadline)
            finally:
                self._cond.acquire()
                self._pumper = None
                self._pump_idle_since = time.monotonic()
                self._cond.notify_all()
            return wanting
        if self._pumper == _KEEPER and not wanting:
            self._pump_want += 1
            wanting = True
            cast(_Waker, self._pump_waker).wake()
        remaining = deadline.remaining()
        if remaining != 0.0:
            self._cond.wait(remaining)
        return wanting

    def _pump(self, deadline: Deadline) -> None:
        """Read the doorbell (the pumper only, ``_cond`` not held) until a message was
        handled, a wake-up came or ``deadline`` passed: first a spin of looks that never
        sleep (``spin_us``, adaptive; past its first ``spin_us`` each look yields the
        CPU), then ``poll``. The credits owed go out once the doorbell has stayed quiet
        for ``_CREDIT_QUIET_S`` (nothing more in hand; a sender waiting for room may
        need them), not before each wait: a reader that waits for the next message of
        a busy link sends none."""
        waker = cast(_Waker, self._pump_waker)
        poller = self._bell_poller
        clock = time.perf_counter_ns
        t0 = clock()
        spin_end = t0 + self._spin_ns
        yield_from = t0 + self._spin_min_ns
        looks = 0
        try:
            while True:
                if self._drain():
                    if self._spin_min_ns:
                        self._adapt_spin(clock() - t0)
                    return
                if self._closing or self._peer_state == "lost" or self._link_error is not None:
                    return
                remaining = deadline.remaining()
                if remaining == 0.0:
                    return
                now = clock()
                if now < spin_end:
                    if now >= yield_from:
                        os.sched_yield()
                    # A wake-up is looked for at every 8th look only: the other looks
                    # read the doorbell socket alone (a zmq poll costs more than that
                    # read, and a message is noticed within half a look).
                    looks += 1
                    if not looks & 7 and poller.poll(0) and waker.rx.poll(0):
                        waker.drain()
                        return
                    continue
                if self._owed:
                    quiet = _CREDIT_QUIET_S if remaining is None else min(remaining, _CREDIT_QUIET_S)
                    events = dict(poller.poll(_poll_ms(quiet)))
                    if not events:
                        self._flush_credits()
                        continue
                else:
                    events = dict(poller.poll(_poll_ms(remaining)))
                if waker.rx in events:
                    waker.drain()
                    return
                if not events:
                    return  # the deadline
        except zmq.ZMQError as exc:
            if self._closing:
                return
            self._peer_gone("lost", f"the doorbell socket of channel {self.channel!r} failed ({exc})")
        except (OmnilinkError, RuntimeError) as exc:
            # A doorbell that cannot be read, or a payload whose receives could not be
            # posted, leaves no way to stay in step: the link fails with that error
            # (nothing was allocated for a doorbell that did not validate).
            if not self._closing:
                self._fail_link(exc, "doorbell")

    def _adapt_spin(self, waited_ns: int) -> None:
        """Fold one wait for a doorbell message into the typical wait and set the next
        spin, by ``next_spin``'s rule (within [``spin_us``, ``SPIN_GROWTH`` x
        ``spin_us``])."""
        self._arrival_ns, self._spin_ns = next_spin(self._arrival_ns, waited_ns, self._spin_min_ns,
                                                    self._spin_max_ns)

    def _drain(self) -> bool:
        """Take every doorbell message waiting (never blocks) and post the receives of
        what they announce, in order, as far as the budget allows. The pumper only.
        Whether anything was taken or posted."""
        did = bool(self._deferred) and self._post_deferred()
        reader = self._bell_in
        while True:
            messages = reader.read()
            if reader.eof and not self._bell_eof:
                # The writer's end closed (it closed, or its process died): nothing more
                # comes; the watcher tells which. Never polled again (always readable).
                self._bell_eof = True
                self._bell_poller.unregister(reader.fileno())
            if not messages:
                return did
            for raw in messages:
                self._announce(raw)
            # All that came at once, posted together (one NCCL launch for them).
            self._post_deferred()
            did = True

    def _announce(self, raw: bytes) -> None:
        """Validate one doorbell message (``wire.read_bell``: nothing allocated before)
        and queue its payload for posting."""
        if not self._bell_authed:
            if raw != self._sid.encode():
                raise BlobDecodeError(
                    f"nccl: the first message on the doorbell socket of channel {self.channel!r} is "
                    "not this session's id (another process connected to it)"
                )
            self._bell_authed = True
            return
        window = self._peer.send_window
        if len(self._deferred) >= window:
            # More announced and unposted than the sender's window allows.
            raise BlobDecodeError(
                f"nccl: doorbell message {self._bell_seq} on channel {self.channel!r} goes beyond the "
                f"sender's window of {window} payloads announced and not yet posted"
            )
        ann = wire.read_bell(
            raw, seq=self._bell_seq, max_header_bytes=self.max_header_bytes,
            max_message_bytes=self.max_message_bytes, nccl=self._is_nccl, cache=self._meta_cache,
            cache_size=_META_CACHE, templates=self._tmpl_in,
        )
        # Queued before it is counted, and taken off the queue only once listed: a get
        # that sees the peer gone then finds it somewhere (``_more_may_come``).
        self._deferred.append(ann)
        self._bell_seq += 1

    def _post_deferred(self) -> bool:
        """Post the announced payloads in order while the receiver's budget allows. On
        NCCL, the receives of several payloads read at once are posted as one NCCL group
        (one launch for them all; a payload with STAGED data, whose copy back to host
        must follow its receives on the stream, is posted alone)."""
        deferred = self._deferred
        did = False
        while deferred and not self._closing:
            run: list[wire.Announced] = []
            pending = self._pending_bytes
            for ann in deferred:
                if pending and pending + ann.nbytes > self.max_pending_bytes:
                    break  # backpressure: the application reads first
                alone = not self._is_nccl or wire.STAGED in ann.env.plan
                if run and alone:
                    break
                run.append(ann)
                pending += ann.nbytes
                if alone:
                    break
            if not run:
                return did
            if len(run) > 1:
                comm = self._pgs[self._in]
                staged = []
                comm.group_start()
                try:
                    for ann in run:
                        staged.append(self._stage_post(ann))
                finally:
                    comm.group_end()  # the launch: the events below come after it
                for ann, st in zip(run, staged):
                    self._list_posted(ann, *st)
                    deferred.popleft()
            else:
                self._post_one(run[0])
                deferred.popleft()
            did = True
        return did

    def _post_one(self, ann: wire.Announced) -> None:
        """Post one payload (``_stage_post`` then ``_list_posted``)."""
        self._list_posted(ann, *self._stage_post(ann))

    def _stage_post(self, ann: wire.Announced) -> tuple[Any, list[Any], Any, list[Any], Any, int]:
        """Allocate one payload's receive buffers and post its receives (one NCCL group,
        or inside the caller's), or copy its region to the device; returns what
        ``_list_posted`` needs: ``(item, bufs, region, works, allocs, stream)``."""
        torch = self._torch
        env = ann.env
        header = ann.header
        uint8 = torch.uint8
        item = _Arrived(env.seq, env.key, ann.nbytes, ann.frame)
        bufs: list[Any] = []
        region: Any = None
        works: list[Any] = []
        allocs: Any = None
        raw = 0
        if self._is_nccl:
            if env.region or ann.sizes:
                # Buffers allocated as the tensors they hold where the payload allows
                # (NCCL moves bytes): no view to build afterwards.
                allocs, region_alloc = wire.receive_allocs(header, env.plan)
                if (allocs is not None and ann.sizes and not env.region and SLAB_ITEM_MAX
                        and max(ann.sizes) <= SLAB_ITEM_MAX and wire.STAGED not in env.plan):
                    bufs, item.slabs = self._carve(ann.sizes, allocs)
                    raw = self._recv_raw
                    self._post(self._pgs[self._in], bufs, send=False, stream=raw, sizes=ann.sizes)
                    return item, bufs, region, works, allocs, raw
                dev = self.device
                # The region (then nothing else goes by NCCL) goes on the region stream,
                # where only such small copies run (a copy from pageable memory may wait
                # for its stream); bulk buffers on the receive stream, whose work waits
                # for the receives: the buffers are allocated with it current.
                ids, raw = (self._region_ids, self._region_raw) if env.region else (self._recv_ids, self._recv_raw)
                saved = self._use_stream(ids)
                try:
                    if env.region:
                        # From the doorbell message's own bytes: the copy returns once
                        # CUDA staged them.
                        n = len(env.region)
                        if region_alloc is not None:
                            region = torch.empty(region_alloc[0], dtype=region_alloc[1], device=dev)
                            if region.nbytes != n:  # pragma: no cover - read_bell checked the region
                                region = torch.empty(n, dtype=uint8, device=dev)
                        else:
                            region = torch.empty(n, dtype=uint8, device=dev)
                        self._ops.memcpy(region.data_ptr(), _address(env.region), n, raw)
                    else:
                        if allocs is not None:
                            bufs = [
                                torch.empty(n, dtype=uint8, device=dev) if a is None
                                else torch.empty(a[0], dtype=a[1], device=dev)
                                for n, a in zip(ann.sizes, allocs)
                            ]
                        else:
                            bufs = [torch.empty(n, dtype=uint8, device=dev) for n in ann.sizes]
                        self._post(self._pgs[self._in], bufs, send=False, stream=raw, sizes=ann.sizes)
                        if wire.STAGED in env.plan:
                            # Host data staged through the device: back to (pinned) host
                            # memory on the receive stream, after the receives (never in
                            # a group of several payloads: launched here, so the copies
                            # follow them).
                            host_bufs = []
                            for buf, staged in zip(bufs, wire.staged_transfers(env.plan)):
                                if staged:
                                    h = torch.empty(buf.numel(), dtype=uint8, pin_memory=True)
                                    h.copy_(buf, non_blocking=True)
                                    buf = h
                                host_bufs.append(buf)
                            bufs = host_bufs
                            item.host_wait = True
                finally:
                    self._restore_stream(saved)
                item.device_tensors = [region] if region is not None else [b for b in bufs if b.is_cuda]
        elif ann.sizes:
            bufs = [torch.empty(n, dtype=uint8) for n in ann.sizes]
            works = self._post(self._pgs[self._in], bufs, send=False)
            item.landed = False
        return item, bufs, region, works, allocs, raw

    def _use_stream(self, ids: tuple[int, int, int]) -> tuple[Any, int]:
        """Make the stream ``ids`` current for the link's device (torch's internal call:
        its ``stream`` context manager costs more than a small payload's copy), so that
        what is allocated now is allocated on it; what ``_restore_stream`` needs."""
        C = self._torch._C
        prev = C._cuda_getCurrentStream(self._dev_index)
        # Setting a stream makes its device current too: the caller's comes back.
        cur = C._cuda_getDevice()
        C._cuda_setStream(stream_id=ids[0], device_index=ids[1], device_type=ids[2])
        return prev, cur

    def _restore_stream(self, saved: tuple[Any, int]) -> None:
        """The caller's current stream and device back (``_use_stream``)."""
        C = self._torch._C
        prev, cur = saved
        C._cuda_setStream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])
        if cur != self._dev_index:
            C._cuda_setDevice(cur)

    def _carve(self, sizes: list[int], allocs: list[Any]) -> tuple[list[Any], list[_Slab]]:
        """The receive buffers of one payload as rows of slabs (``SLAB_ITEM_MAX``): each
        the tensor it receives (``allocs``: its shape and dtype) or a uint8 row whose
        width is a multiple of 64 bytes (a pack, at least its size); a new slab is
        allocated on the receive stream when its shape's is used up."""
        slabs = self._slabs
        bufs = []
        used: list[_Slab] = []
        for n, a in zip(sizes, allocs):
            key = (n,) if a is None else (n, a[0], a[1])
            slab = slabs.get(key)
            if slab is None or slab.at == slab.size:
                slab = self._new_slab(key, n, a)
            bufs.append(slab.rows.select(0, slab.at))
            slab.at += 1
            if slab not in used:
                used.append(slab)
        return bufs, used

    def _new_slab(self, key: tuple[Any, ...], n: int, alloc: Any) -> _Slab:
        """A slab for receive buffers of ``n`` bytes (``alloc``: of that shape and
        dtype, else uint8 rows of ``n`` rounded up to 64), allocated on the receive
        stream (its device's current stream for the call), replacing ``key``'s."""
        torch = self._torch
        rows = max(2, SLAB_BYTES // max(n, 1))
        saved = self._use_stream(self._recv_ids)
        try:
            if alloc is None:
                width = (n + 63) // 64 * 64
                t = torch.empty((rows, width), dtype=torch.uint8, device=self.device)
            else:
                t = torch.empty((rows, *alloc[0]), dtype=alloc[1], device=self.device)
        finally:
            self._restore_stream(saved)
        slab = _Slab(t, rows)
        slabs = self._slabs
        slabs.pop(key, None)
        if len(slabs) >= _SLAB_KINDS:
            slabs.pop(next(iter(slabs)))
        slabs[key] = slab
        return slab

    def _list_posted(
        self, ann: wire.Announced, item: _Arrived, bufs: list[Any], region: Any, works: list[Any], allocs: Any,
        raw: int,
    ) -> None:
        """After its receives are launched: the payload's event (on ``raw``, its
        stream), its views, its place in the index, and the credits owed."""
        env = ann.env
        header = ann.header
        seq = env.seq
        if raw:
            free = self._free_events
            item.event = (free.pop() if free else self._event_cls(self._dev_index)).record(raw)
        # A payload with a view recipe (``allocs``) has no STAGED data: ready at once.
        if allocs is not None or not works or wire.early_ready(header, env.plan, nccl=self._is_nccl):
            try:
                views = wire.build_views(header, env.plan, env.inline, bufs, device=self.device, region=region)
                item.payload = wire.payload_of(ann, views)
            except OmnilinkError as exc:
                # Its bytes are (being) received: the stream stays in step, so this bad
                # payload is an error for its key only and the link keeps serving.
                logger.warning("nccl: channel %r: key %r is malformed: %s", self.channel, env.key, exc)
                item.error = exc
                item.device_tensors = []
        else:
            item.build = (ann, bufs, region)
        with self._cond:
            duplicate = bool(self._inbox.get(env.key))
            if not duplicate:
                self._pending_bytes += ann.nbytes
                self._held += 1
                self._inbox.setdefault(env.key, collections.deque()).append(item)
                self._consumed.forget(env.key)
                self._cond.notify_all()
        if works:
            self._done_q.put((item, works))
        self._posted = seq + 1
        self._owed += 1
        self._owed_bytes += ann.nbytes
        if duplicate:
            logger.warning(
                "nccl: channel %r dropped a second payload under key %r (still pending)", self.channel, env.key,
            )
        if (
            duplicate
            or env.flags & wire.FLAG_REPEAT
            or self._owed >= self._credit_every
            or self._owed_bytes >= self._credit_every_bytes
        ):
            self._send_credit(seq, duplicate)

    def _flush_credits(self) -> None:
        """Credit what was posted and not yet credited (the pumper, before it waits)."""
        if self._owed:
            self._send_credit(self._posted - 1, False)

    def _send_credit(self, seq: int, duplicate: bool) -> None:
        self._owed = self._owed_bytes = 0
        try:
            self._credit_out.send(wire.encode_credit(seq, duplicate), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if not self._closing and self._peer_state is None:
                self._peer_gone("lost", f"the credit socket of channel {self.channel!r} failed ({exc})")

    def _keep_loop(self) -> None:
        """The keeper: read the doorbell while no get does (after ``_KEEPER_GRACE_S``),
        so that announced payloads are posted and credited while the application does
        not read (see the module docstring); give it back as soon as a get asks."""
        cond = self._cond
        waker = cast(_Waker, self._pump_waker)
        poller = self._bell_poller
        while True:
            with cond:
                while True:
                    if self._closing or self._peer_state == "lost" or self._link_error is not None:
                        return
                    if self._pumper is None and not self._pump_want:
                        left = self._pump_idle_since + _KEEPER_GRACE_S - time.monotonic()
                        if left <= 0:
                            self._pumper = _KEEPER
                            break
                        self._keeper_cond.wait(left)
                    else:
                        self._keeper_cond.wait(_KEEPER_LOOK_S)
            try:
                while True:
                    self._drain()
                    if self._pump_want or self._closing or self._peer_state == "lost" or self._link_error:
                        break
                    self._flush_credits()
                    events = dict(poller.poll())
                    if waker.rx in events:
                        waker.drain()
            except zmq.ZMQError as exc:
                if not self._closing:
                    self._peer_gone("lost", f"the doorbell socket of channel {self.channel!r} failed ({exc})")
                return
            finally:
                with cond:
                    self._pumper = None
                    cond.notify_all()

    def _done_loop(self) -> None:
        """Gloo only: wait for each payload's receives in order and mark it landed (a
        gloo receive is waited for by one thread, once)."""
        while True:
            entry = self._done_q.get()
            if entry is None:
                return
            item, works = entry
            try:
                for w in works:
                    _gloo_wait(w)
            except RuntimeError as exc:
                if not self._closing:
                    self._peer_gone("lost", f"receiving from rank {self.peer_rank} failed ({exc})")
                return
            with self._cond:
                item.landed = True
                self._cond.notify_all()

    # ================================================================== receiving
    def _get(self, key: str, deadline: Deadline, block: bool) -> Any:
        if self.role == "sender":
            raise ConfigurationError(
                f"nccl connector on channel {self.channel!r} was opened with role='sender' and cannot get"
            )
        if not block and not self._ready.is_set():
            raise WouldBlock(f"nccl: channel {self.channel!r} is not connected yet")
        self._wait_ready(deadline, key)
        item = self._take(key, deadline, block)
        return self._hand_out(item, key)

    def _take(self, key: str, deadline: Deadline, block: bool) -> _Arrived:
        """Take ``key``'s payload from the index, reading the doorbell meanwhile."""
        cond = self._cond
        wanting = False
        looked = False
        with cond:
            try:
                while True:
                    if self._closing:
                        raise ClosedError(f"nccl connector on channel {self.channel!r} is closed")
                    q = self._inbox.get(key)
                    if q:
                        item = q[0]
                        if item.error is None and not item.landed:
                            # Gloo bytes on the way: the completer says when they landed.
                            if not block:
                                raise WouldBlock(f"nccl: key {key!r} is still arriving on channel {self.channel!r}")
                        elif item.error is None and item.host_wait and not item.event.query():
                            if not block:
                                raise WouldBlock(f"nccl: key {key!r} is still arriving on channel {self.channel!r}")
                            cond.release()  # host data staged through the device: wait for it
                            try:
                                item.event.synchronize()
                            except RuntimeError as exc:
                                raise PeerLostError(
                                    f"nccl: receiving key {key!r} on channel {self.channel!r} failed: {exc}"
                                ) from exc
                            finally:
                                cond.acquire()
                            continue
                        else:
                            q.popleft()
                            if not q:
                                del self._inbox[key]
                            self._pending_bytes -= item.nbytes
                            self._held -= 1
                            self._consumed.add(key)
                            # The application reads: the keeper stays away for its grace
                            # (a stream of gets served from the index would otherwise
                            # hand the doorbell to the keeper and back, a thread switch
                            # each way, every 1 ms).
                            self._pump_idle_since = time.monotonic()
                            if self._deferred:
                                cast(_Waker, self._pump_waker).wake()  # room for what waits
                            return item
                    else:
                        if key in self._consumed:
                            raise self._consumed.error(self.backend, self.channel, key)
                        if self._link_error is not None:
                            raise self._link_error
                        if self._peer_state is not None and not self._more_may_come():
                            raise self._peer_error(key)
                        if not block:
                            if looked or self._pumper is not None:
                                raise WouldBlock(f"nccl: key {key!r} has not arrived on channel {self.channel!r}")
                            looked = True
                            self._progress(deadline, False)  # one look at the doorbell
                            continue
                    if self._link_error is not None:
                        raise self._link_error
                    if deadline.remaining() == 0.0:
                        raise self._timeout("get", key, f"rank {self.peer_rank}", deadline.timeout)
                    if q:
                        cond.wait(deadline.remaining())  # gloo landing: the completer notifies
                    else:
                        wanting = self._progress(deadline, wanting)
            finally:
                if wanting:
                    self._pump_want -= 1

    def _hand_out(self, item: _Arrived, key: str) -> Any:
        """The payload of an item taken from the index, the caller's stream ordered after
        its bytes."""
        if item.error is not None:
            raise item.error
        if item.build is not None:
            ann, bufs, region = item.build
            env = ann.env
            views = wire.build_views(ann.header, env.plan, env.inline, bufs, device=self.device, region=region)
            item.payload = wire.payload_of(ann, views)
            item.build = None
        event = item.event
        if event is not None:
            if self._peer_state == "lost" and not event.query():
                raise self._peer_error(key)  # its receives were aborted, not completed
            ids = self._torch._C._cuda_getCurrentStream(self._dev_index)
            try:
                self._ops.wait(self._torch._C._cuda_getCurrentRawStream(self._dev_index), event)
            except CudaError as exc:
                raise PeerLostError(f"nccl: receiving key {key!r} on channel {self.channel!r} failed: {exc}") from exc
            if len(self._free_events) < _FREE_EVENTS:
                self._free_events.append(event)
            if item.device_tensors or item.slabs:
                stream = self._streams.get(ids)
                if stream is None:
                    if len(self._streams) >= 64:
                        self._streams.clear()
                    stream = self._streams[ids] = self._torch.cuda.Stream(
                        stream_id=ids[0], device_index=ids[1], device_type=ids[2]
                    )
                for t in item.device_tensors:
                    # Allocated on the receive stream: keep the allocator from reusing the
                    # memory while the caller's stream may still use it.
                    t.record_stream(stream)
                for slab in item.slabs:
                    # A slab's memory goes back once its last row dies: recorded once
                    # per consumer stream (the allocator waits for that stream's work
                    # queued up to the free).
                    if ids not in slab.streams:
                        slab.rows.record_stream(stream)
                        slab.streams.add(ids)
        self._count(bytes_got=item.frame_bytes)
        return item.payload

    def _arrivals(self, known: set[str], timeout: float) -> set[str]:
        if self.role == "sender":
            raise ConfigurationError(
                f"nccl connector on channel {self.channel!r} was opened with role='sender' and cannot get"
            )
        deadline = Deadline(timeout)
        if not self._ready.wait(timeout):
            return set()
        if self._link_error is not None:
            raise self._link_error
        cond = self._cond
        wanting = False
        with cond:
            try:
                while True:
                    if self._closing:
                        raise ClosedError(f"nccl connector on channel {self.channel!r} is closed")
                    avail = set()
                    staged = None
                    landing = False
                    for k, q in self._inbox.items():
                        item = q[0]
                        if item.error is None and not item.landed:
                            landing = landing or k not in known
                        elif item.error is None and item.host_wait and not item.event.query():
                            if k not in known and (staged is None or item.seq < staged.seq):
                                staged = item
                        else:
                            avail.add(k)
                    if not avail <= known:
                        return avail
                    if self._link_error is not None:
                        raise self._link_error
                    if self._peer_state is not None and not self._more_may_come() and staged is None and not landing:
                        raise self._peer_error(None)
                    if deadline.remaining() == 0.0:
                        return avail
                    if staged is not None:
                        # Bytes on the way to host memory: its event says when (this is
                        # the waiter thread, which may block).
                        cond.release()
                        try:
                            staged.event.synchronize()
                        except RuntimeError:
                            pass  # the link failed: the state says so on the next turn
                        finally:
                            cond.acquire()
                    elif landing:
                        cond.wait(deadline.remaining())  # the completer notifies
                    else:
                        wanting = self._progress(deadline, wanting)
            finally:
                if wanting:
                    self._pump_want -= 1

    def _more_may_come(self) -> bool:
        """After the peer closed: whether payloads it sent are still to be posted."""
        if self._peer_state == "lost":
            return False
        total = self._recv_total
        return total is not None and (self._bell_seq < total or bool(self._deferred))

    def _discard(self, key: str) -> bool:
        with self._cond:
            q = self._inbox.get(key)
            if not q or q[0].error is not None:
                return False
            item = q.popleft()
            if not q:
                del self._inbox[key]
            self._pending_bytes -= item.nbytes
            self._held -= 1
            self._consumed.add(key, "discarded")
            if self._deferred:
                cast(_Waker, self._pump_waker).wake()
            self._cond.notify_all()
        return True

    def _in_use(self) -> tuple[int, int]:
        with self._cond:
            return (self._held, self._pending_bytes)

    # ==================================================================== closing
    def close(self) -> None:
        """Close the link; idempotent.

        A sender first waits (up to ``connect_timeout``) for the payloads it announced to
        be posted by the receiver and for its own sends to complete, then says goodbye
        so the peer can tell a clean close from a crash. Calls blocked in this connector
        raise ``ClosedError``.
        """
        if self._closed:
            return
        if self._ready.is_set() and self._link_error is None and self._out in self._pgs:
            self._linger(Deadline(self.connect_timeout))
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            self._keeper_cond.notify_all()
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
            # Every receive is posted: let the sends finish before the links go down.
            if self._is_nccl:
                sent_event = self._sent_event
                if not sent_event.query():
                    # In a thread of its own, so the wait is bounded (a CUDA event wait is
                    # not); it ends at the latest with the abort that close makes.
                    done = threading.Event()
                    threading.Thread(
                        target=lambda: (sent_event.synchronize(), done.set()), daemon=True,
                        name=f"omnilink-nccl-linger-{self.channel}",
                    ).start()
                    if not done.wait(deadline.remaining()):
                        logger.warning("nccl: closing channel %r with sends not yet complete", self.channel)
            elif self._peer_state is None:
                sent = threading.Event()
                self._reap_q.put(sent)
                remaining = deadline.remaining()
                if not sent.wait(remaining):
                    logger.warning("nccl: closing channel %r with sends not yet complete", self.channel)
        except OmnilinkError as exc:
            logger.debug("nccl: closing channel %r: %r", self.channel, exc)
        except RuntimeError as exc:
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
        # Receives still pending (a payload whose sender died mid-way) would never end:
        # end them (an NCCL abort, a gloo connection closed), which also wakes every
        # thread blocked in one.
        for pg in self._data_groups():
            self._break_group(pg)
        self._reap_q.put(None)
        self._done_q.put(None)
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(2.0)
        # A get still reading the doorbell returns at its next look (woken above).
        with self._cond:
            self._cond.wait_for(lambda: self._pumper is None, 2.0)
            pumping = self._pumper is not None
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            logger.debug("nccl: threads still blocked at close of %r: %s", self.channel, stuck)
        with self._cond:
            self._inbox.clear()
            self._deferred.clear()
            self._pending_bytes = 0
            self._held = 0
            if not pumping:
                self._slabs.clear()  # (rows handed out keep their slab's memory)
        self._close_sockets(stuck, pumping)
        self._release_claim()
        if not stuck:
            self._pgs.clear()
            self._ctl_pg = None

    def _close_sockets(self, stuck: list[str], pumping: bool) -> None:
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
        if pumping or any("-keeper-" in name for name in stuck):
            left.append("doorbell reader")
        else:
            for s in (self._credit_out, self._bell_in, self._pump_waker):
                if s is not None:
                    s.close()
        if left:
            logger.debug("nccl: sockets of %r left to the garbage collector (still in use: %s)", self.channel, left)
            return
        self._zctx.term()
        self._zctx = None
