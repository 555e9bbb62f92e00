"""The public surface: __all__ sorted and complete, the error tree as documented."""

from __future__ import annotations

import types

import omnilink
from omnilink import _errors


def test_all_is_sorted_and_complete():
    assert omnilink.__all__ == sorted(omnilink.__all__)
    public = {
        name
        for name, value in vars(omnilink).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType) and name != "annotations"
    }
    assert public == set(omnilink.__all__), public ^ set(omnilink.__all__)
    for name in omnilink.__all__:
        assert hasattr(omnilink, name)


def test_error_tree():
    e = omnilink
    assert issubclass(e.TransferTimeout, e.TransportError) and issubclass(e.TransferTimeout, TimeoutError)
    assert issubclass(e.PeerLostError, e.TransportError) and issubclass(e.PeerLostError, ConnectionError)
    assert issubclass(e.ClosedError, e.TransportError)
    assert issubclass(e.ConfigurationError, e.OmnilinkError) and issubclass(e.ConfigurationError, ValueError)
    assert issubclass(e.BlobVersionError, e.BlobDecodeError)
    assert issubclass(e.CudaError, RuntimeError)
    for name in _errors.__all__:
        cls = getattr(_errors, name)
        assert issubclass(cls, e.OmnilinkError)
        assert name in _errors.__doc__, f"{name} is missing from the tree drawn in the docstring"
    t = e.TransferTimeout("x", channel="c", key="k", peer="p")
    assert (t.channel, t.key, t.peer) == ("c", "k", "p")
