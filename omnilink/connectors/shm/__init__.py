"""The ``shm`` backend: same-host transfer through a pre-faulted shared-memory arena.

This package is the public door of the backend; its modules are internal:

=============  ==========================================================================
``connector``  ``ShmConnector``: put / get / discard / release, wake-ups, heartbeats,
               leases that hand a block back when the last decoded view dies
``segments``   the byte layouts (arena, control segment, descriptor state machine) and
               the ``ArenaWriter`` / ``ArenaReader`` / ``Channel`` objects over them
``alloc``      the sender-side first-fit allocator over one arena (64-byte blocks)
``names``      segment and semaphore names (owner pid + random token), the host lock,
               ``/dev/shm`` free-space checks
``gc``         ``collect_garbage``: what ``omnilink gc`` runs for this backend
=============  ==========================================================================

Exports: ``ShmConnector``, ``collect_garbage``, ``DEFAULT_ARENA_BYTES``; for the
``cuda_ipc`` backend, which keeps its pool directory under this backend's naming and
garbage-collection rules: ``SHM_DIR``, ``HostLock``, ``arena_name``, ``read_prefix``,
``pid_alive``, ``Allocator`` (the first-fit allocator), ``create_segment``, ``open_segment``, ``unlink_segment``. Tests may import
the internal modules by their full path (``omnilink.connectors.shm.alloc``) to check
layouts and the allocator; library code outside this package uses the names above.
"""

from __future__ import annotations

from omnilink.connectors.shm.alloc import Allocator
from omnilink.connectors.shm.connector import DEFAULT_ARENA_BYTES, ShmConnector
from omnilink.connectors.shm.gc import collect_cuda_event_files, collect_garbage
from omnilink.connectors.shm.names import SHM_DIR, HostLock, arena_name, pid_alive, read_prefix
from omnilink.connectors.shm.segments import _unlink_quiet as unlink_segment
from omnilink.connectors.shm.segments import create_segment, open_segment

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
