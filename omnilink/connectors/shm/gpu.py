"""The shm backend's GPU path: CUDA tensors by DMA into the arena, and out of it.

Sender (``put`` of a payload holding CUDA tensors)::

    under pipeline_bytes of CUDA tensors (put_direct): write header + host tensors into
    a block; one cudaMemcpyAsync per CUDA tensor straight into the arena, which is
    page-locked once (first CUDA put) with cudaHostRegister -- put: on the tensor's
    current stream (it waits for the copy anyway); put_async: on the D2H controller's
    stream after the producer's event -- wait for the copies; publish the descriptor.

    payloads with >= pipeline_bytes of CUDA tensors: a head, then slices (slices.py),
    each DMA'd by the D2H controller (omnilink.cuda.AsyncD2HController) on its stream
    after the producer's event; up to 4 slices are in flight at once: while slice i is
    published, slice i+1 is still being copied; the receiver copies slice i to its
    device meanwhile.

Receiver (``get(key, device="cuda:k")`` / ``get_handle``)::

    claim; the frame's header is decoded (by the decoder's caches) and its whole data
    region is copied with one cudaMemcpyAsync into one device buffer, straight out of
    our own mapping of the sender's arena, page-locked once per sender arena (first
    CUDA get from it); every tensor is a view of that buffer (the connector's
    ``_land_frame``, AsyncH2DController.submit_frame: one allocation and one DMA per
    message however many tensors it holds). The copy runs on the H2D controller's
    stream after the caller's current stream (frames under SMALL_DEVICE_BYTES: on the
    current stream). A frame holding numpy arrays takes the general path: zero-copy
    host views, then AsyncH2DController.submit_host, one copy per torch tensor.
    StagePayloadHandle; the arena block is released once the copy has completed: by
    the next get that finds it done (no thread hand-off while messages stream), or by
    the controller's completer thread
    get(): handle.wait() = the caller's current stream waits on the copy's event

The host never blocks in ``get`` for the copy, and ``put`` returns once the bytes are
in the arena (the caller may overwrite its tensors then). ``put_async`` records the
producer's event in the caller's thread and does the rest on the connector's put thread.

Registration is undone before the memory is unmapped: the sender's in ``close()``
before the arena goes, a receiver's when it forgets a departed sender's arena (after
its copies from it have completed) and in ``close()``.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
from typing import Any

from omnilink._errors import BlobDecodeError, ConfigurationError, CudaError, TransportError
from omnilink.blob import prepare
from omnilink.connectors.shm.slices import (
    ABORT,
    SLICED_MARK,
    PLACEHOLDER,
    build_head,
    fill_placeholders,
    parse_head,
    plan_slices,
    slice_key,
)
from omnilink.cuda import cuda_ops, current_raw_stream

__all__ = ["ShmGpuPath"]

logger = logging.getLogger(__name__)

#: Slices copied off the device and not yet published, at most.
SLICES_IN_FLIGHT = 4
#: Payloads with fewer device bytes skip the copy streams: the sender copies on its
#: current stream and waits; the receiver copies out of its page-locked mapping on its
#: current stream. Below this the fixed cost per call decides, not PCIe.
SMALL_DEVICE_BYTES = 256 << 10


def _small(payload: Any, torch: Any) -> bool:
    """Whether the torch tensors of ``payload`` hold fewer than SMALL_DEVICE_BYTES."""
    total = 0
    stack = [payload]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
            if total >= SMALL_DEVICE_BYTES:
                return False
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return True


class ShmGpuPath:
    """The CUDA side of one ``ShmConnector`` (made on its first CUDA put or device get)."""

    def __init__(self, conn: Any) -> None:
        import torch

        self.conn = conn
        self._torch = torch
        self._lock = threading.Lock()
        self._d2h: dict[Any, Any] = {}
        self._h2d: dict[Any, Any] = {}
        self._arena_reg: Any = None
        self._arena_t: Any = None
        self._arena_addr: int | None = None
        self._reader_regs: dict[int, tuple[Any, Any]] = {}
        #: parsed ``device=`` strings of get (``"cuda:0"`` -> torch.device)
        self._devices: dict[str, Any] = {}
        #: test hook: treat CPU tensors as device tensors (the CPU-only CI runs the
        #: slicing logic this way)
        self.cpu_mode = False

    # ================================================================ controllers
    def _d2h_for(self, device: Any) -> Any:
        ctl = self._d2h.get(device)
        if ctl is None:
            from omnilink.cuda import AsyncD2HController

            with self._lock:
                ctl = self._d2h.get(device)
                if ctl is None:
                    ctl = self._d2h[device] = AsyncD2HController(device)
        return ctl

    def _h2d_for(self, device: Any) -> Any:
        ctl = self._h2d.get(device)
        if ctl is None:
            from omnilink.cuda import AsyncH2DController

            with self._lock:
                ctl = self._h2d.get(device)
                if ctl is None:
                    ctl = self._h2d[device] = AsyncH2DController(device)
        return ctl

    def _arena(self) -> Any:
        """The sender's arena as a uint8 tensor, page-locked on first use."""
        if self._arena_t is None:
            torch = self._torch
            w = self.conn._writer
            with self._lock:
                if self._arena_t is None:
                    t = torch.frombuffer(w.view, dtype=torch.uint8)
                    if not self.cpu_mode:
                        from omnilink.cuda import HostRegistration

                        self._arena_reg = HostRegistration(t.data_ptr(), t.numel(), what=f"arena {w.name}")
                    self._arena_t = t
        return self._arena_t

    def _register_reader(self, reader: Any) -> None:
        if self.cpu_mode or reader is None or id(reader) in self._reader_regs:
            return
        from omnilink.cuda import HostRegistration

        with self._lock:
            if id(reader) in self._reader_regs:
                return
            start, length = reader.address()
            reg = HostRegistration(start, length, what=f"mapping of arena {reader.name}")
            # The reader is kept referenced: its mapping must outlive the registration.
            self._reader_regs[id(reader)] = (reader, reg)

    def forget_reader(self, reader: Any) -> None:
        """A sender left: unregister our mapping of its arena once copies from it are done."""
        entry = self._reader_regs.pop(id(reader), None)
        if entry is not None:
            for ctl in list(self._h2d.values()):
                ctl.drain()
            entry[1].close()

    # ================================================================ sending
    def _is_dev(self, t: Any) -> bool:
        return t.is_cuda or (self.cpu_mode and isinstance(t, self._torch.Tensor))

    def put(self, key: str, payload: Any, blob: Any, deadline: Any, events: Any) -> int:
        from omnilink.cuda import cuda_devices_of, map_tensors

        conn = self.conn
        if events is None and not self.cpu_mode:
            # put (not put_async): the wait on this event is enqueued before put returns,
            # so this thread's reusable ordering event will do.
            from omnilink.cuda import cuda_ops, current_raw_stream

            ops = cuda_ops()
            events = [(d, ops.ordering_event(d.index).record(current_raw_stream(d.index)))
                      for d in cuda_devices_of(payload)]
        big: list[Any] = []
        if blob.device_bytes() >= conn.pipeline_bytes or self.cpu_mode:
            cut = max(conn.slice_bytes // 8, 1)

            def lift(t: Any) -> Any:
                if self._is_dev(t) and t.numel() * t.element_size() >= cut:
                    big.append(t)
                    return {PLACEHOLDER: len(big) - 1}
                return t

            tree = map_tensors(payload, lift)
            if big and sum(t.numel() * t.element_size() for t in big) >= conn.pipeline_bytes:
                return self._put_sliced(key, tree, big, deadline, events)
        if blob.nbytes > conn._writer.data_bytes:
            # Larger than the arena and not sliceable: the host path's overflow segment.
            return conn._put_overflow(key, key.encode("utf-8"), blob, deadline)
        n = self._put_frame(key, blob, deadline, events)
        conn._count(device_puts=1)
        return n

    def put_direct(self, key: str, blob: Any, deadline: Any, events: Any) -> int:
        """Send a payload of fewer than ``pipeline_bytes`` of CUDA tensors, unsliced.

        Header and host tensors are written into a block; each CUDA tensor is one
        ``cudaMemcpyAsync`` straight into the page-locked block; one synchronize per
        stream; publish. ``put`` copies on the tensor's device's current stream: it
        waits for the copy anyway, and a copy stream would add two events and a
        cross-stream wait to the same wait. ``put_async`` (``events``: the producer's)
        copies on the D2H controller's stream after those events, so the caller's later
        work on its own stream is not ordered behind the copy.
        """
        conn = self.conn
        n = blob.nbytes
        base = self._arena_address() + conn._writer.data_offset
        off, idx = conn._take_block(key, n, deadline, block=True)
        try:
            deferred = blob.write_host_into(conn._block_view(off, n))
            if deferred:
                self._copy_direct(base + off, deferred, events)
        except BaseException:
            conn._give_back_block(off, idx)
            raise
        conn._publish_block(key, off, idx, n, deadline)
        conn._count(device_puts=1)
        return n

    def _copy_direct(self, addr: int, deferred: list[tuple[int, Any]], events: Any) -> None:
        """Copy each ``(offset, CUDA tensor)`` to ``addr + offset`` and wait for the copies
        (also when one of them fails to enqueue: no DMA may still write into a block that
        goes back). Without ``events``, on the tensor's device's current stream; with
        them, on that device's D2H controller stream after them."""
        ops = cuda_ops()
        streams: dict[int, int] = {}
        try:
            for o, src in deferred:
                index = src.get_device()
                raw = streams.get(index)
                if raw is None:
                    if events is None:
                        raw = current_raw_stream(index)
                    else:
                        raw = self._d2h_for(src.device)._raw
                    streams[index] = raw
                    for dev, ev in events or ():
                        if dev.index == index:
                            ops.wait(raw, ev)
                nb = src.numel() * src.element_size()
                if src.is_contiguous() and not (src.is_conj() or src.is_neg()):
                    prev = ops.swap_device(index)
                    try:
                        ops.memcpy(addr + o, src.data_ptr(), nb, raw)
                    finally:
                        ops.restore_device(prev)
                else:
                    # Strided (or a conj/neg view): torch gathers it, on the same stream.
                    start = addr - self._arena_address() + o
                    dst = self._arena()[start : start + nb].view(src.dtype).view(src.shape)
                    with self._torch.cuda.stream(self._torch.cuda.ExternalStream(raw, device=src.device)):
                        dst.copy_(src, non_blocking=True)
        finally:
            for index, raw in streams.items():
                prev = ops.swap_device(index)  # a legacy default stream (0) is the current device's
                try:
                    ops.check(ops.rt.cudaStreamSynchronize(raw), "cudaStreamSynchronize")
                finally:
                    ops.restore_device(prev)

    def _arena_address(self) -> int:
        """Address of the sender's arena mapping (page-locked on first use)."""
        addr = self._arena_addr
        if addr is None:
            addr = self._arena_addr = self._arena().data_ptr()
        return addr

    def _put_frame(self, key: str, blob: Any, deadline: Any, events: Any, *, block: bool = True) -> int:
        """Allocate a block, write ``blob`` (device regions by DMA), publish it."""
        conn = self.conn
        n = blob.nbytes
        got = conn._take_block(key, n, deadline, block=block)
        if got is None:
            return 0
        off, idx = got
        try:
            ev = self._fill(blob, off, events)
        except BaseException:
            conn._give_back_block(off, idx)
            raise
        self._publish_when_copied(key, off, idx, n, ev, deadline)
        return n

    def _publish_when_copied(self, key: str, off: int, idx: int, n: int, ev: Any, deadline: Any) -> None:
        """Wait for the copy into block ``off`` (event ``ev``), then publish it; the block
        goes back if the copy failed."""
        conn = self.conn
        try:
            if ev is not None:
                ev.synchronize()
        except BaseException:
            conn._give_back_block(off, idx)
            raise
        conn._publish_block(key, off, idx, n, deadline)

    def _fill(self, blob: Any, off: int, events: Any) -> Any:
        """Write ``blob`` into the block at ``off``; return the event of its device copies."""
        conn = self.conn
        deferred = blob.write_host_into(conn._block_view(off, blob.nbytes))
        if not deferred:
            return None
        arena = self._arena()
        base = conn._writer.data_offset + off
        by_dev: dict[Any, list[tuple[Any, Any]]] = {}
        for o, src in deferred:
            nb = src.numel() * src.element_size()
            dst = arena[base + o : base + o + nb].view(src.dtype).view(src.shape)
            by_dev.setdefault(src.device, []).append((src, dst))
        last = None
        for dev, pairs in by_dev.items():
            evs = [e for e in (events or ()) if e[0] == dev]
            ev = self._d2h_for(dev).copy_into(pairs, events=evs)
            if ev is not None:
                if last is not None:
                    last.synchronize()
                last = ev
        return last

    def _put_sliced(self, key: str, tree: Any, big: list[Any], deadline: Any, events: Any) -> int:
        torch = self._torch
        conn = self.conn
        token = secrets.token_hex(8)
        flats = []
        for t in big:
            if t.is_conj():
                t = t.resolve_conj()
            if t.is_neg():
                t = t.resolve_neg()
            if not t.is_contiguous():
                if t.is_cuda:
                    # The producer's writes first, then the gather, then our copies.
                    from omnilink.cuda import cuda_ops, record_producer_events

                    ops = cuda_ops()
                    for dev, ev in events or ():
                        if dev == t.device:
                            ops.wait_current(t.device.index, ev)
                    t = t.contiguous()
                    events = list(events or ()) + record_producer_events([t.device])
                else:
                    t = t.contiguous()
            flats.append(t.reshape(-1).view(torch.uint8))
        head = build_head(tree, big, conn.slice_bytes, token)
        total = self._put_frame(key, prepare(head), deadline, events)
        pieces = plan_slices([f.numel() for f in flats], conn.slice_bytes)
        pending: collections.deque[tuple[str, int, int, int, Any]] = collections.deque()
        published = 0

        def complete_oldest() -> None:
            nonlocal published, total
            skey, off, idx, n, ev = pending.popleft()
            self._publish_when_copied(skey, off, idx, n, ev, deadline)
            published += 1
            total += n

        try:
            for i, (j, a, b) in enumerate(pieces):
                skey = slice_key(token, i)
                blob = prepare({"b": flats[j][a:b]})
                n = blob.nbytes
                got = conn._take_block(skey, n, deadline, block=False)
                while got is None:
                    if pending:
                        complete_oldest()
                        got = conn._take_block(skey, n, deadline, block=False)
                    else:
                        got = conn._take_block(skey, n, deadline, block=True)
                off, idx = got
                try:
                    ev = self._fill(blob, off, events)
                except BaseException:
                    conn._give_back_block(off, idx)
                    raise
                pending.append((skey, off, idx, n, ev))
                while len(pending) > SLICES_IN_FLIGHT:
                    complete_oldest()
            while pending:
                complete_oldest()
        except BaseException as exc:
            for _, off, idx, _, ev in pending:
                try:
                    if ev is not None:
                        ev.synchronize()  # the DMA must not write into a block given back
                finally:
                    conn._give_back_block(off, idx)
            self._abort(key, token, published, exc)
            raise
        conn._count(device_puts=1, sliced=1)
        return total

    def _abort(self, key: str, token: str, index: int, exc: BaseException) -> None:
        """Tell the receiver of ``key`` that slice ``index`` will never come."""
        from omnilink._util import Deadline

        reason = f"{type(exc).__name__}: {exc}"[:512]
        try:
            self._put_frame(slice_key(token, index), prepare({ABORT: reason}), Deadline(1.0), None, block=False)
        except Exception:  # the arena is full or closed: the receiver's timeout stays
            logger.debug("shm: could not publish the abort of %r", key, exc_info=True)
        logger.warning("shm: sliced put of %r on channel %r failed at slice %d: %s",
                       key, self.conn.channel, index, reason)

    # ================================================================ receiving
    def land(self, payload: Any, reader: Any, deadline: Any, device: Any, length: int | None = None) -> Any:
        """Start copying a received payload to ``device``; a ``StagePayloadHandle``.

        ``length``: the received frame's size; a frame under ``SMALL_DEVICE_BYTES``
        takes the small path (its tensors are smaller still) without walking it."""
        dev = self.device_of(device)
        if type(payload) is dict and SLICED_MARK in payload:
            return self.gather(payload, deadline, dev)
        self.conn._count(device_gets=1)
        if dev.type != "cuda":
            return self._h2d_for(dev).submit(payload)
        self._register_reader(reader)
        # Small payloads copy on the caller's current stream: the copy stream's ordering
        # (two events, a cross-stream wait) costs more than the copy itself.
        small = length < SMALL_DEVICE_BYTES if length is not None else _small(payload, self._torch)
        return self._h2d_for(dev).submit_host(payload, on_current_stream=small)

    def device_of(self, device: Any) -> Any:
        """``device`` (a string or ``torch.device``) as a ``torch.device``; a CUDA one
        always with its index (``"cuda"``: the current device)."""
        dev = self._devices.get(device) if isinstance(device, str) else None
        if dev is None:
            dev = self._device(device)
            if isinstance(device, str) and dev.index is not None and ":" in device:
                self._devices[device] = dev  # explicit index: the same device every call
        return dev

    def _device(self, device: Any) -> Any:
        torch = self._torch
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigurationError(f"invalid device {device!r}: {exc}") from exc
        if dev.type == "cuda" and dev.index is None:
            from omnilink.cuda import cuda_available

            if not cuda_available():
                raise CudaError(f"device {device!r} requested but CUDA is not available in this process")
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    def gather(self, head: dict[str, Any], deadline: Any, device: Any) -> Any:
        """Claim the slices of a sliced payload, copying each to ``device`` as it comes."""
        torch = self._torch
        conn = self.conn
        dev = torch.device("cpu") if device is None else device
        tree, specs, slice_bytes, token = parse_head(head)
        h2d = self._h2d_for(dev)
        stream = h2d.stream
        # Device buffers from the caller's current stream, like any device get.
        bufs = [torch.empty(n, dtype=torch.uint8, device=dev) for _, _, n in specs]
        pieces = plan_slices([n for _, _, n in specs], slice_bytes)
        for i, (j, a, b) in enumerate(pieces):
            skey = slice_key(token, i)
            got = conn._claim_wait(skey, deadline, True)
            part = conn._open_payload(skey, got)
            if type(part) is dict and ABORT in part:
                raise TransportError(
                    f"shm: the sender of a sliced payload on channel {conn.channel!r} gave up at "
                    f"slice {i}: {str(part[ABORT])[:512]}"
                )
            data = part.get("b") if type(part) is dict and len(part) == 1 else None
            if (not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1
                    or data.numel() != b - a):
                raise BlobDecodeError(f"shm: slice {i} of a sliced payload is malformed (expected {b - a} bytes)")
            if stream is not None:
                self._register_reader(got[0])
            # The slice's block goes back once its copy has completed (keep=part).
            h2d.copy_into([(data, bufs[j][a:b])], keep=part)
            del part, data
        tensors = [buf.view(dtype).view(shape) for buf, (dtype, shape, _) in zip(bufs, specs)]
        full = fill_placeholders(tree, tensors)
        conn._count(sliced=1, device_gets=1 if stream is not None else 0)
        if stream is None:
            from omnilink.cuda import StagePayloadHandle

            # Host assembly: the buffers own their memory; small tensors of the head
            # stay zero-copy views of its block.
            return StagePayloadHandle(full, None, dev, [])
        return h2d.submit(full, keep=head)

    # ================================================================ lifetime
    def close(self) -> None:
        """Finish copies in flight, stop the controllers, unregister every mapping."""
        for ctl in list(self._h2d.values()) + list(self._d2h.values()):
            try:
                ctl.close()
            except Exception:  # pragma: no cover - best effort at close
                logger.debug("shm: closing a copy controller failed", exc_info=True)
        for _, reg in list(self._reader_regs.values()):
            reg.close()
        self._reader_regs.clear()
        if self._arena_reg is not None:
            self._arena_reg.close()
        self._arena_t = None
        self._arena_addr = None
