"""The conformance suite against the in-process ``memory`` backend.

Three ways to open a pair, each running every check: a sender and a receiver, one
``dual`` connector used for both ends, and a capacity-bounded channel (backpressure on,
but roomy enough for the suite's payloads).
"""

from __future__ import annotations

import pytest

import omnilink
from omnilink.testing import CHECKS, check_connector


def sender_receiver(channel: str):
    tx = omnilink.connect("memory", channel=channel, role="sender")
    try:
        rx = omnilink.connect("memory", channel=channel, role="receiver")
    except BaseException:
        tx.close()
        raise
    return tx, rx


def one_dual(channel: str):
    conn = omnilink.connect("memory", channel=channel, role="dual")
    return conn, conn


def bounded(channel: str):
    tx = omnilink.connect("memory", channel=channel, role="sender", capacity_bytes=96 << 20)
    try:
        rx = omnilink.connect("memory", channel=channel, role="receiver")
    except BaseException:
        tx.close()
        raise
    return tx, rx


FACTORIES = {"sender_receiver": sender_receiver, "dual": one_dual, "bounded": bounded}


@pytest.mark.parametrize("factory", list(FACTORIES))
@pytest.mark.parametrize("check", list(CHECKS))
def test_memory_conformance(check, factory):
    from omnilink.connectors import memory

    huge = (64 << 20) if factory == "sender_receiver" else (8 << 20)
    assert check_connector(FACTORIES[factory], only=[check], huge_bytes=huge) == [check]
    # The suite closed every connector it opened, so none of its channels is left.
    assert not [name for name in memory._channels if name.startswith("olconf/")]
