"""The sender's first-fit allocator over the receiver's pool (256-byte blocks).

Unlike the shm arena's allocator it can ``reserve`` a given extent: a sender that attaches
to a pool a dead sender left marks the blocks the receiver still holds as used before it
allocates anything.
"""

from __future__ import annotations

import bisect

from omnilink.connectors.shmem import Allocator

__all__ = ["ALIGN", "BlockAllocator", "round_up"]

#: Alignment of every block and of every tensor inside a block (cudaMalloc gives 256).
ALIGN = 256


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class BlockAllocator(Allocator):
    """Blocks of a ``capacity``-byte pool, 256-aligned: the shm arena's first-fit
    allocator (free extents merged with their neighbours) plus ``reserve``."""

    __slots__ = ()
    align = ALIGN

    def reserve(self, offset: int, nbytes: int) -> bool:
        """Mark ``[offset, offset + nbytes)`` (rounded up) used; ``False`` if it is not free."""
        need = round_up(max(nbytes, 1))
        if offset % ALIGN or offset < 0 or offset + need > self.capacity:
            return False
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            return False
        start = self._starts[i]
        size = self._free[start]
        if offset + need > start + size:
            return False
        del self._free[start]
        del self._starts[i]
        if offset > start:  # the part before the block stays free
            self._starts.insert(i, start)
            self._free[start] = offset - start
            i += 1
        end = offset + need
        if end < start + size:
            self._starts.insert(i, end)
            self._free[end] = start + size - end
        self._used[offset] = need
        self.used_bytes += need
        return True
