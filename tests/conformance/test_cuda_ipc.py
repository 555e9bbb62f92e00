"""The public conformance suite against the ``cuda_ipc`` backend's control plane.

On a CPU-only machine the backend runs over its host-memory test double
(``tests.cuda_ipc_double``): every tensor of the suite's payloads takes the pool path
(pool allocation, event slots, manifests, views, frees). The same suite runs on real
GPUs with CUDA payloads in ``tests/gpu/test_cuda_ipc_gpu.py``.
"""

from __future__ import annotations

import pytest

from omnilink.testing import CHECKS, check_connector
from tests.cuda_ipc_double import HostCudaIpc


def sender_receiver(channel: str):
    rx = HostCudaIpc(channel=channel, role="receiver", pool_bytes=80 << 20)
    try:
        tx = HostCudaIpc(channel=channel, role="sender", linger=0)
    except BaseException:
        rx.close()
        raise
    return tx, rx


def one_dual(channel: str):
    conn = HostCudaIpc(channel=channel, role="dual", pool_bytes=24 << 20, linger=0)
    return conn, conn


FACTORIES = {"sender_receiver": sender_receiver, "dual": one_dual}
HUGE = {"sender_receiver": 64 << 20, "dual": 8 << 20}


@pytest.mark.parametrize("factory", list(FACTORIES))
@pytest.mark.parametrize("check", list(CHECKS))
def test_cuda_ipc_conformance(check, factory):
    assert check_connector(FACTORIES[factory], only=[check], huge_bytes=HUGE[factory]) == [check]
