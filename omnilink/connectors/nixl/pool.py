"""Registered memory: the receiver's pool, the sender's staging buffer, block allocators.

Receiver pool (registered once with the receiver's agent)::

    pool  [ extent of sender A | extent of sender B | free ...                ]
             |blk|blk|  free  |
             ^ a block holds one payload's data region (64-byte aligned tensors)

- ``Pool``: host memory (an anonymous private mapping, pre-faulted; no ``/dev/shm``, so
  nothing outlives the process) or device memory (one ``torch.empty`` on the
  receiver's GPU). Extents are handed to senders (``Blocks`` over the whole pool);
  each extent has a mirror ``Blocks`` on the receiver, into which a published block
  must ``reserve`` (a hostile or confused sender cannot publish overlapping blocks).
- ``lease(offset, length)`` makes the object decoded views are built on: a numpy array
  over the mapping (host), or an object exposing ``__cuda_array_interface__`` (device).
  Views keep it alive; a weak reference's callback learns when the last one died and
  queues the block for release (``Releaser``: a deque, and an eventfd that wakes the
  loop only while a sender waits for room, so the callback takes no lock and may run
  in any thread, even one that holds the receiver's lock). On a device, the callback
  records an event on the releasing thread's current stream unless that stream has
  nothing left to run; the block goes back only once that event has completed (work
  queued on the view): the loop looks, it does not wait.
- ``Staging``: the sender's registered buffer. A payload is written into it (tensor_blob
  layout) and one WRITE moves the data region to the receiver's block: memory is
  registered once (and again only when a larger payload makes it grow), never per
  message. Host staging is a private mapping; device staging a ``torch.empty`` on the
  sender's GPU, filled by device copies on the current stream, synchronised before the
  WRITE.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import os
import weakref
from typing import Any

from omnilink._errors import CapacityError, ConfigurationError
from omnilink.connectors.shmem import Allocator

__all__ = ["ALIGN", "Blocks", "Pool", "Releaser", "Staging", "round_up"]

logger = logging.getLogger(__name__)

#: Alignment of extents and blocks (device allocations are 256-byte aligned; tensor_blob
#: needs 64).
ALIGN = 256


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class Blocks(Allocator):
    """First-fit blocks of an area (the shm arena's allocator at 256-byte alignment), whose
    ``reserve`` the receiver's mirror of a sender's extent uses."""

    __slots__ = ()
    align = ALIGN


def _map(nbytes: int) -> tuple[mmap.mmap, int]:
    """A pre-faulted private anonymous mapping and its address."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    populate = getattr(mmap, "MADV_POPULATE_WRITE", None)
    try:
        if populate is None:
            raise OSError
        mm.madvise(populate)
    except OSError:  # older kernels: touch every page
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(mm)), 0, nbytes)
    return mm, ctypes.addressof(ctypes.c_char.from_buffer(mm))


class _DeviceLease:
    """One device block as a CUDA array (``__cuda_array_interface__`` v3, bytes); holds
    the pool tensor, so the pool outlives every view."""

    __slots__ = ("ptr", "nbytes", "owner", "__weakref__")

    def __init__(self, ptr: int, nbytes: int, owner: Any) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.owner = owner

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"version": 3, "typestr": "|u1", "shape": (self.nbytes,), "data": (self.ptr, False),
                "strides": None, "stream": None}


class _Ref(weakref.ref):
    """A lease's weak reference, carrying what releasing its block takes."""

    __slots__ = ("tag", "nbytes")


class Releaser:
    """Blocks whose last view died, queued for the receiver's loop thread.

    ``track(lease, tag)`` returns a weak reference whose callback queues ``tag`` (with a
    CUDA event on device pools, unless the releasing thread's stream had nothing left
    to run); ``release(ref)`` does the same early (a payload discarded or refused). Each
    lease is released once. The loop is woken through an eventfd only while ``eager``
    (a sender waits for room): otherwise it takes the queue at its next wake-up, before
    the message that woke it (every answer hands the frees back), so the release of a
    payload a consumer just used does not wake the loop while the next one arrives.
    """

    def __init__(self, device: Any = None) -> None:
        self.queue: collections.deque[tuple[Any, Any]] = collections.deque()
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.device = device
        #: wake the loop per release (set by the loop while a sender is parked)
        self.eager = False
        #: id(ref) -> ref of the leases not yet released
        self.live: dict[int, Any] = {}
        self.live_bytes = 0
        self._index = -1
        self._ops: Any = False  # cuda-python's CudaOps once looked up (None: torch's events)
        self._events: list[Any] = []  # completed raw events, reused

    def track(self, lease: Any, tag: Any, nbytes: int) -> Any:
        ref = _Ref(lease, self.release)
        ref.tag = tag
        ref.nbytes = nbytes
        self.live[id(ref)] = ref
        self.live_bytes += nbytes
        return ref

    def release(self, ref: Any) -> None:
        if self.live.pop(id(ref), None) is None:
            return
        self.live_bytes -= ref.nbytes
        event = None
        if self.device is not None and self.fd >= 0:
            try:
                event = self._after_stream()
            except Exception:  # interpreter teardown: the block goes back unordered
                event = None
        fd = self.fd
        if fd < 0:  # closed: the receiver is gone, nothing to hand back to
            return
        self.queue.append((ref.tag, event))
        if self.eager:
            self.wake()

    def wake(self) -> None:
        """Wake the loop (it drains the queue)."""
        try:
            os.eventfd_write(self.fd, 1)
        except (OSError, ValueError):  # closed meanwhile
            pass

    def _after_stream(self) -> Any:
        """An event recorded on this thread's current stream of the pool's device, or
        ``None`` when that stream has nothing left to run (a consumer that synchronized
        before dropping its views)."""
        import torch

        if self._ops is False:
            from omnilink.cuda import cuda_ops_or_none

            self._index = torch.device(self.device).index
            if self._index is None:
                self._index = torch.cuda.current_device()
            self._ops = cuda_ops_or_none()
        ops = self._ops
        if ops is None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            return event
        from omnilink.cuda import Event

        idx = self._index
        stream, idle = ops.current_stream_idle(idx)
        if idle:
            return None
        events = self._events
        event = events.pop() if events else Event(idx)
        return event.record(stream)

    def drain(self, wait: bool = False) -> list[Any]:
        """The tags queued so far whose event (if any) has completed; the others stay
        queued (``wait``: waited for instead, a sender short of room)."""
        try:
            os.eventfd_read(self.fd)
        except (BlockingIOError, OSError):
            pass
        out = []
        later = []
        queue = self.queue
        while queue:
            tag, event = queue.popleft()
            if event is not None:
                if wait:
                    event.synchronize()
                elif not event.query():
                    later.append((tag, event))
                    continue
                if self._ops:
                    self._events.append(event)
            out.append(tag)
        queue.extend(later)
        return out

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
        self.fd = -1


class Pool:
    """The receiver's pool: ``nbytes`` of host memory (``device=None``) or of ``device``'s
    memory, registered once with ``agent``.

    Raises
    ------
    ConfigurationError
        ``device`` is not a CUDA device this process can use.
    CapacityError
        The memory cannot be had.
    """

    def __init__(self, agent: Any, nbytes: int, device: Any = None) -> None:
        self.nbytes = nbytes
        self.device = device
        self.extents = Blocks(nbytes)
        self._mm: mmap.mmap | None = None
        self._tensor: Any = None
        self._stream: Any = None  # a device pool's own stream for inline copies (made on first use)
        if device is None:
            try:
                self._mm, self.addr = _map(nbytes)
            except (OSError, ValueError) as exc:
                raise CapacityError(f"nixl: cannot map a {nbytes}-byte receive pool: {exc}") from exc
            self.mem, self.dev = "DRAM", 0
            import numpy as np

            self._np = np
        else:
            import torch

            dev = torch.device(device)
            if dev.type != "cuda" or not torch.cuda.is_available():
                raise ConfigurationError(f"nixl: device {device!r} is not a usable CUDA device")
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            try:
                self._tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            except RuntimeError as exc:
                raise CapacityError(f"nixl: cannot allocate a {nbytes}-byte pool on {self.device}: {exc}") from exc
            self.addr = self._tensor.data_ptr()
            self.mem, self.dev = "VRAM", index
        self._reg = agent.register(self.addr, nbytes, self.mem, self.dev)
        self._agent = agent

    def write(self, offset: int, data: bytes) -> None:
        """Copy ``data`` into the pool at ``offset`` (validated by the caller), done
        when this returns: a device pool's copy runs on a stream of the pool's own, so
        it waits for no work of the caller's streams.

        Raises
        ------
        CudaError
            The copy failed.
        """
        n = len(data)
        if self._mm is not None:
            self._mm[offset : offset + n] = data
            return
        if not n:
            return
        stream = self._stream
        if stream is None:
            import torch

            stream = self._stream = torch.cuda.Stream(self.device)  # (torch's pool: non-blocking)
        from omnilink.cuda import cuda_ops_or_none

        ops = cuda_ops_or_none()
        if ops is None:
            import torch

            with torch.cuda.stream(stream):
                self._tensor[offset : offset + n].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            stream.synchronize()
            return
        import numpy as np

        src = np.frombuffer(data, dtype=np.uint8)
        raw = int(stream.cuda_stream)
        prev = ops.swap_device(self.dev)
        try:
            ops.memcpy(self.addr + offset, src.ctypes.data, n, raw)
            ops.stream_synchronize(raw)
        finally:
            ops.restore_device(prev)

    def lease(self, offset: int, length: int) -> Any:
        """An object over ``[offset, offset + length)`` of the pool (validated by the
        caller) that decoded views are made from."""
        if self._mm is not None:
            return self._np.frombuffer(self._mm, dtype=self._np.uint8, count=length, offset=offset)
        return _DeviceLease(self.addr + offset, length, self._tensor)

    def close(self) -> None:
        """Deregister. The memory itself goes with the last view of it (a view keeps
        the mapping or the pool tensor alive)."""
        if self._reg is not None:
            self._agent.deregister(self._reg)
            self._reg = None
        self._mm = None
        self._tensor = None


class Staging:
    """The sender's registered buffer of one memory kind, grown (and registered again)
    only when a payload does not fit.

    ``device=None``: host memory; else that CUDA device's.
    """

    MIN_BYTES = 1 << 20

    def __init__(self, agent: Any, device: Any = None) -> None:
        self._agent = agent
        self.device = device
        self.mem = "DRAM" if device is None else "VRAM"
        self.dev = 0 if device is None else device.index
        self.nbytes = 0
        self.addr = 0
        self.view: memoryview | None = None
        self.tensor: Any = None
        self._mm: mmap.mmap | None = None
        self._reg: Any = None
        #: called with ``(dev, addr, nbytes)`` once the buffer is registered anew
        self.on_registered: Any = None

    def ensure(self, nbytes: int) -> None:
        if nbytes <= self.nbytes:
            return
        size = max(self.MIN_BYTES, 1 << (nbytes - 1).bit_length())
        self.close()
        if self.device is None:
            try:
                self._mm, self.addr = _map(size)
            except (OSError, ValueError) as exc:
                raise CapacityError(f"nixl: cannot map a {size}-byte staging buffer: {exc}") from exc
            self.view = memoryview(self._mm)
        else:
            import torch

            self.tensor = torch.empty(size, dtype=torch.uint8, device=self.device)
            self.addr = self.tensor.data_ptr()
        self._reg = self._agent.register(self.addr, size, self.mem, self.dev)
        self.nbytes = size
        if self.on_registered is not None:
            self.on_registered(self.dev, self.addr, size)

    def close(self) -> None:
        if self._reg is not None:
            self._agent.deregister(self._reg)
            self._reg = None
        if self.view is not None:
            self.view.release()
            self.view = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        self.tensor = None
        self.nbytes = 0
