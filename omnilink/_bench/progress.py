"""A one-line progress indicator on stderr (only on a terminal, and not with --quiet)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``Progress(enabled=...)(done, total, label)`` redraws ``[ 3/60  12s] label``.

    Disabled it does nothing, so callers need no conditionals. ``close()`` erases the
    line so the table that follows starts clean.
    """

    def __init__(self, *, enabled: bool, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self._start = time.monotonic()
        self._drawn = False

    @classmethod
    def for_terminal(cls, *, quiet: bool) -> Progress:
        """Enabled only when stderr is a terminal and ``quiet`` is false."""
        try:
            tty = sys.stderr.isatty()
        except (AttributeError, ValueError):
            tty = False
        return cls(enabled=tty and not quiet)

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.enabled:
            return
        width = len(str(total))
        elapsed = time.monotonic() - self._start
        bar_len = 20
        filled = bar_len * done // total if total else bar_len
        bar = "#" * filled + "." * (bar_len - filled)
        self.stream.write(f"\r\x1b[K[{bar}] {done:>{width}}/{total} {elapsed:4.0f}s  {label}")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False
