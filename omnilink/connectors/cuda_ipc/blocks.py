"""The sender's first-fit allocator over the receiver's pool (256-byte blocks).

Unlike the shm arena's allocator it can ``reserve`` a given extent: a sender that attaches
to a pool a dead sender left marks the blocks the receiver still holds as used before it
allocates anything.
"""

from __future__ import annotations

import bisect

from omnilink._errors import ConfigurationError

__all__ = ["ALIGN", "BlockAllocator", "round_up"]

#: Alignment of every block and of every tensor inside a block (cudaMalloc gives 256).
ALIGN = 256


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class BlockAllocator:
    """Blocks of a ``capacity``-byte pool; free extents are merged with their neighbours."""

    __slots__ = ("capacity", "_starts", "_free", "_used", "used_bytes")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0 or capacity % ALIGN:
            raise ConfigurationError(f"pool capacity must be a positive multiple of {ALIGN}, got {capacity}")
        self.capacity = capacity
        self._starts: list[int] = [0]
        self._free: dict[int, int] = {0: capacity}
        self._used: dict[int, int] = {}
        self.used_bytes = 0

    @property
    def blocks(self) -> int:
        return len(self._used)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new block of at least ``nbytes`` bytes, or ``None`` if none fits now."""
        need = round_up(max(nbytes, 1))
        for i, start in enumerate(self._starts):
            size = self._free[start]
            if size >= need:
                self._take(i, start, size, start, need)
                return start
        return None

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
        self._take(i, start, size, offset, need)
        return True

    def _take(self, i: int, start: int, size: int, offset: int, need: int) -> None:
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

    def free(self, offset: int) -> int:
        """Return the block at ``offset``; returns its size.

        Raises
        ------
        KeyError
            ``offset`` is not a live block.
        """
        size = self._used.pop(offset)
        self.used_bytes -= size
        starts, free = self._starts, self._free
        i = bisect.bisect_left(starts, offset)
        start, end = offset, offset + size
        if i < len(starts) and starts[i] == end:
            end += free.pop(starts[i])
            del starts[i]
        if i > 0 and starts[i - 1] + free[starts[i - 1]] == start:
            prev = starts[i - 1]
            free[prev] = end - prev
        else:
            starts.insert(i, start)
            free[start] = end - start
        return size

    def size_of(self, offset: int) -> int | None:
        return self._used.get(offset)
