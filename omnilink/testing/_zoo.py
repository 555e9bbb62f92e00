"""The payload zoo and the bit-for-bit payload comparison of the conformance suite."""

from __future__ import annotations

import math
import struct
import warnings
from typing import Any

__all__ = ["ConformanceError", "assert_payload_equal", "payload_zoo"]


class ConformanceError(AssertionError):
    """A connector (or a payload) does not behave as the omnilink contract says.

    The message names the check that failed and what was wrong. ``failures`` maps each
    failed check's name to its message (one entry when a single check ran).
    """

    def __init__(self, message: str, *, failures: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[str, str] = dict(failures or {})


# dtype names the zoo carries when this torch has them (float8 and wide unsigned types
# arrived in later torch releases).
_TORCH_DTYPES = (
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "complex32",
    "complex64",
    "complex128",
    "float4_e2m1fn_x2",
)
# dtypes torch can hardly compute with: built from raw bits.
_RAW_BITS_DTYPES = ("complex32", "float4_e2m1fn_x2")


def _torch_dtype_tensor(torch: Any, name: str, gen: Any) -> Any:
    """A 3x5 tensor of dtype ``name`` with edge values (NaN, inf, -0.0, extremes)."""
    dtype = getattr(torch, name)
    if name in _RAW_BITS_DTYPES:
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (3, 5 * itemsize), dtype=torch.uint8, generator=gen)
        return raw.view(dtype).clone()
    if dtype is torch.bool:
        return torch.randint(0, 2, (3, 5), generator=gen).bool()
    if dtype.is_complex:
        t = torch.randn(3, 5, dtype=dtype, generator=gen)
        t[0, 0] = complex(math.nan, -0.0)
        t[0, 1] = complex(math.inf, -math.inf)
        return t
    if dtype.is_floating_point:
        t = torch.randn(3, 5, generator=gen, dtype=torch.float32) * 4
        if name == "float8_e8m0fnu":
            # e8m0 holds only powers of two (and NaN); keep values in range.
            t = t.abs() + 0.25
        t = t.to(dtype)
        special = [math.nan, math.inf, -math.inf, -0.0]
        if name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz"):
            special = [math.nan]  # these formats have no infinities (fnuz: no -0 either)
        elif name == "float8_e8m0fnu":
            special = [math.nan]
        for i, value in enumerate(special):
            t.view(-1)[i] = value
        return t
    # Integers: draw raw bits so every unsigned width reaches its top half, and put the
    # extreme values in the first row.
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (3, 5 * itemsize), dtype=torch.uint8, generator=gen)
    t = raw.view(dtype).clone()
    info = torch.iinfo(dtype) if name not in ("uint16", "uint32", "uint64") else None
    if info is not None:
        t[0, 0] = info.min
        t[0, 1] = info.max
    else:
        t.view(-1)[:2].view(torch.uint8).fill_(0)
        t.view(-1)[1:2].view(torch.uint8).fill_(0xFF)
    return t


def payload_zoo() -> dict[str, Any]:
    """Payloads covering the whole tensor_blob format, by name.

    Every call builds fresh objects with the same content (a fixed random seed), so a
    check may mutate one and compare against another call's copy. Names are stable;
    entries are added, never renamed. The zoo holds: plain values (None, bool, int at
    the 64-bit limits, float specials, str, bytes), nested dicts, lists and tuples
    (tuples must stay tuples), torch tensors of every dtype this torch has among
    bfloat16, float16/32/64, the float8 variants, float4_e2m1fn_x2, int8..int64,
    uint8..uint64, bool and complex32/64/128 (with NaN, inf and -0.0 where the dtype
    has them), 0-d, empty and non-contiguous tensors (transposed, strided, expanded,
    offset into their storage, channels-last, a lazy conjugate view), numpy arrays and
    scalars (kept numpy) and payloads shaped like vLLM-Omni's stage hand-offs
    (``hidden_states.output``, ``codes.audio``, ``meta.finished`` and plain metadata).

    Returns
    -------
    dict[str, Any]
        Zoo entry name -> payload.
    """
    import numpy as np
    import torch

    gen = torch.Generator().manual_seed(20240607)
    rng = np.random.default_rng(20240607)
    zoo: dict[str, Any] = {}

    # ---- plain values and containers
    zoo["plain.none"] = None
    zoo["plain.scalars"] = {
        "true": True,
        "false": False,
        "zero": 0,
        "int64_min": -(2**63),
        "int64_max": 2**63 - 1,
        "uint64_max": 2**64 - 1,
        "float": 0.1,
        "neg_zero": -0.0,
        "nan": math.nan,
        "inf": math.inf,
        "ninf": -math.inf,
        "tiny": 5e-324,
        "huge": 1.7976931348623157e308,
        "str": "talker \u2192 code2wav \U0001f50a",
        "str_nul": "a\x00b",
        "empty_str": "",
        "bytes": bytes(range(256)),
        "empty_bytes": b"",
        "none": None,
    }
    zoo["plain.containers"] = {
        "tuple": (1, "two", 3.0, None),
        "empty_tuple": (),
        "one_tuple": (7,),
        "list": [1, [2, [3, [4, []]]]],
        "tuple_in_list": [(1, 2), [3, (4, (5,))]],
        "list_in_tuple": ([1, 2], {"k": (3,)}),
        "empty_dict": {},
        "empty_list": [],
        "unicode.keys": {"\u00e9t\u00e9": 1, "with space": 2, "": 3, "dotted.key.name": 4},
    }
    deep: Any = {"leaf": (1, [2.5, "x"])}
    for level in range(24):
        deep = {f"level{level}": deep} if level % 2 else [deep]
    zoo["plain.deep"] = deep
    zoo["plain.top_level_list"] = [1, "a", None, (2,)]
    zoo["plain.top_level_tuple"] = ("a", ("b", ("c",)))

    # ---- torch tensors, one per dtype
    with warnings.catch_warnings():
        # torch calls complex32 "experimental" on every allocation; the zoo means it.
        warnings.simplefilter("ignore", UserWarning)
        for name in _TORCH_DTYPES:
            if hasattr(torch, name):
                zoo[f"tensor.{name}"] = {"t": _torch_dtype_tensor(torch, name, gen)}

    # ---- torch tensor shapes and layouts
    base = torch.randn(6, 10, generator=gen)
    zoo["tensor.top_level"] = torch.randn(4, 3, generator=gen).to(torch.bfloat16)
    zoo["tensor.0d"] = {
        "f32": torch.tensor(3.25),
        "bool": torch.tensor(True),
        "i64": torch.tensor(-(2**63), dtype=torch.int64),
        "bf16": torch.tensor(-0.0, dtype=torch.bfloat16),
    }
    zoo["tensor.empty"] = {
        "1d": torch.empty(0),
        "2d_rows": torch.empty(0, 4, dtype=torch.bfloat16),
        "2d_cols": torch.empty(3, 0, dtype=torch.int64),
        "3d": torch.empty(2, 0, 3, dtype=torch.bool),
    }
    zoo["tensor.noncontiguous"] = {
        "transposed": base.t(),
        "strided_slice": base[:, ::3],
        "step_rows": base[::2],
        "offset_view": base.view(-1)[7:19],
        "expanded": torch.arange(3, dtype=torch.int32).expand(4, 3),
        "channels_last": torch.randn(2, 3, 4, 5, generator=gen).to(memory_format=torch.channels_last),
        "permuted_bf16": torch.randn(2, 3, 4, generator=gen).to(torch.bfloat16).permute(2, 0, 1),
        "conj_view": torch.randn(3, 4, dtype=torch.complex64, generator=gen).conj(),
    }
    zoo["tensor.many_dims"] = torch.arange(2 * 3 * 1 * 2 * 1 * 2 * 1 * 2, dtype=torch.float64).reshape(
        2, 3, 1, 2, 1, 2, 1, 2
    )
    zoo["tensor.requires_grad"] = {"w": torch.randn(3, 3, generator=gen, requires_grad=True)}
    zoo["tensor.shared_storage"] = {"a": base[0], "b": base[0], "c": base[1:3]}

    # ---- numpy arrays (must come back as numpy, not torch)
    zoo["numpy.dtypes"] = {
        "bool": rng.integers(0, 2, size=(4, 3)).astype(np.bool_),
        "float16": np.array([0.5, -0.0, np.nan, np.inf, -np.inf, 65504.0], dtype=np.float16),
        "complex64": (rng.standard_normal(5) + 1j * rng.standard_normal(5)).astype(np.complex64),
        "int64": np.array([np.iinfo(np.int64).min, -1, 0, 1, np.iinfo(np.int64).max], dtype=np.int64),
        "float32": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "uint8": rng.integers(0, 256, size=17).astype(np.uint8),
    }
    zoo["numpy.shapes"] = {
        "0d": np.array(2.5, dtype=np.float64),
        "empty": np.empty((0, 3), dtype=np.int32),
        "transposed": rng.standard_normal((3, 5)).T,
        "strided": np.arange(40, dtype=np.int16)[::4],
    }
    zoo["numpy.scalars"] = {
        "float32": np.float32(1.5),
        "int64": np.int64(-(2**63)),
        "bool": np.bool_(True),
        "float16_nan": np.float16("nan"),
        "complex128": np.complex128(1 - 2j),
    }
    zoo["mixed.torch_and_numpy"] = {
        "t": torch.arange(6, dtype=torch.int64),
        "a": np.arange(6, dtype=np.int64),
        "list": [torch.ones(2), np.zeros(2, dtype=np.float32), (torch.tensor(1), "x")],
    }

    # ---- vLLM-Omni shaped hand-offs (the stage payloads omnilink.integrations.vllm_omni lists)
    zoo["vllm.thinker_to_talker"] = {
        "hidden_states.output": torch.randn(7, 64, generator=gen).to(torch.bfloat16),
        "hidden_states.output_shape": torch.tensor([7, 64], dtype=torch.int64),
        "embed.prefill": torch.randn(5, 64, generator=gen).to(torch.bfloat16),
        "ids.prompt": torch.randint(0, 151_000, (5,), generator=gen, dtype=torch.int64),
        "ids.output": torch.randint(0, 151_000, (2,), generator=gen, dtype=torch.int64),
        "speaker": "Chelsie",
        "language": "en",
    }
    zoo["vllm.talker_to_code2wav"] = {
        # 16 codebooks x 25 frames, codebook-major flattened
        "codes.audio": torch.randint(0, 4096, (16 * 25,), generator=gen, dtype=torch.int64),
        "meta.finished": torch.tensor(False),
        "meta.left_context_size": 25,
    }
    zoo["vllm.finish_only"] = {
        "codes.audio": torch.empty(0, dtype=torch.int64),
        "meta.finished": torch.tensor(True),
    }
    zoo["vllm.nested_meta"] = {
        "codes": {"audio": torch.randint(0, 4096, (32,), generator=gen, dtype=torch.int64)},
        "meta": {"finished": torch.tensor(True), "left_context_size": 0, "chunk_id": 3},
    }
    zoo["vllm.cosyvoice3"] = {
        "embed.speech_token": torch.randint(0, 6561, (1, 50), generator=gen, dtype=torch.int64),
        "embed.speech_feat": torch.randn(1, 50, 80, generator=gen),
        "embed.embedding": torch.randn(1, 192, generator=gen),
        "speaker": None,
    }
    return zoo


# ---------------------------------------------------------------------------- equality


def _fail(path: str, what: str) -> ConformanceError:
    return ConformanceError(f"{path}: {what}")


def _tensor_bits(torch: Any, t: Any) -> Any:
    """The tensor's logical contents as a flat uint8 tensor on the CPU."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.view(torch.uint8)


def assert_payload_equal(expected: Any, actual: Any, /, *, path: str = "payload") -> None:
    """Assert that ``actual`` is ``expected`` after a round trip, bit for bit.

    Types must match exactly (a tuple is not a list, ``True`` is not ``1``, a numpy
    array is not a tensor), dict keys must match in order, floats compare by their bits
    (NaN equals the same NaN, ``-0.0`` differs from ``0.0``), tensors and arrays by
    dtype, shape and the bytes of their elements. Strides, ``requires_grad`` and the
    device are not compared: a decoded tensor is a contiguous host view.

    Parameters
    ----------
    expected, actual : Any
        The payload that was sent and the one received.
    path : str, optional
        Name of the root in error messages.

    Raises
    ------
    ConformanceError
        The payloads differ; the message names the path of the first difference.
    """
    if type(expected) is not type(actual):
        raise _fail(path, f"type {type(actual).__name__}, expected {type(expected).__name__}")
    if isinstance(expected, dict):
        if list(expected) != list(actual):
            missing = [k for k in expected if k not in actual]
            extra = [k for k in actual if k not in expected]
            raise _fail(
                path,
                f"dict keys differ (missing {missing!r}, unexpected {extra!r}, "
                f"order {list(actual)!r} vs {list(expected)!r})",
            )
        for k in expected:
            assert_payload_equal(expected[k], actual[k], path=f"{path}[{k!r}]")
        return
    if isinstance(expected, (list, tuple)):
        if len(expected) != len(actual):
            raise _fail(path, f"length {len(actual)}, expected {len(expected)}")
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_payload_equal(e, a, path=f"{path}[{i}]")
        return
    if isinstance(expected, float):
        if struct.pack("<d", expected) != struct.pack("<d", actual):
            raise _fail(path, f"float {actual!r}, expected {expected!r} (compared bit for bit)")
        return
    if expected is None or isinstance(expected, (bool, int, str, bytes)):
        if expected != actual:
            raise _fail(path, f"{_short(actual)}, expected {_short(expected)}")
        return
    mod = type(expected).__module__.split(".")[0]
    if mod == "torch":
        import torch

        if isinstance(expected, torch.Tensor):
            if expected.dtype != actual.dtype:
                raise _fail(path, f"tensor dtype {actual.dtype}, expected {expected.dtype}")
            if tuple(expected.shape) != tuple(actual.shape):
                raise _fail(path, f"tensor shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
            eb, ab = _tensor_bits(torch, expected), _tensor_bits(torch, actual)
            if not torch.equal(eb, ab):
                first = int((eb != ab).nonzero()[0, 0]) // max(1, expected.element_size())
                raise _fail(
                    path,
                    f"tensor of {expected.dtype} differs from element {first} on "
                    f"(flat index; compared bit for bit)",
                )
            return
    if mod == "numpy":
        import numpy as np

        if isinstance(expected, np.generic):
            if expected.dtype != actual.dtype or expected.tobytes() != actual.tobytes():
                raise _fail(path, f"numpy scalar {actual!r} ({actual.dtype}), expected {expected!r} "
                            f"({expected.dtype}), compared bit for bit")
            return
        if isinstance(expected, np.ndarray):
            if expected.dtype != actual.dtype:
                raise _fail(path, f"array dtype {actual.dtype}, expected {expected.dtype}")
            if expected.shape != actual.shape:
                raise _fail(path, f"array shape {actual.shape}, expected {expected.shape}")
            if expected.tobytes() != actual.tobytes():
                raise _fail(path, f"array of {expected.dtype} differs (compared bit for bit)")
            return
    if expected != actual:
        raise _fail(path, f"{_short(actual)}, expected {_short(expected)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
