"""Notice requests that keep received payloads (and so arena blocks) for a long time.

A received payload's tensors are views of the sender's shared-memory arena; its block
goes back only when the last view dies. Engines keep a request's inputs for its
lifetime, which is fine, but a request that never finishes (or a reference kept by
mistake) holds its blocks forever and makes the sender's arena grow up to its
``max_bytes``. Once per sweep the adapter asks each receiving edge which payloads this
process still views (``ShmConnector.held``) and logs a warning, once per request, for a
request that has held one longer than ``hold_warn_s`` seconds.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Iterable

from omnilink.integrations.vllm_omni.index import _request_of

__all__: list[str] = []

logger = logging.getLogger(__name__)

#: Requests remembered as already reported (oldest forgotten first).
_MAX_WARNED = 4096


class _HoldWatch:
    """Logs once per request that has held received blocks longer than ``threshold`` s."""

    __slots__ = ("threshold", "warned")

    def __init__(self, threshold: float | None) -> None:
        self.threshold = threshold
        self.warned: OrderedDict[str, None] = OrderedDict()

    def check(self, edges: Iterable[tuple[str, str, Any]]) -> int:
        """Look at ``(channel, from_stage, connector)`` receiving edges; return how many
        requests were reported now."""
        if self.threshold is None:
            return 0
        reported = 0
        for channel, src, conn in edges:
            held = getattr(conn, "held", None)
            if held is None:  # a backend whose payloads own their memory
                continue
            try:
                entries = held()
            except Exception:  # a closed edge: nothing to watch
                continue
            for key, nbytes, age in entries:
                if age < self.threshold:
                    continue
                rid = _request_of(key, src)[0]
                if rid in self.warned:
                    continue
                self.warned[rid] = None
                if len(self.warned) > _MAX_WARNED:
                    self.warned.popitem(last=False)
                reported += 1
                logger.warning(
                    "OmnilinkConnector: request %r has held %d bytes of a received payload (key %r on "
                    "channel %r) for %.0f s (hold_warn_s=%g); its arena block goes back only when the "
                    "last view of it is dropped, so the sender's arena grows meanwhile",
                    rid, nbytes, key, channel, age, self.threshold,
                )
        return reported
