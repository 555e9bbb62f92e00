"""Process bodies for the nccl-backend tests (importable, so ``spawn`` can run them).

Used by tests/integration/test_nccl_processes.py (gloo on CPU) and
tests/gpu/test_nccl_gpu.py (NCCL, one process per GPU). Workers report through a
``multiprocessing`` queue with plain tuples; payload contents are compared by SHA-256
of their bytes, so a half or mixed-up payload shows.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

WAIT = 60.0


def free_port() -> int:
    """A port for a TCPStore, below the ephemeral range (``omnilink._bench.ports``)."""
    from omnilink._bench.ports import free_ports

    return free_ports(1)[0]


def make_payload(i: int, nbytes: int, device: str = "cpu") -> dict[str, Any]:
    """Several tensors (bf16 among them) plus plain metadata, deterministic in ``i``."""
    import torch

    g = torch.Generator().manual_seed(1000 + i)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    hidden = raw[: nbytes - nbytes % 2].view(torch.bfloat16).reshape(-1, 2) if nbytes >= 4 else raw
    return {
        "hidden_states.output": hidden.to(device),
        "embed.prefill": torch.randn(7, 33, generator=g).to(torch.bfloat16).to(device),
        "ids.output": torch.arange(i, i + 17, dtype=torch.int64).to(device),
        "meta.finished": torch.tensor(i % 2 == 0),
        "meta": {"i": i, "speaker": "s1"},
    }


def digest(payload: dict[str, Any]) -> str:
    import torch

    h = hashlib.sha256()
    for name in ("hidden_states.output", "embed.prefill", "ids.output", "meta.finished"):
        t = payload[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(repr(sorted(payload["meta"].items())).encode())
    return h.hexdigest()


def _dump_if_hung() -> None:
    """A worker still running after 100 s (the tests wait 120 s for its reports) prints
    every thread's Python stack and exits: a hang fails with a diagnostic."""
    import faulthandler

    faulthandler.dump_traceback_later(100.0, exit=True)


def sender(port: int, channel: str, backend: str, device: str, count: int, nbytes: int, out: Any) -> None:
    """Rank 0: host the store, put ``count`` payloads, report each digest, close."""
    _dump_if_hung()
    import omnilink

    try:
        with omnilink.connect(
            "nccl", channel=channel, role="sender", backend=backend, device=device,
            master_port=port, timeout=WAIT,
        ) as tx:
            for i in range(count):
                payload = make_payload(i, nbytes, device)
                tx.put(f"req{i}_0_0", payload)
                out.put(("sent", f"req{i}_0_0", digest(payload)))
            out.put(("sender-done", os.getpid(), None))
    except Exception as exc:  # reported to the test, which fails with it
        out.put(("error", type(exc).__name__, str(exc)))


def receiver(port: int, channel: str, backend: str, device: str, keys: list[str], out: Any) -> None:
    """Rank 1: get each key (in the order given), report digest and device."""
    _dump_if_hung()
    import omnilink

    try:
        with omnilink.connect(
            "nccl", channel=channel, role="receiver", backend=backend, device=device,
            master_port=port, timeout=WAIT,
        ) as rx:
            for key in keys:
                got = rx.get(key)
                out.put(("got", key, digest(got), str(got["hidden_states.output"].device),
                         str(got["meta.finished"].device)))
    except Exception as exc:
        out.put(("error", type(exc).__name__, str(exc)))


def doomed_sender(port: int, channel: str, nbytes: int, out: Any) -> None:
    """Rank 0 that puts one payload, reports, then waits to be killed (never closes)."""
    import threading

    import omnilink

    tx = omnilink.connect("nccl", channel=channel, role="sender", backend="gloo", master_port=port, timeout=WAIT)
    tx.put("first", make_payload(0, nbytes))
    out.put(("put", "first", None))
    threading.Event().wait(WAIT)


def doomed_receiver(port: int, channel: str, out: Any) -> None:
    """Rank 1 that connects, reports, then waits to be killed."""
    import threading

    import omnilink

    rx = omnilink.connect("nccl", channel=channel, role="receiver", backend="gloo", master_port=port, timeout=WAIT)
    rx.wait_connected()
    out.put(("connected", os.getpid(), None))
    threading.Event().wait(WAIT)


def streaming_sender(port: int, channel: str, out: Any) -> None:
    """Rank 0 that puts payloads back to back until it is killed: odd ones need the
    bulk group (256 KiB), even ones ride the doorbell whole; it reports each put."""
    _dump_if_hung()
    import omnilink

    try:
        with omnilink.connect("nccl", channel=channel, role="sender", backend="gloo", master_port=port,
                              timeout=WAIT, send_window=8) as tx:
            i = 0
            while True:
                payload = make_payload(i, (256 << 10) if i % 2 else 1024)
                tx.put(f"s{i}", payload)
                out.put(("put", f"s{i}", digest(payload)))
                i += 1
    except Exception as exc:
        out.put(("error", type(exc).__name__, str(exc)))


def stuck_send_sender(port: int, channel: str, out: Any, go: Any) -> None:
    """Rank 0 on cuda:0 over NCCL: once told (the receiver is frozen), put a 64 MiB
    payload whose NCCL send cannot complete, report, and wait for the receiver to be
    killed; then report what ``put``/``close`` raised and whether cuda:0's stream, which
    held the send, finished within 30 s (the link's abort must end the send)."""
    _dump_if_hung()
    import threading
    import time

    import torch

    import omnilink
    from omnilink import PeerLostError

    try:
        tx = omnilink.connect("nccl", channel=channel, role="sender", backend="nccl", device="cuda:0",
                              master_port=port, timeout=WAIT, bell_bytes=0)
        tx.wait_connected(WAIT)
        out.put(("connected", os.getpid(), None))
        go.get(timeout=WAIT)  # the receiver is frozen now
        tx.put("big", {"t": torch.ones(32 << 20, dtype=torch.bfloat16, device="cuda:0")}, timeout=WAIT)
        out.put(("put", "big", None))
        go.get(timeout=WAIT)  # the receiver is dead now
        t0 = time.monotonic()
        lost = None
        while time.monotonic() - t0 < 30:
            try:
                tx.put("next", {"t": torch.ones(8, device="cuda:0")}, timeout=5.0)
            except PeerLostError as exc:
                lost = str(exc)
                break
            except omnilink.TransferTimeout:
                continue
            time.sleep(0.05)
        tx.close()
        done = threading.Event()
        threading.Thread(target=lambda: (torch.cuda.synchronize("cuda:0"), done.set()), daemon=True).start()
        out.put(("result", lost, done.wait(30.0)))
    except Exception as exc:  # reported to the test, which fails with it
        out.put(("error", type(exc).__name__, str(exc)))


def frozen_receiver(port: int, channel: str, out: Any) -> None:
    """Rank 1 on cuda:1 over NCCL that connects, reports, and waits (the test stops it
    with SIGSTOP, then kills it)."""
    import threading

    import omnilink

    rx = omnilink.connect("nccl", channel=channel, role="receiver", backend="nccl", device="cuda:1",
                          master_port=port, timeout=WAIT)
    rx.wait_connected(WAIT)
    out.put(("connected", os.getpid(), None))
    threading.Event().wait(WAIT)
