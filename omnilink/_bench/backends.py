"""The transports ``omnilink bench`` measures, each split into a sender and a receiver half.

=================  ==================================================================
backend            what one message costs
=================  ==================================================================
``memcpy``         one single-threaded host copy of the tensor bytes (the ceiling; in
                   the parent process, no second process involved)
``pickle-shm``     today's engines: ``pickle.dumps`` (protocol 5, in-band), a fresh
                   ``multiprocessing.shared_memory`` segment per message, its name sent
                   over a pipe, ``pickle.loads`` and unlink on the receiver
``msgpack-shm``    engines' other path: msgspec msgpack with the tensor bytes copied
                   into the message, a fresh segment per message, copied out again
``torch-mp-queue`` ``torch.multiprocessing`` queue: storages moved to shared memory
                   and passed as file descriptors (the sender hands over a fresh
                   tensor per message, as a model step would produce)
``shm``            ``omnilink.connect("shm")``: encode in place into a pre-faulted
                   arena, zero-copy views on the receiver
``zmq``            ``omnilink.connect("zmq")`` over ``ipc://``
``h2d-pinned`` ... one host->device / device->host copy from pinned or pageable memory
                   (``h2d-pageable``, ``d2h-pinned``, ``d2h-pageable``): the ceilings
                   of the ``gpu`` scenario, in the parent process
=================  ==================================================================

In the ``gpu`` scenario the sender's payload lives on ``cuda:0`` and the receiver asks
for ``cuda:0``: pickle and msgpack copy to host inside serialisation and move the result
with ``.to(device)``; omnilink takes the CUDA tensors in ``put`` and ``get(device=)``.

PICKLE IS USED HERE ONLY AS A BASELINE BEING MEASURED. It is imported inside the
baseline's own methods so that nothing else in omnilink can reach it; omnilink's data
path never pickles.

A backend that cannot be loaded (a missing dependency, a backend not built yet) is
reported as ``unavailable`` with the reason by ``probe``; it never stops the run.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

__all__ = ["BACKENDS", "Backend", "LocalBackend", "PairContext", "get_backend", "probe"]


def pool_end(conn: Any, route_attr: str, own_attr: str) -> Any:
    """The device pool's end of an omnilink connector (its sender, ``"_tx"`` /
    ``"_sender"``, or its receiver, ``"_rx"`` / ``"_receiver"``), if it has one: the
    shm backend's device-IPC route's, or the ``cuda_ipc`` connector's own. For the
    benchmarks' counters of what went by it (send plans, views made ahead)."""
    ipc = getattr(conn, "_ipc", None)
    end = getattr(ipc, route_attr, None) if ipc is not None else None
    return end if end is not None else getattr(conn, own_attr, None)


class PairContext:
    """What the two halves of a pair share, handed to both worker processes at spawn.

    Attributes
    ----------
    link_send, link_recv
        The two ends of a one-way ``multiprocessing`` pipe from sender to receiver: the
        side channel on which the segment baselines announce each segment's name (as raw
        bytes, the way engines send a handle over their control plane).
    queue
        A ``torch.multiprocessing`` queue for the ``torch-mp-queue`` baseline.
    prefix
        Name prefix of every shared-memory object the baselines create.
    run_id
        Unique per run: channels and segment names include it.
    """

    def __init__(self, *, link_send: Any, link_recv: Any, queue: Any, prefix: str, run_id: str) -> None:
        self.link_send = link_send
        self.link_recv = link_recv
        self.queue = queue
        self.prefix = prefix
        self.run_id = run_id


class Backend:
    """One transport. Subclasses implement the halves they need.

    ``open_sender`` / ``open_receiver`` run in the worker processes; ``send`` and
    ``recv`` are the timed operations; ``close_*`` must release everything created.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: True for ``memcpy``: measured in the parent, no processes.
    local: ClassVar[bool] = False
    #: The sender must hand over a tensor that was never sent before (``torch-mp-queue``
    #: moves the storage it is given into shared memory once, and would then only pass
    #: a handle to the *same* memory each time, which is not a transfer).
    fresh_tensors: ClassVar[bool] = False
    #: Open the receiver before the sender (it binds what the sender connects to).
    receiver_first: ClassVar[bool] = False

    def probe(self) -> str | None:
        """``None`` when usable here, else the reason it is not."""
        return None

    @classmethod
    def bench_options(cls, sizes: list[int], modes: tuple[str, ...]) -> dict[str, Any]:
        """Options the parent computes for both halves (recorded with the results)."""
        return {}

    def open_sender(self, ctx: PairContext, *, timeout: float, options: dict[str, Any]) -> None:
        raise NotImplementedError

    def open_receiver(self, ctx: PairContext, *, timeout: float, options: dict[str, Any]) -> None:
        raise NotImplementedError

    def send(self, seq: int, payload: Any) -> None:
        raise NotImplementedError

    def recv(self, seq: int, *, device: Any = None) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        """Release what this half created; idempotent."""


def _recv_link(ctx: PairContext, timeout: float) -> bytes:
    if not ctx.link_recv.poll(timeout):
        raise TimeoutError(f"no message from the sender within {timeout} s")
    return ctx.link_recv.recv_bytes()


class _SegmentBaseline(Backend):
    """A fresh ``multiprocessing.shared_memory`` segment per message (engines today)."""

    tag: ClassVar[str] = "seg"

    def __init__(self) -> None:
        self._ctx: PairContext | None = None
        self._timeout = 30.0
        self._made = 0

    def open_sender(self, ctx: PairContext, *, timeout: float, options: dict[str, Any]) -> None:
        self._ctx, self._timeout = ctx, timeout

    def open_receiver(self, ctx: PairContext, *, timeout: float, options: dict[str, Any]) -> None:
        self._ctx, self._timeout = ctx, timeout

    def _serialize(self, payload: Any) -> Any:
        raise NotImplementedError

    def _deserialize(self, view: memoryview) -> Any:
        raise NotImplementedError

    def send(self, seq: int, payload: Any) -> None:
        from multiprocessing import shared_memory

        data = self._serialize(payload)
        n = len(data)
        self._made += 1
        name = f"{self._ctx.prefix}-bench-{self.tag}-{self._ctx.run_id}-{os.getpid()}-{self._made}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=n)
        try:
            shm.buf[:n] = data
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        shm.close()
        self._ctx.link_send.send_bytes(f"{name} {n}".encode())

    def recv(self, seq: int, *, device: Any = None) -> Any:
        from multiprocessing import shared_memory

        name, n = _recv_link(self._ctx, self._timeout).decode().split(" ")
        shm = shared_memory.SharedMemory(name=name)
        try:
            with shm.buf[: int(n)] as view:
                payload = self._deserialize(view)
        finally:
            shm.close()
            shm.unlink()
        if device is not None:
            from omnilink.cuda import payload_to_device

            payload = payload_to_device(payload, device)
        return payload


class PickleShm(_SegmentBaseline):
    name = "pickle-shm"
    description = "pickle (protocol 5, in-band) into a fresh SharedMemory segment per message"
    tag = "pk"

    def _serialize(self, payload: Any) -> bytes:
        # BASELINE BEING MEASURED: this is what serving engines do today. Pickle is
        # never used on omnilink's data path; it lives only in this baseline.
        import pickle

        return pickle.dumps(payload, protocol=5)

    def _deserialize(self, view: memoryview) -> Any:
        # BASELINE BEING MEASURED (see _serialize).
        import pickle

        return pickle.loads(view)


def _tensor_ext(t: Any) -> Any:
    """msgspec ``enc_hook``: a tensor becomes Ext(1, [dtype, shape] header + its bytes)."""
    import msgspec
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"msgpack baseline cannot encode {type(t).__name__}")
    t = t.detach().cpu().contiguous()
    header = msgspec.msgpack.encode([str(t.dtype).removeprefix("torch."), list(t.shape)])
    # The copy that defines this baseline: tensor bytes become a bytes object, which
    # msgspec then copies again into the message.
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return msgspec.msgpack.Ext(1, len(header).to_bytes(4, "little") + header + raw)


def _tensor_from_ext(code: int, data: memoryview) -> Any:
    import msgspec
    import torch

    if code != 1:
        raise ValueError(f"unexpected msgpack ext code {code}")
    hlen = int.from_bytes(data[:4], "little")
    dtype_name, shape = msgspec.msgpack.decode(data[4 : 4 + hlen])
    # Copied out: the segment is unlinked right after decoding.
    raw = bytearray(data[4 + hlen :])
    dtype = getattr(torch, dtype_name)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(shape)


class MsgpackShm(_SegmentBaseline):
    name = "msgpack-shm"
    description = "msgspec msgpack with tensor bytes copied in, fresh segment per message"
    tag = "mp"

    def __init__(self) -> None:
        super().__init__()
        import msgspec

        self._enc = msgspec.msgpack.Encoder(enc_hook=_tensor_ext)
        self._dec = msgspec.msgpack.Decoder(ext_hook=_tensor_from_ext)

    def _serialize(self, payload: Any) -> bytes:
        return self._enc.encode(payload)

    def _deserialize(self, view: memoryview) -> Any:
        return self._dec.decode(view)


class TorchQueue(Backend):
    name = "torch-mp-queue"
    description = "torch.multiprocessing queue (storages to shared memory, fds passed)"
    fresh_tensors = True

    def __init__(self) -> None:
        self._ctx: PairContext | None = None
        self._timeout = 30.0

    def open_sender(self, ctx: PairContext, *, timeout: float, options: dict[str, Any]) -> None:
        import torch.multiprocessing  # noqa: F401  (registers the tensor reductions)

        self._ctx, self._timeout = ctx, timeout

    def open_receiver(self, ctx: PairContext, *, timeout: float, options: dict[str, Any]) -> None:
        import torch.multiprocessing  # noqa: F401

        self._ctx, self._timeout = ctx, timeout

    def send(self, seq: int, payload: Any) -> None:
        self._ctx.queue.put(payload, timeout=self._timeout)

    def recv(self, seq: int, *, device: Any = None) -> Any:
        import queue

        try:
            payload = self._ctx.queue.get(timeout=self._timeout)
        except queue.Empty:
            raise TimeoutError(f"no message from the sender within {self._timeout} s") from None
        if device is not None:
            from omnilink.cuda import payload_to_device

            payload = payload_to_device(payload, device)
        return payload


class _OmnilinkBackend(Backend):
    """``omnilink.connect(<backend>)``: the library itself."""

    backend: ClassVar[str] = ""

    def __init__(self) -> None:
        self._conn: Any = None
        self._timeout = 30.0

    def probe(self) -> str | None:
        from omnilink._errors import OmnilinkError
        from omnilink.connectors import backend_factory

        try:
            backend_factory(self.backend)
        except OmnilinkError as exc:
            return str(exc)
        return None

    def _connect(self, ctx: PairContext, role: str, timeout: float, options: dict[str, Any]) -> None:
        import omnilink

        self._timeout = timeout
        self._conn = omnilink.connect(self.backend, channel=f"bench-{ctx.run_id}/{self.backend}",
                                      role=role, **self.role_options(role, options))

    def role_options(self, role: str, options: dict[str, Any]) -> dict[str, Any]:
        """The subset of ``bench_options`` that ``connect`` takes for ``role``."""
        return dict(options)

    def open_sender(self, ctx: PairContext, *, timeout: float, options: dict[str, Any]) -> None:
        self._connect(ctx, "sender", timeout, options)

    def open_receiver(self, ctx: PairContext, *, timeout: float, options: dict[str, Any]) -> None:
        self._connect(ctx, "receiver", timeout, options)

    def send(self, seq: int, payload: Any) -> None:
        self._conn.put(f"m{seq}", payload, timeout=self._timeout)

    def recv(self, seq: int, *, device: Any = None) -> Any:
        return self._conn.get(f"m{seq}", timeout=self._timeout, device=device)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class OmnilinkShm(_OmnilinkBackend):
    name = "shm"
    backend = "shm"
    description = "omnilink shm: encode in place into a pre-faulted arena, zero-copy views"

    @classmethod
    def bench_options(cls, sizes: list[int], modes: tuple[str, ...]) -> dict[str, Any]:
        """An arena that holds a full window of the largest size, as a deployment sized
        for its payloads would have (the default 128 MiB arena would send 256 MiB
        payloads through the slower per-payload overflow segment)."""
        from omnilink._bench.plan import plan

        # 1 MiB per message covers the header, alignment padding and allocator rounding.
        need = max((s + (1 << 20)) * plan(s, "throughput").window for s in sizes)
        try:
            from omnilink.connectors.shm import DEFAULT_ARENA_BYTES
        except ImportError:
            DEFAULT_ARENA_BYTES = 128 << 20
        return {"arena_bytes": max(DEFAULT_ARENA_BYTES, need)}

    def role_options(self, role: str, options: dict[str, Any]) -> dict[str, Any]:
        # Only a sender owns an arena.
        return dict(options) if role == "sender" else {}


class OmnilinkZmq(_OmnilinkBackend):
    name = "zmq"
    backend = "zmq"
    receiver_first = True
    description = "omnilink zmq over ipc://: frames, by reference (process_vm_readv) for payloads >= 1 MiB"


class LocalBackend(Backend):
    """A copy measured in the parent process: the physical ceiling of a scenario.

    ``prepare(size)`` allocates and pre-faults source and destination, ``copy_many(n)``
    returns the seconds ``n`` back-to-back copies took, ``copy_each(n)`` the
    nanoseconds of each, ``release()`` frees the buffers.
    """

    local = True

    def prepare(self, size: int, *, scenario: Any) -> None:
        raise NotImplementedError

    def _copy(self) -> None:
        raise NotImplementedError

    def _wait(self) -> None:
        """Wait until issued copies have finished (asynchronous engines override)."""

    def copy_many(self, n: int) -> float:
        from omnilink._bench.payload import now_ns

        t0 = now_ns()
        for _ in range(n):
            self._copy()
        self._wait()
        return (now_ns() - t0) / 1e9

    def copy_each(self, n: int) -> list[int]:
        from omnilink._bench.payload import now_ns

        out = []
        for _ in range(n):
            t0 = now_ns()
            self._copy()
            self._wait()
            out.append(now_ns() - t0)
        return out

    def release(self) -> None:
        self.__dict__.clear()


class Memcpy(LocalBackend):
    name = "memcpy"
    description = "one single-threaded host memcpy of the tensor bytes (the ceiling)"

    def prepare(self, size: int, *, scenario: Any) -> None:
        import ctypes

        import numpy as np

        self._src = np.empty(size, dtype=np.uint8)
        self._dst = np.empty(size, dtype=np.uint8)
        # Both written once so no page fault lands inside a measured copy.
        self._src.fill(0x5A)
        self._dst.fill(0)
        self._args = (self._dst.ctypes.data, self._src.ctypes.data, size)
        self._memmove = ctypes.memmove

    def _copy(self) -> None:
        self._memmove(*self._args)


class _CudaCopy(LocalBackend):
    """One host<->device copy of the tensor bytes (``gpu`` scenario ceilings)."""

    h2d: ClassVar[bool] = True
    pinned: ClassVar[bool] = True

    def probe(self) -> str | None:
        import torch

        if not torch.cuda.is_available():
            return "CUDA is not available (torch.cuda.is_available() is False)"
        return None

    def prepare(self, size: int, *, scenario: Any) -> None:
        import torch

        device = scenario.payload_device
        host = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        dev = torch.empty(size, dtype=torch.uint8, device=device)
        host.fill_(0x5A)
        dev.fill_(0)
        self._src, self._dst = (host, dev) if self.h2d else (dev, host)
        self._sync = torch.cuda.synchronize
        self._sync()

    def _copy(self) -> None:
        # non_blocking only matters for pinned memory; pageable copies stage and block.
        self._dst.copy_(self._src, non_blocking=True)

    def _wait(self) -> None:
        self._sync()


class H2DPinned(_CudaCopy):
    name = "h2d-pinned"
    description = "host -> device copy from pinned memory"


class H2DPageable(_CudaCopy):
    name = "h2d-pageable"
    description = "host -> device copy from pageable memory"
    pinned = False


class D2HPinned(_CudaCopy):
    name = "d2h-pinned"
    description = "device -> host copy into pinned memory"
    h2d = False


class D2HPageable(_CudaCopy):
    name = "d2h-pageable"
    description = "device -> host copy into pageable memory"
    h2d = False
    pinned = False


BACKENDS: dict[str, type[Backend]] = {
    cls.name: cls
    for cls in (Memcpy, PickleShm, MsgpackShm, TorchQueue, OmnilinkShm, OmnilinkZmq,
                H2DPinned, H2DPageable, D2HPinned, D2HPageable)
}


def get_backend(name: str) -> Backend:
    """A fresh instance of backend ``name`` (``KeyError`` if unknown)."""
    return BACKENDS[name]()


def probe(name: str) -> str | None:
    """``None`` if backend ``name`` can run here, else why not (checked in the parent)."""
    try:
        return BACKENDS[name]().probe()
    except ImportError as exc:
        return f"{exc} (pip install the missing package)"
