"""Names, liveness and host-wide locking of what omnilink keeps in ``/dev/shm``.

Every object the ``shm`` backend and the device pool create in ``/dev/shm`` is named
from the prefix in ``OMNILINK_SHM_PREFIX`` (default ``omnilink``, read once per
connector) and says who owns it, so that ``collect_garbage`` can tell a dead process's
leftovers from a live one's::

    <prefix>-a<pid>-<token>      arena of a sender (shared memory segment)
    <prefix>-a<pid>-<token>-s    that sender's "space freed" semaphore (sem.<...> in /dev/shm)
    <prefix>-o<pid>-<token>      overflow segment of one payload larger than the arena
    <prefix>-e<pid>-<token>      extension segment of a sender's arena (elastic arena)
    <prefix>-c<hash>             control segment of a channel (shared, refcounted)
    <prefix>-c<hash>-m           the channel's mutex semaphore
    <prefix>-c<hash>-w           the channel's wake-up semaphore
    <prefix>-a<pid>-<token>      also a device pool's directory (``devpool``), named like an
                                 arena of its receiver, token from the channel name

``<token>`` is ``secrets.token_hex(8)``; ``<hash>`` is the first 24 hex digits of the
SHA-256 of the channel name (channel names may contain ``/``, file names may not). The
longest name is well under Linux's NAME_MAX of 255 even with the ``sem.`` that glibc
puts in front of a semaphore's file name.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import secrets
import threading

from omnilink._errors import ConfigurationError
from omnilink._util import pid_alive as _pid_alive

__all__ = [
    "SHM_DIR",
    "HostLock",
    "arena_name",
    "channel_names",
    "extension_name",
    "free_shm_bytes",
    "new_token",
    "overflow_name",
    "parse_owned_name",
    "parse_channel_name",
    "pid_alive",
    "read_prefix",
]

SHM_DIR = "/dev/shm"
#: Largest value of a pid_t: a pid read from shared memory above it was not written by
#: a process of ours (``os.kill`` would raise ``OverflowError`` on it).
_PID_T_MAX = 0x7FFFFFFF


def pid_alive(pid: int) -> bool:
    """``omnilink._util.pid_alive`` for a pid read from shared memory, which any process
    of the user can overwrite: a value no pid can have is a dead process, not an error.
    The shm and device-pool modules import it from here."""
    return 0 < pid <= _PID_T_MAX and _pid_alive(pid)
_PREFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,99}")
_OWNED_RE = re.compile(r"-([aoe])([0-9]+)-([0-9a-f]{16})(-s)?$")
_CHANNEL_RE = re.compile(r"-c([0-9a-f]{24})(-m|-w)?$")


def read_prefix() -> str:
    """The name prefix from ``OMNILINK_SHM_PREFIX`` (default ``omnilink``), validated.

    Raises
    ------
    ConfigurationError
        The prefix is not 1-100 characters of ``[A-Za-z0-9._-]`` starting with a letter
        or digit (it becomes part of file names in ``/dev/shm``).
    """
    prefix = os.environ.get("OMNILINK_SHM_PREFIX", "omnilink")
    if not _PREFIX_RE.fullmatch(prefix):
        raise ConfigurationError(
            f"OMNILINK_SHM_PREFIX={prefix!r} is not usable in /dev/shm names: use 1-100 "
            "characters of [A-Za-z0-9._-] starting with a letter or digit"
        )
    return prefix


def new_token() -> str:
    return secrets.token_hex(8)


def arena_name(prefix: str, pid: int, token: str) -> str:
    """Name of a sender's arena; its semaphore is this name plus ``-s``."""
    return f"/{prefix}-a{pid}-{token}"


def overflow_name(prefix: str, pid: int, token: str) -> str:
    return f"/{prefix}-o{pid}-{token}"


def extension_name(prefix: str, pid: int, token: str) -> str:
    """Name of an extension segment of the arena of sender ``pid``."""
    return f"/{prefix}-e{pid}-{token}"


def channel_names(prefix: str, channel: str) -> tuple[str, str, str]:
    """(control segment, mutex semaphore, wake semaphore) names of ``channel``."""
    digest = hashlib.sha256(channel.encode("utf-8")).hexdigest()[:24]
    base = f"/{prefix}-c{digest}"
    return base, base + "-m", base + "-w"


def parse_owned_name(entry: str, prefix: str) -> tuple[str, int, str, bool, bool] | None:
    """Parse a ``/dev/shm`` entry owned by one process.

    Returns ``(kind, pid, token, is_semaphore, is_sender_sem)`` with kind ``"a"`` (arena),
    ``"o"`` (overflow) or ``"e"`` (extension), or ``None`` when ``entry`` is not such a
    name under ``prefix``.
    """
    is_sem = entry.startswith("sem.")
    name = entry[4:] if is_sem else entry
    if not name.startswith(prefix):
        return None
    m = _OWNED_RE.search(name, len(prefix))
    if m is None:
        return None
    kind, pid, token, sem_suffix = m.groups()
    if is_sem != bool(sem_suffix) or (kind != "a" and sem_suffix):
        return None
    return kind, int(pid), token, is_sem, bool(sem_suffix)


def parse_channel_name(entry: str, prefix: str) -> tuple[str, str] | None:
    """Parse a channel object's ``/dev/shm`` entry: ``(posix name of its control segment,
    posix name of this object)``, or ``None``."""
    is_sem = entry.startswith("sem.")
    name = entry[4:] if is_sem else entry
    if not name.startswith(prefix):
        return None
    m = _CHANNEL_RE.search(name, len(prefix))
    if m is None or is_sem != bool(m.group(2)):
        return None
    base = name[: m.start(2)] if m.group(2) else name
    return "/" + base, "/" + name


def free_shm_bytes() -> int:
    """Bytes an unprivileged process may still allocate in ``/dev/shm``.

    A module-level function so that tests can pretend ``/dev/shm`` is small.
    """
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


class HostLock:
    """A host-wide exclusive lock: ``flock`` on the ``/dev/shm`` directory itself.

    Creating and removing a channel's shared objects, and stealing a mutex from a dead
    holder, happen under it, so a process can never open a name that another is about to
    unlink. The kernel drops an ``flock`` when its holder dies, so a crash cannot wedge
    it. Reentrant within a process (one descriptor, a thread lock and a depth count):
    taking a second ``flock`` on another descriptor of the same process would deadlock.
    """

    _lock = threading.RLock()
    _fd: int | None = None
    _fd_pid = -1
    _depth = 0

    def __enter__(self) -> HostLock:
        cls = type(self)
        cls._lock.acquire()
        try:
            if cls._depth == 0:
                if cls._fd is None or cls._fd_pid != os.getpid():
                    cls._fd = os.open(SHM_DIR, os.O_RDONLY | os.O_CLOEXEC)
                    cls._fd_pid = os.getpid()
                fcntl.flock(cls._fd, fcntl.LOCK_EX)
            cls._depth += 1
        except BaseException:
            cls._lock.release()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        cls = type(self)
        cls._depth -= 1
        if cls._depth == 0 and cls._fd is not None:
            fcntl.flock(cls._fd, fcntl.LOCK_UN)
        cls._lock.release()
