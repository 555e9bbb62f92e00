"""Turning benchmark records into a text table, a Markdown table, JSON lines and a plot.

A record is the dict ``_runner`` emits for one cell. ``add_ratios`` adds the two ratio
columns, both "speed relative to" a named backend of the same size and mode, so that
> 1 always means faster:

- throughput: ``vs_reference = gbps / reference gbps`` (same for ``vs_ceiling``);
- latency: ``vs_reference = reference p50 / p50``.

Nothing here assumes CPU tensors or a particular scenario: the reference (``pickle-shm``)
and the ceiling (``memcpy`` on CPU, pinned H2D on GPU) come from the scenario.
"""

from __future__ import annotations

import datetime
from typing import IO, Any, Iterable

import msgspec

from omnilink._bench.units import format_size

__all__ = [
    "add_ratios",
    "caveats",
    "markdown_tables",
    "plot_title",
    "read_jsonl",
    "text_table",
    "write_jsonl",
    "write_plot",
]

REQUIRED_KEYS = ("scenario", "backend", "mode", "size_bytes", "status")


def _key(rec: dict[str, Any]) -> tuple[str, str, int]:
    return (rec["mode"], rec["backend"], rec["size_bytes"])


def _speed(rec: dict[str, Any]) -> float | None:
    """Bigger-is-better figure of an ok record: GB/s, or 1 / p50 for latency."""
    if rec.get("status") != "ok":
        return None
    if rec["mode"] == "throughput":
        return rec.get("gbps")
    p50 = rec.get("p50_us")
    return 1.0 / p50 if p50 else None


def add_ratios(records: list[dict[str, Any]], *, reference: str, ceiling: str) -> None:
    """Set ``vs_reference`` / ``vs_ceiling`` (and their backend names) on each ok record."""
    index = {_key(r): r for r in records}
    for rec in records:
        own = _speed(rec)
        if own is None:
            continue
        for field, other in (("reference", reference), ("ceiling", ceiling)):
            ref = index.get((rec["mode"], other, rec["size_bytes"]))
            ref_speed = _speed(ref) if ref is not None else None
            rec[field] = other
            rec[f"vs_{field}"] = own / ref_speed if ref_speed else None


# ---------------------------------------------------------------------- text table
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _fmt_ratio(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:.0f}x"
    if value >= 10:
        return f"{value:.1f}x"
    if value >= 0.1:
        return f"{value:.2f}x"
    return f"{value:.2g}x"  # keep two significant digits of small fractions of a ceiling


def _fmt_rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if value < 1000 else f"{value:,.0f}"


def _render(headers: list[str], rows: list[list[str]], align: str) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        out = []
        for cell, w, a in zip(cells, widths, align):
            out.append(cell.ljust(w) if a == "<" else cell.rjust(w))
        return "  ".join(out).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def text_table(records: list[dict[str, Any]], *, reference: str, ceiling: str) -> str:
    """The table ``omnilink bench`` prints: one block per mode, rows by size then backend.

    Cells that did not run say so (``unavailable`` / ``error``); their reasons are listed
    once under the table.
    """
    out: list[str] = []
    reasons: dict[str, str] = {}
    for mode in ("throughput", "latency"):
        recs = [r for r in records if r["mode"] == mode]
        if not recs:
            continue
        rows = []
        for rec in sorted(recs, key=lambda r: r["size_bytes"]):
            status = rec.get("status")
            if status != "ok":
                reasons.setdefault(rec["backend"], f"{status}: {rec.get('reason', '')}")
                rows.append([rec["size"], rec["backend"], status, "", "", ""])
                continue
            ratios = [_fmt_ratio(rec.get("vs_reference")), _fmt_ratio(rec.get("vs_ceiling"))]
            if mode == "throughput":
                rows.append([rec["size"], rec["backend"], _fmt(rec["gbps"], ".3f"),
                             _fmt_rate(rec["msgs_per_s"]), *ratios])
            else:
                rows.append([rec["size"], rec["backend"], _fmt(rec["p50_us"], ",.1f"),
                             _fmt(rec["p99_us"], ",.1f"), *ratios])
        if mode == "throughput":
            title = "throughput (median of runs; GB = 1e9 bytes of tensor data)"
            headers = ["size", "backend", "GB/s", "msgs/s", f"vs {reference}", f"vs {ceiling}"]
        else:
            title = "latency (one-way, one message in flight)"
            headers = ["size", "backend", "p50 us", "p99 us", f"vs {reference}", f"vs {ceiling}"]
        if out:
            out.append("")
        out.append(title)
        out.extend(_render(headers, rows, "<<>>>>"))
    out.append("")
    out.append(f"vs X: speed relative to backend X at the same size (>1 = faster; "
               f"latency compares p50).")
    for backend, reason in reasons.items():
        out.append(f"{backend}: {reason}")
    return "\n".join(out)


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1 << 30):.1f} GiB"


def machine_line(machine: dict[str, Any]) -> str:
    """One line naming the machine (no hostname)."""
    shm = machine.get("shm") or {}
    v = machine.get("versions", {})
    parts = [
        f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, "
        f"{_gib(machine.get('memory_bytes'))} RAM, /dev/shm {_gib(shm.get('size_bytes'))} "
        f"({_gib(shm.get('free_bytes'))} free), {machine.get('os', '?')}",
        ", ".join(f"{k} {v[k]}" for k in ("python", "torch", "numpy", "msgspec", "pyzmq", "omnilink")
                  if v.get(k)),
    ]
    gpus = machine.get("cuda_devices")
    if gpus:
        parts.append(", ".join(f"cuda:{d['index']} {d['name']}" for d in gpus))
    return "; ".join(parts)


def caveats(scenario: Any, machine: dict[str, Any], *, ceiling_text: str) -> str:
    """The "benchmarks are hard" lines printed under every table (msgspec does the same)."""
    return "\n".join([
        "Benchmarks are hard. What was measured: " + scenario.description + ": a sender and a "
        "receiver process (spawn, one torch thread each) move a vLLM-Omni-like payload (a bf16 "
        "hidden state of the given size plus small metadata).",
        "  throughput: bursts of messages with a bounded number in flight, median over runs.",
        "  latency: one-way, from the sender's CLOCK_MONOTONIC stamp just before the transport "
        "(serialisation included) to the receiver holding a usable payload.",
        f"  {ceiling_text}",
        "Machine: " + machine_line(machine),
        "Other load on the machine moves these numbers; compare backends within one run, "
        "and run `omnilink bench` on your own hardware.",
    ])


# -------------------------------------------------------------------------- json
def write_jsonl(fh: IO[str], records: Iterable[dict[str, Any]], *, machine: dict[str, Any],
                run_id: str | None = None) -> None:
    """One JSON object per line: the record, ``machine``, ``timestamp`` (UTC) and ``run_id``."""
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    enc = msgspec.json.Encoder()
    for rec in records:
        line = {**rec, "timestamp": when, "machine": machine}
        if run_id is not None:
            line["run_id"] = run_id
        fh.write(enc.encode(line).decode() + "\n")


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Records of a ``--json`` file; ``ValueError`` naming the line if one is malformed."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = msgspec.json.decode(line)
            except msgspec.DecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc})") from exc
            missing = [k for k in REQUIRED_KEYS if k not in rec]
            if missing:
                raise ValueError(f"{path}:{lineno}: missing keys {missing}")
            out.append(rec)
    return out


# ---------------------------------------------------------------------- markdown
def markdown_tables(records: list[dict[str, Any]]) -> str:
    """README tables: backends as rows, sizes as columns; throughput cells read
    ``GB/s (x vs reference)``, latency cells ``p50 us``. Generated, never hand-edited."""
    out: list[str] = []
    sizes = sorted({r["size_bytes"] for r in records})
    backends = list(dict.fromkeys(r["backend"] for r in records))
    index = {_key(r): r for r in records}
    for mode, title in (("throughput", "Throughput, GB/s (ratio to {ref})"),
                        ("latency", "One-way latency p50 / p99, microseconds")):
        if not any(r["mode"] == mode for r in records):
            continue
        ref = next((r.get("reference") for r in records if r.get("reference")), "pickle-shm")
        out.append(f"**{title.format(ref=ref)}**")
        out.append("")
        out.append("| backend | " + " | ".join(format_size(s) for s in sizes) + " |")
        out.append("| --- |" + " ---: |" * len(sizes))
        for b in backends:
            cells = []
            for s in sizes:
                rec = index.get((mode, b, s))
                if rec is None:
                    cells.append("")
                elif rec.get("status") != "ok":
                    cells.append(rec.get("status", "?"))
                elif mode == "throughput":
                    ratio = rec.get("vs_reference")
                    cells.append(f"{rec['gbps']:.3g}" + (f" ({ratio:.3g}x)" if ratio else ""))
                else:
                    cells.append(f"{rec['p50_us']:,.0f} / {rec['p99_us']:,.0f}")
            out.append(f"| {b} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


# -------------------------------------------------------------------------- plot
class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    """Raise ``PlotUnavailable`` with the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable("--plot needs matplotlib: pip install matplotlib") from exc


def plot_title(scenario: str, machine: dict[str, Any]) -> str:
    """Short plot title: scenario, CPU, cores, GPU if any, torch and omnilink versions."""
    v = machine.get("versions", {})
    gpus = machine.get("cuda_devices") or []
    gpu = f", {gpus[0]['name']}" if gpus else ""
    return (f"omnilink bench {scenario}: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores"
            f"{gpu}; torch {v.get('torch', '?')}, omnilink {v.get('omnilink', '?')}")


def write_plot(path: str, records: list[dict[str, Any]], *, title: str) -> None:
    """Throughput vs size (log-log), one line per backend; latency p50 beside it if measured."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("throughput", "latency") if any(r["mode"] == m and r.get("status") == "ok"
                                                         for r in records)]
    fig, axes = plt.subplots(1, max(1, len(modes)), figsize=(6.5 * max(1, len(modes)), 4.8),
                             squeeze=False)
    backends = list(dict.fromkeys(r["backend"] for r in records))
    for ax, mode in zip(axes[0], modes or ["throughput"]):
        for b in backends:
            pts = sorted((r["size_bytes"], r["gbps"] if mode == "throughput" else r["p50_us"])
                         for r in records
                         if r["backend"] == b and r["mode"] == mode and r.get("status") == "ok")
            if not pts:
                continue
            style = "--" if b in ("memcpy", "h2d-pinned") else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=b)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        sizes = sorted({r["size_bytes"] for r in records})
        ax.set_xticks(sizes, [format_size(s) for s in sizes])
        ax.set_xlabel("payload tensor size")
        ax.set_ylabel("GB/s (higher is better)" if mode == "throughput"
                      else "one-way p50, us (lower is better)")
        ax.set_title(mode)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ README block
README_BEGIN = "<!-- omnilink-bench:begin (generated by benchmarks/make_readme_table.py; do not edit) -->"
README_END = "<!-- omnilink-bench:end -->"


def readme_block(records: list[dict[str, Any]], *, source: str) -> str:
    """The README's performance block for a committed run: machine, tables, provenance.

    Raises
    ------
    ValueError
        ``records`` is empty or mixes scenarios or machines.
    """
    if not records:
        raise ValueError(f"{source}: no records")
    scenarios = {r["scenario"] for r in records}
    if len(scenarios) != 1:
        raise ValueError(f"{source}: several scenarios in one file: {sorted(scenarios)}")
    machines = {msgspec.json.encode(r.get("machine")) for r in records}
    if len(machines) != 1:
        raise ValueError(f"{source}: records from several machines or runs")
    machine = records[0].get("machine") or {}
    when = records[0].get("timestamp", "?")
    lines = [
        README_BEGIN,
        f"`omnilink bench {next(iter(scenarios))}`, run {when} on: {machine_line(machine)}.",
        "",
        markdown_tables(records).rstrip(),
        "",
        f"Source: `{source}` (regenerate with `python benchmarks/make_readme_table.py {source} "
        "--write README.md`).",
        README_END,
    ]
    return "\n".join(lines) + "\n"


def replace_readme_block(text: str, block: str) -> str:
    """``text`` with its generated block replaced by ``block``.

    Raises
    ------
    ValueError
        ``text`` has no complete begin/end marker pair.
    """
    start = text.find(README_BEGIN)
    end = text.find(README_END, start + 1)
    if start < 0 or end < 0:
        raise ValueError("README has no generated benchmark block (markers "
                         f"{README_BEGIN!r} ... {README_END!r})")
    return text[:start] + block.rstrip("\n") + text[end + len(README_END):]
