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

Exports: ``ShmConnector``, ``collect_garbage``, ``DEFAULT_ARENA_BYTES``. Tests may import
the internal modules by their full path (``omnilink.connectors.shm.alloc``) to check
layouts and the allocator; library code outside this package uses the names above.
"""

from __future__ import annotations

from omnilink.connectors.shm.connector import DEFAULT_ARENA_BYTES, ShmConnector
from omnilink.connectors.shm.gc import collect_garbage

__all__ = ["DEFAULT_ARENA_BYTES", "ShmConnector", "collect_garbage"]
