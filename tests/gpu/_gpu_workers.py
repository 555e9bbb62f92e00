"""Child-process bodies of the GPU tests (importable for ``spawn``)."""

from __future__ import annotations

import os
import time


def sender(channel: str, key: str, nbytes: int, seed: int, hold: float, arena: int) -> None:
    import torch

    import omnilink

    torch.cuda.init()
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
    with omnilink.connect("shm", channel=channel, role="sender", arena_bytes=arena, linger=30) as tx:
        tx.put(key, {"x": x, "meta": {"seed": seed}}, timeout=60)
        time.sleep(hold)


def receiver_holding(channel: str, key: str, ready_path: str) -> None:
    import torch

    import omnilink

    with omnilink.connect("shm", channel=channel, role="receiver") as rx:
        got = rx.get(key, timeout=60, device="cuda:0")
        torch.cuda.synchronize()
        assert got["x"].is_cuda
        with open(ready_path, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)  # killed by the test
