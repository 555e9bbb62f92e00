"""Benchmark machinery behind ``omnilink bench`` (private; the CLI is the interface).

Modules
-------
``_units``     size parsing (``4KiB``, ``16MiB``, ``1GB``) and formatting
``_machine``   the machine record stored with every result
``_payload``   the vLLM-Omni-like payload dict the transfers carry
``_backends``  the transports measured: omnilink ``shm`` / ``zmq`` and the baselines
``_workers``   sender / receiver process bodies (importable, for ``spawn``)
``_runner``    scenarios, the cell loop, warm-up, repetitions, time budgets
``_gpu``       the ``gpu`` scenario (host<->device copies; needs CUDA)
``_report``    text table, Markdown table, JSON lines, plot, caveats
``_progress``  the progress line on stderr

Pickle appears here, and only here, as a *baseline being measured* (what serving
engines do today); it is never on omnilink's data path.
"""

from __future__ import annotations
