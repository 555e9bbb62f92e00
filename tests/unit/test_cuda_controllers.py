"""The copy controllers' logic on CPU tensors: futures, refcounts, slices, backpressure.

Without CUDA, AsyncD2HController copies host tensors into its pool on its issuer thread
and AsyncH2DController clones: the same code as on a GPU minus the streams, so the
accounting is tested in CPU-only CI (tests/gpu runs the CUDA side).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import omnilink
from omnilink.cuda import AsyncD2HController, AsyncH2DController, PinnedRingPool


@pytest.fixture
def d2h():
    pool = PinnedRingPool(1 << 20, pin=False)
    ctl = AsyncD2HController("cpu", pool)
    yield ctl
    ctl.close()
    pool.close()


def test_submit_copies_into_pool_slots(d2h):
    src = {"hidden": torch.randn(64, 32), "ids": torch.arange(10), "meta": {"n": 3}, "arr": np.ones(3)}
    fut = d2h.submit(src)
    out = fut.result(timeout=10)
    assert torch.equal(out["hidden"], src["hidden"]) and torch.equal(out["ids"], src["ids"])
    assert out["meta"] == {"n": 3} and out["arr"] is src["arr"]
    pool = d2h.pool
    for t in (out["hidden"], out["ids"]):
        assert pool.address <= t.data_ptr() < pool.address + pool.capacity, "result is not in the pool"
    assert pool.slots_in_use == 2
    fut.release()
    assert pool.slots_in_use == 0 and pool.in_use_bytes == 0
    with pytest.raises(omnilink.ClosedError):
        fut.result()


def test_retain_release_refcount(d2h):
    fut = d2h.submit({"x": torch.ones(100)})
    fut.wait(10)
    fut.retain()
    fut.release()
    assert d2h.pool.slots_in_use == 1  # one reference left
    fut.release()
    assert d2h.pool.slots_in_use == 0
    with pytest.raises(omnilink.ClosedError):
        fut.release()


def test_slice_for_request_ranges(d2h):
    batch = torch.arange(10 * 4, dtype=torch.float32).reshape(10, 4)
    fut = d2h.submit({"h": batch, "scale": torch.ones(3)}, ranges={"a": (0, 3), "b": (3, 10)})
    a = fut.slice_for("a")
    b = fut.slice_for("b")
    fut.release()  # the submitter is done; the slices still hold the slots
    assert torch.equal(a.result(10)["h"], batch[0:3])
    assert torch.equal(b.result(10)["h"], batch[3:10])
    assert a.result(10)["scale"].shape == (3,)  # not batched: whole
    assert d2h.pool.slots_in_use == 2
    a.release()
    a.release()  # idempotent
    assert d2h.pool.slots_in_use == 2
    with b:
        pass
    assert d2h.pool.slots_in_use == 0
    with pytest.raises(omnilink.ConfigurationError):
        d2h.submit({"h": batch}, ranges={"a": (5, 2)})
    f2 = d2h.submit({"h": batch}, ranges={"a": (0, 1)})
    with pytest.raises(omnilink.ConfigurationError, match="no token range"):
        f2.slice_for("zzz")
    f2.release()


def test_submit_does_not_block_when_the_pool_is_full():
    pool = PinnedRingPool(4096, pin=False)
    with AsyncD2HController("cpu", pool) as ctl:
        first = ctl.submit({"x": torch.ones(1024)})  # 4096 bytes: the whole pool
        first.wait(10)
        second = ctl.submit({"x": torch.full((1024,), 2.0)})  # returns at once ...
        assert not second.wait(0.2)  # ... and waits for room off the caller's thread
        first.release()
        assert torch.equal(second.result(10)["x"], torch.full((1024,), 2.0))
        second.release()
    pool.close()


def test_pool_timeout_fails_the_future_not_the_caller():
    pool = PinnedRingPool(4096, pin=False)
    with AsyncD2HController("cpu", pool) as ctl:
        held = ctl.submit({"x": torch.ones(1024)})
        held.wait(10)
        fut = ctl.submit({"x": torch.ones(1024)}, timeout=0.05)
        with pytest.raises(omnilink.TransferTimeout):
            fut.result(10)
        assert pool.slots_in_use == 1  # the failed job gave back what it took
        held.release()
    pool.close()


def test_done_callbacks_and_close(d2h):
    seen = threading.Event()
    fut = d2h.submit({"x": torch.ones(4)})
    fut.add_done_callback(lambda f: seen.set())
    assert seen.wait(10)
    fut.release()
    d2h.close()
    with pytest.raises(omnilink.ClosedError):
        d2h.submit({"x": torch.ones(4)})


def test_h2d_cpu_mode_owns_its_copies_and_calls_on_done():
    done = threading.Event()
    with AsyncH2DController("cpu") as ctl:
        src = torch.arange(8)
        h = ctl.submit({"a": src, "n": 1}, on_done=done.set)
        out = h.wait()
        assert torch.equal(out["a"], src) and out["a"].data_ptr() != src.data_ptr()
        assert h.done() and done.wait(10)
    with pytest.raises(omnilink.ConfigurationError):
        AsyncH2DController("nonsense:0")
    if not torch.cuda.is_available():
        with pytest.raises(omnilink.CudaError):
            AsyncH2DController("cuda:0")
