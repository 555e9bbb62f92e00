"""``NixlConnector``: payloads written by NIXL (UCX) into the receiver's registered pool.

Topology and one ``put``::

    sender (DEALER, its own NIXL agent)            receiver (ROUTER bound, NIXL agent, pool)
    -----------------------------------            -----------------------------------------
    hello(session, agent md)          ---------->  load the sender's md; a session
                                      <----------  welcome(agent md, pool address, kind,
                                                           its doorbell)
    connect to the doorbell, name the session on it
    (once per connection; then per payload:)
    block = alloc in own extents      (extent(need) -> granted(...) only when they are full)
    publish(seq, key, block, meta,    ==========>  a waiting get (else the loop thread):
            written=false)                         check the block against the sender's
    encode the frame into staging                  extents, decode views of the pool
      (registered once; tensors                    (header from ``meta``, parsed once
      copied in, one copy)                         per distinct ``meta``): held aside
    NIXL WRITE staging -> pool block               (a refusal is answered at once)
      (one transfer request per payload)
    written(seq, ok)                  ==========>  index the views
                                      <==========  ack(seq, status, blocks freed since)
    put returns                                    get(key): the views; the block goes
                                                   back when the last view dies

  A payload with device memory to copy or write, or of ``AHEAD_MIN_BYTES`` and more,
  is published *ahead* like this (from its own memory, just after its WRITE is
  posted), so the receiver's checks and decoding overlap the staging and the WRITE;
  a small host payload, or one with a bool tensor, is published once written, with
  ``written=true``, and indexed and acknowledged at once (one message). A payload of
  at most ``wire.INLINE_MAX_BYTES`` of data for a host pool goes *inline*: no WRITE,
  its bytes in that one message, copied into the block by the receiver before it
  decodes (``INLINE_TO_DEVICE``). Either way the ack comes once the payload is
  gettable. A put returns once its payload is published (and its WRITE done), without
  waiting for the ack, unless its key was put before by this connector (it may still
  be pending there: the ack says whether it is a duplicate); the acks come with later
  puts (each takes them once its own payload is published: ``ANSWERS_AFTER_PUBLISH``),
  at most ``_UNACKED_MAX`` unanswered, and a closing sender takes the last ones
  before its goodbye. A receiving process busy in Python, whose threads wait for its
  GIL, acknowledges late: its senders do not wait for that.

  (``---->``: the zmq control channel; ``====>``: the doorbell, ``omnilink.connectors.bell``,
  a plain stream socket with no I/O thread between the ends: a zmq message crosses one
  in each process, tens of microseconds per message on a many-core machine.)

- **Memory registered once.** The receiver's pool (host memory, or its GPU's with
  ``device=``) is registered when the connector opens; the sender's staging buffer
  when it first needs it (and again only when a larger payload makes it grow); a CUDA
  tensor of ``DIRECT_CACHED_MIN_BYTES`` or more is written from its own memory, the
  allocation holding it registered on its first WRITE and kept (``regcache``).
- **No polling sleep on the receiving side.** The receiver learns of a payload from
  its sender's doorbell, where its loop thread sleeps in ``poll()`` (with the control
  socket's fd); a waiting ``get`` reads them itself for ``spin_us`` (one thread at a
  time holds them), then waits for them in ``poll()`` itself (one such get at a time;
  another sleeps on a condition variable), so a payload that comes while a get waits
  is published in the getter's own thread, woken once. The sender waits for
  its WRITE as ``agent.Agent.wait`` says (a short spin, then a backoff), and for an
  answer it needs (room, the ack of a key put before) for ``spin_us``, then in
  ``poll()``.
- **Sender-side allocation.** The receiver hands each sender extents of its pool; a
  sender allocates blocks inside them without asking, and learns which came free from
  the answers it gets anyway (``wire``). A receiver that sees a sender's extents too
  full for another payload of the size just published grants it one more with that
  payload's ack (``_grant_ahead``, while the pool has room); a sender whose extents are
  full all the same asks for another extent, and waits (backpressure, bounded by its
  timeout) while the pool is full.
- **Key contract, consume-once, deadlines**: as the ``zmq`` backend's (the receiver
  refuses a pending key in its ack: ``DuplicateKeyError`` from a put of a key its
  connector put before; a refusal of another key, which another sender holds pending,
  or a payload the receiver could not take, comes with a later answer and is logged,
  as the ``nccl`` backend does; it remembers the last 65,536 consumed keys:
  ``KeyConsumedError``). One receiver per endpoint; any number of senders. A receiver
  that loses a sender first handles what that sender's doorbell still holds.
- **Faults.** Each connection is a session (its zmq routing id). A disconnection
  (zmq heartbeats: ``heartbeat_interval``, 3x for the timeout; a killed process's
  socket closes at once) ends the session on both sides: the sender's waiting ``put``
  raises ``PeerLostError`` at once and its next ``put`` says hello again (a restarted
  receiver on the same endpoint is taken back); the receiver drops the peer's agent
  metadata and takes its extents back once their blocks' views are gone. Payloads
  already published stay deliverable: their bytes are in the receiver's pool. A
  receiver's ``get`` raises ``PeerLostError`` once no sender has been connected for
  ``peer_timeout`` seconds (after one was). A ``put`` that raised is in doubt, as with
  ``zmq``.
- **Trust.** Every control message is typed and bounded (``wire``; a doorbell message's
  length is judged before anything is allocated); a doorbell connection must name a
  live session first, or it is closed (at most 64 wait to do so); a block is checked
  against the sending session's extents and live blocks before anything is read, and
  the frame's head comes in the message, validated by the decoder before a
  view is made. A peer that can WRITE into a registered pool can change the bytes of
  any payload in it (that is what RDMA grants): connect senders you trust, on a
  network you trust.
"""

from __future__ import annotations

import bisect
import collections
import logging
import os
import secrets
import select
import threading
import time
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from omnilink._errors import (
    BlobDecodeError,
    CapacityError,
    ClosedError,
    ConfigurationError,
    OmnilinkError,
    PeerLostError,
    TransferTimeout,
    TransportError,
    WouldBlock,
)
from omnilink._util import SPIN_GROWTH, ConsumedKeys, Deadline, duplicate_key, next_spin, validate_key
from omnilink.blob import decode_parsed, parse_detached, peek_header, prepare, reads_data, torch_dtype_of
from omnilink.connectors import bell as _bell
from omnilink.connectors.base import BaseConnector, ConnectorStats, Role, check_constructor_options
from omnilink.connectors.nixl import wire
from omnilink.connectors.nixl.agent import Agent, nixl_unavailable
from omnilink.connectors.nixl.pool import Blocks, Pool, Releaser, Staging, round_up
from omnilink.connectors.nixl.regcache import RegistrationCache
from omnilink.connectors.zmq import EndpointLock, check_endpoint, remove_stale_socket, resolve_endpoint

__all__ = ["NixlConnector"]

logger = logging.getLogger(__name__)

DEFAULT_POOL_BYTES = 256 << 20
DEFAULT_EXTENT_BYTES = 16 << 20
_MON = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
#: Poll slice of a sender waiting for an answer (it also watches for disconnection).
_SLICE_MS = 100
#: What a spinning thread calls between looks: ``sched_yield`` releases the GIL (for this
#: process's loop thread) and lets a thread ready to run on this core (UCX's progress
#: thread, zmq's I/O threads, the peer process) go first; ``time.sleep(0)`` released
#: the GIL only.
_yield = os.sched_yield
#: A contiguous CUDA tensor of at least this many bytes is written from its own memory
#: instead of being copied into the device staging buffer first. Its allocation is
#: registered with the agent once and kept (``regcache``: later tensors of that
#: allocation write with no registration); where the driver cannot name the
#: allocation, the tensor is registered for the WRITE and deregistered after it, and
#: then only from ``DIRECT_MIN_BYTES``: registering costs 45-92 us and deregistering
#: 4-12 us (2x H100 / H200, ``benchmarks/gpu/nixl_write_floor.py``), a staging copy of
#: 64 MiB about as much and of 256 MiB ~180 us, plus its wait. Below 32 MiB the staging
#: copy wins all the same: it lets the payload be published before it (the receiver's
#: decode overlaps the copy and the WRITE), where a direct WRITE is published once
#: posted (2x H200, alternated in one pair of processes, one-way 1 / 4 / 16 MiB: 309-320
#: / 302-368 / 229-415 us staged against 323-428 / 321-443 / 244-502 us direct; 32 / 64
#: MiB: 260 / 410 us staged against 227 / 328 us direct).
DIRECT_CACHED_MIN_BYTES = 32 << 20
DIRECT_MIN_BYTES = 64 << 20
#: A payload is published ahead of its WRITE's end (``wire.Publish.written`` false:
#: the receiver checks and decodes it while the bytes are staged and written, and a
#: ``written`` message makes it gettable; ``_Sender._write`` says when) when it has
#: device memory to copy or to write (a device pool, or CUDA tensors), or at least
#: this many data bytes. A small host payload, whose WRITE into host memory ends about
#: as soon as it is posted, is published once written (one message, not two: on UCX's
#: cma, 4 KiB one-way was 55-60 us so and 105-114 us ahead on the 2-core CPU machine),
#: as is any payload with a bool tensor (the receiver checks its bytes: the ack says
#: whether they were 0 and 1).
AHEAD_MIN_BYTES = 1 << 20
#: ... and a payload with device memory to copy or write is published ahead from this
#: many data bytes (0: always). Published once written instead, a small one costs the
#: sender one doorbell message less and the receiver its decode after the WRITE
#: (``bench_nixl.py --ab AHEAD_DEVICE_MIN_BYTES=N`` compares the two).
AHEAD_DEVICE_MIN_BYTES = 0
#: A WRITE from a tensor's own memory keeps its transfer request for the next WRITE of
#: the same memory into the same block (``agent.KEPT_REQUESTS``); a WRITE from a staging
#: buffer keeps it only when this is true. On one H200, alternated in one pair of
#: processes, two runs: per message 64 / 256 MiB (direct) 286 / 487 and 453 / 536 us kept
#: against 317 / 532 and 481 / 559 us not; 16 MiB (staged) 350 and 446 us kept against
#: 329 and 420 us not; 4 KiB to 1 MiB no change (``bench_nixl.py --ab KEPT_REQUESTS=64``
#: on the code before the split; ``--ab KEEP_STAGED_REQUESTS=true`` compares this one).
KEEP_STAGED_REQUESTS = False
#: A payload of at most ``wire.INLINE_MAX_BYTES`` of data for a receiver whose pool is
#: host memory goes *inline*: its bytes travel in its publish (no WRITE, one message;
#: the receiver copies them into the block). On the 2-core CPU machine over UCX's tcp,
#: 4 KiB one-way 58 us inline against 75 us written, alternated in one pair of
#: processes. Not to a device pool unless this is true: the receiver's copy from
#: pageable memory to its GPU and the decode that then waits for it cost more than the
#: WRITE they save (2x H200, 64 KiB one-way 285-491 us inline against 198-360 us
#: written and published ahead).
INLINE_TO_DEVICE = False


def _int(value: Any, name: str, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigurationError(f"nixl: {name} must be an int in [{lo}, {hi}], got {value!r}")


def _seconds(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(f"nixl: {name} must be a number of seconds > 0, got {value!r}")


def _check_values(
    *, role: Any, endpoint: Any, pool_bytes: Any, extent_bytes: Any, device: Any, heartbeat_interval: Any,
    peer_timeout: Any, spin_us: Any = 200,
) -> None:
    """The value checks of ``NixlConnector``'s options (its constructor and its
    ``check_options`` both call this), opening nothing.

    Raises
    ------
    ConfigurationError
        The first option out of its range or of the wrong type, named.
    """
    _int(pool_bytes, "pool_bytes", 1 << 20, 1 << 46)
    _int(extent_bytes, "extent_bytes", 1 << 16, 1 << 46)
    _seconds(heartbeat_interval, "heartbeat_interval")
    _seconds(peer_timeout, "peer_timeout")
    _int(spin_us, "spin_us", 0, 100_000)
    if endpoint is not None:
        check_endpoint(endpoint, binding=role in ("receiver", "dual"))
    if device is not None:
        text = str(device)
        if not (text == "cuda" or text.startswith("cuda:")):
            raise ConfigurationError(f"nixl: device must be None (host memory) or a CUDA device, got {device!r}")


def _cuda_context(device: Any) -> None:
    """Make ``device``'s CUDA context exist before an agent starts: NIXL's UCX backend
    binds its progress thread to the context of the first device memory it sees."""
    import torch

    try:
        torch.zeros(1, device=torch.device(device))
    except (RuntimeError, AssertionError) as exc:
        raise ConfigurationError(f"nixl: device {device!r} is not a usable CUDA device: {exc}") from exc


class _Session:
    """What the receiver knows of one sender's connection."""

    __slots__ = ("ident", "session", "pid", "fd", "peer", "extents", "frees", "parked", "lost", "bell_r", "bell_w",
                 "ahead", "backlog", "losing")

    def __init__(self, ident: bytes, session: str, pid: int, fd: int, peer: str) -> None:
        self.ident = ident
        self.session = session
        self.pid = pid
        self.fd = fd
        self.peer = peer
        #: extent offset -> mirror of the sender's blocks in it
        self.extents: dict[int, Blocks] = {}
        #: offsets of blocks freed since the last answer
        self.frees: list[int] = []
        #: bytes of an extent asked for and not granted yet
        self.parked: int | None = None
        self.lost = False
        #: the sender's doorbell (its publishes in, their acks out), once it connected
        self.bell_r: Any = None
        self.bell_w: Any = None
        #: payloads published ahead of their WRITE: seq -> ``_Ahead``
        self.ahead: dict[int, _Ahead] = {}
        #: doorbell messages read and not yet handled (in order)
        self.backlog: collections.deque[bytes] = collections.deque()
        #: ``_lose`` is handling what the doorbell still held
        self.losing = False


class _Ahead:
    """A payload published ahead of its WRITE (``wire.Publish.written`` false): checked,
    its block reserved and tracked; decoded already unless decoding reads the data
    (``payload`` ``None``: decoded once written)."""

    __slots__ = ("key", "total", "payload", "header", "lease")

    def __init__(self, key: str, total: int, payload: Any, header: Any, lease: Any) -> None:
        self.key = key
        self.total = total
        self.payload = payload
        self.header = header
        self.lease = lease


#: Most payloads one sender may have published ahead of their WRITE (it has one: its
#: puts take turns).
_MAX_AHEAD = 8
#: Parsed frame headers the receiver keeps, by their bytes (a stream of payloads of one
#: shape parses its header once); cleared when full.
_HEADERS_KEPT = 256
#: Largest ``meta`` whose parsed header is kept (a payload's is a few hundred bytes).
_HEADER_KEPT_BYTES = 4096


#: Doorbell connections held while they have not named their session (a sender names it
#: at once: more are refused).
_MAX_PENDING_BELLS = 64
#: How long an answer on a sender's doorbell (or a sender's best-effort ``written`` of a
#: failed WRITE) may wait for room in the socket (each end reads what the other sends as
#: it comes: a full socket means the reader is stuck or gone).
_BELL_SEND_S = 1.0
#: Payloads a sender may have published and not yet had answered (``_Sender.put``
#: returns without waiting for the answer unless the key was put before).
_UNACKED_MAX = 64
#: Whether a put takes the receiver's answers that came (blocks freed, extents granted)
#: after it published its payload (false: before, on the receiver's path).
ANSWERS_AFTER_PUBLISH = True
#: Keys a sender remembers having put (any session): a put of one of them waits for the
#: receiver's answer (a duplicate of a pending key raises ``DuplicateKeyError``).
_SENT_KEYS_REMEMBERED = 4096
#: Seconds a closing sender waits for the answers to its last payloads before its
#: goodbye (which ends its session on the receiver).
_CLOSE_ANSWERS_S = 10.0


class _Receiver:
    """The receiving end: pool, ROUTER, loop thread, key index."""

    def __init__(self, *, conn: NixlConnector, ctx: zmq.Context, endpoint: str, lock_path: str | None,
                 pool_bytes: int, extent_bytes: int, device: Any, heartbeat: dict[int, int],
                 peer_timeout: float, spin_us: int = 0) -> None:
        self.channel = conn.channel
        #: the spin of a waiting get now: adaptive (``next_spin``), from ``spin_us`` up to
        #: ``SPIN_GROWTH`` x ``spin_us``
        self.spin_ns = self.spin_min_ns = spin_us * 1000
        self.spin_max_ns = spin_us * 1000 * SPIN_GROWTH
        self.arrival_ns = spin_us * 1000  # typical wait for a payload (moving average)
        self.extent_bytes = extent_bytes
        self.peer_timeout = peer_timeout
        self.lock_file: EndpointLock | None = None
        self.socket_path: str | None = None
        if device is not None:
            _cuda_context(device)
        self.agent = Agent(f"omnilink-rx-{os.getpid()}-{secrets.token_hex(6)}")
        self.pool = Pool(self.agent, pool_bytes, device)
        self.releaser = Releaser(self.pool.device if self.pool.mem == "VRAM" else None)
        self.md = self.agent.metadata()
        if lock_path is not None:
            self.lock_file = EndpointLock(lock_path, channel=self.channel)
            self.socket_path = endpoint[len("ipc://"):]
            remove_stale_socket(self.socket_path)
        self.sock = ctx.socket(zmq.ROUTER)
        for opt, val in {zmq.LINGER: 0, zmq.ROUTER_MANDATORY: 0, zmq.MAXMSGSIZE: wire.MAX_FRAME_BYTES,
                         zmq.SNDHWM: 100_000, zmq.RCVHWM: 100_000, **heartbeat}.items():
            self.sock.setsockopt(opt, val)
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self.sock.close(0)
            raise ConfigurationError(f"nixl: cannot bind the control endpoint {endpoint!r} of channel "
                                     f"{self.channel!r}: {exc}") from exc
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.socket_path is not None:
            os.chmod(self.socket_path, 0o600)
        self.mon = self.sock.get_monitor_socket(_MON)
        # The doorbell senders publish on: a Unix-domain socket beside an ipc endpoint,
        # else TCP on the control endpoint's host (its port goes in the welcome).
        if self.endpoint.startswith("ipc://"):
            self.bell = _bell.BellListener(True, f"omnilink-nixl-{os.getpid()}-{secrets.token_hex(8)}", "",
                                           backlog=64)
        else:
            host = self.endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
            self.bell = _bell.BellListener(False, "", host, backlog=64)
        ep = self.bell.endpoint
        self.bell_name = ep if ep.startswith(_bell.UNIX_PREFIX) else "tcp:" + ep.rpartition(":")[2]
        #: accepted doorbell connections that have not said which session they are
        self.pending_bells: dict[int, Any] = {}
        #: gets spinning now (``take``, under ``cond``): the loop leaves the senders'
        #: messages to them
        self.spinners = 0
        #: a get waits in poll() for the senders' messages (``_watch``; one at a time);
        #: ``watch_fd`` wakes it when the doorbells change (``bells_version``) or the
        #: receiver stops
        self.watching = False
        self.bells_version = 0
        self.watch_fd = -1
        #: doorbells of ended sessions, closed by the loop thread (the one that polls them)
        self.dead_bells: list[Any] = []
        self.cond = threading.Condition()
        self.index: dict[str, tuple[Any, int]] = {}
        #: keys of the payloads published ahead of their WRITE (pending too: a second
        #: put of one is a duplicate)
        self.ahead_keys: set[str] = set()
        #: payloads whose WRITE may still land (``WRITTEN_STUCK``): their blocks stay
        #: taken while this receiver lives
        self.stuck: list[_Ahead] = []
        #: ``meta`` bytes -> (parsed header, data_len, frame bytes): see ``_HEADERS_KEPT``
        self.headers: dict[bytes, tuple[Any, int, int]] = {}
        self.consumed = ConsumedKeys()
        self.sessions: dict[bytes, _Session] = {}
        #: held by whoever reads the control socket and handles what it brings (the
        #: loop thread, or a get waiting for its payload): zmq sockets take one thread
        #: at a time, and sessions, extents and mirrors change only under it
        self.handling = threading.Lock()
        #: the control socket's notification fd (edge-triggered: ZMQ_EVENTS tells what
        #: is there), which the loop polls instead of the socket, so that a get may read
        #: the socket meanwhile
        self.sock_fd = self.sock.getsockopt(zmq.FD)
        self.had_peer = False
        self.no_peer_since: float | None = None
        self.stopping = False
        self.error: BaseException | None = None
        self.fallbacks = 0
        self.watch_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.thread = threading.Thread(target=self._run, name=f"omnilink-nixl-rx-{self.channel}", daemon=True)
        self.thread.start()

    # ---------------------------------------------------------------- loop
    def _run(self) -> None:
        # Two pollers: ``full`` also watches the senders' messages (the doorbells and the
        # control socket); ``quiet``, used while a get spins (it reads them itself: the
        # payload is published in its thread, not raced for), watches the rest.
        full, quiet = zmq.Poller(), zmq.Poller()
        full.register(self.sock_fd, zmq.POLLIN)
        listener = self.bell.sock.fileno()
        for p in (full, quiet):
            p.register(self.mon, zmq.POLLIN)
            p.register(self.releaser.fd, zmq.POLLIN)
            p.register(listener, zmq.POLLIN)
        pollers = (full, quiet)
        more = True  # the socket is looked at first (messages may predate the fd's edge)
        try:
            while not self.stopping:
                # A parked sender waits for blocks whose consumer's stream was still busy:
                # look again soon (nothing else needs a timed look).
                rel = self.releaser
                spinning = self.spinners > 0
                timeout = 0 if more and not spinning else 1 if rel.eager and rel.queue else 1000
                ready = dict((quiet if spinning else full).poll(timeout))
                if self.stopping:
                    break
                with self.handling:
                    if self.mon in ready:
                        self._drain_monitor()
                    if self.releaser.fd in ready or self.releaser.queue:
                        self._drain_frees()
                    if listener in ready:
                        self._accept_bells(pollers)
                    for fd in [fd for fd in self.pending_bells if fd in ready]:
                        self._identify_bell(fd, pollers)
                    if not self.spinners:
                        self._read_bells(ready)
                        more = self._pump(256)
                    while self.dead_bells and not self.watching:  # (a watching get may poll them)
                        reader = self.dead_bells.pop()
                        for p in pollers:
                            try:
                                p.unregister(reader.fileno())
                            except (KeyError, ValueError, OSError):
                                pass
                        reader.close()
        except BaseException as exc:  # the loop must not die silently: gets report it
            if not self.stopping:
                logger.exception("nixl: the receiver loop of channel %r failed", self.channel)
                with self.cond:
                    self.error = exc
                    self.cond.notify_all()

    def _accept_bells(self, pollers: tuple[Any, Any]) -> None:
        """Take the senders' doorbell connections waiting (loop thread)."""
        while True:
            try:
                conn = self.bell.accept_nowait()
            except OSError:
                return
            if conn is None:
                return
            if len(self.pending_bells) >= _MAX_PENDING_BELLS:  # connections that name no session
                conn.close()
                continue
            reader = _bell.BellReader(conn, wire.MAX_FRAME_BYTES)
            self.pending_bells[reader.fileno()] = reader
            for p in pollers:
                p.register(reader.fileno(), zmq.POLLIN)

    def _identify_bell(self, fd: int, pollers: tuple[Any, Any]) -> None:
        """A new doorbell's first message names its sender's session: the doorbell is that
        session's from then on; a connection that names none (or anything else) is closed."""
        reader = self.pending_bells[fd]
        try:
            msgs = reader.read()
        except BlobDecodeError:
            msgs, reader.eof = [], True
        if not msgs and not reader.eof:
            return
        del self.pending_bells[fd]
        full, quiet = pollers
        quiet.unregister(fd)  # a session's doorbell: read by a spinning get, else the loop
        s = self.sessions.get(msgs[0]) if msgs else None
        if s is None or s.lost or s.bell_r is not None:
            full.unregister(fd)
            reader.close()
            return
        s.bell_r, s.bell_w = reader, _bell.BellWriter(reader.sock)
        self._bells_changed()
        self._handle_bells(s, msgs[1:])
        if reader.eof:
            self._lose(s, "its doorbell closed")

    def _read_bells(self, ready: Any = None) -> None:
        """Handle what the senders' doorbells hold (the caller holds ``handling``);
        ``ready``: only those whose fd is in it (the loop's poll; a spinning get reads
        them all)."""
        for s in list(self.sessions.values()):
            reader = s.bell_r
            if reader is None or s.lost or (ready is not None and reader.fileno() not in ready):
                continue
            try:
                msgs = reader.read()
            except BlobDecodeError as exc:
                self._lose(s, f"its doorbell sent a message too large ({exc})", drain=False)
                continue
            self._handle_bells(s, msgs)
            if reader.eof and not s.lost:
                self._lose(s, "its doorbell closed")

    def _handle_bells(self, s: _Session, msgs: list[bytes]) -> None:
        """Handle doorbell messages of session ``s`` in order, through its backlog: a
        session lost on the way (``_lose``) has handled the rest there."""
        backlog = s.backlog
        backlog.extend(msgs)
        while backlog and not s.lost:
            self._on_bell(s, backlog.popleft())

    def _on_bell(self, s: _Session, raw: bytes) -> None:
        """One message on a sender's doorbell: a ``publish`` or a ``written`` (nothing else goes there)."""
        try:
            msg = wire.decode_from_sender(raw)
        except BlobDecodeError as exc:
            logger.warning("nixl: channel %r: %s", self.channel, exc)
            return
        if self.releaser.queue:  # blocks freed since: this message's answer says so
            self._drain_frees()
        if isinstance(msg, wire.Publish):
            try:
                self._publish(s, msg)
            except Exception:  # one bad message must not stop the channel
                logger.exception("nixl: channel %r: a publish failed", self.channel)
        elif isinstance(msg, wire.Written):
            try:
                self._written(s, msg)
            except Exception:  # one bad message must not stop the channel
                logger.exception("nixl: channel %r: a written message failed", self.channel)
        else:
            logger.warning("nixl: channel %r: a %s on a doorbell (only publish and written go there)", self.channel,
                           type(msg).__name__)

    def _pump(self, most: int) -> bool:
        """Handle up to ``most`` control messages waiting on the socket (the caller holds
        ``handling``); whether more wait. Reading ``ZMQ_EVENTS`` re-arms the socket's fd,
        so a message that comes later wakes the loop even when a get read this one."""
        sock = self.sock
        for _ in range(most):
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return False
            if self.releaser.queue:  # blocks freed since: this message's answer says so
                self._drain_frees()
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            try:
                self._on_message(frames)
            except Exception:  # one bad message must not stop the channel
                logger.exception("nixl: channel %r: a control message failed", self.channel)
        return bool(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def _drain_monitor(self) -> None:
        while True:
            try:
                msg = self.mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                ev = parse_monitor_message(msg)
            except Exception:  # noqa: BLE001 - not fatal
                continue
            if ev["event"] == zmq.EVENT_DISCONNECTED:
                fd = int(ev["value"])
                for s in list(self.sessions.values()):
                    if s.fd == fd and not s.lost:
                        self._lose(s, "disconnected")

    def _lose(self, s: _Session, why: str, drain: bool = True) -> None:
        """End sender session ``s``. ``drain``: handle what its doorbell still holds
        first (not for a doorbell whose stream is broken)."""
        if s.losing or s.lost:
            return
        s.losing = True
        # What the sender's doorbell still holds was published before it went (a put
        # returns once its payload is published): handled first, so that none of it is
        # lost.
        reader = s.bell_r
        if reader is not None and drain:
            try:
                msgs = reader.read()
            except BlobDecodeError:
                msgs = []
            self._handle_bells(s, msgs)  # (``s.lost`` is set below)
        s.backlog.clear()
        logger.info("nixl: channel %r lost sender session %s (pid %d): %s", self.channel, s.session, s.pid, why)
        s.lost = True
        self.agent.remove_remote(s.peer)
        self.sessions.pop(s.ident, None)
        if s.bell_r is not None:
            self.dead_bells.append(s.bell_r)
            s.bell_w = None
            self._bells_changed()
            self.releaser.wake()  # the loop closes it
        if s.ahead:
            # Never written, as far as this receiver knows: dropped (their blocks come
            # free with their leases).
            with self.cond:
                for entry in s.ahead.values():
                    self.ahead_keys.discard(entry.key)
            s.ahead.clear()
        for off, mirror in list(s.extents.items()):
            if not mirror.used_bytes:
                self._free_extent(s, off)
        self._update_eager()
        with self.cond:
            if not any(not x.lost for x in self.sessions.values()) and self.no_peer_since is None:
                self.no_peer_since = time.monotonic()
            self.cond.notify_all()

    def _free_extent(self, s: _Session, off: int) -> None:
        s.extents.pop(off, None)
        self.pool.extents.free(off)
        self._grant_parked()

    def _drain_frees(self) -> None:
        touched: set[int] = set()
        for s, off in self.releaser.drain():
            ext = next((e for e in s.extents if e <= off < e + s.extents[e].capacity), None)
            if ext is None:
                continue
            mirror = s.extents[ext]
            if mirror.owns(off - ext):
                mirror.free(off - ext)
            if s.lost:
                if not mirror.used_bytes:
                    self._free_extent(s, ext)
            else:
                s.frees.append(off)
                touched.add(id(s))
        for s in list(self.sessions.values()):
            if id(s) in touched and s.parked is not None:
                # It waits for room: what came free may be enough for it.
                s.parked = None
                self._send(s, wire.Granted(offset=0, length=0, frees=self._take_frees(s)))
        self._update_eager()

    def _update_eager(self) -> None:
        """Frees wake the loop only while a sender waits for room."""
        self.releaser.eager = any(s.parked is not None for s in self.sessions.values())

    def _take_frees(self, s: _Session) -> list[int]:
        frees = s.frees[: wire.MAX_FREES]
        del s.frees[: wire.MAX_FREES]
        return frees

    def _send(self, s: _Session, msg: Any) -> None:
        # Answers to payloads and room go on the doorbell, in order with the acks.
        if s.bell_w is not None and isinstance(msg, (wire.Ack, wire.Granted)) and not s.lost:
            try:
                s.bell_w.send(wire.encode(msg), _BELL_SEND_S)
                return
            except (PeerLostError, TransferTimeout) as exc:  # (the stream is then unusable)
                self._lose(s, f"its doorbell failed ({exc})")
                return
        try:
            self.sock.send_multipart([s.ident, wire.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:  # the peer is gone: its session ends with the disconnection
            logger.debug("nixl: answer to session %s dropped", s.session, exc_info=True)

    def _grant_parked(self) -> None:
        for s in list(self.sessions.values()):
            if s.parked is not None and not s.lost:
                off = self._new_extent(s, s.parked)
                if off is not None:
                    s.parked = None
                    self._send(s, wire.Granted(offset=off, length=s.extents[off].capacity,
                                               frees=self._take_frees(s)))
        self._update_eager()

    def _new_extent(self, s: _Session, need: int) -> int | None:
        need = round_up(need)
        if need > self.pool.nbytes:
            return None
        for size in (max(need, self.extent_bytes), need):
            size = min(size, self.pool.nbytes)
            off = self.pool.extents.alloc(size)
            if off is not None:
                s.extents[off] = Blocks(self.pool.extents.size_of(off))
                return off
        return None

    def _on_message(self, frames: list[Any]) -> None:
        if len(frames) != 2:
            return
        ident = frames[0].bytes
        try:
            msg = wire.decode_from_sender(frames[1].buffer)
        except BlobDecodeError as exc:
            logger.warning("nixl: channel %r: %s", self.channel, exc)
            return
        s = self.sessions.get(ident)
        if isinstance(msg, wire.Hello):
            self._hello(ident, msg, frames[1])
            return
        if s is None or s.lost:
            if isinstance(msg, wire.Publish):
                self.sock.send_multipart([ident, wire.encode(wire.Ack(
                    seq=msg.seq, status=wire.ACK_BAD_BLOCK, text="no session: say hello first", frees=[]))],
                    zmq.NOBLOCK)
            return
        if isinstance(msg, wire.Publish):
            self._publish(s, msg)
        elif isinstance(msg, wire.Written):
            self._written(s, msg)
        elif isinstance(msg, wire.Extent):
            off = self._new_extent(s, msg.need)
            if off is not None:
                self._send(s, wire.Granted(offset=off, length=s.extents[off].capacity, frees=self._take_frees(s)))
            elif s.frees:
                self._send(s, wire.Granted(offset=0, length=0, frees=self._take_frees(s)))
            else:
                s.parked = msg.need
                self.releaser.eager = True  # frees now wake the loop
        elif isinstance(msg, wire.Return):
            mirror = s.extents.get(msg.offset)
            if mirror is not None and not mirror.used_bytes:
                self._free_extent(s, msg.offset)
        elif isinstance(msg, wire.Bye):
            self._lose(s, "closed")

    def _hello(self, ident: bytes, msg: wire.Hello, frame: Any) -> None:
        if msg.version != wire.VERSION or ident != msg.session.encode():
            self.sock.send_multipart([ident, wire.encode(wire.Refused(
                text=f"protocol version {msg.version} / routing id do not match this receiver's"))], zmq.NOBLOCK)
            return
        # Sessions are told apart in the monitor's events by their connection's file
        # descriptor, which the kernel hands to the next connection once it is closed: a
        # "disconnected" still queued for that descriptor (zmq queues it before it closes
        # the descriptor, so before this hello came) belongs to a session before this one
        # and is handled now, before this session takes the descriptor.
        self._drain_monitor()
        old = self.sessions.get(ident)
        if old is not None:
            self._lose(old, "said hello again")
        try:
            peer = self.agent.add_remote(msg.md)
        except TransportError as exc:
            self.sock.send_multipart([ident, wire.encode(wire.Refused(text=str(exc)[: wire.MAX_TEXT]))], zmq.NOBLOCK)
            return
        try:
            fd = int(frame.get(zmq.SRCFD))
        except (zmq.ZMQError, AttributeError, TypeError, ValueError):
            fd = -1
        s = _Session(ident, msg.session, msg.pid, fd, peer)
        self.sessions[ident] = s
        with self.cond:
            self.had_peer = True
            self.no_peer_since = None
        pool = self.pool
        self._send(s, wire.Welcome(version=wire.VERSION, session=msg.session, md=self.md, pool_addr=pool.addr,
                                   pool_bytes=pool.nbytes, mem=pool.mem, dev=pool.dev,
                                   bell=self.bell_name))

    def _publish(self, s: _Session, msg: wire.Publish) -> None:
        def ack(status: int, text: str = "") -> None:
            self._ack(s, msg.seq, status, text)

        try:
            key = validate_key(msg.key)
            header, data_len, total = self._header(msg.meta)
        except (ConfigurationError, BlobDecodeError) as exc:
            ack(wire.ACK_DECODE_ERROR, str(exc))
            return
        ahead = not msg.written
        if ahead and (not msg.length or len(s.ahead) >= _MAX_AHEAD or msg.seq in s.ahead):
            ack(wire.ACK_DECODE_ERROR, "a payload published ahead of its WRITE must have a block, a seq of its "
                f"own and at most {_MAX_AHEAD} others ahead of theirs")
            return
        ext = None
        if msg.length:
            extents = {off: m.capacity for off, m in s.extents.items()}
            ext = wire.check_block(msg.offset, msg.length, extents, self.pool.nbytes)
            if ext is None or not s.extents[ext].reserve(msg.offset - ext, msg.length):
                ack(wire.ACK_BAD_BLOCK, f"block [{msg.offset}, +{msg.length}) is not a free block of this "
                    "sender's extents")
                return
        if data_len > msg.length:
            self._unreserve(s, ext, msg.offset)
            ack(wire.ACK_DECODE_ERROR, f"the frame's data region is {data_len} bytes, its block {msg.length}")
            return
        if msg.data and (ahead or len(msg.data) != data_len):
            self._unreserve(s, ext, msg.offset)
            ack(wire.ACK_DECODE_ERROR, f"inline data of {len(msg.data)} bytes: it must be the frame's whole data "
                f"region ({data_len} bytes), published written")
            return
        with self.cond:
            pending = key in self.index or key in self.ahead_keys
        if pending:
            self._unreserve(s, ext, msg.offset)
            ack(wire.ACK_DUPLICATE_KEY)
            return
        if msg.data:
            try:
                self.pool.write(msg.offset, msg.data)  # into the block, before anything reads it
            except Exception as exc:  # noqa: BLE001 - a CUDA failure: refused, nothing kept
                self._unreserve(s, ext, msg.offset)
                ack(wire.ACK_DECODE_ERROR, f"copying the inline data into the pool failed: {exc}")
                return
        ref = None
        lease = None
        payload = None
        try:
            if ext is None:
                payload = decode_parsed(header, bytearray(0))
            else:
                lease = self.pool.lease(msg.offset, msg.length)
                ref = self.releaser.track(lease, (s, msg.offset), msg.length)
                # Published ahead: views only, nothing of the block read before it is
                # written (a bool tensor's check, numpy on a device: decoded then).
                if not ahead or not reads_data(header, device=self.pool.mem == "VRAM"):
                    payload = self._decode(header, lease)
        except BlobDecodeError as exc:
            if ref is not None:
                self.releaser.release(ref)
            else:
                self._unreserve(s, ext, msg.offset)
            ack(wire.ACK_DECODE_ERROR, str(exc))
            return
        if ahead:
            # Acknowledged once written and indexed (``_written``): a put returns only
            # when its payload is gettable here, so a sender that closes or dies right
            # after it loses nothing (its ``written`` and its goodbye travel apart).
            s.ahead[msg.seq] = _Ahead(key, total, payload, header, lease)
            with self.cond:
                self.ahead_keys.add(key)
        else:
            self._index(key, payload, total)
        del payload, lease
        if ext is not None:
            self._grant_ahead(s, msg.length)
        if not ahead:
            ack(wire.ACK_OK)

    def _written(self, s: _Session, msg: wire.Written) -> None:
        """The WRITE of a payload published ahead ended: index and acknowledge it, or
        drop it (a failed WRITE's sender waits for no answer)."""
        entry = s.ahead.pop(msg.seq, None)
        if entry is None:
            return  # refused when published (its ack said why), or a stray message
        with self.cond:
            self.ahead_keys.discard(entry.key)
        if msg.status == wire.WRITTEN_STUCK:
            self.stuck.append(entry)  # its block stays taken: the WRITE may still land
            return
        if msg.status != wire.WRITTEN_OK:
            return  # dropped: its block comes free with its lease
        payload = entry.payload
        if payload is None:
            try:
                payload = self._decode(entry.header, entry.lease)
            except BlobDecodeError as exc:
                entry.lease = None  # its block comes free
                self._ack(s, msg.seq, wire.ACK_DECODE_ERROR, str(exc))
                return
        entry.lease = entry.payload = None
        self._index(entry.key, payload, entry.total)
        del payload
        self._ack(s, msg.seq, wire.ACK_OK)

    def _ack(self, s: _Session, seq: int, status: int, text: str = "") -> None:
        """Answer payload ``seq`` of session ``s``, with the blocks freed since."""
        self._send(s, wire.Ack(seq=seq, status=status, text=text[: wire.MAX_TEXT], frees=self._take_frees(s)))

    def _index(self, key: str, payload: Any, total: int) -> None:
        with self.cond:
            self.index[key] = (payload, total)
            self.consumed.forget(key)
            self.cond.notify_all()

    def _header(self, meta: bytes) -> tuple[Any, int, int]:
        """``(header, data_len, frame bytes)`` of a frame's ``meta``, validated in full
        (kept by its bytes: the same bytes validate the same way)."""
        hit = self.headers.get(meta)
        if hit is None:
            _hl, data_len, total = peek_header(meta)
            hit = (parse_detached(meta), data_len, total)
            if len(meta) <= _HEADER_KEPT_BYTES:  # what a sender makes this receiver keep is bounded
                if len(self.headers) >= _HEADERS_KEPT:
                    self.headers.clear()
                self.headers[bytes(meta)] = hit
        return hit

    def _grant_ahead(self, s: _Session, length: int) -> None:
        """After a block of ``length`` bytes: if none of the sender's extents has room for
        another such block, grant it a new extent now (before the ack, on the same
        doorbell: the sender has it when its put returns), so that its next payload of
        that size does not wait for a round trip to ask (a stream of payloads larger
        than half an extent asked before every put). Nothing when the pool has no room
        (the sender asks as before), or while a sender waits for room (``releaser.eager``:
        what the pool has left is for the senders that asked)."""
        if s.parked is not None or s.lost or self.releaser.eager:
            return
        need = round_up(length)
        if any(m.largest_free() >= need for m in s.extents.values()):
            return
        off = self._new_extent(s, need)
        if off is not None:
            self._send(s, wire.Granted(offset=off, length=s.extents[off].capacity, frees=self._take_frees(s)))

    def _unreserve(self, s: _Session, ext: int | None, offset: int) -> None:
        if ext is not None:
            s.extents[ext].free(offset - ext)
            s.frees.append(offset)

    def _decode(self, header: Any, lease: Any) -> Any:
        """The payload of a parsed ``header`` over ``lease``: views of the pool."""
        if self.pool.mem == "DRAM":
            return decode_parsed(header, lease)
        import torch

        base = torch.as_tensor(lease, device=self.pool.device)

        def view(d: Any) -> Any:
            dt = torch_dtype_of(d.dtype)
            if dt is None:
                raise BlobDecodeError(f"dtype code {d.dtype} is not available in this torch build")
            if not d.nbytes:
                return torch.empty(d.shape, dtype=dt, device=base.device)
            t = base[d.offset : d.offset + d.nbytes].view(dt).view(d.shape)
            if dt == torch.bool and bool((base[d.offset : d.offset + d.nbytes] > 1).any()):
                raise BlobDecodeError("bool data holds bytes other than 0 and 1")
            return t

        try:
            return decode_parsed(header, None, device_view=view)
        except BlobDecodeError as exc:
            if "numpy" not in str(exc):
                raise
        # numpy arrays: decoded on the host from one copy of the region (a fallback).
        self.fallbacks += 1
        host = bytearray(base.cpu().numpy().tobytes())
        return decode_parsed(header, host)

    # ------------------------------------------------------------- get side
    def take(self, key: str, deadline: Deadline, block: bool, conn: NixlConnector) -> Any:
        spin_end: int | None = None
        began = 0  # when this get began to wait (ns)
        with self.cond:
            while True:
                entry = self.index.pop(key, None)
                if entry is not None:
                    if began and self.spin_min_ns:
                        self._adapt_spin(time.perf_counter_ns() - began)
                    self.consumed.add(key)
                    conn._count(bytes_got=entry[1])
                    return entry[0]
                self._raise_if_dead(key, conn)
                if key in self.consumed:
                    raise self.consumed.error("nixl", self.channel, key)
                if not block:
                    raise WouldBlock(f"nixl: key {key!r} is not on channel {self.channel!r} yet")
                remaining = deadline.remaining()
                if remaining == 0.0:
                    if began and self.spin_min_ns:
                        self._adapt_spin(4 * self.spin_max_ns)  # nothing came: spin less
                    raise conn._timeout("get", key, f"a sender on {self.endpoint}", deadline.timeout)
                first = spin_end is None
                if not began:
                    began = time.perf_counter_ns()
                if (first and self.spin_ns) or not self.watching:
                    # The loop thread leaves the senders' messages to this get meanwhile:
                    # first it spins (``spin_us``: a thread woken on a cold core costs
                    # more than the spin), then, unless another get does, it waits for
                    # them in poll() itself (the watch), so that the payload is
                    # published in this thread, woken by its doorbell: no hand-off from
                    # the loop thread (one wake-up instead of two, and no wait for the
                    # GIL between them).
                    spin_end = time.perf_counter_ns() + self.spin_ns
                    if remaining is not None:
                        spin_end = min(spin_end, time.perf_counter_ns() + int(remaining * 1e9))
                    watch = not self.watching
                    if watch:
                        self.watching = True
                    index = self.index
                    self.spinners += 1
                    self.releaser.wake()
                    self.cond.release()
                    try:
                        if first and self.spin_ns:
                            self._spin(key, index, spin_end)
                        if watch and key not in index:
                            self._watch(key, index, remaining)
                    finally:
                        self.cond.acquire()
                        if watch:
                            self.watching = False
                            self.cond.notify_all()  # another waiting get may watch now
                        self.spinners -= 1
                        if not self.spinners:
                            self.releaser.wake()  # the loop reads them again
                    continue
                self.cond.wait(1.0 if remaining is None else min(remaining, 1.0))

    def _adapt_spin(self, waited_ns: int) -> None:
        """Fold one get's wait into the typical wait and set the next spin (under
        ``cond``), by ``next_spin``'s rule, as the ``shm`` and ``nccl`` backends do."""
        self.arrival_ns, self.spin_ns = next_spin(self.arrival_ns, waited_ns, self.spin_min_ns, self.spin_max_ns)

    def _spin(self, key: str, index: dict[str, Any], spin_end: int) -> None:
        """Until ``key`` is indexed or ``spin_end``: read the doorbells and the control
        socket here (the loop thread leaves them to spinning gets), so that the payload
        is published in this thread (no hand-off from the loop thread, whose wake-up and
        wait for the GIL cost more than the message)."""
        handling = self.handling
        while key not in index and time.perf_counter_ns() < spin_end:
            if not self.stopping and handling.acquire(blocking=False):
                try:
                    more = self._handle_messages()
                finally:
                    handling.release()
                if more:
                    self.releaser.wake()  # the rest is the loop thread's (no fd edge for it)
                if key in index:
                    return
            _yield()  # the GIL to the loop thread, the core to whoever is ready

    def _handle_messages(self) -> bool | None:
        """What the senders' doorbells and the control socket hold, handled in the
        calling get's thread (it holds ``handling``); whether more control messages wait,
        or ``None`` when the socket is closing (the loop thread reports that)."""
        try:
            self._read_bells()
            return self._pump(64)
        except zmq.ZMQError:
            return None

    def _watch(self, key: str, index: dict[str, Any], remaining: float | None) -> None:
        """Until ``key`` is indexed, the receiver stops, or a slice of up to a second
        (``remaining`` at most) ends: wait in poll() for the senders' doorbells and the
        control socket, and handle what they bring here (as ``_spin`` does, without
        spinning). The loop thread tells of a doorbell added or gone through
        ``watch_fd`` (this thread then polls the new set) and leaves the doorbells it
        would close open until the watch ends."""
        handling = self.handling
        end = time.monotonic() + (1.0 if remaining is None else min(remaining, 1.0))
        poller: Any = None
        version = -1
        while key not in index and not self.stopping and self.error is None:
            if version != self.bells_version:
                version = self.bells_version
                poller = select.poll()
                poller.register(self.watch_fd, select.POLLIN)
                poller.register(self.sock_fd, select.POLLIN)
                for sess in list(self.sessions.values()):
                    reader = sess.bell_r
                    if reader is not None and not sess.lost:
                        poller.register(reader.fileno(), select.POLLIN)
            with handling:
                if self.stopping:
                    return
                more = self._handle_messages()
            if more is None:
                return
            if key in index or more:
                continue
            left = end - time.monotonic()
            if left <= 0:
                return
            for fd, _ev in poller.poll(max(1, int(left * 1000))):
                if fd == self.watch_fd:
                    try:
                        os.eventfd_read(fd)
                    except OSError:  # drained already, or closed (the receiver stopping)
                        pass

    def _bells_changed(self) -> None:
        """A session's doorbell came or went: a watching get polls the new set."""
        self.bells_version += 1
        if self.watching:
            try:
                os.eventfd_write(self.watch_fd, 1)
            except OSError:
                pass

    def _raise_if_dead(self, key: str | None, conn: NixlConnector) -> None:
        if conn._closed:
            raise ClosedError(f"nixl connector on channel {self.channel!r} is closed")
        if self.error is not None:
            raise TransportError(f"nixl: the receiver loop of channel {self.channel!r} failed: {self.error}")
        since = self.no_peer_since
        if self.had_peer and since is not None and time.monotonic() - since >= self.peer_timeout:
            what = f"key {key!r}" if key is not None else "payloads"
            raise PeerLostError(
                f"nixl: every sender of channel {self.channel!r} has been gone for {self.peer_timeout} s; "
                f"{what} cannot arrive"
            )

    def arrivals(self, known: set[str], timeout: float, conn: NixlConnector) -> set[str]:
        end = time.monotonic() + timeout
        with self.cond:
            while True:
                avail = set(self.index)
                if avail - known:
                    return avail
                self._raise_if_dead(None, conn)
                left = end - time.monotonic()
                if left <= 0:
                    return avail
                self.cond.wait(min(left, 1.0))

    def discard(self, key: str) -> bool:
        with self.cond:
            entry = self.index.pop(key, None)
            if entry is None:
                return False
            self.consumed.add(key, "discarded")
        del entry
        return True

    def close(self) -> None:
        self.stopping = True
        for fd in (self.releaser.fd, self.watch_fd):
            try:
                os.eventfd_write(fd, 1)
            except OSError:
                pass
        self.thread.join(10)
        with self.cond:
            self.index.clear()
            self.cond.notify_all()
        with self.handling:  # a get reading the socket finishes first (then sees stopping)
            self._close_all()

    def _close_all(self) -> None:
        for reader in [*self.pending_bells.values(), *self.dead_bells,
                       *(s.bell_r for s in self.sessions.values() if s.bell_r is not None)]:
            reader.close()
        self.pending_bells.clear()
        self.dead_bells.clear()
        self.bell.close()
        self.sock.disable_monitor()
        self.mon.close(0)
        self.sock.close(0)
        for s in list(self.sessions.values()):
            self.agent.remove_remote(s.peer)
        self.sessions.clear()
        self.pool.close()
        self.releaser.close()
        os.close(self.watch_fd)
        self.watch_fd = -1
        self.agent.close()
        if self.socket_path is not None:
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        if self.lock_file is not None:
            self.lock_file.release()


class _Sender:
    """The sending end: its agent, staging buffers and one session at a time."""

    def __init__(self, *, conn: NixlConnector, ctx: zmq.Context, endpoint: str, heartbeat: dict[int, int],
                 device: Any, spin_us: int = 0) -> None:
        self.conn = conn
        self.spin_ns = spin_us * 1000
        self.channel = conn.channel
        self.ctx = ctx
        self.endpoint = endpoint
        self.heartbeat = heartbeat
        self.device = device
        self.lock = threading.RLock()
        if device is not None:
            _cuda_context(device)
        # No progress thread: this end progresses its worker as it writes (``agent``).
        self.agent = Agent(f"omnilink-tx-{os.getpid()}-{secrets.token_hex(6)}", progress_thread=False)
        self.host_staging = Staging(self.agent)
        self.dev_staging: dict[int, Staging] = {}
        self.sock: zmq.Socket | None = None
        self.mon: zmq.Socket | None = None
        #: the receiver's doorbell: publishes out, their acks in (``wire``)
        self.bell_w: Any = None
        self.bell_r: Any = None
        self.welcome: wire.Welcome | None = None
        self.peer: str | None = None
        self.extents: dict[int, Blocks] = {}
        self.seq = 0
        self.acks: dict[int, wire.Ack] = {}
        #: payloads of this session published and not yet answered: seq -> key
        self.unacked: dict[int, str] = {}
        #: what taking the answers after a put met (``_look_after``): the next put's
        self.deferred: OmnilinkError | None = None
        #: keys put by this connector lately, in any session (``_SENT_KEYS_REMEMBERED``)
        self.sent_keys = ConsumedKeys(_SENT_KEYS_REMEMBERED)
        self.lost: str | None = None
        self.puts_in_session = 0
        self._cuda_ok: bool | None = None  # torch.cuda.is_available(), once asked
        #: registrations of the CUDA allocations direct WRITEs read (made on first use)
        self.regs: RegistrationCache | None = None
        #: registrations of direct WRITEs that NIXL could not release (kept until close)
        self._kept_regs: list[Any] = []
        self._kept_tensors: list[Any] = []

    # ------------------------------------------------------------ session
    def _open_socket(self) -> str:
        session = secrets.token_hex(16)
        sock = self.ctx.socket(zmq.DEALER)
        for opt, val in {zmq.LINGER: 0, zmq.ROUTING_ID: session.encode(), zmq.IMMEDIATE: 1,
                         zmq.SNDHWM: 100_000, zmq.RCVHWM: 100_000, zmq.MAXMSGSIZE: 1 << 24,
                         zmq.RECONNECT_IVL: 100, zmq.RECONNECT_IVL_MAX: 1000, **self.heartbeat}.items():
            sock.setsockopt(opt, val)
        self.mon = sock.get_monitor_socket(_MON)
        sock.connect(self.endpoint)
        self.sock = sock
        self.lost = None
        return session

    def _drop_session(self, linger: int = 0) -> None:
        if self.peer is not None:
            self.agent.remove_remote(self.peer)
        if self.bell_w is not None:
            self.bell_w.close()
        self.bell_w = self.bell_r = None
        if self.sock is not None:
            self.sock.disable_monitor()
            self.sock.close(linger)
        if self.mon is not None:
            self.mon.close(0)
        self.sock = self.mon = None
        self.welcome = None
        self.peer = None
        self.extents.clear()
        self.acks.clear()
        self.unacked.clear()

    def _check_lost(self) -> str | None:
        """Read the connection's events; why the session ended, or ``None``."""
        mon = self.mon
        while mon is not None:
            if not mon.get(zmq.EVENTS) & zmq.POLLIN:  # nothing: no raised Again per look
                break
            try:
                msg = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                ev = parse_monitor_message(msg)
            except Exception:  # noqa: BLE001
                continue
            if ev["event"] == zmq.EVENT_DISCONNECTED and self.welcome is not None:
                self.lost = "the receiver disconnected"
        return self.lost

    def _open_sock(self, what: str) -> Any:
        """The control socket of the current session (``PeerLostError`` when it was
        dropped meanwhile: the next put connects again)."""
        sock = self.sock
        if sock is None:
            raise PeerLostError(f"nixl: the session with the receiver of channel {self.channel!r} was dropped "
                                f"while {what}; the next put connects to the receiver again")
        return sock

    def _send_bell(self, msg: Any, deadline: Deadline, key: str | None) -> None:
        """Send a ``publish`` or ``written`` of payload ``key``: on the receiver's
        doorbell (the control channel when it has none)."""
        writer = self.bell_w
        if writer is None:
            self._send(msg, deadline, "publishing")
            return
        try:
            writer.send(wire.encode(msg), deadline.remaining())
        except TransferTimeout:
            self._drop_session()  # part of the message may be in the stream: it is unusable
            raise self.conn._timeout("put", key, f"the receiver at {self.endpoint} (its doorbell)",
                                     deadline.timeout) from None
        except PeerLostError as exc:
            if not self.lost:
                self.lost = f"its doorbell failed ({exc})"
            raise self._peer_lost("publishing") from exc

    def _send(self, msg: Any, deadline: Deadline, what: str) -> None:
        raw = wire.encode(msg)
        sock = self._open_sock(what)
        while True:
            try:
                sock.send(raw, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            if self._check_lost():
                raise self._peer_lost(what)
            if deadline.expired():
                raise self.conn._timeout("put", None, f"the receiver at {self.endpoint} ({what})", deadline.timeout)
            sock.poll(int(deadline.slice(_SLICE_MS / 1000) * 1000) or 1, zmq.POLLOUT)

    def _peer_lost(self, what: str) -> PeerLostError:
        why = self.lost or "the receiver disconnected"
        self._drop_session()
        return PeerLostError(f"nixl: {why} on channel {self.channel!r} while {what}; the next put "
                             "connects to the receiver again")

    def _receive(self, deadline: Deadline, until: Any, key: str | None, what: str) -> Any:
        """Handle the receiver's messages (control channel and doorbell) until
        ``until(msg)`` is true for one; return it (looking without sleeping for
        ``spin_us`` first)."""
        sock = self._open_sock(what)
        spin_end = time.perf_counter_ns() + self.spin_ns
        poller: Any = None
        while True:
            msgs = self._look(sock, what)
            reader = self.bell_r
            if msgs:
                found = None
                for msg in msgs:
                    if found is None and until(msg):
                        found = msg
                if found is not None:
                    return found
                continue
            if time.perf_counter_ns() < spin_end:
                # (a loss or the deadline is looked at once the spin ends: a spin is short)
                _yield()  # the GIL to this process's threads, the core to whoever is ready
                continue
            if self._check_lost():
                raise self._peer_lost(what)
            if deadline.expired():
                raise self.conn._timeout("put", key, f"the receiver at {self.endpoint} ({what})", deadline.timeout)
            if poller is None:
                poller = zmq.Poller()
                poller.register(sock, zmq.POLLIN)
                if reader is not None:
                    poller.register(reader.fileno(), zmq.POLLIN)
            poller.poll(int(deadline.slice(_SLICE_MS / 1000) * 1000) or 1)

    def _look(self, sock: Any, what: str) -> list[Any]:
        """One look at the receiver's messages (doorbell and control channel), never
        waiting: each one that came is applied (``_apply``) and returned."""
        raws = []
        reader = self.bell_r
        if reader is not None:
            try:
                raws = reader.read()
            except BlobDecodeError as exc:
                self.lost = f"its doorbell sent a message too large ({exc})"
                raise self._peer_lost(what) from None
            if reader.eof and not raws:
                self.lost = self.lost or "its doorbell closed"
                raise self._peer_lost(what)
        if sock.get(zmq.EVENTS) & zmq.POLLIN:  # a look that finds nothing raises nothing
            try:
                raws.append(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                pass
        msgs = [wire.decode_from_receiver(raw) for raw in raws]
        for msg in msgs:
            self._apply(msg)
        return msgs

    def _look_after(self) -> None:
        """After a put published its payload: take the answers that came meanwhile
        (blocks freed, extents granted), off the receiver's path (taken before the
        publish, they delayed every payload by as much). What this meets (a lost
        receiver, a malformed answer) is the next put's to raise, as it was when the
        answers were taken at its start: the payload just published was put."""
        sock = self.sock
        if sock is None:
            return
        try:
            self._look(sock, "putting")
        except OmnilinkError as exc:
            logger.debug("nixl: channel %r: after a put: %s", self.channel, exc)
            self.deferred = exc

    def _settle(self, deadline: Deadline, key: str) -> None:
        """Before a put: take the answers that came (blocks freed), and wait while
        ``_UNACKED_MAX`` payloads are unanswered."""
        self._look(self._open_sock("putting"), "putting")
        if len(self.unacked) >= _UNACKED_MAX:
            self._receive(deadline, lambda m: len(self.unacked) < _UNACKED_MAX, key,
                          "waiting for the answers to its earlier payloads")

    def _refused(self, key: str, ack: wire.Ack) -> None:
        """The answer to a payload whose put did not wait for it says it was refused."""
        if ack.status == wire.ACK_DUPLICATE_KEY:
            why = "a payload under this key is still pending there (this one was dropped)"
        else:
            why = ack.text or f"status {ack.status}"
        logger.warning("nixl: the receiver of channel %r refused key %r: %s", self.channel, key, why)

    def _apply(self, msg: Any) -> None:
        """What every answer carries: blocks come free, extents granted."""
        if isinstance(msg, (wire.Granted, wire.Ack)):
            for off in msg.frees:
                ext = next((e for e in self.extents if e <= off < e + self.extents[e].capacity), None)
                if ext is not None and self.extents[ext].owns(off - ext):
                    self.extents[ext].free(off - ext)
            if isinstance(msg, wire.Granted) and msg.length:
                self.extents[msg.offset] = Blocks(msg.length)
            self._return_empty()
        if isinstance(msg, wire.Ack):
            key = self.unacked.pop(msg.seq, None)
            if key is None:
                self.acks[msg.seq] = msg  # a put waits for it
            elif msg.status != wire.ACK_OK:
                self._refused(key, msg)

    def _return_empty(self) -> None:
        empty = sorted((off for off, b in self.extents.items() if not b.used_bytes),
                       key=lambda off: self.extents[off].capacity)
        for off in empty[:-1]:  # keep the largest empty extent for the next payloads
            del self.extents[off]
            try:
                self.sock.send(wire.encode(wire.Return(offset=off)), zmq.NOBLOCK)  # type: ignore[union-attr]
            except zmq.ZMQError:
                pass

    def _ensure_session(self, deadline: Deadline) -> wire.Welcome:
        if self.welcome is not None:
            if self._check_lost():
                raise self._peer_lost("putting")
            return self.welcome
        self._drop_session()
        session = self._open_socket()
        self._send(wire.Hello(version=wire.VERSION, session=session, pid=os.getpid(), md=self.agent.metadata()),
                   deadline, "saying hello")
        msg = self._receive(deadline, lambda m: isinstance(m, (wire.Welcome, wire.Refused)), None,
                            "waiting for its welcome")
        if isinstance(msg, wire.Refused):
            self._drop_session()
            raise TransportError(f"nixl: the receiver of channel {self.channel!r} refused this sender: {msg.text}")
        if msg.session != session:
            self._drop_session()
            raise TransportError(f"nixl: the receiver of channel {self.channel!r} answered another session")
        self.peer = self.agent.add_remote(msg.md)
        if msg.bell:
            self._connect_bell(msg.bell, session, deadline)
        self.welcome = msg
        return msg

    def _connect_bell(self, name: str, session: str, deadline: Deadline) -> None:
        """Connect to the receiver's doorbell (``unix:@NAME``, or ``tcp:PORT`` on the
        control endpoint's host) and name this session on it."""
        if name.startswith("tcp:"):
            host = self.endpoint[len("tcp://"):].rpartition(":")[0]
            where = f"tcp://{host}:{name[len('tcp:'):]}"
        else:
            where = name
        try:
            sock = _bell.connect_bell(where, deadline.slice(10.0))
            self.bell_w = _bell.BellWriter(sock)
            self.bell_r = _bell.BellReader(sock, wire.MAX_FRAME_BYTES)
            self.bell_w.send(session.encode(), deadline.slice(10.0))
        except (OSError, ValueError, PeerLostError, TransferTimeout) as exc:
            self._drop_session()
            raise PeerLostError(f"nixl: the doorbell {where} of the receiver of channel {self.channel!r} cannot be "
                                f"reached ({exc}); the next put connects to the receiver again") from exc

    # ---------------------------------------------------------------- put
    def _alloc(self, n: int, deadline: Deadline, key: str) -> int:
        pool_bytes = self.welcome.pool_bytes  # type: ignore[union-attr]
        if round_up(n) > pool_bytes:
            raise CapacityError(f"nixl: a payload of {n} data bytes can never fit the {pool_bytes}-byte pool of "
                                f"the receiver of channel {self.channel!r} (its pool_bytes option)")
        looked = not self.unacked  # (no answer to look for)
        while True:
            for ext, blocks in self.extents.items():
                off = blocks.alloc(n)
                if off is not None:
                    return ext + off
            if not looked:  # the answers that came free blocks first (``_look_after``)
                looked = True
                self._look(self._open_sock("asking for room"), "asking for room")
                continue
            self._send(wire.Extent(need=round_up(n)), deadline, "asking for room in its pool")
            self._receive(deadline, lambda m: isinstance(m, wire.Granted), key, "waiting for room in its pool")

    def _free_local(self, off: int) -> None:
        for ext, blocks in self.extents.items():
            if ext <= off < ext + blocks.capacity and blocks.owns(off - ext):
                blocks.free(off - ext)
                return

    def put(self, key: str, payload: Any, deadline: Deadline) -> int:
        prepared = prepare(payload)
        with self.lock:
            if self.deferred is not None:
                exc, self.deferred = self.deferred, None
                raise exc
            welcome = self._ensure_session(deadline)
            if len(self.unacked) >= _UNACKED_MAX or (self.unacked and not ANSWERS_AFTER_PUBLISH):
                self._settle(deadline, key)
            n = prepared.data_len
            off = 0
            seq = self.seq + 1
            ahead = False  # published ahead of its WRITE
            publish_ahead = None
            # The data region sent in the publish instead of written (no WRITE).
            inline: Any = b""
            if n and n <= wire.INLINE_MAX_BYTES and (welcome.mem == "DRAM" or INLINE_TO_DEVICE):
                inline = self._inline_data(prepared)
            if n:
                off = self._alloc(n, deadline, key)
            if n and not inline:
                if (
                    (n >= AHEAD_MIN_BYTES
                     or (n >= AHEAD_DEVICE_MIN_BYTES and (welcome.mem == "VRAM" or bool(prepared.devices()))))
                    and not prepared.holds_bool
                ):

                    def _publish_ahead() -> None:
                        # The receiver checks and decodes while the bytes are staged and
                        # written; ``written`` makes the payload gettable.
                        nonlocal ahead
                        self.seq = seq
                        self._send_bell(wire.Publish(seq=seq, key=key, offset=off, length=n, meta=prepared.meta,
                                                     written=False), deadline, key)
                        ahead = True

                    publish_ahead = _publish_ahead
                try:
                    why = self._write(prepared, welcome, off, deadline, publish_ahead)
                except BaseException as exc:
                    if ahead:  # its block comes back from the receiver, as any
                        self._written_failed(seq, deadline, isinstance(exc, OmnilinkError))
                    else:
                        self._free_local(off)
                    raise
                if why is not None:
                    if why == "timeout":
                        if ahead:
                            self._written_failed(seq, deadline, True)
                        elif not self.agent._stuck:
                            self._free_local(off)
                        raise self.conn._timeout("put", key, f"the receiver at {self.endpoint} (its WRITE)",
                                                 deadline.timeout)
                    raise self._peer_lost("writing")
            if ahead:
                self._send_bell(wire.Written(seq=seq, status=wire.WRITTEN_OK), deadline, key)
            else:
                self.seq = seq
                self._send_bell(wire.Publish(seq=seq, key=key, offset=off, length=n, meta=prepared.meta,
                                             data=inline), deadline, key)
            # The receiver's answer is waited for only by a key put before (it may still
            # be pending there: a duplicate): the others return now, their answers taken
            # by the next puts (a busy receiving process, whose threads wait for its GIL,
            # answers late; its sender does not wait for that).
            again = key in self.sent_keys
            self.sent_keys.add(key, "put")
            if not again:
                self.unacked[seq] = key
                if ANSWERS_AFTER_PUBLISH:
                    self._look_after()
                return prepared.nbytes
            self._receive(deadline, lambda m: isinstance(m, wire.Ack) and m.seq == seq, key, "waiting for its ack")
            ack = self.acks.pop(seq)
        if ack.status == wire.ACK_OK:
            return prepared.nbytes
        if ack.status == wire.ACK_DUPLICATE_KEY:
            raise duplicate_key("nixl", self.channel, key)
        raise BlobDecodeError(f"nixl: the receiver of channel {self.channel!r} rejected key {key!r}: {ack.text}")

    def _inline_data(self, prepared: Any) -> memoryview:
        """The payload's data region (at most ``wire.INLINE_MAX_BYTES``), for a publish
        that carries it: the frame written by ``PreparedBlob.write_into`` (host tensors
        with a memmove, CUDA tensors copied on their device's current stream, after
        their producers' work, and waited for), viewed past its head."""
        frame = bytearray(prepared.nbytes)
        prepared.write_into(frame)
        return memoryview(frame)[prepared.data_offset :]

    def _written_failed(self, seq: int, deadline: Deadline, released: bool) -> None:
        """Tell the receiver that the WRITE of payload ``seq``, published ahead, failed
        (best effort: a lost session drops it anyway). ``released``: NIXL released the
        request, so the block is not written any more unless a request is stuck."""
        if self.welcome is None or self.lost:
            return
        status = wire.WRITTEN_FAILED if released and not self.agent._stuck else wire.WRITTEN_STUCK
        try:
            self._send_bell(wire.Written(seq=seq, status=status), Deadline.after(_BELL_SEND_S), None)
        except OmnilinkError:
            logger.debug("nixl: channel %r: telling the receiver of a failed WRITE failed", self.channel,
                         exc_info=True)

    def _write(self, prepared: Any, welcome: wire.Welcome, off: int, deadline: Deadline,
               ahead: Any = None) -> str | None:
        """WRITE the payload's data region into the block at ``off`` and wait for it:
        ``None``, or why it did not complete. ``ahead()`` (publishing the payload ahead)
        is called once, when the WRITE did not fail first: before the bytes are staged,
        or, for a WRITE from the tensors' own memory (nothing to stage: the receiver
        gets the publish while the bytes move), as soon as it is posted."""
        n = prepared.data_len
        staging = self._staging_for(prepared, welcome)
        if staging.mem == "DRAM":
            if ahead is not None:
                ahead()
            staging.ensure(prepared.nbytes)
            prepared.write_at(staging.view, 0, staging.addr)
            local = (staging.addr + prepared.data_offset, n, 0)
        else:
            sources = prepared.tensor_sources()
            direct = self._direct(prepared, sources)
            if direct:
                return self._write_direct(prepared, sources, welcome, off, deadline, staging, direct, ahead)
            if ahead is not None:
                ahead()
            staging.ensure(n)
            self._fill_device(prepared, staging, sources)
            local = (staging.addr, n, staging.dev)
        remote = (welcome.pool_addr + off, n, welcome.dev)
        return self._post([local], staging.mem, [remote], welcome, deadline, keep=KEEP_STAGED_REQUESTS)

    def _post(self, local: list[tuple[int, int, int]], local_mem: str, remote: list[tuple[int, int, int]],
              welcome: wire.Welcome, deadline: Deadline, ahead: Any = None, *, keep: bool = False) -> str | None:
        """One WRITE of the ``local`` pieces into the ``remote`` ones, waited for;
        ``ahead()`` once it is posted (see ``_write``); ``keep``: its request is kept for
        a WRITE of the same pieces (``Agent.write``)."""
        try:
            req = self.agent.write(local, local_mem, remote, welcome.mem, self.peer, keep=keep)
            if ahead is not None:
                try:
                    ahead()
                except BaseException:
                    if req is not None:
                        self.agent.wait(req, deadline, self._check_lost)  # never left unwaited
                    raise
            if req is None:
                return None
            return self.agent.wait(req, deadline, self._check_lost)
        except PeerLostError as exc:
            # UCX saw the receiver go before the control channel did: same as its loss.
            if not self.lost:
                self.lost = f"the receiver disconnected ({exc})"
            raise self._peer_lost("writing a payload") from exc

    def _direct(self, prepared: Any, sources: list[tuple[int, int, Any]]) -> list[tuple[int, int, Any]]:
        """``(offset, nbytes, tensor)`` of the payload's tensors (``sources``: its
        ``tensor_sources()``) written from their own memory: contiguous CUDA tensors of
        at least ``DIRECT_CACHED_MIN_BYTES`` (``DIRECT_MIN_BYTES`` without cuda-python's
        driver bindings, where allocations cannot be registered once)."""
        if prepared.data_len < min(DIRECT_CACHED_MIN_BYTES, DIRECT_MIN_BYTES) or not prepared.devices():
            return []  # (no tensor that large: nothing to look up)
        cache = self._reg_cache()
        least = DIRECT_CACHED_MIN_BYTES if cache is not None else DIRECT_MIN_BYTES
        out = []
        for offset, nbytes, src in sources:
            if (
                nbytes >= least and getattr(src, "is_cuda", False) and src.is_contiguous()
                and not src.is_conj() and not src.is_neg()
            ):
                out.append((offset, nbytes, src))
        return out

    def _reg_cache(self) -> RegistrationCache | None:
        """The cache of allocations registered once, or ``None`` without cuda-python."""
        cache = self.regs
        if cache is None:
            ops = self._cuda_ops()
            if ops is None:
                return None
            cache = self.regs = RegistrationCache(self.agent, ops.allocation)
            for st in self.dev_staging.values():  # registered before the cache existed
                if st.nbytes:
                    cache.avoid(st.dev, st.addr, st.nbytes)
        return cache

    def _write_direct(self, prepared: Any, sources: list[tuple[int, int, Any]], welcome: wire.Welcome, off: int,
                      deadline: Deadline, staging: Staging, direct: list[tuple[int, int, Any]],
                      ahead: Any = None) -> str | None:
        """A WRITE whose large CUDA tensors (``direct``) go from their own memory, each
        registered for it, and whose other bytes (the runs of the data region between
        them: smaller tensors, padding) from the device staging buffer, packed there
        one run after the other: one request, a descriptor per piece."""
        runs, where, staged, total = direct_layout(sources, direct, prepared.data_len)
        if total:
            staging.ensure(total)
            self._fill_device(prepared, staging, staged)
        # Each tensor's (address, bytes, device), asked of torch once.
        pieces = [(t.data_ptr(), nb, t.get_device()) for _o, nb, t in direct]
        # The WRITE reads the tensors on UCX's own stream: the work queued on their
        # devices' current streams (their producers) must be done first.
        self._sync_devices({p[2] for p in pieces})
        regs = []  # registered for this WRITE alone
        cache = self.regs
        try:
            for piece in dict.fromkeys(pieces):  # a tensor the payload holds twice: registered once
                if cache is not None and cache.covers(*piece):
                    continue  # its allocation is registered (now or before)
                regs.append(self.agent.register(piece[0], piece[1], "VRAM", piece[2]))
            base = welcome.pool_addr + off
            local = [(staging.addr + w, length, staging.dev) for w, (_o, length) in zip(where, runs)]
            remote = [(base + o, length, welcome.dev) for o, length in runs]
            local += pieces
            remote += [(base + o, nb, welcome.dev) for o, nb, _t in direct]
            why = self._post(local, "VRAM", remote, welcome, deadline, ahead, keep=True)
        except BaseException:
            self._drop_regs(regs, direct, still_read=bool(self.agent._stuck))
            raise
        self._drop_regs(regs, direct, still_read=why is not None and bool(self.agent._stuck))
        return why

    def _drop_regs(self, regs: list[Any], direct: list[tuple[int, int, Any]], *, still_read: bool) -> None:
        """Deregister the memory of a direct WRITE; kept (until ``close``) while a
        WRITE NIXL could not release may still read it."""
        if still_read:
            self._kept_regs.extend(regs)
            if self.regs is not None:  # nor the allocations' registrations, ever again
                self._kept_regs.extend(self.regs.release())
            self._kept_tensors.extend(t for _o, _nb, t in direct)  # their memory too
            return
        for r in regs:
            self.agent.deregister(r)

    def _sync_devices(self, devices: set[int]) -> None:
        """Wait for the work queued so far on each device's current stream."""
        import torch

        from omnilink.cuda import current_raw_stream

        ops = self._cuda_ops()
        for index in devices:
            if ops is None:
                torch.cuda.current_stream(index).synchronize()
                continue
            prev = ops.swap_device(index)  # (stream 0 is the current device's)
            try:
                ops.stream_synchronize(current_raw_stream(index))
            finally:
                ops.restore_device(prev)

    def _staging_for(self, prepared: Any, welcome: wire.Welcome) -> Staging:
        """Host staging, except for a device pool when this process has CUDA: device
        staging on ``device`` (the option), else on the payload's first GPU, else on
        the current one."""
        if welcome.mem != "VRAM":
            return self.host_staging
        import torch

        cuda = self._cuda_ok
        if cuda is None:
            cuda = self._cuda_ok = torch.cuda.is_available()
        if not cuda:
            return self.host_staging
        dev = self.device
        if dev is None:
            devs = prepared.devices()
            dev = devs[0] if devs else torch.device("cuda", torch.cuda.current_device())
        dev = torch.device(dev)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        st = self.dev_staging.get(index)
        if st is None:
            st = self.dev_staging[index] = Staging(self.agent, torch.device("cuda", index))
            st.on_registered = self._staging_registered
        return st

    def _staging_registered(self, dev: int, addr: int, nbytes: int) -> None:
        """A device staging buffer registered (anew): no allocation holding it is
        registered whole by the cache (NIXL's registrations must not overlap)."""
        if self.regs is not None:
            self.regs.avoid(dev, addr, nbytes)

    def _fill_device(self, prepared: Any, staging: Staging, sources: list[Any] | None = None) -> None:
        """Copy every tensor (``sources``: ``(offset in the staging buffer, nbytes,
        tensor)``, default the payload's at their data-region offsets) into the device
        staging buffer (on the current stream of the staging device), then wait for the
        copies: the WRITE reads the buffer next. With cuda-python, one
        ``cudaMemcpyAsync`` per tensor and one ``cudaStreamSynchronize`` (torch's device, slicing and
        copy helpers cost several times more than a small copy); tensors on another GPU,
        or strided, take torch's path."""
        import numpy as np
        import torch

        if sources is None:
            sources = prepared.tensor_sources()
        fast = self._fill_raw(sources, staging, torch, np)
        if fast:
            return
        dst = staging.tensor
        with torch.cuda.device(staging.device):
            for offset, nbytes, src in sources:
                if not nbytes:
                    continue
                if isinstance(src, torch.Tensor):
                    flat = src.contiguous().reshape(-1).view(torch.uint8)
                else:
                    flat = torch.from_numpy(np.ascontiguousarray(src).reshape(-1).view(np.uint8))
                dst[offset : offset + nbytes].copy_(flat)
            torch.cuda.current_stream(staging.device).synchronize()

    def _fill_raw(self, sources: list[Any], staging: Staging, torch: Any, np: Any) -> bool:
        """``_fill_device`` by raw CUDA calls; ``False`` (nothing copied) where a source
        is not a C-contiguous host array or tensor, or a tensor of the staging GPU."""
        index = staging.dev
        ptrs = []
        for offset, nbytes, src in sources:
            if not nbytes:
                continue
            if isinstance(src, torch.Tensor):
                if (
                    not src.is_contiguous() or src.is_conj() or src.is_neg()
                    or (src.is_cuda and src.get_device() != index) or not (src.is_cuda or src.is_cpu)
                ):
                    return False
                ptrs.append((offset, src.data_ptr(), nbytes))
            elif isinstance(src, np.ndarray) and src.flags.c_contiguous:
                ptrs.append((offset, src.ctypes.data, nbytes))
            else:
                return False
        ops = self._cuda_ops()
        if ops is None:
            return False
        from omnilink.cuda import current_raw_stream

        stream = current_raw_stream(index)
        base = staging.addr
        prev = ops.swap_device(index)
        try:
            for offset, ptr, nbytes in ptrs:
                ops.memcpy(base + offset, ptr, nbytes, stream)
            ops.stream_synchronize(stream)
        finally:
            ops.restore_device(prev)
        return True

    def _cuda_ops(self) -> Any:
        """cuda-python's ``CudaOps``, or ``None`` without it (torch's path then)."""
        from omnilink.cuda import cuda_ops_or_none

        return cuda_ops_or_none()

    def close(self) -> None:
        with self.lock:
            if self.sock is not None and self.welcome is not None:
                if self.unacked:
                    # The goodbye ends the session on the receiver: the last payloads'
                    # answers first (they travel on the doorbell, the goodbye does not).
                    try:
                        self._receive(Deadline(_CLOSE_ANSWERS_S), lambda m: not self.unacked, None, "closing")
                    except OmnilinkError as exc:
                        logger.warning("nixl: channel %r closed with %d payloads unanswered by its receiver: %s",
                                       self.channel, len(self.unacked), exc)
            if self.sock is not None and self.welcome is not None:
                try:
                    self.sock.send(wire.encode(wire.Bye()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            self._drop_session(linger=200)
            if self.agent._stuck:
                # A transfer NIXL could not cancel may still read the staging memory (or
                # a directly written tensor): keep it (and the agent) for the life of the
                # process.
                _RETAINED.append((self.agent, self.host_staging, self.dev_staging, self._kept_tensors))
                return
            if self.regs is not None:
                self.regs.clear()
            for r in self._kept_regs:
                self.agent.deregister(r)
            self._kept_regs.clear()
            self._kept_tensors.clear()
            self.host_staging.close()
            for st in self.dev_staging.values():
                st.close()
            self.agent.close()


_RETAINED: list[Any] = []


def direct_layout(
    sources: list[tuple[int, int, Any]], direct: list[tuple[int, int, Any]], n: int,
) -> tuple[list[tuple[int, int]], list[int], list[tuple[int, int, Any]], int]:
    """How a WRITE with tensors written from their own memory lays out the rest.

    ``sources``: every tensor's ``(offset in the data region, nbytes, source)``;
    ``direct``: those written from their own memory (by offset, in order); ``n``: the
    data region's length. Returns ``(runs, where, staged, total)``: the runs of the
    data region the direct tensors leave (``(offset, length)``, in order), each run's
    offset in the staging buffer (packed one after the other), the other tensors as
    ``(offset in the staging buffer, nbytes, source)``, and the staging bytes used."""
    runs: list[tuple[int, int]] = []
    at = 0
    for o, nb, _t in direct:
        if o > at:
            runs.append((at, o - at))
        at = o + nb
    if at < n:
        runs.append((at, n - at))
    starts = [r[0] for r in runs]
    where: list[int] = []
    total = 0
    for _o, length in runs:
        where.append(total)
        total += length
    skip = {id(t) for _o, _nb, t in direct}
    staged = []
    for o, nb, src in sources:
        if id(src) in skip:
            continue
        if not nb:  # nothing to copy (it may sit where no run is)
            staged.append((0, 0, src))
            continue
        k = bisect.bisect_right(starts, o) - 1
        staged.append((where[k] + o - runs[k][0], nb, src))
    return runs, where, staged, total


class NixlConnector(BaseConnector):
    """Payloads written with NIXL (UCX: RDMA, cma, tcp, CUDA IPC) into a pool the
    receiver registered once.

    See the module docstring for the design and the guarantees. Needs NIXL
    (``pip install "pyomnilink[nixl]"``); the transports are UCX's choice, narrowed by
    ``UCX_TLS`` as for any UCX program (``tcp``; ``cma,tcp`` on one host; the RDMA and
    CUDA transports where present).

    Parameters
    ----------
    channel, role, timeout
        As for every backend.
    endpoint : str, optional
        The control channel: ``tcp://HOST:PORT`` (a receiver may bind port ``*`` and
        publish its ``endpoint`` attribute) or ``ipc://PATH``. Without it both ends
        derive an ipc path from the channel name in the private directory the ``zmq``
        backend uses (same host only).
    pool_bytes : int
        Receiver: the registered pool's size; a payload's data must fit it
        (``CapacityError`` otherwise). Default 256 MiB.
    extent_bytes : int
        Receiver: the size of the extents it hands to senders (larger payloads get an
        extent their size).
    device : str, optional
        Receiver: ``None`` (host memory) or ``"cuda:k"``: the pool is on that GPU and
        received tensors are views of it there. Sender: the GPU of its device staging
        buffer for such a pool (default: the payload's first GPU).
    heartbeat_interval : float
        zmq heartbeats on the control channel; a peer silent for three intervals is
        disconnected (a killed process's socket closes at once).
    peer_timeout : float
        Receiver: ``get`` raises ``PeerLostError`` once no sender has been connected for
        this long.
    spin_us : int
        Microseconds a waiting ``get`` watches for its payload, and a ``put`` for its
        acknowledgement, before sleeping (default 200; 0 sleeps at once): a thread woken
        on a cold core costs tens to hundreds of microseconds. The get's spin adapts as
        the ``shm`` backend's does: when payloads have lately come a little after it
        ended, it grows to twice their typical wait, up to ``SPIN_GROWTH`` (10) x
        ``spin_us``; when they come later than that, it falls back to ``spin_us``. The
        cost is up to the current spin of CPU per wait (the spinning thread yields the
        CPU at every look).

    Raises
    ------
    ConfigurationError
        Bad options, NIXL missing (the message says what to install), an endpoint in
        use.
    TransportError
        NIXL or UCX would not start.
    """

    backend = "nixl"

    @classmethod
    def check_options(cls, options: dict[str, Any], /) -> None:
        """Refuse, opening nothing, the option values the constructor would refuse.

        Raises
        ------
        ConfigurationError
            ``role`` or ``timeout`` invalid; ``pool_bytes`` outside [1 MiB, 2**46],
            ``extent_bytes`` outside [64 KiB, 2**46]; ``heartbeat_interval`` or
            ``peer_timeout`` not a number > 0; an endpoint that is not ``ipc://PATH``
            or ``tcp://HOST:PORT`` (``*`` for a receiver only); ``device`` not
            ``None`` or a CUDA device.
        """
        check_constructor_options(cls, _check_values, options)

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why this process cannot use the backend (NIXL missing), or ``None``."""
        return nixl_unavailable()

    def __init__(
        self,
        *,
        channel: str,
        role: Role = "dual",
        timeout: float | None = None,
        endpoint: str | None = None,
        pool_bytes: int = DEFAULT_POOL_BYTES,
        extent_bytes: int = DEFAULT_EXTENT_BYTES,
        device: Any = None,
        heartbeat_interval: float = 1.0,
        peer_timeout: float = 5.0,
        spin_us: int = 200,
    ) -> None:
        super().__init__(channel=channel, role=role, timeout=timeout)
        _check_values(role=role, endpoint=endpoint, pool_bytes=pool_bytes, extent_bytes=extent_bytes,
                      device=device, heartbeat_interval=heartbeat_interval, peer_timeout=peer_timeout,
                      spin_us=spin_us)
        reason = nixl_unavailable()
        if reason is not None:
            raise ConfigurationError(reason)
        receives = role in ("receiver", "dual")
        sends = role in ("sender", "dual")
        prefix = os.environ.get("OMNILINK_SHM_PREFIX", "omnilink")
        resolved, lock_path = resolve_endpoint(endpoint, channel=f"nixl/{self.channel}", binding=receives,
                                               ipc_dir=None, prefix=prefix)
        ms = int(float(heartbeat_interval) * 1000)
        heartbeat = {zmq.HEARTBEAT_IVL: ms, zmq.HEARTBEAT_TIMEOUT: 3 * ms, zmq.HEARTBEAT_TTL: 3 * ms}
        self._ctx = zmq.Context(io_threads=1)
        self._rx: _Receiver | None = None
        self._tx: _Sender | None = None
        try:
            if receives:
                self._rx = _Receiver(conn=self, ctx=self._ctx, endpoint=resolved, lock_path=lock_path,
                                     pool_bytes=pool_bytes, extent_bytes=extent_bytes, device=device,
                                     heartbeat=heartbeat, peer_timeout=float(peer_timeout), spin_us=spin_us)
                resolved = self._rx.endpoint
            self.endpoint: str = resolved
            if sends:
                self._tx = _Sender(conn=self, ctx=self._ctx, endpoint=resolved, heartbeat=heartbeat,
                                   device=device if not receives else None, spin_us=spin_us)
        except BaseException:
            self._closed = True
            self._teardown()
            raise

    # ----------------------------------------------------------------- hooks
    def _put(self, key: str, payload: Any, deadline: Deadline) -> int:
        if self._tx is None:
            raise ConfigurationError(f"nixl connector on channel {self.channel!r} has role {self.role!r}: it cannot put")
        try:
            return self._tx.put(key, payload, deadline)
        except zmq.ZMQError as exc:
            raise TransportError(f"nixl: control channel of {self.channel!r}: {exc}") from exc

    def _get(self, key: str, deadline: Deadline, block: bool) -> Any:
        if self._rx is None:
            raise ConfigurationError(f"nixl connector on channel {self.channel!r} has role {self.role!r}: it cannot get")
        return self._rx.take(key, deadline, block, self)

    def _arrivals(self, known: set[str], timeout: float) -> set[str]:
        if self._rx is None:
            raise ConfigurationError(f"nixl connector on channel {self.channel!r} has role {self.role!r}: it cannot get")
        return self._rx.arrivals(known, timeout, self)

    def _discard(self, key: str) -> bool:
        if self._rx is None:
            raise ConfigurationError(
                f"nixl connector on channel {self.channel!r} has role {self.role!r}: it cannot discard"
            )
        return self._rx.discard(key)

    def _in_use(self) -> tuple[int, int]:
        rx = self._rx
        if rx is None:
            return (0, 0)
        return (len(rx.releaser.live), rx.releaser.live_bytes)

    def stats(self) -> ConnectorStats:
        """Counters since this connector was opened; ``fallbacks`` counts received payloads
        holding numpy arrays on a device pool (decoded on the host from a copy).

        Raises
        ------
        ClosedError
            The connector was closed.
        """
        import msgspec

        st = super().stats()
        rx = self._rx
        if rx is None:
            return st
        return msgspec.structs.replace(st, fallbacks=st.fallbacks + rx.fallbacks, bytes_held=rx.releaser.live_bytes,
                                       bytes_mapped=rx.pool.nbytes)

    def _wake(self) -> None:
        rx = self._rx
        if rx is not None:
            with rx.cond:
                rx.cond.notify_all()

    def _close(self) -> None:
        self._teardown()

    def _teardown(self) -> None:
        tx, rx = self._tx, self._rx
        self._tx = self._rx = None
        errors: list[BaseException] = []
        for part in (tx, rx):
            if part is None:
                continue
            try:
                part.close()
            except Exception as exc:  # close every part, then report
                errors.append(exc)
        self._ctx.destroy(linger=0)
        if errors and not isinstance(errors[0], OmnilinkError):
            raise TransportError(f"nixl: closing channel {self.channel!r} failed: {errors[0]}") from errors[0]
        if errors:
            raise errors[0]
