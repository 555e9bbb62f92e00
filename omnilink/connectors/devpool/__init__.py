"""The device pool: CUDA tensors between two processes of one host, GPU to GPU, through
a pool the receiver owns.

Both transports that move CUDA tensors this way build on this package: the ``cuda_ipc``
backend (the pool's two ends plus an inner shm channel that carries their messages) and
the ``shm`` backend's device-IPC route (the two ends, their messages riding the shm
channel's own). It imports neither connector package; what it needs of ``/dev/shm``
comes from ``omnilink.connectors.shmem``. Each end is a plain object, not a connector:
the transport around it carries the message, counts, and raises its own errors around
these.

How a payload travels::

    PoolSender                                        PoolReceiver (owns the pool)
    ----------                                        ----------------------------
    (once) find the pool directory in /dev/shm,       (once) cudaMalloc the pool,
      cudaIpcOpenMemHandle(lazy peer access),           cudaIpcGetMemHandle, write the
      create N interprocess events on the pool's        directory (handle, size, device)
      device, publish their handles
    send: allocate a block (first fit, 256-aligned;
      frees drained from the released ring; no
      room: ask for a segment             ---------->  (heartbeat) cudaMalloc a segment,
      and map it when it is published    <----------    publish its handle (or refuse)
      cudaMemcpyAsync per CUDA tensor -> block on
      the caller's current stream, record the slot
      event there (tensors of another GPU: on the
      pool device's copy stream, after an event of
      the caller's streams, which then wait on the
      copies); the host never blocks
      publish(message): the transport carries
      it                                   ---------> land(key, message): validate the
                                                        manifest; the caller's current
                                                        stream waits on the slot event
                                                        (cudaStreamWaitEvent, host not
                                                        blocked); write the slot's
                                                        done_seq; views of the block
                                                        ... last view dies (or release(key))
    next send drains the released ring   <---------   after the reader's stream is past
                                                        the block: push it on the ring

Design
------
- **Message** (``manifest``): ``{"d": manifest, "h": host part, "n": size}``, one walk of
  the payload on the sender: the host part is the payload with ``None`` where each CUDA
  tensor was; the manifest is ``[generation, seq, slot, block address, block bytes,
  [[dtype code, offset in block, nbytes, shape, path], ...]]``, ``path`` the dict keys
  and list or tuple indices that lead to the tensor. It is bounded and validated on
  receipt (block inside a live segment, each region inside the block, ``nbytes == numel *
  itemsize``, shapes and paths bounded, slot in range), the tensor list once per
  distinct list (a stream of same-shaped payloads repeats it); each view is put at its
  path, which must lead to a ``None`` of the host part (no second walk of the payload).
- **Pool directory** (``directory``): a 0600 segment the receiver creates, named like an
  arena of the receiver (``<prefix>-a<pid>-<token>``, token from the channel name), so
  ``omnilink gc`` and every shm connector's start-up remove it once its receiver is
  dead. It holds the pool's segment table (IPC handle and size of each), its device
  (and UUID), the growth request and answer, the sender's event
  handles with a per-slot ``rec_seq`` (sender) / ``done_seq`` (receiver), the released
  ring (receiver pushes freed blocks, the sender drains them when it allocates) and the
  held list. ``live_pool_owner(channel)`` reads it without a CUDA call.
- **Publish, then copy.** ``PoolSender.send`` publishes a payload's message (block, slot,
  sequence) before it queues the copy and records the slot's event, then stores the
  sequence in the slot's ``rec_seq``; the receiver claims, checks and views the block in
  the meantime and makes its stream wait on the event only once ``rec_seq`` has reached
  that sequence (a serial consumer's landing overlaps the sender's copy calls). What
  the reader does not need to land the payload also comes after publishing: the
  payload's tensor_blob size (``cuda_ipc``'s ``put`` returns it; the message says ``n =
  -1`` and the sender stores it in the slot's ``rec_size``, tagged with the sequence,
  right after ``rec_seq``: the reader looks for it last, and sizes the payload itself
  if it does not come at once), the receiver's liveness check
  (still before the copy) and the drain of the blocks it freed. A copy
  that fails after its message was claimed marks ``rec_seq`` with ``COPY_FAILED`` (the
  reader raises ``TransportError``) and the sender attaches again as a new generation;
  one that fails before is withdrawn.
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
  complete (one completion thread per process). A message withdrawn unread gives its
  block back on either side (``PoolSender.withdrawn``, ``PoolReceiver.drop``).
- **Faults.** The sender checks its receiver's pid and the directory's state every
  0.25 s (and in each ``send``, a pidfd poll: ``omnilink._util.PeerWatch``). A receiver
  that died or closed: the sender closes its pool handle and ``send`` raises
  ``PeerLostError`` at once (a later send attaches to a new receiver, if one opened the
  channel since). A sender that died: the receiver's pool is intact; payloads whose
  copies cannot be confirmed raise ``PeerLostError`` in ``land``; a new sender asks the
  receiver for the blocks it still holds (``want_gen`` / ``ack_gen``, answered on the
  receiver's heartbeat thread) and starts its allocator from them.
- **Growth.** The pool is up to 16 segments (``MAX_SEGMENTS``), each a ``cudaMalloc`` of
  the receiver (it owns the memory: device memory of a dead exporter is gone); segment 0
  is the pool it opens with, never given back before close. A block's address is
  ``segment << 48 | offset`` (the manifest, the released ring and the held list carry one
  int; the receiver checks the segment is live and the block inside it before any view).
  When no live segment has room for a payload (at once when it is larger than every
  segment, else after ``GROW_AFTER_S`` without a free), the sender asks for a segment
  (``grow request``/``grow bytes`` in the directory) as large as the pool already is or
  as the payload, whichever is more, within the bound: the pool doubles. The receiver
  answers on its heartbeat thread: it allocates the segment, publishes its handle in the
  segment table and bumps the segment generation, or refuses past ``pool_max_bytes``
  (default: the pool's size plus 3/4 of the device memory free when it opened), out of
  memory or out of entries; the sender maps the new segment and allocates there. So the
  pool grows while its receiver holds payloads, as the shm arena's extensions do, and
  only then: payloads nobody has read yet never grow it (the receiver publishes the
  bytes it holds, ``held bytes``; if the sender's unread blocks with the new payload
  would not fit in segment 0, or in the payload's own size, a reader is slow and the
  sender waits).
- **Shrink.** A grown segment with no block the receiver holds for ``idle_s`` (2 s) is
  given back in three steps, one writer each: the receiver marks it retiring (and bumps
  the segment generation); the sender (on its heartbeat) allocates there no more,
  closes its handle once no block of its own is left there and sets the segment's
  ``released`` flag; the receiver then frees it (at once if the sender died: its
  mapping went with it). Segment 0 stays until close.
- **Backpressure.** Past the bound, ``send`` waits (bounded by its ``room`` deadline,
  ``TransferTimeout``) while the pool is full (or ``max_blocks`` blocks are out),
  draining the released ring and checking the receiver's liveness; a payload larger
  than every segment that the pool cannot grow for is a ``CapacityError`` naming the
  sizes and the option to raise (the shm route counts it in ``stats().ipc_fallbacks``,
  with the reason).
- **One process, both ends.** A process cannot open its own IPC handles: a sender whose
  receiver lives in the same process uses the pointer and events directly (``process``).
- **Testability.** Every CUDA call is a method of one device-operations object
  (``ops.CudaDeviceOps``); the test suite runs the whole control plane over a host-memory
  double of it.

One receiver and one sender per channel.

=============  ==========================================================================
``receiver``   ``PoolReceiver``: the pool, its directory, landing and dropping messages
``sender``     ``PoolSender``: attach, allocate, event slots, ``send``, withdraw, detach
``manifest``   the message's device part: the payload walk, bounds, views put at paths
``directory``  the pool directory's layout, the released ring, the held list;
               ``live_pool_owner``
``blocks``     the sender's first-fit allocator over the pool (with ``reserve``)
``ops``        ``CudaDeviceOps``: the CUDA calls; ``cuda_ipc_unavailable()``
``process``    same-process shortcuts, the heartbeat thread of each end
=============  ==========================================================================

Exports: ``PoolReceiver``, ``PoolSender``, ``CudaDeviceOps``, ``cuda_ipc_unavailable``,
``live_pool_owner``, ``round_up`` and the defaults ``DEFAULT_POOL_BYTES``,
``DEFAULT_EVENT_SLOTS``, ``DEFAULT_MAX_BLOCKS``.
"""

from __future__ import annotations

from omnilink.connectors.devpool.blocks import round_up
from omnilink.connectors.devpool.directory import live_pool_owner
from omnilink.connectors.devpool.manifest import one_device
from omnilink.connectors.devpool.ops import CudaDeviceOps, cuda_ipc_unavailable
from omnilink.connectors.devpool.receiver import PoolReceiver
from omnilink.connectors.devpool.sender import PoolSender

__all__ = [
    "DEFAULT_EVENT_SLOTS",
    "DEFAULT_MAX_BLOCKS",
    "DEFAULT_POOL_BYTES",
    "CudaDeviceOps",
    "PoolReceiver",
    "PoolSender",
    "cuda_ipc_unavailable",
    "live_pool_owner",
    "one_device",
    "round_up",
]

#: Default size of the receiver's device pool.
DEFAULT_POOL_BYTES = 256 << 20
#: Default interprocess events a sender creates (once, on attach).
DEFAULT_EVENT_SLOTS = 128
#: Default most payloads in flight or viewed at once (the released ring's size).
DEFAULT_MAX_BLOCKS = 4096
