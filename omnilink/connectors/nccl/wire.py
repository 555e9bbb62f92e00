"""What the ``nccl`` backend puts on its side channel, and how it rebuilds a payload.

The header of a payload never travels with its tensor bytes. It is a small msgpack
*envelope* written to the torch.distributed store; the bytes travel by point-to-point
``send``/``recv`` of the process group. The envelope embeds the payload's tensor_blob
``meta`` (prefix + ``BlobHeader``: descriptors and payload tree, see ``omnilink.blob``),
made by ``omnilink.blob.prepare`` without copying a single tensor byte, so the nccl
backend speaks the project's one wire format for everything but the data region::

    store key  <channel-prefix>/<src>to<dst>/h/<seq>
    value      msgpack array  [seq, key, meta, plan, inline]
                 seq     u64    position in the sender's stream (0, 1, 2, ...)
                 key     str    the payload's key
                 meta    bytes  tensor_blob prefix + header (tensor i = descriptor i)
                 plan    [u8]   how tensor i travels, one code per descriptor:
                                  0 EMPTY   no bytes (numel == 0)
                                  1 P2P     its own send/recv, straight into a tensor
                                            on the receiver's device
                                  2 STAGED  host data on an nccl link: copied to the
                                            sender's device, sent, copied back to host
                                  3 INLINE  small host data carried in ``inline``
                 inline  [bytes] the INLINE tensors' bytes, in descriptor order

The receiver posts one ``recv`` per P2P/STAGED descriptor, in descriptor order, right
after reading the envelope; the sender posts the matching ``send``s right after writing
it, so both ends issue the operations in the same order (what NCCL requires).
"""

from __future__ import annotations

import warnings
from typing import Any

import msgspec

from omnilink import blob
from omnilink._errors import BlobDecodeError, ConfigurationError

__all__ = [
    "EMPTY",
    "INLINE",
    "P2P",
    "STAGED",
    "Envelope",
    "Hello",
    "SendPlan",
    "build_views",
    "check_sizes",
    "decode_envelope",
    "decode_hello",
    "decode_tree",
    "encode_envelope",
    "encode_hello",
    "parse_meta",
    "plan_send",
]

EMPTY, P2P, STAGED, INLINE = 0, 1, 2, 3
_PLAN_NAMES = {EMPTY: "EMPTY", P2P: "P2P", STAGED: "STAGED", INLINE: "INLINE"}

#: Version of this side-channel protocol; both ends must speak the same one.
PROTOCOL = 1


class Envelope(msgspec.Struct, array_like=True, frozen=True):
    """The side-channel record of one payload (see the module docstring)."""

    seq: int
    key: str
    meta: bytes
    plan: list[int]
    inline: list[bytes]


class Hello(msgspec.Struct, frozen=True, kw_only=True):
    """What each end publishes about itself before the link is built."""

    protocol: int
    rank: int
    world_size: int
    role: str
    backend: str
    device_type: str
    host: str
    pid: int
    token: str
    send_window: int
    #: Largest payload (bytes) this end accepts as a receiver; ``None``: no limit stated.
    max_message_bytes: int | None = None


_ENV_ENCODER = msgspec.msgpack.Encoder()
_ENV_DECODER = msgspec.msgpack.Decoder(Envelope)
_HELLO_DECODER = msgspec.msgpack.Decoder(Hello)


def encode_hello(hello: Hello) -> bytes:
    return _ENV_ENCODER.encode(hello)


def decode_hello(raw: bytes) -> Hello:
    """Decode the peer's hello.

    Raises
    ------
    BlobDecodeError
        The bytes are not a hello of this protocol.
    """
    try:
        return _HELLO_DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise BlobDecodeError(f"nccl: malformed hello on the side channel: {exc}") from exc


def encode_envelope(env: Envelope) -> bytes:
    return _ENV_ENCODER.encode(env)


def decode_envelope(raw: bytes) -> Envelope:
    """Decode an envelope read from the store.

    Raises
    ------
    BlobDecodeError
        The bytes are not an envelope of this protocol.
    """
    try:
        return _ENV_DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise BlobDecodeError(f"nccl: malformed side-channel envelope: {exc}") from exc


class SendPlan:
    """The sender's view of one payload: envelope fields plus the tensors to send.

    Attributes
    ----------
    plan : list[int]
        One transport code per tensor_blob descriptor.
    inline : list[bytes]
        Bytes of the INLINE descriptors.
    p2p : list[Any]
        For each P2P/STAGED descriptor, in order, a flat uint8 tensor to send (on the
        connector's device). On gloo these are snapshots the caller cannot touch.
    nbytes : int
        tensor_blob frame size of the payload (what ``put`` returns).
    """

    __slots__ = ("meta", "plan", "inline", "p2p", "nbytes", "p2p_bytes")

    def __init__(self, meta: bytes, plan: list[int], inline: list[bytes], p2p: list[Any], nbytes: int) -> None:
        self.meta = meta
        self.plan = plan
        self.inline = inline
        self.p2p = p2p
        self.nbytes = nbytes
        self.p2p_bytes = sum(int(t.numel()) for t in p2p)


def _flat_bytes(torch: Any, t: Any) -> Any:
    """A contiguous 1-D uint8 view of ``t`` (one copy only if ``t`` is strided)."""
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def plan_send(payload: Any, *, device: Any, nccl: bool, inline_bytes: int, max_inline_total: int, key: str) -> SendPlan:
    """Walk ``payload`` and decide how each tensor travels.

    Parameters
    ----------
    device : torch.device
        The connector's device: ``cuda:k`` on an nccl link, ``cpu`` on gloo.
    nccl : bool
        True when the data path is NCCL (it moves device memory only).
    inline_bytes : int
        Host tensors and arrays of at most this many bytes ride inside the envelope.

    Raises
    ------
    BlobEncodeError
        The payload holds something tensor_blob cannot carry.
    ConfigurationError
        A tensor lives on a device this link does not serve (another GPU, or a CUDA
        tensor on a gloo link), or the inline data exceeds ``max_inline_total``.
    """
    import torch

    prepared = blob.prepare(payload)
    descs = prepared._descs
    sources = prepared._sources
    plan: list[int] = []
    inline: list[bytes] = []
    p2p: list[Any] = []
    inline_total = 0
    for i, (d, (kind, src)) in enumerate(zip(descs, sources)):
        if kind == blob.KIND_TORCH:
            dev = src.device
            on_link_device = dev == device or (
                dev.type == device.type == "cuda" and dev.index == device.index
            )
            if dev.type != "cpu" and not on_link_device:
                raise ConfigurationError(
                    f"nccl: tensor {i} of payload {key!r} is on {dev}, but this connector "
                    f"moves tensors of {device}"
                    + (" (a gloo link carries host tensors only)" if not nccl else
                       "; move it to the connector's device or open the connector with device=" + repr(str(dev)))
                )
            host = dev.type == "cpu"
        else:
            host = True
        if d.nbytes == 0:
            plan.append(EMPTY)
            continue
        if host and d.nbytes <= inline_bytes:
            inline_total += d.nbytes
            if inline_total > max_inline_total:
                raise ConfigurationError(
                    f"nccl: payload {key!r} carries more than {max_inline_total} bytes of small "
                    "host tensors inline; raise max_inline_bytes or lower inline_bytes"
                )
            plan.append(INLINE)
            inline.append(_host_bytes(kind, src))
            continue
        if not host:
            # Device tensor on the link's device: sent straight from the caller's memory
            # (NCCL orders the send after the caller's stream; the process group keeps
            # the tensor alive until the send is done).
            plan.append(P2P)
            p2p.append(_flat_bytes(torch, src))
            continue
        flat = _host_flat(torch, kind, src)
        if nccl:
            # NCCL moves device memory only: stage host data through the device.
            plan.append(STAGED)
            p2p.append(flat.to(device, non_blocking=False))
        else:
            # Gloo reads the buffer whenever the receiver is ready, possibly after put
            # returned: send a private snapshot so the caller may reuse its tensors.
            plan.append(P2P)
            p2p.append(flat.clone() if _shares_memory(flat, src) else flat)
    return SendPlan(prepared.meta, plan, inline, p2p, prepared.nbytes)


def _shares_memory(flat: Any, src: Any) -> bool:
    """Whether ``flat`` (made from ``src``) still aliases the caller's memory."""
    try:
        import numpy as np

        if isinstance(src, np.ndarray):
            return bool(np.shares_memory(flat.numpy(), src))
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    return flat.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()


def _host_flat(torch: Any, kind: int, src: Any) -> Any:
    if kind == blob.KIND_TORCH:
        return _flat_bytes(torch, src)
    import numpy as np

    a = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        # A read-only array: we only ever read from this view.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _host_bytes(kind: int, src: Any) -> bytes:
    if kind == blob.KIND_TORCH:
        import torch

        return _flat_bytes(torch, src).numpy().tobytes()
    import numpy as np

    return np.ascontiguousarray(src).tobytes()


def parse_meta(env: Envelope) -> blob.BlobHeader:
    """Validate ``env.meta`` and the plan against it; return the tensor_blob header.

    Raises
    ------
    BlobDecodeError
        Malformed meta, a plan or inline list that disagrees with the descriptors.
    """
    meta = env.meta
    header_len, data_len, _total = blob.peek_header(meta)
    if len(meta) != blob.PREFIX_SIZE + header_len:
        raise BlobDecodeError(
            f"nccl: meta of key {env.key!r} is {len(meta)} bytes, its prefix says "
            f"{blob.PREFIX_SIZE + header_len}"
        )
    raw = memoryview(meta)
    header = blob._parse_header(raw, header_len, data_len)
    if len(env.plan) != len(header.tensors):
        raise BlobDecodeError(
            f"nccl: envelope of key {env.key!r} plans {len(env.plan)} tensors, its header "
            f"describes {len(header.tensors)}"
        )
    n_inline = 0
    for i, (code, d) in enumerate(zip(env.plan, header.tensors)):
        if code not in _PLAN_NAMES:
            raise BlobDecodeError(f"nccl: tensor {i} of key {env.key!r}: unknown transport code {code}")
        if (code == EMPTY) != (d.nbytes == 0):
            raise BlobDecodeError(
                f"nccl: tensor {i} of key {env.key!r}: transport {_PLAN_NAMES[code]} for {d.nbytes} bytes"
            )
        if code == INLINE:
            if n_inline >= len(env.inline):
                raise BlobDecodeError(f"nccl: key {env.key!r}: more INLINE tensors than inline parts")
            if len(env.inline[n_inline]) != d.nbytes:
                raise BlobDecodeError(
                    f"nccl: tensor {i} of key {env.key!r}: inline part of {len(env.inline[n_inline])} "
                    f"bytes, the header says {d.nbytes}"
                )
            n_inline += 1
    if n_inline != len(env.inline):
        raise BlobDecodeError(
            f"nccl: key {env.key!r}: {len(env.inline)} inline parts for {n_inline} INLINE tensors"
        )
    return header


def build_views(header: blob.BlobHeader, plan: list[int], inline: list[bytes], received: list[Any], *, device: Any) -> list[Any]:
    """One object per descriptor, from the received buffers and the inline parts.

    ``received`` holds, in order, the uint8 tensor each P2P/STAGED descriptor was
    received into (STAGED ones already copied back to host). Device tensors are views
    of their own receive buffer; host data is a view of its buffer or inline part.

    Raises
    ------
    BlobDecodeError
        A dtype this build does not have, bool bytes other than 0/1 in host data, or a
        P2P numpy array on a link whose device is not the host.
    """
    import numpy as np
    import torch

    torch_from = blob._torch_dtypes()[1]
    numpy_from = blob._numpy_dtypes()[1]
    views: list[Any] = []
    it_recv = iter(received)
    it_inline = iter(inline)
    bool_code = blob.DTYPE_CODES["bool"][0]
    for i, (code, d) in enumerate(zip(plan, header.tensors)):
        if d.kind == blob.KIND_TORCH:
            dt = torch_from.get(d.dtype)
            if dt is None:
                raise BlobDecodeError(f"tensor {i}: dtype code {d.dtype} is not available in this torch build")
        else:
            dt = numpy_from.get(d.dtype)
            if dt is None:
                raise BlobDecodeError(f"tensor {i}: dtype code {d.dtype} is not a numpy dtype")
        if code == EMPTY:
            if d.kind == blob.KIND_TORCH:
                views.append(torch.empty(d.shape, dtype=dt))
            else:
                a = np.empty(d.shape, dtype=dt)
                views.append(a[()] if d.kind == blob.KIND_NUMPY_SCALAR else a)
            continue
        if code == INLINE:
            region = np.frombuffer(bytearray(next(it_inline)), dtype=np.uint8)
            buf = None
        else:
            buf = next(it_recv)
            if buf.device.type != "cpu":
                if d.kind != blob.KIND_TORCH or code != P2P:
                    raise BlobDecodeError(
                        f"tensor {i}: host data ({_PLAN_NAMES[code]}) arrived in device memory"
                    )
                # A device tensor: a view of its own receive buffer. Its bool bytes came
                # from a torch bool tensor on the peer; checking them would cost a device
                # reduction and a host sync per tensor.
                views.append(buf.view(dt).view(d.shape))
                continue
            region = buf.numpy()
        if d.dtype == bool_code and region.size and region.max() > 1:
            raise BlobDecodeError(f"tensor {i}: bool data holds bytes other than 0 and 1")
        if d.kind == blob.KIND_TORCH:
            t = buf if buf is not None else torch.from_numpy(region)
            views.append(t.view(dt).view(d.shape))
        else:
            a = region.view(dt).reshape(d.shape)
            views.append(a[()] if d.kind == blob.KIND_NUMPY_SCALAR else a)
    return views


def decode_tree(header: blob.BlobHeader, views: list[Any]) -> Any:
    """The payload tree of ``header`` with tensor references replaced by ``views``."""
    return blob._decode_tree(header, views)


def check_sizes(header: blob.BlobHeader, plan: list[int]) -> list[int]:
    """Byte counts of the P2P/STAGED descriptors, in the order they are received."""
    return [d.nbytes for code, d in zip(plan, header.tensors) if code in (P2P, STAGED)]

