"""Tree depth of a tensor_blob payload (issue 31, defect A): a hostile chain of nested
tuples must neither amplify memory (each level decoding a copy of the rest of the
frame) nor pass unbounded; the encoder refuses what the decoder would refuse."""

from __future__ import annotations

import struct
import tracemalloc
import zlib

import msgspec
import numpy as np
import pytest
import torch

import omnilink
from omnilink import BlobDecodeError, BlobEncodeError
from omnilink.blob import MAX_TREE_DEPTH

Ext = msgspec.msgpack.Ext


def _frame_of_tree(tree_bytes: bytes) -> bytes:
    header = msgspec.msgpack.encode([[], msgspec.Raw(tree_bytes)])
    prefix = struct.pack("<4sHHIIQ", b"OLB1", 1, 0, len(header), zlib.crc32(header), 0)
    return prefix + header + bytes((-(24 + len(header))) % 64)


def _tuple_chain(depth: int) -> bytes:
    """The tree bytes of ``depth`` tuples, each holding the next (the innermost None)."""
    inner = msgspec.msgpack.encode(None)
    for _ in range(depth):
        inner = msgspec.msgpack.encode(Ext(2, b"\x91" + inner))
    return inner


def _peak_of(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("max_tree_items", [omnilink.blob.MAX_TREE_ITEMS, 1000])
def test_a_deep_tuple_chain_is_refused_without_amplifying_memory(max_tree_items):
    # 100,000 nested tuples in a 674 KB frame: before the fix every level decoded a
    # copy of the rest of the frame (+318 MiB) before a RecursionError. With a low
    # max_tree_items the item scan (the path of trees over 1 MiB) meets it first.
    frame = _frame_of_tree(_tuple_chain(100_000))
    errors = []

    def run():
        try:
            omnilink.decode(frame, max_tree_items=max_tree_items)
        except BlobDecodeError as exc:
            errors.append(str(exc))

    peak = _peak_of(run)
    assert errors and "MAX_TREE_DEPTH" in errors[0], errors
    assert peak <= 4 * len(frame) + (8 << 20), (peak, len(frame))


def _nest(kinds: str, leaf):
    """A payload whose containers, outermost first, are ``kinds`` (d dict, l list, t tuple)."""
    obj = leaf
    for k in reversed(kinds):
        obj = {"k": obj} if k == "d" else [obj] if k == "l" else (obj,)
    return obj


def _depth_of(obj) -> int:
    if isinstance(obj, dict):
        return 1 + max((_depth_of(v) for v in obj.values()), default=0)
    if isinstance(obj, (list, tuple)):
        return 1 + max((_depth_of(v) for v in obj), default=0)
    return 0


@pytest.mark.parametrize("pattern", ["d", "l", "t", "dlt", "ttl", "tdl"])
def test_exactly_max_depth_round_trips_and_one_more_is_refused_both_ways(pattern):
    kinds = (pattern * (MAX_TREE_DEPTH + 1))[: MAX_TREE_DEPTH + 1]
    ok = _nest(kinds[:MAX_TREE_DEPTH], 7)
    assert _depth_of(ok) == MAX_TREE_DEPTH
    got = omnilink.decode(omnilink.encode(ok))
    assert _depth_of(got) == MAX_TREE_DEPTH and got == ok

    deep = _nest(kinds, 7)
    with pytest.raises(BlobEncodeError, match="MAX_TREE_DEPTH"):
        omnilink.encode(deep)
    # The same tree written by hand (as a hostile sender would) is refused on decode.
    tree = _encode_tree_by_hand(deep)
    with pytest.raises(BlobDecodeError, match="MAX_TREE_DEPTH"):
        omnilink.decode(_frame_of_tree(tree))
    with pytest.raises(BlobDecodeError, match="MAX_TREE_DEPTH"):
        omnilink.decode(bytearray(_frame_of_tree(tree)), copy=True)


def _encode_tree_by_hand(obj) -> bytes:
    def conv(o):
        if isinstance(o, dict):
            return {k: conv(v) for k, v in o.items()}
        if isinstance(o, list):
            return [conv(v) for v in o]
        if isinstance(o, tuple):
            return Ext(2, msgspec.msgpack.encode([conv(v) for v in o]))
        return o

    return msgspec.msgpack.encode(conv(obj))


def test_the_encoder_counts_a_list_of_scalars_as_a_level():
    # The encoder's fast walk passes lists of scalars to msgspec whole: that list is a
    # level too, or a payload would encode that no decoder reads.
    payload = _nest("d" * MAX_TREE_DEPTH, [1, 2, 3])
    with pytest.raises(BlobEncodeError, match="MAX_TREE_DEPTH"):
        omnilink.encode(payload)


def test_tuples_keep_tensors_and_check_keys_at_any_depth():
    t = torch.arange(6).reshape(2, 3)
    payload = {"a": (1, (t, [(np.arange(3), {"x": (t,)})]), ()), "b": ((), ((),))}
    got = omnilink.decode(omnilink.encode(payload))
    assert got["a"][0] == 1 and torch.equal(got["a"][1][0], t)
    assert isinstance(got["a"][1][1][0], tuple) and np.array_equal(got["a"][1][1][0][0], np.arange(3))
    assert torch.equal(got["a"][1][1][0][1]["x"][0], t) and got["a"][2] == () and got["b"] == ((), ((),))
    bad = msgspec.msgpack.encode({"a": Ext(2, msgspec.msgpack.encode([Ext(2, msgspec.msgpack.encode([{1: 2}]))]))})
    with pytest.raises(BlobDecodeError, match="keys must be str"):
        omnilink.decode(_frame_of_tree(bad))
    unknown = msgspec.msgpack.encode(Ext(2, msgspec.msgpack.encode([Ext(9, b"zz")])))
    with pytest.raises(BlobDecodeError, match="unknown extension type 9"):
        omnilink.decode(_frame_of_tree(unknown))
    dangling = msgspec.msgpack.encode(Ext(2, msgspec.msgpack.encode([Ext(1, struct.pack("<I", 3))])))
    with pytest.raises(BlobDecodeError, match="references tensor 3"):
        omnilink.decode(_frame_of_tree(dangling))
