"""Sliced (pipelined) payloads of the shm backend, run on CPU through the GPU path's
test hook, and the validation of the head a receiver gets from another process."""

from __future__ import annotations

import uuid

import pytest
import torch

import omnilink
from omnilink.connectors.shm import ShmConnector
from omnilink.connectors.shm import slices as sl


@pytest.fixture
def pair():
    chan = f"t/slices-{uuid.uuid4().hex[:8]}"
    tx = ShmConnector(channel=chan, role="sender", arena_bytes=4 << 20, pipeline_bytes=64 << 10,
                      slice_bytes=64 << 10, linger=0)
    rx = ShmConnector(channel=chan, role="receiver")
    tx._gpu_path().cpu_mode = True  # CPU tensors take the device path
    yield tx, rx
    rx.close()
    tx.close()


def test_sliced_round_trip_bigger_than_the_arena(pair):
    tx, rx = pair
    big = torch.randn(3 << 20 // 4 * 2)  # 6 MiB > the 4 MiB arena: it must stream through
    payload = {"hidden_states.output": big, "ids": torch.arange(5), "meta": {"finished": True},
               "two": [torch.randn(100, 300), torch.ones(7, dtype=torch.bfloat16)]}
    fut = tx.put_async("req1_0_0", payload, timeout=30)
    got = rx.get("req1_0_0", timeout=30)
    assert fut.result(30) > big.numel() * 4
    assert torch.equal(got["hidden_states.output"], big)
    assert torch.equal(got["ids"], payload["ids"]) and got["meta"] == {"finished": True}
    assert torch.equal(got["two"][0], payload["two"][0]) and torch.equal(got["two"][1], payload["two"][1])
    st = tx.stats()
    assert st.sliced == 1 and st.device_puts == 1
    assert rx.stats().sliced == 1
    del got
    assert tx.stats().blocks_in_use == 0 or _drained(tx)


def _drained(tx):
    import time

    end = time.monotonic() + 5
    while time.monotonic() < end:
        tx._gpu_path()  # noqa: B018 - keep the connector alive
        if tx.stats().blocks_in_use == 0:
            return True
        try:
            tx.put("probe", {"x": 1}, timeout=1)
            tx.discard("probe")
        except omnilink.OmnilinkError:
            pass
        time.sleep(0.05)
    return False


def test_small_payloads_are_not_sliced(pair):
    tx, rx = pair
    tx.put("k", {"x": torch.ones(10)}, timeout=5)
    assert torch.equal(rx.get("k", timeout=5)["x"], torch.ones(10))
    assert tx.stats().sliced == 0 and tx.stats().device_puts == 1


def test_a_sender_failing_half_way_aborts_the_receiver_at_once(pair, monkeypatch):
    tx, rx = pair
    gpu = tx._gpu_path()
    real = gpu._fill
    calls = {"n": 0}

    def flaky(blob, off, events):
        calls["n"] += 1
        if calls["n"] == 4:  # head, slice 0, slice 1, then this one fails
            raise omnilink.CudaError("injected copy failure")
        return real(blob, off, events)

    monkeypatch.setattr(gpu, "_fill", flaky)
    with pytest.raises(omnilink.CudaError):
        tx.put("req2_0_0", {"x": torch.randn(1 << 17)}, timeout=10)  # 512 KiB: 8 slices
    with pytest.raises(omnilink.TransportError, match="gave up at slice [0-2]: CudaError: injected"):
        rx.get("req2_0_0", timeout=10)


def _head(**over):
    h = {sl.SLICED_MARK: 1, "tree": {"x": {sl.PLACEHOLDER: 0}}, "tensors": [["float32", [4, 4], 64]],
         "slice": 4096, "token": "0123456789abcdef"}
    h.update(over)
    return h


@pytest.mark.parametrize("bad", [
    {sl.SLICED_MARK: 2},
    {"token": "../etc"},
    {"slice": 10},
    {"slice": True},
    {"tensors": []},
    {"tensors": [["float32", [4, 4], 65]]},
    {"tensors": [["Tensor", [4, 4], 64]]},
    {"tensors": [["qint8", [4], 4]]},
    {"tensors": [["float32", [-1, 4], 64]]},
    {"tensors": [["float32", [2 ** 40, 2 ** 40], 64]]},
    {"tensors": [["float32", [0, 4], 0]]},
    {"tensors": [["float32", [4, 4]]]},
    {"tensors": [["float32", [2 ** 20, 2 ** 20], 2 ** 42]]},
    {"extra": 1},
])
def test_hostile_heads_are_named_decode_errors(bad):
    with pytest.raises(omnilink.BlobDecodeError, match="sliced payload head"):
        sl.parse_head(_head(**bad))


def test_placeholders_must_match_the_tensors():
    t = [torch.ones(1), torch.ones(2)]
    assert sl.fill_placeholders({"a": {sl.PLACEHOLDER: 1}, "b": [{sl.PLACEHOLDER: 0}]}, t)["a"] is t[1]
    for tree in ({"a": {sl.PLACEHOLDER: 0}}, {"a": {sl.PLACEHOLDER: 0}, "b": {sl.PLACEHOLDER: 0}},
                 {"a": {sl.PLACEHOLDER: 5}}, {"a": {sl.PLACEHOLDER: 0, "x": 1}, "b": {sl.PLACEHOLDER: 1}}):
        with pytest.raises(omnilink.BlobDecodeError):
            sl.fill_placeholders(tree, t)


def test_plan_covers_every_byte_once():
    sizes = [1, 4096, 4097, 3 * 4096, 10]
    plan = sl.plan_slices(sizes, 4096)
    for j, n in enumerate(sizes):
        parts = [(a, b) for jj, a, b in plan if jj == j]
        assert parts[0][0] == 0 and parts[-1][1] == n
        assert all(p[1] == q[0] for p, q in zip(parts, parts[1:]))
        assert all(0 < b - a <= 4096 for a, b in parts)
