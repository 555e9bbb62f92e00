"""Moving a decoded payload to a device (the receiver's ``get(..., device=...)``)."""

from __future__ import annotations

from typing import Any

from omnilink._errors import ConfigurationError, CudaError
from omnilink._util import plain_tensor

__all__ = ["payload_to_device"]


def payload_to_device(obj: Any, device: Any) -> Any:
    """Return ``obj`` with every torch tensor moved to ``device`` (other leaves kept; a
    tensor already there is kept as it is).

    Raises
    ------
    ConfigurationError
        ``device`` is not a valid torch device string.
    CudaError
        A CUDA device was asked for where CUDA is unavailable.
    """
    import torch

    dev = _checked(device, torch)
    index = None if dev.type != "cuda" else dev.index if dev.index is not None else torch.cuda.current_device()
    small: list[Any] = []  # [tensor, offset] of small CPU tensors, placed after the walk
    total = 0
    Tensor = torch.Tensor
    strided = torch.strided

    def move(x: Any) -> Any:
        nonlocal total
        if isinstance(x, Tensor):
            if batch:
                if x.is_cuda and x.get_device() == index:
                    return x  # already there (a pool's view): no dispatch at all
                if x.is_cpu and x.layout is strided:
                    n = x.numel() * x.element_size()
                    if n <= SMALL_BYTES:
                        slot = [x, total]
                        small.append(slot)
                        total += (n + _ALIGN - 1) // _ALIGN * _ALIGN or _ALIGN
                        return slot
            return x.to(dev, non_blocking=False)
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        if isinstance(x, list):
            return [move(v) for v in x]
        if isinstance(x, tuple):
            return tuple(move(v) for v in x)
        return x

    batch = index is not None
    try:
        out = move(obj)
        if not small:
            return out
        views = _one_copy(torch, small, total, dev)
        return _swap(out, {id(slot): v for slot, v in zip(small, views)})
    except RuntimeError as exc:
        raise CudaError(f"moving payload to {device!r} failed: {exc}") from exc


#: device argument -> its torch.device, checked once per argument
_TARGETS: dict[Any, Any] = {}


def _checked(device: Any, torch: Any) -> Any:
    """The ``torch.device`` of a ``device`` argument, parsed and checked once per value."""
    try:
        dev = _TARGETS.get(device)
    except TypeError:  # unhashable: checked every time
        dev = None
    if dev is None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigurationError(f"invalid device {device!r}: {exc}") from exc
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise CudaError(f"device {device!r} requested but CUDA is not available in this process")
        try:
            if len(_TARGETS) < 64:
                _TARGETS[device] = dev
        except TypeError:
            pass
    return dev


#: CPU tensors up to this size go to a CUDA device together: packed into one page-locked
#: staging buffer, one asynchronous copy on the current stream (the host does not wait
#: for the stream), views of one device buffer. Larger ones are copied one by one.
SMALL_BYTES = 64 << 10
_ALIGN = 16


def _one_copy(torch: Any, small: list[Any], total: int, dev: Any, *, pin: bool = True) -> list[Any]:
    """Device tensors of the small CPU tensors ``small`` (``[tensor, offset]``, each
    offset a multiple of 16): one page-locked staging buffer from torch's caching host
    allocator (which keeps it until the copy out of it has run), one ``non_blocking``
    copy into one device buffer on the current stream, then one view of that buffer per
    dtype and one ``as_strided`` per tensor (a slice and two views each cost twice as
    much). ``pin=False``: pageable staging (tests on a machine without CUDA)."""
    import ctypes

    from omnilink.blob import _contiguous_strides

    stage = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    base = stage.data_ptr()
    memmove = ctypes.memmove
    for slot in small:
        t = slot[0] = plain_tensor(slot[0])
        n = t.numel() * t.element_size()
        if n:
            memmove(base + slot[1], t.data_ptr(), n)
    buf = stage.to(dev, non_blocking=True)
    typed: dict[Any, Any] = {}
    views = []
    for t, off in small:
        dt = t.dtype
        v = typed.get(dt)
        if v is None:
            v = typed[dt] = buf.view(dt)  # total is a multiple of 16: of every itemsize
        shape = tuple(t.shape)
        views.append(v.as_strided(shape, _contiguous_strides(shape), off // t.element_size()))
    return views


def _swap(x: Any, views: dict[int, Any]) -> Any:
    """``x`` with each placeholder slot (a list ``move`` returned) replaced by its view."""
    t = type(x)
    if t is list:
        v = views.get(id(x))
        if v is not None:
            return v
        return [_swap(y, views) for y in x]
    if t is dict:
        return {k: _swap(y, views) for k, y in x.items()}
    if t is tuple:
        return tuple(_swap(y, views) for y in x)
    return x
