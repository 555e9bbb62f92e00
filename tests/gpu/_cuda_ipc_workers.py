"""Child-process bodies of the cuda_ipc GPU tests (importable for ``spawn``)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

#: ~1 s of GPU time for torch.cuda._sleep on current parts (cycles at ~1.5-2 GHz)
LONG_SLEEP_CYCLES = 2_000_000_000


def mixed_payload(seed: int, device: str) -> dict[str, Any]:
    """What the sender puts and the receiver rebuilds to compare: bf16, ints, strided,
    a scalar, an empty tensor, a CPU tensor and metadata."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    return {
        "hidden": torch.randn(257, 1031, generator=g).to(torch.bfloat16).to(device),
        "ids": torch.randint(0, 1 << 30, (333,), generator=g).to(device),
        "strided": torch.randn(64, 48, generator=g).to(device).t(),
        "scalar": torch.tensor(2.5, device=device),
        "empty": torch.empty(0, 7, device=device),
        "cpu": torch.arange(11, dtype=torch.int16),
        "meta": {"seed": seed, "finished": True, "names": ["a", "b"]},
    }


def _write(path: str, rec: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, path)


def sender(channel: str, scenario: str, device: str, out: str) -> None:
    import torch

    import omnilink

    torch.cuda.set_device(torch.device(device))
    rec: dict[str, Any] = {"pid": os.getpid()}
    with omnilink.connect("cuda_ipc", channel=channel, role="sender", timeout=60.0, linger=30.0) as tx:
        if scenario in ("mixed", "kill_me", "again"):
            for seed in (1, 2, 3):
                tx.put(f"{'again' if scenario == 'again' else 'mixed'}-{seed}", mixed_payload(seed, device))
        if scenario == "overwrite":
            tx.put("warm", {"x": torch.zeros(1, device=device)})  # attach (maps the pool) first
            torch.cuda.synchronize()
            x = torch.empty(1 << 20, dtype=torch.float32, device=device)
            torch.cuda._sleep(LONG_SLEEP_CYCLES)  # the producer is still busy when put is called
            x.fill_(7.0)
            t0 = time.perf_counter()
            tx.put("ow", {"x": x})
            rec["put_s"] = time.perf_counter() - t0
            rec["stream_busy_after_put"] = not torch.cuda.current_stream().query()
            x.fill_(-1.0)  # overwrite at once: the copy must already have its bytes
            del x
            torch.cuda.synchronize()
        if scenario == "many":
            for i in range(64):
                n = 1 + (i * 7919) % (1 << 20)
                tx.put(f"many-{i}", {"x": torch.full((n,), i % 100, dtype=torch.uint8, device=device)})
        if scenario == "peer":
            ops = tx._ops
            tx.put("mixed-1", mixed_payload(1, device))
            rec["peers"] = sorted([list(p) for p in ops._peers])
        _write(out, rec)
        if scenario == "kill_me":
            time.sleep(600)  # killed by the test
        # close(): waits for the copies and for the receiver to read (linger)


def receiver_holding(channel: str, device: str, pool_bytes: int, out: str) -> None:
    import torch

    import omnilink

    torch.cuda.set_device(torch.device(device))
    rx = omnilink.connect("cuda_ipc", channel=channel, role="receiver", device=device, pool_bytes=pool_bytes)
    got = rx.get("mixed-1", timeout=60)
    torch.cuda.synchronize()
    _write(out, {"pid": os.getpid(), "ok": bool(torch.equal(got["cpu"], torch.arange(11, dtype=torch.int16)))})
    time.sleep(600)  # killed by the test
