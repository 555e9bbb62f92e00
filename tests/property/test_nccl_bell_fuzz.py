"""Hypothesis fuzzing of the nccl backend's doorbell decoder (``wire.read_bell``).

The doorbell message is the whole header of a payload (protocol 6): the receiver sizes
and allocates its receive buffers from it alone, so ``read_bell`` must turn any bytes
into either a validated announcement or a named error (``BlobDecodeError``, or
``CapacityError`` for a payload over ``max_message_bytes``) and never anything else.
What it accepts is consistent: the plan covers every descriptor, the inline parts and
the region match the plan, the buffers it asks for add up to the descriptors' bytes and
stay within ``max_message_bytes``, and building the payload from buffers of those sizes
succeeds or raises a named error. It allocates nothing itself (no torch call at all).
Inputs: valid messages of random payloads (both transports' plans), the same with
fields replaced by hostile values, byte-level mutations of them, and raw noise.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from omnilink import BlobDecodeError, CapacityError, blob
from omnilink.connectors.nccl import wire
from tests.property.strategies import payloads

MAX_HEADER = 1 << 20
MAX_MESSAGE = 1 << 20


def fuzz(n: int):
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _message(payload, *, seq=0, key="k", bell=False):
    """The doorbell message a gloo sender would send for ``payload`` (``bell``: the
    host tensors planned as an NCCL link's BELL region instead, to cover that code)."""
    sp = wire.plan_send(payload, device=torch.device("cpu"), nccl=False, inline_bytes=64,
                        max_inline_total=1 << 20, key=key, pack_bytes=256, pad=torch.zeros(64, dtype=torch.uint8))
    plan, region = list(sp.plan), b""
    if bell:
        header = blob._parse_header(memoryview(sp.meta), *blob.peek_header(sp.meta)[:2])
        end = 0
        parts = bytearray()
        for i, d in enumerate(header.tensors):
            if plan[i] in (wire.P2P, wire.PACK) and d.kind == blob.KIND_TORCH:
                plan[i] = wire.BELL
                at = (end + 63) // 64 * 64
                parts += bytes(at - end) + bytes(d.nbytes)
                end = at + d.nbytes
        region = bytes(parts)
    return wire.encode_envelope(wire.Envelope(seq, key, sp.meta, plan, sp.inline, 0, region))


def _announced(payload, bell):
    """``read_bell`` of ``_message(payload, bell=bell)``, or ``None`` where the payload is
    refused by name (the fuzz tests of the receive path then have nothing to check)."""
    try:
        return wire.read_bell(_message(payload, bell=bell), seq=0, max_header_bytes=MAX_HEADER,
                              max_message_bytes=MAX_MESSAGE, nccl=bell)
    except (BlobDecodeError, CapacityError):
        return None


def _check(raw, nccl):
    """``read_bell`` on ``raw``: a named error, or an announcement that is consistent
    and builds (from zeroed buffers of the sizes it asks for) or fails by name."""
    calls = []
    real = torch.empty
    torch.empty = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        try:
            ann = wire.read_bell(raw, seq=0, max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE, nccl=nccl)
        except (BlobDecodeError, CapacityError):
            return None
    finally:
        torch.empty = real
    assert calls == [], "read_bell allocated"
    env, header = ann.env, ann.header
    assert len(raw) <= MAX_HEADER and ann.frame <= MAX_MESSAGE
    assert env.seq == 0 and env.key and len(env.key.encode()) <= 512
    assert len(env.plan) == len(header.tensors)
    tensor_bytes = sum(d.nbytes for d in header.tensors)
    inline = sum(len(p) for p in env.inline)
    assert sum(ann.sizes) + inline + len(env.region) <= tensor_bytes + 64 * (len(header.tensors) + 1)
    assert ann.nbytes == sum(ann.sizes) + len(env.region)
    assert len(env.region) == wire.bell_layout(header, env.plan)[1]
    if not nccl:
        assert wire.BELL not in env.plan and wire.STAGED not in env.plan
    bufs = [torch.zeros(n, dtype=torch.uint8) for n in ann.sizes]
    region = torch.frombuffer(bytearray(env.region), dtype=torch.uint8) if env.region else None
    try:
        views = wire.build_views(header, env.plan, env.inline, bufs, device=torch.device("cpu"), region=region)
        wire.decode_tree(header, views)
    except BlobDecodeError:
        pass
    return ann


_hostile_ints = st.sampled_from([0, 1, 2, 5, 7, 255, -1, 1 << 31, 1 << 63, -(1 << 63)])
_hostile_keys = st.sampled_from(["", "k", "x" * 513, "a\x00b", "\u00e9" * 300])
_hostile_bytes = st.sampled_from([b"", b"\x00", bytes(64), bytes(4096), b"OLB1", b"\xff" * 30])


@st.composite
def hostile_messages(draw):
    """A valid message of a random payload, with fields replaced by hostile values."""
    payload = draw(payloads)
    bell = draw(st.booleans())
    raw = _message(payload, bell=bell)
    fields = list(msgspec.msgpack.decode(raw))
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(fields) - 1))
        if i in (0, 5):
            fields[i] = draw(_hostile_ints)
        elif i == 1:
            fields[i] = draw(_hostile_keys)
        elif i == 2:
            meta = bytearray(fields[i])
            if meta and draw(st.booleans()):
                at = draw(st.integers(0, len(meta) - 1))
                meta[at] ^= draw(st.integers(1, 255))
            else:
                meta = meta[: draw(st.integers(0, len(meta)))]
            fields[i] = bytes(meta)
        elif i == 3:
            plan = list(fields[i])
            if plan and draw(st.booleans()):
                plan[draw(st.integers(0, len(plan) - 1))] = draw(st.integers(-1, 9))
            else:
                plan = plan + [draw(st.integers(0, 5))] if draw(st.booleans()) else plan[:-1]
            fields[i] = plan
        elif i == 4:
            fields[i] = draw(st.lists(_hostile_bytes, max_size=4))
        else:
            fields[i] = draw(_hostile_bytes)
    if draw(st.booleans()) and len(fields) > 5:
        fields = fields[: draw(st.integers(0, len(fields)))]
    return msgspec.msgpack.encode(fields), bell


@fuzz(400)
@given(payloads, st.booleans())
def test_valid_messages_are_announced_consistently(payload, bell):
    raw = _message(payload, bell=bell)
    ann = _check(raw, nccl=bell)
    frame = omnilink_frame_size(payload)
    plan = msgspec.msgpack.decode(raw)[3]
    # On an NCCL link host data never travels in bulk (it is staged): numpy arrays left
    # P2P or PACK by the gloo plan are refused there.
    legal = not bell or not {wire.P2P, wire.PACK} & set(plan)
    if frame <= MAX_MESSAGE and len(raw) <= MAX_HEADER:
        assert (ann is not None) == legal
        if ann is not None:
            assert ann.frame == frame


def omnilink_frame_size(payload):
    import omnilink

    return omnilink.encoded_size(payload)


@fuzz(1500)
@given(hostile_messages())
def test_hostile_fields_are_named_errors(case):
    raw, bell = case
    _check(raw, nccl=bell)
    _check(raw, nccl=not bell)


@fuzz(1000)
@given(payloads, st.booleans(), st.data())
def test_mutated_bytes_are_named_errors(payload, bell, data):
    raw = bytearray(_message(payload, bell=bell))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[at] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del raw[at: at + data.draw(st.integers(1, 16))]
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    _check(bytes(raw), nccl=bell)


@fuzz(500)
@given(st.binary(max_size=512))
def test_noise_is_a_named_error(raw):
    _check(raw, nccl=False)
    _check(raw, nccl=True)


def test_out_of_sequence_and_oversized_are_refused():
    raw = _message({"t": torch.zeros(300)}, seq=3)
    for seq in (0, 2, 4):
        try:
            wire.read_bell(raw, seq=seq, max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE, nccl=False)
        except BlobDecodeError as exc:
            assert "out of sequence" in str(exc)
        else:
            raise AssertionError("accepted out of sequence")
    assert wire.read_bell(raw, seq=3, max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE, nccl=False)
    try:
        wire.read_bell(raw, seq=3, max_header_bytes=MAX_HEADER, max_message_bytes=1000, nccl=False)
    except CapacityError as exc:
        assert "max_message_bytes=1000" in str(exc)
    else:
        raise AssertionError("accepted over max_message_bytes")


def test_region_with_bulk_transfers_is_refused():
    """A sender puts device tensors in the region only when nothing else of the payload
    goes by the bulk group: a message with both is malformed (the receiver would post
    receives for a payload it also builds from the region)."""
    payload = {"a": torch.arange(16, dtype=torch.float32), "b": torch.arange(4096, dtype=torch.float32)}
    sp = wire.plan_send(payload, device=torch.device("cpu"), nccl=False, inline_bytes=0,
                        max_inline_total=1 << 20, key="k", pack_bytes=0)
    assert sp.plan.count(wire.P2P) == 2
    plan = list(sp.plan)
    plan[0] = wire.BELL  # "a" in the region, "b" still by the bulk group
    raw = wire.encode_envelope(wire.Envelope(0, "k", sp.meta, plan, sp.inline, 0, bytes(64)))
    with pytest.raises(BlobDecodeError, match="region and bulk transfers"):
        wire.read_bell(raw, seq=0, max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE, nccl=True)
    plan[1] = wire.BELL  # both in the region: accepted
    raw = wire.encode_envelope(wire.Envelope(0, "k", sp.meta, plan, sp.inline, 0, bytes(64 + 16384)))
    ann = wire.read_bell(raw, seq=0, max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE, nccl=True)
    assert ann.sizes == [] and ann.nbytes == 64 + 16384


def _same_views(fast, slow, copies=()):
    """``copies``: the indices of INLINE tensors (each path makes its own copy of the
    part; every other tensor is a view of the same received bytes)."""
    assert len(fast) == len(slow)
    for i, (f, s) in enumerate(zip(fast, slow)):
        assert type(f) is type(s)
        if isinstance(s, torch.Tensor):
            assert f.dtype == s.dtype and f.shape == s.shape and f.stride() == s.stride()
            if s.numel():
                if i not in copies:
                    assert f.data_ptr() == s.data_ptr()  # a view of the same received bytes
                assert torch.equal(f.reshape(-1).view(torch.uint8), s.reshape(-1).view(torch.uint8))


@fuzz(300)
@given(payload=payloads, bell=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_cached_recipe_builds_the_views_one_at_a_time_would(payload, bell, seed):
    """The recipe path of ``build_views`` (one split of each typed buffer, planned once
    per header) gives the same views, of the same bytes, as building them one by one,
    for any payload of either transport's plan; what it does not cover it leaves to
    the one-by-one path (it returns None)."""
    ann = _announced(payload, bell)
    if ann is None:
        return
    env, header = ann.env, ann.header
    g = torch.Generator().manual_seed(seed)
    bufs = [torch.randint(0, 2, (n,), dtype=torch.uint8, generator=g) for n in ann.sizes]
    region = torch.randint(0, 2, (len(env.region),), dtype=torch.uint8, generator=g) if env.region else None
    recipe = wire._recipe(header, env.plan)
    assert wire._recipe(header, env.plan) is recipe  # planned once per header
    if recipe is None:
        return
    try:
        fast = wire._fast_views(recipe, bufs, region, env.inline)
    except BlobDecodeError:  # (bool bytes other than 0 and 1: the one-by-one path says so too)
        with pytest.raises(BlobDecodeError, match="bool data"):
            wire._slow_views(header, env.plan, env.inline, bufs, region)
        return
    if fast is None:
        return
    slow = wire._slow_views(header, env.plan, env.inline, bufs, region)
    _same_views(fast, slow, {i for i, c in enumerate(env.plan) if c == wire.INLINE})
    wire.decode_tree(header, fast)


def test_recipe_covers_a_hidden_state_with_many_small_tensors():
    """The shape the recipe is for (vLLM-Omni's: a hidden state plus small tensors of
    several dtypes, packed) takes the recipe path, and its views are right."""
    payload = {
        "hidden": torch.arange(4096, dtype=torch.float32),
        "small": [torch.arange(i + 3, dtype=torch.int64) for i in range(8)] + [torch.ones(2, 3, dtype=torch.float16)],
        "flag": torch.tensor([True]),
    }
    sp = wire.plan_send(payload, device=torch.device("cpu"), nccl=False, inline_bytes=0,
                        max_inline_total=1 << 20, key="k", pack_bytes=1024, pad=torch.zeros(64, dtype=torch.uint8))
    assert sp.plan.count(wire.PACK) == 10
    raw = wire.encode_envelope(wire.Envelope(0, "k", sp.meta, sp.plan, sp.inline, 0, b""))
    ann = wire.read_bell(raw, seq=0, max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE, nccl=False)
    sent = [t.contiguous().reshape(-1).view(torch.uint8) for t in [payload["hidden"]]]
    offsets, size = wire.pack_layout(ann.header, sp.plan)
    pack = torch.zeros(size, dtype=torch.uint8)
    flat = [payload["hidden"], *payload["small"], payload["flag"]]
    packed = [t for t, code in zip(flat, sp.plan) if code == wire.PACK]
    for at, t in zip(offsets, packed):
        b = t.reshape(-1).view(torch.uint8)
        pack[at: at + b.numel()] = b
    bufs = [pack, *sent]
    recipe = wire._recipe(ann.header, sp.plan)
    assert recipe is not None and len(recipe.runs) == 3  # int64, float16, bool
    views = wire._fast_views(recipe, bufs, None)
    assert views is None  # a host bool in the pack: its bytes are checked one by one
    del payload["flag"]
    sp = wire.plan_send(payload, device=torch.device("cpu"), nccl=False, inline_bytes=0,
                        max_inline_total=1 << 20, key="k", pack_bytes=1024, pad=torch.zeros(64, dtype=torch.uint8))
    raw = wire.encode_envelope(wire.Envelope(0, "k", sp.meta, sp.plan, sp.inline, 0, b""))
    ann = wire.read_bell(raw, seq=0, max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE, nccl=False)
    offsets, size = wire.pack_layout(ann.header, sp.plan)
    pack = torch.zeros(size, dtype=torch.uint8)
    for at, t in zip(offsets, payload["small"]):
        b = t.reshape(-1).view(torch.uint8)
        pack[at: at + b.numel()] = b
    recipe = wire._recipe(ann.header, sp.plan)
    views = wire._fast_views(recipe, [pack, *sent], None)
    assert views is not None
    got = wire.decode_tree(ann.header, views)
    assert torch.equal(got["hidden"], payload["hidden"])
    for a, b in zip(got["small"], payload["small"]):
        assert a.dtype == b.dtype and torch.equal(a, b)
        assert pack.data_ptr() <= a.data_ptr() < pack.data_ptr() + size  # views of the pack


@pytest.mark.parametrize("make", [
    lambda: torch.arange(10, dtype=torch.int64),  # 1-D, unit stride: one view
    lambda: torch.arange(20, dtype=torch.float32)[::2],  # 1-D strided: a copy
    lambda: torch.arange(6, dtype=torch.float16).reshape(2, 3),
    lambda: torch.arange(6, dtype=torch.int32).reshape(2, 3).t(),  # not contiguous
    lambda: torch.tensor([7], dtype=torch.int16).as_strided((1,), (2,)),  # size 1, stride 2
    lambda: torch.tensor(3.5),  # 0-d
    lambda: torch.zeros(0, dtype=torch.float64),
    lambda: torch.ones(5, requires_grad=True),
])
def test_flat_bytes_is_the_tensors_bytes(make):
    t = make()
    flat = wire._flat_bytes(t, torch.uint8)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert bytes(flat.numpy()) == t.detach().contiguous().numpy().tobytes()


def test_replayed_plan_recomputes_the_inline_bytes():
    """A payload shape planned once is replayed (``_SEND_PLANS``), with each payload's
    own inline bytes; a tensor no longer where it was makes it plan afresh."""
    dev = torch.device("cuda", 0)  # only named: every tensor below is a small host one
    wire._SEND_PLANS.clear()
    opts = dict(device=dev, nccl=True, inline_bytes=1024, max_inline_total=1 << 20, key="k", pack_bytes=0)
    for step in range(3):
        payload = {"ids": torch.arange(16) * step, "flag": torch.tensor([step % 2 == 0])}
        sp = wire.plan_send(payload, **opts)
        assert sp.plan == [wire.INLINE, wire.INLINE] and len(wire._SEND_PLANS) == 1
        assert sp.inline == [payload["ids"].numpy().tobytes(), payload["flag"].numpy().tobytes()]
    recipe = next(iter(wire._SEND_PLANS.values()))
    prepared = blob.prepare({"ids": torch.arange(16), "flag": torch.tensor([True])})
    assert recipe.apply(torch, prepared, None).inline[0] == torch.arange(16).numpy().tobytes()
    recipe.where[0] = 1  # as if the ids had been on the GPU when it was planned
    assert recipe.apply(torch, prepared, None) is None


@fuzz(300)
@given(payload=payloads, bell=st.booleans(), seed=st.integers(0, 2**31 - 1))
# A host region holding one bool tensor, allocated as it: handed out as it is (it once
# took the checked one-by-one path, which builds a view instead; found by this test).
@example(payload=[torch.zeros((2, 3, 3, 4), dtype=torch.bool)], bell=True, seed=0)
def test_buffers_allocated_as_their_tensors_are_handed_out_as_they_are(payload, bell, seed):
    """Where ``receive_allocs`` says so the receiver allocates each P2P buffer (and a
    region holding one tensor) with the tensor's dtype and shape: ``build_views`` then
    hands out that very buffer (same address, no view), with the same values as the
    one-by-one path reads from the same bytes; other buffers stay uint8."""
    ann = _announced(payload, bell)
    if ann is None:
        return
    env, header = ann.env, ann.header
    allocs, region_alloc = wire.receive_allocs(header, env.plan)
    if allocs is None:
        assert region_alloc is None
        return
    assert len(allocs) == len(ann.sizes)
    g = torch.Generator().manual_seed(seed)
    raw_bufs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in ann.sizes]
    raw_region = torch.randint(0, 256, (len(env.region),), dtype=torch.uint8, generator=g) if env.region else None
    if any(d.dtype == blob.DTYPE_CODES["bool"][0] for d in header.tensors):
        # bool bytes must be 0/1 for the one-by-one path's check (host data)
        raw_bufs = [b % 2 for b in raw_bufs]
        raw_region = raw_region % 2 if raw_region is not None else None

    def typed(shape_dt, src):
        if shape_dt is None:
            return src.clone()
        t = torch.empty(shape_dt[0], dtype=shape_dt[1])
        assert t.nbytes == src.numel()
        t.reshape(-1).view(torch.uint8).copy_(src)
        return t

    bufs = [typed(a, b) for a, b in zip(allocs, raw_bufs)]
    region = typed(region_alloc, raw_region) if raw_region is not None else None
    views = wire.build_views(header, env.plan, env.inline, bufs, device=torch.device("cpu"), region=region)
    slow = wire._slow_views(header, env.plan, env.inline, raw_bufs, raw_region)
    assert len(views) == len(slow)
    for v, s in zip(views, slow):
        if isinstance(s, torch.Tensor):
            assert v.dtype == s.dtype and v.shape == s.shape
            assert torch.equal(v.reshape(-1).view(torch.uint8), s.reshape(-1).view(torch.uint8))
    singles = [i for i, code in enumerate(env.plan) if code == wire.P2P]
    has_pack = bool(allocs) and allocs[0] is None
    assert len(singles) == len(allocs) - has_pack
    for i, buf in zip(singles, bufs[has_pack:]):
        assert views[i] is buf  # the buffer itself, handed out
    if region_alloc is not None:
        (i,) = [i for i, code in enumerate(env.plan) if code == wire.BELL]
        assert views[i] is region


def test_a_hidden_state_is_received_into_itself():
    """The common shapes take the typed allocation: a 2-D bf16 hidden state by NCCL (its
    own buffer) beside packed small tensors, and a small one alone in the region."""
    hidden = torch.arange(8192, dtype=torch.float32).to(torch.bfloat16).view(4, 2048)
    payload = {"hidden": hidden, "ids": torch.arange(5), "pos": torch.arange(5), "meta": {"finished": False}}
    sp = wire.plan_send(payload, device=torch.device("cpu"), nccl=False, inline_bytes=0,
                        max_inline_total=1 << 20, key="k", pack_bytes=1024, pad=torch.zeros(64, dtype=torch.uint8))
    raw = wire.encode_envelope(wire.Envelope(0, "k", sp.meta, sp.plan, sp.inline, 0, b""))
    ann = wire.read_bell(raw, seq=0, max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE, nccl=True)
    allocs, region_alloc = wire.receive_allocs(ann.header, ann.env.plan)
    assert allocs == [None, ((4, 2048), torch.bfloat16)] and region_alloc is None
    raw = _message({"hidden": hidden[:1, :64], "meta": {"finished": True}}, bell=True)
    ann = wire.read_bell(raw, seq=0, max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE, nccl=True)
    assert wire.receive_allocs(ann.header, ann.env.plan) == ([], ((1, 64), torch.bfloat16))
    region = torch.empty((1, 64), dtype=torch.bfloat16)
    views = wire.build_views(ann.header, ann.env.plan, ann.env.inline, [], device=torch.device("cpu"), region=region)
    assert wire.decode_tree(ann.header, views)["hidden"] is region


# ------------------------------------------------------------------ templates
_TEMPLATE_PAYLOAD = {"hidden": torch.arange(40, dtype=torch.float32), "ids": torch.arange(4),
                     "meta": {"finished": False, "chunk": 3, "name": "r"}}


#: A template's payload with lists: of tensors, of a dict holding one, of scalars.
_LISTED_PAYLOAD = {"hidden": torch.arange(40, dtype=torch.float32),
                   "small": [torch.arange(3), torch.ones(2, dtype=torch.bool)],
                   "steps": [{"ids": torch.arange(4) * 2, "done": True}, 7, [None, "x"]]}


def _template_link(payload=_TEMPLATE_PAYLOAD):
    """A receiver's template table holding template 0 (defined by a valid message of
    ``payload``) and the sender's template of it."""
    dev = torch.device("cpu")
    pad = torch.zeros(64, dtype=torch.uint8)
    sp = wire.plan_send(payload, device=dev, nccl=False, inline_bytes=64, max_inline_total=1 << 20,
                        key="d", pack_bytes=256, pad=pad)
    send = wire.compile_template(payload, sp, 0, nccl=False, device=dev)
    assert send is not None
    templates: dict = {}
    raw = wire.encode_envelope(wire.Envelope(0, "d", sp.meta, sp.plan, sp.inline, wire.FLAG_DEFINE, b"", 0))
    wire.read_bell(raw, seq=0, max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE, nccl=False,
                   templates=templates)
    got = wire.send_by_template(send, payload, device=dev, nccl=False, inline_bytes=64,
                                max_inline_total=1 << 20, key="k", pack_bytes=256, pad=pad, bell_bytes=0)
    assert got is not None
    return templates, got


@fuzz(300)
@given(
    tmpl=st.integers(-3, wire.MAX_TEMPLATES + 1),
    flags=st.integers(0, 3),
    host=st.one_of(st.binary(max_size=64), st.builds(msgspec.msgpack.encode, st.recursive(
        st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=3),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
        max_leaves=8))),
    inline=st.one_of(st.none(), st.lists(st.binary(max_size=24), max_size=3)),
)
def test_templated_messages_are_announced_or_named_errors(tmpl, flags, host, inline):
    """Any templated envelope against a receiver that holds template 0: a named error, or
    an announcement whose payload builds from buffers of its sizes (or names what is
    wrong with its tree)."""
    templates, (sp, _host) = _template_link()
    raw = wire.encode_envelope(wire.Envelope(1, "k", b"", [], sp.inline if inline is None else inline, flags,
                                             b"", tmpl, host))
    try:
        ann = wire.read_bell(raw, seq=1, max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE, nccl=False,
                             templates=templates)
    except (BlobDecodeError, CapacityError):
        return
    assert tmpl == 0 and not flags & wire.FLAG_DEFINE and type(ann.host) is dict
    assert ann.env.plan == templates[0].plan and ann.sizes == templates[0].sizes
    bufs = [torch.zeros(n, dtype=torch.uint8) for n in ann.sizes]
    views = wire.build_views(ann.header, ann.env.plan, ann.env.inline, bufs, device=torch.device("cpu"))
    try:
        out = wire.payload_of(ann, views)
    except BlobDecodeError:
        return
    assert out["hidden"].shape == (40,) and out["ids"].shape == (4,)


_plain = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6)


def _nodes(tree, path=()):
    """Every (path, node) of a decoded tree, the root first."""
    yield path, tree
    if type(tree) is dict:
        for k, v in tree.items():
            yield from _nodes(v, (*path, k))
    elif type(tree) is list:
        for i, v in enumerate(tree):
            yield from _nodes(v, (*path, i))


@fuzz(300)
@given(data=st.data())
def test_a_mutated_tree_of_a_template_with_lists_is_built_or_named(data):
    """A templated envelope of a template with lists, whose tree is the valid one with
    one place changed (a value replaced, a list cut or grown, a key renamed): either
    every tensor lands where the template puts it, or a named error."""
    templates, (sp, host) = _template_link(_LISTED_PAYLOAD)
    tree = msgspec.msgpack.decode(host)
    places = [p for p, _ in _nodes(tree) if p]
    path = data.draw(st.sampled_from(places))
    parent = tree
    for step in path[:-1]:
        parent = parent[step]
    how = data.draw(st.sampled_from(["replace", "cut", "grow", "rename"]))
    last = path[-1]
    if how == "replace":
        parent[last] = data.draw(_plain)
    elif how == "cut" and type(parent) is list:
        del parent[last:]
    elif how == "grow" and type(parent) is list:
        parent.append(data.draw(_plain))
    elif how == "rename" and type(parent) is dict:
        parent[str(last) + "_"] = parent.pop(last)
    raw = wire.encode_envelope(wire.Envelope(1, "k", b"", [], sp.inline, 0, b"", 0, msgspec.msgpack.encode(tree)))
    try:
        ann = wire.read_bell(raw, seq=1, max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE, nccl=False,
                             templates=templates)
    except (BlobDecodeError, CapacityError):
        return
    views = wire.build_views(ann.header, ann.env.plan, ann.env.inline, [t.clone() for t in sp.p2p],
                             device=torch.device("cpu"))
    try:
        out = wire.payload_of(ann, views)
    except BlobDecodeError:
        return
    # Each tensor at its place (the tree's plain values are the sender's to change).
    assert torch.equal(out["hidden"], _LISTED_PAYLOAD["hidden"])
    assert torch.equal(out["small"][0], _LISTED_PAYLOAD["small"][0])
    assert torch.equal(out["small"][1], _LISTED_PAYLOAD["small"][1]) and out["small"][1].dtype == torch.bool
    assert torch.equal(out["steps"][0]["ids"], _LISTED_PAYLOAD["steps"][0]["ids"])


def test_a_templated_payload_with_lists_is_built_as_sent():
    templates, (sp, host) = _template_link(_LISTED_PAYLOAD)
    raw = wire.encode_envelope(wire.Envelope(1, "k", b"", [], sp.inline, 0, b"", 0, host))
    ann = wire.read_bell(raw, seq=1, max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE, nccl=False,
                         templates=templates)
    assert ann.frame == sp.nbytes == blob.encoded_size(_LISTED_PAYLOAD)
    assert ann.paths == (("hidden",), ("small", 0), ("small", 1), ("steps", 0, "ids"))
    views = wire.build_views(ann.header, ann.env.plan, ann.env.inline, [t.clone() for t in sp.p2p],
                             device=torch.device("cpu"))
    out = wire.payload_of(ann, views)
    assert out["steps"][1:] == [7, [None, "x"]] and out["steps"][0]["done"] is True
    assert torch.equal(out["small"][1], _LISTED_PAYLOAD["small"][1])


def test_a_templated_payload_is_sized_and_built_as_sent():
    templates, (sp, host) = _template_link()
    raw = wire.encode_envelope(wire.Envelope(1, "k", b"", [], sp.inline, 0, b"", 0, host))
    ann = wire.read_bell(raw, seq=1, max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE, nccl=False,
                         templates=templates)
    assert ann.frame == sp.nbytes == blob.encoded_size(_TEMPLATE_PAYLOAD)
    views = wire.build_views(ann.header, ann.env.plan, ann.env.inline, [t.clone() for t in sp.p2p],
                             device=torch.device("cpu"))
    out = wire.payload_of(ann, views)
    assert torch.equal(out["hidden"], _TEMPLATE_PAYLOAD["hidden"]) and torch.equal(out["ids"], _TEMPLATE_PAYLOAD["ids"])
    assert out["meta"] == _TEMPLATE_PAYLOAD["meta"]
    # Refused without templates, and a template the table does not hold.
    with pytest.raises(BlobDecodeError, match="not defined"):
        wire.read_bell(raw, seq=1, max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE, nccl=False)
    with pytest.raises(CapacityError, match="max_message_bytes"):
        wire.read_bell(raw, seq=1, max_header_bytes=MAX_HEADER, max_message_bytes=sp.nbytes - 1, nccl=False,
                       templates=templates)
