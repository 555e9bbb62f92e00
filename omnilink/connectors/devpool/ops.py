"""``CudaDeviceOps``: every CUDA call of the device pool, in one small object.

The pool's ends (and the ``cuda_ipc`` connector and shm device-IPC route over them) never
call CUDA themselves; they call these methods, so the whole control plane (allocation,
frees, event slots, manifests, the key contract) runs unchanged over a host-memory test
double in the test suite. Calls go through cuda-python
(``cuda.bindings.runtime``) via ``omnilink.cuda.cuda_ops()``; handles cross processes as
their 64 raw bytes.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any, Callable

from omnilink._errors import CudaError
from omnilink.cuda import (
    CUDA_INSTALL_HINT,
    Completer,
    Event,
    cuda_available,
    cuda_devices_of,
    cuda_ops,
    current_raw_stream,
    mps_serving,
    record_producer_events,
)

__all__ = ["CudaDeviceOps", "cuda_ipc_unavailable"]

logger = logging.getLogger(__name__)

#: cudaErrorPeerAccessAlreadyEnabled: enabling twice is not an error for us.
_PEER_ALREADY_ENABLED = 704


def cuda_ipc_unavailable() -> str | None:
    """Why this process cannot use the ``cuda_ipc`` backend, or ``None`` if it can."""
    if not cuda_available():
        return "CUDA is not available in this process (torch.cuda.is_available() is False)"
    try:
        cuda_ops()
    except CudaError as exc:
        return f"{exc} (the cuda_ipc backend calls the CUDA IPC API through cuda-python; {CUDA_INSTALL_HINT})"
    return None


def _handle_bytes(handle: Any) -> bytes:
    raw = handle.reserved
    if isinstance(raw, (bytes, bytearray)):
        return bytes(raw)
    return bytes((int(x) & 0xFF) for x in raw)


class _Lease:
    """Exposes one pool block as a CUDA array (``__cuda_array_interface__`` v3, bytes)."""

    __slots__ = ("ptr", "nbytes", "__weakref__")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"version": 3, "typestr": "|u1", "shape": (self.nbytes,), "data": (self.ptr, False),
                "strides": None, "stream": None}


class CudaDeviceOps:
    """The real device operations (see the module docstring).

    Raises
    ------
    CudaError
        CUDA or cuda-python is missing (the message says which and what to install).
    """

    #: what ``stats()`` and logs call this path
    name = "cuda"

    def __init__(self) -> None:
        reason = cuda_ipc_unavailable()
        if reason is not None:
            raise CudaError(f"cuda_ipc: {reason}")
        import torch

        self._torch = torch
        self._ops = cuda_ops()
        self.rt = self._ops.rt
        self._streams: dict[int, Any] = {}
        self._peers: set[tuple[int, int]] = set()
        self._devices: dict[int, Any] = {}

    # ----------------------------------------------------------------- helpers
    def _check(self, res: Any, what: str) -> Any:
        return self._ops.check(res if isinstance(res, tuple) else (res,), what)

    def _on(self, index: int) -> int:
        return self._ops.swap_device(index)

    def _completer_get(self) -> Completer:
        return _completer()

    def is_device_tensor(self, t: Any) -> bool:
        return bool(t.is_cuda)

    @staticmethod
    def tensor_device(t: Any) -> int:
        """The CUDA device index of tensor ``t`` (-1: a host tensor)."""
        return int(t.get_device())

    def is_small_host_tensor(self, t: Any, most: int) -> bool:
        """A strided CPU tensor of at most ``most`` bytes (``send``'s ``host_to_pool``)."""
        return bool(t.is_cpu) and t.layout is self._torch.strided and t.nbytes <= most

    @staticmethod
    def plan_checks() -> tuple[str, str]:
        """A send plan's tests (``devpool.plan``), Python expressions of a tensor ``{v}``:
        true when it is not a CUDA tensor of device ``{device}``; true when it is not a
        strided CPU tensor (``is_small_host_tensor`` without the size: a plan fixes it)."""
        return "not {v}.is_cuda or {v}.get_device() != {device}", "not {v}.is_cpu or {v}.layout is not _S"

    @staticmethod
    def to_host(t: Any) -> Any:
        """A host copy of the pool view ``t`` (after the current stream's work: a
        synchronous copy on it)."""
        return t.cpu()

    @staticmethod
    def mps_serving() -> bool:
        """Whether an MPS server serves this host's CUDA processes (no CUDA call)."""
        return mps_serving()

    def new_stage(self, nbytes: int) -> Any:
        """A page-locked host buffer of ``nbytes`` for host tensors copied into the pool."""
        return self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)

    @staticmethod
    def stage_slice(arena: Any, offset: int, nbytes: int) -> Any:
        """The stage of ``nbytes`` at ``offset`` of the page-locked ``arena`` (a view)."""
        return arena.narrow(0, offset, nbytes)

    @staticmethod
    def stage_bytes(stage: Any) -> int:
        return int(stage.numel())

    def device_index(self, device: Any) -> int:
        """The CUDA device index of ``device`` (``None``: the current device)."""
        torch = self._torch
        try:
            dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        except (RuntimeError, TypeError) as exc:
            from omnilink._errors import ConfigurationError

            raise ConfigurationError(f"cuda_ipc: invalid device {device!r}: {exc}") from exc
        if dev.type != "cuda":
            raise CudaError(f"cuda_ipc: the pool lives on a CUDA device, not {dev}")
        if dev.index is None:
            return torch.cuda.current_device()
        if not 0 <= dev.index < torch.cuda.device_count():
            raise CudaError(f"cuda_ipc: no device {dev} (this process sees {torch.cuda.device_count()})")
        return dev.index

    def device_uuid(self, index: int) -> bytes:
        try:
            u = self._torch.cuda.get_device_properties(index).uuid
            return bytes.fromhex(str(u).replace("-", "").removeprefix("GPU"))[:16]
        except Exception:  # pragma: no cover - an old torch without uuid
            return b""

    def index_of_uuid(self, uuid: bytes, fallback: int) -> int:
        if uuid.strip(b"\0"):
            for i in range(self._torch.cuda.device_count()):
                if self.device_uuid(i) == uuid:
                    return i
            raise CudaError("cuda_ipc: the receiver's pool device is not visible to this process "
                            "(check CUDA_VISIBLE_DEVICES)")
        return fallback

    # ------------------------------------------------------------ pool memory
    def alloc_pool(self, index: int, nbytes: int) -> tuple[int, bytes]:
        """Receiver: ``cudaMalloc`` the pool on device ``index``; (pointer, IPC handle)."""
        prev = self._on(index)
        try:
            ptr = int(self._check(self.rt.cudaMalloc(nbytes), f"cudaMalloc of the {nbytes}-byte pool"))
            try:
                handle = self._check(self.rt.cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")
            except BaseException:
                self.rt.cudaFree(ptr)
                raise
        finally:
            self._ops.restore_device(prev)
        return ptr, _handle_bytes(handle)

    def free_pool(self, index: int, ptr: int) -> None:
        prev = self._on(index)
        try:
            self._check(self.rt.cudaFree(ptr), "cudaFree of the pool")
        finally:
            self._ops.restore_device(prev)

    def free_bytes(self, index: int) -> int:
        """Receiver: bytes of device ``index`` free now (``cudaMemGetInfo``); what the
        default bound of the pool's growth derives from."""
        prev = self._on(index)
        try:
            err, free, _total = self.rt.cudaMemGetInfo()
            self._check((err,), "cudaMemGetInfo")
            return int(free)
        finally:
            self._ops.restore_device(prev)

    def open_pool(self, index: int, handle: bytes) -> int:
        """Sender: map the receiver's pool once (peer access enabled lazily by CUDA)."""
        h = self.rt.cudaIpcMemHandle_t()
        h.reserved = handle
        prev = self._on(index)
        try:
            return int(self._check(self.rt.cudaIpcOpenMemHandle(h, self.rt.cudaIpcMemLazyEnablePeerAccess),
                                   "cudaIpcOpenMemHandle"))
        finally:
            self._ops.restore_device(prev)

    def close_pool(self, index: int, ptr: int) -> None:
        prev = self._on(index)
        try:
            self._check(self.rt.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")
        finally:
            self._ops.restore_device(prev)

    # ----------------------------------------------------------------- events
    def create_events(self, index: int, n: int) -> list[tuple[Any, bytes]]:
        """Sender: ``n`` interprocess events on the pool's device, with their handles."""
        rt = self.rt
        out = []
        prev = self._on(index)
        try:
            for _ in range(n):
                ev = self._check(rt.cudaEventCreateWithFlags(rt.cudaEventInterprocess | rt.cudaEventDisableTiming),
                                 "cudaEventCreateWithFlags(interprocess)")
                out.append((ev, _handle_bytes(self._check(rt.cudaIpcGetEventHandle(ev), "cudaIpcGetEventHandle"))))
        finally:
            self._ops.restore_device(prev)
        return out

    def open_events(self, index: int, handles: list[bytes]) -> list[Any]:
        """Receiver: open a sender's event handles once."""
        out = []
        prev = self._on(index)
        try:
            for raw in handles:
                h = self.rt.cudaIpcEventHandle_t()
                h.reserved = raw
                out.append(self._check(self.rt.cudaIpcOpenEventHandle(h), "cudaIpcOpenEventHandle"))
        finally:
            self._ops.restore_device(prev)
        return out

    def destroy_events(self, index: int, events: list[Any]) -> None:
        for ev in events:
            try:
                self.rt.cudaEventDestroy(ev)
            except Exception:  # pragma: no cover - teardown
                logger.debug("cudaEventDestroy failed", exc_info=True)

    # ------------------------------------------------------------------ copies
    def _copy_stream(self, index: int) -> int:
        """This process's copy stream on device ``index``, made once by cuda-python (a
        non-blocking stream torch does not know: on 2x H200 without an MPS server, a
        cross-GPU payload's copies and record on a torch stream of the pool's GPU ran
        a few hundred microseconds after they were queued)."""
        s = self._streams.get(index)
        if s is None:
            rt = self.rt
            prev = self._on(index)
            try:
                s = self._streams[index] = int(self._check(
                    rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags"))
            finally:
                self._ops.restore_device(prev)
        return s

    def _enable_peer(self, a: int, b: int) -> None:
        """Peer access both ways between ``a`` and ``b`` (imported memory reaches another
        GPU at peer speed only when this process enabled it)."""
        for src, dst in ((a, b), (b, a)):
            if (src, dst) in self._peers:
                continue
            can = self._check(self.rt.cudaDeviceCanAccessPeer(src, dst), "cudaDeviceCanAccessPeer")
            if can:
                prev = self._on(src)
                try:
                    err = self.rt.cudaDeviceEnablePeerAccess(dst, 0)[0]
                finally:
                    self._ops.restore_device(prev)
                if int(getattr(err, "value", err)) not in (0, _PEER_ALREADY_ENABLED):
                    raise CudaError(f"cudaDeviceEnablePeerAccess({src} -> {dst}) failed: {err}")
            else:
                logger.warning("cuda_ipc: cuda:%d cannot access cuda:%d as a peer; copies between them "
                               "go through the host", src, dst)
            self._peers.add((src, dst))

    def producer_events(self, payload: Any) -> Any:
        """For ``put_async``, in the caller's thread: events recorded now on the current
        stream of each CUDA device of ``payload`` (the copy, issued later on the put
        thread, waits on them); ``None`` when the payload holds no CUDA tensor."""
        devices = cuda_devices_of(payload)
        return record_producer_events(devices) if devices else None

    def copy_in(self, index: int, items: list[tuple[int, Any]], event: Any, after: Any = None, *,
                hosted: Any = None) -> None:
        """Copy each ``(dst pointer, contiguous tensor)`` into the pool after everything
        the caller queued on the tensors' current streams (or after the
        ``producer_events`` in ``after``) and record ``event`` (the slot's interprocess
        event) after the copies; this thread's current streams are ordered after them
        (the caller may overwrite its tensors at once). Tensors on the pool's device
        (and no ``after``): on the caller's current stream itself. All on one other
        device (and no ``after``): on that device's current stream, the slot's event on
        the pool device's copy stream after it (``_copy_from_peer``). Otherwise on the
        copy stream of device ``index`` (an interprocess event must be recorded on a
        stream of the device that owns the memory), the tensors kept alive until the
        copies are done. The host does not block.

        ``hosted``: ``(dst pointer, [(offset, contiguous host tensor)], span, stage)``:
        host tensors for the pool too, at ``dst + offset``; their bytes are gathered in
        ``stage`` (page-locked, at least ``span`` bytes; reused by the caller with the
        same ``event``, so the copy out of it that ``event`` follows is waited for
        first: long done in practice) and copied with one ``cudaMemcpyAsync`` on the
        same stream before ``event`` is recorded."""
        ops = self._ops
        if hosted is not None:
            self._stage(hosted, event)
        devices = sorted({t.get_device() for _, t in items})  # (no torch.device object per tensor)
        if after is None and devices == [index]:
            # The tensors live on the pool's device: copy on the caller's current stream
            # (the one that produced them, so no ordering event is needed, and torch's
            # caching allocator keeps their memory for that stream's later work) and
            # record the slot's event there: one cudaMemcpyAsync per tensor and one
            # cudaEventRecord, the hardware's floor, nothing kept alive on the host.
            self._copy_and_record(index, items, event, current_raw_stream(index), hosted)
            return
        if after is None and len(devices) == 1:
            self._copy_from_peer(index, devices[0], items, event, hosted)
            return
        completer = self._completer_get()
        completer.reap()  # frees and releases whose copies are done: here, no hand-off
        stream = self._copy_stream(index)
        for d in devices:
            if d != index and (index, d) not in self._peers:
                self._enable_peer(index, d)
        if after is not None:
            for _, ev in after:
                ops.wait(stream, ev)
        else:
            for d in devices:
                ops.wait(stream, ops.ordering_event(d).record(current_raw_stream(d)))
        self._copy_and_record(index, items, event, stream, hosted)
        done = Event(index).record(stream)
        for d in devices:
            ops.wait_current(d, done)
        keep: list[Any] = [t for _, t in items]
        if after is not None:
            keep.append(after)  # the producer events live until the copy is done
        completer.submit(done, keep.clear)

    def copy_in_local(self, index: int, items: list[tuple[int, Any]], event: Any, hosted: Any,
                      settled: bool = False) -> None:
        """``copy_in`` of tensors a send plan knows to be on the pool's device ``index``
        (no producer events): on the caller's current stream, the slot's event recorded
        there (the first case of ``copy_in``, without asking each tensor its device).
        ``settled``: the copy out of ``hosted``'s stage that ``event`` last followed is
        known to be done (not waited for again)."""
        if hosted is not None:
            self._stage(hosted, event, settled)
        self._copy_and_record(index, items, event, current_raw_stream(index), hosted)

    def copy_in_peer(self, index: int, src: int, items: list[tuple[int, Any]], event: Any, hosted: Any,
                     settled: bool = False) -> None:
        """``copy_in`` of tensors a send plan knows to live on device ``src``, not the
        pool's device ``index`` (no producer events): peer copies pulled on the pool
        device's copy stream (``_copy_from_peer``), without asking each tensor its
        device. ``settled``: as ``copy_in_local``'s."""
        if hosted is not None:
            self._stage(hosted, event, settled)
        self._copy_from_peer(index, src, items, event, hosted)

    def _copy_from_peer(self, index: int, src: int, items: list[tuple[int, Any]], event: Any,
                        hosted: Any) -> None:
        """``copy_in`` of tensors that all live on another device ``src``, pulled: the
        peer copies, the staged host tensors' copy and the slot's event (an
        interprocess event must be recorded on a stream of the device that owns the
        memory) all go on the pool device's copy stream, after ``src``'s current stream
        (the one that produced the tensors: when it has nothing left to run, no wait at
        all; else it waits for an event recorded there, on the device, the host not
        blocked); then ``src``'s current stream waits for the copies, so that what the
        caller queues there next (writing its tensors again, or torch's caching
        allocator handing their memory to new work) comes after they were read. No new
        event, no completion thread. On 2x H200 without an MPS server the copies pushed
        from ``src``'s stream instead, the pool's stream waiting for them, reached the
        receiver about 300 us later at 4 KiB; under MPS the two took the same time."""
        ops = self._ops
        if (index, src) not in self._peers:
            self._enable_peer(index, src)
        s_src, idle = ops.current_stream_idle(src)
        after = None if idle else ops.ordering_event(src).record(s_src)
        stream = self._copy_stream(index)
        self._copy_and_record(index, items, event, stream, hosted, after)
        ops.wait_current(src, ops.ordering_event(index).record(stream))

    def _stage(self, hosted: Any, event: Any, settled: bool = False) -> None:
        """Gather the host tensors of ``hosted`` in its page-locked stage, once the copy
        out of the stage that ``event`` last followed is done (``settled``: the caller
        knows it is)."""
        _dst, parts, _span, stage = hosted
        if not settled:
            self.settle(event)
        base = stage.data_ptr()
        memmove = ctypes.memmove
        for o, t in parts:
            n = t.nbytes
            if n:
                memmove(base + o, t.data_ptr(), n)

    def _copy_and_record(self, index: int, items: list[tuple[int, Any]], event: Any, stream: int,
                         hosted: Any = None, after: Any = None) -> None:
        """One ``cudaMemcpyAsync`` per non-empty tensor into the pool on ``stream`` (of
        device ``index``, made current meanwhile; after the event ``after``, if any), one
        for the staged host tensors of ``hosted``, then ``event`` recorded there."""
        ops = self._ops
        prev = self._on(index)
        try:
            if after is not None:
                ops.wait(stream, after)
            self._copy_items(items, stream)
            if hosted is not None and hosted[2]:
                ops.memcpy(hosted[0], hosted[3].data_ptr(), hosted[2], stream)
            self._check(self.rt.cudaEventRecord(event, stream), "cudaEventRecord")
        finally:
            ops.restore_device(prev)

    def _copy_items(self, items: list[tuple[int, Any]], stream: int) -> None:
        """One ``cudaMemcpyAsync`` per non-empty ``(dst pointer, contiguous tensor)`` on
        ``stream`` (its device current)."""
        memcpy = self._ops.memcpy_d2d
        for dst, t in items:
            n = t.nbytes
            if n:
                memcpy(dst, t.data_ptr(), n, stream)

    def settle(self, event: Any) -> None:
        """Block until the work ``event`` last followed is done (a sender that lets go of
        a stage its copies read)."""
        self._check(self.rt.cudaEventSynchronize(event), "cudaEventSynchronize")

    def wait(self, index: int, event: Any) -> None:
        """Receiver: the caller's current stream on ``index`` waits for ``event``."""
        self._ops.wait_current(index, event)

    def view(self, ptr: int, nbytes: int, index: int) -> tuple[Any, Any]:
        """A uint8 tensor over ``[ptr, ptr + nbytes)`` of device ``index`` and the lease
        object whose death means no view is left."""
        self._completer_get().reap()  # blocks whose last reader is done go back now
        lease = _Lease(ptr, nbytes)
        dev = self._devices.get(index)
        if dev is None:
            dev = self._devices[index] = self._torch.device("cuda", index)
        return self._torch.as_tensor(lease, device=dev), lease

    def after_use(self, index: int, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the work queued so far on ``index``'s current stream (the
        last reader of a freed block) has run: here and now when that stream has nothing
        left to run (a consumer that synchronized before dropping its views: its block
        goes back before its next ``get``, so a sender short of room does not wait for
        the completion thread), else on the completion thread after an event."""
        idle = False
        try:
            stream, idle = self._ops.current_stream_idle(index)
            ev = None if idle else Event(index).record(stream)
        except Exception:  # pragma: no cover - interpreter or driver teardown
            ev = None
        if idle:
            callback()
        else:
            self._completer_get().submit(ev, callback)

    def synchronize(self, index: int) -> None:
        """Block until the copy stream of ``index`` has finished (close only)."""
        s = self._streams.get(index)
        if s is not None:
            self._check(self.rt.cudaStreamSynchronize(s), "cudaStreamSynchronize")

    def drain(self) -> None:
        """Wait until every deferred callback queued so far has run."""
        if _shared is not None:
            _shared.drain()


#: How long the completion thread leaves completed work to the threads that put and get.
REAP_LAG_S = 0.001
_shared: Completer | None = None
_shared_lock = threading.Lock()


def _completer() -> Completer:
    """The process's one completion thread of this backend (frees and source releases
    run once their events complete; views may outlive any connector). Lagged: each
    ``put`` and ``get`` first reaps what has completed, in its own thread, so a stream
    of messages costs no thread hand-off per message; the thread steps in after
    ``REAP_LAG_S`` for what nobody reaped."""
    global _shared
    if _shared is not None:
        return _shared
    with _shared_lock:
        if _shared is None:
            _shared = Completer("omnilink-cuda-ipc", lag=REAP_LAG_S)
        return _shared
