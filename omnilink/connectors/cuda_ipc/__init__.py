"""The ``cuda_ipc`` backend: CUDA tensors between two processes of one host, GPU to GPU.

The receiver owns one device pool, ``cudaMalloc``-ed and exported through CUDA IPC once;
the sender maps it once and copies each CUDA tensor of a payload straight into a block
of it (one ``cudaMemcpyAsync`` per tensor, device-to-device, or a peer copy over
NVLink/PCIe P2P when the devices differ). The receiver's ``get`` returns views of that
block. Nothing is exported per message, no torch sharing or refcount files are used, and
nothing is unpickled. CPU tensors and metadata of the same payload travel the ``shm`` way.

How a payload travels::

    sender                                            receiver (owns the pool)
    ------                                            ------------------------
    (once) find the pool directory in /dev/shm,       (once) cudaMalloc the pool,
      cudaIpcOpenMemHandle(lazy peer access),           cudaIpcGetMemHandle, write the
      create N interprocess events on the pool's        directory (handle, size, device)
      device, publish their handles
    put: allocate a block (first fit, 256-aligned;
      frees drained from the released ring)
      cudaMemcpyAsync per CUDA tensor -> block on
      the caller's current stream, record the slot
      event there (tensors of another GPU: on the
      pool device's copy stream, after an event of
      the caller's streams, which then wait on the
      copies); the host never blocks
      publish (manifest, host part) on an inner
      shm channel                          ---------> get: validate the manifest; the
                                                        caller's current stream waits on the
                                                        slot event (cudaStreamWaitEvent, host
                                                        not blocked); write the slot's
                                                        done_seq; views of the block
                                                        ... last view dies (or release(key))
    next put drains the released ring     <---------  after the reader's stream is past
                                                        the block: push it on the ring

Design
------
- **Control plane.** Descriptors, wake-ups, the key contract, heartbeats and the death of
  a sender (``PeerLostError`` in ``get``) come from an inner ``ShmConnector`` on channel
  ``<channel>/cuda-ipc``. Its message is ``{"d": manifest, "h": host part, "n": size}``:
  the host part is the payload with ``None`` where each CUDA tensor was (one walk of
  the payload on the sender); the manifest is ``[generation, seq, slot, block offset,
  block bytes, [[dtype code, offset in block, nbytes, shape, path], ...]]``, ``path``
  the dict keys and list or tuple indices that lead to the tensor. It is bounded and
  validated on receipt (block inside the pool, each region inside the block, ``nbytes ==
  numel * itemsize``, shapes and paths bounded, slot in range), the tensor list once per
  distinct list (a stream of same-shaped payloads repeats it); each view is put at its
  path, which must lead to a ``None`` of the host part (no second walk of the payload).
- **Pool directory** (``directory``): a 0600 segment the receiver creates, named like an
  arena of the receiver (``<prefix>-a<pid>-<token>``, token from the channel name), so
  ``omnilink gc`` and every connector's start-up remove it once its receiver is dead. It
  holds the pool's IPC handle, size, device (and UUID), the sender's event handles with a
  per-slot ``rec_seq`` (sender) / ``done_seq`` (receiver), the released ring (receiver
  pushes freed blocks, the sender drains them when it allocates) and the held list.
- **Event slots.** Interprocess events (``cudaEventInterprocess``) must live on the
  device that owns the memory, so the sender's copy stream is on the pool's device and a
  copy from another GPU pulls over peer access, enabled both ways in the sender (imported
  memory reaches another GPU at peer speed only then). The sender prefers a slot whose
  last record the receiver has already waited on (a wait captures the record at call
  time): ``done_seq >= rec_seq``. With more unread payloads than slots it records the
  oldest slot again, which stays correct (every record is on the one copy stream, so a
  later record completes after the earlier copy) and only makes a late reader wait for
  newer copies too.
- **Lifetimes.** A block is freed when the last view dies (``weakref.finalize`` on a lease
  object whose ``__cuda_array_interface__`` the views were made from), once the work
  queued on that thread's current stream is past it. A closed receiver frees its pool
  when its last view dies. The sender keeps its source tensors alive until its copies
  complete (one completion thread per process).
- **Faults.** The sender checks its receiver's pid and the directory's state every
  0.25 s (and in each ``put``, a pidfd poll: ``omnilink._util.PeerWatch``). A receiver that died or closed: the sender closes its pool
  handle and ``put`` raises ``PeerLostError`` at once (a later put attaches to a new
  receiver, if one opened the channel since). The receiver learns of a dead sender from
  the shm control plane and from the sender pid in the directory. A sender that died: the receiver's pool is intact; payloads
  whose copies cannot be confirmed raise ``PeerLostError`` in ``get``; a new sender asks
  the receiver for the blocks it still holds (``want_gen`` / ``ack_gen``) and starts its
  allocator from them.
- **Backpressure.** ``put`` waits (bounded by its timeout, ``TransferTimeout``) while the
  pool is full (or ``max_blocks`` blocks are out), draining the released ring every
  0.5 ms and checking the receiver's liveness; a payload larger than the pool is a
  ``CapacityError``.
- **Testability.** Every CUDA call is a method of one device-operations object
  (``ops.CudaDeviceOps``); the test suite runs the whole control plane over a host-memory
  double of it.

One sender and one receiver per channel. ``connect("cuda_ipc", ...)`` in a process
without CUDA or without cuda-python raises ``CudaError`` with the reason, and the backend
reports itself unavailable with that reason (``omnilink info``).

=============  ==========================================================================
``connector``  ``CudaIpcConnector``
``directory``  the pool directory's layout, the released ring, the held list
``blocks``     the sender's first-fit allocator over the pool (with ``reserve``)
``ops``        ``CudaDeviceOps``: the CUDA calls; ``cuda_ipc_unavailable()``
=============  ==========================================================================

Exports: ``CudaIpcConnector``, ``DEFAULT_POOL_BYTES``, ``cuda_ipc_unavailable``,
``live_pool_owner`` (what the shm backend's automatic device IPC looks for).
"""

from __future__ import annotations

from omnilink.connectors.cuda_ipc.connector import DEFAULT_POOL_BYTES, CudaIpcConnector, live_pool_owner
from omnilink.connectors.cuda_ipc.ops import cuda_ipc_unavailable

__all__ = ["DEFAULT_POOL_BYTES", "CudaIpcConnector", "cuda_ipc_unavailable", "live_pool_owner"]
