"""Hypothesis strategies for payload trees (re-exported by ``tests.property.strategies``)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

__all__ = ["TORCH_DTYPES", "NUMPY_DTYPES", "torch_tensors", "numpy_arrays", "leaves", "payloads"]

TORCH_DTYPES = [
    d
    for d in (
        getattr(torch, n, None)
        for n in (
            "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
            "float32", "float64", "complex32", "complex64", "complex128", "float8_e4m3fn",
            "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "uint16",
            "uint32", "uint64", "float4_e2m1fn_x2",
        )
    )
    if isinstance(d, torch.dtype)
]
NUMPY_DTYPES = [
    np.dtype(n)
    for n in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32",
              "float64", "complex64", "complex128", "uint16", "uint32", "uint64")
]

_shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4)


@st.composite
def torch_tensors(draw, dtypes=TORCH_DTYPES):
    """Tensors of any dtype with random bits (NaN payloads included), 0-d, empty and
    non-contiguous (transposed, sliced with steps, expanded)."""
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(_shapes)
    itemsize = dtype.itemsize
    numel = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
    if dtype == torch.bool:
        raw = bytes(b & 1 for b in raw)
    base = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    t = base.view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)
    layout = draw(st.sampled_from(["contig", "transpose", "step", "expand"]))
    if layout == "transpose" and t.dim() >= 2:
        t = t.transpose(0, -1)
    elif layout == "step" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[::2]
    elif layout == "expand" and t.dim() >= 1 and t.shape[0] == 1:
        t = t.expand(3, *t.shape[1:])
    return t


@st.composite
def numpy_arrays(draw, dtypes=NUMPY_DTYPES):
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(_shapes)
    numel = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    if dtype == np.bool_:
        raw = bytes(b & 1 for b in raw)
    a = np.frombuffer(raw, dtype=dtype).reshape(shape).copy() if numel else np.empty(shape, dtype=dtype)
    if draw(st.booleans()) and a.ndim >= 1 and a.shape[0] > 1:
        a = a[::2]
    if draw(st.booleans()) and a.ndim >= 2:
        a = a.T
    return a


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=40),
    torch_tensors(),
    numpy_arrays(),
)

#: Whole payload trees: dicts with str keys (dotted ones too), lists, tuples, leaves.
payloads = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(
            st.one_of(st.text(max_size=12), st.sampled_from(["codes.audio", "meta.finished", "hidden_states.output"])),
            children,
            max_size=4,
        ),
    ),
    max_leaves=12,
)
