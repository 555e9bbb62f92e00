"""Stress of cuda_ipc's released ring: a long stream between two processes, no GPU needed.

Two processes stream ``N`` small payloads through the ``cuda_ipc`` backend's control
plane over host memory (the CPU test double ``tests.cuda_ipc_double.HostCudaIpc``); the
receiver drops each payload at once, so every payload's block comes back through the
pool directory's released ring. Before the directory wrote its fields with one native
8-byte store, about one run in six failed here with ``ConfigurationError: ... corrupt
released ring (head 0, ...)``: ``struct.pack_into`` zero-fills its target before it
writes the value, and the sender read the ring head in that instant.
``tests/unit/test_cuda_ipc.py::test_a_field_being_written_never_reads_as_zero_in_another_process``
is the fast regression test; this script is the long-run check.

Usage: ``python benchmarks/stress_cuda_ipc_ring.py [N] [--runs R]``; exit status 1 when
a run failed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.environ.get("TREE", os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _worker(role: str, ch: str, n: int, bar, q) -> None:
    import torch

    from tests.cuda_ipc_double import HostCudaIpc

    if role == "receiver":
        c = HostCudaIpc(channel=ch, role="receiver", pool_bytes=64 << 20)
    else:
        c = HostCudaIpc(channel=ch, role="sender", linger=5.0)
    src = torch.randn(2048).to(torch.bfloat16)
    bar.wait()
    try:
        for i in range(n):
            if role == "sender":
                c.put(f"p{i}", {"hidden_states.output": src, "meta": {"finished": False}}, timeout=10)
            else:
                got = c.get(f"p{i}", timeout=10)
                del got
        q.put((role, "ok"))
    except BaseException as exc:  # the failure this script looks for
        q.put((role, f"{type(exc).__name__}: {exc}"))
    bar.wait()
    c.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", nargs="?", type=int, default=30000)
    ap.add_argument("--runs", type=int, default=6)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    failed = 0
    for r in range(args.runs):
        ch = f"stress/{os.getpid()}-{r}"
        bar, q = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(role, ch, args.n, bar, q)) for role in ("receiver", "sender")]
        procs[0].start()
        time.sleep(1.0)
        procs[1].start()
        got = dict(q.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        ok = got.get("sender") == "ok" and got.get("receiver") == "ok"
        failed += not ok
        print(f"run {r}: {'ok' if ok else got.get('sender')}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
