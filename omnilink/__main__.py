"""``python -m omnilink`` is the ``omnilink`` console script."""

from __future__ import annotations

from omnilink.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
