"""Process bodies for the zmq integration tests (importable, so ``spawn`` can run them).

Each worker reports through a ``multiprocessing`` queue with plain tuples; payload
contents are checked by SHA-256 of their bytes, so a half or mixed-up payload shows.
"""

from __future__ import annotations

import hashlib
from typing import Any

WAIT = 30.0


def make_payload(i: int, nbytes: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 + i)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return {"data": data, "meta": {"i": i, "finished": i < 0}}


def digest(payload: dict[str, Any]) -> str:
    return hashlib.sha256(payload["data"].numpy().tobytes()).hexdigest()


def sender(channel: str, endpoint: str | None, ipc_dir: str | None, keys: list[str], nbytes: int, out: Any) -> None:
    """Put one payload per key, then report ("sent", key, digest) for each."""
    import omnilink

    with omnilink.connect("zmq", channel=channel, role="sender", endpoint=endpoint, ipc_dir=ipc_dir) as tx:
        for i, key in enumerate(keys):
            payload = make_payload(i, nbytes)
            tx.put(key, payload, timeout=WAIT)
            out.put(("sent", key, digest(payload)))
    out.put(("done", None, None))


def receiver(
    channel: str,
    ipc_dir: str | None,
    keys: list[str],
    out: Any,
    ready: Any,
    options: dict[str, Any],
) -> None:
    """Bind the channel, signal ``ready``, get ``keys`` in order and report each digest.

    With an empty ``keys`` list it holds the endpoint without reading, until killed.
    """
    import threading

    import omnilink

    rx = omnilink.connect("zmq", channel=channel, role="receiver", ipc_dir=ipc_dir, **options)
    try:
        ready.set()
        if not keys:
            threading.Event().wait(WAIT)
            return
        for key in keys:
            try:
                got = rx.get(key, timeout=WAIT)
            except Exception as exc:  # reported to the test
                out.put(("error", key, f"{type(exc).__name__}: {exc}"))
                return
            out.put(("got", key, digest(got)))
    finally:
        rx.close()


def endless_sender(
    channel: str, ipc_dir: str | None, nbytes: int, out: Any, options: dict[str, Any] | None = None
) -> None:
    """Put big payloads under keys big-0, big-1, ... until killed."""
    import omnilink

    tx = omnilink.connect("zmq", channel=channel, role="sender", ipc_dir=ipc_dir, **(options or {}))
    payloads = [make_payload(i, nbytes) for i in range(2)]
    digests = [digest(p) for p in payloads]
    i = 0
    while True:
        out.put(("putting", f"big-{i}", digests[i % 2]))
        tx.put(f"big-{i}", payloads[i % 2], timeout=WAIT)
        i += 1
