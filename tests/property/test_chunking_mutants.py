"""Each invariant checker rejects a planted bug of the kind the field shipped.

Serving engines have shipped chunk bugs to production (a finish sentinel that resent
the last chunk, ``[:chunk_size]`` prefill slices, a dropped final partial chunk, keys
that collided after truncation or ``None`` ids). Each mutant below
re-creates one of them on top of ``CodecChunker`` (or as a key / slicing function), and
each test shows two things: the checker of that invariant raises on a concrete stream
(while the real chunker passes the same stream), and a Hypothesis search with the very
strategies of ``test_chunking_invariants.py`` finds a failing stream by itself, so the
property test would catch the bug.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

import omnilink
from omnilink.chunking import (
    ChunkInvariantError,
    ChunkReceiver,
    ChunkSender,
    CodecChunker,
    CodecWindow,
    DuplicateChunkError,
    PrefillChunk,
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
    parse_chunk_key,
)
from tests.property.strategies import (
    CodecConfig,
    CodecScenario,
    Preemption,
    codec_scenarios,
    drive_codec_stream,
    scenario_frames,
)

_channels = itertools.count()


# ------------------------------------------------------------------ mutants
class DropPartialTail(CodecChunker):
    """Terminal flush that drops the last partial chunk (sends a bare finish instead)."""

    def finish(self, frames=None, /):
        if frames is not None:
            self._append(frames)
        out = self._drain()
        self._pending, self._pending_n = [], 0  # the bug: the partial tail is dropped
        return out + super().finish()


class NoFinishAfterPartial(CodecChunker):
    """Terminal flush that sends the partial chunk but never a finished message."""

    def finish(self, frames=None, /):
        if frames is not None:
            self._append(frames)
        out = self._drain()
        if self._pending_n:
            out.append(self._emit(self._pending_n, finished=False))
            self._finished = True
            return out  # the bug: the consumer waits forever for meta.finished
        return out + super().finish()


class DoubleFinish(CodecChunker):
    """Sends the partial chunk finished, then a finish-only message finished again."""

    def finish(self, frames=None, /):
        out = super().finish(frames)
        if out[-1].new_frames:
            out.append(msgspec.structs.replace(out[-1], chunk_id=out[-1].chunk_id + 1,
                                               frames=out[-1].frames[:0], left_context_size=0,
                                               new_frames=0))
        return out


class TailResend(CodecChunker):
    """Finish sentinel computed with ``length % C`` ignoring IC: when the finish comes
    alone after a boundary, it resends the tail (the last full chunk when IC is unset)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._history: list[torch.Tensor] = []

    def _append(self, frames):
        super()._append(frames)
        t = torch.as_tensor(frames)
        self._history.append(t.reshape(-1, t.shape[-1]).to(torch.int64))

    def finish(self, frames=None, /):
        if frames is None and self._pending_n == 0 and self._emitted > 0:
            hist = torch.cat(self._history)
            tail = self._emitted % self.chunk_frames or self.chunk_frames  # the bug
            lc = min(self.left_context_frames, self._emitted - tail)
            self._finished = True
            return [CodecWindow(chunk_id=self._next_id, frames=hist[self._emitted - tail - lc : self._emitted],
                                left_context_size=lc, new_frames=tail, start=self._emitted - tail, finished=True)]
        return super().finish(frames)


class IgnoreInitialChunk(CodecChunker):
    """Chunk ends computed with ``length % C``: the initial chunk / ramp is ignored."""

    def chunk_size(self, chunk_id, /):
        return self.chunk_frames


class ZeroPaddedContext(CodecChunker):
    """Left context padded with zero frames up to L at the start of the stream."""

    def _emit(self, n, *, finished):
        w = super()._emit(n, finished=finished)
        pad = self.left_context_frames - w.left_context_size
        if pad > 0:
            zeros = torch.zeros((pad, w.frames.shape[1]), dtype=torch.int64)
            w = msgspec.structs.replace(w, frames=torch.cat((zeros, w.frames)), left_context_size=self.left_context_frames)
        return w


class Chunk1ContextIsIC(CodecChunker):
    """vLLM-Omni's rule: chunk 1's left context is the whole initial chunk, even when
    L is smaller."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._chunk0 = None

    def _emit(self, n, *, finished):
        cid = self._next_id
        w = super()._emit(n, finished=finished)
        if cid == 0:
            self._chunk0 = w.frames
        elif cid == 1 and self._chunk0 is not None and self._chunk0.shape[0] > w.left_context_size:
            w = msgspec.structs.replace(w, frames=torch.cat((self._chunk0, w.new)), left_context_size=self._chunk0.shape[0])
        return w


class RestartIdsOnResume(CodecChunker):
    """A resend after preemption that restarts chunk ids at 0 (frames resume correctly)."""

    def __init__(self, *a, resume_from=None, **kw):
        if resume_from is not None:
            resume_from = msgspec.structs.replace(resume_from, next_chunk_id=0)  # the bug
        super().__init__(*a, resume_from=resume_from, **kw)


def _flat_meta_payload(window):
    return {"codes.audio": window.codes_audio, "meta.finished": window.finished,
            "meta.left_context_size": window.left_context_size}


# ------------------------------------------------------------------ helpers
def _scenario(c, left, n, *, ic=None, ramp=None, finish="alone", q=2, batch=1, pre=()):
    batches = (batch,) * (n // batch) + ((n % batch,) if n % batch else ())
    return CodecScenario(CodecConfig(c, left, ic, ramp), q, n, batches, finish, tuple(pre), seed=7)


def _check_all(windows, s):
    cfg = s.config
    frames = scenario_frames(s)
    check_frames_preserved(windows, frames)
    check_left_context(windows, frames, left_context_frames=cfg.left_context_frames)
    check_boundaries(windows, frames, chunk_frames=cfg.chunk_frames,
                     initial_chunk_frames=cfg.initial_chunk_frames, ramp=cfg.ramp)
    check_single_finish(windows)
    check_finish_only_on_boundary(windows, frames)
    check_chunk_ids([w.chunk_id for w in windows])


def _rejects(checker, mutant, scenario, invariant):
    """The real chunker passes ``scenario``; the mutant fails ``checker`` on it."""
    _check_all(drive_codec_stream(scenario), scenario)
    with pytest.raises(ChunkInvariantError, match=f"invariant {invariant} violated") as ei:
        checker(drive_codec_stream(scenario, mutant), scenario)
    assert ei.value.invariant == invariant


def _search_rejects(checker, mutant, invariant, *, preemptions=False):
    """Hypothesis, with the property tests' strategies, finds a stream the mutant fails."""

    @settings(max_examples=400, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=[HealthCheck.too_slow])
    @given(codec_scenarios(max_frames=120, preemptions=preemptions))
    def prop(s):
        checker(drive_codec_stream(s, mutant), s)

    with pytest.raises(ChunkInvariantError, match=f"invariant {invariant} violated"):
        prop()


def _inv1(ws, s):
    check_frames_preserved(ws, scenario_frames(s))


def _inv2(ws, s):
    check_left_context(ws, scenario_frames(s), left_context_frames=s.config.left_context_frames)


def _inv3(ws, s):
    c = s.config
    check_boundaries(ws, scenario_frames(s), chunk_frames=c.chunk_frames,
                     initial_chunk_frames=c.initial_chunk_frames, ramp=c.ramp)


def _inv4(ws, s):
    check_single_finish(ws)


def _inv5(ws, s):
    check_finish_only_on_boundary(ws, scenario_frames(s))


def _inv6(ws, s):
    check_chunk_ids([w.chunk_id for w in ws])


# ------------------------------------------------------------------ invariant 1
def test_inv1_checker_rejects_a_flush_that_drops_the_last_partial_chunk():
    _rejects(_inv1, DropPartialTail, _scenario(4, 2, 9, ic=2, finish="alone"), 1)
    _search_rejects(_inv1, DropPartialTail, 1)


# ------------------------------------------------------------------ invariant 2
def test_inv2_checker_rejects_zero_padded_context():
    _rejects(_inv2, ZeroPaddedContext, _scenario(4, 3, 9), 2)
    _search_rejects(_inv2, ZeroPaddedContext, 2)


def test_inv2_checker_rejects_chunk1_context_of_the_whole_initial_chunk():
    _rejects(_inv2, Chunk1ContextIsIC, _scenario(6, 1, 12, ic=4), 2)
    _search_rejects(_inv2, Chunk1ContextIsIC, 2)


# ------------------------------------------------------------------ invariant 3
def test_inv3_checker_rejects_boundaries_that_ignore_the_initial_chunk():
    _rejects(_inv3, IgnoreInitialChunk, _scenario(5, 2, 17, ic=2), 3)
    _search_rejects(_inv3, IgnoreInitialChunk, 3)


# ------------------------------------------------------------------ invariant 4
def test_inv4_checker_rejects_a_stream_without_finish():
    _rejects(_inv4, NoFinishAfterPartial, _scenario(4, 2, 7, finish="alone"), 4)
    _search_rejects(_inv4, NoFinishAfterPartial, 4)


def test_inv4_checker_rejects_two_finishes():
    _rejects(_inv4, DoubleFinish, _scenario(4, 2, 7, finish="with_last", batch=3), 4)
    _search_rejects(_inv4, DoubleFinish, 4)


# ------------------------------------------------------------------ invariant 5
@pytest.mark.parametrize("ic", [None, 2])
def test_inv5_checker_rejects_a_finish_sentinel_that_resends_the_tail(ic):
    # 12 frames end exactly on a boundary (4+4+4, or 2+5+5); the finish comes alone.
    s = _scenario(4, 2, 12, finish="alone") if ic is None else _scenario(5, 2, 12, ic=2, finish="alone")
    _rejects(_inv5, TailResend, s, 5)
    # The same bug also duplicates audio, which invariant 1's checker sees too.
    with pytest.raises(ChunkInvariantError, match="invariant 1 violated"):
        _inv1(drive_codec_stream(s, TailResend), s)
    _search_rejects(_inv5, TailResend, 5)


# ------------------------------------------------------------------ invariant 6
def test_inv6_checker_rejects_a_resend_that_restarts_ids():
    s = _scenario(3, 2, 14, pre=(Preemption(8, 0),))
    _rejects(_inv6, RestartIdsOnResume, s, 6)
    _search_rejects(_inv6, RestartIdsOnResume, 6, preemptions=True)


def test_inv6_a_sender_restarted_without_its_watermark_is_caught_on_the_wire():
    keys = []

    class Rec:
        def __init__(self, inner):
            self.inner = inner

        def put(self, key, payload, /, *, timeout=None):
            keys.append(key)
            return self.inner.put(key, payload, timeout=timeout)

    s = _scenario(3, 2, 14, pre=(Preemption(8, 0),))
    with omnilink.connect("memory", channel=f"chunk-mut/{next(_channels)}") as conn:
        rx = ChunkReceiver(conn, request_id="chatcmpl_x_1", from_stage=1, timeout=0)
        got = []
        box = [ChunkSender(Rec(conn), request_id="chatcmpl_x_1", from_stage=1)]

        def on_window(w):
            box[0].send(w.to_payload())  # send() numbers chunks itself, from the sender's watermark
            while not rx.finished:  # the consumer keeps up with the producer
                try:
                    got.append(rx.receive_nowait())
                except omnilink.WouldBlock:
                    break

        def factory(**kw):
            if "resume_from" in kw:
                box[0] = ChunkSender(Rec(conn), request_id="chatcmpl_x_1", from_stage=1)  # the bug: no watermark
            return CodecChunker(**kw)

        drive_codec_stream(s, factory, on_window=on_window)
        with pytest.raises(ChunkInvariantError, match="invariant 6 violated"):
            check_chunk_ids([parse_chunk_key(k)[2] for k in keys])
        with pytest.raises(DuplicateChunkError):
            rx.verify()


# ------------------------------------------------------------------ invariant 7
def test_inv7_checker_and_stream_reject_flat_meta():
    s = _scenario(4, 2, 9)
    windows = drive_codec_stream(s)
    check_meta_nested([w.to_payload() for w in windows])
    flat = [_flat_meta_payload(w) for w in windows]
    with pytest.raises(ChunkInvariantError, match="invariant 7 violated"):
        check_meta_nested(flat)
    with omnilink.connect("memory", channel=f"chunk-mut/{next(_channels)}") as conn:
        tx = ChunkSender(conn, request_id="r", from_stage=0)
        with pytest.raises(omnilink.ConfigurationError, match="nested"):
            tx.send(flat[0])
        assert tx.next_chunk_id == 0  # nothing was consumed by the refused send
    with pytest.raises(omnilink.ConfigurationError, match="nested"):
        accumulate(None, flat[0])


# ------------------------------------------------------------------ prefill
def test_prefill_checker_rejects_slicing_from_zero():
    seq = torch.arange(23 * 3, dtype=torch.float32).reshape(23, 3)
    size = 5
    # The bug: every chunk sliced [:chunk_size] of the growing sequence.
    bad = [PrefillChunk(chunk_id=k, offset=k * size, data=seq[: min(size, 23 - k * size)], finished=k == 4)
           for k in range(5)]
    with pytest.raises(ChunkInvariantError, match="invariant prefill violated"):
        check_prefill_chunks(bad, seq, chunk_size=size)


# ------------------------------------------------------------------ keys
def _truncated_id_key(rid, stage, cid):
    return f"{str(rid)[:25]}_{stage}_{cid}"


def _none_ok_key(rid, stage, cid):
    return f"{rid}_{stage}_{cid}"


def _truncated_key(rid, stage, cid):
    return f"{rid}_{stage}_{cid}"[:56]


def test_keys_checker_rejects_truncated_and_none_ids():
    long_a = "chatcmpl_" + "a" * 40 + "_1"
    long_b = "chatcmpl_" + "a" * 40 + "_2"
    cases = [(long_a, 0, 0), (long_b, 0, 0), (None, 1, 0), ("None", 1, 0)]
    check_keys_injective(chunk_key, cases, parse=parse_chunk_key)  # the real one: refuses None, no collision
    with pytest.raises(ChunkInvariantError, match="invariant keys violated"):
        check_keys_injective(_truncated_id_key, cases)
    with pytest.raises(ChunkInvariantError, match="invariant keys violated"):
        check_keys_injective(_none_ok_key, [(None, 1, 0), ("None", 1, 0)])
    with pytest.raises(ChunkInvariantError, match="invariant keys violated"):
        check_keys_injective(_truncated_key, [(long_a + "x" * 10, 0, 0), (long_a + "x" * 10, 0, 1)])
