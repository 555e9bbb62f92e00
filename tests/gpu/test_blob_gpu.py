"""tensor_blob with CUDA tensors: encoding copies them to host exactly, and a payload
received through the memory backend can be moved back to the GPU by ``get(device=)``."""

from __future__ import annotations

import pytest

import omnilink

torch = pytest.importorskip("torch")

DTYPES = ["bfloat16", "float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bool",
          "complex64", "float8_e4m3fn"]


def _tensor(name: str, g) -> "torch.Tensor":
    dtype = getattr(torch, name)
    if dtype is torch.bool:
        return torch.randint(0, 2, (5, 7), generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(5, 7, generator=g, dtype=torch.complex64 if dtype.is_complex else torch.float32).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, (5, 7), generator=g).to(dtype)


def _cpu_payload() -> dict:
    g = torch.Generator().manual_seed(5)
    payload = {name: _tensor(name, g) for name in DTYPES if hasattr(torch, name)}
    payload["strided"] = torch.randn(16, 9, generator=g).to(torch.bfloat16).t()
    payload["scalar"] = torch.tensor(3.5)
    payload["empty"] = torch.empty(0, 4, dtype=torch.bfloat16)
    payload["meta"] = {"finished": True, "shape": (5, 7)}
    return payload


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _bits(t):
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t


@pytest.mark.gpu
def test_encode_cuda_equals_encode_cpu():
    cpu = _cpu_payload()
    cuda = _to(cpu, "cuda:0")
    assert omnilink.encode(cuda) == omnilink.encode(cpu)
    n = omnilink.encoded_size(cuda)
    assert n == omnilink.encoded_size(cpu)
    buf = bytearray(n + 64)
    assert omnilink.encode_into(cuda, buf) == n
    assert bytes(buf[:n]) == omnilink.encode(cpu)


@pytest.mark.gpu
def test_memory_backend_get_to_cuda():
    cpu = _cpu_payload()
    cuda = _to(cpu, "cuda:0")
    with omnilink.connect("memory", channel="gpu/blob", role="dual") as conn:
        conn.put("k", cuda, timeout=10.0)
        got = conn.get("k", timeout=10.0, device="cuda:0")
    for name, ref in cpu.items():
        if isinstance(ref, torch.Tensor):
            t = got[name]
            assert t.device == torch.device("cuda:0"), name
            assert t.dtype == ref.dtype and t.shape == ref.shape, name
            assert torch.equal(_bits(t), _bits(ref)), name
    assert got["meta"] == cpu["meta"]


@pytest.mark.gpu
def test_encode_parts_stages_cuda_tensors_after_the_queued_work():
    # encode_parts (zmq's frames) copies CUDA tensors to the host after the work queued
    # on the current stream: a tensor still being written by queued kernels must arrive
    # as written, a strided one gathered, every dtype bit-exact.
    from omnilink.blob import decode_parts, encode_parts

    cpu = _cpu_payload()
    cuda = _to(cpu, "cuda:0")
    a = torch.randn(2048, 2048, device="cuda")
    x = torch.zeros(1 << 20, device="cuda")
    for _ in range(20):
        a = a @ a / 2048.0  # queue work, then a write behind it
    x.add_(7.0)
    cuda["late"] = x
    cuda["strided_cuda"] = torch.arange(64, device="cuda", dtype=torch.float32).reshape(8, 8).t()
    meta, regions = encode_parts(cuda)
    got = decode_parts(meta, [bytearray(r) for r in regions])
    assert float(got["late"].min()) == 7.0 == float(got["late"].max())
    assert torch.equal(got["strided_cuda"], torch.arange(64, dtype=torch.float32).reshape(8, 8).t())
    for name, ref in cpu.items():
        if isinstance(ref, torch.Tensor):
            assert torch.equal(_bits(got[name]), _bits(ref)), name


@pytest.mark.gpu
def test_zmq_puts_cuda_payloads_and_lands_them_on_the_device(ipc_dir):
    cpu = _cpu_payload()
    cuda = _to(cpu, "cuda:0")
    cuda["big"] = torch.randn(1 << 20, device="cuda")  # 4 MiB: by reference on ipc://
    with omnilink.connect("zmq", channel="gpu/zmq", role="receiver", ipc_dir=ipc_dir) as rx, \
            omnilink.connect("zmq", channel="gpu/zmq", role="sender", ipc_dir=ipc_dir) as tx:
        for i in range(3):
            tx.put(f"k{i}", cuda, timeout=30.0)
            got = rx.get(f"k{i}", timeout=30.0, device="cuda:0")
            assert got["big"].is_cuda and torch.equal(got["big"], cuda["big"])
            for name, ref in cpu.items():
                if isinstance(ref, torch.Tensor):
                    assert got[name].device == torch.device("cuda:0"), name
                    assert torch.equal(_bits(got[name]), _bits(ref)), name
            assert got["meta"] == cpu["meta"]
