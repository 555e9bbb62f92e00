"""Profile of the shm GPU path's fixed cost per message (one process, sender and receiver).

``python benchmarks/profile_gpu_path.py [--size 4096] [--n 2000]``: cProfile's top lines
for ``put`` of a CUDA payload plus ``get(..., device="cuda:0")``, and the mean time per
round. For finding the Python overhead per message, not for figures to quote.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--cpu", action="store_true", help="CPU tensors and a host get (the baseline)")
    ap.add_argument("--two-process", action="store_true", help="sender in a child process, both profiled")
    args = ap.parse_args()
    if args.two_process:
        two_process(args.size, args.n)
        return 0
    import torch

    import omnilink

    ch = f"prof/{uuid.uuid4().hex[:6]}"
    x = torch.randint(0, 255, (args.size,), dtype=torch.uint8, device="cpu" if args.cpu else "cuda")
    dev = None if args.cpu else "cuda:0"
    with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=256 << 20, linger=0, device_ipc="off") as tx, \
            omnilink.connect("shm", channel=ch, role="receiver", device_ipc="off") as rx:
        def once(i: int, phase: str) -> None:
            # A key is delivered once: each phase uses keys of its own.
            tx.put(f"{phase}{i}", {"x": x, "meta": {"i": i}}, timeout=10)
            got = rx.get(f"{phase}{i}", timeout=10, device=dev)
            del got

        for i in range(200):
            once(i, "w")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(args.n):
            once(i, "t")
        torch.cuda.synchronize()
        per = (time.perf_counter() - t0) / args.n
        prof = cProfile.Profile()
        prof.enable()
        for i in range(args.n):
            once(i, "p")
        torch.cuda.synchronize()
        prof.disable()
    print(f"size {args.size}: {per * 1e6:.1f} us per put + device get (no profiler)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    return 0




def _sender(channel: str, size: int, n: int, q) -> None:
    import cProfile as _cp
    import pstats as _ps
    import io

    import torch

    import omnilink

    x = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
    with omnilink.connect("shm", channel=channel, role="sender", arena_bytes=1 << 30, linger=30, device_ipc="off") as tx:
        for i in range(200):
            tx.put(f"w{i}", {"x": x}, timeout=60)
        prof = _cp.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for i in range(n):
            tx.put(f"k{i}", {"x": x}, timeout=60)
        prof.disable()
        per = (time.perf_counter() - t0) / n
        out = io.StringIO()
        _ps.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        q.put((per, out.getvalue()))
        time.sleep(5)


def two_process(size: int, n: int) -> None:
    """Sender in a child, receiver here, both profiled: where a message's time goes."""
    import multiprocessing as mp

    import torch

    import omnilink

    ch = f"prof2/{uuid.uuid4().hex[:6]}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with omnilink.connect("shm", channel=ch, role="receiver", device_ipc="off") as rx:
        p = ctx.Process(target=_sender, args=(ch, size, n, q), daemon=True)
        p.start()
        for i in range(200):
            rx.get(f"w{i}", timeout=120, device="cuda:0")
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for i in range(n):
            got = rx.get(f"k{i}", timeout=60, device="cuda:0")
            del got
        prof.disable()
        torch.cuda.synchronize()
        per = (time.perf_counter() - t0) / n
        sper, sprof = q.get(timeout=120)
        p.join(30)
    print(f"two processes, {size} bytes: receiver {per * 1e6:.1f} us/message (profiled), sender put {sper * 1e6:.1f} us")
    print("--- receiver")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print("--- sender")
    print(sprof)


if __name__ == "__main__":
    sys.exit(main())
