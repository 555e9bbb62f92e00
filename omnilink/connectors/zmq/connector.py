"""The ``zmq`` backend: payloads over ZeroMQ ``ipc://`` and ``tcp://``, across hosts.

Topology: the receiver binds, senders connect::

    sender A: DEALER --connect--+
                                 +--> ROUTER (bound by the one receiver of the channel)
    sender B: DEALER --connect--+        |  receiver loop thread: decode, ack each
                ^                        |  message back to its sender, index by key
                +------ acks ------------+

    A sender has no thread of its own: the thread blocked in ``put`` drives the DEALER
    (sends, then polls for its ack); concurrent puts take turns (see ``io``).

- Endpoint: ``endpoint="tcp://HOST:PORT"`` (the receiver may bind port ``*`` and publish
  its ``endpoint`` attribute), or ``ipc://PATH``. Without ``endpoint`` both ends derive
  ``ipc://<ipc_dir>/<prefix>-zmq-<sha256(channel)>.sock``, where ``ipc_dir`` defaults to
  ``$OMNILINK_ZMQ_DIR``, else ``$XDG_RUNTIME_DIR/omnilink``, else
  ``/tmp/omnilink-<uid>``, a directory that must be private (0700, ours), and ``prefix``
  is ``$OMNILINK_SHM_PREFIX`` (default ``omnilink``).
- Each message is one ZMQ multipart message: a routing frame (key, sender id, sequence
  number, frame count), the tensor_blob meta (prefix + header) and one frame per tensor
  region, sent ``copy=False`` when at least ``copy_threshold`` bytes (smaller regions
  are copied: cheaper than tracking them). See ``wire`` for the byte layouts.
- The receiver decodes every tensor as a zero-copy view of its received ``zmq.Frame``
  (a frame stays alive while any view of it does), unless the frame's address does not
  suit the dtype's alignment, in which case that one tensor is copied.
- By reference (``ipc://`` only, ``by_reference=True``, messages of at least
  ``reference_threshold`` tensor bytes): the tensor frames are replaced by one
  reference frame (sender pid, addresses, lengths, a per-message token); the receiver
  copies the bytes straight out of the sender with ``process_vm_readv(2)`` into one
  64-byte aligned buffer (two threads for messages of 4 MiB and more; buffers are
  reused once the views of a consumed payload are gone) and decodes views of it. One
  copy instead of two through the kernel's socket buffers: on the 2-core benchmark
  machine a bare Unix socket moved 16 MiB at 0.10-0.61x the shm backend (median
  0.43x over 7 runs of the benchmark), so frames
  cannot get within 2x of shm there; by reference does (see ``cma`` for the
  token protocol that keeps a late read from delivering a torn payload). Where the
  kernel refuses the read (another user; a seccomp filter; Yama ``ptrace_scope`` 1,
  the Ubuntu default, unless the receiver is an ancestor of the sender, e.g. the
  process that spawned it; ``ptrace_scope`` >= 2; a different pid namespace) the
  receiver asks for frames, the sender resends the same message as frames and keeps
  using frames.

What is guaranteed
------------------
*Acknowledged* means: the receiver process has the whole message, validated and
decoded, in its in-memory index (or has recorded that it is malformed, or that its key
was already waiting). ``put`` returns only after that ack arrives, so:

1. When ``put`` returns, the payload is on the receiver, and the caller may reuse or
   free its tensors at once (the ack proves zmq -- or, by reference, the receiver's
   copy -- finished reading them; a by-reference token is invalidated before ``put``
   returns or raises, and a receiver that still read it drops its copy).
2. Each acknowledged payload is delivered to ``get`` at most once and, while the
   receiver process lives, exactly once (or dropped by ``discard``). Resends after a
   reconnect carry the same (sender id, sequence number); the receiver drops the
   duplicate and acks it again (it remembers the last 65536 of them).
3. A receiver that restarts (same endpoint) is reconnected to automatically; every put
   not yet acknowledged when the connection broke is resent, so messages whose ``put``
   returned after the restart are delivered by the new receiver.
4. A sender that dies mid-message leaves nothing behind: ZMQ delivers multipart messages
   whole or not at all, and the receiver also checks the frame count against the
   routing frame and the blob header (``BlobDecodeError`` for the key otherwise). A
   by-reference read that fails part-way, or whose token is gone afterwards, is
   dropped whole.
5. Every wait is bounded by its timeout: ``TransferTimeout`` names the channel, the key
   and the peer endpoint.
6. The key contract: a ``put`` of a key still waiting on the receiver is refused by it
   (``DuplicateKeyError`` from ``put``; the first payload stays); a ``get`` of a key the
   receiver consumed or discarded (the last 65,536) raises ``KeyConsumedError``. A
   malformed message is an error entry for its key, counted as ``ERROR_ENTRY_BYTES``
   against ``max_buffered_bytes`` (at most ``MAX_ERROR_ENTRIES`` kept).
7. A receiver restarted on the same endpoint is taken back however long it was away
   (zmq reconnects for as long as the sender is open); each ``put`` waits for it up to
   ``peer_timeout`` from the later of its own start and the disconnection.

What is NOT guaranteed
----------------------
- Durability: the index lives in the receiver's memory. Payloads acknowledged but not
  yet consumed are lost if the receiver process dies (its consumers die with it).
- A ``put`` that raised (``TransferTimeout``, ``PeerLostError``, ``ClosedError``) is *in
  doubt*: the receiver may or may not get it (at most once). Before raising, ``put``
  takes its message back from zmq (resetting the socket if zmq still held it) and
  waits until zmq released the caller's buffers, so the tensors are free either way;
  resend under a new key or ``discard`` it on the receiving side.
- One receiver per channel endpoint: a second receiver on the same ipc endpoint gets
  ``ConfigurationError`` (a lock file guards it), on the same tcp port the bind fails
  the same way. Keys are not shared across receiver processes: a payload goes to the
  receiver its sender is connected to. Any number of senders may connect.
- Peer loss is detected by ZMQ heartbeats (``heartbeat_interval``, timeout 3x) and by
  connection events: a receiver raises ``PeerLostError`` from ``get`` once *every*
  sender has been disconnected for ``peer_timeout`` seconds (after at least one
  connected); a sender raises it from ``put`` once the receiver has been disconnected
  that long, counted from the later of the disconnection and the ``put``'s start (a
  sender reads connection events only while a ``put`` waits). A peer that never connected is a
  ``TransferTimeout``, not a loss.
- By reference, the receiver can read the sending process's memory (it must be
  allowed to, as for a debugger); use ``by_reference=False`` where sender and
  receiver must not trust each other that far. tcp endpoints never use it.
- Authentication is off by default: anyone who can reach a tcp endpoint can send. Set
  CURVE keys (below) on any endpoint not on loopback; ipc endpoints are protected by
  the private directory.

Backpressure: ``sndhwm``/``rcvhwm`` bound ZMQ's queues (in messages), and the receiver
stops reading its socket while its index holds ``max_buffered_bytes`` or more of
unconsumed payloads, so a slow consumer makes ``put`` wait (and eventually time out)
instead of growing memory without bound.

Cost of the ack: each ``put`` waits one round trip for its ack, so one thread sends one
message per round trip (see ``benchmarks/bench_zmq.py``); use several threads for more
in flight. The receiver sends the ack before it publishes the payload to ``get``, so
the ack never waits for the consumer, and a closing receiver lingers up to 200 ms to
flush acks already queued.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Iterable

import msgspec

from omnilink._errors import BlobDecodeError, ConfigurationError, OmnilinkError
from omnilink._util import Deadline, duplicate_key
from omnilink.connectors.base import BaseConnector, ConnectorStats, Role, check_constructor_options

try:
    import zmq
    import zmq.utils.z85
except ImportError as _exc:  # pragma: no cover - pyzmq is a hard dependency
    raise ImportError("the zmq backend needs pyzmq: `pip install pyzmq`") from _exc

from omnilink.connectors.zmq import wire
from omnilink.connectors.zmq.io import ReceiverLoop, SenderLoop
from omnilink.connectors.zmq.support import (
    EndpointLock,
    check_endpoint,
    remove_stale_socket,
    resolve_endpoint,
    set_options,
    zmq_error,
)

__all__ = ["ZmqConnector", "curve_keypair"]

logger = logging.getLogger(__name__)

#: High-water mark of the ack direction: acks are tiny and must never be dropped for room.
_ACK_HWM = 100_000
_ZAP_DOMAIN = b"omnilink"
#: Most seconds a sender's construction waits for its connection to a receiver that is
#: listening (``SenderLoop.wait_connected``; milliseconds on one host). Bounded by the
#: connector's ``timeout`` when that is shorter.
CONNECT_WAIT_S = 1.0


def curve_keypair() -> tuple[str, str]:
    """Return a new CURVE ``(public_key, secret_key)`` pair, Z85-encoded.

    Raises
    ------
    ConfigurationError
        This libzmq was built without CURVE support.
    """
    _require_curve()
    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise ConfigurationError(
            "zmq: CURVE was requested but this libzmq has no CURVE support; install a pyzmq "
            "wheel (`pip install --force-reinstall pyzmq`), which bundles libzmq with libsodium"
        )


def _z85_key(value: Any, name: str) -> bytes:
    if isinstance(value, str):
        value = value.encode("ascii", "replace")
    if not isinstance(value, bytes) or len(value) != 40:
        raise ConfigurationError(f"zmq: {name} must be a 40-character Z85 CURVE key (see curve_keypair())")
    try:
        zmq.utils.z85.decode(value)
    except (ValueError, KeyError) as exc:
        raise ConfigurationError(f"zmq: {name} is not valid Z85: {exc}") from exc
    return value


class _Allowed:
    """ZAP credentials provider: admit only the listed CURVE client public keys."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def _positive_int(value: Any, name: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"zmq: {name} must be an int >= {minimum}, got {value!r}")
    return value


def _positive_float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(f"zmq: {name} must be a number of seconds > 0, got {value!r}")
    return float(value)


def _check_values(
    *,
    role: Any,
    endpoint: Any,
    sndhwm: Any,
    rcvhwm: Any,
    max_buffered_bytes: Any,
    copy_threshold: Any,
    heartbeat_interval: Any,
    peer_timeout: Any,
    reconnect_interval: Any,
    max_frame_bytes: Any,
    by_reference: Any,
    reference_threshold: Any,
    curve_secret_key: Any,
    curve_server_key: Any,
    curve_allowed_clients: Any,
) -> None:
    """The value checks of ``ZmqConnector``'s options (its constructor and its
    ``check_options`` both call this): what holds on any machine, opening nothing.

    ``role`` decides what an endpoint and the CURVE keys must be: a receiver binds (a
    ``tcp://HOST:*`` endpoint is fine) and admits ``curve_allowed_clients``; a sender
    connects (to a port) with ``curve_server_key``.

    Raises
    ------
    ConfigurationError
        The first option out of its range, of the wrong type, or missing from a CURVE
        set-up, named.
    """
    _positive_int(sndhwm, "sndhwm")
    _positive_int(rcvhwm, "rcvhwm")
    _positive_int(max_buffered_bytes, "max_buffered_bytes")
    _positive_int(copy_threshold, "copy_threshold", minimum=0)
    _positive_float(heartbeat_interval, "heartbeat_interval")
    _positive_float(peer_timeout, "peer_timeout")
    _positive_float(reconnect_interval, "reconnect_interval")
    if max_frame_bytes is not None:
        _positive_int(max_frame_bytes, "max_frame_bytes")
    if not isinstance(by_reference, bool):
        raise ConfigurationError(f"zmq: by_reference must be a bool, got {by_reference!r}")
    _positive_int(reference_threshold, "reference_threshold", minimum=0)
    receives = role in ("receiver", "dual")
    sends = role in ("sender", "dual")
    if endpoint is not None:
        check_endpoint(endpoint, binding=receives)
    if curve_secret_key is None and curve_server_key is None and curve_allowed_clients is None:
        return
    if curve_secret_key is None:
        raise ConfigurationError("zmq: CURVE needs curve_secret_key (this end's secret key)")
    _z85_key(curve_secret_key, "curve_secret_key")
    if receives:
        clients = [_z85_key(k, "curve_allowed_clients[]") for k in (curve_allowed_clients or ())]
        # "dual" admits its own public key (derived from the secret one) besides these.
        if not clients and role != "dual":
            raise ConfigurationError(
                "zmq: a CURVE receiver needs curve_allowed_clients, the public keys of its senders"
            )
    if sends:
        if curve_server_key is None and role != "dual":
            raise ConfigurationError("zmq: a CURVE sender needs curve_server_key (the receiver's public key)")
        if curve_server_key is not None:
            _z85_key(curve_server_key, "curve_server_key")


class _Resources:
    """Everything a connector must release, closable from ``close`` or a finalizer."""

    def __init__(self) -> None:
        self.ctx: zmq.Context | None = None
        self.auth: Any = None
        self.sender: SenderLoop | None = None
        self.receiver: ReceiverLoop | None = None
        self.lock: EndpointLock | None = None
        self.socket_path: str | None = None
        self.sockets: list[zmq.Socket] = []

    def close(self) -> None:
        sender, self.sender = self.sender, None
        receiver, self.receiver = self.receiver, None
        if sender is not None:
            sender.close()
        if receiver is not None:
            receiver.close()
        for s in self.sockets:
            s.close(linger=0)
        self.sockets = []
        auth, self.auth = self.auth, None
        if auth is not None:
            auth.stop()
        ctx, self.ctx = self.ctx, None
        if ctx is not None:
            ctx.term()
        if self.socket_path is not None:
            remove_stale_socket(self.socket_path)  # libzmq removes it; make sure
            self.socket_path = None
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()


class ZmqConnector(BaseConnector):
    """A connector over ZeroMQ: ``ipc://`` on one host, ``tcp://`` across hosts.

    See the module docstring for the topology and the exact delivery guarantees.

    Parameters
    ----------
    channel : str
        Channel name; the default ipc endpoint is derived from it.
    role : {"sender", "receiver", "dual"}
        ``"receiver"`` binds the endpoint, ``"sender"`` connects to it, ``"dual"`` does
        both (it receives the channel and can send to it, itself included).
    timeout : float, optional
        Default seconds for blocking calls (``None``: no limit).
    endpoint : str, optional
        ``"ipc://PATH"`` or ``"tcp://HOST:PORT"``; a receiver may bind ``tcp://HOST:*`` and
        publish the resolved ``endpoint`` attribute. Default: the channel's ipc path.
    ipc_dir : str, optional
        Private directory (0700) for default ipc endpoints.
    sndhwm, rcvhwm : int
        ZMQ high-water marks, in messages, of the sender's and the receiver's queue.
    max_buffered_bytes : int
        Unconsumed bytes after which the receiver stops reading (backpressure).
    copy_threshold : int
        Tensor regions of at least this many bytes are sent zero-copy.
    heartbeat_interval : float
        Seconds between ZMQ heartbeats; a peer silent for 3x this is disconnected.
    peer_timeout : float
        Seconds a peer may stay disconnected before waits raise ``PeerLostError``; a
        peer that reconnects within it (a restart) loses nothing acknowledged.
    reconnect_interval : float
        Seconds between a sender's reconnection attempts.
    max_frame_bytes : int, optional
        Largest frame the receiver accepts (ZMQ_MAXMSGSIZE); a peer sending more is
        disconnected (a by-reference region larger than this is a ``BlobDecodeError``).
        Default: no limit.
    by_reference : bool
        ``ipc://`` only: let the receiver copy large messages' tensor bytes straight
        out of this sender's memory with ``process_vm_readv`` (one copy instead of two
        through the kernel's socket buffers). Needs the receiver to be allowed to read
        this process (same user; no seccomp filter or Yama ``ptrace_scope`` forbidding
        it: with scope 1 only an ancestor of the sender may); when it is not, the message is resent as frames and frames are used from
        then on. Ignored for ``tcp://``.
    reference_threshold : int
        Messages whose tensor bytes total at least this many go by reference.
    curve_secret_key : str, optional
        Enables CURVE: this end's Z85 secret key (its public key is derived).
    curve_server_key : str, optional
        Sender with CURVE: the receiver's Z85 public key (``curve_public_key`` there).
    curve_allowed_clients : iterable of str, optional
        Receiver with CURVE: the Z85 public keys of the senders it admits; every other
        client is refused during the handshake and its messages are never delivered.

    Raises
    ------
    ConfigurationError
        Bad options, an endpoint in use or held by another receiver, an ipc directory
        others can enter, CURVE options without CURVE support.
    """

    backend = "zmq"

    @classmethod
    def check_options(cls, options: dict[str, Any], /) -> None:
        """Refuse, opening nothing, the option values the constructor would refuse.

        The hook ``omnilink.connectors.check_backend_options`` calls (so does the
        vLLM-Omni adapter at construction, for either role). What depends on the
        machine (the ipc directory's owner and mode, a port in use, CURVE support in
        this libzmq) is left to the constructor and to ``omnilink check``.

        Parameters
        ----------
        options : dict
            Keyword options as ``connect`` would receive them.

        Raises
        ------
        ConfigurationError
            ``role`` or ``timeout`` invalid; ``sndhwm``, ``rcvhwm``,
            ``max_buffered_bytes`` or ``max_frame_bytes`` below 1; ``copy_threshold``
            or ``reference_threshold`` below 0; ``heartbeat_interval``,
            ``peer_timeout`` or ``reconnect_interval`` not a number > 0;
            ``by_reference`` not a bool; an ``endpoint`` that is not ``ipc://PATH`` or
            ``tcp://HOST:PORT`` (``*`` for a receiver only); a CURVE key that is not
            40 characters of Z85, or a CURVE set-up without ``curve_secret_key``, a
            receiver without ``curve_allowed_clients`` or a sender without
            ``curve_server_key``.
        """
        check_constructor_options(cls, _check_values, options)

    def __init__(
        self,
        *,
        channel: str,
        role: Role = "dual",
        timeout: float | None = None,
        endpoint: str | None = None,
        ipc_dir: str | None = None,
        sndhwm: int = 16,
        rcvhwm: int = 16,
        max_buffered_bytes: int = 1 << 30,
        copy_threshold: int = 65536,
        heartbeat_interval: float = 1.0,
        peer_timeout: float = 5.0,
        reconnect_interval: float = 0.1,
        max_frame_bytes: int | None = None,
        by_reference: bool = True,
        reference_threshold: int = 1 << 20,
        curve_secret_key: str | bytes | None = None,
        curve_server_key: str | bytes | None = None,
        curve_allowed_clients: Iterable[str | bytes] | None = None,
    ) -> None:
        super().__init__(channel=channel, role=role, timeout=timeout)
        if curve_allowed_clients is not None:
            curve_allowed_clients = list(curve_allowed_clients)  # checked, then used: iterated twice
        _check_values(
            role=role, endpoint=endpoint, sndhwm=sndhwm, rcvhwm=rcvhwm, max_buffered_bytes=max_buffered_bytes,
            copy_threshold=copy_threshold, heartbeat_interval=heartbeat_interval, peer_timeout=peer_timeout,
            reconnect_interval=reconnect_interval, max_frame_bytes=max_frame_bytes, by_reference=by_reference,
            reference_threshold=reference_threshold, curve_secret_key=curve_secret_key,
            curve_server_key=curve_server_key, curve_allowed_clients=curve_allowed_clients,
        )
        heartbeat_interval = float(heartbeat_interval)
        peer_timeout = float(peer_timeout)
        reconnect_interval = float(reconnect_interval)
        receives = role in ("receiver", "dual")
        sends = role in ("sender", "dual")
        prefix = os.environ.get("OMNILINK_SHM_PREFIX", "omnilink")
        resolved, lock_path = resolve_endpoint(
            endpoint, channel=self.channel, binding=receives, ipc_dir=ipc_dir, prefix=prefix
        )

        secret = public = server_key = None
        allowed: set[bytes] = set()
        if curve_secret_key is not None:  # _check_values: every other CURVE option needs it
            _require_curve()
            secret = _z85_key(curve_secret_key, "curve_secret_key")
            public = zmq.curve_public(secret)
            if receives:
                allowed = {_z85_key(k, "curve_allowed_clients[]") for k in (curve_allowed_clients or ())}
                if role == "dual":
                    allowed.add(public)
            if sends:
                server_key = public if curve_server_key is None else _z85_key(curve_server_key, "curve_server_key")
        self.curve_public_key: str | None = public.decode("ascii") if public is not None else None

        heartbeat = {
            zmq.HEARTBEAT_IVL: int(heartbeat_interval * 1000),
            zmq.HEARTBEAT_TIMEOUT: int(heartbeat_interval * 3000),
            zmq.HEARTBEAT_TTL: int(heartbeat_interval * 3000),
        }
        self._res = res = _Resources()
        self._finalizer = weakref.finalize(self, res.close)
        try:
            res.ctx = zmq.Context(io_threads=1)
            if receives:
                resolved = self._bind(
                    res, resolved, lock_path, rcvhwm, max_frame_bytes, heartbeat, secret, allowed,
                    max_buffered_bytes, peer_timeout,
                )
            self.endpoint: str = resolved
            if sends:
                sender_opts: dict[int, Any] = {
                    zmq.SNDHWM: sndhwm,
                    zmq.RCVHWM: _ACK_HWM,
                    zmq.LINGER: 0,
                    # Queue only to live connections: what zmq has not sent stays ours,
                    # so a message to a dead receiver is resent, not parked in a pipe.
                    zmq.IMMEDIATE: 1,
                    zmq.RECONNECT_IVL: int(reconnect_interval * 1000),
                    zmq.RECONNECT_IVL_MAX: max(int(reconnect_interval * 1000), 1000),
                    **heartbeat,
                }
                if secret is not None:
                    sender_opts.update(
                        {zmq.CURVE_SERVERKEY: server_key, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret}
                    )
                ctx = res.ctx
                chan = self.channel

                def make_socket() -> zmq.Socket:
                    sock = ctx.socket(zmq.DEALER)
                    try:
                        set_options(sock, sender_opts, channel=chan, endpoint=resolved)
                        sock.copy_threshold = copy_threshold
                        sock.connect(resolved)
                    except zmq.ZMQError as exc:
                        sock.close(linger=0)
                        raise zmq_error(exc, "connecting", channel=chan, endpoint=resolved) from exc
                    except OmnilinkError:
                        sock.close(linger=0)
                        raise
                    return sock

                res.sender = SenderLoop(
                    ctx=res.ctx,
                    make_socket=make_socket,
                    channel=self.channel,
                    endpoint=resolved,
                    copy_threshold=copy_threshold,
                    peer_timeout=peer_timeout,
                    reference_threshold=(
                        reference_threshold if by_reference and resolved.startswith("ipc://") else None
                    ),
                )
                # Return connected when the receiver is up (see ``wait_connected``).
                wait = CONNECT_WAIT_S if self.timeout is None else min(self.timeout, CONNECT_WAIT_S)
                res.sender.wait_connected(wait)
        except BaseException:
            self._closed = True
            res.close()
            raise

    def _bind(
        self,
        res: _Resources,
        endpoint: str,
        lock_path: str | None,
        rcvhwm: int,
        max_frame_bytes: int | None,
        heartbeat: dict[int, int],
        secret: bytes | None,
        allowed: set[bytes],
        max_buffered_bytes: int,
        peer_timeout: float,
    ) -> str:
        if lock_path is not None:
            res.lock = EndpointLock(lock_path, channel=self.channel)
            res.socket_path = endpoint[len("ipc://") :]
            remove_stale_socket(res.socket_path)  # left by a receiver that died
        opts: dict[int, Any] = {
            zmq.RCVHWM: rcvhwm,
            zmq.SNDHWM: _ACK_HWM,
            zmq.LINGER: 0,
            zmq.ROUTER_MANDATORY: 1,
            **heartbeat,
        }
        if max_frame_bytes is not None:
            opts[zmq.MAXMSGSIZE] = max_frame_bytes
        if secret is not None:
            from zmq.auth.thread import ThreadAuthenticator

            res.auth = ThreadAuthenticator(res.ctx, log=logging.getLogger(__name__ + ".auth"))
            res.auth.start()
            res.auth.configure_curve_callback(_ZAP_DOMAIN.decode(), credentials_provider=_Allowed(allowed))
            opts.update({zmq.CURVE_SERVER: 1, zmq.CURVE_SECRETKEY: secret, zmq.ZAP_DOMAIN: _ZAP_DOMAIN})
        elif endpoint.startswith("tcp://") and not _loopback(endpoint):
            logger.warning(
                "zmq: channel %r binds %s without CURVE: anyone who can reach it can send; "
                "set curve_secret_key and curve_allowed_clients",
                self.channel,
                endpoint,
            )
        sock = res.ctx.socket(zmq.ROUTER)
        res.sockets.append(sock)
        set_options(sock, opts, channel=self.channel, endpoint=endpoint)
        try:
            sock.bind(endpoint)
            bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            raise zmq_error(exc, "binding", channel=self.channel, endpoint=endpoint) from exc
        if res.socket_path is not None:
            # libzmq creates the socket file with the umask (0755 typically); only the
            # owner may connect (the private directory already keeps others out).
            try:
                os.chmod(res.socket_path, 0o600)
            except OSError as exc:
                raise ConfigurationError(
                    f"zmq: cannot make the ipc socket {res.socket_path!r} private: {exc}"
                ) from exc
        res.sockets.remove(sock)
        res.receiver = ReceiverLoop(
            ctx=res.ctx,
            sock=sock,
            channel=self.channel,
            endpoint=bound,
            max_buffered_bytes=max_buffered_bytes,
            peer_timeout=peer_timeout,
            max_frame_bytes=max_frame_bytes,
        )
        return bound

    # ----------------------------------------------------------------- hooks
    def _put(self, key: str, payload: Any, deadline: Deadline) -> int:
        sender = self._res.sender
        if sender is None:
            raise ConfigurationError(f"zmq connector on channel {self.channel!r} has role {self.role!r}: it cannot put")
        from omnilink.blob import prepare

        prepared = prepare(payload)
        status, text = sender.send(
            key,
            prepared.meta,
            prepared.regions(),
            deadline,
            lambda waited, why: self._timeout("put", key, f"the receiver at {self.endpoint} ({why})", waited),
        )
        if status == wire.ACK_DUPLICATE_KEY:
            raise duplicate_key(self.backend, self.channel, key)
        if status == wire.ACK_DECODE_ERROR:
            raise BlobDecodeError(f"zmq: the receiver of channel {self.channel!r} rejected key {key!r}: {text}")
        if status != wire.ACK_OK:
            raise BlobDecodeError(f"zmq: unknown ack status {status} for key {key!r}")
        return prepared.nbytes

    def _get(self, key: str, deadline: Deadline, block: bool) -> Any:
        receiver = self._res.receiver
        if receiver is None:
            raise ConfigurationError(f"zmq connector on channel {self.channel!r} has role {self.role!r}: it cannot get")
        payload, size = receiver.take(
            key, deadline, block, lambda waited: self._timeout("get", key, f"a sender on {self.endpoint}", waited)
        )
        self._count(bytes_got=size)
        return payload

    def _arrivals(self, known: set[str], timeout: float) -> set[str]:
        receiver = self._res.receiver
        if receiver is None:
            raise ConfigurationError(f"zmq connector on channel {self.channel!r} has role {self.role!r}: it cannot get")
        return receiver.arrivals(known, timeout)

    def _discard(self, key: str) -> bool:
        receiver = self._res.receiver
        if receiver is None:
            raise ConfigurationError(
                f"zmq connector on channel {self.channel!r} has role {self.role!r}: it cannot discard"
            )
        return receiver.discard(key)

    def stats(self) -> ConnectorStats:
        """Counters since this connector was opened; ``fallbacks`` counts received tensors
        that had to be copied because their frame's address did not suit their dtype.

        Raises
        ------
        ClosedError
            The connector was closed.
        """
        st = super().stats()
        receiver = self._res.receiver
        if receiver is None:
            return st
        return msgspec.structs.replace(st, fallbacks=st.fallbacks + receiver.fallbacks)

    def _in_use(self) -> tuple[int, int]:
        receiver = self._res.receiver
        return (0, 0) if receiver is None else receiver.in_use()

    def _close(self) -> None:
        self._finalizer()

    def health(self) -> dict[str, Any]:
        """A snapshot of the links: connected peers, pending puts, refusals (for probes)."""
        self._check_open()
        out: dict[str, Any] = {"endpoint": self.endpoint, "role": self.role}
        sender, receiver = self._res.sender, self._res.receiver
        if sender is not None:
            out["sender"] = sender.status()
        if receiver is not None:
            with receiver.cond:
                out["receiver"] = {
                    "connections": len(receiver.live_fds),
                    "buffered_bytes": receiver.buffered,
                    "paused": receiver.paused,
                    "malformed": receiver.malformed,
                    "refused": receiver.auth_failures,
                    "by_reference": receiver.by_reference,
                    "buffer_reuses": receiver.pool.hits,
                }
        return out


def _loopback(endpoint: str) -> bool:
    host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
