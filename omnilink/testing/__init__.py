"""A public, pytest-free conformance suite for omnilink connectors.

Any backend, built-in or third-party, proves it keeps the ``Connector`` contract by
running the suite against a factory that opens a (sender, receiver) pair::

    import omnilink
    from omnilink.testing import check_connector

    def open_pair(channel):
        tx = omnilink.connect("shm", channel=channel, role="sender")
        rx = omnilink.connect("shm", channel=channel, role="receiver")
        return tx, rx

    check_connector(open_pair)                    # raises ConformanceError on failure
    check_connector(open_pair, only=["discard"])  # or run a few checks by name

With pytest, one test per check::

    @pytest.mark.parametrize("check", list(CHECKS))
    def test_conformance(check):
        check_connector(open_pair, only=[check])

``payload_zoo()`` and ``assert_payload_equal`` are the suite's payloads and its
bit-for-bit comparison, usable on their own (e.g. to test a codec).
"""

from __future__ import annotations

from omnilink.testing._checks import CHECKS, PairFactory, check_connector
from omnilink.testing._zoo import ConformanceError, assert_payload_equal, payload_zoo

__all__ = [
    "CHECKS",
    "ConformanceError",
    "PairFactory",
    "assert_payload_equal",
    "check_connector",
    "payload_zoo",
]
