"""What the two ends of a device pool share inside one process: the same-process
shortcuts, and the heartbeat thread each end runs.

A process cannot open its own CUDA IPC handles, so a sender whose receiver lives in the
same process (``role="dual"``, two connectors of one process, or a shm connector's
device-IPC route with both ends here) uses the receiver's pointer and the sender's
events directly, found here by the directory's name.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

__all__ = ["LOCAL_EVENTS", "LOCAL_POOLS", "LOCAL_SENDERS", "local_lock", "start_heartbeat"]

logger = logging.getLogger(__name__)

#: (directory name, segment) -> the device pointer of that pool segment (receiver side)
LOCAL_POOLS: dict[tuple[str, int], int] = {}
#: (directory name, sender generation) -> the sender's event objects
LOCAL_EVENTS: dict[tuple[str, int], list[Any]] = {}
#: directories an end of this process is attached to as the sender
LOCAL_SENDERS: set[str] = set()
local_lock = threading.Lock()


def start_heartbeat(owner: Any, stop: threading.Event, name: str, period: float, beat: str) -> threading.Thread:
    """A daemon thread calling ``owner.<beat>()`` every ``period`` s until ``stop`` is set."""
    t = threading.Thread(target=_heartbeat_loop, args=(weakref.ref(owner), stop, period, beat), name=name,
                         daemon=True)
    t.start()
    return t


def _heartbeat_loop(ref: Any, stop: threading.Event, period: float, beat: str) -> None:
    """Call ``beat`` on the end every ``period`` s until ``stop``; holds it only weakly
    (and only during a beat), so the thread never keeps it alive."""
    while not stop.wait(period):
        end = ref()
        if end is None:
            return
        try:
            getattr(end, beat)()
        except Exception:  # pragma: no cover - keep the heartbeat alive
            logger.debug("cuda_ipc: heartbeat %s failed", beat, exc_info=True)
        del end
