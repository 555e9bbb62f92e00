"""Behaviour of the in-process ``memory`` backend beyond the conformance suite."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest
import torch

import omnilink
from omnilink.blob import peek_header
from omnilink.connectors import memory
from omnilink.connectors.memory import MemoryConnector

JOIN = 30.0


class Worker(threading.Thread):
    """Runs ``fn`` and keeps its result or exception for the test thread."""

    def __init__(self, fn, *args, **kwargs):
        super().__init__(daemon=True)
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.result = self.error = None

    def run(self):
        try:
            self.result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:
            self.error = exc

    def outcome(self):
        self.join(JOIN)
        assert not self.is_alive(), "worker still blocked"
        if self.error is not None:
            raise self.error
        return self.result


def wait_until_blocked(worker: Worker) -> None:
    """Give ``worker`` time to reach its wait. A correct connector is blocked by then;
    a broken one that did not block has most likely finished, failing the test."""
    time.sleep(0.2)


@pytest.fixture
def pair(request):
    name = f"mem/{request.node.name.replace('[', '-').replace(']', '')}"[:120]
    tx = MemoryConnector(channel=name, role="sender")
    rx = MemoryConnector(channel=name, role="receiver")
    yield tx, rx
    rx.close()
    tx.close()
    assert name not in memory._channels


def frame_size(payload) -> int:
    return omnilink.encoded_size(payload)


def test_is_a_connector(pair):
    tx, rx = pair
    assert isinstance(tx, omnilink.Connector)
    assert isinstance(rx, omnilink.Connector)
    assert tx.backend == rx.backend == "memory"


def test_stored_frame_is_a_real_tensor_blob(pair):
    tx, rx = pair
    payload = {"codes.audio": torch.arange(10), "meta.finished": torch.tensor(True)}
    n = tx.put("k", payload)
    frame = memory._channels[tx.channel].frames["k"]
    assert bytes(frame[:4]) == b"OLB1"
    assert peek_header(frame)[2] == n == len(frame) == omnilink.encoded_size(payload)


def test_get_is_zero_copy_view_of_the_stored_frame(pair):
    tx, rx = pair
    payload = {
        "h": torch.randn(16, 32).to(torch.bfloat16),
        "ids": torch.arange(100, dtype=torch.int64),
        "a": np.arange(50, dtype=np.float32),
    }
    tx.put("k", payload)
    frame = memory._channels[tx.channel].frames["k"]
    start = ctypes.addressof(ctypes.c_char.from_buffer(frame))
    end = start + len(frame)
    got = rx.get("k", timeout=5)
    for name in ("h", "ids"):
        t = got[name]
        assert start <= t.data_ptr() and t.data_ptr() + t.nbytes <= end, name
    a = got["a"]
    assert start <= a.ctypes.data and a.ctypes.data + a.nbytes <= end
    # The views are writable and own nothing else: writing one does not touch the sender's.
    got["ids"].fill_(-1)
    assert torch.equal(payload["ids"], torch.arange(100, dtype=torch.int64))
    # The channel no longer references the frame; the views keep it alive.
    assert "k" not in memory._channels[tx.channel].frames
    del frame
    assert torch.equal(got["h"], payload["h"])


def test_payload_larger_than_capacity_is_capacity_error_at_once():
    payload = {"t": torch.zeros(4096, dtype=torch.uint8)}
    cap = frame_size(payload) - 1
    with MemoryConnector(channel="mem/cap-small", capacity_bytes=cap) as conn:
        # timeout=5: a connector that waited instead would raise TransferTimeout.
        with pytest.raises(omnilink.CapacityError, match="capacity_bytes"):
            conn.put("k", payload, timeout=5)
        assert conn.stats().bytes_in_use == 0
        with pytest.raises(omnilink.WouldBlock):
            conn.get_nowait("k")


def test_backpressure_times_out_naming_channel_and_key():
    payload = {"t": torch.zeros(1000, dtype=torch.uint8)}
    n = frame_size(payload)
    with MemoryConnector(channel="mem/bp", capacity_bytes=2 * n) as conn:
        conn.put("a", payload)
        conn.put("b", payload)
        with pytest.raises(omnilink.TransferTimeout) as info:
            conn.put("c", payload, timeout=0.05)
        assert "mem/bp" in str(info.value) and "'c'" in str(info.value)
        assert info.value.key == "c" and info.value.channel == "mem/bp"
        assert conn.stats().timeouts == 1
        assert conn.stats().bytes_in_use == 2 * n
        # Nothing of the refused put is stored; a get makes room.
        with pytest.raises(omnilink.WouldBlock):
            conn.get_nowait("c")
        conn.get("a", timeout=5)
        assert conn.put("c", payload, timeout=5) == n
        assert set(memory._channels["mem/bp"].frames) == {"b", "c"}


def test_blocked_put_is_released_by_a_get_in_another_thread():
    payload = {"t": torch.arange(256, dtype=torch.int32)}
    n = frame_size(payload)
    with MemoryConnector(channel="mem/release", capacity_bytes=n, role="sender") as tx, MemoryConnector(
        channel="mem/release", role="receiver"
    ) as rx:
        tx.put("first", payload)
        putter = Worker(tx.put, "second", {"t": torch.arange(256, dtype=torch.int32) * 2}, timeout=JOIN)
        putter.start()
        wait_until_blocked(putter)
        assert putter.is_alive(), "put did not block on a full channel"
        with pytest.raises(omnilink.WouldBlock):
            rx.get_nowait("second")
        assert torch.equal(rx.get("first", timeout=5)["t"], payload["t"])
        assert putter.outcome() == n
        assert torch.equal(rx.get("second", timeout=5)["t"], payload["t"] * 2)


def test_discard_makes_room_for_a_blocked_put():
    payload = {"t": torch.zeros(512, dtype=torch.uint8)}
    with MemoryConnector(channel="mem/discard-room", capacity_bytes=frame_size(payload)) as conn:
        conn.put("a", payload)
        putter = Worker(conn.put, "b", payload, timeout=JOIN)
        putter.start()
        wait_until_blocked(putter)
        assert putter.is_alive()
        assert conn.discard("a") is True
        putter.outcome()
        assert conn.stats().discards == 1
        conn.get("b", timeout=5)


def test_close_wakes_a_blocked_get_and_a_blocked_put():
    tx = MemoryConnector(channel="mem/close-wakes", role="sender", capacity_bytes=frame_size({"x": 1}))
    rx = MemoryConnector(channel="mem/close-wakes", role="receiver")
    try:
        getter = Worker(rx.get, "never", timeout=JOIN)
        getter.start()
        tx.put("fill", {"x": 1})
        putter = Worker(tx.put, "blocked", {"x": 2}, timeout=JOIN)
        putter.start()
        wait_until_blocked(getter)
        assert getter.is_alive() and putter.is_alive()
        rx.close()
        with pytest.raises(omnilink.ClosedError):
            getter.outcome()
        tx.close()
        with pytest.raises(omnilink.ClosedError):
            putter.outcome()
    finally:
        rx.close()
        tx.close()
    assert "mem/close-wakes" not in memory._channels


def test_close_does_not_wait_for_a_put_async_blocked_on_backpressure():
    conn = MemoryConnector(channel="mem/close-async", capacity_bytes=frame_size({"x": 1}))
    conn.put("fill", {"x": 1})
    fut = conn.put_async("blocked", {"x": 2})  # no timeout: would wait forever
    closer = Worker(conn.close)
    closer.start()
    closer.outcome()
    with pytest.raises(omnilink.ClosedError):
        fut.result(timeout=JOIN)


def test_reusing_a_pending_key_is_a_configuration_error(pair):
    tx, rx = pair
    tx.put("dup", {"v": 1})
    with pytest.raises(omnilink.ConfigurationError, match="still pending"):
        tx.put("dup", {"v": 2})
    assert rx.get("dup", timeout=5) == {"v": 1}
    # Once consumed, the key may be used again.
    tx.put("dup", {"v": 3})
    assert rx.get("dup", timeout=5) == {"v": 3}


def test_roles_are_enforced(pair):
    tx, rx = pair
    with pytest.raises(omnilink.ConfigurationError, match="role='receiver'"):
        rx.put("k", {})
    with pytest.raises(omnilink.ConfigurationError, match="role='sender'"):
        tx.get("k", timeout=0)
    with pytest.raises(omnilink.ConfigurationError, match="role='sender'"):
        tx.get_nowait("k")
    # Either role may discard.
    assert tx.discard("k") is False


def test_exactly_once_with_racing_receivers():
    keys = [f"r{i}" for i in range(100)]
    with MemoryConnector(channel="mem/race", role="sender") as tx:
        receivers = [MemoryConnector(channel="mem/race", role="receiver") for _ in range(4)]
        try:
            for i, key in enumerate(keys):
                tx.put(key, {"i": i})
            barrier = threading.Barrier(len(receivers))

            def drain(rx, order):
                got = []
                barrier.wait(JOIN)
                for key in order:
                    try:
                        got.append((key, rx.get_nowait(key)["i"]))
                    except (omnilink.WouldBlock, omnilink.KeyConsumedError):
                        pass  # not there, or another receiver won it
                return got

            workers = []
            for n, rx in enumerate(receivers):
                order = keys[n:] + keys[:n] if n % 2 else list(reversed(keys))
                workers.append(Worker(drain, rx, order))
            for w in workers:
                w.start()
            results = [item for w in workers for item in w.outcome()]
        finally:
            for rx in receivers:
                rx.close()
    assert sorted(k for k, _ in results) == sorted(keys), "a key was delivered twice or lost"
    assert all(keys[i] == k for k, i in results)


def test_connectors_on_a_channel_share_it_until_the_last_closes():
    a = MemoryConnector(channel="mem/shared")
    b = MemoryConnector(channel="mem/shared")
    a.put("k", {"v": 1})
    a.close()
    assert b.get("k", timeout=5) == {"v": 1}
    b.put("left-behind", {"v": 2})
    assert b.stats().blocks_in_use == 1
    b.close()
    assert "mem/shared" not in memory._channels
    with MemoryConnector(channel="mem/shared") as c:
        with pytest.raises(omnilink.WouldBlock):
            c.get_nowait("left-behind")


def test_capacity_named_by_a_later_connector_applies():
    payload = {"t": torch.zeros(256, dtype=torch.uint8)}
    with MemoryConnector(channel="mem/cap-late", role="receiver") as rx, MemoryConnector(
        channel="mem/cap-late", role="sender", capacity_bytes=frame_size(payload)
    ) as tx:
        assert rx._chan.capacity == frame_size(payload)
        tx.put("a", payload)
        with pytest.raises(omnilink.TransferTimeout):
            tx.put("b", payload, timeout=0.05)


def test_capacity_must_agree_on_an_open_channel():
    with MemoryConnector(channel="mem/cap-agree", capacity_bytes=1 << 20):
        with pytest.raises(omnilink.ConfigurationError, match="capacity_bytes"):
            MemoryConnector(channel="mem/cap-agree", capacity_bytes=2 << 20)
        # Naming no capacity joins the channel as it is.
        with MemoryConnector(channel="mem/cap-agree") as joined:
            assert joined._chan.capacity == 1 << 20
    assert "mem/cap-agree" not in memory._channels


def test_stats_track_bytes_in_use(pair):
    tx, rx = pair
    n1 = tx.put("a", {"t": torch.zeros(100)})
    n2 = tx.put("b", {"t": torch.zeros(300)})
    assert (tx.stats().blocks_in_use, tx.stats().bytes_in_use) == (2, n1 + n2)
    rx.get("a", timeout=5)
    assert (rx.stats().blocks_in_use, rx.stats().bytes_in_use) == (1, n2)
    assert rx.stats().bytes_got == n1
    assert rx.discard("b") is True
    assert tx.stats().bytes_in_use == 0


def test_default_timeout_option_applies():
    with MemoryConnector(channel="mem/default-timeout", timeout=0.05) as conn:
        with pytest.raises(omnilink.TransferTimeout, match="0.05"):
            conn.get("absent")


def test_stats_after_close_is_closed_error():
    conn = MemoryConnector(channel="mem/stats-closed")
    conn.close()
    with pytest.raises(omnilink.ClosedError):
        conn.stats()
