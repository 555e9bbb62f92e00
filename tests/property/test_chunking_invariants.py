"""One property test per chunking invariant (as ``omnilink.chunking`` lists them), so a failure names the invariant.

Each test draws codec scenarios (frame counts 0..300, C, L, IC or ramps, push batch
sizes, finish with the last frames or alone, preemption points) and runs the checker of
its invariant from ``omnilink.chunking``. ``test_chunking_mutants.py`` shows each checker
rejects the field bug it is for.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import omnilink
from omnilink.chunking import (
    ChunkGapError,
    ChunkReceiver,
    ChunkSender,
    DuplicateChunkError,
    PrefillChunker,
    accumulate,
    check_boundaries,
    check_chunk_ids,
    check_finish_only_on_boundary,
    check_frames_preserved,
    check_keys_injective,
    check_left_context,
    check_meta_nested,
    check_prefill_chunks,
    check_single_finish,
    chunk_key,
    join_codec_payloads,
    parse_chunk_key,
)
from tests.property.strategies import (
    codec_scenarios,
    drive_codec_stream,
    request_ids,
    scenario_frames,
    stages,
)

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_channels = itertools.count()


def _channel() -> str:
    return f"chunk-prop/{next(_channels)}"


# ---------------------------------------------------------------- invariant 1
@SETTINGS
@given(codec_scenarios())
def test_inv1_new_frames_concatenate_to_the_frames_pushed(scenario):
    windows = drive_codec_stream(scenario)
    check_frames_preserved(windows, scenario_frames(scenario))


# ---------------------------------------------------------------- invariant 2
@SETTINGS
@given(codec_scenarios())
def test_inv2_left_context_is_real_earlier_frames_at_most_L(scenario):
    windows = drive_codec_stream(scenario)
    check_left_context(windows, scenario_frames(scenario), left_context_frames=scenario.config.left_context_frames)


# ---------------------------------------------------------------- invariant 3
@SETTINGS
@given(codec_scenarios())
def test_inv3_non_final_chunks_end_on_boundaries(scenario):
    windows = drive_codec_stream(scenario)
    cfg = scenario.config
    check_boundaries(
        windows,
        scenario_frames(scenario),
        chunk_frames=cfg.chunk_frames,
        initial_chunk_frames=cfg.initial_chunk_frames,
        ramp=cfg.ramp,
    )


# ---------------------------------------------------------------- invariant 4
@SETTINGS
@given(codec_scenarios())
def test_inv4_exactly_one_finish_and_it_is_last(scenario):
    check_single_finish(drive_codec_stream(scenario))


# ---------------------------------------------------------------- invariant 5
@SETTINGS
@given(codec_scenarios())
def test_inv5_stream_ending_on_a_boundary_sends_finish_only(scenario):
    windows = drive_codec_stream(scenario)
    frames = scenario_frames(scenario)
    check_finish_only_on_boundary(windows, frames)
    # Our documented choice for the finish-only message: shape [0, Q], no context.
    last = windows[-1]
    if last.new_frames == 0:
        assert tuple(last.frames.shape) == (0, scenario.num_codebooks)
        assert last.left_context_size == 0 and last.codes_audio.numel() == 0


# ---------------------------------------------------------------- invariant 6
class _Recording:
    """A connector wrapper that records every key put (what a sender really sent)."""

    def __init__(self, inner):
        self.inner = inner
        self.keys: list[str] = []

    def put(self, key, payload, /, *, timeout=None):
        n = self.inner.put(key, payload, timeout=timeout)
        self.keys.append(key)
        return n


@SETTINGS
@given(codec_scenarios(max_frames=120), request_ids(), stages())
def test_inv6_resend_after_preemption_never_reuses_a_chunk_id(scenario, rid, stage):
    channel = _channel()
    with omnilink.connect("memory", channel=channel) as conn:
        rec = _Recording(conn)
        sender = [ChunkSender(rec, request_id=rid, from_stage=stage)]

        def preempted(_old_chunker):
            # The stage lost its state but kept the watermark: a new sender resumes there.
            sender[0] = ChunkSender(rec, request_id=rid, from_stage=stage, next_chunk_id=sender[0].next_chunk_id)

        windows = _drive_with_preempt_hook(scenario, lambda w: sender[0].send_window(w), preempted)
        ids = []
        for key in rec.keys:
            got_rid, got_stage, cid = parse_chunk_key(key)
            assert got_rid == rid and str(got_stage) == str(stage)
            ids.append(cid)
        check_chunk_ids(ids)
        check_chunk_ids([w.chunk_id for w in windows])
        received = list(ChunkReceiver(conn, request_id=rid, from_stage=stage, timeout=0))
        frames = scenario_frames(scenario)
        assert torch.equal(join_codec_payloads(received, num_codebooks=scenario.num_codebooks), frames)


def _drive_with_preempt_hook(scenario, on_window, on_preempt):
    """``drive_codec_stream`` with a callback each time a chunker is rebuilt from a watermark."""
    from omnilink.chunking import CodecChunker

    def factory(**kw):
        if "resume_from" in kw:
            on_preempt(kw["resume_from"])
        return CodecChunker(**kw)

    return drive_codec_stream(scenario, factory, on_window=on_window)


@SETTINGS
@given(st.integers(3, 12), st.data())
def test_inv6_receiver_reports_a_gap_or_a_duplicate(n, data):
    fault = data.draw(st.sampled_from(["gap", "duplicate"]))
    # A gap is visible once a later chunk is there: the missing one is never the last.
    at = data.draw(st.integers(1, n - 2 if fault == "gap" else n - 1))
    with omnilink.connect("memory", channel=_channel()) as conn:
        payloads = [{"x": torch.tensor([i]), "meta": {"finished": i == n - 1}} for i in range(n)]
        rx = ChunkReceiver(conn, request_id="req_a_1", from_stage=0, timeout=0)
        if fault == "gap":
            tx = ChunkSender(conn, request_id="req_a_1", from_stage=0)
            for p in payloads[:at]:
                tx.send(p)
            # A resumed sender that skipped an id: chunk `at` is never sent.
            tx = ChunkSender(conn, request_id="req_a_1", from_stage=0, next_chunk_id=at + 1)
            for p in payloads[at + 1 :]:
                tx.send(p)
            got = [rx.receive() for _ in range(at)]
            try:
                rx.receive()
            except ChunkGapError as exc:
                assert exc.chunk_id == at
            else:
                raise AssertionError("the receiver did not report the gap")
        else:
            tx = ChunkSender(conn, request_id="req_a_1", from_stage=0)
            for p in payloads[:at]:
                tx.send(p)
            got = [rx.receive() for _ in range(at)]
            # A resend that restarted ids at 0 after a preemption.
            tx = ChunkSender(conn, request_id="req_a_1", from_stage=0)
            for p in payloads:
                tx.send(p)
            try:
                for p in rx:
                    got.append(p)
            except DuplicateChunkError as exc:
                assert exc.chunk_id == 0
            else:
                raise AssertionError("the receiver did not report the duplicate")
            # The finishing chunk was still delivered before the error: nothing lost.
            assert len(got) == n and rx.finished
        # Either way the receiver delivered, in order, every chunk it could.
        assert [int(p["x"][0]) for p in got] == list(range(len(got)))


# ---------------------------------------------------------------- invariant 7
@SETTINGS
@given(codec_scenarios(max_frames=80, preemptions=False), st.data())
def test_inv7_meta_stays_nested_on_the_wire_and_when_accumulated(scenario, data):
    windows = drive_codec_stream(scenario)
    check_meta_nested([w.to_payload() for w in windows], require=("finished", "left_context_size"))
    with omnilink.connect("memory", channel=_channel()) as conn:
        tx = ChunkSender(conn, request_id="r_1", from_stage="talker")
        for w in windows:
            tx.send_window(w)
        received = list(ChunkReceiver(conn, request_id="r_1", from_stage="talker", timeout=0))
    check_meta_nested(received, require=("finished", "left_context_size", "chunk_id"))
    acc = None
    for p in received:
        acc = accumulate(acc, p)
    check_meta_nested([acc], require=("finished", "left_context_size"))
    assert bool(acc["meta"]["finished"]) is True


# ---------------------------------------------------------------- keys
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Stage 0 and stage "0" are the same stage (keys are text): cases are unique up to that.
@given(st.lists(st.tuples(request_ids(), stages(), st.integers(0, 10**6)), min_size=1, max_size=8,
                unique_by=lambda c: (c[0], str(c[1]), c[2])))
def test_keys_are_injective_and_parse_back_whole(cases):
    check_keys_injective(chunk_key, cases, parse=parse_chunk_key)
    for rid, stage, cid in cases:
        key = chunk_key(rid, stage, cid)
        assert chunk_key(*parse_chunk_key(key)) == key


# ---------------------------------------------------------------- prefill
@SETTINGS
@given(
    st.integers(1, 40),
    st.one_of(st.none(), st.integers(1, 40)),
    st.lists(st.integers(0, 50), max_size=12),
    st.integers(1, 4),
)
def test_prefill_chunks_concatenate_to_the_sequence(size, initial, growth, width):
    total = sum(growth)
    seq = torch.randn(total, width)
    chunker = PrefillChunker(size, initial)
    chunks, n = [], 0
    for g in growth:
        n += g
        chunks += chunker.update(seq[:n])
    chunks += chunker.finish(seq)
    check_prefill_chunks(chunks, seq, chunk_size=size, initial_chunk_size=initial)
    # The accumulated payload of the chunks is the sequence, as the talker sees it.
    acc = None
    for c in chunks:
        acc = accumulate(acc, {"hidden_states": {"output": c.data}, "meta": {"finished": c.finished}})
    assert torch.equal(acc["hidden_states"]["output"], seq)


@SETTINGS
@given(codec_scenarios(max_frames=150))
def test_inv6_preemption_is_invisible_in_the_windows(scenario):
    # A resumed chunker sends exactly what an uninterrupted one would: no id, frame or
    # context is sent twice or differently, whatever the replay start.
    preempted = drive_codec_stream(scenario)
    plain = drive_codec_stream(dataclasses.replace(scenario, preemptions=()))
    assert len(preempted) == len(plain)
    for a, b in zip(preempted, plain):
        assert (a.chunk_id, a.left_context_size, a.new_frames, a.start, a.finished) == (
            b.chunk_id, b.left_context_size, b.new_frames, b.start, b.finished
        )
        assert torch.equal(a.frames, b.frames)
