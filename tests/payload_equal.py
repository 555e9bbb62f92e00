"""Bit-for-bit payload comparison used by the tests (NaN payloads compare equal), and a
walk over a payload's tensors."""

from __future__ import annotations

import numpy as np
import torch


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().cpu()
    if t.numel() == 0:
        return b""
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.reshape(-1))
    return flat.view(torch.uint8).numpy().tobytes()


def tensors_in(obj):
    """Every tensor and array of a payload tree, depth first."""
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def assert_same(a, b, path="payload"):
    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert tuple(a.shape) == tuple(b.shape), f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert _bits(a) == _bits(b), f"{path}: tensor bits differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), f"{path}: array bits differ"
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"{path}: scalar differs"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert a == b or (a != a and b != b), f"{path}: {a!r} != {b!r}"
        if a == b == 0.0:
            assert np.copysign(1, a) == np.copysign(1, b), f"{path}: sign of zero differs"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
