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


def test_small_cpu_tensors_go_in_one_copy_without_blocking_the_host():
    """Small CPU tensors are packed and copied with one asynchronous copy on the current
    stream: the host does not wait for the stream (still busy with a long kernel when
    the call returns), and the tensors are right once the stream has run; a large one and
    one that requires grad come out right too."""
    grad = torch.ones(4, requires_grad=True)
    sent = {"ids": torch.arange(16, dtype=torch.int64), "flag": torch.tensor(False), "grad": grad,
            "i8": torch.tensor([-1, 2, -3], dtype=torch.int8)}
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time on the current stream
    got = payload_to_device(sent, "cuda")
    assert not torch.cuda.current_stream().query()  # the host did not wait for the stream
    ptrs = sorted(got[k].data_ptr() for k in ("ids", "flag", "grad", "i8"))
    assert ptrs[-1] - ptrs[0] < 4096  # one device buffer
    torch.cuda.synchronize()
    assert not got["grad"].requires_grad
    _check(got, {k: (v.detach() if v.requires_grad else v) for k, v in sent.items()})
    # A large one beside a small one: copied on its own, both right.
    big = torch.arange(1 << 17, dtype=torch.float32)  # 512 KiB: past the small ones' bound
    _check(payload_to_device({"big": big, "ids": sent["ids"]}, "cuda"), {"big": big, "ids": sent["ids"]})


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
