"""How fast NIXL itself moves a large GPU payload between two processes, and what
registering the source per write costs: the floor under the ``nixl`` backend's large
payloads, beside an in-process peer copy.

Two processes, cuda:0 -> cuda:1 (NVLink), NIXL's UCX backend with ``UCX_TLS`` as set in
the environment; one payload at a time, timed on the sender from posting the WRITE to
the receiver's answer (a pipe) after it saw the WRITE's notification:

- ``split N``: one WRITE request of ``--size`` bytes whose descriptor lists cut the
  transfer into N equal pieces (does UCX move pieces concurrently?);
- ``register+write+deregister``: a fresh tensor per payload (as a stage's output is),
  registered with the agent, written, deregistered (what writing from the caller's
  memory instead of a registered staging buffer costs), at ``--size`` and 4 MiB;
- ``peer copy``: ``dst.copy_(src)`` across the GPUs in one process with peer access,
  synchronized; and the same as two halves on two streams.

    python benchmarks/gpu/nixl_write_floor.py [--size 256MiB] [--splits 1,2,4,8,16] [--rounds 30]

Needs two GPUs, torch and NIXL (``pip install "pyomnilink[nixl]"``); for finding the
floor, not for published figures (``bench_nixl.py`` makes those).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_nixl import raw_write_pieces  # noqa: E402  (the benchmark's raw floor, split into pieces)
from omnilink._bench.units import parse_size  # noqa: E402

WARM = 3


def _receiver(size: int, pipe: Any) -> None:
    import torch

    from omnilink.connectors.nixl.agent import Agent

    torch.cuda.set_device(1)
    agent = Agent(f"floor-rx-{os.getpid()}")
    dst = torch.empty(size, dtype=torch.uint8, device="cuda:1")
    agent.register(dst.data_ptr(), size, "VRAM", 1)
    pipe.send((agent.metadata(), dst.data_ptr()))
    seen: set[bytes] = set()
    try:
        while True:
            key = pipe.recv()
            if key is None:
                break
            want = key.encode()
            while want not in seen:
                for msgs in agent._agent.getNotifs({}, [agent._ucx]).values():
                    seen.update(bytes(m) for m in msgs)
            seen.discard(want)
            pipe.send(1)
    finally:
        agent.close()


def _write(agent: Any, peer: str, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]],
           key: str) -> None:
    raw_write_pieces(agent, peer, "VRAM", local, "VRAM", remote, key)


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--splits", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    import torch

    from omnilink.connectors.nixl.agent import Agent

    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(size, child), daemon=True)
    proc.start()
    torch.cuda.set_device(0)
    agent = Agent(f"floor-tx-{os.getpid()}")
    src = torch.empty(size, dtype=torch.uint8, device="cuda:0").fill_(3)
    agent.register(src.data_ptr(), size, "VRAM", 0)
    metadata, raddr = pipe.recv()
    peer = agent.add_remote(metadata)
    print(f"# {torch.cuda.get_device_name(0)} x2, UCX_TLS={os.environ.get('UCX_TLS', 'default')}, "
          f"{size >> 20} MiB, p50 of {args.rounds}")
    try:
        for n in (int(x) for x in args.splits.split(",")):
            piece = size // n
            local = [(src.data_ptr() + i * piece, piece, 0) for i in range(n)]
            remote = [(raddr + i * piece, piece, 1) for i in range(n)]
            ts = []
            for r in range(args.rounds + WARM):
                key = f"split{n}-{r}"
                pipe.send(key)
                t0 = time.perf_counter()
                _write(agent, peer, local, remote, key)
                pipe.recv()
                if r >= WARM:
                    ts.append(time.perf_counter() - t0)
            m = _p50(ts)
            print(f"split {n:3d}: {m:8.1f} us  {size / m / 1e3:6.1f} GB/s")
        for nbytes in (size, 4 << 20):
            ts, regs, deregs = [], [], []
            for r in range(args.rounds + WARM):
                t = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
                key = f"reg{nbytes}-{r}"
                pipe.send(key)
                t0 = time.perf_counter()
                descs = agent.register(t.data_ptr(), nbytes, "VRAM", 0)
                t1 = time.perf_counter()
                _write(agent, peer, [(t.data_ptr(), nbytes, 0)], [(raddr, nbytes, 1)], key)
                pipe.recv()
                t2 = time.perf_counter()
                agent.deregister(descs)
                t3 = time.perf_counter()
                del t
                if r >= WARM:
                    ts.append(t3 - t0)
                    regs.append(t1 - t0)
                    deregs.append(t3 - t2)
            print(f"register+write+deregister {nbytes >> 20} MiB: {_p50(ts):8.1f} us "
                  f"(register {_p50(regs):.1f}, deregister {_p50(deregs):.1f})")
        pipe.send(None)
        proc.join(30)
        dst = torch.empty(size, dtype=torch.uint8, device="cuda:1")
        ts = []
        for r in range(args.rounds + WARM):
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize(1)
            torch.cuda.synchronize(0)
            if r >= WARM:
                ts.append(time.perf_counter() - t0)
        print(f"peer copy: {_p50(ts):8.1f} us  {size / _p50(ts) / 1e3:6.1f} GB/s")
        s1, s2 = torch.cuda.Stream(0), torch.cuda.Stream(0)
        half = size // 2
        ts = []
        for r in range(args.rounds + WARM):
            t0 = time.perf_counter()
            with torch.cuda.stream(s1):
                dst[:half].copy_(src[:half])
            with torch.cuda.stream(s2):
                dst[half:].copy_(src[half:])
            s1.synchronize()
            s2.synchronize()
            if r >= WARM:
                ts.append(time.perf_counter() - t0)
        print(f"peer copy, 2 streams: {_p50(ts):8.1f} us  {size / _p50(ts) / 1e3:6.1f} GB/s")
    finally:
        if proc.is_alive():
            proc.kill()
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
