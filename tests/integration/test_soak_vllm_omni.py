"""The short configuration of ``benchmarks/soak_vllm_omni.py``: two stage processes
through vLLM-Omni's real factory, chunked requests of which a share is aborted, a full
arena that reclaims the aborted requests' unread chunks, and a receiver SIGKILLed half
way that the sender reports as ``PeerLostError`` before a new receiver carries on.

The long configuration (10,000 requests, 16 KiB-8 MiB chunks) is run by hand
(``python benchmarks/soak_vllm_omni.py``); it checks the same accounting and flatness."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration import _vllm_omni_stubs as stubs

REPO = Path(__file__).resolve().parents[2]

if stubs.vllm_omni_root() is None:  # pragma: no cover - make setup installs it
    pytest.skip(f"vllm-omni is not installed; run `{stubs.PIP_HINT}`", allow_module_level=True)


def test_short_soak_with_aborts_and_a_killed_receiver(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "soak_vllm_omni.py"),
        "--requests", "120", "--max-chunks", "6", "--max-bytes", "64K", "--concurrency", "2",
        "--arena-bytes", "2M", "--abort-share", "0.5", "--reclaim-after", "1", "--sample-interval", "0.5", "--lost-timeout", "30",
        "--kill-receiver-at", "0.5", "--quiet", "--json", str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    acc = res["accounting"]
    assert res["errors"] == [], res["errors"]
    # Nothing of a request that was not aborted is lost or damaged.
    assert (acc["chunks_lost"], acc["requests_lost"], acc["requests_corrupt"]) == (0, 0, 0), acc
    assert acc["requests_done"] + acc["requests_aborted_as_planned"] + acc["requests_failed_by_receiver_death"] == 120
    assert acc["requests_done"] > 0 and acc["requests_aborted_as_planned"] > 0
    # Every chunk sent was received, reclaimed, or was still unread at the end (but the
    # one the killed receiver may have claimed in the instant it died).
    assert acc["sent_minus_received_reclaimed_unread"] in (0, 1), acc
    assert acc["chunks_reclaimed"] > 0
    # The killed receiver: PeerLostError for the edge, then a new receiver.
    assert acc["peer_lost_reported"] == 1
    events = [e["event"] for e in res["events"]]
    assert events == ["receiver SIGKILLed", "sender: PeerLostError for the edge", "receiver restarted"], events
    restart = res["events"][1]["restart_from"]
    assert acc["requests_done"] + acc["requests_aborted_as_planned"] >= 120 - restart  # the new one carried on
    assert acc["dev_shm_left"] == []
    sample = res["samples"][-1]
    for key in ("arena_bytes", "segments", "sender_pending_keys", "receiver_pending_keys", "rss_sender",
                "rss_receiver", "put_p99_us", "get_p99_us", "reclaimed"):
        assert key in sample
    assert "verdict:" in proc.stdout and "flatness" in proc.stdout
