"""A doorbell: one stream socket from a sending end to a receiving end, each message a
4-byte little-endian length then that many bytes (the nccl backend's doorbell, the nixl
backend's publish and acknowledgement messages).

A plain socket rather than a ZeroMQ one: a ZeroMQ message crosses two I/O threads (the
sender's and the receiver's) before the reader's ``poll`` returns, and waking each costs
tens of microseconds on an idle many-core machine, per message, where a small payload's
whole receive path costs about as much. Here ``send`` writes into the kernel's socket
buffer from the caller's thread and the reader's ``recv`` takes it from there: one
wake-up at most, none while the reader spins.

On one host the socket is a Unix-domain stream socket in the abstract namespace; across
hosts, TCP with ``TCP_NODELAY``. ``BellWriter.send`` writes a whole message or fails
(a message never interleaves with another: the caller holds its send lock); it waits
for room in the socket only when the reader is behind by a socket buffer, which it
never stays while alive (it reads every message as it comes, whatever it posts).
``BellReader.read`` never blocks, bounds a message's length before allocating it, and
reports the writer's end of the stream (``eof``).
"""

from __future__ import annotations

import select
import socket
import struct
import time

from omnilink._errors import BlobDecodeError, PeerLostError, TransferTimeout

__all__ = ["BellListener", "BellReader", "BellWriter", "connect_bell"]

_LEN = struct.Struct("<I")
#: What the kernel is asked to buffer each way (it may grant less).
_SOCKET_BUFFER = 4 << 20
#: Bytes read per ``recv_into``.
_CHUNK = 256 << 10
UNIX_PREFIX = "unix:@"


def _tune(sock: socket.socket, tcp: bool) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)
        except OSError:  # pragma: no cover - the kernel keeps its own size
            pass
    if tcp:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class BellListener:
    """The receiving end's listening socket, bound before its address is published."""

    def __init__(self, same_host: bool, name: str, address: str, backlog: int = 1) -> None:
        if same_host:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind("\0" + name)
            self.endpoint = UNIX_PREFIX + name
            self._tcp = False
        else:
            family, kind, proto, _, addr = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0]
            self.sock = socket.socket(family, kind, proto)
            self.sock.bind(addr[:2] if family == socket.AF_INET else addr)
            host, port = self.sock.getsockname()[:2]
            self.endpoint = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
            self._tcp = True
        self.sock.listen(backlog)

    def accept(self, timeout: float | None) -> socket.socket:
        """The writer's connection (``TransferTimeout`` when none came in ``timeout``)."""
        self.sock.settimeout(timeout)
        try:
            conn, _ = self.sock.accept()
        except socket.timeout as exc:
            raise TransferTimeout(f"the peer did not connect to the doorbell within {timeout} s") from exc
        _tune(conn, self._tcp)
        return conn

    def accept_nowait(self) -> socket.socket | None:
        """A connection waiting to be accepted, or ``None`` (never blocks)."""
        self.sock.setblocking(False)
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return None
        _tune(conn, self._tcp)
        return conn

    def close(self) -> None:
        self.sock.close()


def connect_bell(endpoint: str, timeout: float | None) -> socket.socket:
    """Connect to a published doorbell endpoint (``unix:@name`` or ``tcp://host:port``).

    Raises
    ------
    ValueError
        Not such an endpoint.
    OSError
        The connection failed.
    """
    if endpoint.startswith(UNIX_PREFIX):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect("\0" + endpoint[len(UNIX_PREFIX):])
        except BaseException:
            sock.close()
            raise
        _tune(sock, False)
        return sock
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"not a doorbell endpoint: {endpoint!r}")
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit():
        raise ValueError(f"not a doorbell endpoint: {endpoint!r}")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    _tune(sock, True)
    return sock


class BellWriter:
    """The sending end of the stream (the caller serialises ``send``)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLOUT)

    def send(self, raw: bytes | memoryview, timeout: float | None) -> None:
        """Write one message whole.

        Raises
        ------
        PeerLostError
            The reader's end is gone (its process died or closed the socket).
        TransferTimeout
            The reader took none of it for ``timeout`` seconds; the stream is then in an
            unknown state (part of a message may be written) and the caller must give the
            link up.
        """
        bufs = [memoryview(_LEN.pack(len(raw))), memoryview(raw)]
        end = None if timeout is None else time.monotonic() + timeout
        sock = self.sock
        while bufs:
            try:
                n = sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as exc:
                raise PeerLostError(f"the doorbell socket failed ({exc})") from exc
            while n and bufs:
                first = bufs[0]
                if n >= len(first):
                    n -= len(first)
                    bufs.pop(0)
                else:
                    bufs[0] = first[n:]
                    n = 0
            if bufs and not bufs[0]:
                bufs.pop(0)
                continue
            if bufs:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TransferTimeout(f"the doorbell's reader took nothing for {timeout} s")
                self._poll.poll(None if left is None else max(1, int(left * 1000)))

    def close(self) -> None:
        self.sock.close()


class BellReader:
    """The receiving end of the stream (one reader thread at a time)."""

    def __init__(self, sock: socket.socket, max_message: int) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.max_message = max_message
        self.eof = False
        self._buf = bytearray()
        self._at = 0  # start of the first unparsed byte in _buf
        self._chunk = bytearray(_CHUNK)
        self._view = memoryview(self._chunk)

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> list[bytes]:
        """Every whole message the socket holds now (never blocks; sets ``eof`` once the
        writer's end is closed and every message before it was returned).

        Raises
        ------
        BlobDecodeError
            A message's length exceeds ``max_message`` (nothing of it is allocated).
        """
        sock = self.sock
        view = self._view
        buf = self._buf
        while not self.eof:
            try:
                n = sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # reset by a dead writer: the same as its end
                n = 0
            if n == 0:
                self.eof = True
                break
            buf += view[:n]
            if n < len(view):
                break
        out: list[bytes] = []
        at = self._at
        size = len(buf)
        with memoryview(buf) as mv:
            while size - at >= 4:
                (n,) = _LEN.unpack_from(mv, at)
                if n > self.max_message:
                    raise BlobDecodeError(
                        f"doorbell message of {n} bytes, more than this end's {self.max_message}"
                    )
                if size - at - 4 < n:
                    break
                out.append(bytes(mv[at + 4: at + 4 + n]))
                at += 4 + n
        if at == size:
            buf.clear()
            at = 0
        elif at > (1 << 20):
            del buf[:at]
            at = 0
        self._at = at
        return out

    def close(self) -> None:
        self.sock.close()
