"""``PinnedRingPool``: page-locked staging memory with blocking, bounded allocation.

Two modes:

- **standalone** (``PinnedRingPool(capacity)``): the pool allocates its own host memory,
  page-locked by torch (``pin_memory=True``) when CUDA is available, plain otherwise
  (the accounting is the same, so CPU-only CI tests it).
- **over a buffer** (``PinnedRingPool.over(buffer)``): the pool hands out blocks of
  memory someone else owns, e.g. a ``/dev/shm`` arena, which it page-locks once with
  ``cudaHostRegister`` (``register=True``) and unregisters in ``close()``, before the
  owner unmaps it. This is how the shm backend's arena *is* the staging pool: the
  device-to-host DMA writes straight into the block a receiver will map.

Layout and accounting::

    base                                                     base + capacity
    |--[slot a: 64-aligned]--|....free....|--[slot b]--|.......free.......|
          in_use_bytes = sum of slot sizes (rounded to 64)  <=  capacity

Allocation is first-fit over a free list kept sorted by offset, so blocks released out
of order coalesce; ``acquire`` blocks (backpressure) until enough contiguous room is
free or its timeout passes (``TransferTimeout``). A request larger than the capacity is
a ``CapacityError`` at once: it could never be served.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
from typing import Any

from omnilink._errors import CapacityError, ClosedError, ConfigurationError, TransferTimeout
from omnilink._util import Deadline

__all__ = ["PinnedRingPool", "PoolSlot"]

ALIGN = 64


def _round(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class PoolSlot:
    """A block of a ``PinnedRingPool``: ``[offset, offset + nbytes)`` of its memory.

    ``view`` is a writable memoryview of exactly ``nbytes``; ``tensor()`` a uint8 torch
    tensor over the same memory (pinned when the pool is). ``release()`` gives the block
    back (idempotent); the memory must not be used afterwards.
    """

    __slots__ = ("pool", "offset", "nbytes", "reserved", "_released", "__weakref__")

    def __init__(self, pool: PinnedRingPool, offset: int, nbytes: int, reserved: int) -> None:
        self.pool = pool
        self.offset = offset
        self.nbytes = nbytes
        self.reserved = reserved
        self._released = False

    @property
    def address(self) -> int:
        return self.pool.address + self.offset

    @property
    def view(self) -> memoryview:
        return self.pool._view[self.offset : self.offset + self.nbytes]

    def tensor(self) -> Any:
        """The block as a 1-D ``torch.uint8`` tensor (no copy)."""
        return self.pool._tensor[self.offset : self.offset + self.nbytes]

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        self.pool.release(self)

    def __repr__(self) -> str:
        return f"<PoolSlot {self.nbytes} bytes at +{self.offset}{' released' if self._released else ''}>"


class PinnedRingPool:
    """Page-locked staging memory handed out in 64-byte aligned blocks.

    Parameters
    ----------
    capacity : int
        Bytes of the pool (standalone mode).
    pin : bool, optional
        Page-lock the memory; default: when CUDA is available.

    Raises
    ------
    ConfigurationError
        ``capacity`` is not a positive int.
    CudaError
        Page-locking failed.
    """

    def __init__(self, capacity: int, /, *, pin: bool | None = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ConfigurationError(f"capacity must be a positive int, got {capacity!r}")
        import torch

        from omnilink.cuda.runtime import cuda_available

        if pin is None:
            pin = cuda_available()
        self._tensor = torch.empty(capacity, dtype=torch.uint8, pin_memory=bool(pin))
        self._init(memoryview(self._tensor.numpy()).cast("B"), capacity, pinned=bool(pin), registration=None)

    @classmethod
    def over(cls, buffer: Any, /, *, register: bool | None = None, what: str = "a pool buffer") -> PinnedRingPool:
        """A pool over ``buffer`` (writable, contiguous: an mmap, a bytearray).

        Parameters
        ----------
        buffer : writable buffer
            The memory; its owner keeps it mapped until ``close()`` has returned.
        register : bool, optional
            Page-lock it with ``cudaHostRegister`` now (once); default: when CUDA is
            available.
        what : str
            Named in errors.
        """
        import torch

        from omnilink.cuda.runtime import HostRegistration, cuda_available

        view = memoryview(buffer).cast("B")
        if view.readonly:
            raise ConfigurationError(f"{what} is read-only; a pool needs writable memory")
        self = cls.__new__(cls)
        self._tensor = torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else torch.empty(0, dtype=torch.uint8)
        if register is None:
            register = cuda_available()
        registration = None
        if register and view.nbytes:
            address = ctypes.addressof(ctypes.c_char.from_buffer(view))
            registration = HostRegistration(address, view.nbytes, what=what)
        self._init(view, view.nbytes, pinned=registration is not None, registration=registration)
        return self

    def _init(self, view: memoryview, capacity: int, *, pinned: bool, registration: Any) -> None:
        self._view = view
        self.capacity = capacity
        self.pinned = pinned
        self._registration = registration
        self.address = self._tensor.data_ptr() if capacity else 0
        self._cv = threading.Condition()
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, length), sorted
        self._in_use = 0
        self._slots = 0
        self._closed = False

    # ----------------------------------------------------------------- state
    @property
    def in_use_bytes(self) -> int:
        """Bytes handed out and not released (block sizes rounded up to 64)."""
        return self._in_use

    @property
    def slots_in_use(self) -> int:
        return self._slots

    @property
    def closed(self) -> bool:
        return self._closed

    # ----------------------------------------------------------------- allocation
    def try_acquire(self, nbytes: int, /) -> PoolSlot | None:
        """A block of ``nbytes`` if one is free now, else ``None`` (never waits)."""
        need = self._check_size(nbytes)
        with self._cv:
            self._check_open()
            return self._take(nbytes, need)

    def acquire(self, nbytes: int, /, *, timeout: float | None = None) -> PoolSlot:
        """A block of ``nbytes``, waiting up to ``timeout`` seconds for room.

        Raises
        ------
        CapacityError
            ``nbytes`` exceeds the capacity: it could never be served.
        TransferTimeout
            No room within ``timeout`` (backpressure: blocks are still in use).
        ClosedError
            The pool was closed (also while waiting).
        """
        need = self._check_size(nbytes)
        deadline = Deadline(timeout)
        with self._cv:
            while True:
                self._check_open()
                slot = self._take(nbytes, need)
                if slot is not None:
                    return slot
                remaining = deadline.remaining()
                if remaining == 0:
                    raise TransferTimeout(
                        f"pinned pool: no room for {nbytes} bytes within {timeout} s "
                        f"({self._in_use} of {self.capacity} bytes in use in {self._slots} blocks)"
                    )
                self._cv.wait(remaining)

    def release(self, slot: PoolSlot, /) -> None:
        """Give ``slot`` back (idempotent); wakes ``acquire`` calls waiting for room."""
        if slot.pool is not self:
            raise ConfigurationError("slot belongs to another pool")
        with self._cv:
            if slot._released:
                return
            slot._released = True
            self._in_use -= slot.reserved
            self._slots -= 1
            self._insert_free(slot.offset, slot.reserved)
            self._cv.notify_all()

    def _check_size(self, nbytes: int) -> int:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ConfigurationError(f"nbytes must be an int >= 0, got {nbytes!r}")
        need = _round(max(nbytes, 1))
        if need > self.capacity:
            raise CapacityError(f"pinned pool: a block of {nbytes} bytes exceeds the pool's {self.capacity} bytes")
        return need

    def _take(self, nbytes: int, need: int) -> PoolSlot | None:
        free = self._free
        for i, (off, length) in enumerate(free):
            if length >= need:
                if length == need:
                    del free[i]
                else:
                    free[i] = (off + need, length - need)
                self._in_use += need
                self._slots += 1
                return PoolSlot(self, off, nbytes, need)
        return None

    def _insert_free(self, off: int, length: int) -> None:
        free = self._free
        i = bisect.bisect_left(free, (off, 0))
        # Coalesce with the neighbours so out-of-order releases leave no fragments.
        if i > 0 and free[i - 1][0] + free[i - 1][1] == off:
            i -= 1
            off, length = free[i][0], free[i][1] + length
            del free[i]
        if i < len(free) and off + length == free[i][0]:
            length += free[i][1]
            del free[i]
        free.insert(i, (off, length))

    # ----------------------------------------------------------------- lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("pinned pool is closed")

    def close(self) -> None:
        """Unregister the memory (over-buffer mode) and refuse further use; idempotent.

        Waiting ``acquire`` calls raise ``ClosedError``. Blocks still handed out must not
        be used afterwards.
        """
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        if self._registration is not None:
            self._registration.close()

    def __enter__(self) -> PinnedRingPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "pinned" if self.pinned else "pageable"
        return f"<PinnedRingPool {mode} {self._in_use}/{self.capacity} bytes in {self._slots} blocks>"
