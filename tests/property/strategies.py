"""Every Hypothesis strategy the suite uses, in one place (like attrs' tests/strategies.py).

- Payload trees and tensors for the tensor_blob codec: ``payloads``, ``torch_tensors``,
  ``numpy_arrays``, ``leaves`` (``_payload_strategies``).
- Chunk framing: frame counts, chunk sizes, left context, ramps, finish modes and
  preemption points (``_chunk_strategies``).
"""

from __future__ import annotations

from tests.property._payload_strategies import *  # noqa: F403
from tests.property._payload_strategies import __all__ as _payload_all

try:
    from tests.property._chunk_strategies import *  # noqa: F403
    from tests.property._chunk_strategies import __all__ as _chunk_all
except ImportError:  # pragma: no cover - only while chunking is being written
    _chunk_all = []

__all__ = [*_payload_all, *_chunk_all]
