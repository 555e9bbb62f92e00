"""``PoolSender.send(host_to_pool=N)``: small host tensors ride in the pool block after
the device ones (gathered in a per-slot stage, a slice of one page-locked arena, one
copy), so the receiver finds them as views of its pool; larger host tensors stay in the
host part. Over the host double, with int64 and bool tensors standing for host tensors
(everything else for device ones)."""

from __future__ import annotations

import ctypes
import uuid

import pytest

torch = pytest.importorskip("torch")

from omnilink import encoded_size  # noqa: E402
from omnilink._util import Deadline  # noqa: E402
from omnilink.connectors.devpool import PoolReceiver, PoolSender  # noqa: E402
from tests.cuda_ipc_double import HostCudaIpc  # noqa: E402
from tests.cuda_ipc_double import HostLikeOps as HostOnlyOps  # noqa: E402


def _pair():
    ch = f"h2p-{uuid.uuid4().hex[:8]}"
    ops = HostOnlyOps()
    rx = PoolReceiver(ops, ch, device=None, pool_bytes=4 << 20, event_slots=4, max_blocks=64)
    tx = PoolSender(ops, ch)
    return ops, tx, rx


def _send(tx, key, payload, most, landing=False):
    sent = []
    tx.send(key, payload, Deadline(5.0), None, sent.append, host_to_pool=most, landing=landing)
    (msg,) = sent
    return msg


@pytest.mark.parametrize("most", [0, 1 << 10])
def test_small_host_tensors_ride_in_the_block_after_the_device_ones(most):
    ops, tx, rx = _pair()
    try:
        rx._open()
        for i in range(6):  # more payloads than event slots: stages reused
            payload = {"hidden": torch.randn(300) + i, "ids": torch.arange(16) + i,
                       "meta": {"finished": torch.tensor(i % 2 == 0), "big": torch.arange(1000) + i,
                                "chunk": i}, "list": [torch.ones(3, dtype=torch.int64) * i, "x"]}
            msg = _send(tx, f"k{i}", payload, most)
            host, manifest = msg["h"], msg["d"]
            carried = {"ids": host["ids"] is None, "finished": host["meta"]["finished"] is None,
                       "list0": host["list"][0] is None, "big": host["meta"]["big"] is None}
            got = rx.land(f"k{i}", msg)  # (fills the host part in place)
            pool = rx.pool
            lo, hi = pool.ptr, pool.ptr + pool.nbytes
            small = {"ids": got["ids"], "finished": got["meta"]["finished"], "list0": got["list"][0]}
            for name, t in small.items():
                assert (lo <= t.data_ptr() < hi) == bool(most), name  # in the pool iff asked
            assert not lo <= got["meta"]["big"].data_ptr() < hi  # 8000 bytes: over the bound, host part
            assert lo <= got["hidden"].data_ptr() < hi
            assert carried == {"ids": bool(most), "finished": bool(most), "list0": bool(most), "big": False}
            if most:
                offs = [e[1] for e in manifest[5]]
                dev = [e[1] for e in manifest[5] if e[4] == ["hidden"]]
                assert max(dev) < min(o for o, e in zip(offs, manifest[5]) if e[4] != ["hidden"])  # host after
            for a, b in ((got["hidden"], payload["hidden"]), (got["ids"], payload["ids"]),
                         (got["meta"]["finished"], payload["meta"]["finished"]),
                         (got["meta"]["big"], payload["meta"]["big"]), (got["list"][0], payload["list"][0])):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            assert got["meta"]["chunk"] == i and got["list"][1] == "x"
            del got, small
        assert ops.staged == (6 if most else 0)
        assert len(tx.tx.stages) == (min(6, 4) if most else 0)  # one stage per slot used, reused
    finally:
        tx.close()
        rx.close()


def _lands_as_sent(rx, key, msg, payload):
    """``rx.land`` of ``msg`` gives back ``payload``'s hidden state and ids."""
    got = rx.land(key, msg)
    assert torch.equal(got["ids"], payload["ids"]) and torch.equal(got["hidden"], payload["hidden"])


def _placed_pair(mps, device_now):
    """``(ops, sender, receiver)`` over ``HostOnlyOps`` as under an MPS server or not,
    every device tensor on the device ``device_now()`` says (the pool's is 0); the
    receiver's pool open."""

    class Ops(HostOnlyOps):
        MPS = mps

        @staticmethod
        def tensor_device(t):
            return device_now()

    ch = f"h2p-{uuid.uuid4().hex[:8]}"
    ops = Ops()
    rx = PoolReceiver(ops, ch, device=None, pool_bytes=4 << 20, event_slots=4, max_blocks=64)
    tx = PoolSender(ops, ch)
    rx._open()
    return ops, tx, rx


@pytest.mark.parametrize("remote", [False, True])
@pytest.mark.parametrize("mps", [False, True])
@pytest.mark.parametrize("setting", [None, True, False])
def test_host_tensors_beside_another_gpus_tensors_stay_in_the_host_part_without_mps(monkeypatch, remote, mps,
                                                                                    setting):
    """``HOSTS_ACROSS_GPUS``: host tensors ride in the block beside device tensors of
    another GPU than the pool's only under an MPS server (``None``) or when set; beside
    the pool's own device tensors, always."""
    from omnilink.connectors.devpool import sender as pool_sender

    monkeypatch.setattr(pool_sender, "HOSTS_ACROSS_GPUS", setting)

    ops, tx, rx = _placed_pair(mps, lambda: 1 if remote else 0)
    try:
        carried = not remote or (mps if setting is None else setting)
        for i in range(3):
            payload = {"hidden": torch.randn(64) + i, "ids": torch.arange(16) + i,
                       "meta": {"finished": torch.tensor(i == 2), "chunk": i}}
            msg = _send(tx, f"k{i}", payload, 1 << 10)
            assert (msg["h"]["ids"] is None) == carried and (msg["h"]["meta"]["finished"] is None) == carried
            assert [e[4] for e in msg["d"][5]] == ([["hidden"], ["ids"], ["meta", "finished"]] if carried
                                                  else [["hidden"]])
            got = rx.land(f"k{i}", msg)
            lo, hi = rx.pool.ptr, rx.pool.ptr + rx.pool.nbytes
            assert lo <= got["hidden"].data_ptr() < hi
            assert (lo <= got["ids"].data_ptr() < hi) == carried
            assert torch.equal(got["ids"], payload["ids"]) and torch.equal(got["hidden"], payload["hidden"])
            assert bool(got["meta"]["finished"]) == (i == 2) and got["meta"]["chunk"] == i
            del got
        assert ops.staged == (3 if carried else 0)
    finally:
        tx.close()
        rx.close()


def test_a_stream_from_another_gpu_without_mps_is_walked_once_per_payload(monkeypatch):
    """Without MPS, host tensors beside another GPU's device tensors stay in the host part;
    a stream of such payloads walks each once (the first twice), and a payload on the
    pool's own device carries its host tensors in the block again."""
    from omnilink.connectors.devpool import sender as pool_sender

    monkeypatch.setattr(pool_sender, "HOSTS_ACROSS_GPUS", None)
    walks = []
    real = pool_sender.split
    monkeypatch.setattr(pool_sender, "split", lambda *a, **k: walks.append(1) or real(*a, **k))
    where = [1]

    ops, tx, rx = _placed_pair(False, lambda: where[0])
    try:
        for i, dev in enumerate([1, 1, 1, 0, 0, 1, 1]):
            where[0] = dev
            walks.clear()
            payload = {"hidden": torch.randn(64) + i, "ids": torch.arange(16) + i, "meta": {"i": i}}
            msg = _send(tx, f"k{i}", payload, 1 << 10)
            carried = dev == 0
            assert (msg["h"]["ids"] is None) == carried, i
            # two walks where the guess (the payload before's kind) was wrong
            assert len(walks) == (2 if i in (0, 3, 5) else 1), (i, len(walks))
            _lands_as_sent(rx, f"k{i}", msg, payload)
    finally:
        tx.close()
        rx.close()


def test_landing_send_carries_host_tensors_only_while_the_receiver_lands_on_device():
    ops, tx, rx = _pair()
    try:
        for i, landing in enumerate([False, True, False, True]):
            rx.set_landing(landing)
            payload = {"hidden": torch.randn(64), "ids": torch.arange(16) + i}
            msg = _send(tx, f"k{i}", payload, 1 << 10, landing=True)
            assert (msg["h"]["ids"] is None) == landing
            assert [len(e) for e in msg["d"][5]] == ([5, 6] if landing else [5])  # the host mark
            _lands_as_sent(rx, f"k{i}", msg, payload)
    finally:
        tx.close()
        rx.close()


def test_land_to_host_gives_carried_host_tensors_back_as_host_copies():
    ops, tx, rx = _pair()
    try:
        rx.set_landing(True)
        payload = {"hidden": torch.randn(64), "ids": torch.arange(16), "meta": {"done": torch.tensor(True)}}
        msg = _send(tx, "k", payload, 1 << 10, landing=True)
        assert msg["h"]["ids"] is None and msg["h"]["meta"]["done"] is None
        got = rx.land("k", msg, to_host=True)
        lo, hi = rx.pool.ptr, rx.pool.ptr + rx.pool.nbytes
        assert lo <= got["hidden"].data_ptr() < hi  # device tensors stay views of the pool
        for t in (got["ids"], got["meta"]["done"]):
            assert not lo <= t.data_ptr() < hi  # copies of their own
        assert torch.equal(got["ids"], payload["ids"]) and bool(got["meta"]["done"])
        assert got["meta"]["done"].shape == () and got["ids"].dtype == torch.int64
        del got
    finally:
        tx.close()
        rx.close()


class _HostOnlyCudaIpc(HostCudaIpc):
    @staticmethod
    def _make_ops():
        return HostOnlyOps()


def test_cuda_ipc_get_with_a_device_makes_the_sender_carry_host_tensors_and_get_without_gives_host_ones():
    ch = f"h2p-c-{uuid.uuid4().hex[:8]}"
    rx = _HostOnlyCudaIpc(channel=ch, role="receiver", pool_bytes=4 << 20, event_slots=4)
    tx = _HostOnlyCudaIpc(channel=ch, role="sender", linger=0)
    try:
        def payload(i):
            return {"hidden": torch.randn(64) + i, "ids": torch.arange(16) + i}

        def in_pool(t):
            pool = rx._receiver.pool
            return pool.ptr <= t.data_ptr() < pool.ptr + pool.nbytes

        sent = {i: payload(i) for i in range(4)}
        tx.put("k0", sent[0], timeout=5)  # sent before the receiver said anything
        got = rx.get("k0", timeout=5, device="cpu")  # landing from now on
        assert not in_pool(got["ids"]) and tx._ops.staged == 0
        tx.put("k1", sent[1], timeout=5)
        got = rx.get("k1", timeout=5, device="cpu")
        assert in_pool(got["ids"]) and in_pool(got["hidden"]) and tx._ops.staged == 1
        tx.put("k2", sent[2], timeout=5)  # still carried: the receiver's last get landed
        got2 = rx.get("k2", timeout=5)  # no device: the carried host tensor comes back a host copy
        assert not in_pool(got2["ids"]) and in_pool(got2["hidden"]) and tx._ops.staged == 2
        tx.put("k3", sent[3], timeout=5)
        got3 = rx.get("k3", timeout=5)
        assert not in_pool(got3["ids"]) and tx._ops.staged == 2  # not carried any more
        for i, g in ((1, got), (2, got2), (3, got3)):
            assert torch.equal(g["ids"], sent[i]["ids"]) and torch.equal(g["hidden"], sent[i]["hidden"])
        del got, got2, got3
    finally:
        tx.close()
        rx.close()


def test_the_all_in_block_mark_says_whether_the_host_part_kept_a_tensor():
    ops, tx, rx = _pair()
    try:
        for i, (payload, most, mark) in enumerate([
            ({"hidden": torch.randn(64), "ids": torch.arange(16)}, 1 << 10, True),  # ids carried
            ({"hidden": torch.randn(64), "ids": torch.arange(16)}, 0, False),  # ids left behind
            ({"hidden": torch.randn(64), "meta": {"n": 3, "s": "x"}}, 0, True),  # no host tensor
            ({"hidden": torch.randn(64), "big": torch.arange(4096)}, 1 << 10, False),  # over the bound
        ]):
            msg = _send(tx, f"k{i}", payload, most)
            assert (len(msg["d"]) == 7) == mark
            pooled = [None, None]
            got = rx.land(f"k{i}", msg, pooled=pooled)
            assert pooled[0] == mark and pooled[1] == encoded_size(payload)
            del got
    finally:
        tx.close()
        rx.close()


def test_cuda_ipc_skips_the_move_to_the_pool_device_when_every_tensor_is_in_the_block(monkeypatch):
    import omnilink.cuda

    moved = []
    monkeypatch.setattr(omnilink.cuda, "payload_to_device", lambda obj, device: moved.append(device) or obj)
    ch = f"h2p-p-{uuid.uuid4().hex[:8]}"
    rx = _HostOnlyCudaIpc(channel=ch, role="receiver", pool_bytes=4 << 20, event_slots=4)
    tx = _HostOnlyCudaIpc(channel=ch, role="sender", linger=0)
    try:
        assert [rx._is_pool_device(d) for d in ("cuda:0", "cuda:1", "cuda", "cpu", torch.device("cuda", 0))] == \
            [True, False, False, False, True]
        tx.put("k0", {"hidden": torch.randn(64), "ids": torch.arange(16)}, timeout=5)
        rx.get("k0", timeout=5, device="cuda:0")  # sent before it said so: ids in the host part
        assert moved == ["cuda:0"]
        tx.put("k1", {"hidden": torch.randn(64), "ids": torch.arange(16)}, timeout=5)
        got = rx.get("k1", timeout=5, device="cuda:0")  # all in the block, on the pool's device
        assert moved == ["cuda:0"] and torch.equal(got["ids"], torch.arange(16))
        tx.put("k2", {"hidden": torch.randn(64), "big": torch.arange(1 << 14)}, timeout=5)
        rx.get("k2", timeout=5, device="cuda:0")  # a host tensor too large for the block
        tx.put("k3", {"hidden": torch.randn(64)}, timeout=5)
        rx.get("k3", timeout=5, device="cuda:1")  # another device
        assert moved == ["cuda:0", "cuda:0", "cuda:1"]
        del got
    finally:
        tx.close()
        rx.close()


def test_carried_host_tensors_come_back_as_host_copies_after_the_sender_closed_cleanly():
    # A clean close tells readers the copies are done (no event to wait on): the host
    # copies of carried tensors are made without one (they once asked the stream to wait
    # on a missing event).
    ops, tx, rx = _pair()
    try:
        rx.set_landing(True)
        payload = {"hidden": torch.randn(64), "ids": torch.arange(16)}
        msg = _send(tx, "k", payload, 1 << 10, landing=True)
        tx.close()
        got = rx.land("k", msg, to_host=True)
        lo, hi = rx.pool.ptr, rx.pool.ptr + rx.pool.nbytes
        assert not lo <= got["ids"].data_ptr() < hi and torch.equal(got["ids"], payload["ids"])
        assert torch.equal(got["hidden"], payload["hidden"])
        del got
    finally:
        tx.close()
        rx.close()


def test_slot_stages_are_slices_of_one_arena_and_a_larger_span_gets_its_own(monkeypatch):
    from omnilink.connectors.devpool import sender as sender_mod

    monkeypatch.setattr(sender_mod, "STAGE_SLICE_BYTES", 1 << 10)
    ops, tx, rx = _pair()
    new_stage = []
    real = ops.new_stage
    monkeypatch.setattr(ops, "new_stage", lambda n: new_stage.append(n) or real(n))
    try:
        for i in range(4):  # one payload per slot, each within a slice
            got = rx.land(f"k{i}", _send(tx, f"k{i}", {"h": torch.randn(8), "ids": torch.arange(16) + i}, 8 << 10))
            assert torch.equal(got["ids"], torch.arange(16) + i)
            del got
        assert new_stage == [4 * (1 << 10)]  # one arena for the four slots, nothing per slot
        arena = tx.tx.stage_arena
        stages = [tx.tx.stages[s] for s in range(4)]
        assert all(st.obj is arena and len(st) == 1 << 10 for st in stages)
        base = ctypes.addressof((ctypes.c_char * len(arena)).from_buffer(arena))
        at = [ctypes.addressof((ctypes.c_char * len(st)).from_buffer(st)) - base for st in stages]
        assert at == [s * (1 << 10) for s in range(4)]  # slot s: the s-th slice
        # Two kilobytes of host tensors: more than a slice, a stage of the slot's own.
        big = torch.arange(256) + 7
        got = rx.land("big", _send(tx, "big", {"h": torch.randn(8), "ids": big}, 8 << 10))
        assert torch.equal(got["ids"], big)
        del got
        assert new_stage == [4 * (1 << 10), 64 << 10]
    finally:
        tx.close()
        rx.close()
    assert tx.tx is None or tx.tx.stage_arena is None


def test_plain_reads_a_plain_tensor_as_it_is_and_resolves_every_bit_it_must():
    from omnilink._util import plain_tensor as _plain

    a = torch.randn(3, requires_grad=True)  # read as it is: the copy only reads memory
    assert _plain(a) is a
    c = torch.randn(4, dtype=torch.complex64)
    conj = c.conj()
    assert conj.is_conj()
    got = _plain(conj)
    assert not got.is_conj() and torch.equal(got, c.conj().resolve_conj())
    neg = torch._neg_view(torch.arange(4.0))  # a contiguous real tensor with the negative bit
    assert neg.is_neg() and neg.is_contiguous()
    got = _plain(neg)
    assert not got.is_neg() and torch.equal(got, -torch.arange(4.0))
    strided = torch.arange(10.0)[::2]
    got = _plain(strided)
    assert got.is_contiguous() and torch.equal(got, strided)
    imag = conj.imag  # real, negative bit, not contiguous
    got = _plain(imag)
    assert not got.is_neg() and got.is_contiguous() and torch.equal(got, -c.imag)


def test_conjugate_and_negative_views_arrive_resolved():
    ops, tx, rx = _pair()
    try:
        c = torch.randn(6, dtype=torch.complex64)
        payload = {"conj": c.conj(), "neg": torch._neg_view(torch.arange(5.0)), "ids": torch.arange(3)}
        got = rx.land("k", _send(tx, "k", payload, 1 << 10))
        assert torch.equal(got["conj"], c.conj().resolve_conj()) and not got["conj"].is_conj()
        assert torch.equal(got["neg"], -torch.arange(5.0)) and torch.equal(got["ids"], torch.arange(3))
        del got
    finally:
        tx.close()
        rx.close()
