"""The scenarios of ``omnilink bench``, one module each, run by ``omnilink._bench.runner``.

A scenario is a ``Scenario`` record: the backends it measures, where payloads live, the
baseline of its ratio column and its ceiling. Add one by writing a module with a
``SCENARIO`` and listing it here.

``shm_vs_pickle``  the default: same-host CPU transfer (``omnilink bench``)
``gpu``            GPU -> host -> GPU between two processes (``omnilink bench gpu``)
"""

from __future__ import annotations

from omnilink._bench.scenarios import gpu, shm_vs_pickle
from omnilink._bench.scenarios.base import Scenario

__all__ = ["SCENARIOS", "Scenario"]

SCENARIOS: dict[str, Scenario] = {m.SCENARIO.name: m.SCENARIO for m in (shm_vs_pickle, gpu)}
