"""The device part of a message: one walk of the payload on the sender, the manifest's
bounds, and putting each view back at its path on the receiver.

A message is ``{"d": manifest, "h": host part, "n": size}``: the host part is the payload
with ``None`` where each device tensor was; the manifest is ``[generation, seq, slot,
block address (``segment << 48 | offset``), block bytes, [[dtype code, offset in block, nbytes, shape, path], ...]]``
(``None`` when the payload holds no device tensor), ``path`` the dict keys and list or
tuple indices that lead to the tensor. The receiver validates it
(``PoolReceiver.parse``) before any of it is used.
"""

from __future__ import annotations

from typing import Any

from omnilink.blob import DTYPE_CODES

__all__ = ["BadPath", "ITEMSIZE", "MAX_NDIM", "MAX_TENSORS", "INT64_MAX", "dtypes", "one_device", "place", "split",
           "tensor_type"]

#: Most dimensions and tensors a manifest may name (bounded before use).
MAX_NDIM = 64
MAX_TENSORS = 1 << 16
INT64_MAX = (1 << 63) - 1
ITEMSIZE = {code: size for code, size in DTYPE_CODES.values()}

#: what the payload walks pass through as they are (no container, no tensor)
_LEAVES = (str, int, float, bool, type(None), bytes)
_tables: tuple[dict[Any, int], dict[int, Any]] | None = None


def _dtype_tables() -> tuple[dict[Any, int], dict[int, Any]]:
    import torch

    by_dtype: dict[Any, int] = {}
    by_code: dict[int, Any] = {}
    for name, (code, _) in DTYPE_CODES.items():
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            by_dtype[dt] = code
            by_code[code] = dt
    return by_dtype, by_code


def dtypes() -> tuple[dict[Any, int], dict[int, Any]]:
    """``(torch dtype -> tensor_blob dtype code, code -> dtype)``, built once."""
    global _tables
    if _tables is None:
        _tables = _dtype_tables()
    return _tables


def tensor_type() -> Any:
    import torch

    return torch.Tensor


def one_device(chosen: list[tuple[Any, Any, Any]], device_of: Any) -> int | None:
    """The device index every device tensor of ``chosen`` (``split``'s ``[(path, tensor,
    pick)]``, pick 2: a small host tensor for the block) lives on (``device_of``), or
    ``None`` when there is none or they live on several."""
    where = None
    for _path, t, pick in chosen:
        if pick != 2:
            d = device_of(t)
            if where is None:
                where = d
            elif d != where:
                return None
    return where


def split(payload: Any, is_device: Any, tensor_type: Any,
          kept: list[int] | None = None) -> tuple[Any, list[tuple[tuple[Any, ...], Any, Any]]]:
    """One walk of ``payload``: the host part (each tensor ``is_device`` picks replaced
    by ``None``) and ``[(path, tensor, pick)]`` of the picked tensors, ``path`` the dict
    keys and list or tuple indices that lead to it (``()``: the payload is the tensor),
    ``pick`` what ``is_device`` returned for it (a caller that picks tensors of two
    kinds learns which, without asking the tensor again). ``kept``: a list whose first
    item counts the tensors left in the host part."""
    found: list[tuple[tuple[Any, ...], Any, Any]] = []

    def walk(x: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(x, tensor_type):
            pick = is_device(x)
            if pick:
                found.append((path, x, pick))
                return None
            if kept is not None:
                kept[0] += 1
            return x
        if isinstance(x, dict):
            out = {}
            for k, v in x.items():
                out[k] = v if type(v) in _LEAVES else walk(v, (*path, k))
            return out
        if isinstance(x, (list, tuple)):
            items = [v if type(v) in _LEAVES else walk(v, (*path, i)) for i, v in enumerate(x)]
            return items if isinstance(x, list) else tuple(items)
        return x

    return walk(payload, ()), found


class BadPath(Exception):
    """A manifest path that does not lead to a ``None`` of the host part."""


def place(node: Any, path: tuple[Any, ...], depth: int, value: Any) -> Any:
    """``node`` with ``value`` at ``path[depth:]`` in place of the ``None`` there (dicts
    and lists changed in place, a tuple on the way rebuilt); ``BadPath`` otherwise."""
    step = path[depth]
    t = type(node)
    if t is dict:
        if type(step) is not str or step not in node:
            raise BadPath
    elif t is list or t is tuple:
        if type(step) is not int or not 0 <= step < len(node):
            raise BadPath
    else:
        raise BadPath
    child = node[step]
    if depth + 1 == len(path):
        if child is not None:
            raise BadPath
        new = value
    else:
        new = place(child, path, depth + 1, value)
    if t is tuple:
        items = list(node)
        items[step] = new
        return tuple(items)
    node[step] = new
    return node
