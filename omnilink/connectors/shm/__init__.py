"""The ``shm`` backend: same-host transfer through a pre-faulted shared-memory arena.

This package is the public door of the backend; its modules are internal:

=============  ==========================================================================
``connector``  ``ShmConnector``: put / get / discard / release, wake-ups, heartbeats,
               leases that hand a block back when the last decoded view dies
``segments``   the byte layouts (arena, control segment, descriptor state machine) and
               the ``ArenaWriter`` / ``ArenaReader`` / ``Channel`` objects over them
``gpu``        the GPU path: CUDA tensors by DMA into the page-locked arena and out
``slices``     a large CUDA payload in slices: the head message and its checks
``ipc``        the device-IPC route: CUDA payloads GPU to GPU through a device pool the
               receiver owns (``omnilink.connectors.devpool``'s two ends, used
               directly: no ``cuda_ipc`` connector, no second channel)
``gc``         ``collect_garbage``: what ``omnilink gc`` runs for this backend
=============  ==========================================================================

Names, the host lock, segment create / open / unlink and the first-fit allocator live
in ``omnilink.connectors.shmem``, below this package and the device pool both (so
neither imports the other); import graph: ``shm -> devpool -> shmem``, ``cuda_ipc ->
shm, devpool``.

Exports: ``ShmConnector``, ``collect_garbage``, ``collect_cuda_event_files``,
``DEFAULT_ARENA_BYTES``; and, re-exported from ``omnilink.connectors.shmem`` where they
live now (these imports keep working): ``SHM_DIR``, ``HostLock``, ``arena_name``,
``read_prefix``, ``pid_alive``, ``Allocator`` (the first-fit allocator),
``create_segment``, ``open_segment``, ``unlink_segment``. Tests may import the internal
modules by their full path (``omnilink.connectors.shm.segments``) to check layouts;
library code outside this package uses the names above.
"""

from __future__ import annotations

from omnilink.connectors.shm.connector import DEFAULT_ARENA_BYTES, ShmConnector
from omnilink.connectors.shm.gc import collect_cuda_event_files, collect_garbage
from omnilink.connectors.shmem import (
    SHM_DIR,
    Allocator,
    HostLock,
    arena_name,
    create_segment,
    open_segment,
    pid_alive,
    read_prefix,
    unlink_segment,
)

__all__ = [
    "Allocator",
    "DEFAULT_ARENA_BYTES",
    "SHM_DIR",
    "HostLock",
    "ShmConnector",
    "arena_name",
    "collect_cuda_event_files",
    "collect_garbage",
    "create_segment",
    "open_segment",
    "pid_alive",
    "read_prefix",
    "unlink_segment",
]
