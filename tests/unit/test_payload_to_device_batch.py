"""The batch of small CPU tensors ``payload_to_device`` lands on a CUDA device in one
copy: its views (one per dtype, one ``as_strided`` per tensor) checked on the host with
pageable staging, for every dtype and shape, against the tensors themselves (the GPU
suite runs the real thing)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from omnilink.cuda import device as device_mod  # noqa: E402

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]


def _tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g).to(dtype)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3),
                          st.booleans(), st.integers(0, 2**16)), min_size=1, max_size=8))
def test_one_copy_views_hold_each_tensor_with_its_dtype_shape_and_bytes(specs):
    small, total, sources = [], 0, []
    for dtype, shape, transpose, seed in specs:
        t = _tensor(dtype, tuple(shape), seed)
        if transpose and t.dim() >= 2:
            t = t.transpose(0, 1)  # not contiguous: made so on the way
        sources.append(t)
        n = t.numel() * t.element_size()
        small.append([t, total])
        total += (n + device_mod._ALIGN - 1) // device_mod._ALIGN * device_mod._ALIGN or device_mod._ALIGN
    views = device_mod._one_copy(torch, small, total, torch.device("cpu"), pin=False)
    assert len(views) == len(sources)
    for v, t in zip(views, sources):
        assert v.dtype == t.dtype and v.shape == t.shape and v.is_contiguous()
        assert torch.equal(v, t)
    bases = {v.untyped_storage().data_ptr() for v in views}
    assert len(bases) == 1  # all of one buffer


def test_a_device_argument_is_checked_once_and_a_bad_one_named():
    from omnilink._errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="invalid device"):
        device_mod.payload_to_device({"x": torch.ones(2)}, "nonsense:0")
    got = device_mod.payload_to_device({"x": torch.ones(2), "y": [torch.zeros(1, dtype=torch.int8), 3]}, "cpu")
    assert torch.equal(got["x"], torch.ones(2)) and got["y"][1] == 3
    assert "cpu" in device_mod._TARGETS
