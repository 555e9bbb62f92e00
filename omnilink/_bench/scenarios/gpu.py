"""``gpu``: ``cuda:0`` -> host -> ``cuda:0`` between two processes (needs CUDA).

The transports beside single pinned and pageable host<->device copies of the same bytes
(the ceilings), measured in the parent process.
"""

from __future__ import annotations

from omnilink._bench.scenarios.base import Scenario

SCENARIO = Scenario(
    name="gpu",
    description="cuda:0 -> host -> cuda:0 between two processes",
    backends=("h2d-pinned", "h2d-pageable", "d2h-pinned", "d2h-pageable",
              "pickle-shm", "msgpack-shm", "shm", "zmq"),
    reference="pickle-shm",
    ceiling="h2d-pinned",
    payload_device="cuda:0",
    recv_device="cuda:0",
    needs_cuda=True,
)
