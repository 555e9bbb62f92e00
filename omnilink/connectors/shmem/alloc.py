"""First-fit block allocator with coalescing, for the data area of a sender's arena.

Only the sender allocates in its own arena, so the allocator is process-local state;
what crosses processes is the state word of each descriptor (the ``shm`` backend's
``segments``). The device pool's allocator (``devpool.blocks``) derives from it.
Every block starts and ends on a 64-byte boundary (``ALIGN``), which is what
tensor_blob needs for its data region (``FRAME_ALIGN``) and keeps blocks on separate
cache lines.

Free list::

    starts  [s0, s1, s2, ...]      sorted offsets of free extents
    free    {s0: n0, s1: n1, ...}  their sizes
    used    {a: n, ...}            live allocations (for validated frees)

``alloc`` takes the first extent that fits and splits it; ``free`` puts the block back
and merges it with the extents right before and right after it, so a fully drained
arena is always a single extent again.
"""

from __future__ import annotations

import bisect

from omnilink._errors import ConfigurationError

__all__ = ["ALIGN", "Allocator", "round_up"]

ALIGN = 64


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class Allocator:
    """Blocks of a ``capacity``-byte area, every one ``ALIGN``-aligned.

    Parameters
    ----------
    capacity : int
        Size of the area; a multiple of ``ALIGN``.
    """

    __slots__ = ("capacity", "_starts", "_free", "_used", "used_bytes")
    #: block alignment (a subclass may raise it: the cuda_ipc pool uses 256)
    align = ALIGN

    def __init__(self, capacity: int) -> None:
        if capacity <= 0 or capacity % self.align:
            raise ConfigurationError(
                f"allocator capacity must be a positive multiple of {self.align}, got {capacity}"
            )
        self.capacity = capacity
        self._starts: list[int] = [0]
        self._free: dict[int, int] = {0: capacity}
        self._used: dict[int, int] = {}
        self.used_bytes = 0

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new block of at least ``nbytes`` bytes, or ``None`` if none fits now."""
        align = self.align
        need = (nbytes + align - 1) // align * align if nbytes > 0 else align
        starts, free = self._starts, self._free
        if starts:  # the common case: the first extent fits (first fit, no loop)
            start = starts[0]
            size = free[start]
            if size > need:
                del free[start]
                starts[0] = rest = start + need
                free[rest] = size - need
                self._used[start] = need
                self.used_bytes += need
                return start
        for i, start in enumerate(starts):
            size = free[start]
            if size >= need:
                del free[start]
                if size == need:
                    del starts[i]
                else:
                    rest = start + need
                    starts[i] = rest
                    free[rest] = size - need
                self._used[start] = need
                self.used_bytes += need
                return start
        return None

    def free(self, offset: int) -> int:
        """Return the block at ``offset`` to the free list; returns its size.

        Raises
        ------
        KeyError
            ``offset`` is not a live block (a double free is a bug, never ignored).
        """
        size = self._used.pop(offset)
        self.used_bytes -= size
        starts, free = self._starts, self._free
        i = bisect.bisect_left(starts, offset)
        start, end = offset, offset + size
        # merge with the following extent
        if i < len(starts) and starts[i] == end:
            end += free.pop(starts[i])
            del starts[i]
        # merge with the preceding extent
        if i > 0 and starts[i - 1] + free[starts[i - 1]] == start:
            prev = starts[i - 1]
            free[prev] = end - prev
        else:
            starts.insert(i, start)
            free[start] = end - start
        return size

    def reserve(self, offset: int, nbytes: int) -> bool:
        """Mark the block ``[offset, offset + nbytes)`` (rounded up to ``align``) used, as
        if ``alloc`` had returned it; ``False`` (nothing changed) if it is misaligned,
        outside the area or not wholly free. For an allocator that must take over blocks
        another party already holds (a sender attaching to a pool a dead sender left, a
        receiver mirroring the blocks a sender publishes)."""
        align = self.align
        need = (max(nbytes, 1) + align - 1) // align * align
        if offset % align or offset < 0 or offset + need > self.capacity:
            return False
        starts, free = self._starts, self._free
        i = bisect.bisect_right(starts, offset) - 1
        if i < 0:
            return False
        start = starts[i]
        size = free[start]
        if offset + need > start + size:
            return False
        del free[start]
        del starts[i]
        if offset > start:  # the part before the block stays free
            starts.insert(i, start)
            free[start] = offset - start
            i += 1
        end = offset + need
        if end < start + size:  # and the part after it
            starts.insert(i, end)
            free[end] = start + size - end
        self._used[offset] = need
        self.used_bytes += need
        return True

    def owns(self, offset: int) -> bool:
        """Whether a live block starts at ``offset``."""
        return offset in self._used

    def size_of(self, offset: int) -> int:
        return self._used[offset]

    @property
    def blocks(self) -> int:
        return len(self._used)

    def largest_free(self) -> int:
        return max(self._free.values(), default=0)

    def extents(self) -> list[tuple[int, int]]:
        """Free extents as ``(offset, size)``, sorted (for tests and diagnostics)."""
        return [(s, self._free[s]) for s in self._starts]
