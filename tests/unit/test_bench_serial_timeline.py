"""``benchmarks/bench_serial_gpu.py``'s pure functions (no GPU): the two-process timeline
(spans are assigned to the payload whose [t0, t1] they overlap, offsets are taken from
that payload's t0, negative for a span that began before it, and functions that only
some payloads ran say so), the rows of a road run in several process pairs, and where a
connector keeps its device pool's end."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_serial_gpu.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serial_gpu", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_serial_gpu"] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("bench_serial_gpu", None)


def test_timeline_assigns_spans_to_their_payload_on_one_clock(bench):
    us = 1000  # ns
    t0s = [0, 1000 * us, 2000 * us]
    t1s = [500 * us, 1500 * us, 2500 * us]
    tx = [("put", 10 * us, 110 * us), ("put", 1010 * us, 1130 * us), ("put", 2010 * us, 2090 * us),
          ("beat", 700 * us, 705 * us)]  # between payloads: in no payload's window
    rx = [("get", 200 * us, 300 * us), ("get", 1150 * us, 1300 * us), ("get", 2100 * us, 2200 * us),
          ("decode", 1200 * us, 1220 * us), ("decode", 1230 * us, 1250 * us)]  # twice in payload 1
    rows = {(r["side"], r["fn"]): r for r in bench.timeline(t0s, t1s, tx, rx)}
    assert ("sender", "beat") not in rows
    put = rows[("sender", "put")]
    assert put["payloads"] == 3 and put["start_us"] == 10.0 and put["incl_us"] == 100.0
    get = rows[("receiver", "get")]
    assert get["start_us"] == 150.0 and get["incl_us"] == 100.0 and get["calls"] == 1
    dec = rows[("receiver", "decode")]
    assert dec["payloads"] == 1 and dec["calls"] == 2 and dec["incl_us"] == 40.0
    # A receiver's get that waited from before the payload's put: a negative start.
    rx2 = rx + [("wait", 900 * us, 1140 * us)]
    wait = {(r["side"], r["fn"]): r for r in bench.timeline(t0s, t1s, tx, rx2)}[("receiver", "wait")]
    assert wait["payloads"] == 1 and wait["start_us"] == -100.0 and wait["incl_us"] == 240.0
    # Sender rows first, each side by start offset.
    order = [(r["side"], r["fn"]) for r in bench.timeline(t0s, t1s, tx, rx)]
    assert order.index(("sender", "put")) < order.index(("receiver", "get")) < order.index(("receiver", "decode"))


def test_tracer_records_spans_of_omnilink_functions_and_only_those_asked_for(bench):
    torch = pytest.importorskip("torch")
    import uuid

    import omnilink
    from omnilink.connectors.shm import connector as shm_connector

    spans: list = []
    uninstall = bench.install_tracer(spans, ("ShmConnector.put", "blob.prepare"))
    try:
        ch = f"t/tl-{uuid.uuid4().hex[:8]}"
        with omnilink.connect("shm", channel=ch, role="sender", linger=0) as tx, \
                omnilink.connect("shm", channel=ch, role="receiver") as rx:
            tx.put("k", bench._payload(torch.zeros(4), 3), timeout=5)
            got = rx.get("k", timeout=5)
            assert got["meta"]["chunk_id"] == 3 and got["meta"]["finished"].dtype == torch.bool
        names = {n for n, _, _ in spans}
        assert names == {"shm.connector.ShmConnector.put", "blob.prepare"}, names
        assert all(b >= a for _, a, b in spans)
    finally:
        uninstall()
    # Nothing stays wrapped for the rest of the process.
    assert not hasattr(shm_connector.ShmConnector.put, "__wrapped__")
    assert not hasattr(shm_connector._prepare, "__wrapped__")


def test_pairs_pool_every_payload_and_keep_each_pairs_p50(bench):
    fast = [100e-6 + i * 1e-7 for i in range(11)]  # p50 100.5 us
    slow = [180e-6 + i * 1e-7 for i in range(11)]  # p50 180.5 us
    runs = [({4096: bench._stats(fast)}, {4096: fast}), ({4096: bench._stats(slow)}, {4096: slow})]
    row = bench.pool_pairs(runs, [4096])[4096]
    assert row["n"] == 22
    assert row["pair_p50_us"] == pytest.approx([100.5, 180.5])
    assert row["p50_us"] == pytest.approx((101e-6 + 180e-6) / 2 * 1e6)


class _Holder:
    value = 0

    class Inner:
        fn = None


def test_knobs_resolve_and_switch_in_blocks(bench):
    mod = __name__
    owner, name, vals = bench.resolve_knob(f"{mod}:_Holder.value=1,2")
    assert owner is _Holder and name == "value" and vals == [1, 2]
    owner, name, vals = bench.resolve_knob(f"{mod}:_Holder.Inner.fn=@{mod}:_Holder,None")
    assert owner is _Holder.Inner and name == "fn" and vals == [_Holder, None]
    knobs = [bench.resolve_knob(f"{mod}:_Holder.value=10,20,30")]
    seen = [(bench.set_knobs(knobs, i, 2), _Holder.value) for i in range(7)]
    assert seen == [(0, 10), (0, 10), (1, 20), (1, 20), (2, 30), (2, 30), (0, 10)]


def test_pool_end_finds_the_route_s_or_the_connector_s_own(bench):
    class Route:
        _tx = "route sender"

    class Shm:
        _ipc = Route()

    class Own:
        _ipc = None
        _sender = "own sender"

    class Neither:
        pass

    assert bench._pool_end(Shm(), "_tx", "_sender") == "route sender"
    assert bench._pool_end(Own(), "_tx", "_sender") == "own sender"
    assert bench._pool_end(Neither(), "_tx", "_sender") is None
