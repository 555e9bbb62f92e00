"""Worker process of ``test_chunk_stream.py`` (importable, for the ``spawn`` context).

The worker plays the upstream stages of one request: a talker streaming codec windows
(with a preemption half way, resumed from the watermarks) and a thinker streaming
prefill chunks of a growing bf16 hidden-state sequence, both over one ``shm`` channel.
It reports to the test through a queue as ``(tag, value)`` tuples and bounds every wait.
"""

from __future__ import annotations

WAIT = 30.0

CODEC = {"request_id": "chatcmpl_e2e_7", "stage": 1, "frames": 157, "codebooks": 8, "seed": 11,
         "chunk": 25, "left": 25, "initial": 4, "preempt_at": 61, "batch": 3}
PREFILL = {"request_id": "chatcmpl_e2e_7", "stage": 0, "rows": 300, "dim": 64, "seed": 5,
           "chunk": 48, "growth": (1, 37, 60, 2, 100, 50, 50)}


def codec_frames(spec=CODEC):
    """The talker's codec frames: ``[frames, codebooks]`` int64, the same in every process."""
    import torch

    g = torch.Generator().manual_seed(spec["seed"])
    return torch.randint(0, 2048, (spec["frames"], spec["codebooks"]), generator=g, dtype=torch.int64)


def hidden_states(spec=PREFILL):
    """The thinker's hidden states: ``[rows, dim]`` bfloat16, the same in every process."""
    import torch

    g = torch.Generator().manual_seed(spec["seed"])
    return torch.randn((spec["rows"], spec["dim"]), generator=g).to(torch.bfloat16)


def _send_codec(conn, spec) -> int:
    from omnilink.chunking import ChunkSender, CodecChunker

    frames = codec_frames(spec)
    cfg = dict(chunk_frames=spec["chunk"], left_context_frames=spec["left"], initial_chunk_frames=spec["initial"])
    chunker = CodecChunker(**cfg)
    tx = ChunkSender(conn, request_id=spec["request_id"], from_stage=spec["stage"])
    pos, preempted = 0, False
    while pos < spec["frames"]:
        if not preempted and pos >= spec["preempt_at"]:
            # Preemption: the stage loses its chunker and sender but keeps the
            # watermarks; the recomputed request replays every frame from 0.
            preempted = True
            chunker = CodecChunker(**cfg, resume_from=chunker.watermark(), replay_from=0)
            tx = ChunkSender(conn, request_id=spec["request_id"], from_stage=spec["stage"],
                             next_chunk_id=tx.next_chunk_id)
            for w in chunker.push(frames[:pos]):
                tx.send_window(w)
        batch = frames[pos : pos + spec["batch"]]
        pos += batch.shape[0]
        for w in chunker.push(batch, finished=pos >= spec["frames"]):
            tx.send_window(w)
    return tx.next_chunk_id


def _send_prefill(conn, spec) -> int:
    from omnilink.chunking import ChunkSender, PrefillChunker

    seq = hidden_states(spec)
    chunker = PrefillChunker(spec["chunk"])
    tx = ChunkSender(conn, request_id=spec["request_id"], from_stage=spec["stage"])
    n = 0
    for g in spec["growth"]:
        n += g
        for c in chunker.update(seq[:n]):
            tx.send({"hidden_states": {"output": c.data}, "meta": {"finished": False}})
    for c in chunker.finish(seq):
        tx.send({"hidden_states": {"output": c.data}, "meta": {"finished": c.finished}})
    return tx.next_chunk_id


def upstream_stages(channel: str, q, ready, done) -> None:
    """Wait for the receiver, stream both requests, wait for ``done``, close."""
    try:
        import omnilink

        if not ready.wait(WAIT):
            raise TimeoutError("the receiver never said it was ready")
        with omnilink.connect("shm", channel=channel, role="sender", arena_bytes=4 << 20, timeout=WAIT) as conn:
            q.put(("sent", (_send_codec(conn, CODEC), _send_prefill(conn, PREFILL))))
            if not done.wait(WAIT):
                raise TimeoutError("the receiver never said it was done")
    except BaseException as exc:  # report everything; the test decides
        q.put(("error", f"{type(exc).__name__}: {exc}"))
        raise
