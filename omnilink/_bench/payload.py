"""The payload every transport carries: a thinker -> talker message of vLLM-Omni.

``size_bytes`` is the size of the bf16 hidden-state tensor, the part that grows; the
rest is the small metadata a real chunk carries (see ``omnilink.integrations.vllm_omni``)::

    {
        "hidden_states.output": bf16 [rows, HIDDEN] (or [1, n] below one row),
        "hidden_states.output_shape": [rows, HIDDEN],
        "ids.output": int64 [16]   # ids[0] is the message's sequence number
        "meta": {"finished": False, "sent_ns": <sender's CLOCK_MONOTONIC stamp>},
        "speaker": "Ethan",
    }

Nothing here assumes CPU tensors: ``device`` places the tensors anywhere torch can.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["HIDDEN", "check_payload", "hidden_shape", "make_payload", "now_ns", "stamp"]

#: Hidden size of the thinker of a 7B omni model; a row is 4 KiB of bf16.
HIDDEN = 2048
_IDS = 16


def now_ns() -> int:
    """CLOCK_MONOTONIC in ns: one clock for every process of the host, so a stamp taken
    by the sender can be subtracted from the receiver's reading (one-way latency)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def hidden_shape(size_bytes: int) -> tuple[int, int]:
    """Shape of the bf16 hidden state of ``size_bytes`` bytes."""
    n = size_bytes // 2
    if n % HIDDEN == 0:
        return (n // HIDDEN, HIDDEN)
    return (1, n)


def make_payload(size_bytes: int, *, device: Any = "cpu") -> dict[str, Any]:
    """Build the payload of ``size_bytes`` of hidden state on ``device``.

    The hidden state is filled with a non-constant pattern so no transport can profit
    from zero pages.
    """
    import torch

    rows, cols = hidden_shape(size_bytes)
    hidden = torch.empty((rows, cols), dtype=torch.bfloat16, device=device)
    # Every row a ramp modulo 251 (exact in bf16): deterministic, non-zero, and cheap
    # to build at 256 MiB (one row is computed, then broadcast).
    row = torch.arange(cols, device=device, dtype=torch.int32).remainder_(251)
    hidden.copy_(row.expand(rows, cols))
    ids = torch.arange(_IDS, dtype=torch.int64, device=device)
    return {
        "hidden_states.output": hidden,
        "hidden_states.output_shape": [rows, cols],
        "ids.output": ids,
        "meta": {"finished": False, "sent_ns": 0},
        "speaker": "Ethan",
    }


def stamp(payload: dict[str, Any], seq: int) -> None:
    """Mark ``payload`` as message ``seq`` and take the send timestamp (just before the
    transport sees it, so serialisation is inside the measured one-way time)."""
    payload["ids.output"][0] = seq
    payload["meta"]["sent_ns"] = now_ns()


def check_payload(payload: Any, seq: int, size_bytes: int) -> None:
    """Raise ``RuntimeError`` unless ``payload`` is message ``seq`` of ``size_bytes``.

    Cheap on purpose (shape, dtype, one id, one element): it runs inside the timed loop
    to prove the right message arrived whole, not to checksum it.
    """
    import torch

    hidden = payload["hidden_states.output"]
    rows, cols = hidden_shape(size_bytes)
    if tuple(hidden.shape) != (rows, cols) or hidden.dtype != torch.bfloat16:
        raise RuntimeError(f"message {seq}: hidden state {tuple(hidden.shape)} {hidden.dtype}")
    got = int(payload["ids.output"][0])
    if got != seq:
        raise RuntimeError(f"expected message {seq}, got message {got}")
    if float(hidden[rows - 1, cols - 1]) != float((cols - 1) % 251):
        raise RuntimeError(f"message {seq}: hidden state corrupted")
    if payload["meta"]["finished"] is not False or payload["speaker"] != "Ethan":
        raise RuntimeError(f"message {seq}: metadata corrupted")
