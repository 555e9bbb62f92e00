"""What one message's operations cost on this machine, one at a time, in one process.

The fixed cost of a GPU message is a sum of small things: the interpreter's own speed,
each CUDA runtime call the road makes (a ``cudaMemcpyAsync``, an event record, a stream
wait, an event query, a new event), each tensor torch builds over foreign memory, and the
Python the road runs (``tensor_blob`` prepare of a vLLM-Omni-shaped payload). This
script times each of them with ``timeit`` (warm caches, no second process: a lower bound
of what a serial consumer pays) so that a two-process timeline
(``bench_serial_gpu.py --trace``) can be read against them, and so that two machines can
be compared (the first line, a pure-Python loop, is the interpreter's speed).

    python benchmarks/gpu/call_costs.py [--json FILE]   # on a CUDA machine; MPS or not alike

``--cold MS`` also times each operation once after the thread slept MS milliseconds
(a stage idle between chunks), round after round over all operations (``--rounds``),
and prints the median beside the warm figure: a message that follows a pause runs its
code cold (caches, branch predictors, the core's clock), which on the device VMs
costs two to ten times the warm figure, and more for some calls than for others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import timeit
import weakref
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def measure(number: int = 2000, cold_ms: float = 0.0, rounds: int = 50) -> list[dict[str, Any]]:
    """``[{"op": ..., "us": ...}]``: the mean time of each operation over ``number`` calls
    (and with ``cold_ms``, ``"cold_us"``: the median of ``rounds`` single calls, each
    after a sleep of ``cold_ms`` milliseconds)."""
    import time

    import posix_ipc
    import torch

    from omnilink.blob import encoded_size, prepare
    from omnilink.connectors.devpool.ops import _Lease
    from omnilink.cuda import cuda_ops

    torch.cuda.set_device(0)
    ops = cuda_ops()
    rt = ops.rt
    h = torch.randn(2048, device="cuda").to(torch.bfloat16)
    payload = {"hidden_states.output": h, "ids.output": torch.arange(16),
               "meta": {"finished": torch.tensor(False), "request_id": "req-7", "chunk_id": 5}}
    message = {"d": [1, 2, 3, 0, 4096, [[9, 0, 4096, [2048], ["hidden_states.output"]]]],
               "h": {**payload, "hidden_states.output": None}, "n": 5000}
    pool = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    stream = int(torch.cuda.current_stream().cuda_stream)
    ipc_event = ops.check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming | rt.cudaEventInterprocess), "event")
    done_event = ops.check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "event")
    rt.cudaEventRecord(done_event, stream)
    sem = posix_ipc.Semaphore(f"/omnilink-call-costs-{os.getpid()}", posix_ipc.O_CREX, mode=0o600)
    from omnilink._util import PeerWatch
    from omnilink.connectors.devpool import CudaDeviceOps
    from omnilink.connectors.devpool.manifest import split

    dops = CudaDeviceOps()
    pinned = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    peers = PeerWatch()
    parent = os.getppid()
    d2d = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    dev = torch.device("cuda", 0)
    env = {"torch": torch, "prepare": prepare, "encoded_size": encoded_size, "payload": payload,
           "message": message, "rt": rt, "ops": ops, "pool": pool, "h": h, "stream": stream, "d2d": d2d,
           "ipc_event": ipc_event, "done_event": done_event, "_Lease": _Lease, "dev": dev, "weakref": weakref,
           "sem": sem, "dops": dops, "pinned": pinned, "split": split, "peers": peers, "parent": parent,
           "os": os}
    cases = [
        ("python: sum(range(1000))", "sum(range(1000))"),
        ("tensor_blob prepare of the payload (CUDA hidden state, CPU ids and flag, metadata)", "prepare(payload)"),
        ("encoded_size of the payload", "encoded_size(payload)"),
        ("tensor_blob prepare of a cuda_ipc message of it", "prepare(message)"),
        ("cudaGetDevice", "rt.cudaGetDevice()"),
        ("torch: current raw stream", "torch._C._cuda_getCurrentRawStream(0)"),
        ("cudaMemcpyAsync 4 KiB device to device", "rt.cudaMemcpyAsync(pool.data_ptr(), h.data_ptr(), 4096, d2d, stream)"),
        ("cudaEventRecord (interprocess event)", "rt.cudaEventRecord(ipc_event, stream)"),
        ("cudaStreamWaitEvent", "rt.cudaStreamWaitEvent(stream, ipc_event, 0)"),
        ("cudaEventQuery (completed)", "rt.cudaEventQuery(done_event)"),
        ("cudaEventSynchronize (completed)", "rt.cudaEventSynchronize(done_event)"),
        ("cudaStreamQuery (idle stream)", "rt.cudaStreamQuery(stream)"),
        ("cudaMemcpyAsync 256 B page-locked host to device",
         "rt.cudaMemcpyAsync(pool.data_ptr(), pinned.data_ptr(), 256, ops.kind_default, stream)"),
        ("swap_device + restore_device (already current)", "ops.restore_device(ops.swap_device(0))"),
        ("CudaDeviceOps.view (a pool block as a uint8 tensor + its lease)", "dops.view(pool.data_ptr(), 4096, 0)"),
        ("devpool split of the payload (host part, device tensors)", "split(payload, dops.is_device_tensor, torch.Tensor)"),
        ("PeerWatch.alive (pidfd poll)", "peers.alive(parent)"),
        ("os.sched_yield", "os.sched_yield()"),
        ("torch.cuda.Event() + record", "torch.cuda.Event().record()"),
        ("torch.as_tensor over foreign device memory (__cuda_array_interface__)",
         "torch.as_tensor(_Lease(pool.data_ptr(), 4096), device=dev)"),
        ("view(dtype) + as_strided of a device tensor", "pool.view(torch.bfloat16).as_strided((2048,), (1,), 0)"),
        ("weakref.finalize", "weakref.finalize(_Lease(1, 2), int)"),
        ("POSIX semaphore post + take (uncontended)", "sem.release(); sem.acquire()"),
        ("torch.cuda.synchronize (idle)", "torch.cuda.synchronize()"),
        ("torch.empty 4 KiB bf16 on the device", "torch.empty(2048, dtype=torch.bfloat16, device=dev)"),
        ("view(torch.uint8) of a device tensor", "h.view(torch.uint8)"),
        ("record_stream of a new device tensor", "torch.empty(2048, dtype=torch.bfloat16, device=dev).record_stream(side)"),
    ]
    from omnilink.connectors.nccl.wire import plan_send

    cases.append(("nccl plan_send of a 4 KiB hidden state and a flag (its plan cached)",
                  "plan_send(p4, device=dev, nccl=True, inline_bytes=65536, max_inline_total=1 << 20, key='k', "
                  "pack_bytes=1 << 20, pad=pad)"))
    env.update(side=torch.cuda.Stream(dev), plan_send=plan_send,
               p4={"hidden_states.output": h, "meta": {"finished": False}},
               pad=torch.zeros(64, dtype=torch.uint8, device=dev))
    out = []
    try:
        torch.cuda.synchronize()
        for name, stmt in cases:
            n = number // 2 if "cuda" in stmt.lower() or "rt." in stmt else number
            us = timeit.timeit(stmt, number=n, globals=env) / n * 1e6
            out.append({"op": name, "stmt": stmt, "us": us})
        torch.cuda.synchronize()
        if cold_ms:
            import statistics

            code = [compile(stmt, "<op>", "exec") for _name, stmt in cases]
            clock = time.perf_counter_ns
            samples: list[list[int]] = [[] for _ in cases]
            for _ in range(rounds):
                for i, c in enumerate(code):
                    time.sleep(cold_ms / 1e3)
                    t0 = clock()
                    exec(c, env)
                    samples[i].append(clock() - t0)
                torch.cuda.synchronize()
            for row, xs in zip(out, samples):
                row["cold_us"] = statistics.median(xs) / 1e3
    finally:
        sem.unlink()
        rt.cudaEventDestroy(ipc_event)
        rt.cudaEventDestroy(done_event)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cold", type=float, default=0.0, metavar="MS",
                    help="also time each operation once after a sleep of MS milliseconds (median of --rounds)")
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args(argv)
    import torch

    rows = measure(args.number, args.cold, args.rounds)
    from omnilink.cuda import mps_serving

    mps = mps_serving()
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, MPS {'on' if mps else 'off'}")
    if args.cold:
        print(f"# warm: mean of repeated calls; after {args.cold:g} ms asleep: median of {args.rounds} single calls")
    for r in rows:
        cold = f"{r['cold_us']:9.2f} us  " if "cold_us" in r else ""
        print(f"{r['us']:9.2f} us  {cold}{r['op']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "mps": mps,
                       "cold_ms": args.cold, "rounds": args.rounds, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
