"""How a large CUDA payload travels in slices: the head message and its validation.

A payload whose CUDA tensors hold at least ``pipeline_bytes`` is sent as one *head*
message under the user's key, then one message per slice under internal keys that no
user key can equal (they start with NUL, which ``validate_key`` refuses)::

    key            head: {SLICED_MARK: 1,
                          "tree":    the payload, each large CUDA tensor replaced by
                                     {PLACEHOLDER: j} (small tensors and values stay),
                          "tensors": [[dtype name, shape, nbytes], ...]   (tensor j),
                          "slice":   slice_bytes,
                          "token":   16 hex digits}
    \\0<token>.0    {"b": uint8 bytes [0, S) of tensor 0}
    \\0<token>.1    {"b": uint8 bytes [S, 2S) of tensor 0}
    ...             tensor by tensor, each cut at multiples of S, in this order

Whoever claims the head (exactly one receiver) claims the slices in order, so the
receiver copies slice i to its device while the sender is still copying slice i + 1
off its own: both directions of PCIe run at once, and a payload larger than the arena
streams through it. A sender that fails half way publishes an *abort* slice,
``{"abort": reason}``, under the next slice key, so the receiver fails at once instead
of waiting out its timeout.

The head comes from another process: ``parse_head`` checks every field (types,
dtype names, shapes, sizes, counts) before anything is allocated.
"""

from __future__ import annotations

import math
import re
from typing import Any

from omnilink._errors import BlobDecodeError
from omnilink.blob import _torch_dtypes

__all__ = [
    "ABORT",
    "PLACEHOLDER",
    "SLICED_MARK",
    "build_head",
    "fill_placeholders",
    "parse_head",
    "plan_slices",
    "slice_key",
]

SLICED_MARK = "\x00omnilink/sliced"
PLACEHOLDER = "\x00omnilink/t"
ABORT = "abort"
#: Bounds a head must respect (a hostile one must not make the receiver allocate or
#: loop without limit).
MAX_SLICED_TENSORS = 4096
MAX_SLICES = 1 << 20
MAX_SLICED_BYTES = 1 << 40
_TOKEN = re.compile(r"[0-9a-f]{16}")


def slice_key(token: str, index: int) -> str:
    return f"\x00{token}.{index}"


def plan_slices(sizes: list[int], slice_bytes: int) -> list[tuple[int, int, int]]:
    """``[(tensor j, start, stop)]``: each tensor cut at multiples of ``slice_bytes``."""
    out = []
    for j, n in enumerate(sizes):
        for a in range(0, n, slice_bytes):
            out.append((j, a, min(a + slice_bytes, n)))
    return out


def dtype_name(dtype: Any) -> str:
    return str(dtype).rpartition(".")[2]


def build_head(tree: Any, tensors: list[Any], slice_bytes: int, token: str) -> dict[str, Any]:
    """The head message for ``tree`` whose large tensors were replaced by placeholders."""
    specs = [[dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size()] for t in tensors]
    return {SLICED_MARK: 1, "tree": tree, "tensors": specs, "slice": slice_bytes, "token": token}


def _bad(what: str) -> BlobDecodeError:
    return BlobDecodeError(f"sliced payload head: {what}")


def parse_head(head: dict[str, Any]) -> tuple[Any, list[tuple[Any, list[int], int]], int, str]:
    """``(tree, [(dtype, shape, nbytes)], slice_bytes, token)`` of a received head.

    Raises
    ------
    BlobDecodeError
        Any field is missing, of the wrong type, out of bounds or inconsistent.
    """
    import torch

    if head.get(SLICED_MARK) != 1:
        raise _bad(f"unknown version {head.get(SLICED_MARK)!r}")
    extra = set(head) - {SLICED_MARK, "tree", "tensors", "slice", "token"}
    if extra:
        raise _bad(f"unexpected fields {sorted(map(repr, extra))}")
    token = head.get("token")
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise _bad(f"token must be 16 hex digits, got {token!r}")
    slice_bytes = head.get("slice")
    if type(slice_bytes) is not int or not 4096 <= slice_bytes <= MAX_SLICED_BYTES:
        raise _bad(f"slice size must be an int in [4096, 2**40], got {slice_bytes!r}")
    specs = head.get("tensors")
    if not isinstance(specs, list) or not specs or len(specs) > MAX_SLICED_TENSORS:
        raise _bad(f"tensors must be a list of 1 to {MAX_SLICED_TENSORS} entries")
    out = []
    total = 0
    slices = 0
    for j, spec in enumerate(specs):
        if not isinstance(spec, list) or len(spec) != 3:
            raise _bad(f"tensor {j} must be [dtype, shape, nbytes], got {spec!r}")
        name, shape, nbytes = spec
        dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
        if not isinstance(dtype, torch.dtype) or dtype not in _torch_dtypes()[0]:
            raise _bad(f"tensor {j}: unknown dtype {name!r}")
        if not isinstance(shape, list) or len(shape) > 64 or not all(
                type(d) is int and 0 <= d <= MAX_SLICED_BYTES for d in shape):
            raise _bad(f"tensor {j}: shape must be a list of at most 64 ints >= 0, got {shape!r}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = math.prod(shape)
        if type(nbytes) is not int or nbytes != numel * itemsize or nbytes == 0:
            raise _bad(f"tensor {j}: nbytes {nbytes!r} != {numel} elements x {itemsize} bytes, or empty")
        total += nbytes
        if total > MAX_SLICED_BYTES:
            raise _bad(f"tensors hold more than {MAX_SLICED_BYTES} bytes")
        slices += -(-nbytes // slice_bytes)
        if slices > MAX_SLICES:
            raise _bad(f"more than {MAX_SLICES} slices")
        out.append((dtype, shape, nbytes))
    return head.get("tree"), out, slice_bytes, token


def fill_placeholders(tree: Any, tensors: list[Any]) -> Any:
    """``tree`` with each ``{PLACEHOLDER: j}`` replaced by ``tensors[j]``, each used once.

    Raises
    ------
    BlobDecodeError
        A placeholder names no tensor, or names one twice, or one is never named.
    """
    used = [False] * len(tensors)

    def walk(x: Any) -> Any:
        if type(x) is dict:
            if PLACEHOLDER in x:
                j = x[PLACEHOLDER]
                if len(x) != 1 or type(j) is not int or not 0 <= j < len(tensors) or used[j]:
                    raise _bad(f"bad placeholder {x!r}")
                used[j] = True
                return tensors[j]
            return {k: walk(v) for k, v in x.items()}
        if type(x) is list:
            return [walk(v) for v in x]
        if type(x) is tuple:
            return tuple(walk(v) for v in x)
        return x

    out = walk(tree)
    if not all(used):
        raise _bad("a sliced tensor has no place in the payload")
    return out
