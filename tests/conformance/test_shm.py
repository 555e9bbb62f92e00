"""The public conformance suite against the ``shm`` backend.

Three ways to open a pair, each running every check: a sender and a receiver in one
process; one ``dual`` connector used for both ends; and a sender whose arena is smaller
than the suite's huge payload, so that payload goes through an overflow segment.
"""

from __future__ import annotations

import pytest

import omnilink
from omnilink.testing import CHECKS, check_connector


def _pair(channel: str, **sender_options):
    tx = omnilink.connect("shm", channel=channel, role="sender", **sender_options)
    try:
        rx = omnilink.connect("shm", channel=channel, role="receiver")
    except BaseException:
        tx.close()
        raise
    return tx, rx


def sender_receiver(channel: str):
    return _pair(channel, arena_bytes=96 << 20)


def one_dual(channel: str):
    conn = omnilink.connect("shm", channel=channel, role="dual", arena_bytes=32 << 20)
    return conn, conn


def small_arena(channel: str):
    return _pair(channel, arena_bytes=4 << 20)


FACTORIES = {"sender_receiver": sender_receiver, "dual": one_dual, "small_arena": small_arena}
HUGE = {"sender_receiver": 64 << 20, "dual": 8 << 20, "small_arena": 8 << 20}


@pytest.mark.parametrize("factory", list(FACTORIES))
@pytest.mark.parametrize("check", list(CHECKS))
def test_shm_conformance(check, factory):
    assert check_connector(FACTORIES[factory], only=[check], huge_bytes=HUGE[factory]) == [check]
