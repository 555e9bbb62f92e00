"""``AsyncH2DController``: host-to-device copies of received payloads on a dedicated stream.

How one ``submit`` runs (all in the caller's thread, none of it waits)::

    run the callbacks of earlier copies that have completed (reap: no thread hand-off)
    allocate the device tensors (caching allocator, from the caller's current stream)
    copy stream: after the caller's stream; cudaMemcpyAsync from the host views
    record the copy's event                         completer thread (after a 1 ms lag,
    return StagePayloadHandle  -------------------> for what nobody reaped): event done
                                                    -> drop the host views (the arena
                                                    block goes back to its sender)
    handle.wait(stream): stream waits on the event (the host does not)

The device tensors come from the caller's current stream; ``wait(stream)`` on another
stream records them there too, so their memory is not reused before the consumer's
work on them has run. The host block is released only once its copy has completed --
by the next ``submit`` that finds it done, or by the completer thread -- never by
making the caller wait. ``on_current_stream=True`` (small payloads) copies on the
caller's stream itself: no cross-stream ordering to pay for.

Without CUDA (``device="cpu"``) the "copy" is a synchronous ``clone`` and the handle is
complete at once: the same code path, tested on CPU.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from omnilink._errors import ConfigurationError, TransferTimeout
from omnilink.cuda.d2h import make_stream, map_tensors
from omnilink.cuda.events import Completer
from omnilink.cuda.runtime import (
    Event,
    cuda_ops,
    current_raw_stream,
    raw_stream,
    record_producer_events,
    resolve_device,
    sync_debug,
)

__all__ = ["AsyncH2DController", "StagePayloadHandle"]

#: How long the completer thread leaves completed copies to the submitting thread.
REAP_LAG_S = 0.001

logger = logging.getLogger(__name__)


class StagePayloadHandle:
    """A payload being copied to a device.

    ``wait(stream=None)`` makes ``stream`` (default: the device's current stream) wait on
    the copy and returns the payload: its tensors are then safe to use on that stream,
    and the host did not block. ``done()`` says whether the copy has finished;
    ``synchronize(timeout)`` blocks the host until it has (for code that reads the
    tensors on the host).
    """

    def __init__(self, payload: Any, event: Any, device: Any, tensors: list[Any], *,
                 waiter: Completer | None = None, stream: int | None = None) -> None:
        self._payload = payload
        #: raw handle of the stream the copy ran on: waiting there is a no-op
        self._copy_stream = stream
        self._event = event
        self.device = device
        self._tensors = tensors
        self._complete = event is None
        #: the completer that waits on events of ``event``'s stream (a timed
        #: ``synchronize`` is told by it instead of polling); default a shared one
        self._waiter = waiter
        self._done_flag: threading.Event | None = None

    @property
    def event(self) -> Any:
        """The copy's CUDA event (``None`` in CPU mode)."""
        return self._event

    def done(self) -> bool:
        if self._complete:
            return True
        if self._event.query():
            self._complete = True
        return self._complete

    def wait(self, stream: Any = None) -> Any:
        """Order ``stream`` after the copy (host not blocked); return the payload.

        ``stream``: a ``torch.cuda.Stream`` of the handle's device; default its current
        stream. The tensors were allocated on the current stream of ``get``'s caller; on
        another stream they are also recorded there, for the caching allocator.
        """
        if self._event is not None:
            ops = cuda_ops()
            raw = current_raw_stream(self.device.index) if stream is None else raw_stream(stream)
            if raw != self._copy_stream:
                prev = ops.swap_device(self.device.index)
                try:
                    ops.wait(raw, self._event)
                finally:
                    ops.restore_device(prev)
            if stream is not None:
                for t in self._tensors:
                    t.record_stream(stream)
        return self._payload

    def synchronize(self, timeout: float | None = None) -> Any:
        """Block the host until the copy has finished; return the payload.

        Raises
        ------
        TransferTimeout
            ``timeout`` passed first. (A timed wait is woken by a completer thread that
            waits on the event; ``None`` waits on the event in this thread.)
        """
        if self._event is not None and not self._complete:
            if timeout is None:
                self._event.synchronize()
            elif not self._event.query():
                if self._done_flag is None:
                    self._done_flag = threading.Event()
                    (self._waiter or _shared_waiter()).submit(self._event, self._done_flag.set)
                if not self._done_flag.wait(timeout):
                    raise TransferTimeout(f"host-to-device copy to {self.device} not done within {timeout} s")
            self._complete = True
        return self._payload


_waiter: Completer | None = None
_waiter_lock = threading.Lock()


def _shared_waiter() -> Completer:
    """The completer of timed waits on handles that have none of their own."""
    global _waiter
    with _waiter_lock:
        if _waiter is None:
            _waiter = Completer("omnilink-h2d-timed-wait")
        return _waiter


class AsyncH2DController:
    """Copies received payloads' host tensors to a device on a dedicated stream.

    Parameters
    ----------
    device : str or torch.device
        Where tensors land (``"cuda:1"``; ``"cpu"``: CPU mode, copies are clones).
    priority : {"normal", "high"}
        Priority of the copy stream.

    Raises
    ------
    ConfigurationError
        Bad device.
    CudaError
        A CUDA device was asked for and CUDA is not available.
    """

    def __init__(self, device: Any, *, priority: str = "normal") -> None:
        if device is None:
            raise ConfigurationError("AsyncH2DController needs a device (\"cuda:0\", or \"cpu\")")
        dev = resolve_device(device, "AsyncH2DController")
        self.device = dev
        self.sync = sync_debug()
        self._stream = make_stream(dev, priority) if dev.type == "cuda" else None
        if self._stream is not None:
            self._ops = cuda_ops()  # CudaError with the pip hint when cuda-python is missing
            self._raw = int(self._stream.cuda_stream)
            self._index = dev.index
        # Lagged: each submit reaps the copies that completed, in the caller's thread.
        self._completer = Completer(f"omnilink-h2d-{dev}", lag=REAP_LAG_S)

    @property
    def stream(self) -> Any:
        return self._stream

    def submit(self, payload: Any, /, *, keep: Any = None, on_done: Callable[[], None] | None = None,
               on_current_stream: bool = False) -> StagePayloadHandle:
        """Start copying ``payload``'s torch tensors to the device; return at once.

        Parameters
        ----------
        payload : Any
            A dict/list/tuple tree; torch tensors are copied (non-blocking from pinned or
            registered memory), numpy arrays and plain values are kept as they are.
        keep : Any
            Held until the copy has completed, then dropped (the received payload whose
            views keep its transport block alive).
        on_done : callable, optional
            Called once the copy has completed (on the completer thread, or in a later
            ``submit``'s thread that finds it done).
        on_current_stream : bool
            Copy on the caller's current stream instead of the copy stream: for small
            payloads, where the cross-stream ordering costs more than the copy; the
            tensors are then ready for that stream with no wait at all.

        Returns
        -------
        StagePayloadHandle
        """
        import torch

        dev = self.device
        if self._stream is None:
            out = map_tensors(payload, lambda t: t.to(dev).clone() if t.device == dev else t.to(dev))
            if on_done is not None:
                self._completer.submit(None, on_done)
            return StagePayloadHandle(out, None, dev, [])
        ops = self._ops

        def make_move(raw: int, tensors: list[Any], sources: list[Any]) -> Callable[[Any], Any]:
            def move(t: Any) -> Any:
                if t.device == dev:
                    # Made on this device already (the slices of a sliced payload).
                    tensors.append(t)
                    return t
                d = torch.empty(t.shape, dtype=t.dtype, device=dev)
                n = t.numel() * t.element_size()
                if t.is_cuda:
                    # On another GPU (a sender's device payload, say): after its producer.
                    ops.wait(raw, record_producer_events([t.device])[0][1])
                    if on_current_stream:  # raw is the current stream already
                        d.copy_(t, non_blocking=True)
                    else:
                        with torch.cuda.stream(self._stream):
                            d.copy_(t, non_blocking=True)
                elif n:
                    src = t if t.is_contiguous() else t.contiguous()
                    ops.memcpy(d.data_ptr(), src.data_ptr(), n, raw)
                    t = src
                tensors.append(d)
                sources.append(t)
                return d

            return move

        def finish(sources: list[Any]) -> Callable[[], None]:
            def done() -> None:
                sources.clear()
                nonlocal keep
                keep = None
                if on_done is not None:
                    on_done()

            return done

        return self._launch(payload, on_current_stream, make_move, finish)

    def submit_host(self, payload: Any, /, *, on_current_stream: bool = True) -> StagePayloadHandle:
        """``submit`` for a payload of host tensors, at the least cost per message.

        The per-message path of a transport that decoded ``payload`` into host views of
        page-locked memory (the shm backend's device ``get``): one ``torch.empty`` and
        one ``cudaMemcpyAsync`` per tensor, one event, and nothing else. With
        ``on_current_stream`` (small payloads) the copies run on the caller's current
        stream (no cross-stream ordering at all); otherwise on the copy stream, after
        what the current stream queued before. The host views are held until the event
        has completed (then dropped, by the next call that finds it done or by the
        completer thread).

        Raises
        ------
        ValueError
            A tensor of ``payload`` is not on the host (use ``submit``).
        """
        if self._stream is None:
            return self.submit(payload, on_current_stream=on_current_stream)
        import torch

        empty_like, memcpy, dev = torch.empty_like, self._ops.memcpy, self.device

        def make_move(raw: int, tensors: list[Any], sources: list[Any]) -> Callable[[Any], Any]:
            def move(t: Any) -> Any:
                if not t.is_cpu:
                    raise ValueError(f"submit_host copies host tensors; got one on {t.device} (use submit)")
                if not t.is_contiguous():
                    t = t.contiguous()
                # empty_like of the contiguous host view: its shape and dtype without
                # reading them into Python (empty(t.shape, ...) cost twice as much)
                d = empty_like(t, device=dev)
                n = t.nbytes
                if n:
                    memcpy(d.data_ptr(), t.data_ptr(), n, raw)
                tensors.append(d)
                sources.append(t)
                return d

            return move

        return self._launch(payload, on_current_stream, make_move, lambda sources: sources.clear)

    def submit_frame(self, decode: Callable[[Callable[[int, int], Any], Callable[[Any, Any], Any]], Any], /, *,
                     on_current_stream: bool, keep: Any) -> StagePayloadHandle | None:
        """Land a received frame on the device with one copy of its data region.

        ``decode(fetch, empty)`` decodes the frame: it calls ``fetch(address, n)`` (at
        most once) for a device uint8 buffer (of ``n`` bytes rounded up to 64) into whose
        start the ``n`` host bytes at ``address`` (page-locked or registered memory) are
        copied on the chosen stream,
        and makes every tensor a view of that buffer; ``empty(shape, dtype)`` makes an
        empty device tensor. It returns the payload, or ``None`` (before any fetch) when
        the frame needs the general path; then so does this method, having done
        nothing. One ``torch.empty`` and one ``cudaMemcpyAsync`` per frame, however many
        tensors it holds (``submit_host`` makes one of each per tensor). ``keep`` (the
        host block) is dropped once the copy has completed. Streams as ``submit_host``.
        """
        if self._stream is None:
            return None
        import torch

        comp = self._completer
        if comp.pending:
            comp.reap()
        ops, idx, dev = self._ops, self._index, self.device
        bufs: list[Any] = []
        prev = ops.swap_device(idx)
        try:
            raw = self._copy_stream_for(on_current_stream)
            empty, uint8, memcpy = torch.empty, torch.uint8, ops.memcpy

            def fetch(address: int, n: int) -> Any:
                # Rounded up to 64 bytes: the buffer can be viewed as any dtype.
                d = empty((n + 63) & ~63, dtype=uint8, device=dev)
                memcpy(d.data_ptr(), address, n, raw)
                bufs.append(d)
                return d

            def empty_on_device(shape: Any, dtype: Any) -> Any:
                return empty(shape, dtype=dtype, device=dev)

            try:
                out = decode(fetch, empty_on_device)
            except BaseException:
                if bufs:  # the host block goes back on this error: not while DMA reads it
                    Event(idx).record(raw).synchronize()
                raise
            if out is None:
                return None
            event = Event(idx).record(raw)
        finally:
            ops.restore_device(prev)
        if self.sync:
            event.synchronize()
        held = [keep]
        del keep
        comp.submit(event, held.clear)
        return StagePayloadHandle(out, event, dev, bufs, waiter=comp, stream=raw)

    def _copy_stream_for(self, on_current_stream: bool) -> int:
        """The raw stream a landing copies on (this device current): the caller's current
        stream, or the copy stream ordered after what the current stream queued before.
        The device memory comes from the current stream (the consumer's): a copy stream
        that did not wait could overwrite a block the allocator recycled while an
        earlier kernel still reads it."""
        idx = self._index
        if on_current_stream:
            return current_raw_stream(idx)
        ops, raw = self._ops, self._raw
        ops.wait(raw, ops.ordering_event(idx).record(current_raw_stream(idx)))
        return raw

    def _launch(self, payload: Any, on_current_stream: bool,
                make_move: Callable[[int, list[Any], list[Any]], Callable[[Any], Any]],
                finish: Callable[[list[Any]], Callable[[], None]]) -> StagePayloadHandle:
        """The frame of both submits: reap, pick the stream (after the current one),
        copy each tensor with ``make_move(stream, tensors, sources)``, record the event,
        run ``finish(sources)`` once it has completed."""
        comp = self._completer
        if comp.pending:
            comp.reap()
        ops, idx = self._ops, self._index
        tensors: list[Any] = []
        sources: list[Any] = []
        prev = ops.swap_device(idx)
        try:
            raw = self._copy_stream_for(on_current_stream)
            out = map_tensors(payload, make_move(raw, tensors, sources))
            event = Event(idx).record(raw)
        finally:
            ops.restore_device(prev)
        if self.sync:
            event.synchronize()
        comp.submit(event, finish(sources))
        return StagePayloadHandle(out, event, self.device, tensors, waiter=comp, stream=raw)

    def copy_into(self, pairs: list[tuple[Any, Any]], /, *, keep: Any = None) -> Any:
        """Enqueue ``dst.copy_(src)`` for each (host ``src``, device ``dst``) on the copy
        stream, after the caller's current stream; ``keep`` is dropped once they are done.

        The lower-level entry the shm backend uses to land a sliced payload piece by piece
        into device buffers it allocated. Returns the copies' event (``None`` on CPU).
        """
        if self._stream is None:
            for src, dst in pairs:
                dst.copy_(src)
            return None
        ops, raw, idx = self._ops, self._raw, self._index
        self._completer.reap()
        prev = ops.swap_device(idx)
        try:
            ops.wait(raw, ops.ordering_event(idx).record(current_raw_stream(idx)))
            for src, dst in pairs:
                n = src.numel() * src.element_size()
                if n:
                    ops.memcpy(dst.data_ptr(), src.data_ptr(), n, raw)
            event = Event(idx).record(raw)
        finally:
            ops.restore_device(prev)

        def finish() -> None:
            nonlocal keep, pairs
            keep = pairs = None

        self._completer.submit(event, finish)
        return event

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every copy submitted so far has completed and its host memory is released."""
        return self._completer.drain(timeout)

    def close(self) -> None:
        """Wait for the copies in flight, then stop; idempotent."""
        self._completer.close()

    def __enter__(self) -> AsyncH2DController:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
