"""``put_many`` / ``get_many`` (issue 15, item 4): the shm batch path (one hold of the
channel mutex and one wake-up per batch, all-or-nothing claims), its error contract
(what was sent stays sent and is named; nothing else is published or leaked; a timed-out
``get_many`` takes nothing), and the generic version every other backend inherits.

The conformance check ``batch`` (``omnilink.testing``) runs the shared contract on every
backend; these tests look inside the shm and memory backends and at the edge cases.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

import omnilink
from omnilink.connectors import BaseConnector
from omnilink.connectors.memory import MemoryConnector

MiB = 1 << 20


def _chan(name: str) -> str:
    return f"unit/batch-{name}-{os.getpid()}"


def _payload(i: int, rows: int = 25) -> dict:
    """A codec window: 25 frames x 16 codebooks, ids, meta (a few KiB)."""
    return {
        "codes": torch.arange(rows * 16, dtype=torch.int64).reshape(rows, 16) + i,
        "ids": torch.full((4,), i, dtype=torch.int64),
        "meta": {"i": i, "finished": False},
    }


def _check(got: dict, i: int, rows: int = 25) -> None:
    assert got["meta"]["i"] == i
    assert torch.equal(got["codes"], torch.arange(rows * 16, dtype=torch.int64).reshape(rows, 16) + i)
    assert torch.equal(got["ids"], torch.full((4,), i, dtype=torch.int64))


def _pair(name: str, **options):
    tx = omnilink.connect("shm", channel=_chan(name), role="sender", **options)
    try:
        rx = omnilink.connect("shm", channel=_chan(name), role="receiver")
    except BaseException:
        tx.close()
        raise
    return tx, rx


@pytest.fixture
def shm_pair(request):
    tx, rx = _pair(request.node.name.replace("[", "-").replace("]", ""))
    yield tx, rx
    rx.close()
    tx.close()


def _arena_used(tx) -> tuple[int, int]:
    """(descriptors out, bytes allocated) of a sender's arena, after taking back what
    receivers released."""
    w = tx._writer
    with tx._slock, tx._chan.locked():
        w.drain()
        return len(w.out), sum(sp.alloc.used_bytes for sp in w.spaces)


class _Calls:
    """Counts calls of a method of one object (wrapped on the instance)."""

    def __init__(self, monkeypatch, obj, name):
        self.n = 0
        inner = getattr(obj, name)

        def wrapper(*args, **kwargs):
            self.n += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(obj, name, wrapper)


# ------------------------------------------------------------------ the shm batch path
def test_shm_batch_round_trip_in_order_with_zero_copy_views(shm_pair):
    tx, rx = shm_pair
    items = {f"w{i}": _payload(i, rows=(1, 25, 0, 400)[i % 4]) for i in range(16)}
    sizes = tx.put_many(items)
    assert sizes == [omnilink.encoded_size(p) for p in items.values()]
    keys = [f"w{i}" for i in (15, 3, 0, 7, 1, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14)]
    got = rx.get_many(keys, timeout=10)
    assert list(got) == keys
    for k in keys:
        i = int(k[1:])
        _check(got[k], i, rows=(1, 25, 0, 400)[i % 4])
    # Zero-copy: a received tensor is a view of the sender's arena.
    assert rx.mapping_of(got["w1"]["codes"].data_ptr()) is not None
    st_tx, st_rx = tx.stats(), rx.stats()
    assert (st_tx.puts, st_tx.bytes_put) == (16, sum(sizes))
    assert (st_rx.gets, st_rx.bytes_got) == (16, sum(sizes))
    del got
    assert _arena_used(tx) == (0, 0)


def test_shm_put_many_publishes_under_one_mutex_hold_and_wakes_once(shm_pair, monkeypatch):
    tx, rx = shm_pair
    tx.put("warm", _payload(0))
    rx.get("warm", timeout=10)
    publish = _Calls(monkeypatch, tx._writer, "publish")
    notify = _Calls(monkeypatch, tx._chan, "notify_all")
    unlock = _Calls(monkeypatch, tx._chan, "unlock")
    tx.put_many({f"k{i}": _payload(i) for i in range(16)})
    assert publish.n == 16
    assert notify.n == 1 and unlock.n == 1, (notify.n, unlock.n)
    # The receiver claims the whole batch in one pass under the mutex.
    claims = _Calls(monkeypatch, rx._chan, "unlock")
    got = rx.get_many([f"k{i}" for i in range(16)], timeout=10)
    assert claims.n == 1
    for i in range(16):
        _check(got[f"k{i}"], i)


def test_shm_single_put_is_unchanged_by_the_shared_pieces(shm_pair, monkeypatch):
    # put shares _fill / _publish with put_many: one publish, one notification.
    tx, rx = shm_pair
    notify = _Calls(monkeypatch, tx._chan, "notify_all")
    assert tx.put("one", _payload(1)) == omnilink.encoded_size(_payload(1))
    assert notify.n == 1
    _check(rx.get("one", timeout=10), 1)


def test_empty_batches(shm_pair):
    tx, rx = shm_pair
    assert tx.put_many({}) == [] and tx.put_many([]) == [] and tx.put_many(iter(())) == []
    assert rx.get_many([]) == {} and rx.get_many(()) == {}
    assert tx.stats().puts == 0 and rx.stats().gets == 0


def test_duplicates_and_pending_keys_are_refused_before_anything_is_sent(shm_pair):
    tx, rx = shm_pair
    with pytest.raises(omnilink.DuplicateKeyError) as info:
        tx.put_many([("a", _payload(0)), ("b", _payload(1)), ("a", _payload(2))])
    assert info.value.key == "a" and info.value.sent == [] and "nothing was sent" in str(info.value)
    tx.put("p", _payload(9))  # pending: a batch naming it is refused, with nothing sent
    with pytest.raises(omnilink.DuplicateKeyError) as info:
        tx.put_many({"c": _payload(3), "p": _payload(4)})
    assert info.value.key == "p" and info.value.sent == [] and info.value.unsent == ["c", "p"]
    for key in ("a", "b", "c"):
        with pytest.raises(omnilink.WouldBlock):
            rx.get_nowait(key)
    assert _arena_used(tx)[0] == 1  # only "p"
    _check(rx.get("p", timeout=10), 9)
    with pytest.raises(omnilink.ConfigurationError, match="twice"):
        rx.get_many(["x", "y", "x"], timeout=0)
    with pytest.raises(omnilink.ConfigurationError):
        tx.put_many({"ok": 1, "bad\x00key": 2})
    with pytest.raises(omnilink.ConfigurationError):
        rx.get_many(["ok", ""], timeout=0)
    with pytest.raises(omnilink.ConfigurationError, match="pair"):
        tx.put_many(["ab", "cd"])
    assert tx.stats().puts == 1


def test_a_bad_payload_stops_the_batch_with_nothing_sent_or_leaked(shm_pair):
    # shm plans (encodes) every payload before it writes any: nothing goes out.
    tx, rx = shm_pair
    items = [(f"k{i}", _payload(i)) for i in range(3)] + [("bad", {"s": {1, 2}})] + [("k4", _payload(4))]
    with pytest.raises(omnilink.BlobEncodeError) as info:
        tx.put_many(items)
    assert info.value.sent == [] and info.value.unsent == ["k0", "k1", "k2", "bad", "k4"]
    assert "put_many sent 0 of 5" in str(info.value)
    assert _arena_used(tx) == (0, 0)
    tx.put_many(items[:3] + items[4:])  # every key is still free
    got = rx.get_many(["k4", "k0", "k1", "k2"], timeout=10)
    for i in (0, 1, 2, 4):
        _check(got[f"k{i}"], i)


def test_a_batch_that_does_not_fit_sends_a_prefix_and_leaks_no_block():
    tx, rx = _pair("full", arena_bytes=1 * MiB, max_bytes=1 * MiB, max_inflight=64)
    try:
        chunk = lambda i: {"x": np.full(100_000, i % 251, dtype=np.uint8), "i": i}  # noqa: E731
        fits = tx._writer.data_bytes // (omnilink.encoded_size(chunk(0)) + 64)
        n = fits + 4
        keys = [f"k{i}" for i in range(n)]
        with pytest.raises(omnilink.TransferTimeout) as info:
            tx.put_many({k: chunk(i) for i, k in enumerate(keys)}, timeout=0.2)
        exc = info.value
        sent = exc.sent
        assert 0 < len(sent) <= fits and sent == keys[: len(sent)]
        assert exc.unsent == keys[len(sent):] and exc.key == keys[len(sent)]
        assert f"put_many sent {len(sent)} of {n}" in str(exc) and exc.channel == tx.channel
        # Exactly the sent prefix holds blocks: nothing of the failed item or later leaked.
        out, used = _arena_used(tx)
        assert out == len(sent)
        assert used == sum(rec.reserved for rec in tx._writer.out.values())
        assert tx.stats().puts == len(sent)
        # The prefix is receivable, the rest is not there and its keys are free.
        got = rx.get_many(sent, timeout=10)
        assert [g["i"] for g in got.values()] == list(range(len(sent)))
        with pytest.raises(omnilink.TransferTimeout):
            rx.get_many(exc.unsent[:1], timeout=0.05)
        del got
        assert _arena_used(tx) == (0, 0)
        # With the arena free again the rest goes through.
        tx.put_many({k: chunk(int(k[1:])) for k in exc.unsent[:fits]}, timeout=10)
        assert sorted(rx.get_many(exc.unsent[:fits], timeout=10)) == sorted(exc.unsent[:fits])
    finally:
        rx.close()
        tx.close()


def test_a_batch_larger_than_the_arena_flows_while_a_receiver_reads():
    # put_many publishes what it filled before it waits for room: a batch three times
    # the arena goes through as a reader takes the keys one by one (no deadlock).
    tx, rx = _pair("flow", arena_bytes=1 * MiB, max_bytes=1 * MiB, max_inflight=64)
    try:
        chunk = lambda i: {"x": np.full(100_000, i % 251, dtype=np.uint8), "i": i}  # noqa: E731
        n = 3 * (tx._writer.data_bytes // omnilink.encoded_size(chunk(0)))
        seen: list[int] = []
        errors: list[BaseException] = []

        def reader():
            try:
                for i in range(n):
                    got = rx.get(f"k{i}", timeout=30)
                    assert int(got["x"][0]) == i % 251
                    seen.append(got["i"])
                    del got
            except BaseException as exc:  # reported below
                errors.append(exc)

        t = threading.Thread(target=reader)
        t.start()
        sizes = tx.put_many({f"k{i}": chunk(i) for i in range(n)}, timeout=30)
        t.join(30)
        assert not t.is_alive() and not errors, errors
        assert len(sizes) == n and seen == list(range(n))
        assert _arena_used(tx) == (0, 0)
    finally:
        rx.close()
        tx.close()


def test_mutex_timeout_at_publish_gives_every_block_back(shm_pair, monkeypatch):
    tx, rx = shm_pair
    monkeypatch.setattr(tx._chan, "try_lock", lambda: False)
    monkeypatch.setattr(tx._chan, "lock_within", lambda deadline: False)
    free_before = len(tx._writer.free_desc)
    with pytest.raises(omnilink.TransferTimeout) as info:
        tx.put_many({f"k{i}": _payload(i) for i in range(5)}, timeout=0.1)
    assert info.value.sent == [] and "the channel mutex" in str(info.value)
    assert len(tx._writer.free_desc) == free_before and _arena_used(tx) == (0, 0)
    monkeypatch.undo()
    tx.put_many({f"k{i}": _payload(i) for i in range(5)})
    assert len(rx.get_many([f"k{i}" for i in range(5)], timeout=10)) == 5


def test_oversized_items_take_the_per_item_path_in_their_turn():
    tx, rx = _pair("overflow", arena_bytes=1 * MiB, max_bytes=1 * MiB)
    try:
        big = {"x": np.arange(400_000, dtype=np.float32)}  # 1.6 MB: an overflow segment
        items = [("s0", _payload(0)), ("big", big), ("s1", _payload(1)), ("s2", _payload(2))]
        sizes = tx.put_many(items)
        assert sizes[1] == omnilink.encoded_size(big)
        assert tx.stats().fallbacks == 1 and tx.stats().puts == 4
        got = rx.get_many(["s2", "big", "s0", "s1"], timeout=10)
        assert np.array_equal(got["big"]["x"], big["x"])
        for i in range(3):
            _check(got[f"s{i}"], i)
    finally:
        rx.close()
        tx.close()


def test_overflow_error_part_way_names_the_sent_prefix():
    tx, rx = _pair("overflow-err", arena_bytes=1 * MiB, overflow="error")
    try:
        big = {"x": np.zeros(2 * MiB, dtype=np.uint8)}
        with pytest.raises(omnilink.CapacityError) as info:
            tx.put_many([("a", _payload(0)), ("b", _payload(1)), ("big", big), ("c", _payload(2))])
        assert info.value.sent == ["a", "b"] and info.value.unsent == ["big", "c"]
        got = rx.get_many(["a", "b"], timeout=10)
        _check(got["a"], 0)
        with pytest.raises(omnilink.WouldBlock):
            rx.get_nowait("c")
        del got
        assert _arena_used(tx) == (0, 0)
    finally:
        rx.close()
        tx.close()


# ------------------------------------------------------------------ get_many
def test_get_many_timeout_takes_nothing(shm_pair):
    tx, rx = shm_pair
    tx.put_many({"a": _payload(1), "b": _payload(2)})
    with pytest.raises(omnilink.TransferTimeout) as info:
        rx.get_many(["a", "never", "b", "nope"], timeout=0.1)
    exc = info.value
    assert exc.missing == ["never", "nope"] and exc.key == "never" and exc.channel == rx.channel
    assert "'never'" in str(exc) and "nothing was taken" in str(exc)
    assert rx.stats().gets == 0 and rx.stats().timeouts == 1
    # Still there, for a single get as for a batch.
    _check(rx.get("b", timeout=10), 2)
    _check(rx.get_many(["a"], timeout=10)["a"], 1)


def test_get_many_waits_for_the_rest_and_is_woken_by_the_last_put(shm_pair):
    tx, rx = shm_pair
    tx.put_many({"k0": _payload(0), "k1": _payload(1)})
    result: list = []
    t = threading.Thread(target=lambda: result.append(rx.get_many(["k0", "k1", "k2", "k3"], timeout=30)))
    t.start()
    t.join(0.2)
    assert t.is_alive()
    tx.put("k2", _payload(2))
    t.join(0.2)
    assert t.is_alive(), "get_many returned before its last key"
    with pytest.raises(omnilink.WouldBlock):  # and took none meanwhile ...
        rx.get_nowait("k3")
    assert rx.stats().gets == 0
    tx.put("k3", _payload(3))
    t.join(30)
    assert not t.is_alive() and list(result[0]) == ["k0", "k1", "k2", "k3"]
    for i in range(4):
        _check(result[0][f"k{i}"], i)


def test_get_many_of_a_consumed_key_raises_at_once_and_takes_nothing(shm_pair):
    tx, rx = shm_pair
    tx.put_many({"a": _payload(1), "b": _payload(2)})
    rx.get("a", timeout=10)
    with pytest.raises(omnilink.KeyConsumedError) as info:
        rx.get_many(["b", "a"], timeout=30)
    assert info.value.key == "a"
    _check(rx.get("b", timeout=0), 2)


def test_get_many_across_two_senders_and_device_cpu():
    ch = _chan("two-senders")
    tx1 = omnilink.connect("shm", channel=ch, role="sender")
    tx2 = omnilink.connect("shm", channel=ch, role="sender")
    rx = omnilink.connect("shm", channel=ch, role="receiver")
    try:
        tx1.put_many({"a0": _payload(0), "a1": _payload(1)})
        tx2.put_many({"b0": _payload(10), "b1": _payload(11)})
        got = rx.get_many(["b1", "a0", "b0", "a1"], timeout=10, device="cpu")
        for k, i in (("a0", 0), ("a1", 1), ("b0", 10), ("b1", 11)):
            _check(got[k], i)
            assert got[k]["codes"].device.type == "cpu"
    finally:
        rx.close()
        tx2.close()
        tx1.close()


def test_a_broken_payload_consumes_its_batch_and_leaks_nothing(shm_pair, monkeypatch):
    from omnilink.connectors.shm import connector as shm_connector

    tx, rx = shm_pair
    tx.put_many({f"k{i}": _payload(i) for i in range(4)})
    real = shm_connector._decode_fast
    calls = {"n": 0}

    def breaks_second(buf, n):
        calls["n"] += 1
        if calls["n"] == 2:
            raise omnilink.BlobDecodeError("broken frame (test)")
        return real(buf, n)

    monkeypatch.setattr(shm_connector, "_decode_fast", breaks_second)
    with pytest.raises(omnilink.BlobDecodeError):
        rx.get_many([f"k{i}" for i in range(4)], timeout=10)
    monkeypatch.undo()
    assert rx.stats().gets == 1  # the one decoded; the others' counts were taken back
    assert _arena_used(tx) == (0, 0)  # every block went back
    with pytest.raises(omnilink.KeyConsumedError):
        rx.get_nowait("k3")


def test_batches_after_close_and_in_the_wrong_role(shm_pair):
    tx, rx = shm_pair
    with pytest.raises(omnilink.ConfigurationError, match="role='receiver'"):
        rx.put_many({"k": 1})
    with pytest.raises(omnilink.ConfigurationError, match="role='sender'"):
        tx.get_many(["k"], timeout=0)
    rx.close()
    tx.close()
    with pytest.raises(omnilink.ClosedError):
        tx.put_many({"k": 1})
    with pytest.raises(omnilink.ClosedError):
        rx.get_many(["k"])


# ------------------------------------------------------------------ memory
def test_memory_batch_under_backpressure_keeps_the_prefix():
    ch = _chan("memory")
    tx = omnilink.connect("memory", channel=ch, role="sender", capacity_bytes=20_000)
    rx = omnilink.connect("memory", channel=ch, role="receiver")
    try:
        item = {"x": np.zeros(6_000, dtype=np.uint8)}
        with pytest.raises(omnilink.TransferTimeout) as info:
            tx.put_many({f"k{i}": item for i in range(5)}, timeout=0.05)
        assert info.value.sent == ["k0", "k1", "k2"] and info.value.unsent == ["k3", "k4"]
        assert tx.stats().puts == 3 and tx.stats().blocks_in_use == 3
        with pytest.raises(omnilink.TransferTimeout) as info:
            rx.get_many(["k0", "k3"], timeout=0.05)
        assert info.value.missing == ["k3"] and tx.stats().blocks_in_use == 3
        # A reader frees room while the batch waits: the rest goes through.
        t = threading.Thread(target=lambda: [rx.get(f"k{i}", timeout=10) for i in range(5)])
        t.start()
        tx.put_many({"k3": item, "k4": item}, timeout=10)
        t.join(10)
        assert not t.is_alive() and tx.stats().blocks_in_use == 0
    finally:
        rx.close()
        tx.close()


# ------------------------------------------------------------------ the generic version
class _Generic(MemoryConnector):
    """The memory backend with BaseConnector's generic batch (what zmq, nccl and
    cuda_ipc run)."""

    _put_many = BaseConnector._put_many
    _get_many = BaseConnector._get_many


class _NoArrivals(_Generic):
    """A third-party backend that cannot say what has arrived without taking it."""

    _arrivals = BaseConnector._arrivals


def test_generic_batch_round_trip_timeout_and_prefix():
    ch = _chan("generic")
    tx = _Generic(channel=ch, role="sender")
    rx = _Generic(channel=ch, role="receiver")
    try:
        items = [(f"k{i}", _payload(i)) for i in range(3)] + [("bad", {"s": {1}}), ("k4", _payload(4))]
        with pytest.raises(omnilink.BlobEncodeError) as info:
            tx.put_many(items)
        assert info.value.sent == ["k0", "k1", "k2"] and info.value.unsent == ["bad", "k4"]
        assert "put_many sent 3 of 5" in str(info.value) and tx.stats().puts == 3
        with pytest.raises(omnilink.TransferTimeout) as info2:
            rx.get_many(["k2", "k4", "k0"], timeout=0.05)
        assert info2.value.missing == ["k4"] and rx.stats().gets == 0
        got = rx.get_many(["k2", "k1", "k0"], timeout=10)
        assert list(got) == ["k2", "k1", "k0"]
        for i in range(3):
            _check(got[f"k{i}"], i)
    finally:
        rx.close()
        tx.close()


def test_generic_get_many_waits_again_when_a_key_goes_between_look_and_take(monkeypatch):
    ch = _chan("generic-race")
    tx = _Generic(channel=ch, role="sender")
    rx = _Generic(channel=ch, role="receiver")
    try:
        tx.put_many({"a": _payload(1), "b": _payload(2)})
        real = rx.get_nowait
        missed = {"b": 1}

        def racing(key, /, *, device=None):
            if missed.get(key):
                missed[key] -= 1
                raise omnilink.WouldBlock("taken between the look and the take (test)")
            return real(key, device=device)

        monkeypatch.setattr(rx, "get_nowait", racing)
        got = rx.get_many(["a", "b"], timeout=10)  # looks again and finishes the batch
        assert list(got) == ["a", "b"] and not missed["b"]
        _check(got["a"], 1)
        _check(got["b"], 2)
        # Another reader consumed a key of the batch in between: what was taken is
        # handed over with the error instead of being lost.
        tx.put_many({"c": _payload(3), "d": _payload(4)})

        def consumed(key, /, *, device=None):
            if key == "d":
                rx._get("d", omnilink._util.NO_WAIT, False)  # the other reader wins "d"
            return real(key, device=device)

        monkeypatch.setattr(rx, "get_nowait", consumed)
        with pytest.raises(omnilink.KeyConsumedError) as info:
            rx.get_many(["c", "d"], timeout=10)
        assert list(info.value.got) == ["c"] and "'got'" in str(info.value)
        _check(info.value.got["c"], 3)
    finally:
        rx.close()
        tx.close()


def test_generic_get_many_without_arrivals_hands_over_what_it_took():
    ch = _chan("no-arrivals")
    tx = _NoArrivals(channel=ch, role="sender")
    rx = _NoArrivals(channel=ch, role="receiver")
    try:
        tx.put("a", _payload(1))
        with pytest.raises(omnilink.TransferTimeout) as info:
            rx.get_many(["a", "b"], timeout=0.05)
        assert list(info.value.got) == ["a"] and "'got'" in str(info.value)
        tx.put("b", _payload(2))
        _check(rx.get_many(["b"], timeout=10)["b"], 2)
    finally:
        rx.close()
        tx.close()


def test_a_stored_error_is_not_changed_by_the_batch_that_raised_it():
    # A backend may raise one stored error again (a lost link): each batch raises a
    # copy carrying its own note and attributes.
    stored = omnilink.PeerLostError("link lost")

    class Lost(_Generic):
        def _put(self, key, payload, deadline):
            if key == "x":
                raise stored
            return super()._put(key, payload, deadline)

    ch = _chan("stored")
    tx = Lost(channel=ch, role="sender")
    try:
        for first in ("a", "b"):
            with pytest.raises(omnilink.PeerLostError) as info:
                tx.put_many({first: 1, "x": 2})
            assert info.value is not stored and info.value.sent == [first] and info.value.__cause__ is stored
        assert str(stored) == "link lost" and not hasattr(stored, "sent")
    finally:
        tx.close()


def test_payloads_for_the_device_path_go_one_by_one_inside_a_batch():
    # The GPU path's CPU test mode: every payload of the batch takes put's own path
    # (sliced ones too, published as a head and slices), and get_many gathers them.
    from omnilink.connectors.shm import ShmConnector

    ch = _chan("device-path")
    tx = ShmConnector(channel=ch, role="sender", arena_bytes=4 * MiB, pipeline_bytes=64 << 10,
                      slice_bytes=64 << 10, linger=0)
    rx = ShmConnector(channel=ch, role="receiver")
    try:
        tx._gpu_path().cpu_mode = True
        big = torch.randn(256 << 10)  # 1 MiB: sent in 64 KiB slices
        items = {"s0": _payload(0), "big": {"h": big, "meta": {"finished": True}}, "s1": _payload(1)}
        sizes = tx.put_many(items, timeout=30)
        assert len(sizes) == 3 and tx.stats().sliced == 1 and tx.stats().puts == 3
        got = rx.get_many(["big", "s1", "s0"], timeout=30)
        assert torch.equal(got["big"]["h"], big) and got["big"]["meta"] == {"finished": True}
        _check(got["s0"], 0)
        _check(got["s1"], 1)
        assert rx.stats().sliced == 1 and rx.stats().gets == 3
    finally:
        rx.close()
        tx.close()
