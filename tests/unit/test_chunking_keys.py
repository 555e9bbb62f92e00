"""Chunk keys: exact format, exact inverse, refusals instead of truncation."""

from __future__ import annotations

import pytest

import omnilink
from omnilink._util import MAX_KEY_BYTES
from omnilink.chunking import chunk_key, parse_chunk_key


def test_key_format_matches_vllm_omni():
    assert chunk_key("chatcmpl_ab_12", 1, 7) == "chatcmpl_ab_12_1_7"
    assert chunk_key("req7", 0, 0) == "req7_0_0"
    assert chunk_key("req7", "talker", 3) == "req7_talker_3"


def test_parse_from_the_right_keeps_underscores_in_the_request_id():
    assert parse_chunk_key("chatcmpl_ab_12_1_7") == ("chatcmpl_ab_12", 1, 7)
    assert parse_chunk_key("___x_0_0") == ("___x", 0, 0)
    assert parse_chunk_key("r_talker_12") == ("r", "talker", 12)


def test_a_300_character_request_id_round_trips_untruncated():
    rid = "chatcmpl_" + "x_" * 145 + "end"
    assert len(rid) > 300
    key = chunk_key(rid, 2, 41)
    assert parse_chunk_key(key) == (rid, 2, 41)
    assert rid in key


def test_ids_differing_only_after_25_characters_get_different_keys():
    a, b = "c" * 30 + "a", "c" * 30 + "b"
    assert chunk_key(a, 0, 0) != chunk_key(b, 0, 0)


@pytest.mark.parametrize("rid", [None, "", 7, b"req", ["r"]])
def test_none_empty_and_non_str_request_ids_are_refused(rid):
    with pytest.raises(omnilink.ConfigurationError, match="request_id"):
        chunk_key(rid, 0, 0)


def test_none_request_id_error_says_why():
    with pytest.raises(omnilink.ConfigurationError, match="None_1_0"):
        chunk_key(None, 1, 0)


@pytest.mark.parametrize("cid", [-1, 1.0, "3", True, None])
def test_negative_or_non_int_chunk_ids_are_refused(cid):
    with pytest.raises(omnilink.ConfigurationError, match="chunk_id"):
        chunk_key("r", 0, cid)


@pytest.mark.parametrize("stage", [-1, "a_b", "", True, 1.5, "x y"])
def test_bad_stages_are_refused(stage):
    with pytest.raises(omnilink.ConfigurationError, match="from_stage"):
        chunk_key("r", stage, 0)


def test_nul_in_request_id_is_refused():
    with pytest.raises(omnilink.ConfigurationError, match="NUL"):
        chunk_key("a\x00b", 0, 0)


def test_too_long_key_is_refused_not_cut():
    rid = "r" * (MAX_KEY_BYTES - 3)
    assert parse_chunk_key(chunk_key(rid[:-1], 0, 0))[0] == rid[:-1]  # exactly at the limit
    with pytest.raises(omnilink.ConfigurationError, match="never truncated"):
        chunk_key(rid, 0, 10)


@pytest.mark.parametrize(
    "key",
    ["", "abc", "a_b", "_0_1", "r_0_01", "r_0_-1", "r_0_+1", "r_0_ 1", "r_a b_1", "r_0_", "r__1", "r_0_1.0", "r_0_\u0663"],
)
def test_malformed_keys_are_refused(key):
    with pytest.raises(omnilink.ConfigurationError):
        parse_chunk_key(key)


def test_parse_refuses_non_str():
    with pytest.raises(omnilink.ConfigurationError):
        parse_chunk_key(None)
    with pytest.raises(omnilink.ConfigurationError):
        parse_chunk_key(12)


def test_non_canonical_stage_names_round_trip_as_str():
    key = chunk_key("r", "007", 1)
    assert parse_chunk_key(key) == ("r", "007", 1)
    assert chunk_key(*parse_chunk_key(key)) == key


def test_chunking_public_surface_and_error_tree():
    from omnilink import _errors, chunking

    assert chunking.__all__ == sorted(chunking.__all__)
    for name in chunking.__all__:
        assert hasattr(chunking, name), name
    chunk_errors = [n for n in _errors.__all__ if n.startswith("Chunk") or n in ("DuplicateChunkError", "StreamFinishedError")]
    assert len(chunk_errors) == 5
    for name in chunk_errors:
        cls = getattr(_errors, name)
        assert issubclass(cls, omnilink.OmnilinkError)
        assert getattr(chunking, name) is cls, f"omnilink.chunking does not re-export {name}"
        assert name in _errors.__doc__, f"{name} is missing from the drawn tree"
    assert issubclass(chunking.ChunkInvariantError, AssertionError)
    for cls in (chunking.ChunkGapError, chunking.DuplicateChunkError, chunking.StreamFinishedError):
        assert issubclass(cls, chunking.ChunkSequenceError)
