"""``PoolSender.send(host_to_pool=N)``: small host tensors ride in the pool block after
the device ones (gathered in a per-slot stage, one copy), so the receiver finds them as
views of its pool; larger host tensors stay in the host part. Over the host double, with
int64 and bool tensors standing for host tensors (everything else for device ones)."""

from __future__ import annotations

import uuid

import pytest

torch = pytest.importorskip("torch")

from omnilink._util import Deadline  # noqa: E402
from omnilink.connectors.devpool import PoolReceiver, PoolSender  # noqa: E402
from tests.cuda_ipc_double import HostDeviceOps  # noqa: E402

HOSTLIKE = (torch.int64, torch.bool)


class HostOnlyOps(HostDeviceOps):
    """Int64 and bool tensors are host tensors; small ones may go to the pool."""

    def is_device_tensor(self, t):
        return t.dtype not in HOSTLIKE

    def is_small_host_tensor(self, t, most):
        return t.dtype in HOSTLIKE and t.numel() * t.element_size() <= most


def _pair():
    ch = f"h2p-{uuid.uuid4().hex[:8]}"
    ops = HostOnlyOps()
    rx = PoolReceiver(ops, ch, device=None, pool_bytes=4 << 20, event_slots=4, max_blocks=64)
    tx = PoolSender(ops, ch)
    return ops, tx, rx


def _send(tx, key, payload, most):
    sent = []
    tx.send(key, payload, Deadline(5.0), None, sent.append, host_to_pool=most)
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
