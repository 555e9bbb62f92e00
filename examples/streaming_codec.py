"""Streaming codec frames talker -> code2wav with chunk framing over shared memory.

Shows: ``CodecChunker`` cutting a talker's codec frames into windows (initial chunk of 4
frames so the first audio comes early, then chunks of 25 with 25 frames of left
context), ``ChunkSender`` / ``ChunkReceiver`` carrying them over the ``shm`` backend as
vLLM-Omni-shaped payloads (``codes.audio`` plus a nested ``meta``), a preemption in the
middle of the stream resumed from the watermarks without resending anything, and a toy
code2wav that decodes each window and drops its left-context audio. The audio streamed
chunk by chunk is asserted equal to the audio of the whole stream decoded at once.
Run: ``python examples/streaming_codec.py``.
"""

from __future__ import annotations

import os
import threading

import torch

import omnilink
from omnilink.chunking import ChunkReceiver, ChunkSender, CodecChunker

Q = 8  # codebooks per frame
SAMPLES_PER_FRAME = 4
CHUNK_FRAMES, LEFT_CONTEXT_FRAMES, INITIAL_CHUNK_FRAMES = 25, 25, 4
REQUEST = "chatcmpl_demo_42"
TALKER_STAGE = 1


def talker_frames(n: int = 203) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 2048, (n, Q), generator=g)


def code2wav(codes_audio: torch.Tensor) -> torch.Tensor:
    """A toy vocoder: each frame becomes SAMPLES_PER_FRAME samples that depend on the frame
    and on the frame before it (so left context matters, as in a real codec decoder)."""
    frames = codes_audio.reshape(Q, -1).T.to(torch.float32)  # codebook-major -> [n, Q]
    prev = torch.cat((torch.zeros(1, Q), frames[:-1])) if frames.shape[0] else frames
    per_frame = (frames.sum(1) + 0.5 * prev.sum(1)) / 2048.0
    return per_frame.repeat_interleave(SAMPLES_PER_FRAME)


def talker(conn: omnilink.Connector, frames: torch.Tensor, errors: list[BaseException]) -> None:
    """Push frames one decode step at a time; preempted once, resumed from the watermarks."""
    try:
        chunker = CodecChunker(CHUNK_FRAMES, LEFT_CONTEXT_FRAMES, initial_chunk_frames=INITIAL_CHUNK_FRAMES)
        tx = ChunkSender(conn, request_id=REQUEST, from_stage=TALKER_STAGE, timeout=30.0)
        for step in range(frames.shape[0]):
            if step == 90:
                # Preemption: the request is recomputed from scratch. Only the watermarks
                # survive; replayed frames already sent are skipped, ids continue.
                chunker = CodecChunker(CHUNK_FRAMES, LEFT_CONTEXT_FRAMES, initial_chunk_frames=INITIAL_CHUNK_FRAMES,
                                       resume_from=chunker.watermark(), replay_from=0)
                tx = ChunkSender(conn, request_id=REQUEST, from_stage=TALKER_STAGE,
                                 next_chunk_id=tx.next_chunk_id, timeout=30.0)
                for window in chunker.push(frames[:step]):
                    tx.send_window(window)
            for window in chunker.push(frames[step], finished=step == frames.shape[0] - 1):
                tx.send_window(window)
    except BaseException as exc:  # reported to main(), which asserts there were none
        errors.append(exc)


def main() -> None:
    frames = talker_frames()
    channel = f"examples/streaming-codec-{os.getpid()}"
    errors: list[BaseException] = []
    rx_conn = omnilink.connect("shm", channel=channel, role="receiver", timeout=30.0)
    tx_conn = None
    thread = None
    try:
        tx_conn = omnilink.connect("shm", channel=channel, role="sender", arena_bytes=4 << 20)
        thread = threading.Thread(target=talker, args=(tx_conn, frames, errors), daemon=True)
        thread.start()

        pieces, left_contexts = [], []
        for payload in ChunkReceiver(rx_conn, request_id=REQUEST, from_stage=TALKER_STAGE, timeout=30.0):
            meta = payload["meta"]  # nested, as code2wav reads it
            lc = meta["left_context_size"]
            audio = code2wav(payload["codes.audio"])
            pieces.append(audio[lc * SAMPLES_PER_FRAME :])  # drop the left context's audio
            left_contexts.append(lc)
        thread.join(30.0)
        assert not thread.is_alive(), "the talker thread did not finish"
        assert not errors, errors

        streamed = torch.cat(pieces)
        whole = code2wav(frames.T.reshape(-1))
        assert torch.equal(streamed, whole), "streamed audio differs from the whole stream's audio"
        assert left_contexts[:3] == [0, 4, 25], left_contexts
        print(
            f"streamed {frames.shape[0]} frames in {len(pieces)} chunks "
            f"(first audio after {INITIAL_CHUNK_FRAMES} frames); "
            f"{streamed.numel()} samples equal to decoding the whole stream"
        )
    finally:
        if thread is not None:
            thread.join(30.0)
        if tx_conn is not None:
            tx_conn.close()
        rx_conn.close()


if __name__ == "__main__":
    main()
