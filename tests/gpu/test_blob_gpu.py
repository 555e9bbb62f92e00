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
