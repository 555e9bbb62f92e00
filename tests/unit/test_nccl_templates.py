"""The nccl backend's templates (``templates=True``), over gloo: a stream of payloads of one
shape is sent by a template once the shape was sent whole twice (the second defines it),
arrives as it was sent, sizes as tensor_blob does, falls back to a whole payload at any
difference, and the receiver refuses templated envelopes that cannot be right with a
named error before anything is allocated."""

from __future__ import annotations

import msgspec
import pytest
import torch

import omnilink
from omnilink import BlobDecodeError
from omnilink.connectors.nccl import wire
from tests.unit.test_nccl_connector import WAIT, _forge_bell, _open, store  # noqa: F401 - store: a fixture


@pytest.fixture
def envelopes(monkeypatch):
    """Every envelope the senders of the test encode."""
    sent: list[wire.Envelope] = []
    real = wire.encode_envelope
    monkeypatch.setattr(wire, "encode_envelope", lambda env: sent.append(env) or real(env))
    return sent


def _chunk(i: int, *, hidden: int = 4096) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"hidden": torch.randn(hidden, generator=g), "ids": torch.arange(16) + i,
            "meta": {"finished": i % 3 == 2, "chunk": i, "name": "r" * (i % 5), "score": i / 3, "none": None}}


def _same(got, want) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert type(got[k]) is torch.Tensor and got[k].dtype == v.dtype and torch.equal(got[k], v), k
        elif isinstance(v, dict):
            _same(got[k], v)
        else:
            assert type(got[k]) is type(v) and got[k] == v, k


def _kinds(envs) -> list[str]:
    """Each envelope as ``whole``, ``define N`` or ``by N``."""
    out = []
    for e in envs:
        if e.flags & wire.FLAG_DEFINE:
            out.append(f"define {e.tmpl}")
        elif e.tmpl >= 0:
            out.append(f"by {e.tmpl}")
        else:
            out.append("whole")
    return out


@pytest.mark.parametrize("inline_bytes", [1024, 0])
def test_a_stream_of_one_shape_goes_by_a_template_and_arrives_as_sent(store, envelopes, inline_bytes):
    # inline_bytes 0: every tensor by the process group, the small ones in the pack.
    with _open(store, "sender", templates=True, inline_bytes=inline_bytes) as tx, _open(store, "receiver") as rx:
        sizes = []
        for i in range(8):
            p = _chunk(i)
            n = tx.put(f"k{i}", p, timeout=WAIT)
            assert n == omnilink.encoded_size(p)  # put's size, as tensor_blob frames it
            sizes.append(n)
            _same(rx.get(f"k{i}", timeout=WAIT), p)
        assert _kinds(envelopes) == ["whole", "define 0"] + ["by 0"] * 6
        assert all(e.meta == b"" and e.plan == [] and e.host for e in envelopes[2:])
        assert rx.stats().bytes_got == sum(sizes)
        if inline_bytes == 0:
            assert wire.PACK in envelopes[1].plan


def _listed(i: int) -> dict:
    """A chunk whose small tensors come in a list (a stage's token ids, positions, ...)
    and a list of dicts."""
    g = torch.Generator().manual_seed(100 + i)
    return {"hidden": torch.randn(4096, generator=g),
            "small": [torch.randn(64, generator=g) + j for j in range(16)],
            "steps": [{"ids": torch.arange(4) + i, "done": i % 2 == 0}, {"ids": torch.arange(3) - i, "done": None}],
            "meta": {"chunk": i, "names": ["a", "b" * (i % 3)]}}


def _same_tree(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor and got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert type(got) is dict and list(got) == list(want)
        for k in want:
            _same_tree(got[k], want[k])
    elif isinstance(want, list):
        assert type(got) is list and len(got) == len(want)
        for a, b in zip(got, want):
            _same_tree(a, b)
    else:
        assert type(got) is type(want) and got == want


@pytest.mark.parametrize("inline_bytes", [1024, 0])
def test_a_stream_with_lists_of_tensors_goes_by_a_template(store, envelopes, inline_bytes):
    with _open(store, "sender", inline_bytes=inline_bytes) as tx, _open(store, "receiver") as rx:
        for i in range(5):
            tx.put(f"k{i}", _listed(i), timeout=WAIT)
            _same_tree(rx.get(f"k{i}", timeout=WAIT), _listed(i))
        assert _kinds(envelopes) == ["whole", "define 0", "by 0", "by 0", "by 0"]
        # A list of another length, or a tuple for a list: another shape, sent whole.
        for i, change in enumerate(("shorter", "longer", "tuple")):
            p = _listed(10 + i)
            if change == "shorter":
                p["small"].pop()
            elif change == "longer":
                p["steps"][1]["extra"] = 1
                p["meta"]["names"].append("c")
            else:
                p["small"] = tuple(p["small"])
            tx.put(f"odd{i}", p, timeout=WAIT)
            got = rx.get(f"odd{i}", timeout=WAIT)
            if change == "tuple":
                assert type(got["small"]) is tuple
                got["small"], p["small"] = list(got["small"]), list(p["small"])
            _same_tree(got, p)
            assert _kinds(envelopes)[-1] == "whole", change
        tx.put("again", _listed(20), timeout=WAIT)
        _same_tree(rx.get("again", timeout=WAIT), _listed(20))
        assert _kinds(envelopes)[-1] == "by 0"


def test_templates_are_on_by_default(store, envelopes):
    with _open(store, "sender") as tx, _open(store, "receiver") as rx:
        assert tx.templates is True
        for i in range(4):
            tx.put(f"k{i}", _chunk(i), timeout=WAIT)
            _same(rx.get(f"k{i}", timeout=WAIT), _chunk(i))
        assert _kinds(envelopes) == ["whole", "define 0", "by 0", "by 0"]


def test_templates_off_sends_every_payload_whole(store, envelopes):
    with _open(store, "sender", templates=False) as tx, _open(store, "receiver") as rx:
        for i in range(4):
            tx.put(f"k{i}", _chunk(i), timeout=WAIT)
            _same(rx.get(f"k{i}", timeout=WAIT), _chunk(i))
        assert _kinds(envelopes) == ["whole"] * 4


@pytest.mark.parametrize("change", ["key added", "key order", "dtype", "shape", "leaf type", "list leaf",
                                    "tensor leaf", "strided", "needs grad"])
def test_a_payload_that_differs_from_its_template_goes_whole(store, envelopes, change):
    # Another plain scalar in a leaf is still the template's shape (its tree carries it).
    with _open(store, "sender", templates=True, inline_bytes=1024) as tx, _open(store, "receiver") as rx:
        for i in range(3):
            tx.put(f"k{i}", _chunk(i), timeout=WAIT)
            rx.get(f"k{i}", timeout=WAIT)
        p = _chunk(9)
        if change == "key added":
            p["extra"] = 1
        elif change == "key order":
            p = {"ids": p["ids"], "hidden": p["hidden"], "meta": p["meta"]}
        elif change == "dtype":
            p["hidden"] = p["hidden"].double()
        elif change == "shape":
            p["hidden"] = p["hidden"].view(64, 64)
        elif change == "leaf type":
            p["meta"]["chunk"] = "nine"
        elif change == "list leaf":
            p["meta"]["chunk"] = [9]
        elif change == "tensor leaf":
            p["meta"]["chunk"] = torch.tensor(9)
        elif change == "strided":
            p["hidden"] = torch.randn(8192)[::2]
        elif change == "needs grad":
            p["hidden"] = p["hidden"].clone().requires_grad_()
        n = tx.put("odd", p, timeout=WAIT)
        assert n == omnilink.encoded_size(p)
        got = rx.get("odd", timeout=WAIT)
        if change == "needs grad":
            p["hidden"] = p["hidden"].detach()
        _same(got, p)
        assert _kinds(envelopes)[-1] == ("by 0" if change == "leaf type" else "whole")
        tx.put("again", _chunk(10), timeout=WAIT)  # the template still serves its shape
        _same(rx.get("again", timeout=WAIT), _chunk(10))
        assert _kinds(envelopes)[-1] == "by 0"


def test_the_sender_may_change_its_tensors_once_put_returns(store):
    # Gloo reads a buffer when the receiver is ready: a templated payload's bulk data is
    # a snapshot too.
    with _open(store, "sender", templates=True, inline_bytes=1024) as tx, _open(store, "receiver") as rx:
        for i in range(3):
            tx.put(f"k{i}", _chunk(i), timeout=WAIT)
            rx.get(f"k{i}", timeout=WAIT)
        p = _chunk(5)
        want = {"hidden": p["hidden"].clone(), "ids": p["ids"].clone(), "meta": dict(p["meta"])}
        tx.put("k5", p, timeout=WAIT)
        p["hidden"].fill_(-1)
        p["ids"].fill_(-1)
        p["meta"]["chunk"] = -1
        _same(rx.get("k5", timeout=WAIT), want)


def test_more_shapes_than_templates_reuse_the_least_recently_used_id(store, envelopes):
    shapes = wire.MAX_TEMPLATES + 2
    with _open(store, "sender", templates=True, inline_bytes=1024) as tx, _open(store, "receiver") as rx:
        for rnd in range(3):
            for s in range(shapes):
                p = _chunk(rnd, hidden=4096 + 64 * s)
                tx.put(f"k{rnd}-{s}", p, timeout=WAIT)
                _same(rx.get(f"k{rnd}-{s}", timeout=WAIT), p)
        kinds = _kinds(envelopes)
        assert kinds[:shapes] == ["whole"] * shapes
        defined = [k for k in kinds if k.startswith("define")]
        # Each shape compiled once: the first MAX_TEMPLATES take the free ids, the two
        # after take the least recently used ones.
        assert len(defined) == shapes
        assert sorted({int(k.split()[1]) for k in defined}) == list(range(wire.MAX_TEMPLATES))
        assert len(tx._tmpl_by_id) == wire.MAX_TEMPLATES == len(rx._tmpl_in)


def test_dual_ends_each_keep_their_own_templates(store, envelopes):
    with _open(store, "dual", rank=0, templates=True) as a, _open(store, "dual", rank=1, templates=True) as b:
        for i in range(4):
            a.put(f"a{i}", _chunk(i), timeout=WAIT)
            b.put(f"b{i}", {"x": torch.arange(5000) + i, "i": i}, timeout=WAIT)
            _same(b.get(f"a{i}", timeout=WAIT), _chunk(i))
            _same(a.get(f"b{i}", timeout=WAIT), {"x": torch.arange(5000) + i, "i": i})
        assert set(a._tmpl_in) == set(b._tmpl_in) == {0}


def test_a_key_reused_while_unread_is_refused_by_template_too(store, envelopes):
    with _open(store, "sender", templates=True, inline_bytes=1024) as tx, _open(store, "receiver") as rx:
        for i in range(3):
            tx.put(f"k{i}", _chunk(i), timeout=WAIT)
            rx.get(f"k{i}", timeout=WAIT)
        tx.put("dup", _chunk(4), timeout=WAIT)
        with pytest.raises(omnilink.DuplicateKeyError):
            tx.put("dup", _chunk(5), timeout=WAIT)
        assert _kinds(envelopes)[-2:] == ["by 0", "by 0"] and envelopes[-1].flags & wire.FLAG_REPEAT
        _same(rx.get("dup", timeout=WAIT), _chunk(4))
        with pytest.raises(omnilink.KeyConsumedError):
            rx.get("dup", timeout=WAIT)
        tx.put("dup", _chunk(6), timeout=WAIT)  # consumed: the key may be used again
        _same(rx.get("dup", timeout=WAIT), _chunk(6))


def test_a_definition_whose_put_failed_is_made_again(store, envelopes, monkeypatch):
    with _open(store, "sender", templates=True, inline_bytes=1024) as tx, _open(store, "receiver") as rx:
        # (a put that times out waiting for room: nothing of it was sent)
        tx.put("k0", _chunk(0), timeout=WAIT)
        real = tx._wait_window

        def refuse(*a, **k):
            raise omnilink.TransferTimeout("no room here")

        monkeypatch.setattr(tx, "_wait_window", refuse)
        with pytest.raises(omnilink.TransferTimeout):
            tx.put("k1", _chunk(1), timeout=WAIT)
        assert tx._tmpl_by_id == {} and envelopes[-1].flags & wire.FLAG_DEFINE
        monkeypatch.setattr(tx, "_wait_window", real)
        for i in (1, 2):
            tx.put(f"k{i}", _chunk(i), timeout=WAIT)
        assert _kinds(envelopes)[-2:] == ["define 0", "by 0"]
        for i in range(3):
            _same(rx.get(f"k{i}", timeout=WAIT), _chunk(i))


# ------------------------------------------------------------------ hostile envelopes
def _defined(store, make=_chunk, **kw):
    """A sender and a receiver whose direction has template 0 (three payloads sent)."""
    tx = _open(store, "sender", templates=True, inline_bytes=1024, **kw)
    rx = _open(store, "receiver")
    for i in range(3):
        tx.put(f"k{i}", make(i), timeout=WAIT)
        rx.get(f"k{i}", timeout=WAIT)
    assert 0 in rx._tmpl_in
    return tx, rx


def _templated(tx, make=_chunk, **fields):
    p = make(7)
    sp, host = wire.send_by_template(tx._tmpl_by_id[0], p, device=tx.device, nccl=False, inline_bytes=1024,
                                     max_inline_total=1 << 20, key="x", pack_bytes=tx.pack_bytes, pad=tx._pad,
                                     bell_bytes=0)
    env = {"seq": tx._send_seq, "key": "x", "meta": b"", "plan": [], "inline": sp.inline, "flags": 0,
           "region": b"", "tmpl": 0, "host": host}
    return wire.Envelope(**(env | fields))


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"tmpl": 5}, "template 5, which was not defined"),
        ({"tmpl": -2}, "template field without a template"),
        ({"meta": b"x"}, "brings a header, a plan or a region"),
        ({"plan": [wire.P2P]}, "brings a header, a plan or a region"),
        ({"inline": [bytes(3)]}, "inline parts of"),
        ({"host": msgspec.msgpack.encode([1, 2])}, "not a msgpack map"),
        ({"host": b"\xc1"}, "not a msgpack map"),
        ({"host": msgspec.msgpack.encode({"a": msgspec.msgpack.Ext(1, b"x")})}, "not a msgpack map"),
        ({"flags": wire.FLAG_DEFINE, "tmpl": wire.MAX_TEMPLATES}, "outside"),
    ],
)
def test_a_hostile_templated_doorbell_fails_the_link_before_allocation(store, monkeypatch, fields, match):
    tx, rx = _defined(store)
    try:
        calls = []
        real_empty = torch.empty
        monkeypatch.setattr(torch, "empty", lambda *a, **k: calls.append(a) or real_empty(*a, **k))
        ops = rx._p2p_ops
        _forge_bell(tx, wire.encode_envelope(_templated(tx, **fields)))
        with pytest.raises(BlobDecodeError, match=match):
            rx.get("x", timeout=WAIT)
        monkeypatch.setattr(torch, "empty", real_empty)
        assert calls == [] and rx._p2p_ops == ops
    finally:
        rx.close()  # first: the sender's close then learns at once that nobody will credit
        tx.close()


@pytest.mark.parametrize("where", ["dict", "list", "short list", "list for a dict"])
def test_a_tree_without_room_for_its_tensors_is_an_error_for_its_key_only(store, where):
    make = _chunk if where == "dict" else _listed
    tx, rx = _defined(store, make)
    try:
        env = _templated(tx, make)
        host = msgspec.msgpack.decode(env.host)
        if where == "dict":
            host["hidden"] = 3  # no free place for the template's first tensor
        elif where == "list":
            host["small"][5] = 0.5
        elif where == "short list":
            host["small"] = host["small"][:3]
        else:
            host["steps"][1] = [None]
        raw = wire.encode_envelope(wire.Envelope(env.seq, "x", b"", [], env.inline, 0, b"", 0,
                                                 msgspec.msgpack.encode(host)))
        _forge_bell(tx, raw)
        with tx._send_lock:  # its bulk data, as a sender would (the stream stays in step)
            tx._send_seq += 1
        sp, _ = wire.send_by_template(tx._tmpl_by_id[0], make(7), device=tx.device, nccl=False,
                                      inline_bytes=1024, max_inline_total=1 << 20, key="x",
                                      pack_bytes=tx.pack_bytes, pad=tx._pad, bell_bytes=0)
        tx._send_gloo(sp.p2p)
        with pytest.raises(BlobDecodeError, match="no free place"):
            rx.get("x", timeout=WAIT)
        tx.put("after", make(8), timeout=WAIT)  # the link keeps serving
        _same_tree(rx.get("after", timeout=WAIT), make(8))
    finally:
        rx.close()  # first: the sender's close then learns at once that nobody will credit
        tx.close()


def test_a_definition_of_a_shape_no_template_takes_fails_the_link(store):
    with _open(store, "sender") as tx, _open(store, "receiver") as rx:
        tx.wait_connected(WAIT)
        rx.wait_connected(WAIT)
        p = {"t": torch.arange(2000), "l": (1, 2)}  # a tuple: no template's shape
        sp = wire.plan_send(p, device=tx.device, nccl=False, inline_bytes=0, max_inline_total=0, key="k")
        env = wire.Envelope(0, "k", sp.meta, sp.plan, sp.inline, wire.FLAG_DEFINE, b"", 0)
        _forge_bell(tx, wire.encode_envelope(env))
        with pytest.raises(BlobDecodeError, match="not of a template's shape"):
            rx.get("k", timeout=WAIT)


def test_templates_must_be_a_bool(store):
    with pytest.raises(omnilink.ConfigurationError, match="templates must be True or False"):
        _open(store, "sender", templates=1)


def test_a_template_compiles_only_the_shapes_it_can_carry():
    dev = torch.device("cpu")

    def plan(p):
        return wire.plan_send(p, device=dev, nccl=False, inline_bytes=1024, max_inline_total=1 << 20, key="k")

    ok = {"a": torch.arange(3), "b": {"c": 1.5, "d": None, "e": True, "f": "s"}}
    assert wire.compile_template(ok, plan(ok), 0, nccl=False, device=dev) is not None
    wide = {"a": torch.arange(3), **{f"k{i}": i for i in range(wire.MAX_TEMPLATE_NODES)}}
    param = {"a": torch.nn.Parameter(torch.ones(3), requires_grad=False)}
    lists = {"a": [torch.arange(3), {"b": [1, None, torch.ones(2)]}], "c": [], "d": [[2.5]]}
    assert wire.compile_template(lists, plan(lists), 0, nccl=False, device=dev) is not None
    for bad in (wide, param, {"a": torch.arange(3), "l": [b"x"]}, {"a": torch.arange(3), "t": (1,)}, {"x": 1},
                {"a": torch.arange(3), "n": __import__("numpy").arange(3)}, [torch.arange(3)]):
        assert wire.compile_template(bad, plan(bad), 0, nccl=False, device=dev) is None, bad
