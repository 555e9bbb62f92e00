"""`omnilink bench pipeline` with every stage process traced on one clock.

A stage feels each chunk's transport (``omnilink bench pipeline``'s *transport per
chunk*); this says where that time goes in the two processes of the thinker -> talker
edge. It runs the pipeline as ``omnilink bench pipeline`` does (same arguments), with the
functions of omnilink's connector modules (those ``bench_serial_gpu.py --trace`` wraps,
plus the chunk streams and the pipeline's own links and compute) timed in each stage
process (``time.perf_counter_ns``: CLOCK_MONOTONIC, one clock for every process of the
host), and with ``--rt`` every call into ``cuda.bindings.runtime`` too. Then it prints:

- per stage, each traced function's calls, p50 and p90 (microseconds, inclusive);
- per kind of thinker chunk (``prefill``: it carries ``embed.prefill``; ``decode``), the
  median start offset from the thinker's ``put`` and the median duration of every span of
  the thinker and of the talker that overlaps the window from that ``put`` to the end of
  the talker's next ``get`` of a chunk (at most 3 ms): both processes on one timeline.

Tracing inflates each wrapped call by about a microsecond: ``--only`` keeps the wrappers
to the functions named (name endings, as ``bench_serial_gpu.py --trace-only``). The raw
spans go to ``OUTDIR/trace-STAGE.json`` (``[name, start ns, end ns]``).

Usage (repository root)::

    python benchmarks/trace_pipeline.py OUTDIR [--only .put,.land,...] [--rt] -- \\
        --device cuda --connector omnilink-shm --prompt-tokens 4096 --requests 8 --rounds 1
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_serial_gpu as serial  # noqa: E402

import omnilink._bench.pipeline as pipeline  # noqa: E402

STAGES = ("thinker", "talker", "code2wav")
#: marks the tracer records at each thinker put: the kind of chunk
MARK = "mark."
GETS = ("_bench.pipeline._Link.get", "_bench.pipeline._Link.get_nowait")
PUT = "_bench.pipeline._Link.put"
WINDOW_NS = 3_000_000

_stage_main = pipeline._stage_main


def _wrap_runtime(spans: list) -> None:
    """Time every ``cuda.bindings.runtime`` function (looked up per call by omnilink's
    CUDA operations) as ``rt.NAME``."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        return
    clock = time.perf_counter_ns
    for name in dir(rt):
        fn = getattr(rt, name)
        if not name.startswith("cuda") or isinstance(fn, type) or not callable(fn):
            continue

        def traced(*a: Any, _fn: Any = fn, _name: str = "rt." + name, **k: Any) -> Any:
            t = clock()
            try:
                return _fn(*a, **k)
            finally:
                spans.append((_name, t, clock()))
        try:
            setattr(rt, name, traced)
        except (AttributeError, TypeError):  # pragma: no cover - a read-only attribute
            pass


def traced_stage_main(stage: str, *args: Any) -> None:
    """The pipeline's stage body with the tracer installed; its spans written at exit."""
    spans: list = []
    out = os.environ["OMNILINK_TRACE_PIPELINE_OUT"]
    only = tuple(x for x in os.environ.get("OMNILINK_TRACE_PIPELINE_ONLY", "").split(",") if x)
    serial.TRACED = serial.TRACED + ("omnilink.chunking.stream", "omnilink._bench.pipeline")
    put = pipeline._Link.put
    clock = time.perf_counter_ns

    def marked_put(self: Any, key: str, payload: Any, /, **kw: Any) -> None:
        kind = "prefill" if isinstance(payload, dict) and "embed.prefill" in payload else "decode"
        t = clock()
        spans.append((MARK + kind, t, t))
        put(self, key, payload, **kw)

    pipeline._Link.put = marked_put  # type: ignore[method-assign]
    serial.install_tracer(spans, only + (".put",) if only else ())
    if os.environ.get("OMNILINK_TRACE_PIPELINE_RT"):
        _wrap_runtime(spans)
    try:
        _stage_main(stage, *args)
    finally:
        with open(os.path.join(out, f"trace-{stage}.json"), "w") as f:
            json.dump(spans, f)


# Spawned stage processes import this file as their main module: the patch reaches them.
pipeline._stage_main = traced_stage_main


def _load(outdir: str, stage: str) -> list[tuple[str, int, int]]:
    try:
        with open(os.path.join(outdir, f"trace-{stage}.json")) as f:
            return sorted((tuple(s) for s in json.load(f)), key=lambda s: s[1])  # type: ignore[misc]
    except FileNotFoundError:
        return []


def analyze(outdir: str) -> dict[str, Any]:
    """The figures of the traces in ``outdir`` (see the module docstring):
    ``{"stages": {stage: [{"name", "calls", "p50_us", "p90_us"}]}, "chunks": {kind:
    {"count", "spans": [{"side", "name", "start_us", "dur_us", "per_chunk"}]}}}``."""
    st = {s: _load(outdir, s) for s in STAGES}
    report: dict[str, Any] = {"stages": {}, "chunks": {}}
    for s, spans in st.items():
        per: dict[str, list[float]] = collections.defaultdict(list)
        for n, a, b in spans:
            if not n.startswith(MARK):
                per[n].append((b - a) / 1e3)
        rows = report["stages"][s] = []
        for n, v in sorted(per.items()):
            v.sort()
            rows.append({"name": n, "calls": len(v), "p50_us": v[len(v) // 2], "p90_us": v[len(v) * 9 // 10]})
    tx, rx = st["thinker"], st["talker"]
    marks = [(a, n[len(MARK):]) for n, a, _ in tx if n.startswith(MARK)]
    mark_t = [a for a, _ in marks]
    puts = [(a, b) for n, a, b in tx if n == PUT]
    get_ends = sorted(b for n, _, b in rx if n in GETS)
    starts = {"tx": [s[1] for s in tx], "rx": [s[1] for s in rx]}
    for kind in ("prefill", "decode"):
        per: dict[tuple[str, str], list[tuple[float, float]]] = collections.defaultdict(list)
        count = 0
        for a, b in puts:
            i = bisect.bisect_right(mark_t, b) - 1  # its mark is inside its span
            if i < 0 or marks[i][1] != kind:
                continue
            count += 1
            j = bisect.bisect_left(get_ends, b)
            end = min(get_ends[j] if j < len(get_ends) else b, b + WINDOW_NS)
            for side, spans in (("tx", tx), ("rx", rx)):
                for n, x, y in spans[bisect.bisect_left(starts[side], a - WINDOW_NS):]:
                    if x >= end:
                        break
                    if y >= a and not n.startswith(MARK):
                        per[(side, n)].append(((x - a) / 1e3, (y - x) / 1e3))
        if not count:
            continue
        ordered = sorted(per.items(), key=lambda kv: statistics.median(x for x, _ in kv[1]))
        report["chunks"][kind] = {"count": count, "spans": [
            {"side": side, "name": n, "start_us": statistics.median(x for x, _ in v),
             "dur_us": statistics.median(y for _, y in v), "per_chunk": len(v) / count}
            for (side, n), v in ordered]}
    return report


def render(report: dict[str, Any]) -> str:
    """``analyze``'s figures as the printed report."""
    lines = []
    for s, rows in report["stages"].items():
        lines.append(f"{s}: calls, p50 / p90 us (inclusive)")
        for r in rows:
            lines.append(f"  {r['name']:60s} {r['calls']:6d} {r['p50_us']:9.1f} {r['p90_us']:9.1f}")
    for kind, c in report["chunks"].items():
        lines.append(f"\n{kind} chunks ({c['count']}): spans from the thinker's put to the talker's next get's end, "
                     "median start (us from the put) / median duration / per chunk")
        for r in c["spans"]:
            lines.append(f"  {r['side']} {r['name']:60s} {r['start_us']:9.1f} {r['dur_us']:8.1f} {r['per_chunk']:5.2f}")
    return "\n".join(lines)


def summarize(outdir: str) -> str:
    """The printed report of the traces in ``outdir``."""
    return render(analyze(outdir))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--only", default="", help="comma-separated name endings of the functions to trace")
    ap.add_argument("--rt", action="store_true", help="also time every cuda.bindings.runtime call")
    ap.add_argument("--json", default=None, help="also write the figures, the machine and the command here")
    args = ap.parse_args(argv[:cut])
    os.makedirs(args.outdir, exist_ok=True)
    os.environ["OMNILINK_TRACE_PIPELINE_OUT"] = os.path.abspath(args.outdir)
    os.environ["OMNILINK_TRACE_PIPELINE_ONLY"] = args.only
    if args.rt:
        os.environ["OMNILINK_TRACE_PIPELINE_RT"] = "1"
    rc = pipeline.main(argv[cut + 1:])
    report = analyze(args.outdir)
    print()
    print(render(report))
    if args.json:
        from omnilink._bench.machine import machine_record

        report = {"machine": machine_record(include_cuda="cuda" in argv), "command": "python benchmarks/trace_pipeline.py " + " ".join(argv),
                  "pipeline_rc": rc, **report}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
