"""Shared-memory primitives under both same-host transports: names, the host lock,
segments and the first-fit allocator.

The ``shm`` backend (arenas, control segments) and the device pool (``devpool``: its
directory segment) both build on this package, and it imports neither of them, so
neither transport has to import the other for what lives in ``/dev/shm``:

=============  ==========================================================================
``names``      the name of every object omnilink creates in ``/dev/shm`` (owner pid and
               random token), the name prefix, pid liveness, the host-wide lock, free
               space
``segment``    create (0600, reserved and pre-faulted), open and unlink a segment; the
               free-space check and its advice
``alloc``      the first-fit allocator with coalescing (64-byte blocks; the device pool's
               256-byte one derives from it)
=============  ==========================================================================

Exports the names below; library code imports them from this package, never from its
modules (tests may, to patch ``free_shm_bytes`` or check the allocator).
"""

from __future__ import annotations

from omnilink.connectors.shmem.alloc import ALIGN, Allocator, round_up
from omnilink.connectors.shmem.names import (
    SHM_DIR,
    HostLock,
    arena_name,
    channel_names,
    extension_name,
    free_shm_bytes,
    new_token,
    overflow_name,
    parse_channel_name,
    parse_owned_name,
    pid_alive,
    read_prefix,
)
from omnilink.connectors.shmem.segment import (
    MAP_FLAGS,
    MODE,
    PAGE,
    PROT,
    create_segment,
    open_segment,
    preflight,
    shm_error,
    shm_size_advice,
    unlink_segment,
    unlink_semaphore,
)

__all__ = [
    "ALIGN",
    "MAP_FLAGS",
    "MODE",
    "PAGE",
    "PROT",
    "SHM_DIR",
    "Allocator",
    "HostLock",
    "arena_name",
    "channel_names",
    "create_segment",
    "extension_name",
    "free_shm_bytes",
    "new_token",
    "open_segment",
    "overflow_name",
    "parse_channel_name",
    "parse_owned_name",
    "pid_alive",
    "preflight",
    "read_prefix",
    "round_up",
    "shm_error",
    "shm_size_advice",
    "unlink_segment",
    "unlink_semaphore",
]
