"""Small internal helpers shared by the backends: deadlines and name validation."""

from __future__ import annotations

import math
import os
import re
import threading
import time
from typing import Any
from collections import OrderedDict

from omnilink._errors import ConfigurationError, DuplicateKeyError, KeyConsumedError, TransferTimeout

__all__ = [
    "CONSUMED_KEYS_REMEMBERED",
    "ConsumedKeys",
    "Deadline",
    "MAX_CHANNEL_CHARS",
    "MAX_KEY_BYTES",
    "NO_WAIT",
    "PeerWatch",
    "duplicate_key",
    "pid_alive",
    "plain_tensor",
    "validate_channel",
    "validate_key",
]

#: Keys are never truncated; a longer one is refused instead (serving engines that cut
#: ids to 25 characters and keys to 56 bytes delivered one request's chunks to another).
MAX_KEY_BYTES = 512
MAX_CHANNEL_CHARS = 128
_CHANNEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*(/[A-Za-z0-9][A-Za-z0-9._\-]*)*")


class Deadline:
    """A point in monotonic time; ``Deadline(None)`` never expires.

    Parameters
    ----------
    timeout : float or None
        Seconds from now; ``None`` waits forever. Negative or NaN is a
        ``ConfigurationError``.
    """

    __slots__ = ("timeout", "_end")

    def __init__(self, timeout: float | None) -> None:
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise ConfigurationError(f"timeout must be a number of seconds or None, got {timeout!r}")
            if math.isnan(timeout) or timeout < 0:
                raise ConfigurationError(f"timeout must be >= 0, got {timeout!r}")
        self.timeout = timeout
        self._end = None if timeout is None else time.monotonic() + timeout

    @classmethod
    def after(cls, timeout: float | None) -> Deadline:
        """``Deadline(timeout)`` for a ``timeout`` validated before (a connector's own
        option): the per-call hot path skips the checks. ``None`` gives the one shared
        deadline that never expires (a deadline is immutable, so sharing is safe)."""
        if timeout is None:
            return _FOREVER
        d = object.__new__(cls)
        d.timeout = timeout
        d._end = time.monotonic() + timeout
        return d

    def remaining(self) -> float | None:
        """Seconds left (never negative), or ``None`` for no deadline."""
        if self._end is None:
            return None
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        return self._end is not None and time.monotonic() >= self._end

    def slice(self, at_most: float) -> float:
        """Seconds to wait in one step: the remaining time capped at ``at_most``."""
        left = self.remaining()
        return at_most if left is None else min(left, at_most)


_FOREVER = Deadline(None)
#: The deadline of a call that must not wait (``get_nowait``): already expired, shared.
NO_WAIT = Deadline(0.0)


def validate_key(key: object) -> str:
    """Return ``key`` if it is a usable payload key, else raise ``ConfigurationError``.

    A key is a non-empty ``str`` of at most ``MAX_KEY_BYTES`` UTF-8 bytes without NUL.
    Any other character, ``/`` included, is allowed: keys never become file names.
    """
    if not isinstance(key, str):
        raise ConfigurationError(f"key must be a str, got {type(key).__name__}: {key!r}")
    if not key:
        raise ConfigurationError("key must not be empty")
    if "\x00" in key:
        raise ConfigurationError(f"key must not contain NUL: {key!r}")
    try:
        n = len(key.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ConfigurationError(f"key is not encodable as UTF-8: {key!r}") from exc
    if n > MAX_KEY_BYTES:
        raise ConfigurationError(
            f"key is {n} bytes, longer than the {MAX_KEY_BYTES}-byte limit "
            "(keys are never truncated)"
        )
    return key


def validate_channel(channel: object) -> str:
    """Return ``channel`` if it is a valid channel name, else raise ``ConfigurationError``.

    A channel is 1 to ``MAX_CHANNEL_CHARS`` characters of ``[A-Za-z0-9._-]`` in
    ``/``-separated parts, each starting with a letter or digit (``job1/thinker-talker``).
    """
    if not isinstance(channel, str):
        raise ConfigurationError(f"channel must be a str, got {type(channel).__name__}: {channel!r}")
    if not channel or len(channel) > MAX_CHANNEL_CHARS or not _CHANNEL_RE.fullmatch(channel):
        raise ConfigurationError(
            f"invalid channel name {channel!r}: use 1-{MAX_CHANNEL_CHARS} characters of "
            "[A-Za-z0-9._-] in '/'-separated parts, each starting with a letter or digit"
        )
    return channel


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie.

    A SIGKILLed child stays a zombie until its parent reaps it; it will never release
    anything, so it counts as dead here.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    end = data.rfind(b")")
    state = data[end + 2 : end + 3]
    return state not in (b"Z", b"X")


#: How many consumed keys a receiver remembers (see ``ConsumedKeys``).
CONSUMED_KEYS_REMEMBERED = 1 << 16


class ConsumedKeys:
    """A bounded memory of the keys a receiver consumed or discarded, oldest forgotten
    first, so that a ``get`` of one raises ``KeyConsumedError`` instead of waiting out
    its timeout. A key put again is forgotten (it can be received again). (The nixl
    sender keeps one of the keys it put, the same bounded memory.) Not thread-safe:
    callers hold their lock."""

    __slots__ = ("_keys", "_limit")

    def __init__(self, limit: int = CONSUMED_KEYS_REMEMBERED) -> None:
        self._keys: OrderedDict[str, str] = OrderedDict()
        self._limit = limit

    def add(self, key: str, how: str = "consumed") -> None:
        keys = self._keys
        if key in keys:
            keys.move_to_end(key)
        keys[key] = how
        if len(keys) > self._limit:
            keys.popitem(last=False)

    def forget(self, key: str) -> None:
        self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def error(self, backend: str, channel: str, key: str, *, by: str = "this receiver") -> KeyConsumedError:
        """The ``KeyConsumedError`` for ``key`` (which must be remembered)."""
        how = self._keys.get(key, "consumed")
        return KeyConsumedError(
            f"{backend}: key {key!r} on channel {channel!r} was already {how} by {by}; "
            "each key is delivered once (put it again to send another payload under it)",
            channel=channel,
            key=key,
        )


def plain_tensor(t: Any) -> Any:
    """``t`` as the bytes a transport copies: its conjugate and negative bits resolved,
    contiguous, detached when it had to be copied; ``t`` itself when it already is (two
    questions to the tensor, each a microsecond or more on a GPU host; one that requires
    grad is read as it is: every caller only reads its memory)."""
    if t.is_contiguous() and not t.is_neg() and not (t.dtype.is_complex and t.is_conj()):
        return t
    if t.requires_grad:
        t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


#: A waiting ``get``'s spin adapts (``next_spin``) up to this many times ``spin_us``.
SPIN_GROWTH = 10


def next_spin(typical_ns: int, waited_ns: int, lo_ns: int, hi_ns: int) -> tuple[int, int]:
    """Fold one wait (``waited_ns`` until the payload came) into the typical wait
    (``typical_ns``, a moving average); return ``(typical, next spin)``: twice the
    typical wait, within ``[lo_ns, hi_ns]`` (a typical wait between half the ceiling and
    the ceiling spins up to the ceiling: a large payload that comes every millisecond
    is met by the spin, not by a wake-up), or ``lo_ns`` (``spin_us``) alone when
    payloads typically come later than ``hi_ns`` (a longer spin would only burn CPU)."""
    typical = (3 * typical_ns + min(waited_ns, 4 * hi_ns)) >> 2
    if typical > hi_ns:
        return typical, lo_ns
    return typical, max(lo_ns, min(2 * typical, hi_ns))


def duplicate_key(backend: str, channel: str, key: str) -> DuplicateKeyError:
    """The one ``DuplicateKeyError`` every backend raises for a second put of a pending key."""
    return DuplicateKeyError(
        f"{backend}: key {key!r} is still pending on channel {channel!r} (put and not yet "
        "consumed or discarded); a key can be put again only after it was consumed or discarded",
        channel=channel,
        key=key,
    )


def timed_out(backend: str, channel: str, op: str, key: str | None, peer: str | None,
              waited: float | None) -> TransferTimeout:
    """The one ``TransferTimeout`` of an operation (``op``, on ``key`` if any) that waited
    ``waited`` seconds for ``peer`` (every backend's wording)."""
    what = f"{op} of key {key!r}" if key is not None else op
    return TransferTimeout(
        f"{backend}: {what} on channel {channel!r} timed out after "
        f"{waited if waited is not None else '?'} s waiting for {peer or 'the peer'}",
        channel=channel,
        key=key,
        peer=peer,
    )


class PeerWatch:
    """``pid_alive`` for a per-message path: one ``poll`` of a pidfd per look-up.

    ``pid_alive`` costs a signal and a read of ``/proc`` (four system calls, 29 us on a
    2-core VM, 36 us on a GPU cloud VM: a tenth of a small device message's time, paid on
    both ends). A pidfd (``os.pidfd_open``, Linux 5.3+) opened at the first look-up at a
    pid polls readable once that process has exited, zombie or reaped, and it names that
    process and no later one that reuses the pid. Where pidfds are unavailable the
    look-up is ``pid_alive``. A dead answer drops the pid's pidfd, so a later peer that
    reuses the number is looked up afresh (as ``pid_alive`` would).
    """

    __slots__ = ("_probes", "_lock")

    def __init__(self) -> None:
        #: pid -> a poll object of its pidfd, or None (no pidfd here: pid_alive)
        self._probes: dict[int, tuple[Any, int] | None] = {}
        # A poll object refuses a second thread's poll() while one runs ("concurrent
        # poll() invocation"), and a pidfd must not be closed under a poll: one lock.
        self._lock = threading.Lock()

    def alive(self, pid: int) -> bool:
        with self._lock:
            probe = self._probes.get(pid, False)
            if probe is False:
                try:
                    probe = _pidfd_probe(pid)
                except ProcessLookupError:
                    return False
                self._probes[pid] = probe
            if probe is not None:
                if not probe[0].poll(0):
                    return True
                self._forget(pid)
                return False
        return pid_alive(pid)

    def _forget(self, pid: int) -> None:
        probe = self._probes.pop(pid, None)
        if probe:
            os.close(probe[1])

    def close(self) -> None:
        """Close every pidfd (idempotent)."""
        with self._lock:
            for pid in list(self._probes):
                self._forget(pid)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter teardown
            pass


def _pidfd_probe(pid: int) -> tuple[Any, int] | None:
    """``(poll object, pidfd)`` of ``pid``; ``None`` where pidfds are unavailable.

    Raises
    ------
    ProcessLookupError
        No process ``pid`` (any more).
    """
    import select

    if pid <= 0:
        raise ProcessLookupError(pid)
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except (AttributeError, OSError):  # no pidfd_open (old kernel, sandbox, non-Linux)
        return None
    p = select.poll()
    p.register(fd, select.POLLIN)
    return p, fd
