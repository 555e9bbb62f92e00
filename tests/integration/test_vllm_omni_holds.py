"""The vLLM-Omni adapter notices requests that hold received payloads for long.

A received payload's tensors are views of the sender's arena, so a request that keeps
them keeps arena blocks (and makes the elastic arena grow). The adapter logs such a
request once, after ``hold_warn_s`` seconds.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from omnilink.chunking import chunk_key
from tests.integration import _vllm_omni_stubs as stubs

try:
    API = stubs.install()
except ImportError as exc:  # pragma: no cover - make test installs it
    pytest.skip(f"vllm-omni is not installed ({exc}); run `{stubs.PIP_HINT}`", allow_module_level=True)

from omnilink.integrations import vllm_omni as integ  # noqa: E402  (after the stubs)


def _make(name: str, role: str, stage_id: int, **extra):
    integ.register()
    spec = API["ConnectorSpec"](name="OmnilinkConnector", extra={
        "channel": f"t{os.getpid()}-{name}", "stage_id": stage_id, "role": role, "from_stage": 0, "to_stage": 1,
        "options": {"arena_bytes": 2 << 20}, **extra})
    return API["OmniConnectorFactory"].create_connector(spec)


def test_request_holding_received_blocks_is_logged_once(caplog):
    tx = _make("holds", "sender", 0)
    rx = _make("holds", "receiver", 1, hold_warn_s=0.0)
    try:
        for c in range(2):
            ok, _size, _md = tx.put("0", "1", chunk_key("req-7", 0, c), {"x": np.arange(1000.0) + c})
            assert ok
        got = [rx.get("0", "1", chunk_key("req-7", 0, c)) for c in range(2)]
        assert all(g is not None for g in got)
        held = rx.edge("0", "1", side="receiver").held()
        assert sorted(k for k, _n, _age in held) == [chunk_key("req-7", 0, 0), chunk_key("req-7", 0, 1)]
        assert all(n > 8000 and age >= 0 for _k, n, age in held)
        with caplog.at_level(logging.WARNING, logger="omnilink.integrations.vllm_omni.holds"):
            assert rx.check_holds() == 1  # two payloads, one request: one line
            assert rx.check_holds() == 0  # once per request
        lines = [r.getMessage() for r in caplog.records if "has held" in r.getMessage()]
        assert len(lines) == 1 and "'req-7'" in lines[0]
        del got
        assert rx.edge("0", "1", side="receiver").held() == []
    finally:
        rx.close()
        tx.close()


def test_hold_warning_off_and_threshold_respected(caplog):
    tx = _make("holds-off", "sender", 0)
    quiet = _make("holds-off", "receiver", 1, hold_warn_s=None)
    try:
        tx.put("0", "1", chunk_key("r", 0, 0), {"x": np.ones(10)})
        got = quiet.get("0", "1", chunk_key("r", 0, 0))
        assert got is not None
        with caplog.at_level(logging.WARNING, logger="omnilink.integrations.vllm_omni.holds"):
            assert quiet.check_holds() == 0
            quiet._holds.threshold = 3600.0  # held far less than that
            assert quiet.check_holds() == 0
        assert not [r for r in caplog.records if "has held" in r.getMessage()]
    finally:
        quiet.close()
        tx.close()


@pytest.mark.parametrize("bad", [-1, "1", True])
def test_bad_hold_warn_s(bad):
    with pytest.raises(Exception) as info:
        _make("holds-bad", "receiver", 1, hold_warn_s=bad)
    assert "hold_warn_s" in str(info.value)
