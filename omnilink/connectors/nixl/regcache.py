"""Registrations of the sender's CUDA allocations, made once and kept.

A WRITE from a large tensor's own memory (no copy into the staging buffer) needs that
memory registered with the sender's NIXL agent. Registering costs tens of microseconds
(45-92 us on 2x H100 / H200), deregistering a few more: paid per payload, that was the
largest fixed cost of a 256 MiB put. Tensors live in allocations that torch's caching
allocator keeps and hands out again, so this cache registers the whole *allocation*
holding a tensor (the driver's ``cuMemGetAddressRange``) once, and later tensors in it
reuse the registration.

An allocation can be freed (``torch.cuda.empty_cache``) and its addresses handed to a
new one; each allocation has a process-unique buffer id (the driver's
``CU_POINTER_ATTRIBUTE_BUFFER_ID``), so an entry is used only for the allocation it was
made for. A new allocation over addresses an entry covers means that entry's memory is
gone: it is deregistered first. At most ``max_entries`` stay registered (the least
recently used go). Registered device memory pins nothing. An allocation the agent will
not register whole (a range only partly mapped, as torch's expandable segments make) is
remembered and its tensors are registered per write, as without the cache.

Nor is an allocation registered whole where it holds memory the sender registered for
itself (its device staging buffer, ``avoid``): NIXL looks a transfer's memory up among
registrations that must not overlap (with two over the same bytes, preparing a WRITE
failed with ``NIXL_ERR_NOT_FOUND`` on 2x H200). Tensors of such an allocation are
registered per write.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable

logger = logging.getLogger("omnilink.nixl")

#: Allocations kept registered per sender (least recently used deregistered first).
MAX_ENTRIES = 64


class _Entry:
    __slots__ = ("base", "size", "dev", "descs")

    def __init__(self, base: int, size: int, dev: int, descs: Any) -> None:
        self.base = base
        self.size = size
        self.dev = dev
        self.descs = descs


class RegistrationCache:
    """``agent``: what registers (``register(addr, nbytes, "VRAM", dev)`` /
    ``deregister(descs)``); ``allocation(ptr, dev)``: ``(base, size, buffer id)`` of the
    allocation holding device pointer ``ptr`` on device ``dev``, or ``None`` where the
    driver cannot say (the caller then registers the tensor for its write alone)."""

    def __init__(self, agent: Any, allocation: Callable[[int, int], tuple[int, int, int] | None],
                 max_entries: int = MAX_ENTRIES) -> None:
        self.agent = agent
        self.allocation = allocation
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[tuple[int, int], _Entry] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0
        #: allocations the agent would not register whole (counted; remembered by id)
        self.refused = 0
        self._refused: set[tuple[int, int]] = set()
        #: per device, the range the sender registered itself (``avoid``)
        self._avoid: dict[int, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def covers(self, ptr: int, nbytes: int, dev: int) -> bool:
        """Make sure ``[ptr, ptr + nbytes)`` on ``dev`` lies in a registered allocation
        (registering it on a miss); ``False`` where its allocation cannot be found, does
        not hold the whole range, or would not register whole (register the range per
        write then)."""
        found = self.allocation(ptr, dev)
        if found is None:
            return False
        base, size, buffer_id = found
        if not (base <= ptr and ptr + nbytes <= base + size):
            return False
        key = (dev, buffer_id)
        if key in self._refused:
            return False
        entry = self._entries.get(key)
        if entry is not None and entry.base == base and entry.size == size:
            self._entries.move_to_end(key)
            self.hits += 1
            return True
        if entry is not None:  # pragma: no cover - a buffer id names one allocation
            self._drop(key)
        # Entries over these addresses belong to allocations that were freed.
        for k, e in list(self._entries.items()):
            if e.dev == dev and e.base < base + size and base < e.base + e.size:
                self._drop(k)
        own = self._avoid.get(dev)
        if own is not None and own[0] < base + size and base < own[0] + own[1]:
            self._refuse(key)  # it holds the sender's own registered memory
            return False
        try:
            descs = self.agent.register(base, size, "VRAM", dev)
        except Exception:  # noqa: BLE001 - e.g. a range only partly mapped (torch's expandable segments)
            # The tensor alone may still register (the caller does, per write).
            logger.debug("nixl: registering the allocation [%#x, +%d) failed; its tensors register per write",
                         base, size, exc_info=True)
            self._refuse(key)
            return False
        self._entries[key] = _Entry(base, size, dev, descs)
        self.misses += 1
        while len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))
        return True

    def _refuse(self, key: tuple[int, int]) -> None:
        self.refused += 1
        if len(self._refused) >= 4 * self.max_entries:
            self._refused.clear()
        self._refused.add(key)  # not tried again

    def avoid(self, dev: int, addr: int, nbytes: int) -> None:
        """``[addr, addr + nbytes)`` on ``dev`` is registered by the sender itself (its
        staging buffer; replaces the device's former range): an entry whose allocation
        holds any of it is deregistered (its tensors then register per write), and no
        such allocation is registered whole from now on."""
        self._avoid[dev] = (addr, nbytes)
        for k, e in list(self._entries.items()):
            if e.dev == dev and e.base < addr + nbytes and addr < e.base + e.size:
                self._drop(k)
                self._refuse(k)

    def _drop(self, key: tuple[int, int]) -> None:
        entry = self._entries.pop(key)
        self.agent.deregister(entry.descs)

    def clear(self) -> None:
        """Deregister everything (the sender closing)."""
        while self._entries:
            self._drop(next(iter(self._entries)))

    def release(self) -> list[Any]:
        """Forget every entry without deregistering; their registrations (for a caller
        that must keep them: a WRITE that may still read them)."""
        out = [e.descs for e in self._entries.values()]
        self._entries.clear()
        return out
