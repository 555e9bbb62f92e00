"""Hypothesis: any payload tree round-trips bit for bit, through every entry point."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import omnilink
from omnilink import blob
from tests.payload_equal import assert_same
from tests.property.strategies import numpy_arrays, payloads, torch_tensors

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _expected(p):
    """What decode must give back: tensors detached and contiguous, nothing else changes."""
    if isinstance(p, torch.Tensor):
        return p.detach()
    if isinstance(p, dict):
        return {k: _expected(v) for k, v in p.items()}
    if isinstance(p, list):
        return [_expected(v) for v in p]
    if isinstance(p, tuple):
        return tuple(_expected(v) for v in p)
    return p


@SETTINGS
@given(payloads)
def test_encode_decode_round_trip(p):
    buf = omnilink.encode(p)
    assert len(buf) == omnilink.encoded_size(p)
    assert_same(omnilink.decode(buf), _expected(p))
    assert_same(omnilink.decode(buf, copy=True), _expected(p))


@SETTINGS
@given(payloads, st.integers(0, 200))
def test_encode_into_equals_encode(p, slack):
    ref = omnilink.encode(p)
    target = bytearray(len(ref) + slack)
    assert omnilink.encode_into(p, target) == len(ref)
    assert bytes(target[: len(ref)]) == ref
    assert_same(omnilink.decode(target), _expected(p))


@SETTINGS
@given(st.lists(st.one_of(torch_tensors(), numpy_arrays()), max_size=5))
def test_parts_round_trip(tensors):
    meta, regions = blob.encode_parts(tensors)
    assert_same(blob.decode_parts(meta, [bytes(r) for r in regions]), _expected(tensors))


@SETTINGS
@given(torch_tensors())
def test_views_lie_inside_the_buffer(t):
    buf = bytearray(omnilink.encode({"t": t}))
    lo = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    out = omnilink.decode(buf)["t"]
    if out.numel():
        assert lo <= out.data_ptr() and out.data_ptr() + out.numel() * out.element_size() <= lo + len(buf)
