"""CodecChunker and PrefillChunker: concrete windows, layouts, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import omnilink
from omnilink.chunking import (
    CodecChunker,
    CodecWatermark,
    PrefillChunker,
    StreamFinishedError,
    check_codec_stream,
    chunk_schedule,
    codec_frames_from_payload,
    join_codec_payloads,
)


def _frames(n, q=2):
    return torch.arange(n * q, dtype=torch.int64).reshape(n, q)


def _summary(ws):
    return [(w.chunk_id, w.left_context_size, w.new_frames, w.start, w.finished) for w in ws]


def test_windows_of_the_module_diagram():
    # C=6, L=3, IC=4, 18 frames one at a time, finish alone (module docstring's picture).
    c = CodecChunker(6, 3, initial_chunk_frames=4)
    fr = _frames(18)
    ws = [w for i in range(18) for w in c.push(fr[i])] + c.finish()
    assert _summary(ws) == [(0, 0, 4, 0, False), (1, 3, 6, 4, False), (2, 3, 6, 10, False), (3, 3, 2, 16, True)]
    assert torch.equal(ws[1].frames, fr[1:10])
    assert torch.equal(ws[2].frames, fr[7:16])
    check_codec_stream(ws, fr, chunk_frames=6, left_context_frames=3, initial_chunk_frames=4)


def test_partial_final_chunk_carries_the_finish():
    c = CodecChunker(4, 2)
    fr = _frames(10)
    ws = c.push(fr[:9]) + c.finish(fr[9:])
    assert _summary(ws) == [(0, 0, 4, 0, False), (1, 2, 4, 4, False), (2, 2, 2, 8, True)]
    assert torch.equal(ws[-1].frames, fr[6:10])


def test_finish_with_the_frames_completing_a_boundary_rides_on_that_chunk():
    c = CodecChunker(4, 2)
    fr = _frames(8)
    ws = c.push(fr[:5]) + c.push(fr[5:], finished=True)
    assert _summary(ws) == [(0, 0, 4, 0, False), (1, 2, 4, 4, True)]


def test_finish_alone_on_a_boundary_is_finish_only_with_no_frames():
    c = CodecChunker(4, 2)
    ws = c.push(_frames(8)) + c.finish()
    last = ws[-1]
    assert _summary(ws)[-1] == (2, 0, 0, 8, True)
    assert tuple(last.frames.shape) == (0, 2)
    assert last.codes_audio.numel() == 0
    assert last.to_payload()["codes.audio"].numel() == 0


def test_empty_stream_is_one_finish_only_window():
    ws = CodecChunker(3, 1, num_codebooks=5).finish()
    assert _summary(ws) == [(0, 0, 0, 0, True)]
    assert tuple(ws[0].frames.shape) == (0, 5)
    assert tuple(CodecChunker(3, 1).finish()[0].frames.shape) == (0, 0)


def test_ramp_sets_the_first_boundaries():
    c = CodecChunker(5, 1, ramp=[1, 2, 3])
    ws = c.push(_frames(17)) + c.finish()
    ends = [w.start + w.new_frames for w in ws if not w.finished]
    assert ends == [1, 3, 6, 11, 16]
    assert ws[-1].new_frames == 1


def test_initial_chunk_zero_means_unset_like_vllm_omni():
    assert chunk_schedule(4, 0) == ()
    assert chunk_schedule(4, 2) == (2,)
    assert chunk_schedule(4, None, [1, 2]) == (1, 2)


def test_codes_audio_is_codebook_major_int64_and_payload_meta_is_nested():
    c = CodecChunker(2, 0)
    fr = torch.tensor([[1, 10, 100], [2, 20, 200]], dtype=torch.int32)
    (w,) = c.push(fr)
    assert w.codes_audio.dtype == torch.int64
    assert w.codes_audio.tolist() == [1, 2, 10, 20, 100, 200]
    p = w.to_payload()
    assert set(p) == {"codes.audio", "meta"}
    assert p["meta"]["left_context_size"] == 0
    assert p["meta"]["finished"].dtype == torch.bool and p["meta"]["finished"].dim() == 0
    frames, lc = codec_frames_from_payload(p, num_codebooks=3)
    assert lc == 0 and torch.equal(frames, fr.to(torch.int64))


def test_payloads_survive_the_wire_and_rejoin_exactly():
    fr = _frames(23, 4)
    c = CodecChunker(5, 3, initial_chunk_frames=2)
    ws = c.push(fr[:11]) + c.finish(fr[11:])
    decoded = [omnilink.decode(omnilink.encode(w.to_payload())) for w in ws]
    assert torch.equal(join_codec_payloads(decoded, num_codebooks=4), fr)


def test_one_frame_list_and_numpy_inputs_are_accepted_and_copied():
    c = CodecChunker(2, 1)
    buf = torch.tensor([7, 8])
    assert c.push(buf) == []
    buf[:] = 0  # the caller reuses its buffer: the pending frame must not change
    ws = c.push([9, 10]) + c.push(np.array([[11, 12]]))
    assert ws[0].frames.tolist() == [[7, 8], [9, 10]]


@pytest.mark.parametrize(
    "frames, match",
    [
        (torch.ones(2, 2), "integer"),
        (torch.ones(2, 2, dtype=torch.bool), "integer"),
        (torch.ones(2, 2, 2, dtype=torch.int64), "shape"),
        (torch.ones(2, 0, dtype=torch.int64), "codebook"),
        ("abc", "integer"),
    ],
)
def test_bad_frames_are_refused(frames, match):
    with pytest.raises(omnilink.ConfigurationError, match=match):
        CodecChunker(2, 1).push(frames)


def test_codebook_count_cannot_change():
    c = CodecChunker(4, 1)
    c.push(_frames(1, 3))
    with pytest.raises(omnilink.ConfigurationError, match="codebooks"):
        c.push(_frames(1, 2))


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((0, 1), {}, "chunk_frames"),
        ((2, -1), {}, "left_context_frames"),
        ((2, 1, -3), {}, "initial_chunk_frames"),
        ((2, 1, 2, [1]), {}, "not both"),
        ((2, 1, None, [1, 0]), {}, r"ramp\[1\]"),
        ((2, 1, None, "ab"), {}, "ramp"),
        ((2.0, 1), {}, "chunk_frames"),
        ((2, 1), {"num_codebooks": 0}, "num_codebooks"),
        ((2, 1), {"replay_from": 3}, "resume_from"),
    ],
)
def test_bad_configuration_is_refused(args, kwargs, match):
    with pytest.raises(omnilink.ConfigurationError, match=match):
        CodecChunker(*args, **kwargs)


def test_nothing_after_the_finish():
    c = CodecChunker(2, 1)
    c.push(_frames(3), finished=True)
    assert c.finished
    with pytest.raises(StreamFinishedError):
        c.push(_frames(1))
    with pytest.raises(StreamFinishedError):
        c.finish()
    with pytest.raises(StreamFinishedError):
        c.watermark()
    assert issubclass(StreamFinishedError, omnilink.OmnilinkError)


def test_resume_from_watermark_continues_ids_and_skips_sent_frames():
    fr = _frames(14)
    c = CodecChunker(3, 2)
    first = c.push(fr[:8])  # chunks 0, 1 sent; frames 6, 7 pending and lost on preemption
    wm = c.watermark()
    assert (wm.next_chunk_id, wm.frames_emitted) == (2, 6)
    assert torch.equal(wm.context, fr[4:6])
    resumed = CodecChunker(3, 2, resume_from=wm, replay_from=0)
    rest = resumed.push(fr[:14]) + resumed.finish()
    plain = CodecChunker(3, 2)
    expected = plain.push(fr) + plain.finish()
    assert _summary(first + rest) == _summary(expected)
    check_codec_stream(first + rest, fr, chunk_frames=3, left_context_frames=2)


def test_resume_refuses_inconsistent_watermarks():
    c = CodecChunker(3, 2)
    c.push(_frames(7))
    wm = c.watermark()
    with pytest.raises(omnilink.ConfigurationError, match="past the watermark"):
        CodecChunker(3, 2, resume_from=wm, replay_from=7)
    with pytest.raises(omnilink.ConfigurationError, match="context"):
        CodecChunker(3, 5, resume_from=wm)
    with pytest.raises(omnilink.ConfigurationError, match="CodecWatermark"):
        CodecChunker(3, 2, resume_from={"next_chunk_id": 2})
    bad = CodecWatermark(next_chunk_id=-1, frames_emitted=6, context=wm.context, num_codebooks=2)
    with pytest.raises(omnilink.ConfigurationError):
        CodecChunker(3, 2, resume_from=bad)


def test_finish_before_the_replay_reaches_the_watermark_is_refused():
    c = CodecChunker(3, 1)
    c.push(_frames(6))
    resumed = CodecChunker(3, 1, resume_from=c.watermark())
    resumed.push(_frames(4))
    with pytest.raises(omnilink.ConfigurationError, match="watermark"):
        resumed.finish()


def test_context_memory_stays_bounded():
    c = CodecChunker(4, 3)
    for _ in range(50):
        c.push(_frames(4))
    assert c.pending_frames == 0 and c.frames_emitted == 200
    assert c.watermark().context.shape == (3, 2)


# ------------------------------------------------------------------ prefill
def test_prefill_slices_by_offset_not_from_zero():
    seq = torch.arange(11 * 2).reshape(11, 2)
    p = PrefillChunker(4)
    a = p.update(seq[:5])
    b = p.update(seq[:9])
    c = p.finish(seq)
    chunks = a + b + c
    assert [(k.chunk_id, k.offset, k.data.shape[0], k.finished) for k in chunks] == [
        (0, 0, 4, False), (1, 4, 4, False), (2, 8, 3, True)
    ]
    assert torch.equal(torch.cat([k.data for k in chunks]), seq)


def test_prefill_finish_on_a_boundary_marks_the_last_full_chunk():
    seq = torch.zeros(8, 1)
    chunks = PrefillChunker(4).finish(seq)
    assert [(k.offset, k.data.shape[0], k.finished) for k in chunks] == [(0, 4, False), (4, 4, True)]
    (empty,) = PrefillChunker(4).finish(torch.zeros(0, 3))
    assert empty.finished and empty.data.shape == (0, 3)


def test_prefill_refuses_shrinking_sequences_and_use_after_finish():
    p = PrefillChunker(2)
    p.update(torch.zeros(5, 1))
    with pytest.raises(omnilink.ConfigurationError, match="shrank"):
        p.update(torch.zeros(3, 1))
    with pytest.raises(omnilink.ConfigurationError, match="leading dim"):
        p.update([1, 2, 3])
    p.finish(torch.zeros(5, 1))
    with pytest.raises(StreamFinishedError):
        p.update(torch.zeros(6, 1))
