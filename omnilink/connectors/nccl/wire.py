"""What the ``nccl`` backend sends for one payload, and how the receiver rebuilds it.

Protocol 6 (5 with templates). Each payload is at most ONE set of point-to-point operations on the
direction's *bulk* process group (one NCCL communicator; a coalesced group of sends
/ receives), plus ONE ZeroMQ message, the *doorbell*, that the sender sends once those
sends are queued. The doorbell carries the payload's header (its envelope, below): the
receiver learns everything from it, validates it, then allocates and posts the
payload's receives, in the order the doorbells came (the order of the sends). A
payload whose tensors are all small needs no process-group operation at all: host data
rides the envelope inline, and small device tensors (NCCL) ride its *region*, copied to
host by the sender and back to the device by the receiver.

    doorbell message (one ZeroMQ frame, at most the receiver's ``max_header_bytes``;
    the first message on the socket is the session id)

    envelope  msgpack array  [seq, key, meta, plan, inline, flags, region, tmpl, host]
      seq     u64     position in the sender's stream (0, 1, 2, ...); the receiver
                      takes doorbells in this order only
      key     str     the payload's key (1..512 UTF-8 bytes, no NUL)
      meta    bytes   tensor_blob prefix + header (tensor i = descriptor i)
      plan    [u8]    how tensor i travels, one code per descriptor:
                        0 EMPTY   no bytes (numel == 0)
                        1 P2P     a bulk buffer of its own (device data on NCCL: a view
                                  of its receive buffer; host data on gloo)
                        2 STAGED  host data on an NCCL link: copied to the sender's
                                  device, sent as a bulk buffer, copied back to host
                        3 INLINE  small host data (``inline_bytes``), in ``inline``
                        4 PACK    in the pack: one bulk buffer holding every PACK tensor
                        5 BELL    small device data (NCCL only), in ``region``
      inline  [bytes] the INLINE tensors' bytes, in descriptor order
      flags   u8      bit 0 REPEAT: the sender put this key recently and waits for
                      the receiver's verdict (a duplicate or not) on this payload;
                      bit 1 DEFINE: this payload's shape is template ``tmpl`` from now
                      on (a payload of a template's shape, sent whole)
      region  bytes   the BELL tensors, each at the next multiple of 64 in descriptor
                      order (the pack's rule); the gaps are zero; empty when none
      tmpl    i8      -1, or the template this envelope defines (DEFINE) or is sent by
                      (0 .. MAX_TEMPLATES - 1)
      host    bytes   sent by a template (``meta``, ``plan`` and ``region`` empty): the
                      payload's tree as msgpack, ``None`` where each tensor goes; the
                      receiver takes the descriptors, the plan and the transfer sizes
                      from the template (see "templates" below)

    bulk buffers, in this order, one coalesced group: the pack (if any PACK tensor),
                    then one per P2P/STAGED descriptor

    credit message  8-byte little-endian i64  ``seq``: the receives of payloads 0..seq
                    are posted (their receive buffers allocated)
                    + 1 byte verdict  ``1``: payload ``seq`` was dropped because its key
                    was still pending on the receiver (``DuplicateKeyError``), else 0
                    (credits come back on a second ZeroMQ socket, batched: see the
                    connector)

A payload's device tensors ride the region only when the payload has nothing for the
bulk group at all and they total at most ``bell_bytes``: then it costs no NCCL
operation (the sender waits for its stream to reach the copy to host; see the
connector). Otherwise they go by the bulk group: small ones together in the pack.

Both ends derive every size and offset from the envelope alone, and the receiver checks
all of it (``read_bell``: the message's size, the envelope's types and flags, its
``seq``, the key, the tensor_blob limits, the plan against the descriptors and the link's
transport, the inline parts and the region against the plan, ``max_message_bytes``)
before it allocates anything.
"""

from __future__ import annotations

import struct
import warnings
from typing import Any, cast

import msgspec

from omnilink import blob
from omnilink._errors import BlobDecodeError, CapacityError, ConfigurationError
from omnilink._treecode import PLAIN_LEAVES, TreeSource, Unmatchable, tuple_expr

__all__ = [
    "BELL",
    "CREDIT_SIZE",
    "EMPTY",
    "FLAG_DEFINE",
    "FLAG_REPEAT",
    "INLINE",
    "MAX_TEMPLATES",
    "P2P",
    "PACK",
    "PACK_MAX_BYTES",
    "STAGED",
    "Announced",
    "Endpoints",
    "Envelope",
    "Hello",
    "RecvTemplate",
    "SendPlan",
    "SendTemplate",
    "bell_layout",
    "build_views",
    "check_sizes",
    "compile_template",
    "decode_credit",
    "decode_endpoints",
    "decode_envelope",
    "decode_hello",
    "decode_tree",
    "early_ready",
    "encode_credit",
    "encode_endpoints",
    "encode_envelope",
    "encode_hello",
    "pack_layout",
    "parse_meta",
    "payload_of",
    "plan_send",
    "read_bell",
    "send_by_template",
    "staged_transfers",
]

EMPTY, P2P, STAGED, INLINE, PACK, BELL = 0, 1, 2, 3, 4, 5
_PLAN_NAMES = {EMPTY: "EMPTY", P2P: "P2P", STAGED: "STAGED", INLINE: "INLINE", PACK: "PACK", BELL: "BELL"}
FLAG_REPEAT = 1
FLAG_DEFINE = 2
_FLAGS_KNOWN = FLAG_REPEAT | FLAG_DEFINE

#: Version of this protocol; both ends must speak the same one.
PROTOCOL = 6

#: Templates a sender may have defined at once on one direction (ids 0 ..
#: ``MAX_TEMPLATES - 1``; a new definition under an id replaces the old one).
MAX_TEMPLATES = 8
#: Most tensors, and dicts and entries, a template is compiled for.
MAX_TEMPLATE_TENSORS = 64
MAX_TEMPLATE_NODES = 512

#: Most bytes one payload's pack holds; further small tensors get their own transfer
#: (the pack costs the sender a copy and the receiver one buffer shared by its views).
PACK_MAX_BYTES = 64 << 20

_CREDIT = struct.Struct("<qB")
CREDIT_SIZE = _CREDIT.size
_MAX_KEY_BYTES = 512


class Envelope(msgspec.Struct, array_like=True, frozen=True):
    """The envelope of one payload, the doorbell message (see the module docstring)."""

    seq: int
    key: str
    meta: bytes
    plan: list[int]
    inline: list[bytes]
    flags: int = 0
    #: decoded as a view of the received message (no copy: the receiver copies it to the
    #: device straight from there)
    region: memoryview = memoryview(b"")
    #: the template this envelope defines (``FLAG_DEFINE``) or is sent by (``meta`` and
    #: ``plan`` empty); -1: none
    tmpl: int = -1
    #: a templated envelope's tree: msgpack of the payload with ``None`` in place of
    #: each tensor
    host: bytes = b""


class Hello(msgspec.Struct, frozen=True, kw_only=True):
    """What each end publishes about itself in the store before the link is built."""

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
    #: Largest doorbell message this end accepts as a receiver; ``None``: no limit stated.
    max_header_bytes: int | None = None
    #: Most bytes this end keeps announced and not yet posted as a sender.
    max_inflight_bytes: int | None = None


class Endpoints(msgspec.Struct, frozen=True):
    """The addresses of the sockets one end binds, traded once through the store."""

    #: Where the peer sends credits to this end ("" if this end does not send).
    c: str
    #: Where the peer rings this end's doorbell ("" if this end does not receive).
    d: str = ""


_ENV_ENCODER = msgspec.msgpack.Encoder()
_ENV_DECODER = msgspec.msgpack.Decoder(Envelope)
_HELLO_DECODER = msgspec.msgpack.Decoder(Hello)
_ENDPOINTS_DECODER = msgspec.msgpack.Decoder(Endpoints)
_MAX_ENDPOINT = 512


def encode_endpoints(endpoints: dict[str, str]) -> bytes:
    return _ENV_ENCODER.encode(Endpoints(**endpoints))


def decode_endpoints(raw: bytes) -> dict[str, str]:
    """Decode the peer's socket addresses.

    Raises
    ------
    BlobDecodeError
        Not an address record, or an address longer than 512 characters.
    """
    try:
        ep = _ENDPOINTS_DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise BlobDecodeError(f"nccl: malformed socket addresses in the store: {exc}") from exc
    if len(ep.c) > _MAX_ENDPOINT or len(ep.d) > _MAX_ENDPOINT:
        raise BlobDecodeError("nccl: a socket address in the store is longer than 512 characters")
    return {"c": ep.c, "d": ep.d}


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
        raise BlobDecodeError(f"nccl: malformed hello in the store: {exc}") from exc


def encode_envelope(env: Envelope) -> bytes:
    return _ENV_ENCODER.encode(env)


def decode_envelope(raw: Any) -> Envelope:
    """Decode a doorbell message's envelope (types and flags only; ``read_bell`` checks
    the rest).

    Raises
    ------
    BlobDecodeError
        The bytes are not an envelope of this protocol.
    """
    try:
        env = _ENV_DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise BlobDecodeError(f"nccl: malformed envelope: {exc}") from exc
    if env.flags & ~_FLAGS_KNOWN or env.flags < 0:
        raise BlobDecodeError(f"nccl: envelope of key {env.key!r} has unknown flags {env.flags:#x}")
    return env


class Announced:
    """A doorbell message the receiver validated: everything needed to allocate and post
    the payload's receives and to build it.

    Attributes
    ----------
    env : Envelope
    header : blob.BlobHeader
        The payload's tensor_blob header (validated).
    sizes : list[int]
        Byte counts of its bulk buffers, in the order they are received.
    nbytes : int
        ``sum(sizes)`` plus the region: what the receiver allocates for it.
    frame : int
        The payload's tensor_blob frame size (what ``get`` counts).
    host : dict or None
        A templated payload's tree, ``None`` in place of each tensor (``payload_of`` puts
        the tensors there); ``None`` for a payload sent whole.
    paths : tuple or None
        Where each descriptor's tensor goes in ``host`` (the template's).
    """

    __slots__ = ("env", "header", "sizes", "nbytes", "frame", "host", "paths")

    def __init__(self, env: Envelope, header: Any, sizes: list[int], frame: int, host: Any = None,
                 paths: Any = None) -> None:
        self.env = env
        self.header = header
        self.sizes = sizes
        self.nbytes = sum(sizes) + len(env.region)
        self.frame = frame
        self.host = host
        self.paths = paths


def read_bell(
    raw: Any,
    *,
    seq: int,
    max_header_bytes: int,
    max_message_bytes: int,
    nccl: bool,
    cache: dict[Any, tuple[Any, list[int], int]] | None = None,
    cache_size: int = 256,
    templates: dict[int, RecvTemplate] | None = None,
) -> Announced:
    """Validate one doorbell message; return what it announces. Allocates nothing but
    the decoded envelope (bounded by the message's size, itself bounded first).

    Parameters
    ----------
    raw : bytes-like
        The message.
    seq : int
        The sequence number the receiver expects next (doorbells come in order).
    max_header_bytes, max_message_bytes : int
        The receiver's bounds on the message and on the payload's frame.
    nccl : bool
        The link's transport: BELL and STAGED exist on NCCL links only, and there host
        data never travels as P2P or PACK.
    cache : dict, optional
        Parsed headers of earlier messages, keyed by (meta, plan, inline sizes, region
        size); filled here (cleared when it holds ``cache_size``).
    templates : dict, optional
        This direction's templates by id: an envelope that defines one
        (``FLAG_DEFINE``) is checked as any other, then its template is kept here; a
        templated envelope is read against its template. ``None``: templates refused.

    Raises
    ------
    BlobDecodeError
        Too long, not an envelope, unknown flags, out of sequence, an invalid key, a
        malformed tensor_blob header, a plan that disagrees with it or with the link,
        inline parts or a region that disagree with the plan; a template unknown, out of
        range or not a template's shape, a templated envelope with a header, a plan or
        a region of its own, or a tree that is not msgpack of a map.
    CapacityError
        The payload is larger than ``max_message_bytes``.
    """
    n = len(raw)
    if n > max_header_bytes:
        raise BlobDecodeError(f"nccl: doorbell message of {n} bytes, more than this end's {max_header_bytes}")
    env = decode_envelope(raw)
    if env.seq != seq:
        raise BlobDecodeError(f"nccl: doorbell message says seq {env.seq}, expected {seq} (out of sequence)")
    key = env.key
    if not key or "\x00" in key or len(key) > _MAX_KEY_BYTES or len(key.encode("utf-8", "replace")) > _MAX_KEY_BYTES:
        raise BlobDecodeError(f"nccl: doorbell message {seq} names an invalid key {key[:64]!r}")
    if env.tmpl >= 0 and not env.flags & FLAG_DEFINE:
        return _read_templated(env, templates, max_message_bytes)
    if env.flags & FLAG_DEFINE and (templates is None or not 0 <= env.tmpl < MAX_TEMPLATES):
        raise BlobDecodeError(
            f"nccl: doorbell message {seq} (key {key!r}) defines template {env.tmpl}, outside "
            f"0..{MAX_TEMPLATES - 1} or on a link that takes none"
        )
    if env.host or env.tmpl < -1 or (env.tmpl != -1 and not env.flags & FLAG_DEFINE):
        raise BlobDecodeError(f"nccl: doorbell message {seq} (key {key!r}) has a template field without a template")
    ck = (env.meta, tuple(env.plan), tuple(len(p) for p in env.inline), len(env.region))
    hit = cache.get(ck) if cache is not None else None
    if hit is None:
        header = parse_meta(env)
        _check_plan(header, env, nccl)
        sizes = check_sizes(header, env.plan)
        frame = blob.peek_header(env.meta)[2]
        if cache is not None:
            if len(cache) >= cache_size:
                cache.clear()
            cache[ck] = (header, sizes, frame)
    else:
        header, sizes, frame = hit
    if frame > max_message_bytes:
        raise _too_large(seq, key, frame, max_message_bytes)
    if env.flags & FLAG_DEFINE:
        cast(dict, templates)[env.tmpl] = RecvTemplate.of(env, header, sizes, frame)
    return Announced(env, header, sizes, frame)


def _too_large(seq: int, key: str, frame: int, max_message_bytes: int) -> CapacityError:
    return CapacityError(
        f"nccl: doorbell message {seq} announces key {key!r} of {frame} bytes, more than "
        f"max_message_bytes={max_message_bytes}; nothing was allocated, and the link cannot "
        "continue (the sender ignored the limit)"
    )


def _read_templated(env: Envelope, templates: dict[int, RecvTemplate] | None, max_message_bytes: int) -> Announced:
    """``read_bell`` of an envelope sent by a template (see there)."""
    key = env.key
    t = templates.get(env.tmpl) if templates is not None else None
    if t is None:
        raise BlobDecodeError(f"nccl: key {key!r} is sent by template {env.tmpl}, which was not defined")
    if env.meta or env.plan or len(env.region):
        raise BlobDecodeError(f"nccl: key {key!r} is sent by a template, yet brings a header, a plan or a region")
    if [len(p) for p in env.inline] != t.inline_sizes:
        raise BlobDecodeError(
            f"nccl: key {key!r}: inline parts of {[len(p) for p in env.inline]} bytes, its template "
            f"has {t.inline_sizes}"
        )
    try:
        host = _HOST_DECODER.decode(env.host)
    except (msgspec.DecodeError, msgspec.ValidationError, BlobDecodeError, RecursionError, ValueError) as exc:
        raise BlobDecodeError(f"nccl: key {key!r}: its tree is not a msgpack map of plain data: {exc}") from None
    frame = t.size(len(env.host))
    if frame > max_message_bytes:
        raise _too_large(env.seq, key, frame, max_message_bytes)
    whole = Envelope(env.seq, key, t.meta, t.plan, env.inline, env.flags, env.region)
    return Announced(whole, t.header, t.sizes, frame, host, t.paths)


def _check_plan(header: blob.BlobHeader, env: Envelope, nccl: bool) -> None:
    """The plan against the link's transport and the region against the plan."""
    for i, (code, d) in enumerate(zip(env.plan, header.tensors)):
        if code in (BELL, STAGED) and not nccl:
            raise BlobDecodeError(
                f"nccl: tensor {i} of key {env.key!r}: transport {_PLAN_NAMES[code]} on a gloo link"
            )
        if code == BELL and d.kind != blob.KIND_TORCH:
            raise BlobDecodeError(f"nccl: tensor {i} of key {env.key!r}: host data planned BELL")
        if nccl and code in (P2P, PACK) and d.kind != blob.KIND_TORCH:
            raise BlobDecodeError(
                f"nccl: tensor {i} of key {env.key!r}: host data planned {_PLAN_NAMES[code]} on an NCCL link"
            )
    _offsets, region = bell_layout(header, env.plan)
    if len(env.region) != region:
        raise BlobDecodeError(
            f"nccl: key {env.key!r} carries a region of {len(env.region)} bytes, its plan needs {region}"
        )
    if region and any(code in (P2P, PACK, STAGED) for code in env.plan):
        # A sender puts a payload's device tensors in the region only when nothing of it
        # goes by the bulk group.
        raise BlobDecodeError(f"nccl: key {env.key!r} has a region and bulk transfers too")


def encode_credit(seq: int, duplicate: bool) -> bytes:
    return _CREDIT.pack(seq, 1 if duplicate else 0)


def decode_credit(raw: bytes) -> tuple[int, bool]:
    """Decode a credit message: ``(seq, duplicate)``.

    Raises
    ------
    BlobDecodeError
        Not a credit message (wrong length or verdict byte).
    """
    if len(raw) != CREDIT_SIZE:
        raise BlobDecodeError(f"nccl: credit message of {len(raw)} bytes, expected {CREDIT_SIZE}")
    seq, verdict = _CREDIT.unpack(raw)
    if verdict > 1 or seq < 0:
        raise BlobDecodeError(f"nccl: malformed credit message (seq {seq}, verdict {verdict})")
    return seq, verdict == 1


class SendPlan:
    """The sender's view of one payload: envelope fields plus the tensors to send.

    Attributes
    ----------
    plan : list[int]
        One transport code per tensor_blob descriptor.
    inline : list[bytes]
        Bytes of the INLINE descriptors.
    bell : list[tuple[int, Any, int]]
        ``(offset in the region, contiguous device tensor, its byte count)`` of the
        BELL descriptors, in descriptor order: the sender copies them to host into the
        region (from the tensor's pointer).
    region_bytes : int
        Size of the region (0 when no BELL descriptor).
    p2p : list[Any]
        The bulk buffers, in order: the pack (if any) then, for each P2P/STAGED
        descriptor, a flat uint8 tensor to send (on the connector's device; on NCCL a
        payload sent by a template sends its contiguous P2P tensors themselves). On
        gloo these are snapshots the caller cannot touch.
    nbytes : int
        tensor_blob frame size of the payload (what ``put`` returns).
    """

    __slots__ = ("meta", "plan", "inline", "bell", "region_bytes", "p2p", "nbytes", "p2p_bytes", "prepared")

    def __init__(
        self, meta: bytes, plan: list[int], inline: list[bytes], p2p: list[Any], nbytes: int,
        bell: list[tuple[int, Any, int]] | None = None, region_bytes: int = 0, p2p_bytes: int | None = None,
    ) -> None:
        #: the tensor_blob ``plan_send`` planned it from (``compile_template``)
        self.prepared: Any = None
        self.meta = meta
        self.plan = plan
        self.inline = inline
        self.bell = bell if bell is not None else []
        self.region_bytes = region_bytes
        self.p2p = p2p
        self.nbytes = nbytes
        #: bytes the bulk transfers carry (``p2p`` are uint8 views, or tensors a
        #: template's match checked, whose byte count the caller gives)
        self.p2p_bytes = sum(int(t.numel()) for t in p2p) if p2p_bytes is None else p2p_bytes


def _align(n: int) -> int:
    return (n + blob.FRAME_ALIGN - 1) // blob.FRAME_ALIGN * blob.FRAME_ALIGN


def _flat_bytes(t: Any, uint8: Any) -> Any:
    """A contiguous 1-D uint8 view of ``t`` (one copy only if ``t`` is strided).

    A contiguous tensor's items lie one after the other whatever the strides of its
    size-1 dimensions (a ``[1]`` tensor of stride 2 is contiguous, and ``view`` as bytes
    refuses it): the flat view is made with unit stride explicitly."""
    if t.requires_grad:
        t = t.detach()
    if t.dim() == 1 and t.stride(0) == 1:
        return t.view(uint8)  # the common small tensor (ids, positions): one view, the cheapest
    if not t.is_contiguous():
        t = t.contiguous()
    return t.as_strided((t.numel(),), (1,)).view(uint8)


def plan_send(
    payload: Any,
    *,
    device: Any,
    nccl: bool,
    inline_bytes: int,
    max_inline_total: int,
    key: str,
    pack_bytes: int = 0,
    pad: Any = None,
    bell_bytes: int = 0,
) -> SendPlan:
    """Walk ``payload`` and decide how each tensor travels.

    Parameters
    ----------
    device : torch.device
        The connector's device: ``cuda:k`` on an nccl link, ``cpu`` on gloo.
    nccl : bool
        True when the data path is NCCL (it moves device memory only).
    inline_bytes : int
        Host tensors and arrays of at most this many bytes ride inside the envelope.
    max_inline_total : int
        Bound on a payload's inline bytes, region included.
    pack_bytes : int
        Tensors of at most this many bytes that would get a bulk buffer of their own
        travel together in the pack (device tensors on NCCL, host ones on gloo), when
        there are at least two of them.
    pad : torch.Tensor, optional
        ``FRAME_ALIGN`` zero bytes on ``device`` (padding between packed tensors);
        needed when ``pack_bytes`` is set.
    bell_bytes : int
        NCCL: when the payload has nothing else for the bulk group and its device
        tensors take at most this many bytes laid out in the region (64-byte aligned),
        they ride the doorbell message's region (planned BELL) instead: the payload
        costs no NCCL operation.

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
    if not (nccl and device.type == "cuda"):
        sp = _plan_fresh(torch, prepared, device=device, nccl=nccl, inline_bytes=inline_bytes,
                         max_inline_total=max_inline_total, key=key, pack_bytes=pack_bytes, pad=pad,
                         bell_bytes=bell_bytes)
        sp.prepared = prepared
        return sp
    # What the decisions depend on: each tensor's kind, dtype, byte size and number of
    # dimensions (not the tree's values, which change from payload to payload), the
    # device and the options. Looked up first by the descriptors' ids: ``prepare`` hands
    # out one descriptor object per (dtype, shape, offset) from its cache, so a stream of
    # one shape finds its recipe without reading each descriptor (the entry keeps the
    # descriptors alive, so their ids stay theirs); descriptors made afresh (numpy data,
    # a tensor that needs grad) miss there and are looked up by their fields.
    descs = prepared._descs
    opts = (device.index, inline_bytes, max_inline_total, pack_bytes, bell_bytes)
    ik = (tuple(map(id, descs)), opts)
    hit = _SEND_PLANS_BY_ID.get(ik)
    sk = None
    if hit is not None:
        cached = hit[1]
    else:
        sk = (tuple([(d.kind, d.dtype, d.nbytes, len(d.shape)) for d in descs]), opts)
        cached = _SEND_PLANS.get(sk)
        if cached is not None:
            _remember(_SEND_PLANS_BY_ID, ik, (descs, cached))
    if cached is not None:
        sp = cached.apply(torch, prepared, pad)
        if sp is not None:
            sp.prepared = prepared
            return sp
    sp = _plan_fresh(torch, prepared, device=device, nccl=nccl, inline_bytes=inline_bytes,
                     max_inline_total=max_inline_total, key=key, pack_bytes=pack_bytes, pad=pad,
                     bell_bytes=bell_bytes)
    if cached is None:
        recipe = _SendRecipe.of(prepared, sp, device.index)
        if recipe is not None:
            _remember(_SEND_PLANS, sk, recipe)
            _remember(_SEND_PLANS_BY_ID, ik, (descs, recipe))
    sp.prepared = prepared
    return sp


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= _SEND_PLANS_MAX:
        cache.clear()
    cache[key] = value


#: (each tensor's kind, dtype code, byte size and number of dimensions; the device
#: index and the planning options) -> ``_SendRecipe``: the decisions of ``plan_send`` for
#: a payload shape (a stream of payloads of one shape on an NCCL link plans once; where
#: each tensor lives is checked per payload). ``_SEND_PLANS_BY_ID``: the same recipes by
#: the ids of the descriptor objects of a payload that used them, with those objects
#: (which keeps the ids theirs).
_SEND_PLANS: dict[tuple[Any, ...], _SendRecipe] = {}
_SEND_PLANS_BY_ID: dict[tuple[Any, ...], tuple[list[Any], _SendRecipe]] = {}
_SEND_PLANS_MAX = 256


class _SendRecipe:
    """What ``plan_send`` decided for a payload shape on an NCCL link, replayed for the
    next payload of that shape (each tensor's kind, dtype, byte size and number of
    dimensions) once its tensors are where they were (torch tensors on the link's
    device, or on the host) and contiguous as needed."""

    __slots__ = ("plan", "where", "checked", "inline", "bell", "region_bytes", "pack", "pack_bytes", "singles",
                 "index", "cat", "pack_device", "pack_idx", "pack_nd", "p2p_bytes")

    @classmethod
    def of(cls, prepared: Any, sp: SendPlan, index: int) -> _SendRecipe | None:
        import torch

        plan = sp.plan
        if STAGED in plan:
            return None
        r = cls()
        r.plan = plan
        r.index = index
        r.where = []  # per descriptor: 1 on the link's GPU, 0 on the host (torch), -1 not torch
        for kind, src in prepared._sources:
            if kind != blob.KIND_TORCH:
                r.where.append(-1)
            elif src.is_cuda:
                r.where.append(1)
            else:
                r.where.append(0)
        descs = prepared._descs
        r.inline = [i for i, code in enumerate(plan) if code == INLINE]
        r.bell, r.region_bytes = _placed(descs, plan, BELL)
        r.pack, r.pack_bytes = _placed(descs, plan, PACK)
        # The pack's tensors follow one another with no padding (each a multiple of 64
        # bytes) and share a dtype ``cat`` handles (not a float8: those go as bytes):
        # then the pack is one typed ``cat`` of the tensors themselves (it takes any
        # strides; a tensor of other than one dimension is flattened first), no byte
        # view of each, and no per-tensor check (``cat`` refuses tensors on different
        # devices; the pack's device is checked once).
        end = 0
        gapless = bool(r.pack)
        for at, _i, n in r.pack:
            gapless = gapless and at == end
            end = at + n
        r.pack_idx = [i for _at, i, _n in r.pack]
        r.cat = False
        wheres = {r.where[i] for i in r.pack_idx}
        # Where the pack must come out (``get_device()``: the link's GPU, or -1 for host
        # stand-ins), all of its tensors having been there.
        r.pack_device = index if wheres == {1} else -1
        if gapless and len(wheres) == 1 and -1 not in wheres:
            dts = {prepared._sources[i][1].dtype for i in r.pack_idx}
            dt = next(iter(dts))
            r.cat = len(dts) == 1 and not (dt.itemsize == 1 and dt not in (torch.uint8, torch.int8, torch.bool))
        r.pack_nd = [j for j, i in enumerate(r.pack_idx) if len(descs[i].shape) != 1]
        r.singles = [i for i, code in enumerate(plan) if code == P2P]
        skip = set(r.pack_idx) if r.cat else set()
        r.checked = [i for i, w in enumerate(r.where) if w >= 0 and i not in skip]
        r.p2p_bytes = sp.p2p_bytes  # (a payload of this shape's, whatever its values)
        return r

    def apply(self, torch: Any, prepared: Any, pad: Any, *, matched: bool = False) -> SendPlan | None:
        """The plan of ``prepared`` (a payload of this shape), or ``None`` if a tensor is
        not where it was (``plan_send`` plans afresh and names what is wrong).
        ``matched``: a template's match checked every tensor already (where it is,
        contiguous, no grad): each P2P tensor is sent as it is (NCCL moves its bytes),
        not through a byte view."""
        sources = prepared._sources
        if not matched:
            index = self.index
            where = self.where
            for i in self.checked:
                src = sources[i][1]
                if where[i] == 1:
                    if not src.is_cuda or src.get_device() != index:
                        return None
                elif not src.is_cpu:
                    return None
        inline = [_host_bytes(*sources[i]) for i in self.inline]
        if self.bell:
            bell = []
            for at, i, n in self.bell:
                t = sources[i][1]
                bell.append((at, t if t.is_contiguous() else t.contiguous(), n))
            return SendPlan(prepared.meta, self.plan, inline, [], prepared.nbytes, bell, self.region_bytes)
        uint8 = torch.uint8
        p2p: list[Any] = []
        if self.cat:
            ts = [sources[i][1] for i in self.pack_idx]
            for j in self.pack_nd:
                ts[j] = ts[j].reshape(-1)
            try:
                packed = torch.cat(ts)
            except RuntimeError:  # tensors on different devices: planned afresh, named there
                return None
            if packed.get_device() != self.pack_device:
                return None
            if packed.requires_grad:
                packed = packed.detach()
            p2p.append(packed.view(uint8))
        elif self.pack:
            parts: list[Any] = []
            end = 0
            for at, i, n in self.pack:
                if at > end:
                    parts.append(pad[: at - end])
                parts.append(_flat_bytes(sources[i][1], uint8))
                end = at + n
            p2p.append(torch.cat(parts))
        if matched:
            for i in self.singles:
                p2p.append(sources[i][1])
            return SendPlan(prepared.meta, self.plan, inline, p2p, prepared.nbytes, p2p_bytes=self.p2p_bytes)
        for i in self.singles:
            p2p.append(_flat_bytes(sources[i][1], uint8))
        return SendPlan(prepared.meta, self.plan, inline, p2p, prepared.nbytes)


def _plan_fresh(
    torch: Any, prepared: Any, *, device: Any, nccl: bool, inline_bytes: int, max_inline_total: int, key: str,
    pack_bytes: int, pad: Any, bell_bytes: int,
) -> SendPlan:
    """``plan_send``'s decisions for one prepared payload (see there)."""
    uint8 = torch.uint8
    descs = prepared._descs
    sources = prepared._sources
    plan: list[int] = []
    inline: list[bytes] = []
    singles: list[Any] = []  # (descriptor index, flat tensor) of own bulk buffers
    packable: list[tuple[int, Any]] = []
    inline_total = 0
    region = 0  # the region's size, were every device tensor in it
    device_ts: set[int] = set()  # descriptors whose entry is a contiguous device tensor, not yet flat
    staged = False
    cuda_link = device.type == "cuda"
    for i, (d, (kind, src)) in enumerate(zip(descs, sources)):
        if kind == blob.KIND_TORCH:
            dev = src.device
            if dev.type != "cpu" and not (cuda_link and dev.type == "cuda" and dev.index == device.index):
                raise ConfigurationError(
                    f"nccl: tensor {i} of payload {key!r} is on {dev}, but this connector "
                    f"moves tensors of {device}"
                    + (" (a gloo link carries host tensors only)" if not nccl else
                       "; move it to the connector's device or open the connector with device=" + repr(str(dev)))
                )
            host = dev.type == "cpu"
        else:
            host = True
        nbytes = d.nbytes
        if nbytes == 0:
            plan.append(EMPTY)
            continue
        if host and nbytes <= inline_bytes:
            inline_total += nbytes
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
            # the tensor alive until the send is done), packed when small, or in the
            # region (decided below, once the whole payload is known). Made a flat byte
            # view only if it goes by NCCL (the region copies from its pointer).
            plan.append(P2P)
            region = _align(region) + nbytes
            (packable if nbytes <= pack_bytes else singles).append((i, src if src.is_contiguous() else src.contiguous()))
            device_ts.add(i)
            continue
        flat = _host_flat(torch, kind, src)
        if nccl:
            # NCCL moves device memory only: stage host data through the device.
            plan.append(STAGED)
            staged = True
            singles.append((i, flat.to(device, non_blocking=False)))
        else:
            plan.append(P2P)
            if nbytes <= pack_bytes:
                packable.append((i, flat))
            else:
                # Gloo reads the buffer whenever the receiver is ready, possibly after
                # put returned: send a private snapshot so the caller may reuse it.
                singles.append((i, _host_copy(flat) if _shares_memory(flat, src) else flat))
    if (
        nccl and region and not staged and region <= bell_bytes and inline_total + region <= max_inline_total
    ):
        # Nothing but small device tensors for the bulk group: they ride the region.
        bell: list[tuple[int, Any, int]] = []
        end = 0
        for i, t in sorted(packable + singles, key=lambda item: item[0]):
            at = _align(end)
            n = descs[i].nbytes
            bell.append((at, t, n))
            plan[i] = BELL
            end = at + n
        return SendPlan(prepared.meta, plan, inline, [], prepared.nbytes, bell, end)
    if device_ts:
        packable = [(i, _flat_bytes(t, uint8) if i in device_ts else t) for i, t in packable]
        singles = [(i, _flat_bytes(t, uint8) if i in device_ts else t) for i, t in singles]
    p2p: list[Any] = []
    packed: set[int] = set()
    if len(packable) >= 2:
        parts: list[Any] = []
        end = 0
        for i, flat in packable:
            n = int(flat.numel())
            start = _align(end)
            if start + n > PACK_MAX_BYTES:
                continue
            if start > end:
                parts.append(pad[: start - end])
            parts.append(flat)
            end = start + n
            packed.add(i)
        if len(packed) >= 2:
            # One copy of the small tensors into one buffer: one transfer for them all.
            p2p.append(torch.cat(parts) if nccl else _host_cat(parts, end))
            for i in packed:
                plan[i] = PACK
        else:
            packed.clear()
    for i, flat in packable:
        if i not in packed:
            if not nccl and _shares_memory(flat, sources[i][1]):
                flat = _host_copy(flat)  # a private snapshot, as for the other gloo sends
            singles.append((i, flat))
    if packable:
        singles.sort(key=lambda item: item[0])
    p2p.extend(t for _, t in singles)
    return SendPlan(prepared.meta, plan, inline, p2p, prepared.nbytes)


def _host_copy(flat: Any) -> Any:
    """A private copy of a flat host tensor, by numpy's single-threaded memcpy (torch's
    threaded copy of a byte view can cost milliseconds on a busy machine)."""
    import torch

    return torch.from_numpy(flat.numpy().copy())


def _host_cat(parts: list[Any], size: int) -> Any:
    """``torch.cat(parts)`` of flat host tensors, by memcpy (see ``_host_copy``)."""
    import numpy as np
    import torch

    out = np.empty(size, dtype=np.uint8)
    at = 0
    for part in parts:
        n = int(part.numel())
        out[at: at + n] = part.numpy()
        at += n
    return torch.from_numpy(out)


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
        return _flat_bytes(src, torch.uint8)
    import numpy as np

    a = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        # A read-only array: we only ever read from this view.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _host_bytes(kind: int, src: Any) -> bytes:
    if kind == blob.KIND_TORCH:
        import torch

        return _flat_bytes(src, torch.uint8).numpy().tobytes()
    import numpy as np

    return np.ascontiguousarray(src).tobytes()


def parse_meta(env: Envelope, header: blob.BlobHeader | None = None) -> blob.BlobHeader:
    """Validate ``env.meta`` and the plan against it; return the tensor_blob header.

    ``header``: the header already parsed and validated from these very meta bytes (a
    cache's); only the plan and inline parts are then checked against it.

    Raises
    ------
    BlobDecodeError
        Malformed meta, a plan or inline list that disagrees with the descriptors.
    """
    if header is None:
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


def _placed(descs: list[Any], plan: list[int], code: int) -> tuple[list[tuple[int, int, int]], int]:
    """``(offset, descriptor index, nbytes)`` of the descriptors planned ``code`` (PACK:
    in the pack; BELL: in the region), in descriptor order, each at the next multiple of
    64, and the buffer's size: the one layout of both ends."""
    out = []
    end = 0
    for i, c in enumerate(plan):
        if c == code:
            at = _align(end)
            n = descs[i].nbytes
            out.append((at, i, n))
            end = at + n
    return out, end


def pack_layout(header: blob.BlobHeader, plan: list[int], code: int = PACK) -> tuple[list[int], int]:
    """Offsets of the descriptors planned ``code`` (PACK: in the pack; BELL: in the
    doorbell's region) in descriptor order, each at the next multiple of 64, and the
    buffer's size."""
    placed, end = _placed(header.tensors, plan, code)
    return [at for at, _i, _n in placed], end


def bell_layout(header: blob.BlobHeader, plan: list[int]) -> tuple[list[int], int]:
    """``pack_layout`` of the BELL descriptors (offsets in the region)."""
    return pack_layout(header, plan, BELL)


def check_sizes(header: blob.BlobHeader, plan: list[int]) -> list[int]:
    """Byte counts of the transfers of a payload, in the order they are received: the
    pack (if any PACK descriptor), then one per P2P/STAGED descriptor."""
    sizes = [d.nbytes for code, d in zip(plan, header.tensors) if code in (P2P, STAGED)]
    _offsets, pack = pack_layout(header, plan)
    return [pack, *sizes] if pack else sizes


def early_ready(header: blob.BlobHeader, plan: list[int], *, nccl: bool) -> bool:
    """Whether the payload can be built before its bytes arrive: no host data that must
    come back from the device (STAGED), and on gloo no received host bool data (whose
    bytes ``build_views`` checks)."""
    bool_code = blob.DTYPE_CODES["bool"][0]
    for code, d in zip(plan, header.tensors):
        if code == STAGED:
            return False
        if not nccl and code in (P2P, PACK) and d.dtype == bool_code:
            return False
    return True


def staged_transfers(plan: list[int]) -> list[bool]:
    """For each transfer of ``check_sizes``, whether it carries STAGED host data."""
    flags = [code == STAGED for code in plan if code in (P2P, STAGED)]
    return [False, *flags] if PACK in plan else flags


def build_views(
    header: blob.BlobHeader, plan: list[int], inline: list[bytes], received: list[Any], *, device: Any,
    region: Any = None,
) -> list[Any]:
    """One object per descriptor, from the received buffers, the region and the inline
    parts.

    ``received`` holds the uint8 tensors of the bulk buffers, in the order of
    ``check_sizes`` (STAGED ones already copied back to host). Device tensors are views
    of their own receive buffer (PACK ones: of the pack; BELL ones: of ``region``, the
    doorbell's region copied to the device); host data is a view of its buffer or a copy
    of its inline part.

    Raises
    ------
    BlobDecodeError
        A dtype this build does not have, bool bytes other than 0/1 in host data, host
        data (a numpy array, a STAGED tensor) in device memory, or BELL tensors that do
        not fit the region.
    """
    fast = _recipe(header, plan)
    if fast is not None:
        views = _fast_views(fast, received, region, inline)
        if views is not None:
            return views
    # The one-by-one path reads bytes: buffers allocated typed (``receive_allocs``) as
    # their uint8 views.
    received = [_as_bytes(b) for b in received]
    if region is not None:
        region = _as_bytes(region)
    return _slow_views(header, plan, inline, received, region)


def _as_bytes(t: Any) -> Any:
    import torch

    return t if t.dtype == torch.uint8 and t.dim() == 1 else t.reshape(-1).view(torch.uint8)


#: header object id -> (header, plan, recipe or None): ``read_bell`` hands out one header
#: object per distinct envelope (its cache), so a stream of payloads of one shape plans
#: its views once.
_RECIPES: dict[int, tuple[Any, tuple[int, ...], Any]] = {}
_RECIPES_MAX = 256


class _Recipe:
    """The views of a payload whose every tensor is a torch tensor planned P2P, PACK,
    BELL or EMPTY: per buffered run (the pack, the region) one ``split_with_sizes`` of
    its typed view per dtype, instead of one ``as_strided`` per tensor (a payload of
    many small tensors paid most of its receive time building views one by one)."""

    __slots__ = ("n", "empties", "singles", "runs", "pack_size", "bell_size", "bool_in", "allocs", "region_alloc",
                 "inlines")

    def __init__(self) -> None:
        self.n = 0
        # What the receiver allocates, so that a buffer IS its tensor (no view to build):
        # per bulk buffer in ``check_sizes`` order, ``(shape, dtype)`` for a P2P tensor
        # or ``None`` (the pack: uint8); for a region holding one tensor exactly, that.
        self.allocs: list[tuple[tuple[int, ...], Any] | None] = []
        self.region_alloc: tuple[tuple[int, ...], Any] | None = None
        self.empties: list[tuple[int, Any, tuple[int, ...]]] = []  # (index, dtype, shape)
        # INLINE host tensors, in order: (index, dtype, shape, whether bool)
        self.inlines: list[tuple[int, Any, tuple[int, ...], bool]] = []
        self.singles: list[tuple[int, Any, tuple[int, ...]]] = []  # P2P: (index, dtype, shape), in order
        # (code, dtype, sizes in items incl. gaps, [(index, piece, shape or None: 1-D)])
        self.runs: list[tuple[int, Any, list[int], list[tuple[int, int, Any]]]] = []
        self.pack_size = 0
        self.bell_size = 0
        #: the plan codes (PACK, BELL) whose buffer holds a bool tensor
        self.bool_in: set[int] = set()


def _recipe(header: blob.BlobHeader, plan: list[int]) -> _Recipe | None:
    key = id(header)
    hit = _RECIPES.get(key)
    if hit is not None and hit[0] is header and hit[1] == tuple(plan):
        return cast(_Recipe | None, hit[2])
    recipe = _plan_recipe(header, plan)
    if len(_RECIPES) >= _RECIPES_MAX:
        _RECIPES.clear()
    _RECIPES[key] = (header, tuple(plan), recipe)
    return recipe


def _plan_recipe(header: blob.BlobHeader, plan: list[int]) -> _Recipe | None:
    torch_from = blob._torch_dtypes()[1]
    bool_code = blob.DTYPE_CODES["bool"][0]
    r = _Recipe()
    r.n = len(header.tensors)
    # per (code, dtype): [(index, start byte, nbytes, shape)]
    groups: dict[tuple[int, Any], list[tuple[int, int, int, tuple[int, ...]]]] = {}
    pack, r.pack_size = _placed(header.tensors, plan, PACK)
    bell, r.bell_size = _placed(header.tensors, plan, BELL)
    starts = {i: at for at, i, _n in pack + bell}
    for i, (code, d) in enumerate(zip(plan, header.tensors)):
        if d.kind != blob.KIND_TORCH:
            return None
        dt = torch_from.get(d.dtype)
        if dt is None:
            return None  # the slow path names the error
        shape = tuple(d.shape)
        if code == EMPTY:
            r.empties.append((i, dt, shape))
        elif code == INLINE:
            r.inlines.append((i, dt, shape, d.dtype == bool_code))
        elif code == P2P:
            r.singles.append((i, dt, shape))
        elif code in (PACK, BELL):
            start = starts[i]
            if start % dt.itemsize:
                return None  # pragma: no cover - every start is a multiple of 64
            if d.dtype == bool_code:
                r.bool_in.add(code)
            groups.setdefault((code, dt), []).append((i, start, d.nbytes, shape))
        else:
            return None  # STAGED: host data copied back from the device, the slow path
    r.allocs = ([None] if r.pack_size else []) + [(shape, dt) for _i, dt, shape in r.singles]
    if len(bell) == 1 and bell[0][2] == r.bell_size:
        i = bell[0][1]
        r.region_alloc = (tuple(header.tensors[i].shape), torch_from[header.tensors[i].dtype])
    for (code, dt), members in groups.items():
        size = dt.itemsize
        sizes: list[int] = []
        picks: list[tuple[int, int, Any]] = []
        at = 0  # in items
        for i, start, nbytes, shape in members:
            first = start // size
            if first > at:
                sizes.append(first - at)
            picks.append((i, len(sizes), shape if len(shape) != 1 else None))
            sizes.append(nbytes // size)
            at = first + nbytes // size
        r.runs.append((code, dt, sizes, picks))
    return r


def receive_allocs(
    header: blob.BlobHeader, plan: list[int],
) -> tuple[list[tuple[tuple[int, ...], Any] | None] | None, tuple[tuple[int, ...], Any] | None]:
    """How the receiver may allocate a payload's buffers so that each P2P buffer, and a
    region holding one tensor exactly, is that tensor (its dtype and shape: NCCL moves
    bytes, so no view is built afterwards): per bulk buffer (``check_sizes`` order)
    ``(shape, dtype)`` or ``None`` for uint8, and the region's ``(shape, dtype)`` or
    ``None``; ``(None, None)`` where the payload has no view recipe (allocate uint8)."""
    r = _recipe(header, plan)
    if r is None:
        return None, None
    return r.allocs, r.region_alloc


def _region_is_its_tensor(r: _Recipe, region: Any) -> bool:
    """Whether ``region`` was allocated as the one tensor it holds (``receive_allocs``)."""
    alloc = r.region_alloc
    return alloc is not None and region.dtype == alloc[1] and region.shape == alloc[0]


def _fast_views(r: _Recipe, received: list[Any], region: Any, inline: list[Any] = ()) -> list[Any] | None:
    """The views of ``_Recipe`` ``r`` over the received buffers (the pack first, then
    one per P2P descriptor), the region and the inline parts (each INLINE tensor a copy
    of its part, ``torch.frombuffer``: a third of the numpy route's time); ``None`` when
    the buffers are not as the recipe needs (the slow path then names what is wrong).

    Raises
    ------
    BlobDecodeError
        An INLINE bool tensor's bytes are other than 0 and 1.
    """
    import torch

    if len(inline) != len(r.inlines):
        return None
    views: list[Any] = [None] * r.n
    k = 0
    pack = None
    if r.pack_size:
        if not received:
            return None
        pack = received[0]
        k = 1
    if len(received) - k != len(r.singles):
        return None
    if r.bell_size and (region is None or r.bell_size > int(region.nbytes)):
        raise BlobDecodeError(f"BELL tensors of {r.bell_size} bytes do not fit the region")
    if r.bool_in and ((PACK in r.bool_in and pack is not None and not pack.is_cuda)
                      or (BELL in r.bool_in and region is not None and not region.is_cuda
                          and not _region_is_its_tensor(r, region))):
        # Host bool bytes are checked one by one (the slow path), except in a buffer
        # allocated as the bool tensor itself (handed out as it is, as a P2P one is).
        return None
    for (i, dt, shape), buf in zip(r.singles, received[k:]):
        if buf.dtype == dt and buf.shape == shape:
            views[i] = buf  # allocated as the tensor itself (``receive_allocs``)
            continue
        if buf.device.type == "cpu" and dt == torch.bool:
            return None
        views[i] = buf.view(dt).view(shape)
    for code, dt, sizes, picks in r.runs:
        whole = pack if code == PACK else region
        if whole is None or whole.storage_offset() % blob.FRAME_ALIGN:
            return None
        if code == BELL and _region_is_its_tensor(r, whole):
            views[picks[0][0]] = whole  # the region allocated as its one tensor (``receive_allocs``)
            continue
        typed = _typed(whole, dt)
        rest = int(typed.numel()) - sum(sizes)
        if rest < 0:
            return None
        pieces = typed.split_with_sizes([*sizes, rest])  # the rest of the buffer last
        for i, piece, shape in picks:
            t = pieces[piece]
            views[i] = t if shape is None else t.view(shape)
    for i, dt, shape in r.empties:
        views[i] = torch.empty(shape, dtype=dt)
    frombuffer = torch.frombuffer
    for (i, dt, shape, is_bool), part in zip(r.inlines, inline):
        if is_bool and bytes(part).strip(b"\x00\x01"):
            raise BlobDecodeError(f"tensor {i}: bool data holds bytes other than 0 and 1")
        views[i] = frombuffer(bytearray(part), dtype=dt).view(shape)
    return views


def _slow_views(
    header: blob.BlobHeader, plan: list[int], inline: list[bytes], received: list[Any], region: Any,
) -> list[Any]:
    """``build_views`` one descriptor at a time (any plan; names every error)."""
    import numpy as np
    import torch

    torch_from = blob._torch_dtypes()[1]
    numpy_from = blob._numpy_dtypes()[1]
    views: list[Any] = []
    it_recv = iter(received)
    it_inline = iter(inline)
    offsets, pack_size = pack_layout(header, plan)
    pack: Any = next(it_recv) if pack_size else None
    it_offsets = iter(offsets)
    bell_buf = region  # (``region`` names each host tensor's bytes below)
    bell_offsets, bell_size = bell_layout(header, plan)
    if bell_size and (bell_buf is None or bell_size > int(bell_buf.numel())):
        raise BlobDecodeError(f"BELL tensors of {bell_size} bytes do not fit the region")
    it_bell = iter(bell_offsets)
    typed_views: dict[tuple[int, Any], Any] = {}
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
            if code == PACK or code == BELL:
                whole, start = (pack, next(it_offsets)) if code == PACK else (bell_buf, next(it_bell))
                if d.kind == blob.KIND_TORCH and (whole.is_cuda or d.dtype != bool_code):
                    # A tensor of the pack or the region (host bool data goes below, to have
                    # its bytes checked): one as_strided of the buffer's view as its dtype
                    # (made once per dtype), the cheapest view torch makes (a slice and
                    # two views cost 2.5x as much).
                    typed = typed_views.get((code, dt))
                    if typed is None:
                        typed = typed_views[(code, dt)] = _typed(whole, dt)
                    views.append(typed.as_strided(d.shape, blob._contiguous_strides(tuple(d.shape)),
                                                  start // dt.itemsize))
                    continue
                buf = whole[start: start + d.nbytes]
            else:
                buf = next(it_recv)
            if buf.device.type != "cpu":
                if d.kind != blob.KIND_TORCH or code == STAGED:
                    raise BlobDecodeError(
                        f"tensor {i}: host data ({_PLAN_NAMES[code]}) arrived in device memory"
                    )
                # A device tensor: a view of its receive buffer. Its bool bytes came
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


def _typed(whole: Any, dt: Any) -> Any:
    """``whole`` (a uint8 buffer that starts at a multiple of 64 bytes of its storage:
    its own allocation, or a row of a slab) as ``dt``: its whole itemsizes (every tensor
    of the region starts at a multiple of 64 and spans whole items, so it lies inside)."""
    if whole.storage_offset() % blob.FRAME_ALIGN:
        raise BlobDecodeError("nccl: a receive buffer does not start its storage")  # pragma: no cover
    n = int(whole.numel())
    usable = n - n % dt.itemsize
    return (whole if usable == n else whole[:usable]).view(dt)


def decode_tree(header: blob.BlobHeader, views: list[Any]) -> Any:
    """The payload tree of ``header`` with tensor references replaced by ``views``."""
    return blob._decode_tree(header, views)


# ================================================================== templates
# A stream of payloads of one shape (a stage's chunk every step: the same dict of the
# same tensors, other scalars) is sent by a template once the sender has seen that shape
# twice: the envelope that sends it whole the second time also defines the template
# (``FLAG_DEFINE``, ``tmpl``: its id), and the next ones are sent by it: their envelope
# carries no tensor_blob header and no plan, only ``tmpl``, the INLINE parts and the
# tree as msgpack with ``None`` in place of each tensor (``host``). The sender checks
# each payload against the template with one compiled function (``SendTemplate.match``:
# its dict keys, its lists' lengths, the type of every leaf, each tensor's type, dtype, shape, device and
# layout) instead of walking it into a tensor_blob, and the receiver builds it by putting
# the received tensors in the tree it decodes (``payload_of``) instead of decoding a
# header and a tree of references. What a payload of a template may hold: a dict of
# ``str`` keys, nested dicts of the same and lists (matched by their length), whose
# leaves are tensors (each planned EMPTY, P2P, PACK or INLINE) and plain scalars
# (``str``, ``int``, ``float``, ``bool``, ``None``); any other payload (a tuple, bytes,
# a numpy array in it), or one that differs from every template, is sent whole.


def _no_ext(code: int, data: memoryview) -> Any:
    raise BlobDecodeError(f"an extension type ({code}) in a plain tree")


_HOST_DECODER = msgspec.msgpack.Decoder(dict, ext_hook=_no_ext)
_HOST_ENCODE = msgspec.msgpack.Encoder().encode


def _size_of(size_base: int, data_len: int, host_len: int) -> int:
    """The tensor_blob frame size of a payload of a template whose tree's msgpack (with
    ``None`` for each tensor) is ``host_len`` bytes: its header differs from the
    template's payload's only there (each tensor a 6-byte reference in the header, a
    1-byte ``None`` in the tree)."""
    return blob._frame_bytes(size_base + host_len, data_len)


def _tree_paths(tree: Any, is_tensor: Any) -> tuple[list[tuple[Any, ...]], Any] | None:
    """The paths of the tensors of ``tree`` in walk order (tensor_blob's: dict order,
    list order, depth first; a path step is a dict key or a list index) and the tree
    with ``None`` in their place, or ``None`` when ``tree`` is not a template's shape
    (see above)."""
    paths: list[tuple[Any, ...]] = []
    nodes = [0]

    def value(v: Any, p: tuple[Any, ...]) -> Any:
        nodes[0] += 1
        if nodes[0] > MAX_TEMPLATE_NODES:
            raise ValueError
        if is_tensor(v):
            paths.append(p)
            return None
        if type(v) is dict:
            return walk(v, p)
        if type(v) is list:
            return [value(x, (*p, i)) for i, x in enumerate(v)]
        if type(v) in PLAIN_LEAVES:
            return v
        raise ValueError

    def walk(x: Any, path: tuple[Any, ...]) -> Any:
        out = {}
        for k, v in x.items():
            if type(k) is not str:
                raise ValueError
            out[k] = value(v, (*path, k))
        return out

    if type(tree) is not dict:
        return None
    try:
        host = walk(tree, ())
    except ValueError:
        return None
    if not paths or len(paths) > MAX_TEMPLATE_TENSORS:
        return None
    return paths, host


class _Shim:
    """What ``_plan_fresh`` and ``_SendRecipe.apply`` read of a prepared payload: a
    template's descriptors with a new payload's tensors."""

    __slots__ = ("_descs", "_sources", "meta", "nbytes")

    def __init__(self, descs: list[Any], sources: list[tuple[int, Any]], nbytes: int) -> None:
        self._descs = descs
        self._sources = sources
        self.meta = b""
        self.nbytes = nbytes


class SendTemplate:
    """The sender's template of one payload shape (``compile_template``).

    ``match(payload)`` -> ``(tree, tensors)``: the tree with ``None`` for each tensor and
    the tensors in descriptor order, or ``None`` at the first difference."""

    __slots__ = ("tid", "match", "descs", "plan", "recipe", "size_base", "data_len", "key")

    def size(self, host_len: int) -> int:
        return _size_of(self.size_base, self.data_len, host_len)


def compile_template(payload: Any, sp: SendPlan, tid: int, *, nccl: bool, device: Any) -> SendTemplate | None:
    """The template of ``payload``, which ``plan_send`` planned as ``sp`` (``sp.prepared``
    its tensor_blob), under id ``tid``; ``None`` when the payload is not of a template's
    shape (see above) or its plan has STAGED or BELL tensors."""
    import torch

    prepared = sp.prepared
    if prepared is None or sp.bell or any(c not in (EMPTY, P2P, PACK, INLINE) for c in sp.plan):
        return None
    tensor = torch.Tensor
    found = _tree_paths(payload, lambda v: type(v) is tensor)  # (a subclass: not a template's)
    if found is None:
        return None
    paths, host = found
    sources = prepared._sources
    descs = prepared._descs
    if len(paths) != len(sources) or any(kind != blob.KIND_TORCH for kind, _ in sources):
        return None
    src = TreeSource({"_T": torch.Tensor, "_S": torch.strided}, lists=True)
    const = src.const
    tensors: dict[tuple[Any, ...], str] = {}

    def entry(v: Any, c: str, p: tuple[Any, ...]) -> str | None:
        if type(v) is tensor:
            tensors[p] = c  # (checked below, in descriptor order)
            return "None"
        return None  # a dict, a list or a leaf (``_tree_paths`` let nothing else through)

    try:
        expr = src.node(payload, "p", (), entry)
    except Unmatchable:  # pragma: no cover - ``_tree_paths`` took the payload
        return None
    index = device.index if device.type == "cuda" else None
    order = []
    for p, (_kind, t_src), code in zip(paths, sources, sp.plan):
        c = tensors[p]
        # The tensor at the path must be the one tensor_blob described there.
        t = payload
        for step in p:
            t = t[step]
        if t is not t_src or t_src.requires_grad:
            return None
        if nccl and code in (P2P, PACK):
            where = f"not {c}.is_cuda or {c}.get_device() != {index}"
        elif code == EMPTY:
            where = f"{c}.device != {const(t_src.device)}"
        else:
            where = f"not {c}.is_cpu"
        src.line(
            f"if type({c}) is not _T or {c}.dtype is not {const(t_src.dtype)} or {c}.shape != "
            f"{const(t_src.shape)} or {where} or {c}.layout is not _S or not {c}.is_contiguous() "
            f"or {c}.requires_grad or {c}.is_neg() or {c}.is_conj(): return None"
        )
        order.append(c)
    src.line(f"return {expr}, {tuple_expr(order)}")
    match = src.compile("<omnilink nccl template>")
    t = SendTemplate()
    t.key = None
    t.tid = tid
    t.match = match
    t.descs = descs
    t.plan = list(sp.plan)
    t.recipe = _SendRecipe.of(prepared, sp, index) if nccl and index is not None else None
    h = len(_HOST_ENCODE(host))
    t.size_base, t.data_len = prepared.header_len - h, prepared.data_len
    if t.size(h) != prepared.nbytes:  # pragma: no cover - the format changed under the template
        return None
    return t


def send_by_template(
    t: SendTemplate, payload: Any, *, device: Any, nccl: bool, inline_bytes: int, max_inline_total: int, key: str,
    pack_bytes: int, pad: Any, bell_bytes: int,
) -> tuple[SendPlan, bytes] | None:
    """The plan of ``payload`` by template ``t`` and its tree's msgpack, or ``None``
    when it is not of the template (send it whole)."""
    got = t.match(payload)
    if got is None:
        return None
    host, tensors = got
    try:
        raw = _HOST_ENCODE(host)
    except (OverflowError, TypeError, ValueError):  # an int past 64 bits: sent whole, named there
        return None
    import torch

    shim = _Shim(t.descs, [(blob.KIND_TORCH, x) for x in tensors], t.size(len(raw)))
    try:
        if t.recipe is not None:
            sp = t.recipe.apply(torch, shim, pad, matched=True)
        else:
            sp = _plan_fresh(torch, shim, device=device, nccl=nccl, inline_bytes=inline_bytes,
                             max_inline_total=max_inline_total, key=key, pack_bytes=pack_bytes, pad=pad,
                             bell_bytes=bell_bytes)
    except (ConfigurationError, RuntimeError):
        return None
    if sp is None or sp.plan != t.plan or sp.bell:
        return None
    return sp, raw


class RecvTemplate:
    """The receiver's template of one id: the defining payload's header, plan and
    transfer sizes, where each tensor goes in the tree, and how the frame size follows
    from the tree's size."""

    __slots__ = ("meta", "header", "plan", "sizes", "paths", "inline_sizes", "size_base", "data_len")

    def size(self, host_len: int) -> int:
        return _size_of(self.size_base, self.data_len, host_len)

    @classmethod
    def of(cls, env: Envelope, header: blob.BlobHeader, sizes: list[int], frame: int) -> RecvTemplate:
        """The template ``env`` (already checked) defines.

        Raises
        ------
        BlobDecodeError
            The payload is not of a template's shape (what a sender never defines).
        """
        if env.region or any(c not in (EMPTY, P2P, PACK, INLINE) for c in env.plan):
            raise BlobDecodeError(f"nccl: key {env.key!r} defines a template with STAGED or BELL tensors")

        class Ref:
            __slots__ = ()

        refs = [Ref() for _ in header.tensors]
        try:
            tree = blob._decode_tree(header, refs)
        except BlobDecodeError as exc:
            raise BlobDecodeError(f"nccl: key {env.key!r} defines a template whose tree is malformed: {exc}") from None
        found = _tree_paths(tree, lambda v: type(v) is Ref)
        ids = {id(r): i for i, r in enumerate(refs)}
        if found is not None:
            paths, host = found
            at = []
            for p in paths:
                v = tree
                for step in p:
                    v = v[step]
                at.append(ids[id(v)])
            if at != list(range(len(refs))):
                found = None  # each tensor once, in descriptor order
        if found is None:
            raise BlobDecodeError(f"nccl: key {env.key!r} defines a template, but its payload is not of a template's shape")
        t = cls()
        t.meta = env.meta
        t.header = header
        t.plan = list(env.plan)
        t.sizes = sizes
        t.paths = tuple(paths)
        t.inline_sizes = [len(p) for p in env.inline]
        h = len(_HOST_ENCODE(host))
        t.size_base = len(env.meta) - blob.PREFIX_SIZE - h
        t.data_len = frame - blob._frame_bytes(len(env.meta) - blob.PREFIX_SIZE, 0)
        if t.size(h) != frame:  # pragma: no cover - the format changed under the template
            raise BlobDecodeError(f"nccl: key {env.key!r} defines a template whose size does not follow its tree")
        return t


#: ``_child``'s answer where a received tree has no such child
_MISSING = object()


def _child(node: Any, step: Any) -> Any:
    """``node[step]`` of a received tree (a dict by key, a list by index), or
    ``_MISSING`` where it has no such child (``node`` itself missing included)."""
    t = type(node)
    if t is dict:
        return node.get(step, _MISSING) if type(step) is str else _MISSING
    if t is list and type(step) is int and 0 <= step < len(node):
        return node[step]
    return _MISSING


def payload_of(ann: Announced, views: list[Any]) -> Any:
    """The payload of ``ann`` with ``views`` (one per descriptor) in it: its tensor_blob
    tree, or a templated payload's tree with each view put where its template says.

    Raises
    ------
    BlobDecodeError
        The tree has no ``None`` where the template puts a tensor.
    """
    if ann.paths is None:
        return decode_tree(ann.header, views)
    out = ann.host
    for path, v in zip(ann.paths, views):
        node = out
        for step in path[:-1]:
            node = _child(node, step)
        last = path[-1]
        if _child(node, last) is not None:
            raise BlobDecodeError(
                f"nccl: key {ann.env.key!r}: its tree has no free place at {list(path)} for a tensor of its template"
            )
        node[last] = v
    return out
