"""The nccl sender's replayed plan (``wire._SendRecipe``) packs exactly what planning
afresh packs, byte for byte, whichever way it builds the pack (one typed ``cat`` of
gapless same-dtype tensors, or byte views with padding). Host tensors stand in for
device ones: the replay is the same code for both."""

from __future__ import annotations

import pytest
import torch

from omnilink import blob
from omnilink.connectors.nccl import wire

PAD = torch.zeros(64, dtype=torch.uint8)


def _fresh(payload):
    prepared = blob.prepare(payload)
    sp = wire._plan_fresh(torch, prepared, device=torch.device("cpu"), nccl=False, inline_bytes=0,
                          max_inline_total=1 << 20, key="k", pack_bytes=1 << 16, pad=PAD, bell_bytes=0)
    return prepared, sp


def _bf16(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(torch.bfloat16)


CASES = {
    # gapless, one dtype, 1-D and 2-D: one typed cat
    "same dtype": (lambda s: {"h": _bf16(4096, s).view(8, 512), "small": [_bf16(2048, s + i) for i in range(16)]}, True),
    # gapless but two dtypes: byte views
    "mixed dtypes": (lambda s: {"a": _bf16(64, s), "ids": torch.arange(s, s + 32, dtype=torch.int64)}, False),
    # 3 bf16 items = 6 bytes: padding between the pack's tensors: byte views
    "with gaps": (lambda s: {"a": _bf16(3, s), "b": _bf16(3, s + 1), "c": _bf16(64, s + 2)}, False),
    # a strided 2-D member: flattened (a copy) for the typed cat
    "strided": (lambda s: {"a": _bf16(4096, s).view(64, 64).t(), "b": _bf16(64, s + 1)}, True),
    # a strided 1-D member: the typed cat takes it as it is
    "strided 1-D": (lambda s: {"a": _bf16(4096, s)[::2], "b": _bf16(64, s + 1)}, True),
    # a 0-d member (2 bytes, padded): byte views
    "0-d": (lambda s: {"a": _bf16(32, s)[3], "b": _bf16(32, s + 1)}, False),
    # a 3-D member: flattened for the typed cat
    "3-D": (lambda s: {"a": _bf16(2048, s).view(4, 8, 64), "b": _bf16(32, s + 1)}, True),
    # prepare detaches a tensor that needs grad: packed like any other
    "needs grad": (lambda s: {"a": torch.randn(64, requires_grad=True), "b": torch.randn(64)}, True),
    "bool": (lambda s: {"a": torch.arange(64) % (s % 3 + 2) == 0, "b": torch.ones(64, dtype=torch.bool)}, True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_replay_packs_what_planning_afresh_packs(name):
    make, typed = CASES[name]
    prepared, sp = _fresh(make(1))
    recipe = wire._SendRecipe.of(prepared, sp, 0)
    assert recipe is not None and bool(recipe.cat) is typed
    for seed in (2, 3):
        payload = make(seed)
        prepared, sp = _fresh(payload)
        replay = recipe.apply(torch, prepared, PAD)
        assert replay is not None and replay.plan == sp.plan
        assert len(replay.p2p) == len(sp.p2p)
        for got, want in zip(replay.p2p, sp.p2p):
            assert got.dtype == torch.uint8 and got.dim() == 1
            assert torch.equal(got, want)


def test_a_float8_pack_is_catted_as_bytes():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8 dtypes")
    payload = {"a": torch.zeros(64, dtype=torch.float8_e4m3fn), "b": torch.zeros(64, dtype=torch.float8_e4m3fn)}
    prepared, sp = _fresh(payload)
    recipe = wire._SendRecipe.of(prepared, sp, 0)
    assert not recipe.cat
    assert torch.equal(recipe.apply(torch, prepared, PAD).p2p[0], sp.p2p[0])


def test_a_pack_whose_tensors_moved_is_planned_afresh():
    # A replay skips the per-tensor checks of the typed cat's tensors: cat itself
    # refuses tensors of two devices, and the pack's device is checked once.
    make, _ = CASES["same dtype"]
    prepared, sp = _fresh(make(1))
    recipe = wire._SendRecipe.of(prepared, sp, 0)
    assert recipe.cat and recipe.pack_device == -1  # host stand-ins
    recipe.pack_device = 0  # as if they had been on the link's GPU: a host pack is not where they were
    assert recipe.apply(torch, blob.prepare(make(2)), PAD) is None


def test_recipes_are_found_by_descriptor_ids_then_by_their_fields(monkeypatch):
    # plan_send looks a payload shape up by the ids of prepare's cached descriptors, then
    # by each descriptor's kind, dtype, bytes and dimensions: a stream of one shape hits
    # by id; descriptors made afresh per payload (numpy data) hit by fields; another
    # dtype of the same bytes is another shape. Host tensors inline on an NCCL link here.
    np = pytest.importorskip("numpy")
    monkeypatch.setattr(wire, "_SEND_PLANS", {})
    monkeypatch.setattr(wire, "_SEND_PLANS_BY_ID", {})
    cuda0 = torch.device("cuda", 0)

    def plan(payload):
        return wire.plan_send(payload, device=cuda0, nccl=True, inline_bytes=1 << 16, max_inline_total=1 << 20,
                              key="k", pack_bytes=1 << 16, pad=PAD, bell_bytes=0)

    def tensors(dt, shape, i):
        return {"h": torch.full(shape, i, dtype=dt), "ids": torch.arange(16) + i}

    for i in range(3):
        sp = plan(tensors(torch.bfloat16, (8, 64), i))
        assert sp.plan == [wire.INLINE, wire.INLINE]
    assert len(wire._SEND_PLANS) == 1 and len(wire._SEND_PLANS_BY_ID) == 1
    plan(tensors(torch.bfloat16, (64, 8), 3))  # same fields, other descriptors: found by fields
    assert len(wire._SEND_PLANS) == 1 and len(wire._SEND_PLANS_BY_ID) == 2
    plan(tensors(torch.float16, (8, 64), 4))  # another dtype of the same bytes: another shape
    assert len(wire._SEND_PLANS) == 2
    for i in range(3):  # numpy data: fresh descriptors each payload, one recipe
        sp = plan({"a": np.full(8, i, dtype=np.int32), "ids": torch.arange(16) + i})
        assert sp.inline[0] == np.full(8, i, dtype=np.int32).tobytes()
    assert len(wire._SEND_PLANS) == 3


def test_a_matched_replay_sends_its_p2p_tensors_themselves():
    # A template's match checked them (contiguous, no grad, where they belong): NCCL
    # sends their bytes from the tensors as they are, no byte view; the pack as before.
    def make(s):
        return {"h": _bf16(1 << 16, s).view(256, 256), "ids": torch.arange(s, s + 40, dtype=torch.int64),
                "small": [_bf16(64, s + i) for i in range(3)]}

    prepared, sp = _fresh(make(1))
    assert wire.P2P in sp.plan and wire.PACK in sp.plan
    recipe = wire._SendRecipe.of(prepared, sp, 0)
    payload = make(2)
    prepared, sp = _fresh(payload)
    replay = recipe.apply(torch, prepared, PAD, matched=True)
    assert replay.plan == sp.plan and len(replay.p2p) == len(sp.p2p) == 2
    assert torch.equal(replay.p2p[0], sp.p2p[0])  # the pack: bytes, as planned afresh
    assert replay.p2p[1] is payload["h"]
    assert torch.equal(replay.p2p[1].reshape(-1).view(torch.uint8), sp.p2p[1])
    assert replay.p2p_bytes == sp.p2p_bytes == sum(int(t.nbytes) for t in replay.p2p)
