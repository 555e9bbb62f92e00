"""How many messages a measured run of one cell sends, and how many may be in flight."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Plan", "plan"]

MiB = 1 << 20


@dataclass(frozen=True)
class Plan:
    count: int  # messages per run
    window: int  # messages in flight
    warmup: int  # messages in the warm-up run


def plan(size: int, mode: str) -> Plan:
    """Messages per run, messages in flight and warm-up length for one cell.

    Bursts carry about 64 MiB (2 to 200 messages); at most 512 MiB is in flight (so a
    256 MiB run keeps two messages in flight and ``/dev/shm`` is never flooded).
    Latency runs send up to 100 small messages, one at a time, and a single one from
    64 MiB up (where a baseline message takes seconds). The warm-up (once per backend
    and size) is a quarter of a throughput burst.
    """
    tp_count = max(2, min(200, (64 * MiB) // size))
    if mode == "throughput":
        count = tp_count
        window = max(1, min(8, (512 * MiB) // size))
    else:
        count = max(1, min(100, (32 * MiB) // size))
        window = 1
    return Plan(count=count, window=window, warmup=max(1, tp_count // 4))
