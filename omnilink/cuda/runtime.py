"""The few CUDA runtime facts the copy controllers need, with errors translated.

- ``cuda_available()``: whether torch sees a CUDA device (never creates a context).
- ``HostRegistration``: page-locks an existing host mapping (a ``/dev/shm`` arena) with
  ``cudaHostRegister`` once, and unregisters it once, before its owner unmaps it.
  Registration costs milliseconds per GiB, so it is never done per message.
- ``sync_debug()``: the debug switch ``OMNILINK_CUDA_SYNC=1``, read by each controller
  once when it is created: every copy is then host-synchronous, for bisecting.
- ``record_producer_events(payload)``: in the caller's thread, one event per CUDA device
  of the payload, recorded on that device's *current* stream, so a copy stream that waits
  on it sees every write the producer queued before the call.

cudaHostRegister is called through cuda-python (``cuda.bindings.runtime``) when it is
installed (``pip install "pyomnilink[cuda]"``), else through torch's own binding of the
CUDA runtime (``torch.cuda.cudart()``), which every CUDA build of torch has.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from omnilink._errors import CudaError

__all__ = [
    "CudaOps",
    "Event",
    "HostRegistration",
    "current_raw_stream",
    "cuda_ops",
    "have_cuda_ops",
    "raw_stream",
    "resolve_device",
    "cuda_available",
    "cuda_devices_of",
    "mps_serving",
    "record_producer_events",
    "sync_debug",
]

logger = logging.getLogger(__name__)

#: cudaHostRegisterPortable: the memory counts as pinned in every CUDA context of the
#: process, so copies to and from any device run as DMA.
_REGISTER_PORTABLE = 1
#: cudaErrorHostMemoryAlreadyRegistered
_ALREADY_REGISTERED = 712

SYNC_ENV = "OMNILINK_CUDA_SYNC"


def mps_serving() -> bool:
    """Whether an MPS control daemon serves this host's CUDA processes: its pid file is
    in the MPS pipe directory (``CUDA_MPS_PIPE_DIRECTORY``, default ``/tmp/nvidia-mps``)
    while it runs (the daemon removes it when it quits; its sockets stay). No CUDA call."""
    pipes = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    return os.path.exists(os.path.join(pipes, "nvidia-cuda-mps-control.pid"))


def sync_debug() -> bool:
    """Whether ``OMNILINK_CUDA_SYNC`` asks for host-synchronous copies (read per call:
    controllers call it once, at creation)."""
    return os.environ.get(SYNC_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def cuda_available() -> bool:
    """Whether torch is importable and sees a CUDA device."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - a broken driver counts as none
        return False


def _runtime_call(name: str, *args: Any) -> int:
    """Call CUDA runtime function ``name``; return its error code (0 is success)."""
    try:
        from cuda.bindings import runtime as cudart  # type: ignore[import-not-found]
    except ImportError:
        cudart = None
    if cudart is not None:
        res = getattr(cudart, name)(*args)
        err = res[0] if isinstance(res, tuple) else res
        return int(err)
    import torch

    return int(getattr(torch.cuda.cudart(), name)(*args))


class HostRegistration:
    """Page-locks ``[address, address + nbytes)`` for DMA until ``close()``.

    Parameters
    ----------
    address : int
        Start of a host mapping this process owns (page aligned, as mmap gives).
    nbytes : int
        Its length.
    what : str
        Said in errors and logs (``"arena omnilink-1234-ab..."``).

    Raises
    ------
    CudaError
        CUDA is unavailable or ``cudaHostRegister`` failed.

    Notes
    -----
    Unregister (``close()``) before unmapping the memory: an unmapped registered range
    leaves the driver with a stale mapping. ``close`` is idempotent; a registration that
    was never closed is unregistered when it is collected (``weakref.finalize``), which
    is only safe while the mapping is still there, so owners close it explicitly.
    """

    def __init__(self, address: int, nbytes: int, *, what: str = "host memory") -> None:
        import weakref

        if not cuda_available():
            raise CudaError(f"cannot page-lock {what}: CUDA is not available in this process")
        self.address = int(address)
        self.nbytes = int(nbytes)
        self.what = what
        self._lock = threading.Lock()
        try:
            err = _runtime_call("cudaHostRegister", self.address, self.nbytes, _REGISTER_PORTABLE)
        except Exception as exc:
            raise CudaError(f"cudaHostRegister of {what} ({self.nbytes} bytes) failed: {exc}") from exc
        if err not in (0, _ALREADY_REGISTERED):
            raise CudaError(f"cudaHostRegister of {what} ({self.nbytes} bytes) failed with CUDA error {err}")
        self._owned = err == 0
        self._finalizer = weakref.finalize(self, _unregister, self.address, self.what) if self._owned else None
        logger.debug("page-locked %s: %d bytes at %#x", what, self.nbytes, self.address)

    @property
    def closed(self) -> bool:
        return self._finalizer is None or not self._finalizer.alive

    def close(self) -> None:
        """Unregister (once). Call before the memory is unmapped."""
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()

    def __enter__(self) -> HostRegistration:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _unregister(address: int, what: str) -> None:
    try:
        err = _runtime_call("cudaHostUnregister", address)
    except Exception:  # pragma: no cover - process teardown with CUDA gone
        logger.debug("cudaHostUnregister of %s raised", what, exc_info=True)
        return
    if err != 0:  # pragma: no cover - a driver reset; nothing to do but say so
        logger.warning("cudaHostUnregister of %s failed with CUDA error %d", what, err)


def resolve_device(device: Any, what: str) -> Any:
    """``device`` as a ``torch.device`` with its index (``None``: the current CUDA device,
    or the CPU without CUDA) for a controller named ``what``.

    Raises
    ------
    ConfigurationError
        Not a device string, or neither CUDA nor CPU.
    CudaError
        A CUDA device where CUDA is unavailable.
    """
    import torch

    from omnilink._errors import ConfigurationError

    try:
        dev = torch.device(device) if device is not None else None
    except (RuntimeError, TypeError) as exc:
        raise ConfigurationError(f"invalid device {device!r}: {exc}") from exc
    if dev is None:
        dev = torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")
    if dev.type == "cuda":
        if not cuda_available():
            raise CudaError(f"device {device!r} requested but CUDA is not available in this process")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ConfigurationError(f"{what} works with CUDA devices (or the CPU), not {dev}")
    return dev


def cuda_devices_of(payload: Any) -> list[Any]:
    """The distinct CUDA devices of the torch tensors in ``payload`` (dict/list/tuple tree)."""
    import torch

    devices: dict[Any, None] = {}

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.is_cuda:
                devices.setdefault(x.device, None)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(payload)
    return list(devices)


class CudaOps:
    """The CUDA runtime calls of the per-message hot path, on raw stream handles.

    torch's Python helpers for streams and devices (``current_stream``, the ``device``
    and ``stream`` context managers) cost 30-45 us a call, more than a 4 KiB copy; these
    calls go straight to cuda-python's bindings (about a microsecond each, GIL
    released while CUDA works). Events come from here too (``Event``).
    """

    def __init__(self) -> None:
        from cuda.bindings import runtime as rt  # type: ignore[import-not-found]

        self.rt = rt
        self.success = rt.cudaError_t.cudaSuccess
        self.kind_default = rt.cudaMemcpyKind.cudaMemcpyDefault
        #: device to device, said outright (no pointer look-up by the driver)
        self.kind_d2d = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self.flags = rt.cudaEventDisableTiming
        self.not_ready = rt.cudaError_t.cudaErrorNotReady
        import torch

        # torch's binding of cudaGetDevice: a plain int, no enum to build.
        self._get_device = torch._C._cuda_getDevice
        self._current_stream = torch._C._cuda_getCurrentRawStream
        self._local = threading.local()
        #: cuda-python's driver module once imported (``False``: not there)
        self._driver: Any = None

    def ordering_event(self, index: int) -> Event:
        """This thread's reusable event of device ``index``, for record-then-wait at once.

        An event may be recorded again as soon as every wait on its last recording has
        been *enqueued*; a thread that records and immediately enqueues the wait can
        reuse one event forever (events for later waits or host syncs are fresh).
        """
        cache = self._local.__dict__.setdefault("events", {})
        ev = cache.get(index)
        if ev is None:
            ev = cache[index] = Event(index)
        return ev

    def check(self, res: Any, what: str) -> Any:
        err = res[0]
        if err != self.success:
            raise CudaError(f"{what} failed: {err.name if hasattr(err, 'name') else err}")
        return res[1] if len(res) > 1 else None

    def swap_device(self, index: int) -> int:
        """Make ``index`` this thread's current device; return the one to restore (-1:
        it already was). The caller's current device is always given back
        (``restore_device``): torch reads it from CUDA on every call."""
        cur = self._get_device()
        if cur == index:
            return -1
        self.check(self.rt.cudaSetDevice(index), "cudaSetDevice")
        return cur

    def restore_device(self, prev: int) -> None:
        if prev >= 0:
            self.check(self.rt.cudaSetDevice(prev), "cudaSetDevice")

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """``cudaMemcpyAsync`` on ``stream`` (direction from the pointers: unified addressing)."""
        self.check(self.rt.cudaMemcpyAsync(dst, src, nbytes, self.kind_default, stream), "cudaMemcpyAsync")

    def memcpy_d2d(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """``cudaMemcpyAsync`` between device pointers (a peer copy across devices)."""
        self.check(self.rt.cudaMemcpyAsync(dst, src, nbytes, self.kind_d2d, stream), "cudaMemcpyAsync")

    def stream_synchronize(self, stream: int) -> None:
        """Block until the work queued so far on ``stream`` is done (the legacy default
        stream, 0, is the current device's)."""
        self.check(self.rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def wait(self, stream: int, event: Event) -> None:
        """``stream`` waits for ``event`` (a stream of the current device: the legacy
        default stream, 0, is the current device's; ``wait_current`` for another's)."""
        self.check(self.rt.cudaStreamWaitEvent(stream, event.handle, 0), "cudaStreamWaitEvent")

    def current_stream_idle(self, index: int) -> tuple[int, bool]:
        """Device ``index``'s current stream (torch's, this thread; ``index`` made current
        for the query: the legacy default stream, 0, is the current device's) and
        whether it has nothing left to run."""
        stream = int(self._current_stream(index))
        prev = self.swap_device(index)
        try:
            return stream, self.rt.cudaStreamQuery(stream)[0] == self.success
        finally:
            self.restore_device(prev)

    def allocation(self, ptr: int, index: int) -> tuple[int, int, int] | None:
        """``(base, size, buffer id)`` of the device allocation holding ``ptr`` (device
        ``index`` made current for the driver's queries), or ``None`` where the driver
        cannot say (not device memory, no driver bindings). The buffer id is unique to
        one allocation in this process: addresses freed and handed to a new allocation
        get a new id."""
        drv = self._driver
        if drv is None:
            try:
                from cuda.bindings import driver as drv  # type: ignore[import-not-found]
            except ImportError:
                self._driver = False
                return None
            self._driver = drv
            self._buffer_id = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_BUFFER_ID
            self._drv_ok = drv.CUresult.CUDA_SUCCESS
        elif drv is False:
            return None
        prev = self.swap_device(index)
        try:
            err, base, size = drv.cuMemGetAddressRange(ptr)
            if err != self._drv_ok:
                return None
            err, buffer_id = drv.cuPointerGetAttribute(self._buffer_id, ptr)
            if err != self._drv_ok:
                return None
        finally:
            self.restore_device(prev)
        return int(base), int(size), int(buffer_id)

    def wait_current(self, index: int, event: Any) -> None:
        """Device ``index``'s current stream (torch's, this thread) waits for ``event`` (an
        ``Event`` or a raw event, an interprocess one included), whichever device the
        caller has current: that stream may be the legacy default stream (handle 0), which
        CUDA takes as the current device's, so ``index`` is made current for the call (a
        receiver on cuda:0 whose thread had cuda:1 current ordered cuda:1's stream and,
        with an event opened from another process, crashed in the driver on 2x H200)."""
        handle = event.handle if isinstance(event, Event) else event
        prev = self.swap_device(index)
        try:
            stream = int(self._current_stream(index))
            self.check(self.rt.cudaStreamWaitEvent(stream, handle, 0), "cudaStreamWaitEvent")
        finally:
            self.restore_device(prev)


_ops: CudaOps | None = None
_ops_error: str | None = None
_ops_lock = threading.Lock()

#: What to run when the fast path is missing.
CUDA_INSTALL_HINT = "pip install 'pyomnilink[cuda]' (cuda-python)"


def cuda_ops() -> CudaOps:
    """The process's ``CudaOps``.

    Raises
    ------
    CudaError
        cuda-python is not installed (the message says what to install).
    """
    global _ops, _ops_error
    if _ops is None:
        with _ops_lock:
            if _ops is None and _ops_error is None:
                try:
                    _ops = CudaOps()
                except ImportError as exc:
                    _ops_error = f"cuda-python is not importable ({exc}); {CUDA_INSTALL_HINT}"
    if _ops is None:
        raise CudaError(_ops_error or "cuda-python is not importable")
    return _ops


def cuda_ops_or_none() -> CudaOps | None:
    """The process's ``CudaOps``, or ``None`` without cuda-python (the caller's torch path)."""
    try:
        return cuda_ops()
    except CudaError:
        return None


def have_cuda_ops() -> bool:
    """Whether cuda-python is importable (the GPU copy path needs it)."""
    try:
        cuda_ops()
    except CudaError:
        return False
    return True


#: Most raw event handles a device keeps for reuse (``Event``).
EVENT_POOL_MAX = 256
#: device index -> raw handles of dead ``Event`` objects, ready to be recorded again
_free_events: dict[int, list[Any]] = {}


class Event:
    """A CUDA event (timing disabled) of device ``index``.

    Handles are recycled: when the object dies its handle goes to a per-device free
    list (up to ``EVENT_POOL_MAX``, then it is destroyed) and the next ``Event`` of
    that device takes it instead of creating one (``cudaEventCreateWithFlags`` plus
    the device switch around it cost more than the record that follows, once per
    message). That is safe because every use of a handle is a ``record`` after which
    only this object's holders look at it: a wait enqueued earlier on the dead
    object's recording keeps the state it captured, and a fresh ``Event`` is always
    recorded before it is waited on or queried (a recycled handle not yet recorded
    may still report its last recording as pending).
    """

    __slots__ = ("handle", "index", "_ops")

    def __init__(self, index: int) -> None:
        ops = cuda_ops()
        self._ops = ops
        self.index = index
        free = _free_events.get(index)
        if free:
            try:
                self.handle = free.pop()  # atomic under the GIL: no two takers get one handle
                return
            except IndexError:  # another thread took the last one
                pass
        prev = ops.swap_device(index)
        try:
            self.handle = ops.check(ops.rt.cudaEventCreateWithFlags(ops.flags), "cudaEventCreateWithFlags")
        finally:
            ops.restore_device(prev)

    def record(self, stream: int) -> Event:
        """Record on ``stream`` (a raw handle of this event's device); returns ``self``."""
        ops = self._ops
        prev = ops.swap_device(self.index)
        try:
            ops.check(ops.rt.cudaEventRecord(self.handle, stream), "cudaEventRecord")
        finally:
            ops.restore_device(prev)
        return self

    def synchronize(self) -> None:
        """Block this thread (GIL released) until the event has completed."""
        self._ops.check(self._ops.rt.cudaEventSynchronize(self.handle), "cudaEventSynchronize")

    def query(self) -> bool:
        err = self._ops.rt.cudaEventQuery(self.handle)[0]
        if err == self._ops.success:
            return True
        if err == self._ops.not_ready:
            return False
        raise CudaError(f"cudaEventQuery failed: {err}")

    def __del__(self) -> None:
        try:
            handle = self.handle
        except AttributeError:  # creation failed
            return
        try:
            free = _free_events.get(self.index)
            if free is None:
                free = _free_events.setdefault(self.index, [])
            if len(free) < EVENT_POOL_MAX:
                free.append(handle)
                return
            self._ops.rt.cudaEventDestroy(handle)
        except Exception:  # pragma: no cover - interpreter teardown
            pass


def current_raw_stream(index: int) -> int:
    """The raw handle of device ``index``'s current stream in this thread (torch's notion)."""
    import torch

    return int(torch._C._cuda_getCurrentRawStream(index))


def raw_stream(stream: Any) -> int:
    """The raw handle of a ``torch.cuda.Stream`` (or an int handle, returned as is)."""
    return stream if isinstance(stream, int) else int(stream.cuda_stream)


def record_producer_events(devices: list[Any]) -> list[tuple[Any, Event]]:
    """``[(device, event)]``: an event recorded now on each device's current stream.

    Called in the producer's thread: a copy stream that waits on these events runs after
    every kernel the producer queued before the call, whichever thread issues the copy.

    Raises
    ------
    CudaError
        cuda-python is missing, or a CUDA call failed.
    """
    out = []
    for dev in devices:
        idx = dev.index
        out.append((dev, Event(idx).record(current_raw_stream(idx))))
    return out
