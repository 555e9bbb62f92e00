"""The conformance suite against the ``zmq`` backend: over ipc, over tcp on loopback,
and with one ``dual`` connector as both ends (it binds the channel and sends to it).

Every ipc socket lives in a private directory made for this module; the module checks
that nothing is left in it once every connector is closed.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

import omnilink
from omnilink.testing import CHECKS, check_connector

pytest.importorskip("zmq")

_IPC_DIR: str | None = None


@pytest.fixture(scope="module", autouse=True)
def ipc_dir():
    global _IPC_DIR
    # Short, private (mkdtemp makes it 0700), and not pytest's tmp_path: ipc paths are
    # limited to 107 bytes.
    _IPC_DIR = tempfile.mkdtemp(prefix="olzc-")
    try:
        yield _IPC_DIR
        left = os.listdir(_IPC_DIR)
        assert not left, f"zmq connectors left files behind: {left}"
    finally:
        shutil.rmtree(_IPC_DIR, ignore_errors=True)
        _IPC_DIR = None


def _pair(channel: str, **options):
    rx = omnilink.connect("zmq", channel=channel, role="receiver", **options)
    try:
        if "endpoint" in options:
            options = {**options, "endpoint": rx.endpoint}
        tx = omnilink.connect("zmq", channel=channel, role="sender", **options)
    except BaseException:
        rx.close()
        raise
    return tx, rx


def over_ipc(channel: str):
    return _pair(channel, ipc_dir=_IPC_DIR)


def over_tcp(channel: str):
    return _pair(channel, endpoint="tcp://127.0.0.1:*")


def one_dual(channel: str):
    conn = omnilink.connect("zmq", channel=channel, role="dual", ipc_dir=_IPC_DIR)
    return conn, conn


FACTORIES = {"ipc": over_ipc, "tcp": over_tcp, "dual": one_dual}


@pytest.mark.parametrize("factory", list(FACTORIES))
@pytest.mark.parametrize("check", list(CHECKS))
def test_zmq_conformance(check, factory):
    huge = (64 << 20) if factory == "ipc" else (16 << 20)
    assert check_connector(FACTORIES[factory], only=[check], huge_bytes=huge) == [check]
