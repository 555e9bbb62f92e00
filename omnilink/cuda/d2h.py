"""``AsyncD2HController``: device-to-host copies of payloads on a dedicated stream.

How one ``submit`` runs::

    caller thread                issuer thread (copy stream)          completer thread
    -------------                ---------------------------          ----------------
    record an event on the       copy stream waits on those events
    current stream of each       acquire pool slots (backpressure)
    CUDA device of the payload   copy_(non_blocking=True) per tensor
    queue the job, return a      record_stream(copy stream) on each
    BatchPayloadFuture           source; record the done event  --->  done event completes:
                                                                       resolve the future,
                                                                       drop the sources

The caller never waits: ``submit`` only records events and queues. The copy waits on the
producer's stream through the event, so it sees everything queued before ``submit``;
the sources stay referenced (and ``record_stream``-ed) until the copy has finished, so the
caching allocator cannot hand their memory to a new tensor too early.

The future's result is the payload with every tensor replaced by a host tensor that is a
view of a pool slot (numpy arrays and plain values are kept as they are). The slots stay
in use until the future's reference count drops to zero: ``retain()`` / ``release()``,
and each ``slice_for(request_id)`` holds a reference until the slice is released.

Without CUDA the same machinery runs on CPU tensors (copied synchronously by the issuer),
so pool accounting, refcounts, slices and backpressure are tested in CPU-only CI.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable

from omnilink._errors import CapacityError, ClosedError, ConfigurationError, CudaError, OmnilinkError, TransferTimeout
from omnilink._util import Deadline
from omnilink.cuda.events import Completer
from omnilink.cuda.pool import PinnedRingPool, PoolSlot

__all__ = ["AsyncD2HController", "BatchPayloadFuture", "BatchPayloadSliceRef"]

logger = logging.getLogger(__name__)

_PRIORITIES = ("normal", "high")


def map_tensors(payload: Any, fn: Callable[[Any], Any]) -> Any:
    """``payload`` with ``fn(t)`` in place of each torch tensor (dict/list/tuple trees)."""
    import torch

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        return x

    return walk(payload)


def make_stream(device: Any, priority: str) -> Any:
    """A new CUDA stream on ``device`` (high priority: the highest the device allows)."""
    import torch

    if priority not in _PRIORITIES:
        raise ConfigurationError(f"priority must be one of {_PRIORITIES}, got {priority!r}")
    if priority == "high":
        # Lower numbers are higher priorities; torch clamps to the device's range.
        return torch.cuda.Stream(device=device, priority=-1)
    return torch.cuda.Stream(device=device)


class BatchPayloadFuture:
    """The host copy of a payload, once the device-to-host copy has finished.

    ``done()``, ``wait(timeout)``, ``result(timeout)`` and ``exception(timeout)`` as in
    ``concurrent.futures``; the result's tensors are views of pool slots, valid while the
    future holds a reference: it starts with one (the submitter's), ``retain()`` adds one,
    ``release()`` drops one, and the slots go back to the pool when the count reaches zero
    (after the copy, if it is still running).
    """

    def __init__(self, ranges: dict[str, tuple[int, int]] | None = None) -> None:
        self._cv = threading.Condition()
        self._done = False
        self._result: Any = None
        self._exc: BaseException | None = None
        self._slots: list[PoolSlot] = []
        self._refs = 1
        self._ranges = dict(ranges or {})
        self._callbacks: list[Callable[[BatchPayloadFuture], None]] = []

    # ------------------------------------------------------------- completion
    def _set(self, result: Any, exc: BaseException | None) -> None:
        with self._cv:
            self._result, self._exc, self._done = result, exc, True
            callbacks, self._callbacks = self._callbacks, []
            free = self._refs == 0
            self._cv.notify_all()
        if free:
            self._free_slots()
        for cb in callbacks:
            try:
                cb(self)
            except Exception:
                logger.exception("omnilink: a BatchPayloadFuture callback failed")

    def add_done_callback(self, fn: Callable[[BatchPayloadFuture], None]) -> None:
        """Call ``fn(future)`` when done (at once if it already is)."""
        with self._cv:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn(self)

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds; return whether the copy has finished."""
        with self._cv:
            return self._cv.wait_for(lambda: self._done, timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.wait(timeout):
            raise TransferTimeout(f"device-to-host copy not finished within {timeout} s")
        return self._exc

    def result(self, timeout: float | None = None) -> Any:
        """The host payload; raises what the copy raised.

        Raises
        ------
        TransferTimeout
            Not finished within ``timeout``.
        ClosedError
            Every reference was released: the slots are back in the pool.
        """
        exc = self.exception(timeout)
        if exc is not None:
            raise exc
        if self._refs <= 0:
            raise ClosedError("BatchPayloadFuture was released; its slots are back in the pool")
        return self._result

    # ------------------------------------------------------------- references
    @property
    def refcount(self) -> int:
        return self._refs

    def retain(self) -> BatchPayloadFuture:
        """Add a reference; returns ``self``."""
        with self._cv:
            if self._refs <= 0:
                raise ClosedError("BatchPayloadFuture was already released")
            self._refs += 1
        return self

    def release(self) -> None:
        """Drop a reference; the last one gives the slots back once the copy is done."""
        with self._cv:
            if self._refs <= 0:
                raise ClosedError("BatchPayloadFuture released more often than retained")
            self._refs -= 1
            free = self._refs == 0 and self._done
        if free:
            self._free_slots()

    def _free_slots(self) -> None:
        slots, self._slots = self._slots, []
        self._result = None
        for s in slots:
            s.release()

    # ------------------------------------------------------------- slices
    def slice_for(self, request_id: str, /) -> BatchPayloadSliceRef:
        """A reference to the token range of ``request_id`` (given at ``submit``).

        Raises
        ------
        ConfigurationError
            ``request_id`` was not among the ranges submitted.
        """
        rng = self._ranges.get(request_id)
        if rng is None:
            raise ConfigurationError(
                f"no token range for request {request_id!r}; submitted: {sorted(self._ranges)}"
            )
        self.retain()
        return BatchPayloadSliceRef(self, request_id, rng[0], rng[1])


class BatchPayloadSliceRef:
    """One request's rows of a batched payload, holding a reference on its future.

    ``result(timeout)`` gives the payload with every tensor whose first dimension is the
    batch's token count sliced to ``[start:stop]`` (views, no copy); other values whole.
    ``release()`` (idempotent; also ``with``) drops the reference.
    """

    def __init__(self, future: BatchPayloadFuture, request_id: str, start: int, stop: int) -> None:
        self.future = future
        self.request_id = request_id
        self.start = start
        self.stop = stop
        self._released = False

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> Any:
        if self._released:
            raise ClosedError(f"slice of request {self.request_id!r} was released")
        payload = self.future.result(timeout)
        tokens = max(stop for _, stop in self.future._ranges.values())

        def cut(t: Any) -> Any:
            if t.dim() >= 1 and t.shape[0] == tokens:
                return t[self.start : self.stop]
            return t

        return map_tensors(payload, cut)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.future.release()

    def __enter__(self) -> BatchPayloadSliceRef:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class _Job:
    __slots__ = ("payload", "events", "future", "timeout")

    def __init__(self, payload: Any, events: list[tuple[Any, Any]], future: BatchPayloadFuture,
                 timeout: float | None) -> None:
        self.payload = payload
        self.events = events
        self.future = future
        self.timeout = timeout


class AsyncD2HController:
    """Copies payloads' tensors to host pool slots on a dedicated stream.

    Parameters
    ----------
    device : str or torch.device, optional
        The CUDA device whose tensors this controller copies (default: the current one;
        ``"cpu"`` or no CUDA: the CPU mode, same logic on host tensors).
    pool : PinnedRingPool, optional
        Where the copies land; default a standalone pool of ``pool_bytes``.
    pool_bytes : int
        Size of the default pool (256 MiB).
    priority : {"normal", "high"}
        Priority of the copy stream; ``"high"`` lets copies overtake compute kernels
        queued on normal-priority streams.

    Raises
    ------
    ConfigurationError
        Bad device or priority.
    CudaError
        The CUDA device cannot be used.
    """

    def __init__(self, device: Any = None, pool: PinnedRingPool | None = None, *,
                 pool_bytes: int = 256 << 20, priority: str = "normal") -> None:
        from omnilink.cuda.runtime import resolve_device, sync_debug

        if priority not in _PRIORITIES:
            raise ConfigurationError(f"priority must be one of {_PRIORITIES}, got {priority!r}")
        dev = resolve_device(device, "AsyncD2HController")
        self.device = dev
        self.priority = priority
        self.sync = sync_debug()
        self._stream = make_stream(dev, priority) if dev.type == "cuda" else None
        if self._stream is not None:
            from omnilink.cuda.runtime import cuda_ops

            self._ops = cuda_ops()  # CudaError with the pip hint when cuda-python is missing
            self._raw = int(self._stream.cuda_stream)
            self._index = dev.index
        self._owns_pool = pool is None
        self._pool = pool
        self._pool_bytes = pool_bytes
        self._jobs: collections.deque[_Job | None] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._completer = Completer(f"omnilink-d2h-{dev}")
        self._issuer = threading.Thread(target=self._issue_loop, name=f"omnilink-d2h-issue-{dev}", daemon=True)
        self._issuer.start()

    @property
    def stream(self) -> Any:
        """The copy stream (``None`` in CPU mode)."""
        return self._stream

    @property
    def pool(self) -> PinnedRingPool:
        """Where ``submit`` copies land (a standalone pool is made on first use)."""
        if self._pool is None:
            with self._cv:
                if self._pool is None:
                    self._pool = PinnedRingPool(self._pool_bytes)
        return self._pool

    def submit(self, payload: Any, /, *, ranges: dict[str, tuple[int, int]] | None = None,
               timeout: float | None = None) -> BatchPayloadFuture:
        """Start copying ``payload``'s tensors to host; return at once with a future.

        Parameters
        ----------
        payload : Any
            A dict/list/tuple tree; its torch tensors are copied (CUDA tensors must be on
            this controller's device), everything else is kept as it is.
        ranges : dict of str to (int, int), optional
            Per-request token ranges ``[start, stop)`` of a batched ``[tokens, ...]``
            payload, for ``future.slice_for(request_id)``.
        timeout : float, optional
            How long the copy may wait for pool room; past it the future fails with
            ``TransferTimeout``.

        Returns
        -------
        BatchPayloadFuture

        Raises
        ------
        ClosedError
            The controller was closed.
        ConfigurationError
            Bad ranges, or a CUDA tensor on another device.
        """
        self._check_ranges(ranges)
        events: list[tuple[Any, Any]] = []
        if self._stream is not None:
            from omnilink.cuda.runtime import cuda_devices_of, record_producer_events

            devices = cuda_devices_of(payload)
            for d in devices:
                if d != self.device:
                    raise ConfigurationError(f"payload holds a tensor on {d}; this controller copies from {self.device}")
            events = record_producer_events(devices)
        future = BatchPayloadFuture(ranges)
        with self._cv:
            if self._closed:
                raise ClosedError("AsyncD2HController is closed")
            self._jobs.append(_Job(payload, events, future, timeout))
            self._cv.notify()
        return future

    def copy_into(self, pairs: list[tuple[Any, Any]], /, *, events: list[tuple[Any, Any]] | None = None) -> Any:
        """Enqueue ``dst.copy_(src)`` for each ``(src, dst)`` on the copy stream.

        The lower-level entry the shm backend uses: ``dst`` is a host view of an arena
        block it allocated itself. The copies run after ``events`` (from
        ``record_producer_events``; default: one recorded now on the current stream).

        Returns
        -------
        torch.cuda.Event or None
            The event that completes with the last copy (``None`` in CPU mode, where the
            copies are done when this returns). The caller keeps the sources alive until
            it has completed.
        """
        import torch

        from omnilink.cuda.runtime import Event, record_producer_events

        if self._stream is None:
            for src, dst in pairs:
                dst.copy_(src)
            return None
        ops, raw = self._ops, self._raw
        if events is None:
            events = record_producer_events([self.device])
        prev = ops.swap_device(self._index)
        try:
            for _, ev in events:
                ops.wait(raw, ev)
            strided = []
            for src, dst in pairs:
                n = src.numel() * src.element_size()
                if not n:
                    continue
                if src.is_contiguous() and dst.is_contiguous():
                    ops.memcpy(dst.data_ptr(), src.data_ptr(), n, raw)
                else:
                    strided.append((src, dst))
            if strided:
                with torch.cuda.stream(self._stream):
                    for src, dst in strided:
                        dst.copy_(src, non_blocking=True)
            done = Event(self._index).record(raw)
        finally:
            ops.restore_device(prev)
        if self.sync:
            done.synchronize()
        return done

    @staticmethod
    def _check_ranges(ranges: dict[str, tuple[int, int]] | None) -> None:
        if ranges is None:
            return
        if not isinstance(ranges, dict):
            raise ConfigurationError(f"ranges must be a dict of request id -> (start, stop), got {ranges!r}")
        for rid, rng in ranges.items():
            ok = isinstance(rid, str) and isinstance(rng, tuple) and len(rng) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) for v in rng) and 0 <= rng[0] <= rng[1]
            if not ok:
                raise ConfigurationError(f"range of {rid!r} must be (start, stop) with 0 <= start <= stop, got {rng!r}")

    # ----------------------------------------------------------------- issuer
    def _issue_loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                job = self._jobs.popleft()
            if job is None:
                return
            try:
                self._issue(job)
            except BaseException as exc:
                err = exc if isinstance(exc, OmnilinkError) else CudaError(f"device-to-host copy failed: {exc}")
                if err is not exc:
                    err.__cause__ = exc
                for s in job.future._slots:
                    s.release()
                job.future._slots = []
                job.future._set(None, err)

    def _issue(self, job: _Job) -> None:
        import torch

        deadline = Deadline(job.timeout)
        future = job.future
        sources: list[Any] = []

        def to_slot(t: Any) -> Any:
            if t.is_cuda and t.device != self.device:
                raise ConfigurationError(f"tensor on {t.device}; this controller copies from {self.device}")
            nbytes = t.numel() * t.element_size()
            try:
                slot = self.pool.acquire(nbytes, timeout=deadline.remaining())
            except CapacityError:
                raise
            future._slots.append(slot)
            dst = slot.tensor()[:nbytes].view(t.dtype).view(t.shape) if nbytes else torch.empty(
                t.shape, dtype=t.dtype)
            if nbytes:
                dst.copy_(t, non_blocking=self._stream is not None)
            if t.is_cuda:
                t.record_stream(self._stream)
                sources.append(t)
            return dst

        if self._stream is None:
            result = map_tensors(job.payload, to_slot)
            done_event = None
        else:
            from omnilink.cuda.runtime import Event

            self._ops.swap_device(self._index)  # our own thread: no need to restore
            for _, ev in job.events:
                self._ops.wait(self._raw, ev)
            with torch.cuda.stream(self._stream):
                result = map_tensors(job.payload, to_slot)
            done_event = Event(self._index).record(self._raw)
            if self.sync:
                done_event.synchronize()
        job.payload = None

        def finish() -> None:
            # The sources are dropped here, after the copy: only now may the allocator
            # reuse their memory.
            sources.clear()
            future._set(result, None)

        self._completer.submit(done_event, finish)

    # ----------------------------------------------------------------- lifetime
    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted copy has finished; return whether they did."""
        deadline = Deadline(timeout)
        with self._cv:
            if not self._cv.wait_for(lambda: not self._jobs, deadline.remaining()):
                return False
        return self._completer.drain(deadline.remaining())

    def close(self) -> None:
        """Finish what was submitted, stop the threads, close an owned pool; idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._jobs.append(None)
            self._cv.notify()
        self._issuer.join()
        self._completer.close()
        if self._owns_pool and self._pool is not None:
            self._pool.close()

    def __enter__(self) -> AsyncD2HController:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
