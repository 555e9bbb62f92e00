"""tensor_blob v1: the one wire format of every omnilink backend.

A frame is a fixed prefix, a msgpack header and a data region holding every tensor's
bytes at a 64-byte aligned offset. Nothing is pickled; decoding makes zero-copy views::

    offset  size  field
    0       4     magic b"OLB1"
    4       2     version (u16, little-endian) = 1
    6       2     flags (u16) = 0 (a frame with unknown flags is rejected)
    8       4     header_len (u32)
    12      4     crc32 of the header bytes (zlib.crc32)
    16      8     data_len (u64)
    24      H     header: msgpack of BlobHeader = [tensors, tree]
    24+H    ...   zero padding up to D = align64(24 + H)
    D       ...   data region, data_len bytes: tensor i at D + offset_i (offset_i % 64 == 0)

    BlobHeader.tensors[i] = [kind, dtype_code, shape, offset, nbytes]
        kind   0 torch.Tensor, 1 numpy.ndarray, 2 numpy scalar (np.generic)
        dtype  stable code from DTYPE_CODES (independent of torch/numpy versions)
        shape  list of dims >= 0; nbytes == prod(shape) * itemsize
        data is C-contiguous, little-endian, in host memory order
    BlobHeader.tree = the payload in msgpack, where a tensor or array is
        Ext(1, u32 index into tensors) and a tuple is Ext(2, msgpack list of items).

The data region is not checksummed (a CRC would cost a pass over every byte); the
header is. Whatever a buffer holds, ``decode`` validates the prefix, the header's CRC,
every descriptor (known dtype, non-negative dims, ``nbytes == numel * itemsize``,
alignment, region inside ``data_len``, regions in order and disjoint) and the tree's
tensor references before it makes a single view, and reports anything wrong as
``BlobDecodeError`` naming the field and the limit. Everything a header could make the
decoder allocate is bounded before it is allocated:

    header bytes   MAX_HEADER_BYTES (checked from the prefix, before the header is read)
    tensor count   MAX_TENSORS, or a lower ``max_tensors`` (checked from the msgpack
                   array length, before any descriptor is built)
    dims           MAX_NDIM per shape; each dim in [0, 2**63); the product of the
                   non-zero dims times the itemsize fits in int64 (torch/numpy strides)
    tree items     MAX_TREE_ITEMS, or a lower ``max_tree_items``: every msgpack item
                   of the payload tree (containers, keys, scalars) counts one; a tree
                   of at most that many bytes cannot hold more, so only larger trees
                   are scanned before they are decoded
    tree depth     MAX_TREE_DEPTH nested containers (dicts, lists and tuples) at most;
                   a tuple's items are decoded from a view of the frame, never from a
                   copy of the rest of it, so depth cannot multiply what a frame costs
    arity          the header, each descriptor: exactly the fields above, no extras
    dict keys      str only (a map with another key type is rejected)

``encode`` refuses a payload above MAX_TENSORS, MAX_TREE_ITEMS or MAX_TREE_DEPTH, so whatever it writes
a default decoder reads.

Read-only buffers (``bytes``, a received network frame): numpy arrays decoded from one
are read-only views; torch has no read-only tensors, so torch tensors are copies unless
the caller passes ``view_readonly=True`` and thereby promises not to write to them (a
transport does, for a frame only it holds). Writing into a view of ``bytes`` would
silently change an immutable object.

Lifetime: decoded tensors are views made with ``torch.frombuffer`` / ``np.frombuffer``
on the very object passed to ``decode``; each view keeps that object alive, and it is
released when the last view dies. Transports hand ``decode`` a per-message exporter
and attach ``weakref.finalize`` to it to learn when a block is free.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import struct
import sys
import warnings
import zlib
from typing import Annotated, Any

import msgspec

from omnilink._errors import BlobDecodeError, BlobEncodeError, BlobVersionError

__all__ = [
    "DTYPE_CODES",
    "FRAME_ALIGN",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MAX_NDIM",
    "MAX_TENSORS",
    "MAX_TREE_DEPTH",
    "MAX_TREE_ITEMS",
    "PREFIX_SIZE",
    "VERSION",
    "BlobHeader",
    "PreparedBlob",
    "TensorDesc",
    "decode",
    "decode_detached",
    "decode_parsed",
    "decode_parts",
    "decode_parts_counted",
    "encode",
    "encode_into",
    "encode_parts",
    "encoded_size",
    "parse_detached",
    "peek_header",
    "prepare",
    "reads_data",
    "torch_dtype_of",
]

MAGIC = b"OLB1"
VERSION = 1
FRAME_ALIGN = 64
PREFIX_SIZE = 24
#: Largest header a decoder accepts: bounds what a hostile frame can make us parse.
MAX_HEADER_BYTES = 64 << 20
MAX_NDIM = 64
#: Most tensors one frame may describe (each costs the decoder ~1 KiB of objects).
MAX_TENSORS = 1 << 14
#: Most msgpack items one payload tree may hold (each costs the decoder <= ~100 bytes).
MAX_TREE_ITEMS = 1 << 20
#: Most containers (dicts, lists, tuples) one payload tree may nest: the decoder holds
#: one frame of work per level, and a bound far below Python's recursion limit keeps a
#: legal payload decodable however deep the caller's own stack is.
MAX_TREE_DEPTH = 128
_INT64_MAX = (1 << 63) - 1

_PREFIX = struct.Struct("<4sHHIIQ")
_ZEROS = bytes(FRAME_ALIGN)
#: Below this size a contiguous CPU tensor is written with one ctypes.memmove; above
#: it torch's copy is used when torch has several intra-op threads to spread it over
#: and they leave a CPU free (see ``_parallel_copy``).
_MEMMOVE_MAX = 1 << 20


_PAGE = 4096
_ALIAS_WINDOW = 1024
_CHUNK = 1 << 20


def _memcpy(dst: int, src: int, n: int) -> None:
    """One copy of ``n`` bytes, avoiding glibc's slow case for huge copies.

    Above its non-temporal threshold glibc's memmove runs ~4x slower when ``dst`` sits
    just past ``src`` modulo a page (4K aliasing; measured 72 ms against 18 ms for
    256 MiB on the 2-core EPYC). Copies in 1 MiB pieces use ordinary stores and do not
    suffer it, so such copies are split.
    """
    if n > 8 * _CHUNK and 0 < (dst - src) % _PAGE < _ALIAS_WINDOW:
        for i in range(0, n, _CHUNK):
            ctypes.memmove(dst + i, src + i, min(_CHUNK, n - i))
    else:
        ctypes.memmove(dst, src, n)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _parallel_copy() -> bool:
    """Whether a large host copy should use torch's intra-op threads.

    Only when there are several and they leave at least one CPU of this process free: a
    parallel copy ends when its slowest thread does, so one that needs every CPU stalls
    for a scheduler slice (milliseconds) whenever anything else is busy, a receiver
    polling ``get_nowait`` for instance. Measured with benchmarks/bench_small.py on a
    2-core VM: 8 MiB put -> consumed took 7.8 ms with torch's 2-thread copy beside one
    busy process, 0.8-1.1 ms with one memmove."""
    threads = _torch_threads()
    if threads <= 1:
        return False
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return threads < cpus
_U32 = struct.Struct("<I")

_EXT_TENSOR = 1
_EXT_TUPLE = 2

KIND_TORCH = 0
KIND_NUMPY = 1
KIND_NUMPY_SCALAR = 2

#: Stable dtype codes: name -> (code, itemsize). Names are torch's; numpy uses the same
#: code for the same bit layout. Codes are never reused.
DTYPE_CODES: dict[str, tuple[int, int]] = {
    "bool": (1, 1),
    "uint8": (2, 1),
    "int8": (3, 1),
    "int16": (4, 2),
    "int32": (5, 4),
    "int64": (6, 8),
    "float16": (7, 2),
    "bfloat16": (8, 2),
    "float32": (9, 4),
    "float64": (10, 8),
    "complex32": (11, 4),
    "complex64": (12, 8),
    "complex128": (13, 16),
    "float8_e4m3fn": (14, 1),
    "float8_e5m2": (15, 1),
    "float8_e4m3fnuz": (16, 1),
    "float8_e5m2fnuz": (17, 1),
    "float8_e8m0fnu": (18, 1),
    "uint16": (19, 2),
    "uint32": (20, 4),
    "uint64": (21, 8),
    "float4_e2m1fn_x2": (22, 1),
}
_ITEMSIZE_BY_CODE = {code: size for code, size in DTYPE_CODES.values()}
_BOOL_CODE = DTYPE_CODES["bool"][0]
_NAME_BY_CODE = {code: name for name, (code, _) in DTYPE_CODES.items()}
_NUMPY_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
    "complex64", "complex128", "uint16", "uint32", "uint64",
)


_Dim = Annotated[int, msgspec.Meta(ge=0, le=_INT64_MAX)]
_Size = Annotated[int, msgspec.Meta(ge=0, le=_INT64_MAX)]


class TensorDesc(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One tensor region: ``[kind, dtype, shape, offset, nbytes]`` on the wire."""

    kind: int
    dtype: int
    shape: Annotated[list[_Dim], msgspec.Meta(max_length=MAX_NDIM)]
    offset: _Size
    nbytes: _Size


class BlobHeader(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """The msgpack header of a frame: tensor descriptors and the payload tree."""

    tensors: Annotated[list[TensorDesc], msgspec.Meta(max_length=MAX_TENSORS)]
    tree: msgspec.Raw


class _SplitHeader(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """The same header bytes as ``BlobHeader``, split without decoding the descriptors
    (the decoder's plan cache is keyed by their bytes)."""

    tensors: msgspec.Raw
    tree: msgspec.Raw


_ENCODER = msgspec.msgpack.Encoder()
_HEADER_DECODER = msgspec.msgpack.Decoder(BlobHeader)
_SPLIT_DECODER = msgspec.msgpack.Decoder(_SplitHeader)
_DESC_FIELDS = ("kind", "dtype", "shape", "offset", "nbytes")
_ERR_PATH = re.compile(r"`\$\[0\](?:\[(\d+)\](?:\[(\d+)\](?:\[(\d+)\])?)?)?`$")


# --------------------------------------------------------------------------- dtypes
_torch_tables: tuple[dict[Any, tuple[int, int]], dict[int, Any]] | None = None
_numpy_tables: tuple[dict[Any, tuple[int, int]], dict[int, Any]] | None = None


#: torch dtype -> (code, itemsize, is complex), filled with ``_torch_dtypes`` (empty until then)
_TORCH_CODES: dict[Any, tuple[int, int]] = {}
#: ``[torch.strided]`` once torch is in use
_STRIDED: list[Any] = [None]
#: ``(dtype, torch.Size, offset) -> (TensorDesc, next offset)`` for the encoder's tensors
_DESC_CACHE: dict[tuple[Any, Any, int], tuple[TensorDesc, int]] = {}
_DESC_CACHE_MAX = 1024


def _torch_dtypes() -> tuple[dict[Any, tuple[int, int]], dict[int, Any]]:
    global _torch_tables
    if _torch_tables is None:
        import torch

        to_code: dict[Any, tuple[int, int]] = {}
        from_code: dict[int, Any] = {}
        for name, (code, size) in DTYPE_CODES.items():
            dt = getattr(torch, name, None)
            if isinstance(dt, torch.dtype):
                to_code[dt] = (code, size)
                from_code[code] = dt
        _STRIDED[0] = torch.strided
        _TORCH_CODES.update({dt: (code, size, code in _COMPLEX_CODES) for dt, (code, size) in to_code.items()})
        _torch_tables = (to_code, from_code)
    return _torch_tables


def _numpy_dtypes() -> tuple[dict[Any, tuple[int, int]], dict[int, Any]]:
    global _numpy_tables
    if _numpy_tables is None:
        import numpy as np

        to_code: dict[Any, tuple[int, int]] = {}
        from_code: dict[int, Any] = {}
        for name in _NUMPY_NAMES:
            dt = np.dtype(name)
            to_code[dt] = DTYPE_CODES[name]
            from_code[DTYPE_CODES[name][0]] = dt
        _numpy_tables = (to_code, from_code)
    return _numpy_tables




# msgpack lead bytes -> (bytes of the length field, fixed extra bytes) for the items the
# tree scanner skips by length; containers and ext are handled separately.
_MP_SKIP = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
            0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
_MP_LEN = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
_MP_EXT = {0xC7: 1, 0xC8: 2, 0xC9: 4, 0xD4: -1, 0xD5: -2, 0xD6: -4, 0xD7: -8, 0xD8: -16}


def _count_items(buf: memoryview, pos: int, end: int, budget: int) -> tuple[int, int]:
    """Count the msgpack items of the one object at ``buf[pos:end]``, tuple extensions
    included, without building any of them; return ``(items, end of the object)``.

    Raises ``BlobDecodeError`` as soon as the count passes ``budget`` or the bytes run
    out; it never allocates per item, so it bounds what decoding the tree would build.
    """
    count = 0
    pending = 1
    stack: list[tuple[int, int]] = []  # (outer pending, outer end) around a tuple ext
    while True:
        while pending:
            if pos >= end:
                raise BlobDecodeError("payload tree is truncated")
            b = buf[pos]
            pending -= 1
            count += 1
            if count > budget:
                raise BlobDecodeError(
                    f"payload tree holds more than {budget} items (limit max_tree_items / MAX_TREE_ITEMS)"
                )
            if b <= 0x7F or b >= 0xE0:
                pos += 1
            elif b <= 0x8F:
                pending += 2 * (b & 0x0F)
                pos += 1
            elif b <= 0x9F:
                pending += b & 0x0F
                pos += 1
            elif b <= 0xBF:
                pos += 1 + (b & 0x1F)
            elif b in _MP_SKIP:
                pos += 1 + _MP_SKIP[b]
            elif b in _MP_LEN:
                w = _MP_LEN[b]
                pos += 1 + w + int.from_bytes(buf[pos + 1 : pos + 1 + w], "big")
            elif b in (0xDC, 0xDD, 0xDE, 0xDF):
                w = 2 if b in (0xDC, 0xDE) else 4
                n = int.from_bytes(buf[pos + 1 : pos + 1 + w], "big")
                pending += 2 * n if b >= 0xDE else n
                pos += 1 + w
            elif b in _MP_EXT:
                w = _MP_EXT[b]
                if w < 0:
                    n, head = -w, 1
                else:
                    n, head = int.from_bytes(buf[pos + 1 : pos + 1 + w], "big"), 1 + w
                if pos + head >= end:
                    raise BlobDecodeError("payload tree is truncated")
                code = buf[pos + head]
                start = pos + head + 1
                pos = start + n
                if code == _EXT_TUPLE:
                    # Descend: the tuple's items are built too, so they count. The
                    # stack is bounded as the decoder bounds the nesting.
                    if len(stack) >= MAX_TREE_DEPTH:
                        raise _too_deep()
                    stack.append((pending, end))
                    pending, end, pos = 1, min(pos, end), start
            else:
                raise BlobDecodeError(f"payload tree holds the invalid msgpack byte 0x{b:02x}")
        if pos > end:
            raise BlobDecodeError("payload tree is truncated")
        if not stack:
            return count, pos
        pending, end = stack.pop()


def _align(n: int) -> int:
    return (n + FRAME_ALIGN - 1) & ~(FRAME_ALIGN - 1)


def _byte_view(buffer: Any, what: str, exc_type: type[Exception]) -> memoryview:
    """A 1-D unsigned-byte memoryview of any C-contiguous buffer-protocol object."""
    try:
        mv = memoryview(buffer)
    except TypeError as exc:
        raise exc_type(f"{what} needs a bytes-like buffer, got {type(buffer).__name__}") from exc
    if mv.format == "B" and mv.ndim == 1:
        return mv
    if not mv.c_contiguous:
        raise exc_type(f"{what} needs a C-contiguous buffer")
    try:
        return mv.cast("B")
    except TypeError:
        import numpy as np

        return memoryview(np.frombuffer(buffer, dtype=np.uint8))


def _path_str(path: list[Any]) -> str:
    return "payload" + "".join(f"[{p!r}]" for p in path)


# ------------------------------------------------------------------------- encoding
_SCALARS = frozenset((str, int, float, bool, type(None), bytes))
_COMPLEX_CODES = frozenset(DTYPE_CODES[n][0] for n in ("complex32", "complex64", "complex128"))
_TENSOR_REFS = [msgspec.msgpack.Ext(_EXT_TENSOR, _U32.pack(i)) for i in range(256)]


class _Retry(Exception):
    """Internal: the fast walk met something it leaves to the path-tracking walk."""


class _Walker:
    """Turns a payload into a msgpack-ready tree plus the list of tensors it holds."""

    __slots__ = ("torch", "tensor", "np", "sources", "descs", "seen", "offset", "path", "on_device")

    def __init__(self) -> None:
        # A payload can only hold torch tensors if torch is already imported.
        torch = self.torch = sys.modules.get("torch")
        self.tensor = None if torch is None else torch.Tensor
        self.np = sys.modules.get("numpy")
        self.sources: list[tuple[int, Any]] = []
        self.descs: list[TensorDesc] = []
        self.seen: dict[int, int] = {}
        self.offset = 0
        self.path: list[Any] = []
        #: whether a torch tensor of the payload is not on the host (``device_bytes``)
        self.on_device = False

    def fail(self, what: str) -> BlobEncodeError:
        return BlobEncodeError(f"{_path_str(self.path)}: {what}")

    def fast(self, obj: Any, depth: int = 1) -> Any:
        """``walk`` without path bookkeeping: raises ``_Retry`` on anything unusual so
        that ``walk`` can run again and name the offending path. ``depth``: how many
        containers ``obj`` is nested in, itself included if it is one."""
        t = type(obj)
        if t in _SCALARS:
            return obj
        if depth > MAX_TREE_DEPTH and (t is dict or t is list or t is tuple):
            raise _Retry
        if t is dict:
            out = {}
            tensor = self.tensor
            for k, v in obj.items():
                if type(k) is not str:
                    raise _Retry
                tv = type(v)
                if tv in _SCALARS:
                    out[k] = v
                elif tv is tensor:
                    out[k] = _plain_ref(self, v) or self.fast(v, depth + 1)
                elif tv is list and depth < MAX_TREE_DEPTH and _SCALARS.issuperset(map(type, v)):
                    out[k] = v  # scalars only (a shape, ids): msgspec encodes the list itself
                else:
                    out[k] = self.fast(v, depth + 1)
            return out
        if t is list:
            if _SCALARS.issuperset(map(type, obj)):
                return obj
            tensor = self.tensor
            # A list of tensors (small ones beside a hidden state): each one's reference
            # in one call, as in a dict.
            return [v if type(v) in _SCALARS
                    else ((_plain_ref(self, v) or self.fast(v, depth + 1)) if type(v) is tensor
                          else self.fast(v, depth + 1)) for v in obj]
        if t is tuple:
            items = [v if type(v) in _SCALARS else self.fast(v, depth + 1) for v in obj]
            return msgspec.msgpack.Ext(_EXT_TUPLE, _ENCODER.encode(items))
        if t is self.tensor:
            ref = _plain_ref(self, obj)
            if ref is not None:
                return ref
        ref = self.array_ref(obj)
        if ref is None:
            raise _Retry
        return ref

    def walk(self, obj: Any) -> Any:
        t = type(obj)
        if t is str or t is int or t is float or t is bool or obj is None or t is bytes:
            if t is int and not (-(1 << 63) <= obj < (1 << 64)):
                raise self.fail(f"int {obj} does not fit in 64 bits")
            return obj
        if (t is dict or t is list or t is tuple) and len(self.path) >= MAX_TREE_DEPTH:
            raise self.fail(f"nested too deeply (more than MAX_TREE_DEPTH = {MAX_TREE_DEPTH} containers)")
        if t is dict:
            out = {}
            path = self.path
            for k, v in obj.items():
                if type(k) is not str:
                    path.append(k)
                    raise self.fail(f"dict key of type {type(k).__name__} (keys must be str)")
                path.append(k)
                out[k] = self.walk(v)
                path.pop()
            return out
        if t is list or t is tuple:
            path = self.path
            items = []
            for i, v in enumerate(obj):
                path.append(i)
                items.append(self.walk(v))
                path.pop()
            if t is tuple:
                return msgspec.msgpack.Ext(_EXT_TUPLE, _ENCODER.encode(items))
            return items
        ref = self.array_ref(obj)
        if ref is not None:
            return ref
        # Subclasses of the plain types (IntEnum, str subclasses, OrderedDict...) are
        # refused rather than silently decoded as their base type.
        raise self.fail(f"type {t.__module__}.{t.__qualname__} is not supported by tensor_blob")

    def array_ref(self, obj: Any) -> msgspec.msgpack.Ext | None:
        """The reference to ``obj`` if it is a tensor, array or numpy scalar, else None."""
        torch = self.torch
        if torch is not None and isinstance(obj, torch.Tensor):
            return self.tensor_ref(obj, KIND_TORCH)
        np = self.np
        if np is not None:
            if isinstance(obj, np.ndarray):
                return self.tensor_ref(obj, KIND_NUMPY)
            if isinstance(obj, np.generic):
                return self.tensor_ref(np.asarray(obj), KIND_NUMPY_SCALAR)
        return None

    def tensor_ref(self, obj: Any, kind: int) -> msgspec.msgpack.Ext:
        key = id(obj)
        index = self.seen.get(key)
        if index is None:
            if kind == KIND_TORCH:
                code, size, shape, src = self.torch_source(obj)
                if not src.is_cpu:
                    self.on_device = True
            else:
                code, size, shape, src = self.numpy_source(obj)
            numel = math.prod(shape)
            nbytes = numel * size
            index = len(self.descs)
            self.descs.append(TensorDesc(kind, code, shape, self.offset, nbytes))
            self.sources.append((kind, src))
            self.offset = _align(self.offset + nbytes)
            self.seen[key] = index
        return _TENSOR_REFS[index] if index < len(_TENSOR_REFS) else msgspec.msgpack.Ext(_EXT_TENSOR, _U32.pack(index))

    def torch_source(self, t: Any) -> tuple[int, int, list[int], Any]:
        to_code, _ = _torch_dtypes()
        entry = to_code.get(t.dtype)
        if entry is None:
            raise self.fail(f"torch dtype {t.dtype} is not supported by tensor_blob")
        if t.layout is not self.torch.strided:
            raise self.fail(f"torch layout {t.layout} is not supported (only dense tensors)")
        # Quantized dtypes are not in the table, so they were refused above.
        if t.is_meta:
            raise self.fail("meta tensors have no data to send")
        if t.requires_grad:
            t = t.detach()
        if entry[0] in _COMPLEX_CODES and t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        return entry[0], entry[1], list(t.shape), t

    def numpy_source(self, a: Any) -> tuple[int, int, list[int], Any]:
        to_code, _ = _numpy_dtypes()
        dt = a.dtype
        entry = to_code.get(dt)
        if entry is None:
            if dt.kind in "biufc" and dt.byteorder not in "=|" and dt.newbyteorder("=") in to_code:
                raise self.fail(f"numpy array of non-native byte order {dt.str} (use .astype(native))")
            raise self.fail(f"numpy dtype {dt} is not supported by tensor_blob")
        return entry[0], entry[1], list(a.shape), a


_new = object.__new__
_modules = sys.modules


def _new_walker() -> _Walker:
    """``_Walker()`` without the cost of calling a class (once per ``prepare``)."""
    w = _new(_Walker)
    torch = w.torch = _modules.get("torch")
    w.tensor = None if torch is None else torch.Tensor
    w.np = _modules.get("numpy")
    w.sources = []
    w.descs = []
    w.seen = {}
    w.offset = 0
    w.path = []
    w.on_device = False
    return w


def _plain_ref(w: _Walker, obj: Any) -> msgspec.msgpack.Ext | None:
    """``tensor_ref`` of the common tensor in one call: a dense tensor of a known
    dtype that needs no detach, conj or neg resolution and was not seen before in
    this payload. Anything else returns ``None`` and takes ``tensor_ref``.

    The descriptor of a (dtype, shape, offset) seen before is reused from a small
    cache (``TensorDesc`` is immutable): a stream of same-shaped messages builds
    none."""
    seen = w.seen
    oid = id(obj)
    if oid in seen:
        return None
    dtype = obj.dtype
    entry = _TORCH_CODES.get(dtype)
    if entry is None:
        if _TORCH_CODES:
            return None
        _torch_dtypes()  # first torch payload: fill the table
        entry = _TORCH_CODES.get(dtype)
        if entry is None:
            return None
    if obj.layout is not _STRIDED[0] or obj.requires_grad or obj.is_neg():
        return None
    if entry[2] and obj.is_conj():
        return None
    if not obj.is_cpu:  # a host tensor is never a meta tensor: one look for both
        if obj.is_meta:
            return None
        w.on_device = True
    offset = w.offset
    ck = (dtype, obj.shape, offset)
    hit = _DESC_CACHE.get(ck)
    if hit is None:
        code, size = entry[0], entry[1]
        shape = ck[1]
        nbytes = obj.numel() * size
        hit = (TensorDesc(KIND_TORCH, code, list(shape), offset, nbytes),
               (offset + nbytes + FRAME_ALIGN - 1) & ~(FRAME_ALIGN - 1))
        if len(_DESC_CACHE) >= _DESC_CACHE_MAX:
            _DESC_CACHE.clear()
        _DESC_CACHE[ck] = hit
    descs = w.descs
    index = len(descs)
    descs.append(hit[0])
    w.sources.append((KIND_TORCH, obj))
    w.offset = hit[1]
    seen[oid] = index
    return _TENSOR_REFS[index] if index < 256 else msgspec.msgpack.Ext(_EXT_TENSOR, _U32.pack(index))


class PreparedBlob:
    """A payload walked and its header encoded, ready to be written.

    ``prepare(payload)`` does the work ``encoded_size`` and ``encode_into`` share, so a
    transport that must size a block before writing into it walks the payload once.

    Attributes
    ----------
    nbytes : int
        Exact size of the frame.
    header_len, data_len : int
        Lengths of the header and of the data region.
    """

    __slots__ = ("_header", "_head", "_descs", "_sources", "_on_device", "data_offset", "data_len",
                 "header_len", "nbytes")

    def __init__(
        self, header: bytes, descs: list[TensorDesc], sources: list[tuple[int, Any]], on_device: bool = True
    ) -> None:
        _fill_blob(self, header, descs, sources, on_device)

    def _fill(
        self, header: bytes, descs: list[TensorDesc], sources: list[tuple[int, Any]], on_device: bool
    ) -> None:
        self._header = header
        self._descs = descs
        self._sources = sources
        #: False when the walk saw that no torch tensor lives off the host
        self._on_device = on_device
        layout = _LAYOUTS.get(header)
        if layout is None:
            layout = _layout(header, descs)
        #: ``_head``: prefix, header and the zero padding up to the data region (one store)
        self._head, self.header_len, self.data_len, self.data_offset, self.nbytes = layout

    @property
    def _prefix(self) -> bytes:
        return self._head[:PREFIX_SIZE]

    @property
    def meta(self) -> bytes:
        """Prefix + header: the first part of a multi-frame message (``encode_parts``)."""
        return self._prefix + self._header

    @property
    def holds_bool(self) -> bool:
        """Whether a bool tensor with bytes is in the frame (a decoder checks those)."""
        return any(d.dtype == _BOOL_CODE and d.nbytes for d in self._descs)

    def write_into(self, buffer: Any, /) -> int:
        """Write the whole frame at the start of ``buffer``; return ``nbytes``.

        Each tensor's bytes are copied exactly once, straight from the source tensor
        (strided, on any device) into the buffer.

        Raises
        ------
        BlobEncodeError
            ``buffer`` is read-only, not contiguous, or smaller than ``nbytes``.
        """
        raw = self._write_head(buffer)
        if self._descs:
            self._write_data(raw, None)
        return self.nbytes

    def write_at(self, view: memoryview, start: int, address: int, /) -> int:
        """Write the whole frame at ``view[start:]``; return ``nbytes``.

        ``write_into`` for a transport that writes into memory it maps itself (the shm
        arena): ``view`` is a writable 1-D byte memoryview of the whole mapping and
        ``address`` the address of its first byte, which the transport looks up once
        instead of per frame. The bytes are the same as ``write_into``'s.

        Raises
        ------
        BlobEncodeError
            ``view`` is read-only, or the frame does not fit between ``start`` and its end.
        """
        n = self.nbytes
        if view.readonly or start < 0 or start + n > view.nbytes:
            raise BlobEncodeError(f"a {n}-byte frame does not fit at {start} in a writable {view.nbytes}-byte view")
        d0 = start + self.data_offset
        view[start:d0] = self._head
        if self._descs:
            if self._on_device:
                self._write_data(view, None, d0, address)
            else:
                _write_host(view, d0, address, self._descs, self._sources)
        return n

    def _write_head(self, buffer: Any) -> memoryview:
        """Check ``buffer`` and write prefix, header and padding; the buffer's byte view."""
        raw = _byte_view(buffer, "encode_into", BlobEncodeError)
        if raw.readonly:
            raise BlobEncodeError("encode_into needs a writable buffer, got a read-only one")
        if raw.nbytes < self.nbytes:
            raise BlobEncodeError(f"buffer of {raw.nbytes} bytes is too small for a {self.nbytes}-byte frame")
        h_end = PREFIX_SIZE + self.header_len
        raw[:PREFIX_SIZE] = self._prefix
        raw[PREFIX_SIZE:h_end] = self._header
        raw[h_end : self.data_offset] = _ZEROS[: self.data_offset - h_end]
        return raw

    def device_bytes(self) -> int:
        """Bytes of the tensors that live on a device (not on the host)."""
        if not self._on_device:
            return 0
        return sum(d.nbytes for d, (k, src) in zip(self._descs, self._sources)
                   if k == KIND_TORCH and not src.is_cpu)

    def devices(self) -> list[Any]:
        """The distinct devices (not the host) of the payload's torch tensors."""
        if not self._on_device:
            return []
        return list({src.device: None for k, src in self._sources if k == KIND_TORCH and not src.is_cpu})

    def write_host_into(self, buffer: Any, /) -> list[tuple[int, Any]]:
        """Write the frame like ``write_into`` except the bytes of device tensors.

        For transports that copy device tensors themselves (a DMA into a page-locked
        block): returns ``[(offset, tensor)]``, the frame offset where each device
        tensor's bytes (C order) belong; the caller must fill them before the frame is
        read. Padding around them is written here.

        Raises
        ------
        BlobEncodeError
            As ``write_into``.
        """
        raw = self._write_head(buffer)
        deferred: list[tuple[int, Any]] = []
        if self._descs:
            self._write_data(raw, deferred)
        return deferred

    def _write_data(
        self, raw: memoryview, deferred: list[tuple[int, Any]] | None, base: int | None = None,
        addr: int | None = None,
    ) -> None:
        """Write every tensor's bytes (and the padding after each) into ``raw``, whose
        data region starts at ``base`` (default: the frame starts at ``raw[0]``);
        ``addr``: the address of ``raw[0]`` when the caller knows it."""
        if base is None:
            base = self.data_offset
        data_end = base + self.data_len
        for desc, (kind, src) in zip(self._descs, self._sources):
            start = base + desc.offset
            n = desc.nbytes
            if n and deferred is not None and kind == KIND_TORCH and not src.is_cpu:
                deferred.append((start, src))
                _zero_padding(raw, start + n, n, data_end)
                continue
            if addr is None and n:
                addr = ctypes.addressof(ctypes.c_char.from_buffer(raw))
            _write_one(raw, start, addr, desc, kind, src, data_end)

    def to_bytes(self) -> bytes:
        buf = bytearray(self.nbytes)
        self.write_into(buf)
        return bytes(buf)

    def tensor_sources(self) -> list[tuple[int, int, Any]]:
        """``(offset in the data region, nbytes, source)`` of every tensor, in frame
        order: for a transport that fills the data region itself (the ``nixl``
        backend's device staging). A source is the tensor or array as passed (any
        device, any strides); its bytes go at the offset in C order."""
        return [(d.offset, d.nbytes, src) for d, (_kind, src) in zip(self._descs, self._sources)]

    def regions(self) -> list[memoryview]:
        """Each tensor's bytes as a C-contiguous host memoryview (copy only if needed)."""
        out = []
        for kind, src in self._sources:
            if kind == KIND_TORCH:
                import torch

                t = src
                if t.device.type != "cpu":
                    t = t.to("cpu")
                t = t.contiguous()
                # as_strided: a contiguous tensor may still report odd strides on size-1 dims.
                n = t.numel()
                flat = t.as_strided((n,), (1,)).view(torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
                out.append(memoryview(flat.numpy()))
            else:
                import numpy as np

                a = np.ascontiguousarray(src)
                out.append(memoryview(a.reshape(-1).view(np.uint8)))
        return out



def _write_host(view: memoryview, base: int, addr: int, descs: list[TensorDesc], sources: list[tuple[int, Any]]) -> None:
    """``_write_data`` for a payload whose tensors all live on the host, into a mapping
    whose first byte is at ``addr``: one memmove per contiguous tensor of up to
    ``_MEMMOVE_MAX`` bytes, the general writer for anything else."""
    memmove = ctypes.memmove
    last = descs[-1]
    data_end = base + last.offset + last.nbytes
    for desc, (kind, src) in zip(descs, sources):
        n = desc.nbytes
        start = base + desc.offset
        if kind != KIND_TORCH or n > _MEMMOVE_MAX or not n or not src.is_contiguous():
            _write_one(view, start, addr, desc, kind, src, data_end)
            continue
        memmove(addr + start, src.data_ptr(), n)
        if n & (FRAME_ALIGN - 1) and desc is not last:
            end = start + n
            view[end : (end + FRAME_ALIGN - 1) & ~(FRAME_ALIGN - 1)] = _ZEROS[: -n & (FRAME_ALIGN - 1)]


def _write_one(
    view: memoryview, start: int, addr: int, desc: TensorDesc, kind: int, src: Any, data_end: int
) -> None:
    """Write one tensor's bytes at ``view[start:]`` (``addr``: the address of ``view[0]``)
    and zero its padding, up to ``data_end`` at most. A host tensor: one memmove when
    contiguous (cheaper than torch's dispatch for small tensors, as fast as its copy for
    large ones unless it has spare threads); anything else, a CUDA tensor included, one
    strided copy straight from the source."""
    n = desc.nbytes
    end = start + n
    if n:
        if kind == KIND_TORCH:
            if src.is_cpu and src.is_contiguous() and (n <= _MEMMOVE_MAX or not _parallel_copy()):
                if n <= _MEMMOVE_MAX:
                    ctypes.memmove(addr + start, src.data_ptr(), n)
                else:
                    _memcpy(addr + start, src.data_ptr(), n)
            else:
                import torch

                dst = torch.frombuffer(view, dtype=torch.uint8, count=n, offset=start)
                dst.view(src.dtype).view(src.shape).copy_(src)
        elif src.flags.c_contiguous:
            _memcpy(addr + start, src.ctypes.data, n)
        else:
            import numpy as np

            np.frombuffer(view, dtype=src.dtype, count=src.size, offset=start).reshape(src.shape)[...] = src
    _zero_padding(view, end, n, data_end)


def _zero_padding(view: memoryview, end: int, n: int, data_end: int) -> None:
    """Zero the alignment padding after a tensor of ``n`` bytes ending at ``end`` (up to
    ``data_end`` at most), so frames are deterministic (no stale bytes leak out)."""
    pad_end = min(end + (-n & (FRAME_ALIGN - 1)), data_end)
    if pad_end > end:
        view[end:pad_end] = _ZEROS[: pad_end - end]

def prepare(payload: Any, /) -> PreparedBlob:
    """Walk ``payload`` and encode its header; see ``PreparedBlob``.

    Raises
    ------
    BlobEncodeError
        The payload holds an object the format cannot carry; the message names its
        path, e.g. ``payload['meta']['x']: type foo.Bar is not supported``.
    """
    walker = _new_walker()
    try:
        tree = walker.fast(payload)
        # One pass: [tensors, tree] is exactly what BlobHeader decodes (array_like).
        header = _ENCODER.encode((walker.descs, tree))
    except (_Retry, BlobEncodeError, msgspec.EncodeError, OverflowError, RecursionError):
        # Something is unsupported: walk again, tracking the path, to say where.
        walker = _Walker()
        try:
            tree = walker.walk(payload)
        except RecursionError as exc:
            raise BlobEncodeError("payload is nested too deeply") from exc
        try:
            header = _ENCODER.encode((walker.descs, tree))
        except (msgspec.EncodeError, OverflowError, RecursionError) as exc:
            raise BlobEncodeError(f"payload could not be encoded: {exc}") from exc
    if len(header) > MAX_HEADER_BYTES:
        raise BlobEncodeError(
            f"header of {len(header)} bytes exceeds MAX_HEADER_BYTES ({MAX_HEADER_BYTES}); "
            "send large data as tensors or arrays, not as Python lists"
        )
    if len(walker.descs) > MAX_TENSORS:
        raise BlobEncodeError(
            f"payload holds {len(walker.descs)} tensors or arrays, more than MAX_TENSORS "
            f"({MAX_TENSORS}); stack them into fewer tensors"
        )
    if len(header) > MAX_TREE_ITEMS:
        # Only a tree of more bytes than the item limit can hold more items than it.
        _check_tree_items(memoryview(header), MAX_TREE_ITEMS, BlobEncodeError)
    return _new_blob(header, walker.descs, walker.sources, walker.on_device)


_fill_blob = PreparedBlob._fill
#: header bytes -> ``(head, header_len, data_len, data_offset, nbytes)`` of the frames
#: encoded lately (a header fixes its descriptors, so all of these): a stream of
#: same-header messages packs the prefix and checksums the header once. Bounded.
_LAYOUTS: dict[bytes, tuple[bytes, int, int, int, int]] = {}
_LAYOUTS_MAX = 256


def _frame_bytes(header_len: int, data_len: int) -> int:
    """The size of a frame whose header is ``header_len`` bytes and whose tensor regions
    span ``data_len`` (the prefix and header padded to ``FRAME_ALIGN``, then the data)."""
    return ((PREFIX_SIZE + header_len + FRAME_ALIGN - 1) & -FRAME_ALIGN) + data_len


def _layout(header: bytes, descs: list[TensorDesc]) -> tuple[bytes, int, int, int, int]:
    header_len = len(header)
    if descs:
        last = descs[-1]
        data_len = last.offset + last.nbytes
    else:
        data_len = 0
    data_offset = (PREFIX_SIZE + header_len + FRAME_ALIGN - 1) & ~(FRAME_ALIGN - 1)
    prefix = _PREFIX.pack(MAGIC, VERSION, 0, header_len, zlib.crc32(header), data_len)
    head = b"".join((prefix, header, _ZEROS[: data_offset - PREFIX_SIZE - header_len]))
    layout = (head, header_len, data_len, data_offset, data_offset + data_len)
    if len(_LAYOUTS) >= _LAYOUTS_MAX:
        _LAYOUTS.clear()
    _LAYOUTS[header] = layout
    return layout


def _new_blob(
    header: bytes, descs: list[TensorDesc], sources: list[tuple[int, Any]], on_device: bool
) -> PreparedBlob:
    """``PreparedBlob(...)`` without the cost of calling a class (once per ``prepare``)."""
    b = _new(PreparedBlob)
    _fill_blob(b, header, descs, sources, on_device)
    return b


def _check_tree_items(header: memoryview, budget: int, exc_type: type[Exception]) -> None:
    """Count the tree items of an encoded header ``[tensors, tree]`` against ``budget``."""
    try:
        # Past the 1-byte array head, skip the descriptor list (one object, not part
        # of the tree), then count the tree that follows it.
        _n, pos = _count_items(header, 1, len(header), len(header))
        _count_items(header, pos, len(header), budget)
    except BlobDecodeError as exc:
        if exc_type is BlobDecodeError:
            raise
        raise exc_type(f"payload: {exc}; send large data as tensors or arrays") from None


def encoded_size(payload: Any, /) -> int:
    """Exact number of bytes ``encode_into`` needs for ``payload``.

    Raises
    ------
    BlobEncodeError
        The payload holds an object the format cannot carry.
    """
    return prepare(payload).nbytes


def encode_into(payload: Any, buffer: Any, /) -> int:
    """Encode ``payload`` in place at the start of ``buffer``; return the bytes written.

    Parameters
    ----------
    payload : Any
        Dicts with str keys, lists, tuples, str, bytes, int, float, bool, None, torch
        tensors (any supported dtype, any device; CUDA tensors are copied to host) and
        numpy arrays.
    buffer : writable buffer
        A bytearray, mmap, memoryview or numpy array of at least
        ``encoded_size(payload)`` bytes.

    Raises
    ------
    BlobEncodeError
        Unsupported content, or a buffer that is read-only or too small.
    """
    return prepare(payload).write_into(buffer)


def encode(payload: Any, /) -> bytes:
    """Encode ``payload`` to a new ``bytes`` frame (see ``encode_into``)."""
    return prepare(payload).to_bytes()


def encode_parts(payload: Any, /) -> tuple[bytes, list[memoryview]]:
    """Encode for multi-frame transports: ``(meta, regions)``.

    ``meta`` is the prefix plus header; ``regions[i]`` holds tensor i's bytes (a view of
    the tensor's own memory when it is a contiguous CPU tensor, else one copy). Send
    them as separate frames and rebuild with ``decode_parts``.
    """
    p = prepare(payload)
    return p.meta, p.regions()


# ------------------------------------------------------------------------- decoding
def peek_header(buffer: Any, /) -> tuple[int, int, int]:
    """Validate a frame's 24-byte prefix; return ``(header_len, data_len, total_len)``.

    Raises
    ------
    BlobDecodeError
        Too short, bad magic, unknown flags, or a header larger than ``MAX_HEADER_BYTES``.
    BlobVersionError
        A version other than 1.
    """
    return _peek(_byte_view(buffer, "decode", BlobDecodeError))


def _peek(raw: memoryview) -> tuple[int, int, int]:
    if raw.nbytes < PREFIX_SIZE:
        raise BlobDecodeError(f"frame is {raw.nbytes} bytes, shorter than the {PREFIX_SIZE}-byte prefix")
    magic, version, flags, header_len, _crc, data_len = _PREFIX.unpack_from(raw, 0)
    if magic != MAGIC:
        raise BlobDecodeError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r} (not a tensor_blob frame)")
    if version != VERSION:
        raise BlobVersionError(f"tensor_blob version {version} is not supported (this omnilink reads {VERSION})")
    if flags != 0:
        raise BlobDecodeError(f"unknown flags 0x{flags:04x} in frame prefix")
    if header_len > MAX_HEADER_BYTES:
        raise BlobDecodeError(f"header_len {header_len} exceeds the limit of {MAX_HEADER_BYTES} bytes")
    return header_len, data_len, _align(PREFIX_SIZE + header_len) + data_len


def _limit(value: int, ceiling: int, name: str) -> int:
    if type(value) is not int or not 0 <= value <= ceiling:
        from omnilink._errors import ConfigurationError

        raise ConfigurationError(f"{name} must be an int in [0, {ceiling}], got {value!r}")
    return value


def _header_error(exc: msgspec.MsgspecError) -> BlobDecodeError:
    """Say which header field a msgspec error is about, in the spec's words."""
    msg = str(exc)
    where = "header"
    text, sep, path = msg.rpartition(" - at ")
    m = _ERR_PATH.match(path) if sep else None
    if m:
        i, j, k = m.groups()
        if i is None:
            where = "header field tensors (limit MAX_TENSORS)" if "length" in text else "header field tensors"
        elif j is None:
            where = f"tensor {i} descriptor"
        else:
            field = _DESC_FIELDS[int(j)] if int(j) < len(_DESC_FIELDS) else f"#{j}"
            where = f"tensor {i} field {field}"
            if field == "shape":
                if k is None:
                    where += " (limit MAX_NDIM dims)"
                elif text.endswith(">= 0"):
                    return BlobDecodeError(f"tensor {i}: negative dimension at shape[{k}]")
                else:
                    where += f"[{k}]"
            elif text.endswith(">= 0"):
                return BlobDecodeError(f"tensor {i}: negative {field}")
        msg = text
    elif sep and path == "`$`":
        msg = text
    return BlobDecodeError(f"malformed {where}: {msg}")


def _tensor_count(header_bytes: memoryview) -> int | None:
    """The tensor count an encoded header declares, read from msgpack array heads
    without decoding anything; None when the header is not laid out canonically
    (msgspec then rejects it or applies MAX_TENSORS itself)."""
    if len(header_bytes) < 2 or header_bytes[0] != 0x92:
        return None
    b = header_bytes[1]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    if b == 0xDC and len(header_bytes) >= 4:
        return int.from_bytes(header_bytes[2:4], "big")
    if b == 0xDD and len(header_bytes) >= 6:
        return int.from_bytes(header_bytes[2:6], "big")
    return None


def _parse_header(
    raw: memoryview,
    header_len: int,
    data_len: int,
    *,
    max_tensors: int = MAX_TENSORS,
    max_tree_items: int = MAX_TREE_ITEMS,
) -> BlobHeader:
    """Check the CRC, decode and validate the header held in ``raw[24:24+header_len]``.

    Every bound is checked before what it bounds is built: the tensor count from the
    msgpack array head, shapes and sizes by msgspec constraints while decoding, the
    tree's item count by a scan (only of trees larger than ``max_tree_items`` bytes).
    """
    (crc,) = _U32.unpack_from(raw, 12)
    header_bytes = raw[PREFIX_SIZE : PREFIX_SIZE + header_len]
    if zlib.crc32(header_bytes) != crc:
        raise BlobDecodeError("header checksum mismatch (corrupted or truncated frame)")
    if max_tensors < MAX_TENSORS:
        n = _tensor_count(header_bytes)
        if n is not None and n > max_tensors:
            raise BlobDecodeError(f"header describes {n} tensors, more than max_tensors ({max_tensors})")
    try:
        header = _HEADER_DECODER.decode(header_bytes)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise _header_error(exc) from exc
    except RecursionError as exc:
        raise BlobDecodeError("malformed header: nested too deeply") from exc
    if len(header.tensors) > max_tensors:
        raise BlobDecodeError(
            f"header describes {len(header.tensors)} tensors, more than max_tensors ({max_tensors})"
        )
    tree = header.tree
    if len(tree) > max_tree_items:
        # A tree of at most max_tree_items bytes cannot hold more items than that.
        _count_items(memoryview(tree), 0, len(tree), max_tree_items)
    end = 0
    for i, d in enumerate(header.tensors):
        if d.kind not in (KIND_TORCH, KIND_NUMPY, KIND_NUMPY_SCALAR):
            raise BlobDecodeError(f"tensor {i}: unknown kind {d.kind}")
        size = _ITEMSIZE_BY_CODE.get(d.dtype)
        if size is None:
            raise BlobDecodeError(f"tensor {i}: unknown dtype code {d.dtype}")
        if d.kind == KIND_NUMPY_SCALAR and d.shape:
            raise BlobDecodeError(f"tensor {i}: a numpy scalar must have shape [], got {d.shape}")
        numel = 1
        span = size  # bytes the non-zero dims address: torch and numpy stride with it
        for dim in d.shape:
            numel *= dim
            if dim:
                span *= dim
                if span > _INT64_MAX:
                    raise BlobDecodeError(
                        f"tensor {i}: shape {d.shape} overflows int64 (its non-zero dims times "
                        f"itemsize {size} exceed 2**63 - 1 bytes)"
                    )
        if d.nbytes != numel * size:
            raise BlobDecodeError(
                f"tensor {i}: nbytes {d.nbytes} != numel {numel} * itemsize {size} for shape {d.shape}"
            )
        if d.offset % FRAME_ALIGN:
            raise BlobDecodeError(f"tensor {i}: offset {d.offset} is not a multiple of {FRAME_ALIGN}")
        if d.offset < end:
            raise BlobDecodeError(f"tensor {i}: region at {d.offset} overlaps or precedes the previous one")
        end = d.offset + d.nbytes
        if end > data_len:
            raise BlobDecodeError(f"tensor {i}: region [{d.offset}, {end}) lies outside data_len {data_len}")
    return header


def _make_views(
    header: BlobHeader,
    region_of: Any,
    copy: bool,
    copied: list[int] | None = None,
    view_readonly: bool = False,
) -> list[Any]:
    """One tensor/array per descriptor, viewing ``region_of(i, desc) -> (memoryview, offset)``.

    Views are made on the buffer object itself (``torch.frombuffer`` / ``np.frombuffer``),
    so each keeps it alive. A region whose address does not suit its dtype's alignment is
    copied (one copy beats undefined behaviour); ``copied[0]`` counts those, when given.
    A torch tensor over a read-only region is a copy unless ``view_readonly`` (numpy
    views of one are read-only already).
    """
    views: list[Any] = []
    torch = torch_from = np_from = None
    for i, d in enumerate(header.tensors):
        buf, off = region_of(i, d)
        size = _ITEMSIZE_BY_CODE[d.dtype]
        numel = d.nbytes // size if size else 0
        # Bytes other than 0/1 in a bool tensor are undefined behaviour downstream.
        if d.dtype == _BOOL_CODE and d.nbytes and not _bool_bytes_ok(buf, off, d.nbytes):
            raise BlobDecodeError(f"tensor {i}: bool data holds bytes other than 0 and 1")
        if d.kind == KIND_TORCH:
            if torch_from is None:
                import torch

                torch_from = _torch_dtypes()[1]
            dt = torch_from.get(d.dtype)
            if dt is None:
                raise BlobDecodeError(
                    f"tensor {i}: dtype {_NAME_BY_CODE[d.dtype]} is not available in this torch build"
                )
            if numel == 0:
                views.append(torch.empty(d.shape, dtype=dt))
                continue
            t = torch.frombuffer(buf, dtype=dt, count=numel, offset=off)
            if t.data_ptr() % size:
                # Never touch a typed view of misaligned memory (a complex128 clone of
                # one crashed): copy the bytes, then type the aligned copy.
                t = torch.frombuffer(buf, dtype=torch.uint8, count=d.nbytes, offset=off).clone().view(dt)
                if copied is not None:
                    copied[0] += 1
            elif copy or (buf.readonly and not view_readonly):
                t = t.clone()
            if len(d.shape) != 1:
                t = t.view(d.shape)
            views.append(t)
        else:
            import numpy as np

            if np_from is None:
                np_from = _numpy_dtypes()[1]
            dt = np_from.get(d.dtype)
            if dt is None:
                raise BlobDecodeError(f"tensor {i}: dtype {_NAME_BY_CODE[d.dtype]} is not a numpy dtype")
            a = np.frombuffer(buf, dtype=dt, count=numel, offset=off).reshape(d.shape)
            if a.ctypes.data % size:
                a = a.copy()
                if copied is not None:
                    copied[0] += 1
            elif copy:
                a = a.copy()
            views.append(a[()] if d.kind == KIND_NUMPY_SCALAR else a)
    return views


def _decode_tree(header: BlobHeader, views: list[Any]) -> Any:
    return _decode_tree_bytes(header.tree, views)


def _decode_tree_bytes(tree: Any, views: list[Any], refs: list[Any] | None = None) -> Any:
    """The payload of an encoded tree: tensor references replaced by ``views``, tuples
    rebuilt, every dict key checked (str only). With ``refs``, the place of every
    tensor reference is appended to it as ``(path, index)``, or ``None`` when the tree
    holds a tuple (a tree that cannot be filled in by paths alone)."""
    try:
        return _resolve(_PLAIN_DECODER.decode(tree), views, refs)
    except BlobDecodeError:
        raise
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, ValueError, TypeError) as exc:
        raise BlobDecodeError(f"malformed payload tree: {exc}") from exc


def _ref_view(ext: Any, views: list[Any]) -> tuple[int, Any]:
    """``(index, view)`` of a tensor reference (extension type 1)."""
    data = ext.data
    if len(data) != 4:
        raise BlobDecodeError(f"tensor reference of {len(data)} bytes, expected 4")
    (index,) = _U32.unpack(data)
    if index >= len(views):
        raise BlobDecodeError(f"payload references tensor {index} but the header describes {len(views)}")
    return index, views[index]


def _resolve_ext(ext: Any, views: list[Any], refs: list[Any] | None, path: tuple[Any, ...]) -> Any:
    code = ext.code
    if code == _EXT_TENSOR:
        index, view = _ref_view(ext, views)
        if refs is not None:
            refs.append((path, index))
        return view
    if code == _EXT_TUPLE:
        if refs is not None:
            refs.append(None)  # paths cannot go through a tuple: not cacheable
        # ``path`` leads to the tuple: it is nested in len(path) containers.
        return _resolve_tuple(ext.data, views, len(path) + 1)
    raise BlobDecodeError(f"unknown extension type {code} in payload tree")


class _TupleItems:
    """A tuple's encoded items as ``_TUPLE_DECODER`` returns them: a view of the bytes
    being decoded, not a copy (a chain of nested tuples would otherwise copy the rest
    of the frame at every level)."""

    __slots__ = ("data",)

    def __init__(self, data: memoryview) -> None:
        self.data = data


def _tuple_ext(code: int, data: memoryview) -> Any:
    if code == _EXT_TUPLE:
        return _TupleItems(data)
    if code == _EXT_TENSOR:
        return _Ext(code, bytes(data))  # 4 bytes when valid; _ref_view checks
    raise BlobDecodeError(f"unknown extension type {code} in payload tree")


def _tuple_list(data: Any) -> list[Any]:
    items = _TUPLE_DECODER.decode(data)
    if type(items) is not list:
        raise BlobDecodeError(f"tuple extension holds a {type(items).__name__}, expected an array")
    return items


def _too_deep() -> BlobDecodeError:
    return BlobDecodeError(f"payload tree nests more than MAX_TREE_DEPTH ({MAX_TREE_DEPTH}) containers")


def _resolve_tuple(data: Any, views: list[Any], depth: int) -> tuple[Any, ...]:
    """The tuple encoded as ``data`` (its extension's bytes), nested at ``depth``.

    Iterative, so the Python stack does not grow with the tree; nested tuples are
    decoded from views of ``data`` (``_TupleItems``) and rebuilt bottom-up once their
    items are resolved."""
    if depth > MAX_TREE_DEPTH:
        raise _too_deep()
    top = _tuple_list(data)
    stack: list[tuple[Any, int]] = [(top, depth)]
    pop, push = stack.pop, stack.append
    # (container, slot, items list) of every nested tuple in the order found: a tuple
    # is always found after the one holding it, so the reverse order builds inner
    # tuples before outer ones.
    tuples: list[tuple[Any, Any, list[Any]]] = []
    while stack:
        o, d = pop()
        if type(o) is dict:
            for k in o:
                if type(k) is not str:
                    raise BlobDecodeError(
                        f"payload tree: dict key {k!r} of type {type(k).__name__} (keys must be str)"
                    )
            it: Any = o.items()
        else:
            it = enumerate(o)
        for k, v in it:
            tv = type(v)
            if tv is _Ext:
                o[k] = _ref_view(v, views)[1]
            elif tv is _TupleItems:
                if d >= MAX_TREE_DEPTH:
                    raise _too_deep()
                items = _tuple_list(v.data)
                o[k] = items
                tuples.append((o, k, items))
                push((items, d + 1))
            elif tv is dict or tv is list:
                if d >= MAX_TREE_DEPTH:
                    raise _too_deep()
                push((v, d + 1))
    for o, k, items in reversed(tuples):
        o[k] = tuple(items)
    return tuple(top)


def _resolve(obj: Any, views: list[Any], refs: list[Any] | None) -> Any:
    """``_decode_tree_bytes`` on a tree msgspec decoded (extensions as ``Ext``)."""
    t = type(obj)
    if t is _Ext:
        return _resolve_ext(obj, views, refs, ())
    if t is not dict and t is not list:
        return obj
    stack = [(obj, ())]
    pop, push = stack.pop, stack.append
    while stack:
        o, path = pop()
        if len(path) >= MAX_TREE_DEPTH:
            raise _too_deep()
        if type(o) is dict:
            for k, v in o.items():
                if type(k) is not str:
                    raise BlobDecodeError(
                        f"payload tree: dict key {k!r} of type {type(k).__name__} (keys must be str)"
                    )
                tv = type(v)
                if tv is _Ext:
                    o[k] = _resolve_ext(v, views, refs, path + (k,))
                elif tv is dict or tv is list:
                    push((v, path + (k,)))
        else:
            nviews = len(views)
            for i, v in enumerate(o):
                tv = type(v)
                if tv is _Ext:
                    if refs is None and v.code == _EXT_TENSOR and len(v.data) == 4:
                        # A list of tensor references (small tensors beside a hidden
                        # state): each one inline, no call and no path per item.
                        (index,) = _U32.unpack(v.data)
                        if index < nviews:
                            o[i] = views[index]
                            continue
                    o[i] = _resolve_ext(v, views, refs, path + (i,))
                elif tv is dict or tv is list:
                    push((v, path + (i,)))
    return obj


# ------------------------------------------------------------------ the plan cache
#: Validated view recipes of descriptor lists seen before, keyed by the descriptors'
#: exact msgpack bytes and ``data_len``: a stream of messages of the same shapes (the
#: common case: a codec window, a hidden state per chunk) validates its descriptors
#: once. Bounded; cleared when full.
_PLANS: dict[tuple[bytes, int], Any] = {}
_PLANS_MAX = 512
#: Whole frame heads (prefix + header bytes) decoded and validated before, for a stream
#: whose headers repeat byte for byte: ``head -> (total, data start, tree bytes, plan,
#: refs)``. A frame's head bytes are compared in full with the cached ones (a dict
#: lookup by value), never trusted by any shorter key, so a hit is a frame whose every
#: header byte was validated before: its CRC, descriptors, tree keys and tensor
#: references. Only the views are made and the tree decoded again (fresh objects).
_HEADS: dict[bytes, tuple[Any, ...]] = {}
_HEADS_MAX = 256
#: Per plan: how many frames of it missed ``_HEADS``; past ``_HEADS_LEARN`` its heads
#: differ from frame to frame (a timestamp in the tree) and are no longer cached.
_HEAD_MISSES: dict[tuple[bytes, int], int] = {}
_HEADS_LEARN = 8
_PLAIN_DECODER = msgspec.msgpack.Decoder()
_Ext = msgspec.msgpack.Ext
#: Decodes a tuple's items: a nested tuple comes back as a view of its bytes.
_TUPLE_DECODER = msgspec.msgpack.Decoder(ext_hook=_tuple_ext)
#: ``_decode_fast`` could not decode the frame (the general path will, or will say why)
_MISS = object()


def _plan_of(header: BlobHeader) -> tuple[tuple[Any, ...], ...] | None:
    """Per-descriptor view recipes ``(kind, dtype, count, shape, offset, itemsize)`` of a
    validated header, or ``None`` when one needs the general path (numpy scalars and
    empty numpy arrays are built differently, a dtype this torch build lacks is an error
    the general path reports). An empty torch tensor's recipe has kind ``_PLAN_EMPTY``;
    a bool one's ``_PLAN_BOOL``: its bytes are checked per message (0 and 1 only).
    ``shape`` is ``None`` for a 1-D tensor (``frombuffer`` makes that shape)."""
    plan = []
    for d in header.tensors:
        size = _ITEMSIZE_BY_CODE[d.dtype]
        if d.kind == KIND_NUMPY_SCALAR or (not d.nbytes and d.kind != KIND_TORCH):
            return None
        if d.kind == KIND_TORCH:
            dt = _torch_dtypes()[1].get(d.dtype)
            if dt is None:
                return None
            if not d.nbytes:
                plan.append((_PLAN_EMPTY, dt, 0, tuple(d.shape), d.offset, size))
                continue
            if d.dtype == _BOOL_CODE:
                plan.append((_PLAN_BOOL, dt, d.nbytes, None if len(d.shape) == 1 else tuple(d.shape),
                             d.offset, size))
                continue
            shape = None if len(d.shape) == 1 else tuple(d.shape)
        else:
            dt = _numpy_dtypes()[1].get(d.dtype)
            shape = tuple(d.shape)
        if dt is None:
            return None
        plan.append((d.kind, dt, d.nbytes // size, shape, d.offset, size))
    _bind_frombuffer()
    return tuple(plan)


def _views(buf: Any, plan: tuple[tuple[Any, ...], ...], base: int) -> list[Any] | None:
    """The views a plan makes of ``buf`` (data region at ``base``); ``None`` when one
    would be misaligned for its dtype (the general path copies those)."""
    views: list[Any] = []
    append = views.append
    # Every region starts at a multiple of 64 from the buffer's start: once one lies on
    # a 64-byte boundary, so do all, and no dtype needs more.
    aligned = False
    for kind, dt, count, shape, off, size in plan:
        if kind == KIND_TORCH or kind == _PLAN_BOOL:
            if kind == _PLAN_BOOL and not _bool_bytes_ok(buf, base + off, count):
                return None  # the general path reports it
            t = _torch_frombuffer(buf, dtype=dt, count=count, offset=base + off)
            if not aligned:
                ptr = t.data_ptr()
                if ptr % size:
                    return None
                aligned = not ptr & (FRAME_ALIGN - 1)
            # ``resize_`` to the same number of elements only sets sizes and strides
            # (contiguous, in place): cheaper than ``view`` and never reallocates.
            append(t if shape is None else t.resize_(*shape) if shape else t.resize_(shape))
        elif kind == _PLAN_EMPTY:
            append(_torch_empty(shape, dtype=dt))
        else:
            a = _np_frombuffer(buf, dtype=dt, count=count, offset=base + off)
            if not aligned and a.ctypes.data % size:
                return None
            append(a.reshape(shape))
    return views


#: ``id(plan) -> (plan, layout)`` for ``_device_views``: per tensor ``(kind, dtype, size,
#: stride, element offset)``, the data region's end, whether bool data needs a check;
#: ``layout`` is None for a plan that needs the general path (numpy arrays). Bounded.
_DEVICE_LAYOUTS: dict[int, tuple[Any, Any]] = {}
_DEVICE_LAYOUTS_MAX = 512


def _contiguous_strides(dims: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous tensor of shape ``dims`` (as torch gives them:
    a dimension of size 0 counts as 1)."""
    stride = []
    step = 1
    for d in reversed(dims):
        stride.append(step)
        step *= max(d, 1)
    return tuple(reversed(stride))


def _device_layout(plan: tuple[tuple[Any, ...], ...]) -> Any:
    entries = []
    end = 0
    has_bool = False
    for kind, dt, count, shape, off, size in plan:
        if kind == _PLAN_EMPTY:
            entries.append((kind, dt, shape, None, 0))
            continue
        if kind != KIND_TORCH and kind != _PLAN_BOOL:
            return None
        has_bool |= kind == _PLAN_BOOL
        dims = (count,) if shape is None else tuple(shape)
        entries.append((kind, dt, dims, _contiguous_strides(dims), off // size))
        end = max(end, off + count * size)
    return tuple(entries), end, has_bool


def _device_views(buf: Any, plan: tuple[tuple[Any, ...], ...], base: int, fetch: Any, empty: Any) -> list[Any] | None:
    """``_views`` on a device, for a frame of torch tensors only: ``fetch(start, n)``
    returns a device uint8 buffer that will hold the frame's bytes ``[start, start+n)``
    (its copy enqueued; its size rounded up to a multiple of 64 bytes, so that it can be
    viewed as any dtype), called once for the whole data region; every tensor is a view
    of it (one ``as_strided`` of a per-dtype view, the cheapest view torch makes of a
    device tensor). ``empty(shape, dtype)`` makes an empty tensor. ``None`` (before any
    fetch) when the frame holds numpy arrays, or bool data that is not 0/1 (the general
    path keeps or reports those)."""
    cached = _DEVICE_LAYOUTS.get(id(plan))
    if cached is None or cached[0] is not plan:
        if len(_DEVICE_LAYOUTS) >= _DEVICE_LAYOUTS_MAX:
            _DEVICE_LAYOUTS.clear()
        cached = _DEVICE_LAYOUTS[id(plan)] = (plan, _device_layout(plan))
    layout = cached[1]
    if layout is None:
        return None
    entries, end, has_bool = layout
    if has_bool:
        for kind, _dt, count, _shape, off, _size in plan:
            if kind == _PLAN_BOOL and not _bool_bytes_ok(buf, base + off, count):
                return None
    data = fetch(base, end) if end else None
    typed: dict[Any, Any] = {}
    views: list[Any] = []
    append = views.append
    for kind, dt, dims, stride, elem in entries:
        if stride is None:
            append(empty(dims, dt))
            continue
        v = typed.get(dt)
        if v is None:
            v = typed[dt] = data.view(dt)
        append(v.as_strided(dims, stride, elem))
    return views


def _decode_fast(buf: Any, nbytes: int, make_views: Any = _views) -> Any:
    """Decode the frame at the start of the writable buffer ``buf`` (``nbytes`` long:
    a memoryview, or a numpy uint8 array) by the caches: the payload, or ``_MISS`` when
    the frame needs the general path (which then reports any error).

    ``make_views(buf, plan, base)``: the tensors of a validated plan (default: zero-copy
    views of ``buf``; ``_device_views`` lands them on a GPU in one copy), or ``None``
    for the general path."""
    if nbytes < PREFIX_SIZE:
        return _MISS
    end = PREFIX_SIZE + _U32.unpack_from(buf, 8)[0]
    if end > nbytes:
        return _MISS
    head = buf[:end].tobytes()
    hit = _HEADS.get(head)
    if hit is None:
        return _decode_learn(buf, nbytes, head, make_views)
    total, base, tree, plan, refs = hit
    if total > nbytes:
        return _MISS
    views = make_views(buf, plan, base)
    if views is None:
        return _MISS
    out = _PLAIN_DECODER.decode(tree)
    if type(refs) is dict:  # every reference is a value of the top-level dict
        for k, index in refs.items():
            out[k] = views[index]
        return out
    for path, index in refs:
        if not path:
            out = views[index]
        else:
            c = out
            for p in path[:-1]:
                c = c[p]
            c[path[-1]] = views[index]
    return out


def _decode_learn(buf: Any, nbytes: int, head: bytes, make_views: Any = _views) -> Any:
    """``_decode_fast`` for a head not in ``_HEADS``: the CRC, the header's arity and the
    tree's item bound and keys are checked; the descriptors' validation
    (``_parse_header``) runs once per distinct descriptor list (``_PLANS``). Caches the
    head when it may repeat."""
    magic, version, flags, header_len, crc, data_len = _PREFIX.unpack_from(head, 0)
    if magic != MAGIC or version != VERSION or flags or header_len > MAX_HEADER_BYTES:
        return _MISS
    base = ((PREFIX_SIZE + header_len + FRAME_ALIGN - 1) & ~(FRAME_ALIGN - 1))
    total = base + data_len
    if total > nbytes:
        return _MISS
    header_bytes = memoryview(head)[PREFIX_SIZE:]
    if zlib.crc32(header_bytes) != crc:
        return _MISS
    try:
        split = _SPLIT_DECODER.decode(header_bytes)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return _MISS
    key = (bytes(split.tensors), data_len)
    plan = _PLANS.get(key)
    if plan is None:
        if key in _PLANS:
            return _MISS  # known to need the general path
        try:
            header = _parse_header(memoryview(head), header_len, data_len)
        except BlobDecodeError:
            return _MISS
        plan = _plan_of(header)
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
            _HEAD_MISSES.clear()
        _PLANS[key] = plan
        if plan is None:
            return _MISS
    tree = split.tree
    if len(tree) > MAX_TREE_ITEMS:
        _count_items(memoryview(tree), 0, len(tree), MAX_TREE_ITEMS)
    views = make_views(buf, plan, base)
    if views is None:
        return _MISS
    misses = _HEAD_MISSES.get(key, 0)
    if misses >= _HEADS_LEARN:
        return _decode_tree_bytes(tree, views)
    _HEAD_MISSES[key] = misses + 1
    refs: list[Any] = []
    out = _decode_tree_bytes(tree, views, refs)
    if None not in refs:
        if len(_HEADS) >= _HEADS_MAX:
            _HEADS.clear()
        top = all(len(path) == 1 for path, _ in refs) and len({path for path, _ in refs}) == len(refs)
        _HEADS[head] = (total, base, bytes(tree), plan,
                        {path[0]: index for path, index in refs} if top and refs and type(out) is dict
                        else tuple(refs))
    return out


_torch_frombuffer: Any = None
_torch_empty: Any = None
_np_frombuffer: Any = None
#: Plan kinds beside ``KIND_TORCH`` / ``KIND_NUMPY``: a torch bool tensor (bytes checked
#: per message) and an empty torch tensor (no bytes to view).
_PLAN_BOOL = -1
_PLAN_EMPTY = -2
#: Bool data up to this many bytes is checked with ``bytes.translate``, larger with numpy.
_BOOL_BYTES_CHECK = 4096


def _bool_bytes_ok(buf: Any, start: int, count: int) -> bool:
    """Whether the ``count`` bytes of ``buf`` at ``start`` are all 0 or 1 (bool data)."""
    if count <= _BOOL_BYTES_CHECK:
        return not bytes(buf[start : start + count]).translate(None, b"\x00\x01")
    import numpy as np

    return bool(np.frombuffer(buf, dtype=np.uint8, count=count, offset=start).max() <= 1)


def _bind_frombuffer() -> None:
    """Bind the view makers (a plan names torch or numpy dtypes, so its module is
    imported by the time a plan exists)."""
    global _torch_frombuffer, _torch_empty, _np_frombuffer
    np = sys.modules.get("numpy")
    if np is not None:
        _np_frombuffer = np.frombuffer
    torch = sys.modules.get("torch")
    if torch is not None:
        _torch_frombuffer, _torch_empty = torch.frombuffer, torch.empty


def decode(
    buffer: Any,
    /,
    *,
    copy: bool = False,
    view_readonly: bool = False,
    max_tensors: int = MAX_TENSORS,
    max_tree_items: int = MAX_TREE_ITEMS,
) -> Any:
    """Decode a tensor_blob frame held at the start of ``buffer``.

    Parameters
    ----------
    buffer : bytes-like
        bytes, bytearray, memoryview, mmap, numpy array, ctypes array... Bytes after the
        frame's end are ignored.
    copy : bool
        ``False`` (default): tensors and arrays are zero-copy views of ``buffer``, which
        each view keeps alive. ``True``: they own their memory (one copy each).
    view_readonly : bool
        What happens when ``buffer`` is read-only (``bytes``, a received frame) and
        ``copy`` is False. ``False`` (default): numpy arrays are read-only views, torch
        tensors (which cannot be read-only) are copies, so nothing can write into an
        immutable object. ``True``: torch tensors are views as well; the caller promises
        not to write to them (or owns the buffer alone, as a transport does).
    max_tensors, max_tree_items : int
        Lower the bounds ``MAX_TENSORS`` and ``MAX_TREE_ITEMS`` for this call (a
        receiver that takes input it trusts less). A frame above either is rejected
        before anything it describes is built.

    Returns
    -------
    Any
        The payload: torch tensors come back as torch tensors (on CPU), numpy arrays as
        numpy arrays, tuples as tuples.

    Raises
    ------
    BlobDecodeError
        Anything malformed or over a limit: the message says which field and which limit.
    BlobVersionError
        A frame of another format version.
    ConfigurationError
        ``max_tensors`` or ``max_tree_items`` is not an int between 0 and its ceiling.
    """
    if max_tensors != MAX_TENSORS:
        _limit(max_tensors, MAX_TENSORS, "max_tensors")
    if max_tree_items != MAX_TREE_ITEMS:
        _limit(max_tree_items, MAX_TREE_ITEMS, "max_tree_items")
    raw = _byte_view(buffer, "decode", BlobDecodeError)
    header_len, data_len, total = _peek(raw)
    if raw.nbytes < total:
        raise BlobDecodeError(f"frame is truncated: {raw.nbytes} bytes, the prefix says {total}")
    if not copy and not raw.readonly and max_tensors == MAX_TENSORS and max_tree_items == MAX_TREE_ITEMS:
        out = _decode_fast(raw, total)
        if out is not _MISS:
            return out
    header = _parse_header(raw, header_len, data_len, max_tensors=max_tensors, max_tree_items=max_tree_items)
    if not header.tensors:
        return _decode_tree(header, [])
    data_start = total - data_len
    # ``raw`` references ``buffer``: every view keeps the caller's object alive.
    if raw.readonly:
        with warnings.catch_warnings():
            # torch warns that views of read-only memory are writable: they are copies
            # unless view_readonly, whose contract is documented above.
            warnings.simplefilter("ignore", UserWarning)
            views = _make_views(header, lambda i, d: (raw, data_start + d.offset), copy, None, view_readonly)
    else:
        views = _make_views(header, lambda i, d: (raw, data_start + d.offset), copy)
    return _decode_tree(header, views)


def decode_parts(
    meta: Any,
    regions: list[Any],
    /,
    *,
    copy: bool = False,
    view_readonly: bool = False,
    max_tensors: int = MAX_TENSORS,
    max_tree_items: int = MAX_TREE_ITEMS,
) -> Any:
    """Decode a payload sent as ``encode_parts`` produced it: meta frame + regions.

    Each tensor is a zero-copy view of its region object (kept alive by the view) when
    the region's address suits the dtype's alignment, else a copy. Options as for
    ``decode`` (``view_readonly`` applies to each read-only region).

    Raises
    ------
    BlobDecodeError
        Malformed meta, a region count or length that disagrees with the header, a
        limit exceeded.
    ConfigurationError
        A limit option out of range.
    """
    return decode_parts_counted(
        meta, regions, copy=copy, view_readonly=view_readonly, max_tensors=max_tensors,
        max_tree_items=max_tree_items,
    )[0]


def decode_parts_counted(
    meta: Any,
    regions: list[Any],
    /,
    *,
    copy: bool = False,
    view_readonly: bool = False,
    max_tensors: int = MAX_TENSORS,
    max_tree_items: int = MAX_TREE_ITEMS,
) -> tuple[Any, int]:
    """``decode_parts``, also returning how many regions had to be copied because their
    address did not suit their dtype (a transport counts these as fallbacks)."""
    if max_tensors != MAX_TENSORS:
        _limit(max_tensors, MAX_TENSORS, "max_tensors")
    if max_tree_items != MAX_TREE_ITEMS:
        _limit(max_tree_items, MAX_TREE_ITEMS, "max_tree_items")
    raw = _byte_view(meta, "decode_parts", BlobDecodeError)
    header_len, data_len, _total = _peek(raw)
    if raw.nbytes != PREFIX_SIZE + header_len:
        raise BlobDecodeError(
            f"meta frame is {raw.nbytes} bytes, the prefix says {PREFIX_SIZE + header_len}"
        )
    header = _parse_header(raw, header_len, data_len, max_tensors=max_tensors, max_tree_items=max_tree_items)
    if len(regions) != len(header.tensors):
        raise BlobDecodeError(f"{len(regions)} region frames, the header describes {len(header.tensors)}")
    if not header.tensors:
        return _decode_tree(header, []), 0

    def region_of(i: int, d: TensorDesc) -> tuple[Any, int]:
        rmv = _byte_view(regions[i], f"region {i}", BlobDecodeError)
        if rmv.nbytes != d.nbytes:
            raise BlobDecodeError(f"region {i} is {rmv.nbytes} bytes, the header says {d.nbytes}")
        return rmv, 0

    with warnings.catch_warnings():
        # Received frames are often read-only; torch warns its views are writable.
        warnings.simplefilter("ignore", UserWarning)
        copied = [0]
        views = _make_views(header, region_of, copy, copied, view_readonly)
    return _decode_tree(header, views), copied[0]


def decode_detached(meta: Any, data: Any, /, *, device_view: Any = None) -> Any:
    """Decode a frame whose head and data region travel apart (the ``nixl`` backend:
    the head over its control channel, the data region written into a pool block).

    ``meta`` is the frame's prefix and header (``PreparedBlob.meta``), validated in full
    before anything of ``data`` is viewed. ``data`` is the data region: a writable
    host buffer at least ``data_len`` bytes long, whose views the tensors become (each
    keeps ``data`` alive); or, with ``device_view``, anything: ``device_view(desc)``
    then returns the tensor of each descriptor (a view of device memory), and only
    torch tensors may be described (``BlobDecodeError`` otherwise: the caller decodes
    such frames on the host). ``parse_detached`` then ``decode_parsed`` is the same in
    two steps (a caller may keep the parsed header of a ``meta`` it sees again).

    Raises
    ------
    BlobDecodeError
        Malformed ``meta``, a data region shorter than the header says, bool data
        other than 0/1 on the host, a non-torch tensor with ``device_view``.
    BlobVersionError
        A frame of another version.
    """
    return decode_parsed(parse_detached(meta), data, device_view=device_view)


def parse_detached(meta: Any, /) -> BlobHeader:
    """Validate a detached frame's ``meta`` (prefix and header) in full; its header.

    Raises
    ------
    BlobDecodeError
        Malformed ``meta``.
    BlobVersionError
        A frame of another version.
    """
    raw = _byte_view(meta, "decode_detached", BlobDecodeError)
    header_len, data_len, _total = _peek(raw)
    if raw.nbytes != PREFIX_SIZE + header_len:
        raise BlobDecodeError(f"meta is {raw.nbytes} bytes, the prefix says {PREFIX_SIZE + header_len}")
    return _parse_header(raw, header_len, data_len, max_tensors=MAX_TENSORS, max_tree_items=MAX_TREE_ITEMS)


def reads_data(header: BlobHeader, /, *, device: bool) -> bool:
    """Whether decoding ``header`` reads the data region's bytes rather than only
    viewing them (``device``: its tensors are viewed on a device): a bool tensor's bytes
    are checked (0 and 1 only), a numpy array cannot be viewed on a device (the caller
    copies the region to the host)."""
    for d in header.tensors:
        if d.nbytes and (d.dtype == _BOOL_CODE or (device and d.kind != KIND_TORCH)):
            return True
    return False


def decode_parsed(header: BlobHeader, data: Any, /, *, device_view: Any = None) -> Any:
    """``decode_detached`` of a header ``parse_detached`` returned (see there)."""
    if not header.tensors:
        return _decode_tree(header, [])
    if device_view is not None:
        views = []
        for i, d in enumerate(header.tensors):
            if d.kind != KIND_TORCH:
                raise BlobDecodeError(f"tensor {i}: a numpy array cannot be viewed on a device")
            views.append(device_view(d))
        return _decode_tree(header, views)
    data_len = max((d.offset + d.nbytes for d in header.tensors), default=0)
    dmv = _byte_view(data, "decode_detached", BlobDecodeError)
    if dmv.nbytes < data_len:
        raise BlobDecodeError(f"data region is {dmv.nbytes} bytes, the header says {data_len}")
    if dmv.readonly:
        raise BlobDecodeError("decode_detached needs a writable data region")
    return _decode_tree(header, _make_views(header, lambda i, d: (dmv, d.offset), False))


def torch_dtype_of(code: int) -> Any:
    """The torch dtype of a validated descriptor's dtype code (``None``: not in this
    torch build)."""
    return _torch_dtypes()[1].get(code)
