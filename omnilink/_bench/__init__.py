"""Benchmark machinery behind ``omnilink bench`` (private; the CLI is the interface).

Modules
-------
``units``      size parsing (``4KiB``, ``16MiB``, ``1GB``) and formatting
``machine``    the machine record stored with every result
``payload``    the vLLM-Omni-like payload dict the transfers carry
``backends``   the transports measured: omnilink ``shm`` / ``zmq`` and the baselines
``workers``    sender / receiver process bodies (importable, for ``spawn``)
``scenarios``  one module per scenario (``shm_vs_pickle``, ``gpu``), each a ``Scenario``
``runner``     the shared runner: cell loop, warm-up, repetitions, time budgets
``report``     text table, Markdown table, JSON lines, plot, caveats
``progress``   the progress line on stderr
``pipeline``   ``omnilink bench pipeline``: a three-process streaming pipeline, time to
               first audio per connector (its own options and runner)
``vllm_omni_shm``  vLLM-Omni's ``SharedMemoryConnector`` loaded without vLLM (a baseline)

Pickle appears here, and only here, as a *baseline being measured* (what serving
engines do today); it is never on omnilink's data path.
"""

from __future__ import annotations

from typing import Any

# The door the CLI uses; each name loads its module on first use, so ``omnilink --help``
# stays cheap.
_EXPORTS = {
    "machine_record": "machine", "cpu_model": "machine", "cuda_devices": "machine",
    "shm_usage": "machine", "versions": "machine",
    "Progress": "progress",
    "pipeline_main": "pipeline",
    "PlotUnavailable": "report", "add_ratios": "report", "caveats": "report",
    "plot_title": "report", "require_matplotlib": "report", "text_table": "report",
    "write_jsonl": "report", "write_plot": "report", "read_jsonl": "report",
    "markdown_tables": "report",
    "DEFAULT_SIZES": "runner", "MODES": "runner", "BenchOptions": "runner", "run_bench": "runner",
    "SCENARIOS": "scenarios", "Scenario": "scenarios",
    "format_size": "units", "parse_size": "units", "parse_sizes": "units",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
