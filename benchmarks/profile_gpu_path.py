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
    args = ap.parse_args()
    import torch

    import omnilink

    ch = f"prof/{uuid.uuid4().hex[:6]}"
    x = torch.randint(0, 255, (args.size,), dtype=torch.uint8, device="cpu" if args.cpu else "cuda")
    dev = None if args.cpu else "cuda:0"
    with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=256 << 20, linger=0) as tx, \
            omnilink.connect("shm", channel=ch, role="receiver") as rx:
        def once(i: int) -> None:
            tx.put(f"k{i}", {"x": x, "meta": {"i": i}}, timeout=10)
            got = rx.get(f"k{i}", timeout=10, device=dev)
            del got

        for i in range(200):
            once(i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(args.n):
            once(i)
        torch.cuda.synchronize()
        per = (time.perf_counter() - t0) / args.n
        prof = cProfile.Profile()
        prof.enable()
        for i in range(args.n):
            once(i)
        torch.cuda.synchronize()
        prof.disable()
    print(f"size {args.size}: {per * 1e6:.1f} us per put + device get (no profiler)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
