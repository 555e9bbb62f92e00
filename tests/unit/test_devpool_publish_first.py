"""The pool's sender publishes a message before it queues the copy (the receiver claims,
checks and views the block meanwhile) and stores the slot's ``rec_seq`` once the copy
and its event are queued; the receiver's stream waits on the event only after that.
Over the host double, whose copy is a ``memmove`` at ``copy_in``: a receiver that did
not wait for ``rec_seq`` would read the block before the bytes are there."""

from __future__ import annotations

import gc
import threading
import time
import uuid

import pytest

torch = pytest.importorskip("torch")

from omnilink import TransportError, WouldBlock  # noqa: E402
from tests.cuda_ipc_double import HostCudaIpc, HostDeviceOps, host_pair  # noqa: E402


class GatedOps(HostDeviceOps):
    """``copy_in`` waits for ``go`` (or raises ``fail``) before it copies."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.go.set()
        self.entered = threading.Event()
        self.fail: BaseException | None = None

    def copy_in(self, *a, **k):
        self.entered.set()
        assert self.go.wait(10)
        if self.fail is not None:
            raise self.fail
        return super().copy_in(*a, **k)


class _Gated(HostCudaIpc):
    @staticmethod
    def _make_ops():
        return GatedOps()


@pytest.fixture
def pair():
    with host_pair(f"pub1-{uuid.uuid4().hex[:8]}", sender=_Gated) as (tx, rx):
        yield tx, rx


def _payload(i):
    return {"hidden": torch.arange(1024, dtype=torch.float32) + i, "meta": {"i": i}}


def _hold_the_next_copy(tx, rx, fail=None):
    """Attach with one payload (read and dropped), then make the next copy wait for
    ``ops.go`` (and raise ``fail`` then, if given): the sender's ops."""
    ops = tx._ops
    tx.put("warm", _payload(0), timeout=5)
    del rx.get("warm", timeout=5)["hidden"]
    ops.go.clear()
    ops.entered.clear()
    ops.fail = fail
    return ops


def test_the_receiver_waits_for_the_queued_copy_of_a_message_published_first(pair):
    tx, rx = pair
    ops = _hold_the_next_copy(tx, rx)  # attached: the next send goes straight on
    errors = []
    t = threading.Thread(target=lambda: errors.append(tx.put("k", _payload(7), timeout=5)))
    t.start()
    try:
        assert ops.entered.wait(5)  # the message is published, its copy not yet made
        assert tx._sender.lane_pending("k")
        got = {}
        r = threading.Thread(target=lambda: got.update(rx.get("k", timeout=10)))
        r.start()
        time.sleep(0.3)
        assert r.is_alive() and not got  # claimed, viewed, waiting for the slot's record
        assert not tx._sender.lane_pending("k")
        ops.go.set()
        r.join(10)
        t.join(10)
        assert torch.equal(got["hidden"], _payload(7)["hidden"]) and got["meta"] == {"i": 7}
    finally:
        ops.go.set()
        t.join(10)
    assert errors and isinstance(errors[0], int)


def test_a_copy_that_fails_before_the_claim_withdraws_its_message(pair):
    tx, rx = pair
    ops = tx._ops
    tx.put("warm", _payload(0), timeout=5)
    del rx.get("warm", timeout=5)["hidden"]
    gc.collect()
    ops.fail = RuntimeError("copy engine on fire")
    with pytest.raises(RuntimeError, match="on fire"):
        tx.put("k", _payload(1), timeout=5)
    with pytest.raises(WouldBlock):
        rx.get_nowait("k")  # withdrawn: never arrives
    assert tx.stats().blocks_in_use == 0  # its block went back
    ops.fail = None
    tx.put("k", _payload(2), timeout=5)  # the key is free again
    got = rx.get("k", timeout=5)
    assert torch.equal(got["hidden"], _payload(2)["hidden"])


def test_a_copy_that_fails_after_the_claim_is_a_transport_error_for_its_reader(pair):
    tx, rx = pair
    ops = _hold_the_next_copy(tx, rx, RuntimeError("copy engine on fire"))
    raised = []

    def put():
        try:
            tx.put("k", _payload(1), timeout=5)
        except RuntimeError as exc:
            raised.append(exc)

    t = threading.Thread(target=put)
    t.start()
    outcome = []

    def get():
        try:
            rx.get("k", timeout=10)
        except TransportError as exc:
            outcome.append(exc)

    r = threading.Thread(target=get)
    try:
        assert ops.entered.wait(5)
        r.start()
        deadline = time.monotonic() + 5
        while tx._sender.lane_pending("k") and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not tx._sender.lane_pending("k")  # claimed
        ops.go.set()  # the copy fails now
        r.join(10)
        t.join(10)
    finally:
        ops.go.set()
        t.join(10)
    assert raised and "on fire" in str(raised[0])
    assert outcome and "could not copy key 'k'" in str(outcome[0])
    ops.fail = None
    tx.put("k2", _payload(3), timeout=5)  # the sender attached again (a new generation)
    got = rx.get("k2", timeout=5)
    assert torch.equal(got["hidden"], _payload(3)["hidden"])


def test_a_size_computed_after_publishing_reaches_the_reader_even_when_its_slot_was_recorded_again():
    # cuda_ipc computes put's size after publishing and stores it with the slot's record;
    # a slot recorded again by a later payload (more unread payloads than slots) leaves
    # the reader to size the payload itself: bytes_got is exact either way.
    from omnilink import encoded_size

    ch = f"pub1-n-{uuid.uuid4().hex[:8]}"
    rx = HostCudaIpc(channel=ch, role="receiver", pool_bytes=4 << 20, event_slots=2)
    tx = HostCudaIpc(channel=ch, role="sender", linger=0)
    try:
        payloads = [{"hidden": torch.arange(64 * (i + 1), dtype=torch.float32), "meta": {"s": "x" * i}}
                    for i in range(5)]
        sizes = [tx.put(f"k{i}", p, timeout=5) for i, p in enumerate(payloads)]
        assert sizes == [encoded_size(p) for p in payloads]
        for i, p in enumerate(payloads):
            before = rx.stats().bytes_got
            got = rx.get(f"k{i}", timeout=5)
            assert rx.stats().bytes_got - before == sizes[i]
            assert torch.equal(got["hidden"], p["hidden"])
            del got
    finally:
        tx.close()
        rx.close()


def test_the_reader_does_not_wait_for_a_size_stored_late(monkeypatch):
    # The sender stores put's size after it recorded the copy; a reader that finds no
    # size for its sequence after a few looks computes it itself: same bytes_got, and
    # its get does not wait for the sender's store.
    from omnilink import encoded_size
    from omnilink.connectors.devpool import sender as sender_mod

    ch = f"pub1-late-{uuid.uuid4().hex[:8]}"
    rx = HostCudaIpc(channel=ch, role="receiver", pool_bytes=4 << 20, event_slots=4)
    tx = HostCudaIpc(channel=ch, role="sender", linger=0)
    go, entered = threading.Event(), threading.Event()
    real = sender_mod.PoolSender._size_after

    def late(payload, key, total):
        entered.set()
        assert go.wait(10)
        return real(payload, key, total)

    try:
        tx.put("warm", _payload(0), timeout=5)
        rx.get("warm", timeout=5)
        monkeypatch.setattr(sender_mod.PoolSender, "_size_after", staticmethod(late))
        sizes = []
        t = threading.Thread(target=lambda: sizes.append(tx.put("k", _payload(7), timeout=5)))
        t.start()
        try:
            assert entered.wait(5)  # the copy is recorded, the size not stored yet
            before = rx.stats().bytes_got
            got = rx.get("k", timeout=5)
            assert rx.stats().bytes_got - before == encoded_size(_payload(7))
            assert torch.equal(got["hidden"], _payload(7)["hidden"])
            assert t.is_alive()  # the sender was still held: the reader sized it itself
        finally:
            go.set()
            t.join(10)
        assert sizes == [encoded_size(_payload(7))]
        del got
    finally:
        go.set()
        tx.close()
        rx.close()


def test_a_slot_size_belongs_to_one_sequence():
    from omnilink.connectors.devpool.directory import SIZE_BITS, Directory

    d = Directory.__new__(Directory)
    d._slots, d._q = 0, [0] * 64
    d.set_rec_size(1, 5, 1234)
    assert d.rec_size(1, 5) == 1234
    assert d.rec_size(1, 6) == -1 and d.rec_size(1, 5 + (1 << (64 - SIZE_BITS))) == 1234
    assert d.rec_size(0, 5) == -1  # another slot: nothing stored for 5
    d.set_rec_size(1, 6, 1 << SIZE_BITS)  # past the field: stored as unknown
    assert d.rec_size(1, 6) == -1
    d.set_rec_size(1, 7, -1)
    assert d.rec_size(1, 7) == -1


@pytest.mark.parametrize("n, manifest", [(-2, True), (-1, False), (-(1 << 40), True)])
def test_a_negative_size_other_than_the_marked_one_is_refused(n, manifest):
    from omnilink import BlobDecodeError
    from omnilink.connectors.shm import ShmConnector

    ch = f"pub1-h-{uuid.uuid4().hex[:8]}"
    with HostCudaIpc(channel=ch, role="receiver", pool_bytes=4 << 20, event_slots=4) as rx, \
            ShmConnector(channel=f"{ch}/cuda-ipc", role="sender", arena_bytes=1 << 20, linger=0) as raw:
        d = [1, 1, 0, 0, 256, [[9, 0, 16, [4], ["x"]]]] if manifest else None
        raw.put("bad", {"d": d, "h": {"x": None}, "n": n}, timeout=5)
        with pytest.raises(BlobDecodeError, match="invalid payload size"):
            rx.get("bad", timeout=5)
        gc.collect()
        assert rx.stats().blocks_in_use == 0


def test_get_nowait_of_a_message_whose_copy_is_being_queued_waits_for_it_instead_of_losing_it(pair):
    tx, rx = pair
    ops = _hold_the_next_copy(tx, rx)
    t = threading.Thread(target=lambda: tx.put("k", _payload(5), timeout=5))
    t.start()
    try:
        assert ops.entered.wait(5)  # published, copy not queued
        threading.Timer(0.2, ops.go.set).start()
        got = rx.get_nowait("k")  # claimed at once: waits the 0.2 s for the record
        assert torch.equal(got["hidden"], _payload(5)["hidden"])
    finally:
        ops.go.set()
        t.join(10)


def test_a_clean_close_waits_for_every_slots_event_before_it_marks_the_copies_done():
    # Copies on the caller's stream (one GPU) or a peer's are not on the sender's copy
    # stream: a close that only synchronized that stream could tell readers "done"
    # (CLEAN_GEN) while a copy still ran. Every slot's event follows the copies recorded
    # before it: a clean close settles them all first.
    from omnilink.connectors.devpool.directory import CLEAN_GEN

    class Settles(HostDeviceOps):
        def __init__(self):
            super().__init__()
            self.settled = []
            self.dir = None

        def settle(self, event):
            self.settled.append((event, self.dir.get(CLEAN_GEN) if self.dir is not None else None))

    class _S(HostCudaIpc):
        @staticmethod
        def _make_ops():
            return Settles()

    with host_pair(f"pub1-c-{uuid.uuid4().hex[:8]}", sender=_S) as (tx, rx):
        for i in range(3):
            tx.put(f"k{i}", _payload(i), timeout=5)
        att = tx._sender.tx
        ops = tx._ops
        ops.dir = att.dir
        gen = att.gen
        events = list(att.events)
        tx.close()
        assert [e for e, _ in ops.settled] == events  # every slot's event, once
        assert all(clean != gen for _, clean in ops.settled)  # before the copies are called done
        assert rx._receiver.pool.dir.get(CLEAN_GEN) == gen
        for i in range(3):
            assert torch.equal(rx.get(f"k{i}", timeout=5)["hidden"], _payload(i)["hidden"])
