"""``shm-vs-pickle``, the default scenario: same-host CPU transfer between two processes.

omnilink ``shm`` and ``zmq`` beside what serving engines do today (pickle over a fresh
shared-memory segment), msgpack over shared memory, ``torch.multiprocessing`` queues,
and one host ``memcpy`` (the ceiling).
"""

from __future__ import annotations

from omnilink._bench.scenarios.base import Scenario

SCENARIO = Scenario(
    name="shm-vs-pickle",
    description="same-host CPU transfer between two processes",
    backends=("memcpy", "pickle-shm", "msgpack-shm", "torch-mp-queue", "shm", "zmq"),
    reference="pickle-shm",
    ceiling="memcpy",
)
