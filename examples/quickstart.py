"""Quickstart: encode a vLLM-Omni-shaped payload, then move it between two processes.

Shows: ``omnilink.encode`` / ``decode`` (zero-copy views), and the ``shm`` connector
carrying a thinker -> talker payload from a spawned sender process to this receiver.
Run: ``python examples/quickstart.py``.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import numpy as np
import torch

import omnilink

CHANNEL = "quickstart/thinker-talker"


def make_payload(i: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(i)
    return {
        "hidden_states.output": torch.randn(32, 256, generator=g).bfloat16(),
        "ids.output": torch.arange(i, i + 8),
        "meta": {"finished": torch.tensor(i == 2)},
        "speaker": "Ethan",
    }


def sender() -> None:
    # No arena_bytes: the arena is sized to fit /dev/shm (128 MiB, or less in a small
    # container) and grows when receivers hold on to what they got.
    with omnilink.connect("shm", channel=CHANNEL, role="sender") as tx:
        for i in range(3):
            tx.put(f"req7_0_{i}", make_payload(i), timeout=30.0)
        # Stay alive until the receiver says it has read everything: payloads live in
        # this process's arena.
        with omnilink.connect("shm", channel=CHANNEL + "-ack", role="receiver") as ack:
            ack.get("done", timeout=60.0)


def main() -> None:
    # 1. The wire format on its own.
    payload = make_payload(0)
    frame = bytearray(omnilink.encoded_size(payload))
    omnilink.encode_into(payload, frame)
    out = omnilink.decode(frame)
    assert torch.equal(out["hidden_states.output"], payload["hidden_states.output"])
    base = np.frombuffer(frame, dtype=np.uint8).ctypes.data
    assert base <= out["hidden_states.output"].data_ptr() < base + len(frame), "decode copied"

    # 2. Across processes over shared memory.
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=sender, daemon=True)
    with omnilink.connect("shm", channel=CHANNEL, role="receiver") as rx, \
         omnilink.connect("shm", channel=CHANNEL + "-ack", role="sender") as ack:
        proc.start()
        try:
            for i in range(3):
                got = rx.get(f"req7_0_{i}", timeout=60.0)
                want = make_payload(i)
                assert torch.equal(got["hidden_states.output"], want["hidden_states.output"])
                assert got["ids.output"].tolist() == want["ids.output"].tolist()
                assert bool(got["meta"]["finished"]) == (i == 2)
                del got
            ack.put("done", {}, timeout=30.0)
            proc.join(60)
            assert proc.exitcode == 0, f"sender exited with {proc.exitcode}"
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    print("quickstart: ok")


if __name__ == "__main__":
    main()
