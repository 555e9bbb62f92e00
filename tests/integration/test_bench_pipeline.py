"""``omnilink bench pipeline``: the three-process streaming pipeline runs over every
connector installed here, prints every figure, and the audio is bit-identical across
connectors. A small configuration (the figures themselves are not asserted: no timed
assertions in tests; ``omnilink bench pipeline`` with no options measures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from omnilink._bench.pipeline import CONNECTORS, PipelineConfig, _pct, probe

SMALL = ["--requests", "2", "--warmup", "1", "--concurrency", "2", "--prompt-tokens", "128",
         "--prefill-chunk", "64", "--hidden", "256", "--ffn", "256", "--decode-tokens", "6",
         "--codebooks", "8", "--timeout", "60", "--rounds", "1"]


def _ours() -> set[str]:
    # Names the baselines and vLLM-Omni's connector create (keys and segments of a run).
    return {n for n in os.listdir("/dev/shm") if n.startswith("olpipe") or n.startswith("shm_olpipe")}


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "omnilink", "bench", "pipeline", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_pipeline_runs_every_installed_connector_with_identical_audio(tmp_path):
    installed = [c for c in CONNECTORS if probe(c) is None]
    assert {"omnilink-shm", "omnilink-zmq", "pickle-shm"} <= set(installed)
    before = _ours()
    out_json, out_png = tmp_path / "p.json", tmp_path / "p.png"
    args = [*SMALL, "--json", str(out_json)]
    try:
        import matplotlib  # noqa: F401

        args += ["--plot", str(out_png)]
    except ImportError:
        out_png = None
    r = _run(*args)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert _ours() == before, "the pipeline left shared memory behind"

    report = json.loads(out_json.read_text())
    assert [x["connector"] for x in report["results"]] == installed
    assert report["identical"] is True
    hashes = {x["connector"]: x["audio_sha256"] for x in report["results"]}
    assert len(next(iter(hashes.values()))) == 3  # warm-up + 2 requests, each hashed
    for x in report["results"]:
        for figure in ("first_audio_ms_p50", "first_audio_ms_p99", "last_audio_ms_p50", "last_audio_ms_p99",
                       "transport_ms_p50", "transport_ms_p99", "transport_share"):
            assert isinstance(x[figure], float) and x[figure] >= 0, (x["connector"], figure)
        assert x["first_audio_ms_p50"] <= x["last_audio_ms_p50"]
        assert 0 < x["transport_share"] < 1
        e0, e1 = x["edges"]
        # Per measured request: thinker 2 prefill chunks + 6 decoded tokens; talker 24
        # frames, windows of 4 then 25 -> 2 windows (the second finishes). All read.
        assert e0["chunks"] == 2 * (128 // 64 + 6) and e0["unread"] == 0 and e0["bytes"] > 0
        assert e1["chunks"] == 2 * 2 and e1["unread"] == 0 and e1["bytes"] > 0
        counts = x["counts"]
        if x["connector"].startswith("omnilink-"):
            # The connectors' own counters, warm-up request included: every chunk put and
            # got once, the same bytes on both ends.
            tx0, rx0 = counts["thinker"]["sender:e0"], counts["talker"]["receiver:e0"]
            tx1, rx1 = counts["talker"]["sender:e1"], counts["code2wav"]["receiver:e1"]
            assert tx0["puts"] == rx0["gets"] == 3 * e0["chunks"] // 2
            assert tx1["puts"] == rx1["gets"] == 3 * e1["chunks"] // 2
            assert tx0["bytes_put"] == rx0["bytes_got"] > 0 and "blocks_in_use" not in tx0
        else:
            assert counts["talker"] == {"receiver:e0": {}, "sender:e1": {}}
        tl = x["timeline"]
        assert tl["request"] == 1 and tl["transfers"] and all(tl["compute"][s] for s in tl["compute"])
        assert 0 < tl["first_audio_ms"] <= tl["last_audio_ms"]
    # Bytes on the wire are the same payloads: omnilink's blob and vLLM-Omni's msgpack
    # differ by headers only, so the edge-0 sizes agree within 10 %.
    sizes = [x["edges"][0]["bytes"] for x in report["results"]]
    assert max(sizes) < 1.1 * min(sizes)
    assert "machine:" in report["machine_line"] and "cores" in report["machine_line"]

    # What it prints: progress on stderr, the table and the verdict on stdout.
    assert "[pipeline] omnilink-shm (round 1/1): running" in r.stderr
    for name in installed:
        assert f"\n{name} " in r.stdout
    assert "audio bit-identical across connectors" in r.stdout and ": yes" in r.stdout
    assert "omnilink-shm vs pickle-shm: transport/chunk p50" in r.stdout
    assert "machine: " in r.stdout
    if out_png is not None:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cuda_without_cuda_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here; the GPU variant runs on the device")
    r = _run("--device", "cuda", timeout=60)
    assert r.returncode == 1
    assert "CUDA is not available" in r.stderr and "--device cpu" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--connector", "rdma"], "unknown rdma"),
    (["--requests", "0"], "requests must be an int >= 1"),
    (["--codebooks", "12"], "invalid choice"),
    (["--rounds", "0"], "rounds must be an int >= 1"),
])
def test_bad_options_are_usage_errors(args, message):
    r = _run(*args, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_config_validation_and_percentiles():
    from omnilink import ConfigurationError

    with pytest.raises(ConfigurationError, match="prefill-chunk"):
        PipelineConfig(prefill_chunk=0).validate()
    with pytest.raises(ConfigurationError, match="codebooks"):
        PipelineConfig(codebooks=4).validate()
    assert _pct([], 50) is None
    assert _pct([3.0, 1.0, 2.0], 50) == 2.0
    assert _pct([float(i) for i in range(1, 101)], 99) == 99.0
    assert _pct([1.0, 2.0], 99) == 2.0


def test_measured_requests_wait_for_the_warm_up_to_finish():
    """With eight in flight, the warm-up request still finishes before the first
    measured one is admitted: one-time set-up never lands in a measured request."""
    from omnilink._bench.pipeline import _may_admit

    cfg = PipelineConfig(warmup=1, requests=8, concurrency=8)
    assert _may_admit(0, 0, cfg)  # the warm-up
    assert not _may_admit(1, 0, cfg)  # a measured one while the warm-up runs
    assert _may_admit(1, 1, cfg) and _may_admit(8, 1, cfg)  # then up to eight at once
    assert not _may_admit(9, 1, cfg)
    cfg2 = PipelineConfig(warmup=2, requests=4, concurrency=2)
    assert _may_admit(1, 0, cfg2) and not _may_admit(2, 1, cfg2) and _may_admit(2, 2, cfg2)
    assert _may_admit(0, 0, PipelineConfig(warmup=0, requests=2, concurrency=1))


def test_trace_pipeline_puts_both_stages_on_one_clock(tmp_path):
    # benchmarks/trace_pipeline.py: the pipeline's stage processes traced; every stage
    # writes its spans, and the report lays the talker's gets beside the thinker's puts.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    before = _ours()
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "trace_pipeline.py"), str(tmp_path),
                        "--only", ".put,.get,.get_nowait,.land", "--json", str(tmp_path / "t.json"), "--", *SMALL, "--connector", "omnilink-shm"],
                       capture_output=True, text=True, timeout=240, cwd=root)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert _ours() == before, "the traced pipeline left shared memory behind"
    spans = {s: json.loads((tmp_path / f"trace-{s}.json").read_text()) for s in ("thinker", "talker", "code2wav")}
    thinker_puts = [x for x in spans["thinker"] if x[0] == "_bench.pipeline._Link.put"]
    # warm-up + 2 requests, each 2 prefill chunks (128 / 64) and 6 decode steps
    assert len(thinker_puts) == 3 * (2 + 6)
    assert all(a <= b for _, a, b in thinker_puts)
    assert sum(1 for x in spans["thinker"] if x[0] == "mark.prefill") == 3 * 2
    assert any(x[0] == "_bench.pipeline._Link.get_nowait" or x[0] == "_bench.pipeline._Link.get"
               for x in spans["talker"])
    out = r.stdout
    assert "prefill chunks (6)" in out and "decode chunks (18)" in out
    section = out[out.index("prefill chunks (6)"):]
    assert " tx _bench.pipeline._Link.put " in section and " rx _bench.pipeline._Link.get" in section
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["pipeline_rc"] == 0 and report["machine"]["cores"] >= 1
    assert report["chunks"]["prefill"]["count"] == 6 and report["chunks"]["decode"]["count"] == 18
    assert {r["name"] for r in report["stages"]["thinker"]} >= {"_bench.pipeline._Link.put"}
