"""Progress on stderr: a redrawn line on a terminal, plain lines otherwise (CI logs).

Nothing is written with ``--quiet``.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``Progress(enabled=..., redraw=...)(done, total, label)`` reports one step.

    With ``redraw`` (a terminal) the call redraws ``[####....] 3/60   12s  label`` in
    place and ``close()`` erases it so the table that follows starts clean. Without it
    (stderr is a pipe or a file, as under CI) each call that moves on writes one line
    ``omnilink bench: [ 3/60   12s] label``, so a long run is never silent. Disabled it
    does nothing, so callers need no conditionals.
    """

    def __init__(self, *, enabled: bool, redraw: bool = True, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.redraw = redraw
        self._start = time.monotonic()
        self._drawn = False
        self._last_line: tuple[int, str] | None = None

    @classmethod
    def for_terminal(cls, *, quiet: bool) -> Progress:
        """Enabled unless ``quiet``; redrawn in place only when stderr is a terminal."""
        try:
            tty = sys.stderr.isatty()
        except (AttributeError, ValueError):
            tty = False
        return cls(enabled=not quiet, redraw=tty)

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.enabled:
            return
        width = len(str(total))
        elapsed = time.monotonic() - self._start
        if not self.redraw:
            if self._last_line == (done, label):
                return
            self._last_line = (done, label)
            self.stream.write(f"omnilink bench: [{done:>{width}}/{total} {elapsed:4.0f}s] {label}\n")
            self.stream.flush()
            return
        bar_len = 20
        filled = bar_len * done // total if total else bar_len
        bar = "#" * filled + "." * (bar_len - filled)
        self.stream.write(f"\r\x1b[K[{bar}] {done:>{width}}/{total} {elapsed:4.0f}s  {label}")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self.enabled and self.redraw and self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False
