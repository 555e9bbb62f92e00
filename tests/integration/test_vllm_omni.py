"""``OmnilinkConnector`` against vLLM-Omni's real ``OmniConnectorFactory`` and base class.

vLLM is not needed: ``_vllm_omni_stubs`` loads the connector modules of the installed
``vllm-omni`` wheel (``pip install --no-deps vllm-omni==0.30.0``, done by ``make test``)
under namespace stubs. Covers vLLM-Omni's connector contract (as
``omnilink.integrations.vllm_omni`` states it) point by point.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import time
from importlib.metadata import EntryPoint
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

import omnilink
from omnilink.chunking import CodecChunker, chunk_key, join_codec_payloads
from tests.integration import _vllm_omni_stubs as stubs
from tests.payload_equal import assert_same as assert_payload_equal

try:
    API = stubs.install()
except ImportError as exc:  # pragma: no cover - make test installs it
    pytest.skip(f"vllm-omni is not installed ({exc}); run `{stubs.PIP_HINT}`", allow_module_level=True)

from omnilink.integrations import vllm_omni as integ  # noqa: E402  (after the stubs)

Factory = API["OmniConnectorFactory"]
Base = API["OmniConnectorBase"]
Spec = API["ConnectorSpec"]
REPO = Path(__file__).resolve().parents[2]
CTX = mp.get_context("spawn")
SMALL = {"arena_bytes": 4 << 20}


@pytest.fixture(scope="module", autouse=True)
def registered():
    integ.register()


def _prefix(name: str) -> str:
    return f"t{os.getpid()}-{name}"


def make(name: str, role: str, stage_id: int, **extra):
    """Create through the real factory, with what vLLM-Omni injects (stage_id, role)."""
    extra.setdefault("options", dict(SMALL))
    spec = Spec(name="OmnilinkConnector", extra={"channel": _prefix(name), "stage_id": stage_id, "role": role, **extra})
    return Factory.create_connector(spec)


@pytest.fixture
def pair(request):
    """Stage 0 (sender) and stage 1 (receiver) of edge 0 -> 1."""
    name = request.node.name.replace("[", "-").replace("]", "").replace("_", "-")[:40]
    tx = make(name, "sender", 0, from_stage=0, to_stage=1)
    rx = make(name, "receiver", 1, from_stage=0, to_stage=1)
    yield tx, rx
    rx.close()
    tx.close()


def sender_blocks(tx) -> int:
    return tx.edge("0", "1", side="sender").stats().blocks_in_use


# ------------------------------------------------------------------ payloads vLLM-Omni moves
def thinker_to_talker():
    return stubs.thinker_payload(3)


def talker_to_code2wav():
    return {
        "codes.audio": torch.arange(16 * 4, dtype=torch.int64),  # 4 frames x 16 codebooks, flat
        "meta.finished": torch.tensor(True),
    }


def cosyvoice3():
    return {
        "embed.speech_token": torch.randint(0, 6561, (1, 50), dtype=torch.int32),
        "embed.speech_feat": torch.randn(1, 80, 100, dtype=torch.float32),
        "embed.embedding": torch.randn(1, 192, dtype=torch.float16),
    }


def plain_metadata():
    return {"speaker": "Ethan", "language": "en", "ids.output": [1, 2, 3], "meta.finished": torch.tensor(False)}


PAYLOADS = {
    "thinker-talker": thinker_to_talker,
    "talker-code2wav": talker_to_code2wav,
    "cosyvoice3": cosyvoice3,
    "plain-metadata": plain_metadata,
}


# ------------------------------------------------------------------ registration
def test_importing_omnilink_imports_no_vllm():
    code = (
        "import sys, omnilink, omnilink.integrations, omnilink.integrations.vllm_omni\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'vllm_omni')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def test_register_with_the_real_factory_is_idempotent():
    assert "OmnilinkConnector" in Factory.list_registered_connectors()
    cls = integ.register()
    assert integ.register(Factory) is cls is integ.OmnilinkConnector
    assert issubclass(cls, Base)
    assert Factory._registry["OmnilinkConnector"] is cls


def test_register_refuses_a_name_taken_by_another_connector():
    class Other(Factory):  # a factory of its own: the real registry stays untouched
        _registry = {"OmnilinkConnector": object}

    with pytest.raises(omnilink.ConfigurationError, match="already registered"):
        integ.register(Other)


def test_entry_point_is_declared_for_vllm_omni_plugins():
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python >= 3.11")
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    group = meta["project"]["entry-points"]["vllm_omni.general_plugins"]
    assert group["omnilink"] == "omnilink.integrations.vllm_omni:register"
    # What vllm_omni.plugins.load_omni_general_plugins does with it: load, then call.
    ep = EntryPoint(name="omnilink", value=group["omnilink"], group="vllm_omni.general_plugins")
    assert ep.load()() is integ.OmnilinkConnector


def test_factory_creates_with_injected_stage_and_role(pair):
    tx, rx = pair
    for conn, stage, role in ((tx, 0, "sender"), (rx, 1, "receiver")):
        assert isinstance(conn, Base) and type(conn) is integ.OmnilinkConnector
        assert conn.stage_id == stage and conn.role == role
        assert conn.supports_raw_data is True
    extra = {"codec_chunk_frames": 25, "codec_left_context_frames": 25, "initial_codec_chunk_frames": 4}
    with make("codec", "receiver", 2, **extra) as c:
        assert c.config["codec_chunk_frames"] == 25
        assert c.config["codec_left_context_frames"] == 25
        assert c.config["initial_codec_chunk_frames"] == 4
        assert c.backend == "shm" and "backend" not in c.config


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"backend": "nope"}, "unknown backend"),
        ({"options": {"channel": "x"}}, "must not set 'channel'"),
        ({"codec_chunk_frames": 0}, "codec_chunk_frames"),
        ({"role": "boss"}, "role"),
        ({"channel": "bad name"}, "invalid channel"),
        ({"options": {"arena_bytes": 1}}, "arena_bytes"),
    ],
)
def test_bad_config_fails_at_creation(extra, match):
    spec = Spec(name="OmnilinkConnector", extra={"stage_id": 0, "role": "sender", "from_stage": 0, "to_stage": 1,
                                                 "channel": _prefix("bad"), **{"options": SMALL, **extra}})
    with pytest.raises(ValueError, match=match):  # the factory wraps our ConfigurationError
        Factory.create_connector(spec)


# ------------------------------------------------------------------ put / get
@pytest.mark.parametrize("shape", sorted(PAYLOADS))
def test_round_trip_of_each_payload_shape(pair, shape):
    tx, rx = pair
    payload = PAYLOADS[shape]()
    key = chunk_key("chatcmpl_ab_12", 0, 0)
    ok, size, md = tx.put("0", "1", key, payload)
    assert ok and size == omnilink.encoded_size(payload)
    got, got_size = rx.get("0", "1", key, md)
    assert got_size == size
    assert_payload_equal(got, payload)
    tensors = [v for v in got.values() if isinstance(v, torch.Tensor) and v.numel()]
    mapping = rx.edge("0", "1", side="receiver")
    for t in tensors:  # zero-copy: views of the sender's arena
        assert mapping.mapping_of(t.data_ptr()) is not None
    if "meta.finished" in got:
        assert got["meta.finished"].dim() == 0 and got["meta.finished"].dtype == torch.bool


def test_struct_payload_arrives_as_the_dict_msgspec_makes():
    # What vLLM-Omni's chunk adapter puts: an OmniPayloadStruct (nested Structs).
    import importlib

    keys = importlib.import_module("vllm_omni.data_entry_keys")
    struct = keys.OmniPayloadStruct(
        codes=keys.CodesStruct(audio=torch.arange(32, dtype=torch.int64)),
        meta=keys.MetaStruct(finished=torch.tensor(True), left_context_size=25),
        speaker="Chelsie",
    )
    with make("struct", "dual", 1) as conn:
        ok, size, md = conn.put("1", "2", "rq_1_0", struct)
        assert ok
        got, _ = conn.get("1", "2", "rq_1_0", md)
    assert set(got) == {"codes", "meta", "speaker"}  # None fields omitted, as msgspec does
    assert set(got["meta"]) == {"finished", "left_context_size"}
    ref = msgspec.msgpack.decode(msgspec.msgpack.encode(struct, enc_hook=lambda t: t.tolist()))
    assert set(ref) == set(got) and set(ref["meta"]) == set(got["meta"]) and set(ref["codes"]) == set(got["codes"])
    assert got["meta"]["left_context_size"] == 25 and bool(got["meta"]["finished"])
    assert torch.equal(got["codes"]["audio"], torch.arange(32))

    @dataclasses.dataclass
    class Extra:
        name: str
        x: torch.Tensor

    with make("dataclass", "dual", 1) as conn:
        assert conn.put("1", "2", "dc_1_0", {"extra": Extra("a", torch.ones(3))})[0]
        got, _ = conn.get("1", "2", "dc_1_0")
    assert got["extra"]["name"] == "a" and torch.equal(got["extra"]["x"], torch.ones(3))


def test_raw_tensor_and_bytes(pair):
    tx, rx = pair
    raw = torch.arange(100, dtype=torch.uint8)
    assert tx.put("0", "1", "kv_raw", raw)[0]
    assert tx.put("0", "1", "kv_bytes", b"\x00\x01abc")[0]
    got, _ = rx.get("0", "1", "kv_raw")
    assert torch.equal(got, raw)
    assert rx.get("0", "1", "kv_bytes")[0] == b"\x00\x01abc"


def test_missing_key_is_none_and_never_raises(pair):
    _tx, rx = pair
    for md in (None, {}, {"shm": {"name": "x", "size": 3}}, {"missing_1_0": {"size": 1}}):
        assert rx.get("0", "1", "missing_1_0", md) is None
    assert rx.get("7", "8", "other_7_0") is None  # an edge nobody sends on yet


@pytest.mark.parametrize("form", ["as-returned", "keyed-by-key", "none", "foreign"])
def test_metadata_forms(pair, form):
    tx, rx = pair
    key = chunk_key("req-md", 0, 0)
    ok, _, md = tx.put("0", "1", key, talker_to_code2wav())
    assert ok and md["omnilink"]["key"] == key and md["size"] > 0
    given = {"as-returned": md, "keyed-by-key": {key: md}, "none": None,
             "foreign": {"shm": {"name": key, "size": 10}}}[form]
    got, _ = rx.get("0", "1", key, given)
    assert bool(got["meta.finished"])


def test_metadata_channel_wins_over_a_different_prefix():
    tx = make("md-a", "sender", 0, from_stage=0, to_stage=1)
    rx = make("md-b", "receiver", 1, from_stage=0, to_stage=1)
    try:
        ok, _, md = tx.put("0", "1", "x_0_0", plain_metadata())
        assert ok
        assert rx.get("0", "1", "x_0_0") is None  # by key alone: another channel
        assert rx.get("0", "1", "x_0_0", md)[0]["speaker"] == "Ethan"
    finally:
        rx.close()
        tx.close()


def test_reads_consume_exactly_once(pair):
    tx, rx = pair
    name = pair[0].channel_prefix.split("-", 1)[1]
    rx2 = make(name, "receiver", 1, from_stage=0, to_stage=1)
    try:
        keys = [chunk_key("once", 0, c) for c in range(6)]
        for k in keys:
            assert tx.put("0", "1", k, talker_to_code2wav())[0]
        hits = 0
        for k in keys:
            a = rx.get("0", "1", k)
            b = rx2.get("0", "1", k)
            assert (a is None) != (b is None)
            hits += 1
            assert rx.get("0", "1", k) is None and rx2.get("0", "1", k) is None
        assert hits == len(keys)
    finally:
        rx2.close()


def test_get_with_deadline_waits_then_gives_none(pair):
    tx, rx = pair
    assert rx.get_with_deadline("0", "1", "late_0_0", deadline=time.monotonic() + 0.05) is None
    assert tx.put("0", "1", "late_0_0", plain_metadata())[0]
    got = rx.get_with_deadline("0", "1", "late_0_0", deadline=time.monotonic() + 5.0)
    assert got is not None and got[0]["language"] == "en"


def test_zero_copy_off_releases_the_block_at_once():
    tx = make("copy", "sender", 0, from_stage=0, to_stage=1)
    rx = make("copy", "receiver", 1, from_stage=0, to_stage=1, zero_copy=False)
    try:
        assert tx.put("0", "1", "c_0_0", cosyvoice3())[0]
        got, _ = rx.get("0", "1", "c_0_0")
        edge = rx.edge("0", "1", side="receiver")
        assert edge.stats().blocks_in_use == 0  # nothing of the arena held ...
        assert edge.mapping_of(got["embed.speech_feat"].data_ptr()) is None  # ... owned copies
        assert got["embed.speech_feat"].shape == (1, 80, 100)
    finally:
        rx.close()
        tx.close()


# ------------------------------------------------------------------ failures
def test_put_failure_returns_false_zero_none(pair, caplog):
    tx, rx = pair
    before = sender_blocks(tx)
    with caplog.at_level("ERROR", logger="omnilink.integrations.vllm_omni"):
        assert tx.put("0", "1", "bad_0_0", {"meta": {"x": object()}}) == (False, 0, None)
        assert tx.put("0", "1", "", plain_metadata()) == (False, 0, None)  # invalid key
        assert tx.put("0", "bad stage", "k", plain_metadata()) == (False, 0, None)
    assert "payload['meta']['x']" in caplog.text
    assert sender_blocks(tx) == before  # nothing half-sent
    assert tx.health()["put_failures"] == 3
    assert rx.get("0", "1", "bad_0_0") is None


def test_full_arena_put_fails_after_put_timeout():
    tx = make("full", "sender", 0, from_stage=0, to_stage=1, put_timeout=0.05,
              options={"arena_bytes": 1 << 20, "overflow": "error"})
    try:
        chunk = {"x": np.zeros(300 << 10, dtype=np.uint8)}
        assert tx.put("0", "1", "a_0_0", chunk)[0]
        # Nobody reads: the arena stays full, the put gives up after put_timeout.
        assert tx.put("0", "1", "a_0_1", chunk) == (False, 0, None)
        # Larger than the arena with overflow="error": CapacityError, reported, not raised.
        assert tx.put("0", "1", "a_0_2", {"x": np.zeros(2 << 20, dtype=np.uint8)}) == (False, 0, None)
        health = tx.health()
        assert health["put_failures"] == 2 and health["pending_keys"] == 1
        assert health["edges"]["sender:" + tx.channel_prefix + "/0-1"]["timeouts"] == 1
    finally:
        tx.close()


def test_close_is_idempotent_and_context_manager():
    with make("close", "dual", 0) as conn:
        assert conn.put("0", "1", "z_0_0", plain_metadata())[0]
    assert conn.closed
    conn.close()
    conn.close()
    assert conn.put("0", "1", "z_0_1", plain_metadata()) == (False, 0, None)
    with pytest.raises(omnilink.ClosedError):
        conn.get("0", "1", "z_0_0")
    conn.cleanup("z")  # no-op after close
    assert conn.health()["status"] == "closed"


# ------------------------------------------------------------------ cleanup
def test_cleanup_is_exact_a_request_id_matches_no_chunk(pair):
    # vLLM-Omni 0.30.0's contract: "a raw request id is not an exact key and must not
    # match any chunks". A caller that cleans up a finished request while the next stage
    # still has chunks to read must not take them away.
    tx, rx = pair
    for c in range(2):
        assert tx.put("0", "1", chunk_key("req", 0, c), cosyvoice3())[0]
    tx.cleanup("req")
    rx.cleanup("req")
    assert sender_blocks(tx) == 2
    assert tx.health()["discarded"] == 0 and rx.health()["discarded"] == 0
    for c in range(2):
        assert rx.get("0", "1", chunk_key("req", 0, c)) is not None


def test_cleanup_request_sweeps_every_chunk_of_the_request(pair):
    tx, rx = pair
    for c in range(3):
        assert tx.put("0", "1", chunk_key("req_A", 0, c), cosyvoice3())[0]
    assert tx.put("0", "1", chunk_key("req_B", 0, 0), cosyvoice3())[0]
    edge = tx.edge("0", "1", side="sender")
    assert edge.stats().blocks_in_use == 4
    in_use = edge.stats().bytes_in_use
    assert tx.cleanup_request("req_A") == 3
    assert edge.stats().blocks_in_use == 1
    assert edge.stats().bytes_in_use < in_use
    for c in range(3):
        assert rx.get("0", "1", chunk_key("req_A", 0, c)) is None
    assert rx.get("0", "1", chunk_key("req_B", 0, 0)) is not None  # other requests untouched
    assert tx.cleanup_request("req_A") == 0  # idempotent
    assert tx.cleanup_request("never-seen") == 0
    assert tx.health()["discarded"] == 3


def test_cleanup_of_an_exact_key_as_the_chunk_adapter_calls_it(pair):
    tx, rx = pair
    for c in range(2):
        assert tx.put("0", "1", chunk_key("ext", 0, c), talker_to_code2wav())[0]
    tx.cleanup(chunk_key("ext", 0, 1))
    assert sender_blocks(tx) == 1
    assert tx.health()["discarded"] == 1
    assert rx.get("0", "1", chunk_key("ext", 0, 0)) is not None
    assert rx.get("0", "1", chunk_key("ext", 0, 1)) is None
    tx.cleanup(chunk_key("ext", 0, 1))  # idempotent
    tx.cleanup("")  # never raises
    tx.cleanup(None)


def test_receiver_cleanup_of_an_exact_key(pair):
    tx, rx = pair
    for c in range(2):
        assert tx.put("0", "1", chunk_key("rk", 0, c), plain_metadata())[0]
    rx.cleanup(chunk_key("rk", 0, 0))
    assert rx.health()["discarded"] == 1
    assert rx.get("0", "1", chunk_key("rk", 0, 0)) is None
    assert rx.get("0", "1", chunk_key("rk", 0, 1)) is not None


def test_receiver_cleanup_request_discards_polled_and_later_chunks(pair):
    tx, rx = pair
    assert tx.put("0", "1", chunk_key("abort", 0, 0), thinker_to_talker())[0]
    assert rx.get("0", "1", chunk_key("abort", 0, 0)) is not None  # chunk 0 read (and dropped)
    assert rx.get("0", "1", chunk_key("abort", 0, 1)) is None  # chunk 1 polled before it arrived
    for c in range(1, 5):
        assert tx.put("0", "1", chunk_key("abort", 0, c), thinker_to_talker())[0]
    assert tx.put("0", "1", chunk_key("keep", 0, 0), thinker_to_talker())[0]
    assert rx.cleanup_request("abort") == 4  # aborted downstream: chunks 1..4 are garbage
    assert rx.health()["discarded"] == 4
    # The sender gets the blocks back with its next put (it drains released blocks then).
    assert tx.put("0", "1", chunk_key("keep", 0, 1), plain_metadata())[0]
    assert sender_blocks(tx) == 2
    assert rx.get("0", "1", chunk_key("keep", 0, 0)) is not None


def test_receiver_cleanup_request_before_any_poll(pair):
    tx, rx = pair
    for c in range(2):
        assert tx.put("0", "1", chunk_key("early", 0, c), plain_metadata())[0]
    assert tx.put("0", "1", "early", plain_metadata())[0]  # a whole-request key
    assert rx.cleanup_request("early") == 3
    assert rx.health()["discarded"] == 3


def test_abandon_get_forgets_the_polled_key_and_keeps_the_payload(pair):
    tx, rx = pair
    key = chunk_key("ab", 0, 0)
    assert rx.get("0", "1", key) is None
    assert rx.health()["pending_keys"] == 1
    rx.abandon_get(key)
    assert rx.health()["pending_keys"] == 0
    assert tx.put("0", "1", key, plain_metadata())[0]
    rx.abandon_get(key)  # a payload that arrived since is not touched
    assert rx.get("0", "1", key) is not None


def test_cleanup_returns_dev_shm_space_of_overflow_payloads():
    # A payload larger than the arena travels in a segment of its own in /dev/shm:
    # cleanup must unlink it (a no-op cleanup leaked /dev/shm segments until shutdown).
    tx = make("ovf", "sender", 0, from_stage=0, to_stage=1, options={"arena_bytes": 1 << 20})
    try:
        from tests.conftest import shm_entries

        before = shm_entries()
        assert tx.put("0", "1", "huge_0_0", {"x": np.zeros(3 << 20, dtype=np.uint8)})[0]
        assert len(shm_entries() - before) == 1
        tx.cleanup("huge_0_0")
        assert shm_entries() - before == set()
    finally:
        tx.close()


def test_pending_ttl_drops_unread_payloads(pair):
    name = pair[0].channel_prefix.split("-", 1)[1]
    tx = make(name, "sender", 0, from_stage=0, to_stage=1, pending_ttl=0)
    try:
        assert tx.put("0", "1", "old_0_0", plain_metadata())[0]
        tx.reap_consumed()
        assert tx.health()["expired"] == 1
        assert pair[1].get("0", "1", "old_0_0") is None
    finally:
        tx.close()


def test_index_forgets_consumed_keys_when_the_backend_tells(pair):
    tx, rx = pair
    for c in range(3):
        assert tx.put("0", "1", chunk_key("idx", 0, c), plain_metadata())[0]
    assert rx.get("0", "1", chunk_key("idx", 0, 0)) is not None
    edge = tx.edge("0", "1", side="sender")
    if not hasattr(edge, "pending_keys"):
        # Until the backend reports its pending keys, emulate it with the real state:
        # the keys a receiver can still claim (discarding and re-putting would change it).
        edge.pending_keys = lambda: [chunk_key("idx", 0, 1), chunk_key("idx", 0, 2)]
    assert tx.health()["pending_keys"] == 3
    tx.reap_consumed()
    assert tx.health()["pending_keys"] == 2


# ------------------------------------------------------------------ aborts and reclaim
def test_reclaim_after_follows_the_engines_input_wait_timeout(monkeypatch):
    monkeypatch.delenv("VLLM_OMNI_INPUT_WAIT_TIMEOUT_S", raising=False)
    with make("ra-default", "sender", 0) as conn:
        assert conn.health()["reclaim_after"] == 600.0
    monkeypatch.setenv("VLLM_OMNI_INPUT_WAIT_TIMEOUT_S", "42.5")
    with make("ra-env", "sender", 0) as conn:
        assert conn.health()["reclaim_after"] == 42.5
        assert conn.edge("0", "1", side="sender").reclaim_after == 42.5
    monkeypatch.setenv("VLLM_OMNI_INPUT_WAIT_TIMEOUT_S", "0")  # the engine waits forever
    with make("ra-off", "sender", 0) as conn:
        assert conn.health()["reclaim_after"] is None
    with make("ra-extra", "sender", 0, reclaim_after=7) as conn:
        assert conn.health()["reclaim_after"] == 7.0
    with make("ra-none", "sender", 0, reclaim_after=None) as conn:
        assert conn.edge("0", "1", side="sender").reclaim_after is None
    monkeypatch.setenv("VLLM_OMNI_INPUT_WAIT_TIMEOUT_S", "-1")
    with pytest.raises(ValueError, match="VLLM_OMNI_INPUT_WAIT_TIMEOUT_S"):  # the factory wraps it
        make("ra-bad", "sender", 0)
    with pytest.raises(ValueError, match="reclaim_after"):
        make("ra-bad2", "sender", 0, reclaim_after="soon")


def test_full_arena_reclaims_an_aborted_requests_unread_chunks(caplog):
    # Request "gone" was aborted before its chunks were read; the receiver went on to
    # the live request and holds its chunk. Once the unread chunks fill the arena, the
    # live request's next put reclaims the oldest of them instead of waiting on
    # backpressure; the chunk the receiver holds stays valid.
    opts = {"arena_bytes": 1 << 20, "max_bytes": 1 << 20, "max_inflight": 16}
    tx = make("reclaim", "sender", 0, from_stage=0, to_stage=1, options=opts, reclaim_after=0, put_timeout=2.0)
    rx = make("reclaim", "receiver", 1, from_stage=0, to_stage=1, options=opts)
    try:
        chunk = {"hidden_states.output": torch.ones(120 << 10, dtype=torch.bfloat16)}
        for c in range(3):
            assert tx.put("0", "1", chunk_key("gone", 0, c), chunk)[0]
        assert tx.put("0", "1", chunk_key("live", 0, 0), chunk)[0]
        held, _ = rx.get("0", "1", chunk_key("live", 0, 0))
        with caplog.at_level(logging.INFO, logger="omnilink.connectors.shm.connector"):
            assert tx.put("0", "1", chunk_key("live", 0, 1), chunk)[0]
        assert tx.health()["reclaimed"] == 1
        assert any("'gone_0_0'" in r.getMessage() for r in caplog.records)
        assert rx.get("0", "1", chunk_key("gone", 0, 0)) is None
        assert rx.get("0", "1", chunk_key("live", 0, 1)) is not None
        assert bool((held["hidden_states.output"] == 1).all())
        del held
    finally:
        rx.close()
        tx.close()


def test_engine_abort_path_reaches_the_connector():
    # vLLM-Omni 0.30.0's chunk adapter frees an aborted request's unread chunks only for
    # connectors that are isinstance(SharedMemoryConnector), by exact keys on its save
    # thread. Pin that code, then run the same calls against OmnilinkConnector.
    src = stubs.chunk_adapter_source()
    assert "isinstance(self.connector, SharedMemoryConnector)" in src
    assert 'self.connector.cleanup(f"{key_prefix}_{chunk_id}")' in src
    assert '{"cleanup_shm": (f"{external_req_id}_{self.connector.stage_id}", sender_token.num_puts)}' in src
    shm_cls = stubs.install_shm_connector()
    integ.register()
    name = "abort-hook"
    tx = make(name, "sender", 0, from_stage=0, to_stage=1)
    rx = make(name, "receiver", 1, from_stage=0, to_stage=1)
    try:
        assert isinstance(tx, shm_cls)
        assert not issubclass(shm_cls, integ.OmnilinkConnector)
        for c in range(3):
            assert tx.put("0", "1", chunk_key("ext", 0, c), plain_metadata())[0]
        assert rx.get("0", "1", chunk_key("ext", 0, 0)) is not None  # read before the abort
        key_prefix, num_puts = f"ext_{tx.stage_id}", 3  # what _queue_shm_cleanup_locked queues
        for chunk_id in range(num_puts):  # what _send_single_request then runs
            tx.cleanup(f"{key_prefix}_{chunk_id}")
        assert tx.health()["discarded"] == 2  # chunk 0 was read: not touched
        assert tx.edge("0", "1", side="sender").pending_keys() == []
        assert rx.get("0", "1", chunk_key("ext", 0, 1)) is None
    finally:
        rx.close()
        tx.close()


# ------------------------------------------------------------------ chunk adapter + processes
def test_chunk_adapter_codec_stream_with_no_metadata(pair):
    tx, rx = pair
    chunker = CodecChunker(25, 25, initial_chunk_frames=4)
    frames = torch.randint(0, 2048, (83, 16), dtype=torch.int64)
    windows = chunker.push(frames) + chunker.finish()
    for w in windows:
        assert tx.put("0", "1", chunk_key("tts_req_1", 0, w.chunk_id), w.to_payload())[0]
    got, c = [], 0
    while True:  # the adapter's poll: next chunk id until meta.finished
        res = rx.get("0", "1", chunk_key("tts_req_1", 0, c), None)
        assert res is not None
        got.append(res[0])
        c += 1
        if bool(res[0]["meta"]["finished"]):
            break
    assert c == len(windows)
    assert torch.equal(join_codec_payloads(got, num_codebooks=16), frames)
    assert rx.get("0", "1", chunk_key("tts_req_1", 0, c), None) is None


def test_two_stage_processes_over_shm():
    prefix = _prefix("procs")
    n = 5
    extra_rx = {"channel": prefix, "stage_id": 1, "role": "receiver", "from_stage": 0, "to_stage": 1, "options": SMALL}
    extra_tx = {"channel": prefix, "stage_id": 0, "role": "sender", "from_stage": 0, "to_stage": 1, "options": SMALL}
    q, done = CTX.Queue(), CTX.Event()
    # The receiving stage is up first, as in vLLM-Omni (its connector opens at start-up).
    rx = stubs.create(extra_rx)
    proc = CTX.Process(target=stubs.stage_sender, args=(extra_tx, "chatcmpl_x_9", n, q, done))
    try:
        proc.start()
        msg = q.get(timeout=60)
        assert msg[0] == "sent", msg
        sizes = msg[1]
        received = []
        deadline = time.monotonic() + stubs.WAIT
        c = 0
        while c < n and time.monotonic() < deadline:
            res = rx.get("0", "1", chunk_key("chatcmpl_x_9", 0, c))  # polled, as vLLM-Omni does
            if res is None:
                time.sleep(0.001)
                continue
            payload, size = res
            assert size == sizes[c]
            expect = stubs.thinker_payload(c)
            expect["meta.finished"] = torch.tensor(c == n - 1)
            assert_payload_equal(payload, expect)
            received.append(payload)
            c += 1
        assert c == n, f"received {c} of {n} chunks"
        assert bool(received[-1]["meta.finished"])
        done.set()
        msg = q.get(timeout=stubs.WAIT)
        assert msg[0] == "closed", msg
        proc.join(stubs.WAIT)
        assert proc.exitcode == 0
    finally:
        done.set()
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        rx.close()
