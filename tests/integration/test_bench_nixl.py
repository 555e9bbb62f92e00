"""``benchmarks/bench_nixl.py`` in a short configuration over UCX's tcp on loopback: the
omnilink row and its in-pair A/B row (``--ab``: sender-side constants alternated message
by message) both run and land in the JSON, the raw floor runs beside them, and a
constant that is not the backend's is refused before any process starts. No figure is
compared with a target: speed is measured by the script, not asserted in tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from omnilink.connectors import backend_unavailable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_REASON = backend_unavailable("nixl")
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"nixl backend unavailable: {_REASON}")


def _run(*args, timeout=240):
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_nixl.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_bench_nixl_short_with_an_in_pair_ab(tmp_path):
    out = tmp_path / "nixl.jsonl"
    proc = _run("--sizes", "4KiB,1MiB", "--rounds", "8", "--tls", "tcp", "--connectors", "omnilink-nixl,raw-nixl",
                "--ab", "DIRECT_CACHED_MIN_BYTES=1,AHEAD_MIN_BYTES=0", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    head, *rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert head["scenario"] == "nixl" and "--ab" in head["command"]
    assert not [r for r in rows if "error" in r], rows
    cells = {(r["connector"], r["size"]): r for r in rows}
    assert set(cells) == {(c, s) for c in ("omnilink-nixl", "nixl-ab", "raw-nixl") for s in (4096, 1 << 20)}
    for (name, _size), r in cells.items():
        assert r["n"] == 8 and 0 < r["one_way_p50_s"] <= r["p50_s"] * 1.5
        assert (r.get("ab") == "DIRECT_CACHED_MIN_BYTES=1,AHEAD_MIN_BYTES=0") is (name == "nixl-ab")
    assert "nixl-ab" in proc.stdout


def test_bench_nixl_refuses_an_unknown_constant():
    proc = _run("--ab", "NOT_A_CONSTANT=1", timeout=60)
    assert proc.returncode != 0 and "not NAME=VALUE for a constant" in proc.stderr
    proc = _run("--ab", "AHEAD_MIN_BYTES=lots", timeout=60)
    assert proc.returncode != 0 and "is not a value of AHEAD_MIN_BYTES's type (int)" in proc.stderr
    proc = _run("--ab", "INLINE_TO_DEVICE=maybe", timeout=60)
    assert proc.returncode != 0 and "is not a value of INLINE_TO_DEVICE's type (bool)" in proc.stderr


def test_bench_nixl_ab_settings_read_every_nixl_module():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_nixl
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    got = {(m.__name__.rsplit(".", 1)[-1], name, value)
           for m, name, _base, value in bench_nixl._ab_settings("INLINE_TO_DEVICE=true,INLINE_MAX_BYTES=0,SPIN_S=0.001")}
    assert got == {("connector", "INLINE_TO_DEVICE", True), ("wire", "INLINE_MAX_BYTES", 0), ("agent", "SPIN_S", 0.001)}
