"""Compiled checks of payload trees: the source of one ``match(p)`` function per payload
shape, shared by the device pool's send plans and the nccl backend's templates.

A stage sends the same dict of the same tensors chunk after chunk, with other scalars.
Walking each payload generically costs more than the copy of a small one, so a shape
seen again is compiled into a function that checks a payload against it with straight
line code (its dict keys in order, the type of every leaf, whatever its caller checks
of each tensor) and returns the tree with its scalars and the tensors picked out, or
``None`` at the first difference.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["PLAIN_LEAVES", "TreeSource", "Unmatchable", "tuple_expr"]

#: Leaves a compiled tree may hold besides tensors: what msgpack gives back as the same
#: type.
PLAIN_LEAVES = frozenset((str, int, float, bool, type(None)))


class Unmatchable(Exception):
    """The payload is not of a shape a matcher is compiled for."""


class TreeSource:
    """The lines of one ``match(p)`` function and the names they use.

    ``ns``: the function's globals; ``_L`` (``PLAIN_LEAVES``) is added. ``max_vars``:
    most local names the function may hold (``Unmatchable`` past it), or ``None``.
    ``lists``: a list in the tree is matched by its length and its items (else a list
    is ``Unmatchable``)."""

    def __init__(self, ns: dict[str, Any], max_vars: int | None = None, *, lists: bool = False) -> None:
        ns["_L"] = PLAIN_LEAVES
        self.ns = ns
        self.lines: list[str] = []
        self.max_vars = max_vars
        self.lists = lists
        self._vars = 0
        self._consts = 0

    def var(self) -> str:
        """A new local name."""
        self._vars += 1
        if self.max_vars is not None and self._vars > self.max_vars:
            raise Unmatchable
        return f"v{self._vars}"

    def const(self, value: Any) -> str:
        """A global name holding ``value``."""
        name = f"c{self._consts}"
        self._consts += 1
        self.ns[name] = value
        return name

    def line(self, text: str) -> None:
        """One statement of the function's body."""
        self.lines.append(f"    {text}")

    def node(self, x: dict[Any, Any], name: str, path: tuple[Any, ...],
             entry: Callable[[Any, str, tuple[Any, ...]], str | None]) -> str:
        """The checks of dict ``x`` (held in local ``name`` at ``path``) and of its
        children, and the expression of its part of the returned tree. ``entry(v, c,
        p)`` handles each value ``v`` (held in ``c``, at ``p``) first: its expression,
        or ``None`` for the default (a dict, or a list with ``lists``: walked; a plain
        leaf: its type checked and kept; anything else: ``Unmatchable``)."""
        keys = tuple(x)
        if not all(type(k) is str for k in keys):
            raise Unmatchable
        self.line(f"if type({name}) is not dict or tuple({name}) != {self.const(keys)}: return None")
        parts = []
        for k in keys:
            c = self.var()
            self.line(f"{c} = {name}[{k!r}]")
            parts.append(f"{k!r}: {self._value(x[k], c, (*path, k), entry)}")
        return "{" + ", ".join(parts) + "}"

    def items(self, x: list[Any], name: str, path: tuple[Any, ...],
              entry: Callable[[Any, str, tuple[Any, ...]], str | None]) -> str:
        """``node`` for list ``x`` (``lists`` only): its length and each item checked;
        an item's path step is its index."""
        self.line(f"if type({name}) is not list or len({name}) != {len(x)}: return None")
        parts = []
        for i, v in enumerate(x):
            c = self.var()
            self.line(f"{c} = {name}[{i}]")
            parts.append(self._value(v, c, (*path, i), entry))
        return "[" + "".join(f"{e}, " for e in parts) + "]"

    def _value(self, v: Any, c: str, p: tuple[Any, ...],
               entry: Callable[[Any, str, tuple[Any, ...]], str | None]) -> str:
        expr = entry(v, c, p)
        if expr is not None:
            return expr
        if type(v) in PLAIN_LEAVES:
            self.line(f"if type({c}) not in _L: return None")
            return c
        if type(v) is dict:
            return self.node(v, c, p, entry)
        if type(v) is list and self.lists:
            return self.items(v, c, p, entry)
        raise Unmatchable

    def compile(self, filename: str) -> Any:
        """The function ``match(p)``."""
        source = "def match(p):\n" + "\n".join(self.lines) + "\n"
        exec(compile(source, filename, "exec"), self.ns)  # noqa: S102 - our own source, keys by repr()
        return self.ns["match"]


def tuple_expr(names: list[str]) -> str:
    """The source of a tuple of the locals ``names``."""
    return "(" + "".join(f"{n}, " for n in names) + ")"
