"""The CUDA layer: moving payloads between GPUs and the transports' host buffers.

Importing this package never initialises CUDA (or imports torch); every module imports
torch and cuda-python on first use.

=============  ==========================================================================
``pool``       ``PinnedRingPool``: page-locked staging handed out in 64-byte blocks, with
               backpressure; standalone (its own pinned memory) or over a buffer someone
               else owns (the shm arena), page-locked once with ``cudaHostRegister``
``d2h``        ``AsyncD2HController``: device-to-host copies on a dedicated stream, event
               ordered after the producer's stream; ``BatchPayloadFuture`` (done / wait /
               result, retain / release) and ``BatchPayloadSliceRef`` (one request's
               rows of a batched payload)
``h2d``        ``AsyncH2DController``: host-to-device copies on a dedicated stream;
               ``StagePayloadHandle.wait(stream)`` orders the consumer's stream after the
               copy without blocking the host
``events``     ``Completer``: runs what must follow a copy (release a block, resolve a
               future) once its event completes, on its own thread
``runtime``    ``HostRegistration`` (cudaHostRegister / Unregister), producer events,
               the ``OMNILINK_CUDA_SYNC=1`` debug switch
``device``     ``payload_to_device``: the plain synchronous ``.to(device)`` fallback
``nccl``       ``NcclLibrary`` / ``NcclComm``: NCCL's point-to-point calls through its C
               API (``ctypes``), the nccl backend's data path between GPUs
=============  ==========================================================================

The shm backend builds its GPU path from these: a sender's device tensors are copied by
DMA straight into its arena block (page-locked once), a receiver copies from its own
page-locked mapping of that block to its device, and large payloads travel in slices so
both directions of PCIe run at once (see ``omnilink.connectors.shm``).
"""

from __future__ import annotations

from omnilink.cuda.d2h import AsyncD2HController, BatchPayloadFuture, BatchPayloadSliceRef, map_tensors
from omnilink.cuda.device import payload_to_device
from omnilink.cuda.events import Completer
from omnilink.cuda.h2d import AsyncH2DController, StagePayloadHandle
from omnilink.cuda.nccl import NCCL_LIBRARY_ENV, NcclComm, NcclLibrary, nccl_library
from omnilink.cuda.pool import PinnedRingPool, PoolSlot
from omnilink.cuda.runtime import (
    CudaOps,
    Event,
    HostRegistration,
    cuda_available,
    cuda_ops,
    current_raw_stream,
    cuda_ops_or_none,
    have_cuda_ops,
    cuda_devices_of,
    mps_serving,
    record_producer_events,
    sync_debug,
)
from omnilink.cuda.runtime import CUDA_INSTALL_HINT

__all__ = [
    "CUDA_INSTALL_HINT",
    "NCCL_LIBRARY_ENV",
    "NcclComm",
    "NcclLibrary",
    "nccl_library",
    "AsyncD2HController",
    "CudaOps",
    "Event",
    "AsyncH2DController",
    "BatchPayloadFuture",
    "BatchPayloadSliceRef",
    "Completer",
    "HostRegistration",
    "PinnedRingPool",
    "PoolSlot",
    "StagePayloadHandle",
    "cuda_available",
    "cuda_devices_of",
    "cuda_ops",
    "current_raw_stream",
    "cuda_ops_or_none",
    "have_cuda_ops",
    "map_tensors",
    "mps_serving",
    "payload_to_device",
    "record_producer_events",
    "sync_debug",
]
