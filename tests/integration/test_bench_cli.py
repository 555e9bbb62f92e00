"""``omnilink bench`` end to end, as CI runs it: tiny sizes, two processes per backend.

Checks the JSON schema, that every baseline produced a figure, that omnilink's own
backends produce figures whenever they exist in the tree, the table and caveats on
stdout, the plot, and that ``python -m omnilink`` is the ``omnilink`` script. No figure
is compared with a threshold: speed lives in benchmarks/, not in tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from importlib import metadata

import pytest

SCENARIO_BACKENDS = ("memcpy", "pickle-shm", "msgpack-shm", "torch-mp-queue", "shm", "zmq")
BASELINES = ("memcpy", "pickle-shm", "msgpack-shm", "torch-mp-queue")
OMNILINK_MODULES = {"shm": "omnilink.connectors.shm", "zmq": "omnilink.connectors.zmq"}
SIZES = {4096, 65536}
TIMEOUT = 240  # generous bound for a loaded 2-core CI machine; a healthy run takes ~20 s


def _omnilink(*args, timeout=TIMEOUT):
    return subprocess.run([sys.executable, "-m", "omnilink", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_bench_end_to_end(tmp_path):
    out_json = tmp_path / "run.jsonl"
    out_png = tmp_path / "run.png"
    proc = _omnilink("bench", "--sizes", "4KiB,64KiB", "--repeat", "3", "--max-seconds", "2",
                     "--json", str(out_json), "--plot", str(out_png))
    assert proc.returncode == 0, proc.stderr

    # stdout: the table, the ratio columns and the caveats
    for needle in ("throughput", "latency", "GB/s", "msgs/s", "p50 us", "p99 us", "vs pickle-shm",
                   "vs memcpy", "Benchmarks are hard", "Machine:", "CLOCK_MONOTONIC"):
        assert needle in proc.stdout
    # stderr: progress as plain lines (not a terminal: no redraws), one per finished cell
    # and more, no crash, no resource-tracker complaints
    assert "\r" not in proc.stderr and "\x1b" not in proc.stderr
    done_lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("omnilink bench: [")]
    assert any(ln.startswith("omnilink bench: [24/24 ") for ln in done_lines), proc.stderr
    assert len(done_lines) >= 24, proc.stderr
    for bad in ("Traceback", "resource_tracker", "leaked"):
        assert bad not in proc.stderr, proc.stderr

    records = [json.loads(line) for line in out_json.read_text().splitlines()]
    cells = {(r["backend"], r["size_bytes"], r["mode"]) for r in records}
    expected = {(b, s, m) for b in SCENARIO_BACKENDS for s in SIZES for m in ("throughput", "latency")}
    assert cells == expected and len(records) == len(expected)

    host = socket.gethostname()
    for r in records:
        assert r["scenario"] == "shm-vs-pickle"
        assert r["size"] in ("4KiB", "64KiB")
        m = r["machine"]
        assert {"cpu", "cores", "memory_bytes", "shm", "versions"} <= set(m)
        assert {"python", "torch", "numpy", "msgspec", "pyzmq", "omnilink"} <= set(m["versions"])
        if len(host) >= 4:
            assert host not in json.dumps(m)
        backend = r["backend"]
        must_run = backend in BASELINES or importlib.util.find_spec(OMNILINK_MODULES[backend]) is not None
        if not must_run:
            # Only a backend genuinely absent from this tree may be missing, with a reason.
            assert r["status"] == "unavailable" and r["reason"], r
            continue
        assert r["status"] == "ok", r
        assert r["reps"] >= 1
        if r["mode"] == "throughput":
            assert r["gbps"] > 0 and r["msgs_per_s"] > 0
            assert r["gbps_min"] <= r["gbps"] <= r["gbps_max"]
            assert r["msgs_per_s"] == pytest.approx(r["gbps"] * 1e9 / r["size_bytes"])
        else:
            assert 0 < r["p50_us"] <= r["p99_us"]
            assert r["samples"] >= r["reps"]
        assert r["reference"] == "pickle-shm" and r["ceiling"] == "memcpy"
        assert r["vs_reference"] > 0 and r["vs_ceiling"] > 0
        if backend == "pickle-shm":
            assert r["vs_reference"] == pytest.approx(1.0)

    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_subset_latency_only(tmp_path):
    out_json = tmp_path / "lat.jsonl"
    proc = _omnilink("bench", "--backends", "memcpy,pickle-shm", "--mode", "latency", "--sizes", "4KiB",
                     "--repeat", "2", "--max-seconds", "1", "--json", str(out_json), "--quiet")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in out_json.read_text().splitlines()]
    assert sorted((r["backend"], r["mode"]) for r in records) == [("memcpy", "latency"),
                                                                   ("pickle-shm", "latency")]
    assert all(r["status"] == "ok" and r["size_bytes"] == 4096 for r in records)
    assert "throughput (" not in proc.stdout


def test_bench_bad_option_exits_nonzero():
    proc = _omnilink("bench", "--sizes", "3KB,banana", timeout=120)
    assert proc.returncode == 2
    assert "--sizes" in proc.stderr and "banana" in proc.stderr
    assert proc.stdout == ""


def _script_path():
    try:
        eps = metadata.entry_points(group="console_scripts", name="omnilink")
    except TypeError:  # pragma: no cover - Python < 3.10 API
        eps = [ep for ep in metadata.entry_points()["console_scripts"] if ep.name == "omnilink"]
    if not list(eps):
        return None, "omnilink is not installed (pip install -e .): no console script"
    path = shutil.which("omnilink", path=os.path.dirname(sys.executable)) or shutil.which("omnilink")
    if path is None:
        return None, "the omnilink console script is not on PATH"
    return path, None


def test_console_script_equals_python_m():
    ep = [e for e in metadata.entry_points(group="console_scripts") if e.name == "omnilink"]
    if not ep:
        pytest.skip("omnilink is not installed (pip install -e .): no console script")
    # The declared entry point is the same function `python -m omnilink` runs.
    import omnilink.__main__
    import omnilink.cli

    assert ep[0].load() is omnilink.cli.main is omnilink.__main__.main

    path, why = _script_path()
    if path is None:
        pytest.skip(why)
    for args in (["bench", "--help"], ["bench", "--sizes", "x"]):
        via_script = subprocess.run([path, *args], capture_output=True, text=True, timeout=120)
        via_module = _omnilink(*args, timeout=120)
        assert (via_script.returncode, via_script.stdout, via_script.stderr) == \
               (via_module.returncode, via_module.stdout, via_module.stderr)
    info_script = json.loads(subprocess.run([path, "info", "--json"], capture_output=True, text=True,
                                            timeout=120, check=True).stdout)
    info_module = json.loads(_omnilink("info", "--json", timeout=120).stdout)
    for rec in (info_script, info_module):
        rec.pop("shm")  # free space moves between the two calls
    assert info_script == info_module


def test_python_m_info():
    proc = _omnilink("info", timeout=120)
    assert proc.returncode == 0 and "/dev/shm" in proc.stdout and "backends:" in proc.stdout
