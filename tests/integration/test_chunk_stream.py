"""End to end: one request streamed through ``shm`` between two processes (spawn),
reassembled exactly on the other side.

The child (``_chunk_workers.upstream_stages``) is the talker and the thinker of the
request; this process is code2wav and the talker's input side. Every wait is bounded:
the child is joined with a timeout and killed if it overstays.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import uuid

import pytest
import torch

pytest.importorskip(
    "omnilink.connectors.shm", reason="the shm backend (omnilink/connectors/shm.py) is not importable yet"
)

import omnilink  # noqa: E402
from omnilink.chunking import (  # noqa: E402
    ChunkReceiver,
    accumulate,
    check_chunk_ids,
    check_meta_nested,
    join_codec_payloads,
)
from tests.integration import _chunk_workers as workers  # noqa: E402

CTX = mp.get_context("spawn")
WAIT = workers.WAIT


def _drain(q) -> list[tuple[str, object]]:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def test_streamed_request_through_shm_between_processes_reassembles_exactly():
    channel = f"chunk-e2e/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    q, ready, done = CTX.Queue(), CTX.Event(), CTX.Event()
    child = CTX.Process(target=workers.upstream_stages, args=(channel, q, ready, done), daemon=True)
    child.start()
    try:
        with omnilink.connect("shm", channel=channel, role="receiver", timeout=WAIT) as conn:
            ready.set()
            codec = workers.CODEC
            payloads = list(ChunkReceiver(conn, request_id=codec["request_id"], from_stage=codec["stage"], timeout=WAIT))
            check_meta_nested(payloads, require=("finished", "left_context_size", "chunk_id"))
            check_chunk_ids([p["meta"]["chunk_id"] for p in payloads])
            frames = join_codec_payloads(payloads, num_codebooks=codec["codebooks"])
            contexts = [p["meta"]["left_context_size"] for p in payloads]
            finished = [bool(p["meta"]["finished"]) for p in payloads]
            del payloads  # views of the sender's arena: hand the blocks back

            pre = workers.PREFILL
            acc, n_prefill = None, 0
            for p in ChunkReceiver(conn, request_id=pre["request_id"], from_stage=pre["stage"], timeout=WAIT):
                acc = accumulate(acc, p)
                n_prefill += 1
            done.set()
        child.join(WAIT)
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
    reports = _drain(q)
    errors = [v for tag, v in reports if tag == "error"]
    assert not errors, errors
    assert child.exitcode == 0, f"child exited with {child.exitcode}; reports: {reports}"
    (sent,) = [v for tag, v in reports if tag == "sent"]

    # Codec: exactly the talker's frames, context as configured, one finish at the end,
    # and no chunk id sent twice across the preemption.
    expected = workers.codec_frames()
    assert torch.equal(frames, expected)
    assert len(contexts) == sent[0]
    assert contexts[0] == 0 and contexts[1] == codec["initial"] and set(contexts[2:]) == {codec["left"]}
    assert finished == [False] * (len(finished) - 1) + [True]

    # Prefill: the accumulated hidden states are the thinker's sequence, bit for bit.
    hidden = workers.hidden_states()
    out = acc["hidden_states"]["output"]
    assert out.dtype == torch.bfloat16 and torch.equal(out, hidden)
    assert n_prefill == sent[1]
    assert bool(acc["meta"]["finished"])
