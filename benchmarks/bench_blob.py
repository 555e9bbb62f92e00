"""tensor_blob encode+decode against the codecs engines use today.

Benchmarks are hard: this measures one process on one machine, CPU tensors, buffers
pre-allocated and pre-faulted (as an omnilink SHM arena is), medians of repeated runs.
It compares, for a vLLM-Omni-shaped payload holding one bf16 tensor of each size:

- ``omnilink``  ``encode_into`` a reused buffer + zero-copy ``decode``
- ``memcpy``    one single-threaded ``memmove`` of the tensor's bytes to where omnilink
                puts them (the floor: omnilink must cost <= 1.3x this at 16 MiB)
- ``pickle``    ``pickle.dumps(protocol=5)`` in-band + ``pickle.loads``
- ``msgpack``   msgspec msgpack with each tensor's bytes copied into the message
                (``tobytes``), decoded and copied back into a tensor

Usage: ``python benchmarks/bench_blob.py [--sizes 4KiB,1MiB,16MiB,256MiB] [--json FILE]``
"""

from __future__ import annotations

import argparse
import ctypes
import json
import pickle  # the baseline being measured, never omnilink's data path
import statistics
import sys
import time

import msgspec
import numpy as np
import torch

import omnilink
from omnilink._bench.machine import machine_record
from omnilink._bench.payload import make_payload
from omnilink._bench.units import format_size, parse_sizes






def timed(fn, repeat: int, max_seconds: float) -> float:
    fn()  # warm-up
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > max_seconds and len(times) >= 3:
            break
    return statistics.median(times)


class MsgpackCodec:
    """The engines' other path: tensor bytes copied into a msgpack message and back."""

    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder()

    def dumps(self, p):
        def conv(v):
            if isinstance(v, torch.Tensor):
                return {"__t__": str(v.dtype), "shape": list(v.shape),
                        "data": v.contiguous().view(torch.uint8).numpy().tobytes()}
            if isinstance(v, dict):
                return {k: conv(x) for k, x in v.items()}
            return v
        return self.enc.encode(conv(p))

    def loads(self, b):
        def conv(v):
            if isinstance(v, dict) and "__t__" in v:
                dt = getattr(torch, v["__t__"].split(".")[1])
                return torch.frombuffer(bytearray(v["data"]), dtype=torch.uint8).view(dt).view(v["shape"])
            if isinstance(v, dict):
                return {k: conv(x) for k, x in v.items()}
            return v
        return conv(self.dec.decode(b))


def run(sizes: list[int], repeat: int, max_seconds: float) -> list[dict]:
    records = []
    mp = MsgpackCodec()
    for size in sizes:
        p = make_payload(size)
        t = p["hidden_states.output"]
        tensor_bytes = t.numel() * t.element_size()
        prepared = omnilink.blob.prepare(p)
        buf = np.ones(prepared.nbytes, dtype=np.uint8)  # pre-faulted, like an SHM arena block
        # memcpy writes where omnilink writes the tensor: the same source and destination
        # addresses, so both pay the same (mis)alignment costs.
        src_addr, dst_addr = t.data_ptr(), buf.ctypes.data + prepared.data_offset

        def omni():
            omnilink.encode_into(p, buf)
            out = omnilink.decode(buf)
            return out["hidden_states.output"]

        cells = {
            "omnilink": omni,
            "memcpy": lambda: ctypes.memmove(dst_addr, src_addr, tensor_bytes),
            "pickle": lambda: pickle.loads(pickle.dumps(p, protocol=5)),
            "msgpack": lambda: mp.loads(mp.dumps(p)),
        }
        row = {}
        for name, fn in cells.items():
            reps = repeat if size <= (16 << 20) or name in ("omnilink", "memcpy") else max(3, repeat // 4)
            row[name] = timed(fn, reps, max_seconds)
        for name, sec in row.items():
            records.append({
                "scenario": "blob-codec", "backend": name, "mode": "throughput", "size_bytes": size,
                "seconds": sec, "gbps": tensor_bytes / sec / 1e9,
                "x_memcpy": sec / row["memcpy"], "pickle_over_this": row["pickle"] / sec,
            })
    return records


def table(records: list[dict]) -> str:
    lines = [f"{'size':>8} {'codec':>9} {'time':>11} {'GB/s':>8} {'cost/memcpy':>12} {'pickle/this':>12}"]
    for r in records:
        label = format_size(r["size_bytes"])
        lines.append(
            f"{label:>8} {r['backend']:>9} {r['seconds'] * 1e6:>9.1f}us {r['gbps']:>8.2f} "
            f"{r['x_memcpy']:>11.2f}x {r['pickle_over_this']:>11.1f}x"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4KiB,1MiB,16MiB,256MiB")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--max-seconds", type=float, default=8.0)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    sizes = parse_sizes(args.sizes)
    torch.set_num_threads(1)  # one core, like one memcpy: no thread-count advantage
    machine = machine_record()
    records = run(sizes, args.repeat, args.max_seconds)
    print(table(records))
    print(f"\nmachine: {machine.get('cpu')} | {machine.get('cores')} cores | torch {torch.__version__} "
          f"| python {sys.version.split()[0]}")
    print("benchmarks are hard: one process, pre-faulted buffers, medians; your payloads will differ.")
    if args.json:
        with open(args.json, "w") as fh:
            for r in records:
                fh.write(json.dumps({**r, "machine": machine}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
