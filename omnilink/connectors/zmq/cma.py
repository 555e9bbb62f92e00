"""Cross-memory attach for the zmq backend's ``ipc://`` endpoints: one copy, not two.

A payload sent as ZMQ frames is copied twice on one host: sender memory -> kernel
socket buffer -> receiver memory, and the kernel's socket path runs at a fraction of
``memcpy`` speed (on the 2-core benchmark machine a bare Unix socket tops out near
4 GB/s while ``memcpy`` does ~10). ``process_vm_readv(2)`` lets the receiver copy the
tensor bytes straight out of the sender's address space in one pass, the same single
copy the shm backend makes. The frames still travel over ZMQ; only the bulk bytes do
not (see ``wire`` for the reference frame).

Safety protocol (the sender's tensors must never be read after its ``put`` returned
or raised, and a payload is delivered whole or not at all)::

    sender (put waiting)                     receiver loop
    ---------------------------------        ----------------------------------------
    token := nonce (16 B, own memory)
    send routing + meta + reference  ----->  read token from sender   (1)
                                             != nonce, EPERM, ESRCH:  ack RESEND_AS_FRAMES
                                             read every region        (2)
                                             short read / EFAULT:     drop (withdrawn)
                                             read token again         (3)
                                             != nonce:                drop (withdrawn)
                                             decode, index, ack OK
    ack OK: token := 0, put returns  <-----
    put gives up: token := 0, raises

(1) proves the pid names the sending process (a pid from another pid namespace, or
a recycled pid, does not hold this message's random nonce at that address) and that
the kernel lets us read it (same user, no seccomp filter in the way). (3) proves the
sender had not invalidated the token -- so had not returned from ``put`` and let the
caller touch its tensors -- before (2) finished: the copy is consistent. The sender
invalidates the token before ``put`` returns or raises, so no later read can pass (3).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import sys
import threading
import weakref
from typing import Any

import numpy as np

from omnilink.blob import FRAME_ALIGN

__all__ = ["BufferPool", "CannotReference", "Token", "Withdrawn", "address_of", "available", "read_regions"]

logger = logging.getLogger(__name__)

#: Largest iovec count one process_vm_readv call takes (IOV_MAX on Linux).
IOV_MAX = 1024
#: Messages at least this large are copied by two threads at once (a single copy
#: thread does not saturate memory bandwidth; the sender idles meanwhile, waiting).
PARALLEL_MIN_BYTES = 4 << 20


class CannotReference(Exception):
    """This process cannot read the sender's memory: it must send frames instead."""


class Withdrawn(Exception):
    """The sender gave the message up (or died) while it was being read: drop it."""


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    fn.restype = ctypes.c_ssize_t
    return fn


_process_vm_readv = _load()


def available() -> bool:
    """Whether this platform has ``process_vm_readv`` at all (Linux)."""
    return _process_vm_readv is not None


def address_of(buf: memoryview) -> int:
    """Address of the first byte of a contiguous buffer (0 for an empty one)."""
    if not buf.nbytes:
        return 0
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


class Token:
    """The sender's 16-byte proof of life for one message (see the module docstring)."""

    __slots__ = ("buf", "address", "nonce")

    def __init__(self) -> None:
        self.nonce = os.urandom(16)
        self.buf = ctypes.create_string_buffer(self.nonce, 16)
        self.address = ctypes.addressof(self.buf)

    def invalidate(self) -> None:
        ctypes.memset(self.address, 0, 16)


class BufferPool:
    """Recently released receive buffers, reused to skip the kernel's page faults.

    A fresh 16 MiB buffer costs 4096 page faults, each zeroing a page, before the copy
    can land in it: about as long as the copy itself. A buffer goes back to the pool
    when the last view of the payload decoded from it dies (``weakref.finalize`` on the
    object the views keep alive), so a consumer that drops its payloads before the next
    one arrives keeps reusing the same warm pages.

    At most ``max_buffers`` buffers and ``max_bytes`` bytes are kept; ``clear`` (on
    close) drops them.
    """

    def __init__(self, *, max_buffers: int = 4, max_bytes: int = 256 << 20) -> None:
        self.max_buffers = max_buffers
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []
        self._bytes = 0
        self.hits = 0

    def take(self, size: int) -> np.ndarray:
        """A 64-byte aligned uint8 array of exactly ``size`` bytes (a view of a pooled base)."""
        raw = None
        with self._lock:
            for i, cand in enumerate(self._free):
                # Best effort fit: big enough, and not wasting more than half of it.
                if size + FRAME_ALIGN <= cand.nbytes <= 2 * (size + FRAME_ALIGN):
                    raw = self._free.pop(i)
                    self._bytes -= raw.nbytes
                    self.hits += 1
                    break
        if raw is None:
            raw = np.empty(size + FRAME_ALIGN, dtype=np.uint8)
        start = -raw.ctypes.data % FRAME_ALIGN
        buf = raw[start : start + size]
        weakref.finalize(buf, self._give_back, raw)
        return buf

    def _give_back(self, raw: np.ndarray) -> None:
        with self._lock:
            if len(self._free) >= self.max_buffers or self._bytes + raw.nbytes > self.max_bytes:
                return
            self._free.append(raw)
            self._bytes += raw.nbytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._bytes = 0
            # Buffers still lent out are dropped when their views die.
            self.max_buffers = 0


def _readv(pid: int, pairs: list[tuple[int, int, int]]) -> None:
    """Copy each ``(local address, remote address, length)``; raise unless all arrived."""
    for start in range(0, len(pairs), IOV_MAX):
        chunk = pairs[start : start + IOV_MAX]
        local = (_Iovec * len(chunk))(*[(la, n) for la, _, n in chunk])
        remote = (_Iovec * len(chunk))(*[(ra, n) for _, ra, n in chunk])
        want = sum(n for _, _, n in chunk)
        # ctypes releases the GIL for the duration of the copy.
        got = _process_vm_readv(pid, local, len(chunk), remote, len(chunk), 0)
        if got < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        if got != want:
            raise OSError(errno.EFAULT, f"short read: {got} of {want} bytes")


def _check_token(pid: int, token_addr: int, nonce: bytes, scratch: ctypes.Array) -> bool:
    _readv(pid, [(ctypes.addressof(scratch), token_addr, 16)])
    return scratch.raw == nonce


def _split(pairs: list[tuple[int, int, int]], total: int) -> tuple[list, list]:
    """Cut ``pairs`` into two lists of about ``total / 2`` bytes each."""
    half = total // 2
    first: list[tuple[int, int, int]] = []
    second: list[tuple[int, int, int]] = []
    done = 0
    for la, ra, n in pairs:
        if done >= half:
            second.append((la, ra, n))
        elif done + n <= half:
            first.append((la, ra, n))
        else:
            cut = half - done
            first.append((la, ra, cut))
            second.append((la + cut, ra + cut, n - cut))
        done += n
    return first, second


def read_regions(
    pid: int,
    token_addr: int,
    nonce: bytes,
    regions: list[tuple[int, int]],
    pool: BufferPool | None = None,
    helper: Any = None,
) -> tuple[np.ndarray, list[memoryview]]:
    """Copy ``regions`` (sender addresses, lengths) out of process ``pid``.

    ``helper`` (a ``concurrent.futures.Executor``), when given, copies half of a
    message of at least ``PARALLEL_MIN_BYTES`` while this thread copies the other half.
    Returns one 64-byte aligned buffer (from ``pool`` when given) holding every region at a 64-aligned offset and
    a memoryview of each region inside it.

    Raises
    ------
    CannotReference
        No ``process_vm_readv``, no permission, no such process, or the token does not
        hold the nonce (not the sending process).
    Withdrawn
        The sender died or invalidated its token while the regions were read.
    MemoryError
        The buffer cannot be allocated.
    """
    if _process_vm_readv is None:
        raise CannotReference("process_vm_readv is not available on this platform")
    scratch = ctypes.create_string_buffer(16)
    try:
        ok = _check_token(pid, token_addr, nonce, scratch)
    except OSError as exc:
        raise CannotReference(f"cannot read process {pid}: {exc}") from exc
    if not ok:
        raise CannotReference(f"process {pid} does not hold this message's token (another pid namespace?)")
    offsets = []
    size = 0
    for _, n in regions:
        offsets.append(size)
        size += -(-n // FRAME_ALIGN) * FRAME_ALIGN
    if pool is not None:
        buf = pool.take(size)
    else:
        raw = np.empty(size + FRAME_ALIGN, dtype=np.uint8)
        start = -raw.ctypes.data % FRAME_ALIGN
        buf = raw[start : start + size]
    base = buf.ctypes.data
    pairs = [(base + off, addr, n) for off, (addr, n) in zip(offsets, regions) if n]
    total = sum(n for _, _, n in pairs)
    try:
        if helper is not None and total >= PARALLEL_MIN_BYTES:
            first, second = _split(pairs, total)
            claim = threading.Lock()

            def other_half() -> bool:
                # Whoever gets here first copies the second half; on a busy machine the
                # helper may not even be scheduled before this thread finished the first.
                if not claim.acquire(blocking=False):
                    return False
                _readv(pid, second)
                return True

            future = helper.submit(other_half)
            try:
                _readv(pid, first)
            finally:
                if not other_half():
                    future.result()  # the helper copies it: wait, it writes into buf
                else:
                    future.cancel()
        else:
            _readv(pid, pairs)
        ok = _check_token(pid, token_addr, nonce, scratch)
    except OSError as exc:
        raise Withdrawn(f"reading process {pid} failed mid-message: {exc}") from exc
    if not ok:
        raise Withdrawn(f"process {pid} withdrew the message while it was read")
    mv = memoryview(buf)
    return buf, [mv[off : off + n] for off, (_, n) in zip(offsets, regions)]
