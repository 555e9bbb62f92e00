"""The sender's first-fit allocator over the receiver's pool (256-byte blocks).

A sender that attaches to a pool a dead sender left ``reserve``s the blocks the receiver
still holds before it allocates anything.
"""

from __future__ import annotations

from omnilink.connectors.shmem import Allocator

__all__ = ["ALIGN", "BlockAllocator", "round_up"]

#: Alignment of every block and of every tensor inside a block (cudaMalloc gives 256).
ALIGN = 256


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class BlockAllocator(Allocator):
    """Blocks of a ``capacity``-byte pool, 256-aligned: the shm arena's first-fit
    allocator (free extents merged with their neighbours, ``reserve`` of a given block)."""

    __slots__ = ()
    align = ALIGN
