"""NCCL point-to-point through the library's C API (``ctypes``), without a process group.

``torch.distributed``'s NCCL process group wraps every send and receive in a work
object, events and its own stream; from Python that costs about 30 us per operation on
a 2x H200 host (a 1 MiB send/recv stream: 43 us per message through the process group,
13 us through the C API, the link's own time). The nccl connector's bulk path calls
NCCL directly, as vLLM's ``pynccl`` does:

- ``NcclLibrary``: the NCCL shared library, found where CUDA builds of torch put it (the
  one already loaded in this process, else ``nvidia/nccl/lib`` of the Python path, else
  the loader's search path), or at ``OMNILINK_NCCL_LIBRARY``; ``unique_id()`` and
  ``init_rank()``;
- ``NcclComm``: one communicator (two ranks); ``send`` / ``recv`` of raw device
  addresses on a raw stream handle, ``group()`` around several, ``abort()`` (pending
  operations end: how a link to a dead peer is broken) and ``destroy()``.

Every call checks NCCL's result and raises ``TransportError`` with NCCL's own words
(``ncclGetErrorString`` and, where the library has it, ``ncclGetLastError``).
Nothing here imports torch or initialises CUDA; the caller makes the communicator's
device current before ``init_rank`` (NCCL binds a communicator to the current device).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from typing import Any

from omnilink._errors import CudaError, TransportError

__all__ = ["NCCL_LIBRARY_ENV", "NcclComm", "NcclLibrary", "nccl_library"]

#: A path to ``libnccl.so.2`` that overrides the search.
NCCL_LIBRARY_ENV = "OMNILINK_NCCL_LIBRARY"

#: ncclResult_t values NCCL documents (the rest are named by ``ncclGetErrorString``).
_SUCCESS = 0
_IN_PROGRESS = 7
#: ncclDataType_t: ncclInt8; bytes are bytes.
_INT8 = 0
#: sizeof(ncclUniqueId)
UNIQUE_ID_BYTES = 128

_HINT = (
    "the nccl connector calls NCCL's library directly: use a CUDA build of torch (it brings "
    f"libnccl.so.2 with the nvidia-nccl wheel) or set {NCCL_LIBRARY_ENV} to the library's path"
)


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


def _candidates() -> list[str]:
    """Where to look for libnccl, best first: the override, the copy this process has
    loaded already (torch's), the nvidia-nccl wheel on the Python path, the loader."""
    out = []
    env = os.environ.get(NCCL_LIBRARY_ENV, "").strip()
    if env:
        return [env]
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "libnccl" in line else ""
                if path.startswith("/") and os.path.basename(path).startswith("libnccl.so") and path not in out:
                    out.append(path)
    except OSError:
        pass
    for base in sys.path:
        for path in sorted(glob.glob(os.path.join(base or ".", "nvidia", "nccl", "lib", "libnccl.so*"))):
            if path not in out:
                out.append(path)
    out.append("libnccl.so.2")
    return out


class NcclLibrary:
    """The NCCL shared library, its p2p entry points typed once.

    Raises
    ------
    CudaError
        No NCCL library could be loaded (the message says where it looked and what to
        install), or it lacks the point-to-point API (NCCL older than 2.7).
    """

    def __init__(self, path: str | None = None) -> None:
        tried: list[str] = []
        lib = None
        for cand in [path] if path else _candidates():
            try:
                lib = ctypes.CDLL(cand)
            except OSError as exc:
                tried.append(f"{cand} ({exc})")
                continue
            self.path = cand
            break
        if lib is None:
            raise CudaError(f"no NCCL library could be loaded (tried {'; '.join(tried)}): {_HINT}")
        try:
            self._send = lib.ncclSend
            self._recv = lib.ncclRecv
            self._group_start = lib.ncclGroupStart
            self._group_end = lib.ncclGroupEnd
            self._init = lib.ncclCommInitRank
            self._abort = lib.ncclCommAbort
            self._destroy = lib.ncclCommDestroy
            self._async_error = lib.ncclCommGetAsyncError
            self._error_string = lib.ncclGetErrorString
            self._unique_id = lib.ncclGetUniqueId
        except AttributeError as exc:
            raise CudaError(f"{self.path} lacks NCCL's point-to-point API ({exc}): NCCL 2.7 or later is needed") from exc
        self._last_error = getattr(lib, "ncclGetLastError", None)
        vp, cvp, sz, i = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        for fn in (self._send, self._recv):
            fn.argtypes = [cvp, sz, i, i, vp, vp]
            fn.restype = i
        self._group_start.argtypes = self._group_end.argtypes = []
        self._group_start.restype = self._group_end.restype = i
        self._init.argtypes = [ctypes.POINTER(vp), i, _UniqueId, i]
        self._init.restype = i
        for fn in (self._abort, self._destroy):
            fn.argtypes = [vp]
            fn.restype = i
        self._async_error.argtypes = [vp, ctypes.POINTER(i)]
        self._async_error.restype = i
        self._error_string.argtypes = [i]
        self._error_string.restype = ctypes.c_char_p
        self._unique_id.argtypes = [ctypes.POINTER(_UniqueId)]
        self._unique_id.restype = i
        if self._last_error is not None:
            self._last_error.argtypes = [vp]
            self._last_error.restype = ctypes.c_char_p
        version = ctypes.c_int()
        get_version = getattr(lib, "ncclGetVersion", None)
        self.version = 0
        if get_version is not None and get_version(ctypes.byref(version)) == _SUCCESS:
            self.version = int(version.value)
        self._lib = lib

    def version_string(self) -> str:
        """``major.minor.patch`` (NCCL 2.9 and later encode the version as
        ``major*10000 + minor*100 + patch``)."""
        v = self.version
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v else "unknown"

    def describe(self, code: int, comm: Any = None) -> str:
        """NCCL's words for a result code (and the communicator's last error)."""
        words = self._error_string(code)
        what = words.decode(errors="replace") if words else f"result {code}"
        if self._last_error is not None:
            last = self._last_error(comm)
            if last:
                what += f": {last.decode(errors='replace')}"
        return f"{what} (NCCL {self.version_string()}, result {code})"

    def check(self, code: int, what: str, comm: Any = None) -> None:
        if code != _SUCCESS:
            raise TransportError(f"NCCL {what} failed: {self.describe(code, comm)}")

    def unique_id(self) -> bytes:
        """A fresh ``ncclUniqueId`` (the bootstrap address rank 0 of a communicator
        hands to the other ranks)."""
        uid = _UniqueId()
        self.check(self._unique_id(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(bytearray(uid.internal))

    def init_rank(self, uid: bytes, nranks: int, rank: int) -> NcclComm:
        """Join the communicator of ``uid`` as ``rank`` of ``nranks`` on the calling
        thread's current CUDA device; blocks until every rank has joined.

        Raises
        ------
        TransportError
            NCCL could not build the communicator (NCCL's reason in the message).
        """
        if len(uid) != UNIQUE_ID_BYTES:
            raise TransportError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        u = _UniqueId()
        ctypes.memmove(ctypes.byref(u), uid, UNIQUE_ID_BYTES)
        handle = ctypes.c_void_p()
        self.check(self._init(ctypes.byref(handle), nranks, u, rank), "ncclCommInitRank")
        return NcclComm(self, handle)


class NcclComm:
    """One NCCL communicator. ``send`` / ``recv`` enqueue on a raw stream handle and
    return at once (the operation runs when the peer's matching one is posted); several
    inside ``group_start()`` ... ``group_end()`` are launched together. One thread at a
    time may enqueue on a communicator (NCCL's rule); ``abort`` may come from any thread.
    """

    __slots__ = ("_lib", "_handle", "_send", "_recv", "_gone", "_lock")

    def __init__(self, lib: NcclLibrary, handle: ctypes.c_void_p) -> None:
        self._lib = lib
        self._handle = handle
        self._send = lib._send
        self._recv = lib._recv
        self._gone = False
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return not self._gone

    def send(self, ptr: int, nbytes: int, peer: int, stream: int) -> None:
        """Enqueue a send of ``nbytes`` at device address ``ptr`` to ``peer`` on ``stream``."""
        with self._lock:
            if self._gone:
                raise TransportError("NCCL send on a communicator that was aborted or destroyed")
            code = self._send(ptr, nbytes, _INT8, peer, self._handle, stream)
        if code != _SUCCESS:
            self._lib.check(code, "ncclSend", self._handle)

    def recv(self, ptr: int, nbytes: int, peer: int, stream: int) -> None:
        """Enqueue a receive of ``nbytes`` into device address ``ptr`` from ``peer``."""
        with self._lock:
            if self._gone:
                raise TransportError("NCCL receive on a communicator that was aborted or destroyed")
            code = self._recv(ptr, nbytes, _INT8, peer, self._handle, stream)
        if code != _SUCCESS:
            self._lib.check(code, "ncclRecv", self._handle)

    def group_start(self) -> None:
        self._lib.check(self._lib._group_start(), "ncclGroupStart")

    def group_end(self) -> None:
        """Launch the operations enqueued since ``group_start``."""
        with self._lock:
            if self._gone:
                # Still end the group NCCL holds open for this thread, then say why.
                self._lib._group_end()
                raise TransportError("NCCL group on a communicator that was aborted or destroyed")
            code = self._lib._group_end()
        if code != _SUCCESS:
            self._lib.check(code, "ncclGroupEnd", self._handle)

    def async_error(self) -> str | None:
        """The communicator's asynchronous error in NCCL's words, or ``None``."""
        if self._gone:
            return None
        err = ctypes.c_int()
        code = self._lib._async_error(self._handle, ctypes.byref(err))
        if code != _SUCCESS:
            return self._lib.describe(code, self._handle)
        if err.value not in (_SUCCESS, _IN_PROGRESS):
            return self._lib.describe(err.value, self._handle)
        return None

    def abort(self) -> None:
        """End every operation pending on the communicator (their kernels exit) and free
        it; idempotent, from any thread. An enqueue still blocked in NCCL after a second
        (its peer is gone) does not hold the abort back: the abort is what ends it."""
        locked = self._lock.acquire(timeout=1.0)
        try:
            if self._gone:
                return
            self._gone = True
        finally:
            if locked:
                self._lock.release()
        self._lib._abort(self._handle)

    def destroy(self) -> None:
        """Free the communicator once its operations are done; idempotent."""
        with self._lock:
            if self._gone:
                return
            self._gone = True
        self._lib._destroy(self._handle)


_library: NcclLibrary | None = None
_library_error: str | None = None
_library_lock = threading.Lock()


def nccl_library() -> NcclLibrary:
    """The process's ``NcclLibrary``, loaded once (a failure is remembered).

    Raises
    ------
    CudaError
        No usable NCCL library (the message says where it looked and what to install).
    """
    global _library, _library_error
    if _library is None:
        with _library_lock:
            if _library is None and _library_error is None:
                try:
                    _library = NcclLibrary()
                except CudaError as exc:
                    _library_error = str(exc)
    if _library is None:
        raise CudaError(_library_error or f"no NCCL library could be loaded: {_HINT}")
    return _library
