"""The conformance suite against the ``nixl`` backend, over UCX on loopback: ``tcp``
(``UCX_TLS=tcp``, control channel on tcp), ``cma`` (``UCX_TLS=cma,tcp``: the bytes go by
``process_vm_writev``, control channel on ipc) and one ``dual`` connector as both ends.

UCX reads ``UCX_TLS`` when an agent starts, so each factory sets it before it opens
its pair. Skipped with the reason where NIXL is not installed.
"""

from __future__ import annotations

import os

import pytest

import omnilink
from omnilink.connectors import backend_unavailable
from omnilink.testing import CHECKS, check_connector
from tests.nixl_pair import ucx_tls

_REASON = backend_unavailable("nixl")
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"nixl backend unavailable: {_REASON}")


def _pair(channel: str, tls: str, **options):
    os.environ["UCX_TLS"] = ucx_tls(tls)
    rx = omnilink.connect("nixl", channel=channel, role="receiver", pool_bytes=80 << 20, **options)
    try:
        if "endpoint" in options:
            options = {**options, "endpoint": rx.endpoint}
        tx = omnilink.connect("nixl", channel=channel, role="sender", **options)
    except BaseException:
        rx.close()
        raise
    return tx, rx


def over_tcp(channel: str):
    return _pair(channel, "tcp", endpoint="tcp://127.0.0.1:*")


def over_cma(channel: str):
    return _pair(channel, "cma,tcp")


def one_dual(channel: str):
    os.environ["UCX_TLS"] = ucx_tls("cma,tcp")
    conn = omnilink.connect("nixl", channel=channel, role="dual", pool_bytes=24 << 20)
    return conn, conn


FACTORIES = {"tcp": over_tcp, "cma": over_cma, "dual": one_dual}
HUGE = {"tcp": 16 << 20, "cma": 64 << 20, "dual": 8 << 20}


@pytest.fixture(autouse=True)
def _restore_ucx_tls():
    old = os.environ.get("UCX_TLS")
    yield
    if old is None:
        os.environ.pop("UCX_TLS", None)
    else:
        os.environ["UCX_TLS"] = old


@pytest.mark.parametrize("factory", list(FACTORIES))
@pytest.mark.parametrize("check", list(CHECKS))
def test_nixl_conformance(check, factory):
    assert check_connector(FACTORIES[factory], only=[check], huge_bytes=HUGE[factory]) == [check]
