"""``get(device=)`` moves every tensor of a payload to the device, on every road
(``payload_to_device``): the shm connector's device-IPC route moves the CPU tensors too
(it used to leave them in host memory). Skipped with a reason on a machine without
CUDA."""

from __future__ import annotations

import uuid

import pytest

torch = pytest.importorskip("torch")

import omnilink  # noqa: E402
from omnilink.connectors import backend_unavailable  # noqa: E402
from omnilink.cuda import payload_to_device  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is present")]


def _payload():
    nc = torch.arange(12, dtype=torch.float16).reshape(3, 4).t()  # not contiguous
    return {"ids": torch.arange(16, dtype=torch.int64), "finished": torch.tensor(True),
            "half": nc, "empty": torch.zeros(0, 5), "same": None, "list": [torch.ones(3, dtype=torch.bfloat16), 7],
            "tup": (torch.tensor([1.5, 2.5], dtype=torch.float64), "x"), "gpu": torch.arange(5, device="cuda"),
            "meta": {"request_id": "r", "n": torch.tensor(3, dtype=torch.int32)}}


def _check(got, sent):
    flat_got, flat_sent = [], []

    def walk(a, b):
        if isinstance(b, torch.Tensor):
            flat_got.append(a)
            flat_sent.append(b)
        elif isinstance(b, dict):
            assert set(a) == set(b)
            for k in b:
                walk(a[k], b[k])
        elif isinstance(b, (list, tuple)):
            assert type(a) is type(b) and len(a) == len(b)
            for x, y in zip(a, b):
                walk(x, y)
        else:
            assert a == b

    walk(got, sent)
    for a, b in zip(flat_got, flat_sent):
        assert a.is_cuda and a.dtype == b.dtype and a.shape == b.shape, (a, b)
        assert torch.equal(a.cpu(), b.cpu())


def test_every_tensor_lands_equal():
    sent = _payload()
    sent["alias"] = sent["ids"]  # one tensor twice: both places get the same data
    got = payload_to_device(sent, "cuda")
    _check(got, sent)
    assert got["gpu"] is sent["gpu"]  # already there: kept as it is
    # The source may change right after: the copy no longer reads it.
    sent["ids"].fill_(-1)
    torch.cuda.synchronize()
    assert int(got["ids"][3]) == 3


@pytest.mark.skipif(backend_unavailable("cuda_ipc") is not None, reason="the cuda_ipc backend is unavailable")
def test_shm_device_ipc_route_moves_cpu_tensors_too():
    ch = f"t/p2d-{uuid.uuid4().hex[:8]}"
    with omnilink.connect("shm", channel=ch, role="receiver", device_ipc="on", ipc_device="cuda:0") as rx, \
            omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="on") as tx:
        sent = _payload()
        tx.put("k", sent, timeout=10)
        got = rx.get("k", timeout=10, device="cuda:0")
        assert tx.stats().ipc_puts == 1
        _check(got, sent)
