"""The CUDA layer: moving payloads between GPUs and the transports' host buffers.

Importing this package never initialises CUDA; every module imports torch and
cuda-python on first use.

=============  ==========================================================================
``device``     ``payload_to_device``: the plain, synchronous ``.to(device)`` of a decoded
               payload (the fallback when no copy controller applies)
=============  ==========================================================================

What comes next lives here too, one module per part: the pinned ring pool that *is* the
shm arena (registered with ``cudaHostRegister`` once per mapping), the asynchronous
device-to-host and host-to-device controllers on their own streams, and the handles and
futures they return.
"""

from __future__ import annotations

from omnilink.cuda.device import payload_to_device

__all__ = ["payload_to_device"]
