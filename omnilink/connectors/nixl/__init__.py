"""The ``nixl`` backend: payloads written by NIXL (UCX) into a pool the receiver
registered once, across hosts; an optional extra (``pip install "pyomnilink[nixl]"``).

This package is the public door of the backend; its modules are internal:

=============  ==========================================================================
``connector``  ``NixlConnector``: the control channel (zmq), sessions, put / get
``agent``      loading NIXL, the agent wrapper (event-driven progress, WRITE, wait)
``pool``       the receiver's registered pool and leases, the sender's staging buffer,
               the block allocators
``wire``       the control channel's messages and the block check (bounded, typed)
=============  ==========================================================================

Importing this package does not import NIXL: the connector loads it when it opens,
and ``nixl_unavailable()`` (``omnilink info``) says why it cannot where it is missing.

Exports: ``NixlConnector``, ``nixl_unavailable``. Tests may import ``wire`` by its
full path to fuzz its decoder.
"""

from __future__ import annotations

from omnilink.connectors.nixl.agent import nixl_unavailable
from omnilink.connectors.nixl.connector import NixlConnector

__all__ = ["NixlConnector", "nixl_unavailable"]
