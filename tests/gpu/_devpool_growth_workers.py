"""Child-process bodies of the device pool's growth GPU tests (importable for ``spawn``)."""

from __future__ import annotations

import json
import os
import time

MIB = 1 << 20


def _write(path: str, rec: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, path)


def big(n_mib: int, fill: int, device: str):
    import torch

    return torch.full((n_mib * MIB,), fill, dtype=torch.uint8, device=device)


def growth_sender(channel: str, out: str, n: int, n_mib: int) -> None:
    """Put ``n`` payloads of ``n_mib`` MiB each on cuda:0, then an unread one; report and
    wait to be killed (or exit when ``out + '.done'`` appears)."""
    import omnilink

    with omnilink.connect("cuda_ipc", channel=channel, role="sender", linger=0) as tx:
        for i in range(n):
            tx.put(f"k{i}", {"x": big(n_mib, i + 1, "cuda:0")}, timeout=120)
        tx.put("unread", {"x": big(1, 99, "cuda:0")}, timeout=120)
        _write(out, {"pid": os.getpid(), "stats": tx.stats().device_puts})
        deadline = time.monotonic() + 600
        while not os.path.exists(out + ".done") and time.monotonic() < deadline:
            time.sleep(0.05)


def growth_receiver(channel: str, out: str, pool_bytes: int, n_mib: int) -> None:
    """Open a pool of ``pool_bytes`` on cuda:0, get one payload larger than it, hold it,
    report the pool's segments; wait to be killed."""
    import torch

    import omnilink

    with omnilink.connect("cuda_ipc", channel=channel, role="receiver", device="cuda:0",
                          pool_bytes=pool_bytes) as rx:
        got = rx.get("k0", timeout=120)
        ok = bool(torch.equal(got["x"], big(n_mib, 1, "cuda:0")))
        st = rx.stats()
        _write(out, {"pid": os.getpid(), "ok": ok, "segments": st.pool_segments, "bytes": st.pool_bytes_now})
        time.sleep(600)  # killed by the test
