"""The ``omnilink`` command line (also ``python -m omnilink``).

Subcommands
-----------
``omnilink bench [SCENARIO]``
    Measure omnilink's transfers against what engines do today, on this machine.
``omnilink bench pipeline``
    Run a three-process streaming pipeline (thinker -> talker -> code2wav) per connector:
    time to first audio, transport per chunk, bit-identical audio (its own options:
    ``omnilink bench pipeline --help``).
``omnilink info``
    Versions (cuda-python, vLLM and vLLM-Omni among them), backends, ``/dev/shm`` (a
    warning when it is smaller than the default arena) and CUDA devices, and whether
    vLLM-Omni would load omnilink's plugin under the current ``VLLM_PLUGINS``.
``omnilink check FILE...``
    Check vLLM-Omni deployment files edge by edge without vLLM or a GPU: the connector
    of every stage edge, and for omnilink edges whether ``extra`` and the backend
    options validate and the backend can run here (exit 1 when problems are found).
``omnilink gc``
    Remove shared-memory segments and semaphores, and zmq ipc socket and lock files,
    that dead processes left behind.
``omnilink --version``
    Print omnilink's version.

Exit status: 0 success, 1 the command could not do its work (a scenario that cannot run
here, a backend that fails to load), 2 bad usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence, TextIO

__all__ = ["main"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _UsageError(Exception):
    """A bad option found after argparse (sizes, backends); exit status 2."""


# -------------------------------------------------------------------------- parsing
def _build_parser() -> argparse.ArgumentParser:
    from omnilink import __version__
    from omnilink._bench import SCENARIOS

    parser = argparse.ArgumentParser(
        prog="omnilink",
        description="omnilink: zero-copy tensor transfer between pipeline stages.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"omnilink {__version__}",
                        help="print omnilink's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    bench = sub.add_parser(
        "bench",
        help="benchmark omnilink against pickle and the other baselines",
        description=(
            "Measure same-host transfers of a vLLM-Omni-like payload between two processes: "
            "omnilink shm and zmq against pickle over a fresh SharedMemory segment, msgpack "
            "with copies, a torch.multiprocessing queue and a plain memcpy (the ceiling)."
        ),
        epilog="scenarios: " + "; ".join(f"{s.name}: {s.description}" for s in SCENARIOS.values())
        + "; pipeline: a three-process streaming pipeline, time to first audio per connector "
          "(omnilink bench pipeline --help)",
    )
    bench.add_argument("scenario_pos", nargs="?", metavar="SCENARIO", choices=list(SCENARIOS),
                       help=f"one of {', '.join(SCENARIOS)} (default shm-vs-pickle)")
    bench.add_argument("--scenario", dest="scenario_opt", choices=list(SCENARIOS),
                       help="same as the positional SCENARIO")
    bench.add_argument("--sizes", default=None,
                       help="comma list of tensor sizes, e.g. 4KiB,64KiB,16MiB "
                            "(KiB/MiB/GiB binary, KB/MB/GB decimal; default 4KiB,64KiB,1MiB,16MiB,256MiB)")
    bench.add_argument("--mode", choices=("throughput", "latency", "both"), default="both",
                       help="what to measure (default both)")
    bench.add_argument("--backends", default=None,
                       help="comma list of backends to run (default: all of the scenario)")
    bench.add_argument("--repeat", type=int, default=5,
                       help="measured runs per cell after one warm-up run (default 5)")
    bench.add_argument("--max-seconds", type=float, default=3.0,
                       help="time budget per cell: stop repeating once exceeded, after at "
                            "least one measured run (default 3)")
    bench.add_argument("--timeout", type=float, default=60.0,
                       help="seconds any single message may take before the cell fails (default 60)")
    bench.add_argument("--json", metavar="FILE", help="write one JSON object per cell to FILE")
    bench.add_argument("--plot", metavar="FILE.png", help="write a throughput-vs-size plot (needs matplotlib)")
    bench.add_argument("-q", "--quiet", action="store_true",
                       help="no progress on stderr (by default a redrawn line on a terminal, "
                            "one line per step otherwise)")

    info = sub.add_parser("info", help="versions, backends, /dev/shm and CUDA devices")
    info.add_argument("--json", action="store_true", help="print one JSON object")

    check = sub.add_parser(
        "check",
        help="check vLLM-Omni deployment files edge by edge (needs neither vLLM nor a GPU)",
        description=(
            "Read vLLM-Omni 0.30.0 deployment / stage-config files (YAML or JSON, base_config "
            "resolved) as vLLM-Omni does and print, for every stage edge, the connector it gets; "
            "for OmnilinkConnector edges, whether extra and the backend options validate and "
            "whether the backend can run on this machine (/dev/shm size, CUDA, NCCL)."
        ),
        epilog="exit status: 0 no problem, 1 problems found, 2 bad usage or a file that cannot be read",
    )
    check.add_argument("files", nargs="+", metavar="FILE", help="deployment files (.yaml, .yml, .json)")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.add_argument("--file-only", action="store_true",
                       help="check the files only, not whether this machine can run their backends")

    gc = sub.add_parser("gc", help="remove shared memory and zmq ipc files left behind by dead processes")
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    gc.add_argument("--prefix", default=None,
                    help="name prefix to look at (default: $OMNILINK_SHM_PREFIX or 'omnilink')")
    gc.add_argument("--cuda", action="store_true",
                    help="also remove the CUDA driver's interprocess-event files of processes that are gone "
                         "(/dev/shm/cuda.shm.<n>.<pid hex>.<n>: the driver leaves one per process that made "
                         "interprocess events, even after a clean exit)")
    return parser


def _bench_options(args: argparse.Namespace) -> Any:
    from omnilink._bench import DEFAULT_SIZES, MODES, SCENARIOS, BenchOptions
    from omnilink._bench import parse_sizes
    from omnilink._errors import ConfigurationError

    if args.scenario_pos and args.scenario_opt and args.scenario_pos != args.scenario_opt:
        raise _UsageError(f"scenario given twice: {args.scenario_pos!r} and --scenario {args.scenario_opt!r}")
    scenario = SCENARIOS[args.scenario_opt or args.scenario_pos or "shm-vs-pickle"]
    try:
        sizes = parse_sizes(args.sizes) if args.sizes is not None else list(DEFAULT_SIZES)
    except ConfigurationError as exc:
        raise _UsageError(f"--sizes: {exc}") from exc
    backends = None
    if args.backends is not None:
        backends = list(dict.fromkeys(b.strip() for b in args.backends.split(",") if b.strip()))
        unknown = [b for b in backends if b not in scenario.backends]
        if not backends or unknown:
            raise _UsageError(
                f"--backends: unknown backend(s) {', '.join(unknown) or '(none given)'} for scenario "
                f"{scenario.name}; choose from {','.join(scenario.backends)}"
            )
    if args.repeat < 1:
        raise _UsageError(f"--repeat must be >= 1, got {args.repeat}")
    if not args.max_seconds > 0:
        raise _UsageError(f"--max-seconds must be > 0, got {args.max_seconds}")
    if not args.timeout > 0:
        raise _UsageError(f"--timeout must be > 0, got {args.timeout}")
    modes = MODES if args.mode == "both" else (args.mode,)
    return BenchOptions(scenario=scenario.name, sizes=sizes, modes=modes, backends=backends,
                        repeat=args.repeat, max_seconds=args.max_seconds, timeout=args.timeout)


# --------------------------------------------------------------------------- bench
def _cmd_bench(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from omnilink._bench import machine_record
    from omnilink._bench import Progress
    from omnilink._bench import (
        PlotUnavailable,
        add_ratios,
        caveats,
        plot_title,
        require_matplotlib,
        text_table,
        write_jsonl,
        write_plot,
    )
    from omnilink._bench import SCENARIOS, run_bench

    opts = _bench_options(args)
    scenario = SCENARIOS[opts.scenario]
    if scenario.needs_cuda:
        import torch

        if not torch.cuda.is_available():
            print(f"omnilink bench {scenario.name}: CUDA is not available on this machine "
                  "(torch.cuda.is_available() is False); this scenario needs a CUDA device. "
                  "`omnilink bench` runs the CPU scenario.", file=err)
            return EXIT_FAIL
    if args.plot:
        try:
            require_matplotlib()
        except PlotUnavailable as exc:
            print(f"omnilink bench: {exc}", file=err)
            return EXIT_USAGE
    # Open the output now so a bad path fails before minutes of measuring.
    json_fh = None
    if args.json:
        try:
            json_fh = open(args.json, "w", encoding="utf-8")  # noqa: SIM115 (closed below)
        except OSError as exc:
            raise _UsageError(f"--json: cannot write {args.json}: {exc}") from exc

    machine = machine_record(include_cuda=scenario.needs_cuda)
    records: list[dict[str, Any]] = []
    progress = Progress.for_terminal(quiet=args.quiet)
    interrupted = False
    try:
        run_bench(opts, emit=records.append, progress=progress)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.close()
    add_ratios(records, reference=scenario.reference, ceiling=scenario.ceiling)

    if json_fh is not None:
        with json_fh:
            write_jsonl(json_fh, records, machine=machine)
    if records:
        print(f"omnilink bench: {scenario.name}", file=out)
        print(file=out)
        print(text_table(records, reference=scenario.reference, ceiling=scenario.ceiling), file=out)
        print(file=out)
        ceiling_text = ("memcpy: one single-threaded copy of the same bytes inside one process "
                        "(the ceiling)." if scenario.ceiling == "memcpy" else
                        f"{scenario.ceiling}: one copy of the same bytes (the ceiling).")
        print(caveats(scenario, machine, ceiling_text=ceiling_text), file=out)
    if args.plot and records:
        write_plot(args.plot, records, title=plot_title(scenario.name, machine))
    if args.json:
        print(f"wrote {len(records)} records to {args.json}", file=err)
    if args.plot and records:
        print(f"wrote plot to {args.plot}", file=err)
    if interrupted:
        print("omnilink bench: interrupted; results above are partial", file=err)
        return EXIT_INTERRUPTED
    return EXIT_OK


# ---------------------------------------------------------------------------- info
def _backend_status() -> dict[str, str | None]:
    """Each registered backend and ``None`` if it loads, else the reason it does not."""
    from omnilink.connectors import available_backends, backend_unavailable

    return {name: backend_unavailable(name) for name in available_backends()}


#: Distributions ``info`` reports besides those the transfers depend on: what a
#: vLLM-Omni deployment needs to match (none of them is imported).
_DEPLOY_DISTRIBUTIONS = {"cuda-python": ("cuda-python", "cuda-bindings"), "vllm": ("vllm",),
                         "vllm-omni": ("vllm-omni",)}


def _deploy_versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for key, dists in _DEPLOY_DISTRIBUTIONS.items():
        out[key] = None
        for dist in dists:
            try:
                out[key] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def _shm_warnings(shm: dict[str, int] | None) -> list[str]:
    """Why the shm backend's defaults will not be what they are elsewhere, if they won't."""
    from omnilink.connectors.shm import DEFAULT_ARENA_BYTES

    if shm is None:
        return ["/dev/shm is not present: the shm backend cannot run here"]
    free = shm["free_bytes"]
    if free >= DEFAULT_ARENA_BYTES:
        return []
    start = max(1 << 20, (free // 4) >> 20 << 20)
    return [
        f"/dev/shm has {free / 2**20:.1f} MiB free, less than the default {DEFAULT_ARENA_BYTES >> 20} MiB "
        f"arena: shm senders start at {start >> 20} MiB (a quarter of it) and a payload /dev/shm cannot "
        "hold fails. Give it room: docker run --shm-size=1g (or --ipc=host); Kubernetes: a memory-backed "
        "emptyDir (medium: Memory) mounted on /dev/shm"
    ]


def _info_record() -> dict[str, Any]:
    from omnilink._bench import cpu_model, cuda_devices, shm_usage, versions
    from omnilink.integrations.vllm_omni import plugin_status

    import os

    backends = _backend_status()
    shm = shm_usage()
    warnings = _shm_warnings(shm)
    states = {name: ("ok" if reason is None else f"unavailable: {reason}") for name, reason in backends.items()}
    if warnings and states.get("shm") == "ok":
        states["shm"] = "ok, but /dev/shm is small (see the warning)"
    return {
        "versions": {**versions(), **_deploy_versions()},
        "backends": states,
        "shm": shm,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cuda_devices": cuda_devices(),
        "vllm_omni_plugin": plugin_status(),
        "warnings": warnings,
    }


def _cmd_info(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    import msgspec

    rec = _info_record()
    if args.json:
        out.write(msgspec.json.encode(rec).decode() + "\n")
        return EXIT_OK
    for name, ver in rec["versions"].items():
        print(f"{name:<10} {ver or 'not installed'}", file=out)
    print(file=out)
    print("backends:", file=out)
    for name, state in rec["backends"].items():
        print(f"  {name:<8} {state}", file=out)
    print(file=out)
    shm = rec["shm"]
    if shm is None:
        print("/dev/shm:  not present (the shm backend needs it)", file=out)
    else:
        print(f"/dev/shm:  {shm['size_bytes'] / (1 << 30):.1f} GiB, "
              f"{shm['free_bytes'] / (1 << 30):.1f} GiB free", file=out)
    print(f"cpu:       {rec['cpu']}, {rec['cores']} cores", file=out)
    if rec["cuda_devices"]:
        for d in rec["cuda_devices"]:
            print(f"cuda:{d['index']}:    {d['name']}, {d['memory_bytes'] / (1 << 30):.1f} GiB, "
                  f"compute capability {d['capability']}", file=out)
    else:
        print("cuda:      not available", file=out)
    plugin = rec["vllm_omni_plugin"]
    print(file=out)
    print(f"vLLM-Omni plugin: {plugin['entry_point'] or 'not installed'} "
          f"(group vllm_omni.general_plugins)", file=out)
    print(f"  {'loads' if plugin['loads'] else 'does NOT load'}: {plugin['reason']}", file=out)
    for warning in rec["warnings"]:
        print(file=out)
        print(f"warning: {warning}", file=out)
    return EXIT_OK


# --------------------------------------------------------------------------- check
def _cmd_check(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    import msgspec

    from omnilink.integrations.vllm_omni import CheckUsageError, check_file, format_report

    reports = []
    for path in args.files:
        try:
            reports.append(check_file(path, host=not args.file_only))
        except CheckUsageError as exc:
            raise _UsageError(str(exc)) from exc
    problems = sum(r.problem_count for r in reports)
    if args.json:
        out.write(msgspec.json.encode({"files": [r.as_dict() for r in reports], "problems": problems}).decode() + "\n")
    else:
        print("\n\n".join(format_report(r) for r in reports), file=out)
    return EXIT_FAIL if problems else EXIT_OK


# ------------------------------------------------------------------------------ gc
def _cmd_gc(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        from omnilink.connectors.shm import collect_garbage
    except ImportError as exc:
        print(f"omnilink gc: the shm backend could not be loaded ({exc})", file=err)
        return EXIT_FAIL
    from omnilink._errors import ConfigurationError, OmnilinkError

    kwargs: dict[str, Any] = {"dry_run": args.dry_run}
    if args.prefix is not None:
        kwargs["prefix"] = args.prefix
    try:
        removed = collect_garbage(**kwargs)
    except ConfigurationError as exc:  # a bad --prefix or $OMNILINK_SHM_PREFIX
        raise _UsageError(str(exc)) from exc
    except OmnilinkError as exc:
        print(f"omnilink gc: {exc}", file=err)
        return EXIT_FAIL
    try:
        from omnilink.connectors.zmq import collect_ipc_garbage
    except ImportError:  # pyzmq missing: no zmq receivers can have left anything
        pass
    else:
        try:
            removed = removed + collect_ipc_garbage(**kwargs)
        except OmnilinkError as exc:
            print(f"omnilink gc: {exc}", file=err)
            return EXIT_FAIL
    if args.cuda:
        from omnilink.connectors.shm import collect_cuda_event_files

        removed = removed + collect_cuda_event_files(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for name in removed:
        print(f"{verb} {name}", file=out)
    print(f"{len(removed)} {'entry' if len(removed) == 1 else 'entries'} "
          f"{'would be removed' if args.dry_run else 'removed'}", file=out)
    return EXIT_OK


# ---------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``omnilink`` command line and return its exit status.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments without the program name; ``sys.argv[1:]`` when omitted.

    Returns
    -------
    int
        0 on success, 1 when the command could not do its work, 2 for bad usage, 130
        when interrupted.
    """
    out, err = sys.stdout, sys.stderr
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:2] == ["bench", "pipeline"]:
        # A whole pipeline, not a transfer scenario: its own options and runner.
        from omnilink._bench import pipeline_main

        try:
            return pipeline_main(args_list[2:], out=out, err=err)
        except KeyboardInterrupt:
            print("omnilink bench pipeline: interrupted", file=err)
            return EXIT_INTERRUPTED
    parser = _build_parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse has printed the message (or --help)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(err)
        return EXIT_USAGE
    handler = {"bench": _cmd_bench, "info": _cmd_info, "check": _cmd_check, "gc": _cmd_gc}[args.command]
    try:
        return handler(args, out, err)
    except _UsageError as exc:
        print(f"omnilink {args.command}: error: {exc}", file=err)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"omnilink {args.command}: interrupted", file=err)
        return EXIT_INTERRUPTED
