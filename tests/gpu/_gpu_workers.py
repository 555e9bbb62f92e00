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
    with omnilink.connect("shm", channel=channel, role="sender", arena_bytes=arena, linger=30,
                          device_ipc="off") as tx:
        tx.put(key, {"x": x, "meta": {"seed": seed}}, timeout=60)
        time.sleep(hold)


def receiver_holding(channel: str, key: str, ready_path: str) -> None:
    import torch

    import omnilink

    with omnilink.connect("shm", channel=channel, role="receiver", device_ipc="off") as rx:
        got = rx.get(key, timeout=60, device="cuda:0")
        torch.cuda.synchronize()
        assert got["x"].is_cuda
        with open(ready_path, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)  # killed by the test


def ipc_sender(channel: str, n: int, nbytes: int) -> None:
    import torch

    import omnilink

    torch.cuda.init()
    with omnilink.connect("shm", channel=channel, role="sender", arena_bytes=64 << 20, linger=30,
                          device_ipc="on") as tx:
        deadline = time.monotonic() + 60
        from omnilink.connectors.cuda_ipc import live_pool_owner

        while live_pool_owner(channel) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        for i in range(n):
            x = torch.full((nbytes,), i % 251, dtype=torch.uint8, device="cuda")
            tx.put(f"m{i}", {"x": x, "i": i}, timeout=60)
        assert tx.stats().ipc_puts == n, tx.stats()


def ipc_receiver_holding(channel: str, ready_path: str) -> None:
    import torch

    import omnilink

    with omnilink.connect("shm", channel=channel, role="receiver", device_ipc="on") as rx:
        got = rx.get("k0", timeout=60, device="cuda:0")  # a view of its pool, held
        torch.cuda.synchronize()
        assert rx.stats().ipc_gets == 1
        with open(ready_path, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)  # killed by the test
        del got
