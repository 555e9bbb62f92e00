"""PinnedRingPool accounting and backpressure (CPU: the same logic as pinned memory)."""

from __future__ import annotations

import random
import threading

import pytest

import omnilink
from omnilink.cuda import PinnedRingPool


def test_acquire_release_accounting_and_coalescing():
    pool = PinnedRingPool(1024, pin=False)
    a = pool.acquire(100)
    b = pool.acquire(200)
    c = pool.acquire(64)
    assert (a.offset, b.offset, c.offset) == (0, 128, 384)
    assert pool.in_use_bytes == 128 + 256 + 64 and pool.slots_in_use == 3
    b.release()
    a.release()  # out of order: a and b's blocks coalesce into one 384-byte hole
    big = pool.acquire(384)
    assert big.offset == 0
    a.release()  # idempotent
    assert pool.in_use_bytes == 384 + 64


def test_slot_memory_is_the_pool_memory():
    pool = PinnedRingPool(4096, pin=False)
    s = pool.acquire(256)
    s.view[:4] = b"abcd"
    assert s.tensor().data_ptr() == pool.address + s.offset
    assert bytes(pool._view[s.offset : s.offset + 4]) == b"abcd"


def test_over_buffer_hands_out_that_buffer():
    buf = bytearray(8192)
    pool = PinnedRingPool.over(buf, register=False)
    s = pool.acquire(10)
    s.view[:] = b"0123456789"
    assert buf[:10] == b"0123456789"
    pool.close()
    with pytest.raises(omnilink.ClosedError):
        pool.acquire(1)


def test_too_large_is_capacity_error_and_timeout_is_transfer_timeout():
    pool = PinnedRingPool(1024, pin=False)
    with pytest.raises(omnilink.CapacityError):
        pool.acquire(2048)
    pool.acquire(1024)
    assert pool.try_acquire(1) is None
    with pytest.raises(omnilink.TransferTimeout) as ei:
        pool.acquire(64, timeout=0.05)
    assert "1024 of 1024 bytes in use" in str(ei.value)


def test_full_pool_blocks_until_a_release():
    pool = PinnedRingPool(1024, pin=False)
    held = pool.acquire(1024)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(512, timeout=10)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got  # blocked: backpressure
    held.release()
    t.join(10)
    assert got and got[0].nbytes == 512


def test_close_wakes_a_waiting_acquire():
    pool = PinnedRingPool(128, pin=False)
    pool.acquire(128)
    errs = []

    def wait():
        try:
            pool.acquire(64, timeout=10)
        except omnilink.ClosedError as exc:
            errs.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    t.join(0.1)
    pool.close()
    t.join(10)
    assert errs


def test_in_use_never_exceeds_capacity_under_random_use():
    rng = random.Random(7)
    pool = PinnedRingPool(1 << 16, pin=False)
    live = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live))).release()
        else:
            s = pool.try_acquire(rng.randrange(0, 5000))
            if s is not None:
                live.append(s)
        assert 0 <= pool.in_use_bytes <= pool.capacity
        spans = sorted((s.offset, s.offset + s.reserved) for s in live)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "overlapping blocks"
    for s in live:
        s.release()
    assert pool.in_use_bytes == 0 and pool._free == [(0, 1 << 16)]


def test_bad_arguments():
    with pytest.raises(omnilink.ConfigurationError):
        PinnedRingPool(0)
    pool = PinnedRingPool(128, pin=False)
    with pytest.raises(omnilink.ConfigurationError):
        pool.acquire(-1)
    other = PinnedRingPool(128, pin=False)
    with pytest.raises(omnilink.ConfigurationError):
        pool.release(other.acquire(1))
