"""Generate (or check) the figures of ``docs/performance.md`` and the README's headline table.

Every figure the project publishes comes from a committed result file under
``benchmarks/results/``, named by scenario and machine. This script is the only writer
of the blocks between ``<!-- perf:begin ID -->`` and ``<!-- perf:end ID -->`` in the
performance page and in README.md; each block names its result file, the machine
recorded in it and the command that made it::

    python benchmarks/make_perf_page.py            # print every block
    python benchmarks/make_perf_page.py --write    # rewrite the blocks in place
    python benchmarks/make_perf_page.py --check    # exit 1 if a page differs (CI runs this)

To publish a new run: run the command a block names, copy its result over the file the
block names (same scenario, same machine), ``--write``, and commit both.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
sys.path.insert(0, REPO)

from omnilink._bench.report import machine_line, markdown_tables  # noqa: E402

PAGES = ("docs/performance.md", "README.md")
RESULTS = "benchmarks/results"
_BLOCK = re.compile(r"<!-- perf:begin (?P<id>[\w-]+) -->\n.*?<!-- perf:end (?P=id) -->", re.S)


@dataclass(frozen=True)
class Block:
    id: str
    files: tuple[str, ...]     # under benchmarks/results/
    command: str               # what made the files (run from the repository root)
    render: Callable[[list[Any]], str]


# ------------------------------------------------------------------ formatting helpers
def _num(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if x >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def _ms(x: float | None) -> str:
    return "-" if x is None else (f"{x:.2f}" if x < 10 else f"{x:.1f}")


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _bytes(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def _table(headers: list[str], rows: list[list[str]], align: str) -> str:
    sep = ["---" if a == "<" else "---:" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _load(name: str) -> Any:
    path = os.path.join(REPO, RESULTS, name)
    with open(path, encoding="utf-8") as f:
        if name.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        return json.load(f)


def _gpus(machine: dict[str, Any]) -> str:
    gpus = machine.get("gpus") or machine.get("gpu") or [d["name"] for d in machine.get("cuda_devices", [])]
    return " + ".join(gpus) if gpus else ""


# ------------------------------------------------------------------ renderers
def render_bench(data: list[Any]) -> str:
    """A run of ``omnilink bench --json``: throughput and latency tables."""
    (records,) = data
    for n, rec in enumerate(records, 1):
        missing = [k for k in ("scenario", "backend", "mode", "size_bytes", "status", "machine") if k not in rec]
        if missing:
            raise ValueError(f"record {n} is not from `omnilink bench --json`: no {missing}")
    m = records[0]["machine"]
    return (f"Run {records[0]['timestamp']} on: {machine_line(m)}.\n\n"
            + markdown_tables(records).rstrip())


_CONNECTORS = ("omnilink-shm", "omnilink-zmq", "vllm-omni-shm", "pickle-shm")


def render_pipeline(data: list[Any]) -> str:
    """A run of ``omnilink bench pipeline --json``."""
    (run,) = data
    rows = []
    for r in sorted(run["results"], key=lambda r: _CONNECTORS.index(r["connector"])):
        rows.append([r["connector"] + (" (baseline)" if r["connector"] == "pickle-shm" else ""),
                     f"{_ms(r['first_audio_ms_p50'])} / {_ms(r['first_audio_ms_p99'])} ms",
                     f"{_ms(r['last_audio_ms_p50'])} ms",
                     f"{_ms(r['transport_ms_p50'])} / {_ms(r['transport_ms_p99'])} ms",
                     f"{100 * r['transport_share']:.1f} %"])
    edges = run["results"][0]["edges"]
    c = run["config"]
    return (f"{run['machine_line']}.\n\n"
            + _table(["connector", "first audio p50 / p99", "last audio p50", "transport per chunk p50 / p99",
                      "transport share of step time"], rows, "<<<<<")
            + f"\n\nPrompt {c['prompt_tokens']} tokens x hidden {c['hidden']}, {c['requests']} requests per round, "
            f"device {c['device']}; per round "
            + "; ".join(f"{e['edge']} {e['chunks']} chunks, {_bytes(e['bytes'])}" for e in edges)
            + f". Audio bit-identical across connectors: {'yes' if run['identical'] else 'NO'}.")


def render_bench_gpu(data: list[Any]) -> str:
    """A run of ``benchmarks/bench_gpu.py --json``: GPU -> shm -> GPU across two processes."""
    (records,) = data
    m = records[0]["machine"]
    rows, tail = [], None
    for r in records:
        if "size" not in r:
            tail = r
            continue
        o = r["cuda:0"]
        rows.append([_size(r["size"]), _num(o["omnilink"]), _ratio(o["ratio_slower_pinned"]),
                     _num(o["omnilink_put_async_x8"]), _num(o["raw_two_process"]),
                     _ratio(o["ratio_raw_two_process"]), _num(r["duplex_per_direction"]),
                     f"{_num(r['d2h_pinned'])} / {_num(r['h2d_pinned'])}", _num(o["ipc"])])
    text = (f"{_gpus(m)}, {m.get('cpus')} CPUs, torch {m.get('torch')}, "
            f"MPS server {'on' if m.get('mps') else 'off'}. GB/s:\n\n"
            + _table(["payload", "omnilink shm", "x slower pinned copy", "8 put_async in flight",
                      "raw two-process floor", "x raw floor", "duplex ceiling", "pinned D2H / H2D (one process)",
                      "device IPC (device_ipc=\"on\")"], rows, "<" + ">" * 8))
    if tail and tail.get("latency"):
        p50, p99 = tail["latency"]["cuda:0"]
        raw50, raw99 = tail["latency_raw_two_process"]["cuda:0"]
        text += (f"\n\n4 KiB one-way (round trip / 2): p50 {p50:.0f} us, p99 {p99:.0f} us; raw two-process "
                 f"floor p50 {raw50:.0f} us, p99 {raw99:.0f} us.")
    return text


def render_pivot(data: list[Any]) -> str:
    """``bench_cuda_ipc.py --json`` (a dict) or ``bench_nccl.py --json`` (records): GB/s by size."""
    (raw,) = data
    if isinstance(raw, dict):
        m, results, latency = raw["machine"], raw["results"], raw.get("latency", [])
        key = "what"
        lat = [(x["what"], x["p50_us"]) for x in latency]
    else:
        m, results, latency = raw[0]["machine"], [r for r in raw if "gbps" in r], [r for r in raw if "p50_us" in r]
        key = "variant"
        lat = [(x["variant"].removeprefix("latency "), x["p50_us"]) for x in latency]
        lat = [("raw torch.distributed" if w == "raw" else w, v) for w, v in lat]
    sizes = sorted({r["size"] for r in results}, reverse=True)
    names: list[str] = []
    for r in results:
        if r[key] not in names:
            names.append(r[key])
    cell = {(r[key], r["size"]): r["gbps"] for r in results}
    rows = [[("raw torch.distributed" if n == "raw" else n)] + [_num(cell.get((n, s))) for s in sizes] for n in names]
    text = (f"{_gpus(m)}; {m.get('cpu')}, {m.get('cores')} cores; torch {m.get('torch') or m['versions']['torch']}. "
            "GB/s (median of rounds):\n\n"
            + _table(["path"] + [_size(s) for s in sizes], rows, "<" + ">" * len(sizes)))
    if lat:
        text += "\n\n4 KiB one-way p50: " + ", ".join(f"{w} {v:.0f} us" for w, v in lat) + "."
    return text


def render_serial(data: list[Any]) -> str:
    """``benchmarks/bench_serial_gpu.py --json``: one payload at a time, us per payload."""
    (run,) = data
    m = run["machine"]
    rows = run["rows"]
    roads = [r for r in dict.fromkeys(row["road"] for row in rows) if r != "raw"]
    by = {(row["road"], row["size"]): row for row in rows}
    sizes = sorted({row["size"] for row in rows if row["road"] != "raw"})
    raw4k = by.get(("raw", 4096), {}).get("p50_us")
    out = []
    for size in sizes:
        any_row = next(by[(r, size)] for r in roads + ["raw"] if (r, size) in by)
        cells = [_size(size), f"{any_row['copy_us']:.0f}",
                 f"{by[('raw', size)]['p50_us']:.0f}" if ("raw", size) in by else "-"]
        target = any_row.get("target_us")
        for r in roads:
            x = by.get((r, size))
            cells.append("-" if x is None else
                         f"{x['p50_us']:.0f} ({x['p50_us'] / target:.2f}x)" if target else f"{x['p50_us']:.0f}")
        cells.append(f"{target:.0f}" if target else "-")
        out.append(cells)
    where = m["src"] if m["src"] == m["dst"] else f"{m['src']} -> {m['dst']}"
    gpus = m["gpu_src"] if m["gpu_src"] == m["gpu_dst"] else f"{m['gpu_src']} -> {m['gpu_dst']}"
    text = (f"{gpus}, {where}, {m.get('cpus')} CPUs, torch {m.get('torch')}, MPS server "
            f"{'on' if m.get('mps') else 'off'}; run {m.get('date')}. p50 microseconds per payload, "
            "from `put` to the tensor read on the receiver's stream (in brackets: x the target):\n\n"
            + _table(["payload", "copy_ (in process)", "raw floor"] + roads + ["target"], out,
                     "<" + ">" * (3 + len(roads))))
    if raw4k:
        text += (f"\n\nTarget per size: the in-process copy plus twice the raw floor's 4 KiB "
                 f"({raw4k:.0f} us) of this run.")
    return text


def render_route_cpu(data: list[Any]) -> str:
    """``benchmarks/bench_route_cpu.py --json``: host CPU per device-IPC message."""
    (run,) = data
    m, rows = run["machine"], run["rows"]
    flat = rows["flat"]
    names = {"flat": "the same steps written flat",
             "route": "`shm` device-IPC route (host double): send plan, views made while waiting",
             "general": "the same route the general way", "host": "`shm` host road"}
    out = []
    for key in ("flat", "route", "general", "host"):
        r = rows[key]
        out.append([names[key]] + [f"{r[f]:.1f} ({r[f] / ref:.1f}x)" for f, ref in
                                   (("put_us", flat["put_us"]), ("get_us", flat["get_us"]))])
    return (f"{m.get('cpus')} CPUs ({m.get('cpu')}), python {m.get('python')}, torch {m.get('torch')}; "
            f"run {m.get('date')}. Median microseconds per message, {_size(run['size'])} bf16 hidden state "
            f"with token ids, a flag and metadata, {run['n']} messages (in brackets: x the flat steps'):\n\n"
            + _table(["row", "put", "get"], out, "<>>"))


def render_busy(data: list[Any]) -> str:
    """``benchmarks/bench_busy_receiver.py --json``: put time while the receiver computes."""
    (run,) = data
    m, rows, args = run["machine"], run["rows"], run["args"]
    busy = sorted({r["busy_ms"] for r in rows})
    idle, hot = busy[0], busy[-1]
    out = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        by = {r["busy_ms"]: r for r in rows if r["backend"] == backend}
        a, b = by.get(idle), by.get(hot)
        if a is None or b is None:
            continue
        out.append([backend, f"{a['put_p50_us']:,.0f}", f"{b['put_p50_us']:,.0f}", f"{b['put_p90_us']:,.0f}",
                    _ratio(b["put_p50_us"] / a["put_p50_us"])])
    return (f"Run {run['time']} on: {machine_line(m)}. `put` time in microseconds, a "
            f"{_size(rows[0].get('size', 4096))} bf16 hidden state and a flag every "
            f"{args['gap_ms']:g} ms, {rows[0]['n']} payloads per row; the receiver runs {hot:g} ms of Python after "
            f"each get (busy) or none (idle):\n\n"
            + _table(["backend", "idle p50", "busy p50", "busy p90", "busy / idle"], out, "<>>>>"))


def _nixl_cells(rows: list[dict[str, Any]], sizes: list[int], field: str, ref_name: str,
                cell: Any) -> list[list[str]]:
    """Table rows of one UCX transport's ``rows``: per connector, ``cell(row, the
    ref_name row's field or None)`` per size (``None`` for that row itself and where it
    lacks the size), ``-`` where the connector lacks it."""
    ref = {r["size"]: r[field] for r in rows if r["connector"] == ref_name}
    table = []
    for name in dict.fromkeys(r["connector"] for r in rows):
        cells = [name]
        for size in sizes:
            r = next((r for r in rows if r["connector"] == name and r["size"] == size), None)
            cells.append("-" if r is None else cell(r, ref.get(size) if name != ref_name else None))
        table.append(cells)
    return table


def render_nixl(data: list[Any]) -> str:
    """``benchmarks/bench_nixl.py --json``: us per payload (and GB/s) by UCX transport,
    with each row's ratio to vLLM-Omni's NixlConnector of the same run."""
    (records,) = data
    head, rows = records[0], [r for r in records[1:] if "size" in r]
    if head.get("scenario") != "nixl":
        raise ValueError("not a benchmarks/bench_nixl.py --json file")
    m = head["machine"]
    sizes = sorted({r["size"] for r in rows})
    out = []
    head_row = ["connector"] + [_size(s) for s in sizes]
    align = "<" + ">" * len(sizes)

    def per_message(r: dict[str, Any], ref: float | None) -> str:
        us = r["p50_s"] * 1e6
        text = f"{us:,.0f} us" if r["size"] < (16 << 20) else f"{us / 1000:.1f} ms ({r['gbps']:.2f} GB/s)"
        return text if ref is None else text + f", {ref / r['p50_s']:.1f}x"

    def one_way(r: dict[str, Any], ref: float | None) -> str:
        us = r["one_way_p50_s"] * 1e6
        text = f"{us:,.0f} us" if r["size"] < (16 << 20) else f"{us / 1000:.2f} ms"
        return text if ref is None else text + f", {r['one_way_p50_s'] / ref:.2f}x"

    for tls in dict.fromkeys(r["tls"] for r in rows):
        mine = [r for r in rows if r["tls"] == tls]
        out.append(f"`UCX_TLS={tls}`:\n\n"
                   + _table(head_row, _nixl_cells(mine, sizes, "p50_s", "vllm-omni-nixl", per_message), align))
        table = _nixl_cells([r for r in mine if "one_way_p50_s" in r], sizes, "one_way_p50_s", "raw-nixl", one_way)
        if table:
            out.append(f"`UCX_TLS={tls}`, one-way (from `put` until the receiver holds the payload, one clock; "
                       "after the comma: the row's time / the raw WRITE + notification's):\n\n"
                       + _table(head_row, table, align))
    gpus = _gpus(m)
    where = f"{gpus}; " if gpus else ""
    return (f"{where}{m.get('cpu')}, {m.get('cores')} cores; torch {m['versions'].get('torch')}. "
            "p50 time per payload, from `put` until the receiver's answer says it holds the payload (one "
            "payload at a time; after the comma: vLLM-Omni's NixlConnector time / the row's, same run, same "
            "transport):\n\n"
            + "\n\n".join(out))


def render_headline(data: list[Any]) -> str:
    """README: transport per chunk and first audio of the streaming pipeline, CPU and GPU."""
    cpu, gpu = data
    by = [{r["connector"]: r for r in run["results"]} for run in (cpu, gpu)]
    rows = []
    for c in _CONNECTORS:
        cells = []
        for b in by:
            r = b[c]
            cells += [f"{_ms(r['transport_ms_p50'])} ms", f"{_ms(r['first_audio_ms_p50'])} ms"]
        rows.append([c + (" (baseline)" if c == "pickle-shm" else "")] + cells)
    return _table(["connector", "per chunk, 2-core CPU", "first audio, 2-core CPU", "per chunk, H100",
                   "first audio, H100"], rows, "<>>>>")


BLOCKS = (
    Block("headline", ("pipeline-cpu-epyc-2core.json", "pipeline-cuda-h100.json"),
          "`omnilink bench pipeline` (2-core CPU) and `omnilink bench pipeline --device cuda --prompt-tokens 4096 "
          "--requests 4 --rounds 2` (H100); machines and full tables on the performance page", render_headline),
    Block("pipeline-cpu-epyc-2core", ("pipeline-cpu-epyc-2core.json",),
          "omnilink bench pipeline --json FILE --plot FILE.png",
          render_pipeline),
    Block("pipeline-cuda-h100", ("pipeline-cuda-h100.json",),
          "omnilink bench pipeline --device cuda --prompt-tokens 4096 --requests 4 --rounds 2 --json FILE",
          render_pipeline),
    Block("pipeline-cuda-h100-mps", ("pipeline-cuda-h100-mps.json",),
          "nvidia-cuda-mps-control -d; omnilink bench pipeline --device cuda --prompt-tokens 4096 --requests 4 "
          "--rounds 2 --json FILE", render_pipeline),
    Block("pipeline-cuda-h200-mps-c1", ("pipeline-cuda-h200-mps-c1.json",),
          "nvidia-cuda-mps-control -d; omnilink bench pipeline --device cuda --connector omnilink-shm,vllm-omni-shm "
          "--prompt-tokens 4096 --requests 8 --rounds 3 --concurrency 1 --json FILE", render_pipeline),
    Block("pipeline-cuda-h200-mps-c8", ("pipeline-cuda-h200-mps-c8.json",),
          "nvidia-cuda-mps-control -d; omnilink bench pipeline --device cuda --connector omnilink-shm,vllm-omni-shm "
          "--prompt-tokens 4096 --requests 8 --rounds 3 --concurrency 8 --json FILE", render_pipeline),
    Block("pipeline-cuda-h100-mps-c1", ("pipeline-cuda-h100-mps-c1.json",),
          "nvidia-cuda-mps-control -d; omnilink bench pipeline --device cuda --connector omnilink-shm,vllm-omni-shm "
          "--prompt-tokens 4096 --requests 8 --rounds 1 --concurrency 1 --json FILE", render_pipeline),
    Block("pipeline-cuda-h100-mps-c8", ("pipeline-cuda-h100-mps-c8.json",),
          "nvidia-cuda-mps-control -d; omnilink bench pipeline --device cuda --connector omnilink-shm,vllm-omni-shm "
          "--prompt-tokens 4096 --requests 8 --rounds 1 --concurrency 8 --json FILE", render_pipeline),
    Block("pipeline-cuda-2xh100-mps-c1", ("pipeline-cuda-2xh100-mps-c1.json",),
          "nvidia-cuda-mps-control -d; omnilink bench pipeline --device cuda --connector omnilink-shm,vllm-omni-shm "
          "--prompt-tokens 4096 --requests 8 --rounds 1 --concurrency 1 --json FILE", render_pipeline),
    Block("pipeline-cuda-2xh100-mps-c8", ("pipeline-cuda-2xh100-mps-c8.json",),
          "nvidia-cuda-mps-control -d; omnilink bench pipeline --device cuda --connector omnilink-shm,vllm-omni-shm "
          "--prompt-tokens 4096 --requests 8 --rounds 1 --concurrency 8 --json FILE", render_pipeline),
    Block("shm-vs-pickle-epyc-2core", ("shm-vs-pickle-epyc-2core.jsonl",),
          "omnilink bench --json FILE --plot FILE.png", render_bench),
    Block("shm-vs-pickle-h100host-16core", ("shm-vs-pickle-h100host-16core.jsonl",),
          "omnilink bench --json FILE", render_bench),
    Block("bench-gpu-h100", ("bench-gpu-h100.jsonl",), "omnilink bench gpu --json FILE --plot FILE.png",
          render_bench),
    Block("gpu-shm-h100", ("gpu-shm-h100.jsonl",), "python benchmarks/bench_gpu.py --skip-overlap --json FILE",
          render_bench_gpu),
    Block("gpu-shm-h100-mps", ("gpu-shm-h100-mps.jsonl",),
          "nvidia-cuda-mps-control -d; python benchmarks/bench_gpu.py --skip-overlap --json FILE", render_bench_gpu),
    Block("route-cpu-2core", ("route-cpu-2core.json",), "python benchmarks/bench_route_cpu.py --json FILE",
          render_route_cpu),
    Block("serial-gpu-h200", ("serial-gpu-h200.json",),
          "python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB "
          "--roads raw,shm,cuda_ipc,shm-ipc --lat-n 200 --n 40 --json FILE", render_serial),
    Block("serial-gpu-h200-mps", ("serial-gpu-h200-mps.json",),
          "nvidia-cuda-mps-control -d; python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB "
          "--roads raw,shm,cuda_ipc,shm-ipc --lat-n 200 --n 40 --json FILE", render_serial),
    Block("serial-gpu-h100", ("serial-gpu-h100.json",),
          "python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB "
          "--roads raw,shm,cuda_ipc,shm-ipc --lat-n 200 --json FILE", render_serial),
    Block("serial-gpu-h100-mps", ("serial-gpu-h100-mps.json",),
          "nvidia-cuda-mps-control -d; python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB "
          "--roads raw,shm,cuda_ipc,shm-ipc --lat-n 200 --json FILE", render_serial),
    Block("serial-gpu-cross-2xh200-publish", ("serial-gpu-cross-2xh200-publish.json",),
          "python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB "
          "--roads raw,shm,cuda_ipc,shm-ipc --lat-n 200 --src cuda:0 --dst cuda:1 --json FILE", render_serial),
    Block("serial-gpu-cross-2xh200-publish-mps", ("serial-gpu-cross-2xh200-publish-mps.json",),
          "nvidia-cuda-mps-control -d; python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB "
          "--roads raw,shm,cuda_ipc,shm-ipc --lat-n 200 --src cuda:0 --dst cuda:1 --json FILE", render_serial),
    Block("serial-gpu-cross-2xh200-mps", ("serial-gpu-cross-2xh200-mps.json",),
          "nvidia-cuda-mps-control -d; python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB "
          "--roads raw,shm,cuda_ipc --src cuda:0 --dst cuda:1 --lat-n 200 --n 20 --json FILE", render_serial),
    Block("serial-gpu-cross-2xh200-pull", ("serial-gpu-cross-2xh200-pull.json",),
          "python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB --roads raw,shm,cuda_ipc "
          "--src cuda:0 --dst cuda:1 --lat-n 200 --n 20 --json FILE, at commit 0ed639c", render_serial),
    Block("serial-gpu-cross-2xh200-pull-device", ("serial-gpu-cross-2xh200-pull-device.json",),
          "python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB --roads raw,shm,cuda_ipc "
          "--src cuda:0 --dst cuda:1 --lat-n 200 --n 20 --payload device --json FILE, at commit 0ed639c",
          render_serial),
    Block("serial-gpu-cross-2xh200-mps-pull", ("serial-gpu-cross-2xh200-mps-pull.json",),
          "nvidia-cuda-mps-control -d; python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB "
          "--roads raw,shm,cuda_ipc --src cuda:0 --dst cuda:1 --lat-n 200 --json FILE, the pulled copies in",
          render_serial),
    Block("serial-gpu-cross-2xh200-mps-plans", ("serial-gpu-cross-2xh200-mps-plans.json",),
          "nvidia-cuda-mps-control -d; python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB "
          "--roads raw,shm,cuda_ipc,shm-ipc --src cuda:0 --dst cuda:1 --lat-n 200 --n 20 --json FILE "
          "(send plans for another GPU's tensors; `shm` still by the host road below 16 MiB)", render_serial),
    Block("serial-gpu-2xh200", ("serial-gpu-2xh200.json",),
          "python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB --json FILE "
          "(benchmarks/gpu/run_serial_device.sh)", render_serial),
    Block("serial-gpu-2xh200-mps", ("serial-gpu-2xh200-mps.json",),
          "nvidia-cuda-mps-control -d; python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB "
          "--json FILE (benchmarks/gpu/run_serial_device.sh)", render_serial),
    Block("serial-gpu-cross-2xh200", ("serial-gpu-cross-2xh200.json",),
          "python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB --src cuda:0 --dst cuda:1 "
          "--json FILE (benchmarks/gpu/run_serial_device.sh)", render_serial),
    Block("serial-gpu-2xh200-mps-probe", ("serial-gpu-2xh200-mps-probe.json",),
          "nvidia-cuda-mps-control -d; python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB "
          "--roads raw,shm,cuda_ipc,shm-ipc --lat-n 200 --json FILE", render_serial),
    Block("serial-gpu-2xh200-mps-before-probe", ("serial-gpu-2xh200-mps-before-probe.json",),
          "nvidia-cuda-mps-control -d; python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB "
          "--roads raw,shm,cuda_ipc,shm-ipc --lat-n 200 --json FILE, with the library at commit 14d9c9d", render_serial),
    Block("serial-gpu-cross-2xh200-probe", ("serial-gpu-cross-2xh200-probe.json",),
          "python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,16MiB,64MiB,256MiB --roads raw,shm,cuda_ipc "
          "--src cuda:0 --dst cuda:1 --lat-n 200 --json FILE", render_serial),
    Block("serial-gpu-2xh100", ("serial-gpu-2xh100.json",),
          "python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,64MiB,256MiB --roads raw,shm,cuda_ipc,shm-ipc "
          "--lat-n 300 --json FILE", render_serial),
    Block("serial-gpu-2xh100-mps", ("serial-gpu-2xh100-mps.json",),
          "nvidia-cuda-mps-control -d; python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,64MiB,256MiB "
          "--roads raw,shm,cuda_ipc,shm-ipc --lat-n 300 --json FILE", render_serial),
    Block("serial-gpu-cross-2xh100", ("serial-gpu-cross-2xh100.json",),
          "python benchmarks/bench_serial_gpu.py --sizes 4KiB,1MiB,64MiB,256MiB --roads raw,shm,cuda_ipc,shm-ipc "
          "--lat-n 300 --src cuda:0 --dst cuda:1 --json FILE", render_serial),
    Block("cuda-ipc-h100-mps", ("cuda-ipc-h100-mps.json",),
          "nvidia-cuda-mps-control -d; python benchmarks/bench_cuda_ipc.py --cases same --json FILE", render_pivot),
    Block("cuda-ipc-2xh200", ("cuda-ipc-2xh200.json",),
          "python benchmarks/bench_cuda_ipc.py --cases cross --sizes 256MiB,64MiB --latency-iters 200 --rounds 2 "
          "--json FILE", render_pivot),
    Block("cuda-ipc-2xh200-pull", ("cuda-ipc-2xh200-pull.json",),
          "python benchmarks/bench_cuda_ipc.py --sizes 256MiB,1MiB --rounds 3 --latency-iters 200 --json FILE, "
          "at commit 0ed639c", render_pivot),
    Block("busy-receiver-epyc-2core", ("busy-receiver-epyc-2core.json",),
          "python benchmarks/bench_busy_receiver.py --json FILE", render_busy),
    Block("busy-receiver-h200", ("busy-receiver-h200.json",),
          "python benchmarks/bench_busy_receiver.py --device cuda --backends shm,cuda_ipc,nixl --json FILE",
          render_busy),
    Block("busy-receiver-epyc-2core-before", ("busy-receiver-epyc-2core-before.json",),
          "python benchmarks/bench_busy_receiver.py --json FILE, with omnilink at commit 7882a13", render_busy),
    Block("nixl-cpu-epyc-2core", ("nixl-cpu-epyc-2core.jsonl",), "python benchmarks/bench_nixl.py --json FILE, at commit 0a6f314",
          render_nixl),
    Block("nixl-gpu-2xh200", ("nixl-gpu-2xh200.jsonl",), "python benchmarks/bench_nixl.py --device cuda --sizes 4KiB,1MiB,64MiB,256MiB --rounds 60 --json FILE, at commit fc0855d",
          render_nixl),
    Block("nixl-gpu-2xh200-watch", ("nixl-gpu-2xh200-watch.jsonl",), "python benchmarks/bench_nixl.py --device cuda --sizes 4KiB,1MiB,64MiB,256MiB --rounds 60 --json FILE (vllm-omni was not installed on that machine: its row is empty)",
          render_nixl),
    Block("nixl-gpu-2xh200-direct", ("nixl-gpu-2xh200-direct.jsonl",), "python benchmarks/bench_nixl.py --device cuda --sizes 4KiB,1MiB,64MiB,256MiB --rounds 100 --connectors omnilink-nixl,raw-nixl,nccl,peer-copy --json FILE",
          render_nixl),
    Block("nixl-gpu-2xh200-before-direct", ("nixl-gpu-2xh200-before-direct.jsonl",), "python benchmarks/bench_nixl.py --device cuda --sizes 4KiB,1MiB,64MiB,256MiB --rounds 100 --connectors omnilink-nixl,raw-nixl,nccl,peer-copy --json FILE, with omnilink/connectors/nixl at commit 14d9c9d",
          render_nixl),
    Block("nccl-2xh200", ("nccl-2xh200.jsonl",), "python benchmarks/bench_nccl.py --backend nccl --rounds 3 --latency-iters 300 --json FILE, at commit bc768ca",
          render_pivot),
)


def block_text(block: Block) -> str:
    """The generated Markdown of one block, markers included."""
    body = block.render([_load(f) for f in block.files])
    files = ", ".join(f"`{RESULTS}/{f}`" for f in block.files)
    cmd = block.command if "`" in block.command else f"`{block.command}`"
    return (f"<!-- perf:begin {block.id} -->\n{body}\n\n"
            f"Source: {files}, made by {cmd}.\n"
            f"<!-- perf:end {block.id} -->")


def update(text: str, blocks: dict[str, str], *, page: str) -> str:
    """``text`` with each generated block replaced by its current rendering.

    Raises
    ------
    ValueError
        The page names a block this script does not know.
    """
    def repl(m: re.Match[str]) -> str:
        if m.group("id") not in blocks:
            raise ValueError(f"{page}: unknown generated block {m.group('id')!r}")
        return blocks[m.group("id")]

    return _BLOCK.sub(repl, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="rewrite the generated blocks of the pages")
    group.add_argument("--check", action="store_true", help="exit 1 if a page's blocks are out of date")
    parser.add_argument("--root", default=REPO, help="repository root holding the pages (default: this one)")
    args = parser.parse_args(argv)
    try:
        blocks = {b.id: block_text(b) for b in BLOCKS}
    except (OSError, ValueError, KeyError) as exc:
        print(f"make_perf_page: cannot render: {exc!r}", file=sys.stderr)
        return 2
    if not (args.write or args.check):
        sys.stdout.write("\n\n".join(blocks.values()) + "\n")
        return 0
    used: set[str] = set()
    stale = []
    for page in PAGES:
        path = os.path.join(args.root, page)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        used |= {m.group("id") for m in _BLOCK.finditer(text)}
        try:
            new = update(text, blocks, page=page)
        except ValueError as exc:
            print(f"make_perf_page: {exc}", file=sys.stderr)
            return 2
        if new != text:
            stale.append(page)
            if args.write:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
    missing = sorted(set(blocks) - used)
    if missing:
        print(f"make_perf_page: blocks not on any page: {', '.join(missing)}", file=sys.stderr)
        return 1
    if args.check and stale:
        print(f"make_perf_page: out of date with benchmarks/results: {', '.join(stale)}; run "
              "python benchmarks/make_perf_page.py --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
