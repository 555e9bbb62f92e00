"""The typed ``connect`` overloads name exactly the options each built-in backend takes."""

from __future__ import annotations

import inspect
import re
import typing

import pytest

import omnilink
from omnilink.connectors import backend_factory


@pytest.mark.skipif(not hasattr(typing, "get_overloads"), reason="typing.get_overloads needs Python 3.11")
def test_overloads_match_backend_signatures():
    checked = 0
    for ov in typing.get_overloads(omnilink.connect):
        params = inspect.signature(ov).parameters
        first = next(iter(params.values()))  # the positional backend name
        backend = first.annotation
        m = re.fullmatch(r"Literal\[[\"'](\w+)[\"']\]", backend) if isinstance(backend, str) else None
        if m is None:
            continue
        name = m.group(1)
        factory = backend_factory(name)
        want = {p.name for p in inspect.signature(factory).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
        have = {p.name for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
        assert have == want, f"connect overload for {name!r}: {sorted(have ^ want)} differ from {factory.__name__}"
        checked += 1
    assert checked >= 4
