"""The ``Scenario`` record every scenario module fills in."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Scenario"]


@dataclass(frozen=True)
class Scenario:
    """What a scenario measures: its backends, where payloads live, and its references.

    ``reference`` is the baseline of the "x pickle" ratio column and ``ceiling`` the
    physical limit of the "of ceiling" column.
    """

    name: str
    description: str
    backends: tuple[str, ...]
    reference: str
    ceiling: str
    payload_device: str = "cpu"
    recv_device: str | None = None
    needs_cuda: bool = False
