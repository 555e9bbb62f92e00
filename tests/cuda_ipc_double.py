"""TEST DOUBLE (never offered to users): the ``cuda_ipc`` backend over host memory.

``HostDeviceOps`` stands in for ``omnilink.connectors.devpool.ops.CudaDeviceOps`` so the
backend's whole control plane (pool directory, allocation and frees, event slots,
manifests, the key contract, faults) runs on a CPU-only machine:

- the "device pool" is a ``memfd`` mapped in the receiver; its "IPC handle" is
  ``b"<pid>:<fd>"``, opened by another process through ``/proc/<pid>/fd/<fd>`` (same user)
  and mapped there: two processes really share it, and nothing lands in ``/dev/shm``;
- every torch tensor counts as a "device" tensor, so all of a payload's tensors take the
  pool path; copies are ``ctypes.memmove`` (synchronous: the event semantics collapse to
  "done at record time"), and each event counts its records and waits so tests can check
  the slot protocol;
- views are made through ``__array_interface__`` instead of ``__cuda_array_interface__``.

``HostCudaIpc`` is the connector class wired to it; ``register()`` registers it as the
backend ``"cuda_ipc_host"`` for tests that go through ``omnilink.connect``.
``host_route(conn)`` gives a shm connector a device-IPC route over the same double
(``HostDeviceIpcRoute``), and ``route_put`` sends a payload by it: shm's ``put`` takes
the route only for CUDA tensors, so tests call the route as that ``put`` would.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from typing import Any, Callable

import numpy as np
import torch

from omnilink.blob import prepare
from omnilink.connectors.cuda_ipc import CudaIpcConnector
from omnilink.connectors.shm.ipc import DeviceIpcRoute

HANDLE = 64


class HostEvent:
    """A stand-in for an interprocess event: counts what happened to it."""

    def __init__(self, name: bytes) -> None:
        self.name = name
        self.records = 0
        self.waits = 0


class _Holder:
    """Makes a lease's bytes an ndarray (host memory: ``__array_interface__``)."""

    def __init__(self, lease: Any, ptr: int, nbytes: int) -> None:
        self.lease = lease
        self.__array_interface__ = {"version": 3, "typestr": "|u1", "shape": (nbytes,),
                                    "data": (ptr, False)}


class _Lease:
    __slots__ = ("ptr", "nbytes", "__weakref__")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes


class HostDeviceOps:
    """Host-memory double of ``CudaDeviceOps`` (same methods, same contracts)."""

    name = "host-double"
    #: what ``free_bytes`` reports (the pool's default growth bound derives from it)
    FREE_BYTES = 64 << 20
    #: every instance's pools and mappings, for tests that inspect them
    pools: dict[int, tuple[int, mmap.mmap, Any]] = {}
    lock = threading.Lock()

    def __init__(self) -> None:
        self.opened: dict[int, tuple[mmap.mmap, Any]] = {}
        self.copies = 0
        self.staged = 0
        self.waits: list[HostEvent] = []
        self.after_use_calls = 0
        #: waits for a stage's last copy (``settle``), and copies that would wait for it
        #: themselves (``copy_in_local`` not told it is done)
        self.settles = 0
        self.settles_in_copy = 0
        #: plan copies from a device other than the pool's (``copy_in_peer``)
        self.peer_copies = 0

    def is_device_tensor(self, t: Any) -> bool:
        return True

    def is_small_host_tensor(self, t: Any, most: int) -> bool:
        return False  # every tensor is a "device" tensor here (HostLikeOps below says otherwise)

    @staticmethod
    def tensor_device(t: Any) -> int:
        return 0  # every tensor is on "device" 0

    @staticmethod
    def plan_checks() -> tuple[str, str]:
        # Every tensor is a "device" tensor of device 0 here (and a subclass that says
        # otherwise by dtype is pinned by the plan's dtype check).
        return "False", "False"

    def copy_in_local(self, index: int, items: list[tuple[int, Any]], event: Any, hosted: Any,
                      settled: bool = False) -> None:
        if hosted is not None and not settled:
            self.settles_in_copy += 1
        self.copy_in(index, items, event, None, hosted=hosted)

    def copy_in_peer(self, index: int, src: int, items: list[tuple[int, Any]], event: Any, hosted: Any,
                     settled: bool = False) -> None:
        self.peer_copies += 1
        self.copy_in_local(index, items, event, hosted, settled)

    @staticmethod
    def to_host(t: Any) -> Any:
        return t.clone()  # a copy of its own, out of the pool, as the real one's .cpu()

    #: what ``mps_serving`` answers
    MPS = True

    def mps_serving(self) -> bool:
        return self.MPS

    def new_stage(self, nbytes: int) -> Any:
        return bytearray(nbytes)

    @staticmethod
    def stage_slice(arena: Any, offset: int, nbytes: int) -> Any:
        return memoryview(arena)[offset : offset + nbytes]

    @staticmethod
    def stage_bytes(stage: Any) -> int:
        return len(stage)

    def settle(self, event: Any) -> None:
        self.settles += 1

    def device_index(self, device: Any) -> int:
        return 0

    def device_uuid(self, index: int) -> bytes:
        return b""

    def index_of_uuid(self, uuid: bytes, fallback: int) -> int:
        return fallback

    def alloc_pool(self, index: int, nbytes: int) -> tuple[int, bytes]:
        fd = os.memfd_create("omnilink-test-pool", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
        anchor = ctypes.c_char.from_buffer(mm)
        ptr = ctypes.addressof(anchor)
        with self.lock:
            self.pools[ptr] = (fd, mm, anchor)
        return ptr, f"{os.getpid()}:{fd}".encode().ljust(HANDLE, b"\0")

    def free_bytes(self, index: int) -> int:
        return self.FREE_BYTES

    def free_pool(self, index: int, ptr: int) -> None:
        with self.lock:
            fd, mm, anchor = self.pools.pop(ptr)
        del anchor
        mm.close()
        os.close(fd)

    def open_pool(self, index: int, handle: bytes) -> int:
        pid, fd = handle.rstrip(b"\0").decode().split(":")
        with open(f"/proc/{pid}/fd/{fd}", "r+b") as f:
            mm = mmap.mmap(f.fileno(), 0)
        anchor = ctypes.c_char.from_buffer(mm)
        ptr = ctypes.addressof(anchor)
        self.opened[ptr] = (mm, anchor)
        return ptr

    def close_pool(self, index: int, ptr: int) -> None:
        mm, anchor = self.opened.pop(ptr)
        del anchor
        mm.close()

    def create_events(self, index: int, n: int) -> list[tuple[Any, bytes]]:
        out = []
        for i in range(n):
            name = f"ev-{os.getpid()}-{id(self)}-{i}".encode()
            out.append((HostEvent(name), name.ljust(HANDLE, b"\0")))
        return out

    def open_events(self, index: int, handles: list[bytes]) -> list[Any]:
        return [HostEvent(h.rstrip(b"\0")) for h in handles]

    def destroy_events(self, index: int, events: list[Any]) -> None:
        pass

    def producer_events(self, payload: Any) -> Any:
        return None

    def copy_in(self, index: int, items: list[tuple[int, Any]], event: Any, after: Any = None, *,
                hosted: Any = None) -> None:
        for dst, t in items:
            n = t.numel() * t.element_size()
            if n:
                ctypes.memmove(dst, t.data_ptr(), n)
        if hosted is not None:  # as the real one: gathered in the stage, then one copy
            dst, parts, span, stage = hosted
            assert len(stage) >= span
            view = (ctypes.c_char * len(stage)).from_buffer(stage)
            for o, t in parts:
                n = t.numel() * t.element_size()
                if n:
                    ctypes.memmove(ctypes.addressof(view) + o, t.data_ptr(), n)
            ctypes.memmove(dst, ctypes.addressof(view), span)
            del view
            self.staged += 1
        event.records += 1
        self.copies += 1

    def wait(self, index: int, event: Any) -> None:
        event.waits += 1
        self.waits.append(event)

    def view(self, ptr: int, nbytes: int, index: int) -> tuple[Any, Any]:
        lease = _Lease(ptr, nbytes)
        return torch.from_numpy(np.asarray(_Holder(lease, ptr, nbytes))), lease

    def after_use(self, index: int, callback: Callable[[], None]) -> None:
        self.after_use_calls += 1
        callback()

    def synchronize(self, index: int) -> None:
        pass

    def drain(self) -> None:
        pass


class HostCudaIpc(CudaIpcConnector):
    """The ``cuda_ipc`` connector over ``HostDeviceOps`` (tests only)."""

    @staticmethod
    def _make_ops() -> Any:
        return HostDeviceOps()

    @staticmethod
    def unavailable_reason() -> str | None:
        return None


def register() -> None:
    import omnilink

    omnilink.register_backend("cuda_ipc_host", HostCudaIpc, replace=True)


class HostDeviceIpcRoute(DeviceIpcRoute):
    """The shm backend's device-IPC route over ``HostDeviceOps`` (tests only)."""

    @staticmethod
    def _make_ops() -> Any:
        return HostDeviceOps()

    @staticmethod
    def _unavailable() -> str | None:
        return None


#: the dtypes ``HostLikeOps`` takes for host tensors
HOSTLIKE = (torch.int64, torch.bool)


class HostLikeOps(HostDeviceOps):
    """Int64 and bool tensors stand for host tensors (small ones may ride in the pool
    block), every other tensor for a device one: a vLLM-Omni chunk's bf16 hidden state,
    token ids and flag take the roads they take on a GPU."""

    def is_device_tensor(self, t: Any) -> bool:
        return t.dtype not in HOSTLIKE

    def is_small_host_tensor(self, t: Any, most: int) -> bool:
        return t.dtype in HOSTLIKE and t.nbytes <= most


class HostLikeIpcRoute(HostDeviceIpcRoute):
    """``HostDeviceIpcRoute`` over ``HostLikeOps``."""

    @staticmethod
    def _make_ops() -> Any:
        return HostLikeOps()


def host_route(conn: Any, *, mode: str = "on", pool_bytes: int = 4 << 20, min_bytes: int | None = 0,
               pool_max_bytes: int | None = None) -> HostDeviceIpcRoute:
    """Give the shm connector ``conn`` (opened with ``device_ipc="off"``) a device-IPC
    route over the host double (its ``"on"`` receiver opens its pool now); ``conn.close()``
    closes it."""
    assert conn._ipc is None, "open the connector with device_ipc='off'"
    conn._ipc = HostDeviceIpcRoute(conn, mode, pool_bytes, min_bytes, None, pool_max_bytes=pool_max_bytes)
    return conn._ipc


def route_put(conn: Any, key: str, payload: Any, timeout: float = 5.0) -> int | None:
    """Send ``payload`` by ``conn``'s device-IPC route as its ``put`` would for a CUDA
    payload: the bytes sent, or ``None`` when the route handed it to the host path."""
    from omnilink._util import Deadline

    return conn._ipc.put(key, payload, prepare(payload), Deadline(timeout), None)


@contextlib.contextmanager
def host_pair(channel: str, sender: type = HostCudaIpc):
    """A receiver (4 MiB pool, 4 event slots) and a sender (of class ``sender``, a
    ``HostCudaIpc``) of ``channel`` over the host-memory double, closed on the way out:
    ``(tx, rx)``."""
    rx = HostCudaIpc(channel=channel, role="receiver", pool_bytes=4 << 20, event_slots=4)
    tx = sender(channel=channel, role="sender", linger=0)
    try:
        yield tx, rx
    finally:
        tx.close()
        rx.close()
