"""Starting child processes in tests: always spawn, always tracked by the ``procs``
fixture (tests/conftest.py), which kills what is still alive at teardown."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

CTX = mp.get_context("spawn")


def start_process(procs: list, target, *args):
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    procs.append(p)
    return p


def wait_file(path: str, proc, timeout: float = 60.0) -> None:
    """Wait until the child ``proc`` wrote something to ``path`` (its "ready")."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) or not open(path).read():
        assert proc.is_alive(), "child died"
        assert time.monotonic() < deadline, "child never got ready"
        time.sleep(0.02)


def wait_json(path: str, proc, timeout: float = 120.0) -> dict:
    """The JSON report the child ``proc`` writes to ``path`` once (waited for)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.is_alive() or os.path.exists(path), f"child exited with {proc.exitcode}"
        assert time.monotonic() < deadline, "child never reported"
        time.sleep(0.02)
    with open(path) as f:
        return json.load(f)
