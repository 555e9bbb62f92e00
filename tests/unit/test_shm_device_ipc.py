"""The shm backend's device-IPC options where there is no GPU: validation, the "on"
receiver's clear error, and that nothing changes for host payloads."""

from __future__ import annotations

import uuid

import pytest

import omnilink
from omnilink.connectors.cuda_ipc import cuda_ipc_unavailable


def _chan() -> str:
    return f"t/ipcu-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("options", [{"device_ipc": "yes"}, {"device_ipc": True}, {"ipc_pool_bytes": 1024},
                                     {"ipc_pool_bytes": 2.5}, {"ipc_min_bytes": -1}, {"ipc_min_bytes": True}])
def test_bad_device_ipc_options(options):
    with pytest.raises(omnilink.ConfigurationError):
        omnilink.connect("shm", channel=_chan(), role="receiver", **options)


@pytest.mark.skipif(cuda_ipc_unavailable() is None, reason="this machine can open a device pool")
def test_on_receiver_without_cuda_says_why():
    with pytest.raises(omnilink.CudaError, match="device_ipc='on'"):
        omnilink.connect("shm", channel=_chan(), role="receiver", device_ipc="on")


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_host_payloads_are_untouched_by_the_mode(mode):
    torch = pytest.importorskip("torch")
    ch = _chan()
    with omnilink.connect("shm", channel=ch, role="sender", linger=0, device_ipc=mode) as tx, \
            omnilink.connect("shm", channel=ch, role="receiver", device_ipc="auto") as rx:
        tx.put("k", {"x": torch.arange(10), "m": "meta"}, timeout=5)
        got = rx.get("k", timeout=5)
        assert torch.equal(got["x"], torch.arange(10)) and got["m"] == "meta"
        assert tx.stats().ipc_puts == 0 and rx.stats().ipc_gets == 0
