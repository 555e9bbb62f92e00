"""Benchmark output: ratios, the text and Markdown tables, JSON lines, the plot, the
progress line, the run plan and the committed runs of ``omnilink bench``.

The records here are made up on purpose: these tests check formatting and arithmetic,
never performance (that is ``omnilink bench``'s job).
"""

from __future__ import annotations

import io
import json
import os

import pytest

from omnilink._bench.machine import machine_record
from omnilink._bench.plan import plan
from omnilink._bench.progress import Progress
from omnilink._bench.report import (
    README_BEGIN,
    README_END,
    add_ratios,
    markdown_tables,
    read_jsonl,
    readme_block,
    text_table,
    write_jsonl,
    write_plot,
)
from omnilink._bench.runner import _percentile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tp(backend, size, gbps):
    return {"scenario": "shm-vs-pickle", "backend": backend, "mode": "throughput", "size_bytes": size,
            "size": f"{size // 1024}KiB", "status": "ok", "gbps": gbps, "msgs_per_s": gbps * 1e9 / size}


def _lat(backend, size, p50, p99):
    return {"scenario": "shm-vs-pickle", "backend": backend, "mode": "latency", "size_bytes": size,
            "size": f"{size // 1024}KiB", "status": "ok", "p50_us": p50, "p99_us": p99}


def _records():
    return [
        _tp("memcpy", 4096, 10.0), _tp("pickle-shm", 4096, 0.5), _tp("shm", 4096, 2.0),
        _lat("memcpy", 4096, 1.0, 2.0), _lat("pickle-shm", 4096, 200.0, 400.0), _lat("shm", 4096, 20.0, 50.0),
        {"scenario": "shm-vs-pickle", "backend": "zmq", "mode": "throughput", "size_bytes": 4096,
         "size": "4KiB", "status": "unavailable", "reason": "backend 'zmq' could not be loaded"},
    ]


def test_add_ratios_throughput_and_latency():
    recs = _records()
    add_ratios(recs, reference="pickle-shm", ceiling="memcpy")
    by = {(r["backend"], r["mode"]): r for r in recs}
    assert by["shm", "throughput"]["vs_reference"] == pytest.approx(4.0)
    assert by["shm", "throughput"]["vs_ceiling"] == pytest.approx(0.2)
    # latency ratios compare p50 so that > 1 still means faster
    assert by["shm", "latency"]["vs_reference"] == pytest.approx(10.0)
    assert by["shm", "latency"]["vs_ceiling"] == pytest.approx(0.05)
    assert by["pickle-shm", "throughput"]["vs_reference"] == pytest.approx(1.0)
    assert "vs_reference" not in by["zmq", "throughput"]


def test_add_ratios_missing_reference_is_none():
    recs = [_tp("shm", 4096, 2.0)]
    add_ratios(recs, reference="pickle-shm", ceiling="memcpy")
    assert recs[0]["vs_reference"] is None and recs[0]["vs_ceiling"] is None


def test_text_table_rows_ratios_and_reasons():
    recs = _records()
    add_ratios(recs, reference="pickle-shm", ceiling="memcpy")
    table = text_table(recs, reference="pickle-shm", ceiling="memcpy")
    assert "vs pickle-shm" in table and "vs memcpy" in table
    assert "4.00x" in table and "0.20x" in table and "10.0x" in table
    assert "p50 us" in table and "p99 us" in table
    assert "zmq: unavailable: backend 'zmq' could not be loaded" in table
    shm_line = next(line for line in table.splitlines() if " shm " in f" {line} " and "2.000" in line)
    assert "4.00x" in shm_line


def test_markdown_tables():
    recs = _records()
    add_ratios(recs, reference="pickle-shm", ceiling="memcpy")
    md = markdown_tables(recs)
    assert "| backend | 4KiB |" in md
    assert "| shm | 2 (4x) |" in md
    assert "| shm | 20 / 50 |" in md
    assert "| zmq | unavailable |" in md


def test_jsonl_round_trip_and_validation(tmp_path):
    recs = _records()
    path = tmp_path / "run.jsonl"
    with open(path, "w") as fh:
        write_jsonl(fh, recs, machine=machine_record(), run_id="abc")
    back = read_jsonl(str(path))
    assert len(back) == len(recs)
    assert all(r["machine"]["cores"] == os.cpu_count() and r["run_id"] == "abc" for r in back)
    assert all("timestamp" in r for r in back)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"backend": "shm"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: missing keys"):
        read_jsonl(str(bad))
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        read_jsonl(str(bad))


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")
    recs = _records() + [_tp("shm", 65536, 5.0), _tp("pickle-shm", 65536, 0.6)]
    path = tmp_path / "p.png"
    write_plot(str(path), recs, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_only_when_enabled():
    off = io.StringIO()
    p = Progress(enabled=False, stream=off)
    p(1, 4, "shm 4KiB throughput")
    p.close()
    assert off.getvalue() == ""

    on = io.StringIO()
    p = Progress(enabled=True, stream=on)
    p(1, 4, "shm 4KiB throughput")
    p.close()
    text = on.getvalue()
    assert "1/4" in text and "shm 4KiB throughput" in text and text.endswith("\r\x1b[K")
    assert Progress.for_terminal(quiet=True).enabled is False


def test_progress_lines_when_not_a_terminal():
    # Under CI stderr is a pipe: one plain line per step, no carriage returns, no escapes.
    out = io.StringIO()
    p = Progress(enabled=True, redraw=False, stream=out)
    p(0, 4, "starting sender and receiver processes")
    p(0, 4, "shm 4KiB throughput")
    p(0, 4, "shm 4KiB throughput")      # the same step twice: one line
    p(1, 4, "shm 4KiB throughput")
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and all(ln.startswith("omnilink bench: [") for ln in lines)
    assert "0/4" in lines[0] and "starting" in lines[0]
    assert "1/4" in lines[2] and lines[2].endswith("shm 4KiB throughput")
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


@pytest.mark.parametrize("size", [4096, 65536, 1 << 20, 16 << 20, 256 << 20, 1 << 30])
def test_plan_bounds(size):
    tp = plan(size, "throughput")
    lat = plan(size, "latency")
    assert 2 <= tp.count <= 200 and 1 <= tp.window <= 8
    # at most 512 MiB in flight, except that one message always may be
    assert tp.window == 1 or tp.window * size <= 512 << 20
    assert lat.window == 1 and 1 <= lat.count <= 100
    assert 1 <= tp.warmup <= tp.count


def test_percentile_nearest_rank():
    values = [float(i) for i in range(1, 101)]
    assert _percentile(values, 0.50) == 50.0
    assert _percentile(values, 0.99) == 99.0
    assert _percentile([7.0], 0.99) == 7.0
    assert _percentile([1.0, 2.0], 0.5) == 1.0


# ------------------------------------------------------------ README block
def test_readme_block_names_machine_and_source():
    recs = _records()
    add_ratios(recs, reference="pickle-shm", ceiling="memcpy")
    for r in recs:
        r["machine"] = {"cpu": "Test CPU", "cores": 2, "versions": {"python": "3.11"}}
    block = readme_block(recs, source="benchmarks/results/x.jsonl")
    assert block.startswith(README_BEGIN) and block.rstrip().endswith(README_END)
    assert "Test CPU, 2 cores" in block and "benchmarks/results/x.jsonl" in block
    recs[0]["machine"] = {"cpu": "Other"}
    with pytest.raises(ValueError, match="several machines"):
        readme_block(recs, source="x")


def test_committed_results_are_valid():
    """Every committed run of ``omnilink bench`` is readable and names its machine.

    (The other scripts' result files have their own formats; ``benchmarks/make_perf_page.py``
    reads them for the performance page, and its check runs in CI.)
    """
    folder = os.path.join(ROOT, "benchmarks", "results")
    runs = []
    for f in os.listdir(folder):
        if f.endswith(".jsonl") and not f.startswith("latest"):
            with open(os.path.join(folder, f)) as fh:
                if {"scenario", "backend", "mode"} <= set(json.loads(fh.readline())):
                    runs.append(f)
    if not runs:
        pytest.skip("no committed benchmark results yet")
    for name in runs:
        recs = read_jsonl(os.path.join(folder, name))
        assert recs, name
        for r in recs:
            m = r["machine"]
            assert m["cpu"] and m["cores"] and m["versions"]["omnilink"], name
            if r["status"] == "ok":
                assert (r["gbps"] > 0) if r["mode"] == "throughput" else (0 < r["p50_us"] <= r["p99_us"])
        json.dumps(recs)
