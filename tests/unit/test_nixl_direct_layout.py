"""The nixl sender's layout of a WRITE whose large CUDA tensors go from their own
memory: the staged runs and the direct tensors tile the data region exactly once, and
every other tensor is staged inside its run at its place."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from omnilink.connectors.nixl.connector import direct_layout


class _T:
    """A stand-in tensor (only its identity matters)."""


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5000), st.booleans()), min_size=1, max_size=10),
       st.integers(0, 3))
def test_staged_runs_and_direct_tensors_tile_the_data_region(specs, tail):
    sources, direct, at = [], [], 0
    for gap, nb, is_direct in specs:
        at += gap * 64
        t = _T()
        sources.append((at, nb, t))
        if is_direct and nb:
            direct.append((at, nb, t))
        at += nb
    n = at + tail * 64
    runs, where, staged, total = direct_layout(sources, direct, n)
    pieces = sorted([(o, ln, "run") for o, ln in runs] + [(o, nb, "direct") for o, nb, _t in direct])
    pos = 0
    for o, ln, _kind in pieces:
        assert o == pos and ln > 0  # no gap, no overlap, nothing empty
        pos = o + ln
    assert pos == n
    assert total == sum(ln for _o, ln in runs) == n - sum(nb for _o, nb, _t in direct)
    assert where == [sum(ln for _o, ln in runs[:i]) for i in range(len(runs))]
    direct_ids = {id(t) for *_x, t in direct}
    want = [(o, nb, t) for o, nb, t in sources if id(t) not in direct_ids]
    assert [t for *_x, t in staged] == [t for *_x, t in want]
    for (so, nb, _t), (o, _nb, _t2) in zip(staged, want):
        k = max(i for i, (ro, _ln) in enumerate(runs) if ro <= o) if nb else None
        if k is None:
            continue
        ro, ln = runs[k]
        assert o + nb <= ro + ln  # the tensor lies inside its run
        assert so == where[k] + (o - ro) and so + nb <= total
