"""ChunkSender / ChunkReceiver over the memory backend, and accumulate()."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch

import omnilink
from omnilink.chunking import (
    ChunkGapError,
    ChunkReceiver,
    ChunkSender,
    ChunkSequenceError,
    CodecChunker,
    DuplicateChunkError,
    StreamFinishedError,
    accumulate,
    is_finished,
    join_codec_payloads,
)

_n = itertools.count()


@pytest.fixture
def conn():
    with omnilink.connect("memory", channel=f"chunk-unit/{next(_n)}") as c:
        yield c


def _p(i, finished=False):
    return {"x": torch.tensor([i]), "meta": {"finished": finished}}


def test_ids_count_up_and_the_finish_ends_the_stream(conn):
    tx = ChunkSender(conn, request_id="chatcmpl_ab_12", from_stage=0)
    assert [tx.send(_p(0)), tx.send(_p(1)), tx.finish(_p(2))] == [0, 1, 2]
    assert tx.finished and tx.next_chunk_id == 3
    got = list(ChunkReceiver(conn, request_id="chatcmpl_ab_12", from_stage=0, timeout=0))
    assert [int(p["x"][0]) for p in got] == [0, 1, 2]
    assert [p["meta"]["chunk_id"] for p in got] == [0, 1, 2]
    assert bool(got[-1]["meta"]["finished"]) and not any(bool(p["meta"]["finished"]) for p in got[:-1])


def test_keys_on_the_transport_are_chunk_keys(conn):
    ChunkSender(conn, request_id="r_x", from_stage=3).finish()
    payload = conn.get("r_x_3_0", timeout=0)
    assert bool(payload["meta"]["finished"])


def test_the_callers_payload_is_not_modified(conn):
    p = {"x": torch.tensor([1]), "meta": {"finished": False, "speaker": "a"}}
    ChunkSender(conn, request_id="r", from_stage=0).send(p)
    assert p["meta"] == {"finished": False, "speaker": "a"}


def test_finish_exactly_once_and_nothing_after(conn):
    tx = ChunkSender(conn, request_id="r", from_stage=0)
    tx.send(_p(0, finished=True))  # meta.finished in the payload finishes too
    for call in (lambda: tx.send(_p(1)), lambda: tx.finish(), lambda: tx.finish(_p(2))):
        with pytest.raises(StreamFinishedError) as ei:
            call()
        assert ei.value.chunk_id == 1 and ei.value.request_id == "r"
    assert tx.next_chunk_id == 1


def test_finished_may_be_a_tensor_bool_or_numpy(conn):
    assert is_finished({"meta": {"finished": torch.tensor(True)}})
    assert is_finished({"meta": {"finished": torch.tensor([True])}})
    assert is_finished({"meta": {"finished": np.bool_(True)}})
    assert not is_finished({"meta": {"finished": torch.tensor(False)}})
    assert not is_finished({"x": 1})
    with pytest.raises(omnilink.ConfigurationError):
        is_finished({"meta": {"finished": torch.tensor([True, False])}})
    with pytest.raises(omnilink.ConfigurationError):
        is_finished({"meta": {"finished": "yes"}})


def test_failed_put_does_not_consume_the_id():
    with omnilink.connect("memory", channel=f"chunk-unit/{next(_n)}", capacity_bytes=4096) as conn:
        tx = ChunkSender(conn, request_id="r", from_stage=0)
        with pytest.raises(omnilink.CapacityError):
            tx.send({"big": torch.zeros(10_000), "meta": {"finished": False}})
        assert tx.send(_p(0)) == 0


def test_resumed_sender_continues_above_the_watermark(conn):
    tx = ChunkSender(conn, request_id="r", from_stage=0)
    tx.send(_p(0))
    tx.send(_p(1))
    tx2 = ChunkSender(conn, request_id="r", from_stage=0, next_chunk_id=tx.next_chunk_id)
    assert tx2.finish(_p(2)) == 2
    got = list(ChunkReceiver(conn, request_id="r", from_stage=0, timeout=0))
    assert [int(p["x"][0]) for p in got] == [0, 1, 2]


def test_send_window_checks_the_id_against_the_watermark(conn):
    c = CodecChunker(2, 1)
    w0, w1 = c.push(torch.zeros(4, 2, dtype=torch.int64))
    tx = ChunkSender(conn, request_id="r", from_stage=1)
    with pytest.raises(ChunkGapError):
        tx.send_window(w1)
    tx.send_window(w0)
    with pytest.raises(DuplicateChunkError):
        tx.send_window(w0)
    assert tx.send_window(w1) == 1


def test_codec_stream_over_the_connector_reassembles_exactly(conn):
    fr = torch.randint(0, 2048, (57, 8))
    c = CodecChunker(25, 25, initial_chunk_frames=4)
    tx = ChunkSender(conn, request_id="chatcmpl_q_1", from_stage=1)
    for i in range(57):
        for w in c.push(fr[i]):
            tx.send_window(w)
    for w in c.finish():
        tx.send_window(w)
    got = list(ChunkReceiver(conn, request_id="chatcmpl_q_1", from_stage=1, timeout=0))
    assert torch.equal(join_codec_payloads(got, num_codebooks=8), fr)
    assert [p["meta"]["left_context_size"] for p in got] == [0, 4, 25, 25]


def test_receiver_waits_for_a_sender_in_another_thread(conn):
    def produce():
        tx = ChunkSender(conn, request_id="r", from_stage=0)
        for i in range(5):
            tx.send(_p(i))
        tx.finish()

    t = threading.Thread(target=produce)
    t.start()
    try:
        got = list(ChunkReceiver(conn, request_id="r", from_stage=0, timeout=10))
    finally:
        t.join(10)
    assert len(got) == 6 and not t.is_alive()


def test_receive_nowait_would_block_then_succeeds(conn):
    rx = ChunkReceiver(conn, request_id="r", from_stage=0)
    with pytest.raises(omnilink.WouldBlock):
        rx.receive_nowait()
    ChunkSender(conn, request_id="r", from_stage=0).finish(_p(0))
    assert int(rx.receive_nowait()["x"][0]) == 0
    assert rx.finished
    with pytest.raises(StreamFinishedError):
        rx.receive_nowait()


def test_missing_chunk_with_nothing_after_is_a_plain_timeout(conn):
    rx = ChunkReceiver(conn, request_id="r", from_stage=0, timeout=0)
    with pytest.raises(omnilink.TransferTimeout) as ei:
        rx.receive()
    assert not isinstance(ei.value, ChunkSequenceError)


def test_gap_is_reported_and_the_later_chunk_is_kept(conn):
    tx = ChunkSender(conn, request_id="r", from_stage=0)
    tx.send(_p(0))
    ChunkSender(conn, request_id="r", from_stage=0, next_chunk_id=2).finish(_p(2))
    rx = ChunkReceiver(conn, request_id="r", from_stage=0, timeout=0)
    assert int(rx.receive()["x"][0]) == 0
    with pytest.raises(ChunkGapError) as ei:
        rx.receive()
    assert ei.value.chunk_id == 1 and isinstance(ei.value.__cause__, omnilink.TransferTimeout)
    # The missing chunk turns up late: nothing was lost, order is kept.
    ChunkSender(conn, request_id="r", from_stage=0, next_chunk_id=1).send(_p(1))
    assert [int(p["x"][0]) for p in rx] == [1, 2]


def test_in_band_id_mismatch_is_a_duplicate_or_a_gap(conn):
    conn.put("r_0_0", {"meta": {"finished": False, "chunk_id": 0}})
    conn.put("r_0_1", {"meta": {"finished": False, "chunk_id": 0}})
    conn.put("r_0_2", {"meta": {"finished": False, "chunk_id": 5}})
    rx = ChunkReceiver(conn, request_id="r", from_stage=0, timeout=0)
    rx.receive()
    with pytest.raises(DuplicateChunkError):
        rx.receive()
    rx2 = ChunkReceiver(conn, request_id="r", from_stage=0, next_chunk_id=2, timeout=0)
    with pytest.raises(ChunkGapError):
        rx2.receive()


def test_chunks_sent_after_the_finish_are_reported(conn):
    ChunkSender(conn, request_id="r", from_stage=0).finish(_p(0))
    conn.put("r_0_1", _p(1))  # a buggy sender that ignored the finish
    rx = ChunkReceiver(conn, request_id="r", from_stage=0, timeout=0)
    got = []
    with pytest.raises(StreamFinishedError, match="after the finish"):
        for p in rx:
            got.append(p)
    assert len(got) == 1  # the finishing chunk itself was delivered first
    with pytest.raises(omnilink.KeyConsumedError):
        conn.get_nowait("r_0_1")  # and the straggler does not linger on the transport


def test_probe_can_be_turned_off(conn):
    ChunkSender(conn, request_id="r", from_stage=0).finish(_p(0))
    conn.put("r_0_1", _p(1))
    assert len(list(ChunkReceiver(conn, request_id="r", from_stage=0, timeout=0, probe_duplicates=False))) == 1


def test_flat_meta_is_refused_everywhere(conn):
    flat = {"x": torch.tensor([1]), "meta.finished": True}
    tx = ChunkSender(conn, request_id="r", from_stage=0)
    with pytest.raises(omnilink.ConfigurationError, match="nested"):
        tx.send(flat)
    with pytest.raises(omnilink.ConfigurationError, match="nested"):
        tx.finish(flat)
    conn.put("r_0_0", flat)
    with pytest.raises(omnilink.ConfigurationError, match="nested"):
        ChunkReceiver(conn, request_id="r", from_stage=0, timeout=0).receive()


def test_bad_arguments(conn):
    with pytest.raises(omnilink.ConfigurationError):
        ChunkSender(conn, request_id=None, from_stage=0)
    with pytest.raises(omnilink.ConfigurationError):
        ChunkSender(conn, request_id="r", from_stage="a_b")
    with pytest.raises(omnilink.ConfigurationError):
        ChunkSender(conn, request_id="r", from_stage=0, next_chunk_id=-1)
    with pytest.raises(omnilink.ConfigurationError):
        ChunkReceiver(conn, request_id="", from_stage=0)
    with pytest.raises(omnilink.ConfigurationError):
        ChunkReceiver(conn, request_id="r", from_stage=0, timeout=-1)
    with pytest.raises(omnilink.ConfigurationError):
        ChunkSender(conn, request_id="r", from_stage=0).send([1, 2])


def test_closed_connector_errors_pass_through():
    conn = omnilink.connect("memory", channel=f"chunk-unit/{next(_n)}")
    conn.close()
    with pytest.raises(omnilink.ClosedError):
        ChunkSender(conn, request_id="r", from_stage=0).send(_p(0))


# ------------------------------------------------------------------ accumulate
def test_accumulate_concatenates_extends_replaces_and_keeps_meta_nested():
    a = {
        "hidden_states": {"output": torch.ones(2, 3)},
        "ids": {"output": [1, 2]},
        "speaker": "a",
        "arr": np.zeros((1, 2)),
        "meta": {"finished": torch.tensor(False), "left_context_size": 0},
    }
    b = {
        "hidden_states": {"output": torch.zeros(1, 3)},
        "ids": {"output": [3]},
        "speaker": "b",
        "arr": np.ones((2, 2)),
        "meta": {"finished": torch.tensor(True), "left_context_size": 4},
        "new": [9],
    }
    snapshot_ids = list(a["ids"]["output"])
    out = accumulate(accumulate(None, a), b)
    assert out["hidden_states"]["output"].shape == (3, 3)
    assert out["ids"]["output"] == [1, 2, 3]
    assert out["speaker"] == "b"
    assert out["arr"].shape == (3, 2)
    assert bool(out["meta"]["finished"]) and out["meta"]["left_context_size"] == 4
    assert out["new"] == [9]
    assert a["ids"]["output"] == snapshot_ids  # inputs untouched


def test_accumulate_replace_keys_by_name_or_dotted_path():
    a = {"embed": {"prefill": torch.ones(2, 1), "tts_bos": torch.ones(1, 1)}, "ids": {"all": [1]}}
    b = {"embed": {"prefill": torch.ones(3, 1), "tts_bos": torch.zeros(1, 1)}, "ids": {"all": [1, 2]}}
    out = accumulate(a, b, replace_keys={"embed.prefill", "all"})
    assert out["embed"]["prefill"].shape == (3, 1)
    assert out["embed"]["tts_bos"].shape == (2, 1)
    assert out["ids"]["all"] == [1, 2]


def test_accumulate_none_never_erases():
    out = accumulate({"x": torch.ones(1), "y": None}, {"x": None, "y": torch.ones(2)})
    assert out["x"].shape == (1,) and out["y"].shape == (2,)


def test_accumulate_refuses_what_cannot_merge():
    with pytest.raises(omnilink.ConfigurationError, match="differ"):
        accumulate({"x": torch.ones(1, 2)}, {"x": torch.ones(1, 3)})
    with pytest.raises(omnilink.ConfigurationError, match="cannot merge"):
        accumulate({"x": torch.ones(1)}, {"x": [1]})
    with pytest.raises(omnilink.ConfigurationError):
        accumulate(None, [1])
    with pytest.raises(omnilink.ConfigurationError):
        accumulate([1], {})
