"""The few CUDA runtime facts the copy controllers need, with errors translated.

- ``cuda_available()``: whether torch sees a CUDA device (never creates a context).
- ``HostRegistration``: page-locks an existing host mapping (a ``/dev/shm`` arena) with
  ``cudaHostRegister`` once, and unregisters it once, before its owner unmaps it.
  Registration costs milliseconds per GiB, so it is never done per message.
- ``sync_debug()``: the debug switch ``OMNILINK_CUDA_SYNC=1``, read by each controller
  once when it is created: every copy is then host-synchronous, for bisecting.
- ``record_producer_events(payload)``: in the caller's thread, one event per CUDA device
  of the payload, recorded on that device's *current* stream, so a copy stream that waits
  on it sees every write the producer queued before the call.

cudaHostRegister is called through cuda-python (``cuda.bindings.runtime``) when it is
installed (``pip install omnilink[cuda]``), else through torch's own binding of the
CUDA runtime (``torch.cuda.cudart()``), which every CUDA build of torch has.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from omnilink._errors import CudaError

__all__ = [
    "HostRegistration",
    "cuda_available",
    "cuda_devices_of",
    "record_producer_events",
    "sync_debug",
]

logger = logging.getLogger(__name__)

#: cudaHostRegisterPortable: the memory counts as pinned in every CUDA context of the
#: process, so copies to and from any device run as DMA.
_REGISTER_PORTABLE = 1
#: cudaErrorHostMemoryAlreadyRegistered
_ALREADY_REGISTERED = 712

SYNC_ENV = "OMNILINK_CUDA_SYNC"


def sync_debug() -> bool:
    """Whether ``OMNILINK_CUDA_SYNC`` asks for host-synchronous copies (read per call:
    controllers call it once, at creation)."""
    return os.environ.get(SYNC_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def cuda_available() -> bool:
    """Whether torch is importable and sees a CUDA device."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - a broken driver counts as none
        return False


def _runtime_call(name: str, *args: Any) -> int:
    """Call CUDA runtime function ``name``; return its error code (0 is success)."""
    try:
        from cuda.bindings import runtime as cudart  # type: ignore[import-not-found]
    except ImportError:
        cudart = None
    if cudart is not None:
        res = getattr(cudart, name)(*args)
        err = res[0] if isinstance(res, tuple) else res
        return int(err)
    import torch

    return int(getattr(torch.cuda.cudart(), name)(*args))


class HostRegistration:
    """Page-locks ``[address, address + nbytes)`` for DMA until ``close()``.

    Parameters
    ----------
    address : int
        Start of a host mapping this process owns (page aligned, as mmap gives).
    nbytes : int
        Its length.
    what : str
        Said in errors and logs (``"arena omnilink-1234-ab..."``).

    Raises
    ------
    CudaError
        CUDA is unavailable or ``cudaHostRegister`` failed.

    Notes
    -----
    Unregister (``close()``) before unmapping the memory: an unmapped registered range
    leaves the driver with a stale mapping. ``close`` is idempotent; a registration that
    was never closed is unregistered when it is collected (``weakref.finalize``), which
    is only safe while the mapping is still there, so owners close it explicitly.
    """

    def __init__(self, address: int, nbytes: int, *, what: str = "host memory") -> None:
        import weakref

        if not cuda_available():
            raise CudaError(f"cannot page-lock {what}: CUDA is not available in this process")
        self.address = int(address)
        self.nbytes = int(nbytes)
        self.what = what
        self._lock = threading.Lock()
        try:
            err = _runtime_call("cudaHostRegister", self.address, self.nbytes, _REGISTER_PORTABLE)
        except Exception as exc:
            raise CudaError(f"cudaHostRegister of {what} ({self.nbytes} bytes) failed: {exc}") from exc
        if err not in (0, _ALREADY_REGISTERED):
            raise CudaError(f"cudaHostRegister of {what} ({self.nbytes} bytes) failed with CUDA error {err}")
        self._owned = err == 0
        self._finalizer = weakref.finalize(self, _unregister, self.address, self.what) if self._owned else None
        logger.debug("page-locked %s: %d bytes at %#x", what, self.nbytes, self.address)

    @property
    def closed(self) -> bool:
        return self._finalizer is None or not self._finalizer.alive

    def close(self) -> None:
        """Unregister (once). Call before the memory is unmapped."""
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()

    def __enter__(self) -> HostRegistration:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _unregister(address: int, what: str) -> None:
    try:
        err = _runtime_call("cudaHostUnregister", address)
    except Exception:  # pragma: no cover - process teardown with CUDA gone
        logger.debug("cudaHostUnregister of %s raised", what, exc_info=True)
        return
    if err != 0:  # pragma: no cover - a driver reset; nothing to do but say so
        logger.warning("cudaHostUnregister of %s failed with CUDA error %d", what, err)


def cuda_devices_of(payload: Any) -> list[Any]:
    """The distinct CUDA devices of the torch tensors in ``payload`` (dict/list/tuple tree)."""
    import torch

    devices: dict[Any, None] = {}

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.is_cuda:
                devices.setdefault(x.device, None)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(payload)
    return list(devices)


def record_producer_events(devices: list[Any]) -> list[tuple[Any, Any]]:
    """``[(device, event)]``: an event recorded now on each device's current stream.

    Called in the producer's thread: a copy stream that waits on these events runs after
    every kernel the producer queued before the call, whichever thread issues the copy.
    """
    import torch

    out = []
    for dev in devices:
        with torch.cuda.device(dev):
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
        out.append((dev, ev))
    return out
