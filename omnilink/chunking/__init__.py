"""Chunk framing for streaming stages: keys, chunk ids, finish sentinels and the codec
window arithmetic, built so the chunking bugs serving engines have shipped (duplicated
tail chunks, misaligned prefill slices, dropped final chunks, colliding keys) cannot happen.

The package's modules (internal; import the names below from ``omnilink.chunking``):
``keys`` (key building and parsing), ``codec`` (window arithmetic, ``CodecChunker``,
``PrefillChunker``), ``stream`` (``ChunkSender`` / ``ChunkReceiver``), ``checks`` (one
checker per invariant, for property tests of any chunker).

Streaming omni pipelines send a request's output in chunks (thinker hidden states in
prefill chunks, talker codec frames in windows with left context) so the first audio
plays after one chunk instead of the whole answer. This module gives:

- ``chunk_key`` / ``parse_chunk_key``: ``f"{request_id}_{from_stage}_{chunk_id}"`` and
  its exact inverse (parsed from the right; never truncated; ``None`` ids refused).
- ``CodecChunker``: codec frames -> ``CodecWindow`` (left context + new frames, the
  ``codes.audio`` flat form, ``to_payload()`` in vLLM-Omni's shape with ``meta`` nested).
- ``PrefillChunker``: ``sequence[offset : offset + size]`` slices of a growing sequence.
- ``ChunkSender`` / ``ChunkReceiver``: a chunk stream over any Connector, ids 0, 1, 2,
  ..., one finish, a watermark for resends after preemption, gap and duplicate errors.
- ``accumulate``: merge chunk payloads the way engines do.
- ``check_*``: one checker per invariant listed below, for any chunker.

Example (talker side, then code2wav side)::

    from omnilink.chunking import ChunkReceiver, ChunkSender, CodecChunker

    chunker = CodecChunker(25, 25, initial_chunk_frames=4)
    tx = ChunkSender(conn, request_id="chatcmpl_ab_12", from_stage=1)
    for codes in talker_steps():               # one [Q] frame per decode step
        for window in chunker.push(codes):
            tx.send_window(window)
    for window in chunker.finish():
        tx.send_window(window)

    for payload in ChunkReceiver(conn, request_id="chatcmpl_ab_12", from_stage=1, timeout=5):
        audio = code2wav(payload["codes.audio"], payload["meta"]["left_context_size"])

The invariants every ``CodecChunker`` output keeps, for every ``C >= 1``, ``L >= 0``,
``IC >= 1`` or unset, ramp, and finish arriving with the last frame or alone:

1. the new frames of all windows, concatenated, are exactly the frames pushed;
2. left context is real, earlier frames only, at most ``min(L, frames sent before)``;
3. non-final chunks end at ``IC, IC + C, IC + 2C, ...`` (or the ramp's sums, then C);
4. exactly one window is ``finished`` and it is the last;
5. a stream that ends exactly on a boundary, finish arriving alone, ends with a
   finish-only window: no new frames, no context, frames of shape ``[0, Q]``;
6. a resend after preemption never reuses a chunk id (``CodecWatermark``,
   ``ChunkSender(next_chunk_id=...)``); a receiver that sees a gap or a duplicate raises;
7. ``meta`` stays nested (``meta.finished``, ``meta.left_context_size``).
"""

from __future__ import annotations

from omnilink.chunking.checks import (
    check_boundaries,
    check_chunk_ids,
    check_codec_stream,
    check_finish_only_on_boundary,
    check_frames_preserved,
    check_keys_injective,
    check_left_context,
    check_meta_nested,
    check_prefill_chunks,
    check_single_finish,
)
from omnilink.chunking.codec import (
    CodecChunker,
    CodecWatermark,
    CodecWindow,
    PrefillChunk,
    PrefillChunker,
    chunk_schedule,
    codec_frames_from_payload,
    iter_boundaries,
    join_codec_payloads,
)
from omnilink._errors import (
    ChunkGapError,
    ChunkInvariantError,
    ChunkSequenceError,
    DuplicateChunkError,
    StreamFinishedError,
)
from omnilink.chunking.keys import chunk_key, parse_chunk_key
from omnilink.chunking.stream import ChunkReceiver, ChunkSender, accumulate, is_finished

__all__ = [
    "ChunkGapError",
    "ChunkInvariantError",
    "ChunkReceiver",
    "ChunkSender",
    "ChunkSequenceError",
    "CodecChunker",
    "CodecWatermark",
    "CodecWindow",
    "DuplicateChunkError",
    "PrefillChunk",
    "PrefillChunker",
    "StreamFinishedError",
    "accumulate",
    "check_boundaries",
    "check_chunk_ids",
    "check_codec_stream",
    "check_finish_only_on_boundary",
    "check_frames_preserved",
    "check_keys_injective",
    "check_left_context",
    "check_meta_nested",
    "check_prefill_chunks",
    "check_single_finish",
    "chunk_key",
    "chunk_schedule",
    "codec_frames_from_payload",
    "is_finished",
    "iter_boundaries",
    "join_codec_payloads",
    "parse_chunk_key",
]
