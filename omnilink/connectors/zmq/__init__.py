"""The ``zmq`` backend: transfer over ZeroMQ ``ipc://`` and ``tcp://`` sockets, across hosts.

This package is the public door of the backend; its modules are internal:

=============  ==========================================================================
``connector``  ``ZmqConnector``: sockets, CURVE, the public put / get surface
``io``         the sender and receiver I/O loops (acks, resends, de-duplication,
               heartbeats, backpressure)
``wire``       the byte layouts of the routing, body, ack and reference frames
``cma``        by-reference transfer on one host (``process_vm_readv``, token-checked)
``support``    endpoint helpers, ipc directories and the translation of zmq errors
=============  ==========================================================================

Exports: ``ZmqConnector``, ``curve_keypair``, ``collect_ipc_garbage`` (``omnilink gc``), and the
endpoint helpers the ``nixl`` backend's control channel reuses (``check_endpoint``,
``resolve_endpoint``, ``EndpointLock``, ``remove_stale_socket``). Tests may import ``wire`` and ``cma`` by
their full path to check layouts; library code outside this package uses the names above.
"""

from __future__ import annotations

from omnilink.connectors.zmq.connector import ZmqConnector, curve_keypair
from omnilink.connectors.zmq.support import (
    EndpointLock,
    check_endpoint,
    collect_ipc_garbage,
    remove_stale_socket,
    resolve_endpoint,
)

__all__ = [
    "EndpointLock",
    "ZmqConnector",
    "check_endpoint",
    "collect_ipc_garbage",
    "curve_keypair",
    "remove_stale_socket",
    "resolve_endpoint",
]
