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
    "mixed dtypes": (lambda s: {"a": _bf16(64, s), "ids": torch.arange(s, s + 32, dtype=torch.int64)}, True),
    # 3 bf16 items = 6 bytes: padding between the pack's tensors
    "with gaps": (lambda s: {"a": _bf16(3, s), "b": _bf16(3, s + 1), "c": _bf16(64, s + 2)}, False),
    # a strided member: the byte-view path copies it
    "strided": (lambda s: {"a": _bf16(4096, s).view(64, 64).t(), "b": _bf16(64, s + 1)}, True),
    # prepare detaches a tensor that needs grad: packed like any other
    "needs grad": (lambda s: {"a": torch.randn(64, requires_grad=True), "b": torch.randn(64)}, True),
    "bool": (lambda s: {"a": torch.arange(64) % (s % 3 + 2) == 0, "b": torch.ones(64, dtype=torch.bool)}, True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_replay_packs_what_planning_afresh_packs(name):
    make, gapless = CASES[name]
    prepared, sp = _fresh(make(1))
    recipe = wire._SendRecipe.of(prepared, sp, 0)
    assert recipe is not None and recipe.gapless is gapless
    for seed in (2, 3):
        payload = make(seed)
        prepared, sp = _fresh(payload)
        replay = recipe.apply(torch, prepared, PAD)
        assert replay is not None and replay.plan == sp.plan
        assert len(replay.p2p) == len(sp.p2p)
        for got, want in zip(replay.p2p, sp.p2p):
            assert got.dtype == torch.uint8 and got.dim() == 1
            assert torch.equal(got, want)


def test_the_typed_cat_is_taken_where_it_can_be_and_left_where_it_cannot():
    make, _ = CASES["same dtype"]
    prepared, sp = _fresh(make(1))
    recipe = wire._SendRecipe.of(prepared, sp, 0)
    assert recipe._cat_typed(torch, prepared._sources) is not None
    for name in ("strided", "mixed dtypes"):
        prepared, sp = _fresh(CASES[name][0](1))
        assert wire._SendRecipe.of(prepared, sp, 0)._cat_typed(torch, prepared._sources) is None, name
    if hasattr(torch, "float8_e4m3fn"):
        payload = {"a": torch.zeros(64, dtype=torch.float8_e4m3fn), "b": torch.zeros(64, dtype=torch.float8_e4m3fn)}
        prepared, sp = _fresh(payload)
        recipe = wire._SendRecipe.of(prepared, sp, 0)
        assert recipe.gapless and recipe._cat_typed(torch, prepared._sources) is None
        assert torch.equal(recipe.apply(torch, prepared, PAD).p2p[0], sp.p2p[0])
