"""Send plans (``omnilink.connectors.devpool.plan``): a stream of same-shaped payloads on
the shm backend's device-IPC route goes by a compiled plan after two payloads laid out
alike, arrives exactly as the general way delivers it, and ``put`` returns the payload's
tensor_blob size; any payload the plan does not describe goes the general way. Over the
host double of the device operations, int64 and bool tensors standing for host tensors
(everything else for device ones), as ``benchmarks/bench_route_cpu.py`` runs it."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import omnilink  # noqa: E402
from omnilink import encoded_size  # noqa: E402
from omnilink.connectors.devpool.plan import compile_plan  # noqa: E402
from tests import cuda_ipc_double as double  # noqa: E402


@pytest.fixture
def pair():
    ch = f"t/plan-{uuid.uuid4().hex[:8]}"
    rx = omnilink.connect("shm", channel=ch, role="receiver", device_ipc="off")
    tx = omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc="off")
    try:
        rx._ipc = double.HostLikeIpcRoute(rx, "on", 4 << 20, 0, None)
        tx._ipc = double.HostLikeIpcRoute(tx, "on", 4 << 20, 0, None)
        # The sender maps the pool (shm's put takes the route first from then on, as it
        # does for a CUDA payload).
        double.route_put(tx, "attach", {"x": torch.zeros(8)})
        rx.get("attach", timeout=5.0)
        yield tx, rx
    finally:
        tx.close()
        rx.close()


def _payload(i: int, **meta: Any) -> dict[str, Any]:
    return {"hidden": torch.randn(2048).to(torch.bfloat16), "ids": torch.arange(16, dtype=torch.int64) + i,
            "meta": {"finished": torch.tensor(i % 2 == 0), "request_id": "req-7", "chunk_id": i, **meta}}


def _sender(tx: Any) -> Any:
    return tx._ipc._tx


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)  # key order too
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


def _roundtrip(tx: Any, rx: Any, key: str, payload: Any) -> Any:
    n = tx.put(key, payload, timeout=5.0)
    got = rx.get(key, timeout=5.0)
    _same(got, payload)
    assert n == encoded_size(payload)
    return got


def test_a_stream_goes_by_its_plan_and_arrives_as_sent(pair):
    tx, rx = pair
    for i in range(40):  # more than the pool's event slots: slots and stages reused
        _roundtrip(tx, rx, f"k{i}", _payload(i))
    s = _sender(tx)
    assert s.planned_puts == 38  # the first two went the general way and made the plan
    assert tx.stats().ipc_puts == 41 and rx.stats().ipc_gets == 41  # (and the fixture's)
    plan = s.tx.plan
    assert [e[4] for e in plan.entries] == [["hidden"], ["ids"], ["meta", "finished"]]


def test_the_views_are_the_pool(pair):
    tx, rx = pair
    for i in range(4):
        tx.put(f"k{i}", _payload(i), timeout=5.0)
        got = rx.get(f"k{i}", timeout=5.0)
    assert _sender(tx).planned_puts == 2
    pool = rx._ipc._rx.pool
    lo, hi = pool.ptr, pool.ptr + pool.nbytes
    for t in (got["hidden"], got["ids"], got["meta"]["finished"]):
        assert lo <= t.data_ptr() < hi  # zero-copy: the decoded tensor is the pool's memory


@pytest.mark.parametrize("first", [None, 0, "default"])
def test_a_planned_payload_copies_before_its_message_from_copy_first_bytes(pair, monkeypatch, first):
    # ``COPY_FIRST_BYTES``: a planned payload at least that large queues its copy before
    # its message is published (None: the message first, as every payload before; the
    # default, 128 MiB: a small one publishes first).
    from omnilink.connectors.devpool import lane as pool_lane
    from omnilink.connectors.devpool import sender as pool_sender

    if first == "default":
        assert pool_sender.COPY_FIRST_BYTES == 128 << 20
    else:
        monkeypatch.setattr(pool_sender, "COPY_FIRST_BYTES", first)
    tx, rx = pair
    s = _sender(tx)
    order: list[str] = []
    real_copy = s.ops.copy_in_local
    monkeypatch.setattr(s.ops, "copy_in_local", lambda *a, **k: order.append("copy") or real_copy(*a, **k))
    real_write = pool_lane.LaneWriter.write_body
    monkeypatch.setattr(pool_lane.LaneWriter, "write_body",
                        lambda self, *a, **k: order.append("publish") or real_write(self, *a, **k))
    for i in range(6):
        order.clear()
        _roundtrip(tx, rx, f"k{i}", _payload(i))
    assert s.planned_puts == 4
    assert order == (["copy", "publish"] if first == 0 else ["publish", "copy"])


def test_a_copied_payload_whose_message_the_lane_refuses_frees_its_block_after_the_copy(pair, monkeypatch):
    # Copy first, then the lane cannot take the message: the block goes back only once
    # the copy into it is done (no later copy races it), and the payload goes the
    # general way.
    from omnilink.connectors.devpool import lane as pool_lane
    from omnilink.connectors.devpool import sender as pool_sender

    monkeypatch.setattr(pool_sender, "COPY_FIRST_BYTES", 0)
    tx, rx = pair
    for i in range(3):
        _roundtrip(tx, rx, f"k{i}", _payload(i))
    s = _sender(tx)
    planned = s.planned_puts
    events: list[Any] = []
    real_settle = s.ops.settle
    monkeypatch.setattr(s.ops, "settle", lambda ev: events.append("settle") or real_settle(ev))
    real_free = pool_sender._Attachment.free
    monkeypatch.setattr(pool_sender._Attachment, "free", lambda self, blk: events.append("free") or real_free(self, blk))
    refused = [True]
    real_write = pool_lane.LaneWriter.write_body

    def write_body(self: Any, *a: Any, **k: Any) -> bool:
        if refused[0]:
            refused[0] = False
            return False  # the planned message: not taken
        return real_write(self, *a, **k)

    monkeypatch.setattr(pool_lane.LaneWriter, "write_body", write_body)
    _roundtrip(tx, rx, "late", _payload(9))
    assert s.planned_puts == planned  # the general way sent it
    assert events[:2] == ["settle", "free"]


leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                 st.floats(allow_nan=False), st.text(max_size=300))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(leaf, leaf), min_size=1, max_size=8))
def test_size_and_content_for_any_scalars(pair, values):
    tx, rx = pair
    base = uuid.uuid4().hex[:6]
    for j in range(2):  # this layout's plan
        _roundtrip(tx, rx, f"{base}-p{j}", _payload(j, extra=None))
    before = _sender(tx).planned_puts
    for j, (a, b) in enumerate(values):
        _roundtrip(tx, rx, f"{base}-{j}", _payload(j, request_id=a, extra=b))
    assert _sender(tx).planned_puts == before + len(values)  # every one by the plan


@pytest.mark.parametrize("change", ["shape", "dtype", "key", "order", "scalar_for_tensor", "tensor_for_scalar",
                                    "not_contiguous", "negative", "list", "big_int", "no_meta"])
def test_a_payload_the_plan_does_not_describe_goes_the_general_way(pair, change):
    tx, rx = pair
    for i in range(3):
        _roundtrip(tx, rx, f"w{i}", _payload(i))
    s = _sender(tx)
    assert s.planned_puts == 1
    p = _payload(7)
    if change == "shape":
        p["hidden"] = torch.randn(1024).to(torch.bfloat16)
    elif change == "dtype":
        p["hidden"] = torch.randn(2048)
    elif change == "key":
        p["other"] = 1
    elif change == "order":
        p = {"ids": p["ids"], "hidden": p["hidden"], "meta": p["meta"]}
    elif change == "scalar_for_tensor":
        p["meta"]["finished"] = True
    elif change == "tensor_for_scalar":
        p["meta"]["chunk_id"] = torch.tensor(3)
    elif change == "not_contiguous":
        p["hidden"] = torch.randn(4096).to(torch.bfloat16)[::2]
    elif change == "negative":
        p["hidden"] = torch._neg_view(p["hidden"])
    elif change == "list":
        p["meta"]["request_id"] = ["a", 1]
    elif change == "big_int":
        p["meta"]["chunk_id"] = 1 << 70
    elif change == "no_meta":
        del p["meta"]
    if change == "big_int":  # not for the lane (nor for tensor_blob): refused as on every road
        with pytest.raises(omnilink.BlobEncodeError):
            tx.put("changed", p, timeout=5.0)
    else:
        _roundtrip(tx, rx, "changed", p)
    assert s.planned_puts == 1  # not by the plan
    _roundtrip(tx, rx, "after", _payload(8))
    assert s.planned_puts == 2  # the plan still there for the stream


def test_a_new_layout_twice_makes_a_new_plan(pair):
    tx, rx = pair
    for i in range(3):
        _roundtrip(tx, rx, f"a{i}", _payload(i))
    first = _sender(tx).tx.plan
    for i in range(3):
        p = _payload(i)
        p["hidden"] = torch.randn(8, 64).to(torch.bfloat16)
        _roundtrip(tx, rx, f"b{i}", p)
    second = _sender(tx).tx.plan
    assert second is not first and second.entries[0][3] == [8, 64]
    assert _sender(tx).planned_puts == 2  # a2, b2


def _decode_step(i: int) -> dict[str, Any]:
    # another layout, as a thinker's decode chunk after its prefill chunks
    return {"hidden": torch.randn(1, 64).to(torch.bfloat16), "ids": torch.tensor([i]),
            "meta": {"finished": torch.tensor(False), "chunk_id": i}}


@pytest.mark.parametrize("order", ["phases", "in_turn"])
def test_layouts_sent_in_turn_keep_a_plan_each(pair, monkeypatch, order):
    from omnilink.connectors.devpool import sender as pool_sender

    calls = []
    real = pool_sender.compile_plan
    monkeypatch.setattr(pool_sender, "compile_plan", lambda *a: calls.append(1) or real(*a))
    tx, rx = pair
    s = _sender(tx)
    if order == "phases":  # a request's prefill chunks, then its decode chunks, request after request
        kinds = [k for _ in range(4) for k in "p" * 6 + "d" * 6]
    else:  # requests at different steps, stepped round robin: the layouts alternate
        kinds = list("pd" * 24)
    for i, k in enumerate(kinds):
        _roundtrip(tx, rx, f"k{i}", _payload(i) if k == "p" else _decode_step(i))
    # Each layout compiled once, then kept: every payload after the first two of each
    # layout (phases), or after each layout was seen twice (in turn), went by a plan.
    assert len(calls) == 2 and len(s.tx.plans) == 2
    assert s.planned_puts == len(kinds) - 4


def test_a_sender_keeps_at_most_max_plans(pair):
    from omnilink.connectors.devpool import sender as pool_sender

    tx, rx = pair
    s = _sender(tx)
    n = pool_sender.MAX_PLANS + 2
    for j in range(n):  # n layouts (sizes of the hidden state), three payloads each
        for i in range(3):
            p = _payload(i)
            p["hidden"] = torch.randn(64 * (j + 1)).to(torch.bfloat16)
            _roundtrip(tx, rx, f"l{j}-{i}", p)
    kept = [p.entries[0][3] for p in s.tx.plans]
    assert kept == [[64 * (j + 1)] for j in reversed(range(n))][: pool_sender.MAX_PLANS]
    assert s.planned_puts == n  # the third payload of each layout
    p = _payload(0)
    p["hidden"] = torch.randn(64).to(torch.bfloat16)  # the first layout's plan was dropped
    _roundtrip(tx, rx, "again", p)
    assert s.planned_puts == n


def test_a_key_still_unread_is_refused_as_the_general_way_refuses_it(pair):
    tx, rx = pair
    for i in range(3):
        _roundtrip(tx, rx, f"w{i}", _payload(i))
    tx.put("dup", _payload(1), timeout=5.0)
    with pytest.raises(omnilink.OmnilinkError, match="dup"):
        tx.put("dup", _payload(2), timeout=5.0)
    got = rx.get("dup", timeout=5.0)
    assert int(got["ids"][0]) == 1  # the first one, untouched


def test_plans_off_sends_everything_the_general_way(pair):
    tx, rx = pair
    _sender(tx).plans = False
    for i in range(5):
        _roundtrip(tx, rx, f"k{i}", _payload(i))
    assert _sender(tx).planned_puts == 0 and _sender(tx).tx.plan is None


def test_compile_plan_refuses_what_it_does_not_cover():
    t = torch.ones(4)
    entries = [[1, 0, 16, [4], ["x"]]]
    chosen = [(("x",), t, 1)]
    checks = ("False", "False")
    assert compile_plan({"x": t}, entries, chosen, 256, 0, checks) is not None
    assert compile_plan([t], entries, chosen, 256, 0, checks) is None  # not a dict
    assert compile_plan({"x": t, "l": [1]}, entries, chosen, 256, 0, checks) is None  # a list
    assert compile_plan({"x": t, 1: 2}, entries, chosen, 256, 0, checks) is None  # a key not a str
    assert compile_plan({"x": t, "b": b"x"}, entries, chosen, 256, 0, checks) is None  # bytes
    host_only = [[1, 0, 16, [4], ["x"], 1]]
    assert compile_plan({"x": t}, host_only, [(("x",), t, 2)], 256, 0, checks) is None  # no device tensor
    plan = compile_plan({"x": t, "m": {"s": "a"}}, entries, chosen, 256, 0, checks)
    assert plan.match({"x": torch.zeros(4), "m": {"s": 5}})[0] == {"x": None, "m": {"s": 5}}
    assert plan.match({"x": torch.zeros(4), "m": {"s": object()}}) is None
    assert plan.match({"x": torch.zeros(5), "m": {"s": 5}}) is None
    assert plan.match({"m": {"s": 5}, "x": torch.zeros(4)}) is None


# ------------------------------------------------------------------ the receiver's side
from omnilink.connectors.devpool.receiver import next_block  # noqa: E402


@pytest.mark.parametrize("blocks, want", [
    ([0, 4608, 0, 4608, 0], 4608),                      # dropped before each get: two blocks in turn
    ([9, 0, 4608, 0, 4608], 0),
    ([7, 7, 7], 7),                                       # the same block every time
    ([1, 2, 3, 4, 1, 2, 3, 4, 1], 2),                    # a consumer that keeps three
    ([1, 2, 3, 1, 2, 4, 1], None),                        # no cycle
    ([1, 2, 3, 4, 1, 2, 3, 5], None),
    ([5, 6], None),                                       # too short to tell
    ([], None),
])
def test_next_block(blocks, want):
    assert next_block(blocks) == want


def _rx_pool(rx: Any) -> Any:
    return rx._ipc._rx


def test_views_made_while_waiting_are_the_ones_landed(pair):
    tx, rx = pair
    prx = _rx_pool(rx)
    for i in range(6):
        _roundtrip(tx, rx, f"w{i}", _payload(i))
    assert prx.prebuild()  # what a waiting get does (the connector's ``_wait_hook``)
    made = prx._pre
    assert made is not None and not prx.prebuild()  # once
    p = _payload(6)
    tx.put("k6", p, timeout=5.0)
    got = rx.get("k6", timeout=5.0)
    _same(got, p)
    assert prx.prebuilt_hits == 1 and prx._pre is None
    assert got["hidden"].data_ptr() == made[5][0].data_ptr()  # the very views made ahead
    del got, made
    import gc

    gc.collect()
    assert not prx.pool.held  # the block went back when its last view died


def test_views_made_for_another_block_are_dropped(pair):
    tx, rx = pair
    prx = _rx_pool(rx)
    for i in range(6):
        _roundtrip(tx, rx, f"w{i}", _payload(i))
    assert prx.prebuild()
    p = _payload(6)
    p["hidden"] = torch.randn(3000).to(torch.bfloat16)  # another layout: another block size
    _roundtrip(tx, rx, "other", p)
    assert prx.prebuilt_hits == 0 and prx._pre is None
    kept = []
    for i in range(16):  # a consumer that keeps the last two: a cycle of four blocks
        p = _payload(i)
        tx.put(f"k{i}", p, timeout=5.0)
        prx.prebuild()
        got = rx.get(f"k{i}", timeout=5.0)
        _same(got, p)
        kept.append(got)
        del kept[:-2]
    assert prx.prebuilt_hits >= 1
    kept.clear()
    del got
    import gc

    gc.collect()
    assert not prx.pool.held


def test_a_waiting_get_prepares_the_landing(pair):
    import threading
    import time

    tx, rx = pair
    prx = _rx_pool(rx)
    n = 30
    sent = [_payload(i) for i in range(n)]
    errors: list[BaseException] = []
    waiting = threading.Event()

    def consume() -> None:
        try:
            for i in range(n):
                waiting.set()
                got = rx.get(f"k{i}", timeout=10.0)  # waits: its first miss prebuilds
                _same(got, sent[i])
                del got
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=consume)
    t.start()
    for i in range(n):
        waiting.wait(5.0)
        waiting.clear()
        time.sleep(0.005)  # the consumer is waiting by now
        tx.put(f"k{i}", sent[i], timeout=5.0)
    t.join(30)
    assert not errors, errors
    assert prx.prebuilt_hits >= n // 2  # most landings found their views made


def test_landings_in_phases_of_layouts_find_their_views_made(pair):
    """A stage's payloads come in phases (prefill chunks, then decode ones, then the next
    request's prefill): after one round of phases, every landing but the first of each
    phase finds its views made, the block remembered from the phase before."""
    tx, rx = pair
    prx = _rx_pool(rx)

    def phase(tag: str, size: int, n: int) -> tuple[int, int]:
        hits, landed = prx.prebuilt_hits, 0
        for i in range(n):
            p = _payload(i)
            p["hidden"] = torch.randn(size).to(torch.bfloat16)
            prx.prebuild()  # what a waiting get does
            _roundtrip(tx, rx, f"{tag}{i}", p)
            landed += 1
        return prx.prebuilt_hits - hits, landed

    for r in range(2):  # the first rounds learn the blocks (and the sender its plans)
        phase(f"a{r}-", 2048, 8)
        phase(f"b{r}-", 512, 8)
    for r in range(2, 4):
        for tag, size in (("a", 2048), ("b", 512)):
            hits, landed = phase(f"{tag}{r}-", size, 8)
            assert hits == landed - 1, (tag, r, hits)  # all but the phase's first


@pytest.mark.parametrize("case", ["held", "segment gone"])
def test_a_remembered_block_that_cannot_be_taken_gives_way_to_the_cycle(pair, case):
    from omnilink.connectors.devpool.receiver import SEG_SHIFT

    tx, rx = pair
    prx = _rx_pool(rx)
    for i in range(6):
        _roundtrip(tx, rx, f"w{i}", _payload(i))
    kept = _roundtrip(tx, rx, "keep", _payload(6))  # its block stays held
    blocks = list(prx._blocks)
    if case == "held":
        (bad,) = prx.pool.held
    else:  # a block of a segment this pool does not have (given back since)
        gone = prx.pool.segs.index(None)
        bad = gone << SEG_SHIFT
    assert next_block(blocks) not in (None, bad)
    prx._successor[(blocks[-1], prx._layout[0])] = bad  # what last time's phase said
    assert prx.prebuild()
    assert prx._pre[0] == next_block(blocks)
    del kept


def test_cuda_ipc_sends_by_plan_and_prebuilds():
    import threading

    with double.host_pair(f"t/plan-ci-{uuid.uuid4().hex[:8]}") as (tx, rx):
        sent = [{"h": torch.randn(64) + i, "m": {"i": i, "s": "x" * i}} for i in range(12)]

        def consume(out: list) -> None:
            for i in range(12):
                out.append(rx.get(f"k{i}", timeout=10.0))

        got: list = []
        t = threading.Thread(target=consume, args=(got,))
        t.start()
        for i in range(12):
            assert tx.put(f"k{i}", sent[i], timeout=5.0) == encoded_size(sent[i])
        t.join(30)
        assert len(got) == 12
        for a, b in zip(got, sent):
            _same(a, b)
        assert tx._sender.planned_puts == 10


def test_a_planned_put_into_a_full_pool_waits_then_takes_the_host_road(pair):
    tx, rx = pair
    big = [{"hidden": torch.randn(1 << 19).to(torch.bfloat16) + i, "ids": torch.arange(16, dtype=torch.int64) + i,
            "meta": {"i": i}} for i in range(7)]
    for i in range(2):  # the layout's plan
        _roundtrip(tx, rx, f"w{i}", big[i])
    s = _sender(tx)
    before = s.planned_puts
    for i in range(7):  # nobody reads: a 4 MiB pool holds three 1 MiB payloads
        assert tx.put(f"k{i}", big[i], timeout=5.0) == encoded_size(big[i])
    st = tx.stats()
    assert s.planned_puts - before == 3 and st.ipc_fallbacks == 4  # waited for room, then the host road
    assert "TransferTimeout" in st.ipc_fallback_reason
    for i in range(7):
        _same(rx.get(f"k{i}", timeout=5.0), big[i])


def test_a_planned_put_finds_its_stage_free_already(pair):
    tx, rx = pair
    s = _sender(tx)
    for i in range(2 * len(s.tx.events) + 4):  # every event slot's stage made and reused
        _roundtrip(tx, rx, f"w{i}", _payload(i))
    ops = s.ops
    before, waited = ops.settles_in_copy, ops.settles
    for i in range(20):
        _roundtrip(tx, rx, f"k{i}", _payload(i))
    assert s.planned_puts > 20
    assert ops.settles_in_copy == before  # no put waited for its stage on its own path
    assert ops.settles - waited == 20  # each put waited for the next one's, after its copy


@pytest.mark.parametrize("error, dropped", [("PeerLostError", True), ("CapacityError", False)])
def test_a_planned_put_that_fails_takes_the_host_road(pair, error, dropped):
    tx, rx = pair
    for i in range(3):
        _roundtrip(tx, rx, f"w{i}", _payload(i))
    s = _sender(tx)
    assert s.planned_puts == 1

    def fail(*a: Any, **k: Any) -> None:
        raise getattr(omnilink, error)("refused here")

    s.send_planned = fail  # what a lost receiver, or a pool that cannot grow, raises
    p = _payload(9)
    assert tx.put("after", p, timeout=5.0) == encoded_size(p)
    st = tx.stats()
    assert st.ipc_fallbacks == 1 and st.ipc_fallback_reason == f"{error}: refused here"
    assert (tx._ipc._tx is None) == dropped  # a lost receiver drops the route's sender
    _same(rx.get("after", timeout=5.0), p)


def _remote(ops_base: type, mps: bool = True) -> type:
    """A ``HostCudaIpc`` whose ops (a subclass of ``ops_base``, MPS or not) put every
    tensor of a payload on device 1, another GPU than the pool's (device 0)."""

    class RemoteOps(ops_base):  # type: ignore[misc,valid-type]
        MPS = mps

        @staticmethod
        def tensor_device(t: Any) -> int:
            return 1

    class Remote(double.HostCudaIpc):
        @staticmethod
        def _make_ops() -> Any:
            return RemoteOps()

    return Remote


@pytest.mark.parametrize("peer", [True, False])
def test_a_plan_for_tensors_on_another_device_than_the_pool_copies_peer_to_peer(monkeypatch, peer):
    """A layout whose device tensors all live on one GPU other than the pool's goes by a
    send plan too, its copies by ``copy_in_peer`` (``PLAN_PEER``; off: the general way
    every time), and arrives the same."""
    from omnilink.connectors.devpool import sender as pool_sender

    monkeypatch.setattr(pool_sender, "PLAN_PEER", peer)

    with double.host_pair(f"t/plan-rm-{uuid.uuid4().hex[:8]}", sender=_remote(double.HostDeviceOps)) as (tx, rx):
        for i in range(6):
            p = {"h": torch.randn(64) + i, "m": {"i": i}}
            tx.put(f"k{i}", p, timeout=5.0)
            _same(rx.get(f"k{i}", timeout=5.0), p)
        s = tx._sender
        if peer:
            assert s.planned_puts >= 3 and s.ops.peer_copies == s.planned_puts
            assert [p.device for p in s.tx.plans] == [1]
        else:
            assert s.planned_puts == 0 and s.tx.plans == [] and s.ops.peer_copies == 0


@pytest.mark.parametrize("kept_bytes", [64, 4096])
def test_a_stream_from_another_gpu_without_mps_goes_by_a_plan_that_keeps_its_host_tensors(monkeypatch, kept_bytes):
    """Without MPS, small host tensors beside another GPU's device tensors stay in the host
    part (``HOSTS_ACROSS_GPUS``); a stream of such payloads still goes by a send plan,
    which keeps them there (the lane record carries them), and arrives the same, sized
    as tensor_blob sizes it; host tensors past ``MAX_KEPT_BYTES`` leave it to the
    general way."""
    from omnilink.connectors.devpool import sender as pool_sender

    monkeypatch.setattr(pool_sender, "HOSTS_ACROSS_GPUS", None)

    with double.host_pair(f"t/plan-keep-{uuid.uuid4().hex[:8]}", sender=_remote(double.HostLikeOps, mps=False)) \
            as (tx, rx):
        for i in range(8):
            p = {"h": torch.randn(64) + i, "ids": torch.arange(kept_bytes // 8) + i,
                 "m": {"flag": torch.tensor(i % 2 == 0), "i": i, "s": "x" * i}}
            assert tx.put(f"k{i}", p, timeout=5.0) == encoded_size(p)
            _same(rx.get(f"k{i}", timeout=5.0, device="cpu"), p)  # (landing on the receiver's device)
        s = tx._sender
        if kept_bytes <= 1024:
            assert s.planned_puts >= 4 and s.ops.peer_copies == s.planned_puts
            assert [pl.kept for pl in s.tx.plans] == [2]
        else:
            assert s.planned_puts == 0 and s.tx.plans == []


def test_a_layout_no_plan_covers_is_compiled_once(pair, monkeypatch):
    from omnilink.connectors.devpool import sender as pool_sender

    calls = []
    real = pool_sender.compile_plan
    monkeypatch.setattr(pool_sender, "compile_plan", lambda *a: calls.append(1) or real(*a))
    tx, rx = pair
    for i in range(8):
        p = _payload(i, tags=["a", i])  # a list: not for a plan
        _roundtrip(tx, rx, f"k{i}", p)
    assert _sender(tx).planned_puts == 0 and len(calls) == 1  # tried once, not at every put
    for i in range(3):  # another layout gets its plan
        p = _payload(i)
        p["hidden"] = torch.randn(1024).to(torch.bfloat16)
        _roundtrip(tx, rx, f"n{i}", p)
    assert _sender(tx).planned_puts == 1 and len(calls) == 2
    for i in range(pool_sender.PLAN_RETRY + 2):  # the first one's tensors without the list:
        _roundtrip(tx, rx, f"m{i}", _payload(i))  # its plan once the refusal has aged
    assert _sender(tx).planned_puts > 1 and len(calls) == 3


def test_the_release_tracker_runs_once():
    import gc
    import threading

    from omnilink.connectors.devpool.receiver import _Finalizer

    class Lease:
        pass

    calls = []
    lease = Lease()
    fin = _Finalizer(lease, lambda *a: calls.append(a), "k", 1, 2)
    assert fin.alive
    del lease
    gc.collect()
    assert calls == [("k", 1, 2)] and not fin.alive  # when the lease died
    fin()
    assert calls == [("k", 1, 2)]  # not again when called
    keep = Lease()
    fin = _Finalizer(keep, lambda *a: calls.append(a), "j", 3, 4)
    threads = [threading.Thread(target=fin) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    del keep
    gc.collect()
    assert calls.count(("j", 3, 4)) == 1  # once, whichever thread (or the lease's death) came first
