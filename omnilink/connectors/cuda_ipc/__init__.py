"""The ``cuda_ipc`` backend: CUDA tensors between two processes of one host, GPU to GPU.

The receiver owns one device pool, ``cudaMalloc``-ed and exported through CUDA IPC once;
the sender maps it once and copies each CUDA tensor of a payload straight into a block
of it (one ``cudaMemcpyAsync`` per tensor, device-to-device, or a peer copy over
NVLink/PCIe P2P when the devices differ). The receiver's ``get`` returns views of that
block. Nothing is exported per message, no torch sharing or refcount files are used, and
nothing is unpickled. CPU tensors and metadata of the same payload travel the ``shm`` way.

``CudaIpcConnector`` is the device pool's two ends (``omnilink.connectors.devpool``:
``PoolReceiver`` owns the pool, ``PoolSender`` copies into it; the pool directory, event
slots, lifetimes, faults and backpressure are described there) plus an inner shm
channel that carries their messages::

    sender                                            receiver (owns the pool)
    ------                                            ------------------------
    put: PoolSender.send copies the CUDA              (open) PoolReceiver allocates and
      tensors into a pool block on the caller's         exports the pool, writes its
      current stream, records the slot event,           directory
      and publishes the message on the inner
      shm channel                          ---------> get: the inner channel's get;
                                                        PoolReceiver.land: the current
                                                        stream waits on the slot event;
                                                        views of the block
    next put drains the released ring     <---------  last view dies: the block goes back

Design
------
- **Control plane.** Descriptors, wake-ups, the key contract, heartbeats and the death of
  a sender (``PeerLostError`` in ``get``) come from an inner ``ShmConnector`` on channel
  ``<channel>/cuda-ipc``. Its message is ``{"d": manifest, "h": host part, "n": size}``
  (``devpool.manifest``): the host part is the payload with ``None`` where each CUDA
  tensor was (one walk of the payload on the sender), the manifest the block, event slot
  and each tensor's dtype, place, shape and path in the payload; it is validated on
  receipt, and each view put at its path (no second walk).
- **The ends.** The sender end checks its receiver's liveness every 0.25 s and in each
  ``put``: a receiver that died or closed makes ``put`` raise ``PeerLostError`` at once
  (a later put attaches to a new receiver, if one opened the channel since). The
  receiver learns of a dead sender from the shm control plane and from the sender pid
  in the pool directory; a new sender starts from the blocks the receiver still holds.
- **Growth.** A payload larger than every segment of the pool, or one that finds the
  pool full of payloads the receiver still views (never of payloads nobody has read
  yet: a slow reader meets backpressure), makes the receiver add a segment (``cudaMalloc``, exported through the pool
  directory) as large as the pool already is, up to 16 segments and ``pool_max_bytes``
  in all (default: ``pool_bytes`` plus 3/4 of the device memory free when the pool
  opened); a grown segment nothing holds for 2 s is given back. ``stats()`` shows the
  receiver's ``pool_segments`` and ``pool_bytes_now``.
- **Backpressure.** Past that bound ``put`` waits (bounded by its timeout,
  ``TransferTimeout``) while the pool is full (or ``max_blocks`` blocks are out); a
  payload larger than every segment is a ``CapacityError`` naming the sizes and the
  option to raise. ``discard`` gives a withdrawn or unread payload's block back.
- **Counters.** ``device_puts`` / ``device_gets`` count messages with a device part;
  ``timeouts`` includes the sender end's waits for a receiver or for room.
- **Testability.** Every CUDA call is a method of one device-operations object
  (``devpool.CudaDeviceOps``, made by ``CudaIpcConnector._make_ops``); the test suite runs
  the whole control plane over a host-memory double of it.

The shm backend's device-IPC route uses the same pool ends without this connector (and
without an inner channel): its messages ride the shm channel's own.

One sender and one receiver per channel. ``connect("cuda_ipc", ...)`` in a process
without CUDA or without cuda-python raises ``CudaError`` with the reason, and the backend
reports itself unavailable with that reason (``omnilink info``).

=============  ==========================================================================
``connector``  ``CudaIpcConnector``: options, the inner shm channel, counters
=============  ==========================================================================

Exports: ``CudaIpcConnector``, ``DEFAULT_POOL_BYTES``, ``cuda_ipc_unavailable``,
``live_pool_owner`` (what the shm backend's automatic device IPC looks for; these three
are the device pool's, re-exported here).
"""

from __future__ import annotations

from omnilink.connectors.cuda_ipc.connector import DEFAULT_POOL_BYTES, CudaIpcConnector, live_pool_owner
from omnilink.connectors.devpool import cuda_ipc_unavailable

__all__ = ["DEFAULT_POOL_BYTES", "CudaIpcConnector", "cuda_ipc_unavailable", "live_pool_owner"]
