"""Support code of the zmq backend: error translation, endpoints, the ipc bind lock.

``zmq_error`` is the one place where a ``zmq.ZMQError`` becomes an omnilink error; every
call site does ``raise zmq_error(exc, ...) from exc``.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import stat
import tempfile
from typing import Any

import zmq

from omnilink._errors import (
    ClosedError,
    ConfigurationError,
    OmnilinkError,
    PeerLostError,
    TransportError,
)

__all__ = [
    "EndpointLock",
    "check_endpoint",
    "collect_ipc_garbage",
    "default_ipc_dir",
    "ipc_paths",
    "resolve_endpoint",
    "zmq_error",
]

logger = logging.getLogger(__name__)

#: Longest ipc:// path libzmq accepts (sun_path is 108 bytes including the NUL).
MAX_IPC_PATH = 107


def zmq_error(exc: zmq.ZMQError, what: str, *, channel: str, endpoint: str | None) -> OmnilinkError:
    """Translate ``exc`` (raised while doing ``what``) into the omnilink error it means."""
    where = f"zmq: {what} on channel {channel!r}" + (f" ({endpoint})" if endpoint else "")
    code = exc.errno
    if code == errno.EADDRINUSE:
        return ConfigurationError(
            f"{where}: address already in use; another receiver is bound to it "
            "(one receiver per channel endpoint)"
        )
    if code in (errno.EINVAL, errno.EPROTONOSUPPORT, errno.ENODEV, errno.EADDRNOTAVAIL, errno.ENOENT):
        return ConfigurationError(f"{where}: invalid endpoint or option: {exc}")
    if code in (zmq.ETERM, errno.ENOTSOCK):
        return ClosedError(f"{where}: socket or context already closed: {exc}")
    if code == errno.EHOSTUNREACH:
        return PeerLostError(f"{where}: peer is not connected: {exc}")
    return TransportError(f"{where}: {exc} (errno {code})")


# ---------------------------------------------------------------------- endpoints
def default_ipc_dir() -> str:
    """``$OMNILINK_ZMQ_DIR``, else ``$XDG_RUNTIME_DIR/omnilink``, else ``/tmp/omnilink-<uid>``."""
    env = os.environ.get("OMNILINK_ZMQ_DIR")
    if env:
        return env
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "omnilink")
    return os.path.join(tempfile.gettempdir(), f"omnilink-{os.getuid()}")


def _private_dir(path: str) -> str:
    """Create ``path`` mode 0700 if missing; refuse one that others can enter.

    The ipc socket file is reachable by whoever can traverse its directory; a private
    directory is what keeps other local users from injecting messages.
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as exc:
        raise ConfigurationError(f"zmq: cannot create the ipc directory {path!r}: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigurationError(f"zmq: ipc directory {path!r} is not a directory")
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigurationError(
            f"zmq: ipc directory {path!r} must be owned by uid {os.getuid()} with mode 0700 "
            f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}); other users could "
            "connect to its sockets. Fix it with `chmod 700` or pass ipc_dir= elsewhere"
        )
    return path


def ipc_paths(channel: str, ipc_dir: str | None, prefix: str) -> tuple[str, str]:
    """(socket path, lock path) of ``channel``'s default ipc endpoint.

    The name hashes the channel (channels may be 128 characters, a socket path at most
    107 bytes) and starts with ``prefix`` (``OMNILINK_SHM_PREFIX``), so test runs and
    deployments that set different prefixes never meet.
    """
    base = _private_dir(ipc_dir or default_ipc_dir())
    digest = hashlib.sha256(channel.encode("utf-8")).hexdigest()[:24]
    sock = os.path.join(base, f"{prefix}-zmq-{digest}.sock")
    if len(sock.encode()) > MAX_IPC_PATH:
        raise ConfigurationError(
            f"zmq: ipc socket path {sock!r} is longer than {MAX_IPC_PATH} bytes; use a shorter ipc_dir"
        )
    return sock, sock[: -len(".sock")] + ".lock"


def check_endpoint(endpoint: Any, *, binding: bool) -> None:
    """Refuse an ``endpoint`` option that no machine could bind or connect to.

    The part of ``resolve_endpoint`` that reads nothing but the string, so the
    connector's ``check_options`` can apply it without touching the filesystem.

    Raises
    ------
    ConfigurationError
        Not a str; an ``ipc://`` endpoint without a file path, an abstract one or one
        longer than ``MAX_IPC_PATH`` bytes; a tcp endpoint a sender cannot connect to (no
        port, ``*`` port) or with an invalid port; any other scheme.
    """
    if not isinstance(endpoint, str):
        raise ConfigurationError(f"zmq: endpoint must be a str, got {endpoint!r}")
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if not path or path.startswith("@"):
            raise ConfigurationError(
                f"zmq: ipc endpoint {endpoint!r} must name a file path (abstract sockets have no permissions)"
            )
        if len(path.encode()) > MAX_IPC_PATH:
            raise ConfigurationError(f"zmq: ipc path {path!r} is longer than {MAX_IPC_PATH} bytes")
        return
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if not sep or not host or not port:
            raise ConfigurationError(f"zmq: tcp endpoint {endpoint!r} must be tcp://HOST:PORT")
        if port == "*" and not binding:
            raise ConfigurationError(
                f"zmq: a sender cannot connect to {endpoint!r}; use the receiver's bound "
                "endpoint (its `endpoint` attribute)"
            )
        if port != "*" and not port.isdigit():
            raise ConfigurationError(f"zmq: tcp endpoint {endpoint!r} has an invalid port")
        return
    raise ConfigurationError(f"zmq: endpoint {endpoint!r} must start with ipc:// or tcp://")


def resolve_endpoint(
    endpoint: str | None, *, channel: str, binding: bool, ipc_dir: str | None, prefix: str
) -> tuple[str, str | None]:
    """Return ``(endpoint, lock_path)`` for a socket that binds or connects.

    ``lock_path`` is set for ipc endpoints: a binder must hold its lock (see
    ``EndpointLock``).

    Raises
    ------
    ConfigurationError
        What ``check_endpoint`` refuses, or an ipc directory that cannot be created or
        that others can enter.
    """
    if endpoint is None:
        sock, lock = ipc_paths(channel, ipc_dir, prefix)
        return "ipc://" + sock, lock
    check_endpoint(endpoint, binding=binding)
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if binding:
            _private_dir(os.path.dirname(os.path.abspath(path)))
        return endpoint, os.path.abspath(path) + ".lock"
    return endpoint, None


class EndpointLock:
    """An exclusive ``flock`` next to an ipc socket: one live receiver per ipc endpoint.

    libzmq unlinks an existing socket file when it binds, so without this lock a second
    receiver would silently steal the endpoint from the first. The kernel drops the lock
    when its holder dies, so a crashed receiver never blocks its successor.
    """

    def __init__(self, path: str, *, channel: str) -> None:
        self.path = path
        self._fd: int | None = None
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise ConfigurationError(f"zmq: cannot open lock file {path!r}: {exc}") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise ConfigurationError(
                        f"zmq: another receiver is already bound to channel {channel!r} "
                        f"(lock {path!r} is held); one receiver per channel endpoint"
                    ) from exc
                raise ConfigurationError(f"zmq: cannot lock {path!r}: {exc}") from exc
            # The previous holder may have unlinked the file between our open and flock:
            # then we hold a lock on a dead inode and must start over.
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.unlink(self.path)  # while still holding the lock: see __init__
        except FileNotFoundError:
            pass
        os.close(fd)


def remove_stale_socket(path: str) -> None:
    """Remove a socket file left by a receiver that died (we hold its lock, so it is ours)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISSOCK(st.st_mode):
        os.unlink(path)


def set_options(sock: zmq.Socket, options: dict[int, Any], *, channel: str, endpoint: str) -> None:
    for opt, value in options.items():
        try:
            sock.setsockopt(opt, value)
        except zmq.ZMQError as exc:
            raise zmq_error(exc, f"setting socket option {opt}", channel=channel, endpoint=endpoint) from exc


def collect_ipc_garbage(
    *, ipc_dir: str | None = None, prefix: str | None = None, dry_run: bool = False
) -> list[str]:
    """Remove the ipc files (``.sock`` and ``.lock``) of zmq receivers that died.

    A receiver holds an ``flock`` on its ``.lock`` file while it lives and removes both
    files when it closes; a receiver killed with SIGKILL leaves them. A lock file whose
    lock can be taken therefore belongs to a dead receiver: its socket file is removed,
    then the lock file, while holding the lock (as ``EndpointLock.release`` does, so a
    receiver starting at the same moment cannot lose its endpoint).

    Parameters
    ----------
    ipc_dir : str, optional
        Directory of the default ipc endpoints (default: ``default_ipc_dir()``).
    prefix : str, optional
        Name prefix; default ``OMNILINK_SHM_PREFIX`` or ``omnilink``.
    dry_run : bool
        Only report what would be removed.

    Returns
    -------
    list of str
        Paths removed (or that would be), sorted. A missing directory gives ``[]``.
    """
    base = ipc_dir or default_ipc_dir()
    if prefix is None:
        prefix = os.environ.get("OMNILINK_SHM_PREFIX", "omnilink")
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ConfigurationError(f"zmq: cannot list the ipc directory {base!r}: {exc}") from exc
    start = f"{prefix}-zmq-"
    removed: list[str] = []
    for name in sorted(names):
        if not name.startswith(start):
            continue
        path = os.path.join(base, name)
        if name.endswith(".lock"):
            removed.extend(_collect_endpoint(path, dry_run))
        elif name.endswith(".sock") and not os.path.exists(path[: -len(".sock")] + ".lock"):
            # A socket without its lock file: its receiver died after the lock was gone
            # (or it was never locked); nobody can be bound to it through omnilink.
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    if not dry_run:
                        os.unlink(path)
                    removed.append(path)
            except FileNotFoundError:
                pass
    return sorted(set(removed))


def _collect_endpoint(lock_path: str, dry_run: bool) -> list[str]:
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return []
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return []  # held: a live receiver
        try:
            if os.stat(lock_path).st_ino != os.fstat(fd).st_ino:
                return []  # replaced meanwhile by a new receiver's file
        except FileNotFoundError:
            return []
        out = []
        sock = lock_path[: -len(".lock")] + ".sock"
        try:
            if stat.S_ISSOCK(os.lstat(sock).st_mode):
                if not dry_run:
                    os.unlink(sock)
                out.append(sock)
        except FileNotFoundError:
            pass
        if not dry_run:
            os.unlink(lock_path)
        out.append(lock_path)
        return out
    finally:
        os.close(fd)
