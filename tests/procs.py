"""Starting child processes in tests: always spawn, always tracked by the ``procs``
fixture (tests/conftest.py), which kills what is still alive at teardown."""

from __future__ import annotations

import multiprocessing as mp

CTX = mp.get_context("spawn")


def start_process(procs: list, target, *args):
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    procs.append(p)
    return p
